"""Few-bit activation modules: drop-in replacements for the ``torch.nn`` activations.

Each class subclasses its ``torch.nn`` twin (so ``isinstance(m, torch.nn.GELU)`` still
holds), takes the same constructor arguments plus keyword-only ``bits``, and its
``forward`` is one call into :mod:`fewbit.functional`: forward output equals torch's bit
for bit, backward keeps a ``bits``-bit code per element (Novikov et al., "Few-bit
Backward", ICML 2023). The modules hold no parameters or buffers (nothing in
``state_dict``), and pickle and deep-copy like their torch twins.

Stepwise functions (ReLU, LeakyReLU, ReLU6, Hardtanh, Threshold, Hardshrink, Softshrink,
Hardsigmoid) default to ``bits=1``: their 1-bit table is exact, and larger ``bits`` still
use it. :class:`QuickGELU` has no ``torch.nn`` twin; :class:`FewBitActivation` wraps any
elementwise function with any table.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import torch
from torch import nn

from fewbit import functional as FF
from fewbit._checks import check_bits
from fewbit.activations import checked_params, get_formula
from fewbit.resolve import resolve_fn, table_argument
from fewbit.table import Table

__all__ = [
    # smooth (fitted tables)
    "GELU", "SiLU", "SELU", "ELU", "CELU", "Mish", "Softplus", "Sigmoid", "Tanh",
    "LogSigmoid", "Softsign", "Tanhshrink", "Hardswish", "QuickGELU",
    # stepwise (exact 1-bit tables)
    "ReLU", "LeakyReLU", "ReLU6", "Hardtanh", "Threshold", "Hardshrink", "Softshrink",
    "Hardsigmoid",
    # Hugging Face formulas, bit for bit
    "FormulaActivation",
    # generic
    "FewBitActivation",
]


class _FewBit:
    """Mixin: stores and shows ``bits``."""

    bits: int

    def _init_bits(self, bits: int) -> None:
        self.bits = check_bits(bits)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, bits={self.bits}" if base else f"bits={self.bits}"


# The modules whose torch twin takes no argument, only ``inplace``, or ``alpha`` and
# ``inplace`` differ only in the function they call: these bases hold their constructor and
# forward, and each class names its function (``_fn``). The class statements below then
# repeat one three-line shape on purpose: each module is a real class (isinstance of its
# torch twin, pickling by name, IDE completion, its own docstring), not made by a factory.
# The modules with other parameters spell out their constructor and forward.


class _NoArgs(_FewBit):
    """Base of modules whose torch twin takes no argument: ``__init__(*, bits=3)``."""

    _fn: Callable[..., torch.Tensor]

    def __init__(self, *, bits: int = 3) -> None:
        super().__init__()
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._fn(input, bits=self.bits)


class _InplaceOnly(_FewBit):
    """Base of modules whose torch twin takes only ``inplace``: ``__init__(inplace=False, *, bits=3)``."""

    _fn: Callable[..., torch.Tensor]

    def __init__(self, inplace: bool = False, *, bits: int = 3) -> None:
        super().__init__(inplace)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._fn(input, self.inplace, bits=self.bits)


class _AlphaInplace(_FewBit):
    """Base of modules whose torch twin takes ``alpha`` and ``inplace`` (ELU, CELU)."""

    _fn: Callable[..., torch.Tensor]

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3) -> None:
        checked_params(self._fn.__name__, {"alpha": alpha})
        super().__init__(alpha, inplace)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._fn(input, self.alpha, self.inplace, bits=self.bits)


class _InplaceOnlyExact(_InplaceOnly):
    """:class:`_InplaceOnly` for stepwise functions: ``bits`` defaults to 1 (exact)."""

    def __init__(self, inplace: bool = False, *, bits: int = 1) -> None:
        super().__init__(inplace, bits=bits)


# --------------------------------------------------------------------------- smooth


class GELU(_FewBit, nn.GELU):
    """Few-bit :class:`torch.nn.GELU` (Novikov et al., "Few-bit Backward", ICML 2023, eq. 1-2).

    Forward equals ``nn.GELU`` bit for bit; backward is ``grad_output * values[code(x)]``
    (:func:`fewbit.functional.gelu`), torch's gradient at NaN/+-inf inputs, and raises
    ``RuntimeError`` if differentiated again (fitted table; stepwise modules support double
    backward exactly). The other modules here follow the same contract; ``inplace=True``
    on a ``Parameter`` raises before writing, as torch's modules do.

    Args:
        approximate: ``'none'`` or ``'tanh'``.
        bits: bits per element kept for backward, 1..8 (default 3), checked here.

    Shape: input ``(*)`` of a floating dtype (float16/bfloat16/float32/float64), output
    ``(*)`` of the same dtype; memory kept for backward ``ceil(numel * bits / 8)`` bytes.

    Raises:
        ValueError: at construction, for a bad ``approximate`` or ``bits`` not an integer
            in 1..8 ("bits must be ..., got X").
        TypeError: in forward, if the input is not a tensor (an integer or bool tensor
            goes to torch's function, as in the module it replaces).
    """

    def __init__(self, approximate: str = "none", *, bits: int = 3) -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        super().__init__(approximate)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.gelu(input, self.approximate, bits=self.bits)


class SiLU(_InplaceOnly, nn.SiLU):
    """Few-bit :class:`torch.nn.SiLU` (``bits`` default 3)."""

    _fn = staticmethod(FF.silu)


class SELU(_InplaceOnly, nn.SELU):
    """Few-bit :class:`torch.nn.SELU` (``bits`` default 3)."""

    _fn = staticmethod(FF.selu)


class ELU(_AlphaInplace, nn.ELU):
    """Few-bit :class:`torch.nn.ELU` (``bits`` default 3; non-default ``alpha``: own table)."""

    _fn = staticmethod(FF.elu)


class CELU(_AlphaInplace, nn.CELU):
    """Few-bit :class:`torch.nn.CELU` (``bits`` default 3; non-default ``alpha``: own table).

    Raises:
        ValueError: at construction, for ``alpha <= 0`` (for ``alpha < 0`` the derivative
            ``exp(x / alpha)`` is unbounded, which no table of levels approximates; torch
            refuses 0) or a non-finite ``alpha``.
    """

    _fn = staticmethod(FF.celu)


class Mish(_InplaceOnly, nn.Mish):
    """Few-bit :class:`torch.nn.Mish` (``bits`` default 3)."""

    _fn = staticmethod(FF.mish)


class Softplus(_FewBit, nn.Softplus):
    """Few-bit :class:`torch.nn.Softplus` (``bits`` default 3; non-default ``beta`` or
    ``threshold``: own table).

    Raises:
        ValueError: at construction, for ``beta == 0`` or a non-finite ``beta`` / ``threshold``.
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 3) -> None:
        checked_params("softplus", {"beta": beta, "threshold": threshold})
        super().__init__(beta, threshold)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.softplus(input, self.beta, self.threshold, bits=self.bits)


class Sigmoid(_NoArgs, nn.Sigmoid):
    """Few-bit :class:`torch.nn.Sigmoid` (``bits`` default 3)."""

    _fn = staticmethod(FF.sigmoid)


class Tanh(_NoArgs, nn.Tanh):
    """Few-bit :class:`torch.nn.Tanh` (``bits`` default 3)."""

    _fn = staticmethod(FF.tanh)


class LogSigmoid(_NoArgs, nn.LogSigmoid):
    """Few-bit :class:`torch.nn.LogSigmoid` (``bits`` default 3)."""

    _fn = staticmethod(FF.logsigmoid)


class Softsign(_NoArgs, nn.Softsign):
    """Few-bit :class:`torch.nn.Softsign` (``bits`` default 3)."""

    _fn = staticmethod(FF.softsign)


class Tanhshrink(_NoArgs, nn.Tanhshrink):
    """Few-bit :class:`torch.nn.Tanhshrink` (``bits`` default 3)."""

    _fn = staticmethod(FF.tanhshrink)


class Hardswish(_InplaceOnly, nn.Hardswish):
    """Few-bit :class:`torch.nn.Hardswish` (``bits`` default 3)."""

    _fn = staticmethod(FF.hardswish)


class QuickGELU(_NoArgs, nn.Module):
    """Few-bit QuickGELU, ``x * sigmoid(1.702 * x)`` (no ``torch.nn`` twin; matches
    Hugging Face ``QuickGELUActivation``). ``bits`` default 3."""

    _fn = staticmethod(FF.quick_gelu)


# --------------------------------------------------------------------------- stepwise


class ReLU(_InplaceOnlyExact, nn.ReLU):
    """Few-bit :class:`torch.nn.ReLU`: exact gradient from a 1-bit code."""

    _fn = staticmethod(FF.relu)


class LeakyReLU(_FewBit, nn.LeakyReLU):
    """Few-bit :class:`torch.nn.LeakyReLU`: exact gradient from a 1-bit code.

    Raises:
        ValueError: at construction, for a non-finite ``negative_slope``.
    """

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False, *, bits: int = 1) -> None:
        checked_params("leaky_relu", {"negative_slope": negative_slope})
        super().__init__(negative_slope, inplace)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.leaky_relu(input, self.negative_slope, self.inplace, bits=self.bits)


class Hardtanh(_FewBit, nn.Hardtanh):
    """Few-bit :class:`torch.nn.Hardtanh`: exact gradient from a 1-bit code.

    Raises:
        ValueError: at construction, if ``min_val >= max_val`` or either is not finite.
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *, bits: int = 1) -> None:
        checked_params("hardtanh", {"min_val": min_val, "max_val": max_val})
        super().__init__(min_val, max_val, inplace)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.hardtanh(input, self.min_val, self.max_val, self.inplace, bits=self.bits)


class ReLU6(_InplaceOnlyExact, nn.ReLU6):
    """Few-bit :class:`torch.nn.ReLU6`: exact gradient from a 1-bit code."""

    _fn = staticmethod(FF.relu6)


class Threshold(_FewBit, nn.Threshold):
    """Few-bit :class:`torch.nn.Threshold`: exact gradient from a 1-bit code.

    Raises:
        ValueError: at construction, for a non-finite ``threshold`` or ``value``.
    """

    def __init__(self, threshold: float, value: float, inplace: bool = False, *, bits: int = 1) -> None:
        checked_params("threshold", {"threshold": threshold, "value": value})
        super().__init__(threshold, value, inplace)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.threshold(input, self.threshold, self.value, self.inplace, bits=self.bits)


class Hardshrink(_FewBit, nn.Hardshrink):
    """Few-bit :class:`torch.nn.Hardshrink`: exact gradient from a 1-bit code.

    Raises:
        ValueError: at construction, for ``lambd < 0`` or a non-finite ``lambd``.
    """

    def __init__(self, lambd: float = 0.5, *, bits: int = 1) -> None:
        checked_params("hardshrink", {"lambd": lambd})
        super().__init__(lambd)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.hardshrink(input, self.lambd, bits=self.bits)


class Softshrink(_FewBit, nn.Softshrink):
    """Few-bit :class:`torch.nn.Softshrink`: exact gradient from a 1-bit code.

    Raises:
        ValueError: at construction, for ``lambd < 0`` or a non-finite ``lambd``.
    """

    def __init__(self, lambd: float = 0.5, *, bits: int = 1) -> None:
        checked_params("softshrink", {"lambd": lambd})
        super().__init__(lambd)
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.softshrink(input, self.lambd, bits=self.bits)


class Hardsigmoid(_InplaceOnlyExact, nn.Hardsigmoid):
    """Few-bit :class:`torch.nn.Hardsigmoid`: exact gradient from a 1-bit code."""

    _fn = staticmethod(FF.hardsigmoid)


# --------------------------------------------------------------------------- formulas


class FormulaActivation(_FewBit, nn.Module):
    """Few-bit Hugging Face activation formula, bit for bit (:data:`fewbit.activations.FORMULAS`).

    Forward is ``FORMULAS[name].torch_fn(input)``: the very expression the Hugging Face
    module evaluates (``NewGELUActivation`` for ``"gelu_new"``, ...), so a converted model's
    outputs are bit-identical to the original's. Backward is
    ``grad_output * values[code(input)]`` (Novikov et al., "Few-bit Backward", ICML 2023,
    eq. 1-2) with the shipped ``bits``-bit table of ``FORMULAS[name].table`` (``gelu_tanh``
    for the tanh formulas, ``gelu`` for ``gelu_python``); see
    :class:`fewbit.activations.Formula` for how close the formula's derivative is to that
    table's function. :func:`fewbit.convert_` creates these for the Hugging Face classes.

    Args:
        name: ``"gelu_new"``, ``"gelu_python_tanh"``, ``"gelu_accurate"``, ``"gelu_fast"``,
            ``"gelu_python"`` or ``"bloom_gelu"``.
        bits: bits per element kept for backward, 1..8 (default 3).

    Shape: input ``(*)`` of a floating dtype (float16/bfloat16/float32/float64), output
    ``(*)`` of the same dtype; memory kept for backward ``ceil(numel * bits / 8)`` bytes
    (the formula's intermediates are not kept).

    Raises:
        ValueError: at construction, for an unknown ``name`` or ``bits`` not in 1..8.
        TypeError: in forward, if the input is not a floating-point tensor.
    """

    def __init__(self, name: str, *, bits: int = 3) -> None:
        super().__init__()
        self.name = get_formula(name).name
        self._init_bits(bits)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # fewbit.functional.activation knows formula names: forward the formula, backward
        # the shared registry table (nothing fitted or copied); no table without grad.
        return FF.activation(input, self.name, bits=self.bits)

    def extra_repr(self) -> str:
        return f"{self.name!r}, bits={self.bits}"


# --------------------------------------------------------------------------- generic


class FewBitActivation(nn.Module):
    """Any elementwise activation with few-bit backward.

    Args:
        fn: a registry name (``"gelu"``), a ``"module:callable"`` string, or a picklable
            callable ``fn(input, **params)``.
        table: a :class:`~fewbit.table.Table` or a JSON table file; ``None`` resolves it
            with :func:`fewbit.functional.load_table` on first use.
        bits: bits per element, 1..8; ``None``: the table's, or the function's default.
        params: keyword parameters of ``fn``.

    Shape: input ``(*)``, output ``(*)``. The table (if given) is kept as a plain
    attribute, not a buffer: nothing goes into ``state_dict``.

    Raises:
        ValueError: for bits outside 1..8, or a table that does not match ``fn``.
    """

    def __init__(
        self,
        fn: str | Callable[..., torch.Tensor],
        *,
        table: Table | str | os.PathLike | None = None,
        bits: int | None = None,
        params: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__()
        if bits is not None:
            bits = check_bits(bits)
        resolved = resolve_fn(fn)
        full = resolved.full_params(params)
        if table is not None:
            table = table_argument(table, resolved, bits, full)
            bits = table.bits
        self.fn = fn
        self.table = table
        self.bits = bits
        self.params = full

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return FF.activation(input, self.fn, table=self.table, bits=self.bits, params=self.params)

    def extra_repr(self) -> str:
        name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))
        parts = [repr(name)]
        parts += [f"{k}={v:g}" for k, v in self.params.items()]
        parts.append(f"bits={self.bits if self.bits is not None else 'default'}")
        return ", ".join(parts)
