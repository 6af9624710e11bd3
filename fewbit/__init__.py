"""fewbit: train neural networks with less memory.

Pointwise activations keep a b-bit code per element for backward instead of their
input (Novikov et al., "Few-bit Backward", ICML 2023); other layers' saved tensors can
be compressed by a group-wise stochastic quantizer (Chen et al., "ActNN", ICML 2021).

``import fewbit`` is lean: it imports torch but neither numba, scipy, triton nor the
offline solver, and it does not initialise CUDA. Public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_MODULE_CLASSES = [
    "GELU", "SiLU", "SELU", "ELU", "CELU", "Mish", "Softplus", "Sigmoid", "Tanh",
    "LogSigmoid", "Softsign", "Tanhshrink", "Hardswish", "QuickGELU", "ReLU", "LeakyReLU",
    "ReLU6", "Hardtanh", "Threshold", "Hardshrink", "Softshrink", "Hardsigmoid",
    "FormulaActivation", "FewBitActivation",
]

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    # Tables
    "Table": ("fewbit.table", "Table"),
    "load_table": ("fewbit.functional", "load_table"),
    # Functional API and modules
    "functional": ("fewbit.functional", None),
    **{name: ("fewbit.modules", name) for name in _MODULE_CLASSES},
    # Model conversion
    "convert": ("fewbit.convert", None),
    "Config": ("fewbit.convert", "Config"),
    "convert_": ("fewbit.convert", "convert_"),
    "ConversionSummary": ("fewbit.convert", "ConversionSummary"),
    # Group quantizer for other layers' saved tensors
    "quant": ("fewbit.quant", None),
    "compress_activations": ("fewbit.quant", "compress_activations"),
    "manual_seed": ("fewbit.quant", "manual_seed"),
    "get_rng_state": ("fewbit.quant", "get_rng_state"),
    "set_rng_state": ("fewbit.quant", "set_rng_state"),
    # Kernels (fewbit.ops.load_cpu_kernels)
    "ops": ("fewbit.ops", None),
    # Memory report
    "memory": ("fewbit.memory", None),
    # Fused linear + cross-entropy for language-model heads
    "losses": ("fewbit.losses", None),
    "linear_cross_entropy": ("fewbit.losses", "linear_cross_entropy"),
    # Memory-budget planner
    "planner": ("fewbit.planner", None),
    "plan": ("fewbit.planner", "plan"),
    "Plan": ("fewbit.planner", "Plan"),
}

__all__ = [
    "__version__",
    # tables
    "Table", "load_table",
    # functional API and modules
    "functional", *_MODULE_CLASSES,
    # conversion
    "convert", "Config", "convert_", "ConversionSummary",
    # saved-tensor compression
    "quant", "compress_activations", "manual_seed", "get_rng_state", "set_rng_state",
    # kernels, reporting
    "ops", "memory",
    # losses
    "losses", "linear_cross_entropy",
    # planner
    "planner", "plan", "Plan",
]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fewbit' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
