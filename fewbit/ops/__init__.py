"""fewbit.ops: kernels and the autograd op of few-bit activations.

Novikov et al., "Few-bit Backward: Quantized Gradients of Activation Functions for
Memory Footprint Reduction", ICML 2023 (docs/method.md §1, §2, §6).

Layers (Liger-Kernel / bitsandbytes / torchao style):

- ``torch.ops.fewbit.encode`` / ``encode_nonfinite`` / ``decode_mul``: ``torch.library``
  custom ops with fake kernels, vmap rules and one kernel per backend (CPU: numba, CUDA:
  Triton, other devices: the pure-torch reference); see :mod:`fewbit.ops._ops`.
- :func:`pointwise`: the autograd op (exact torch forward, packed codes saved; torch's
  gradient at NaN/+-inf inputs and torch's select for exact tables; double backward,
  ``torch.func`` grad/vjp/vmap).
- :func:`encode_reference` / :func:`decode_mul_reference` /
  :func:`nonfinite_record_reference` / :func:`patch_reference`: the pure-torch
  definitions every backend matches bit for bit (:mod:`fewbit.ops._nonfinite` for the
  non-finite inputs).

Importing this package imports neither numba nor triton and does not initialise CUDA.
Triton loads on the first CUDA kernel call; numba in a background thread started by the
first CPU kernel call, the reference kernels standing in until it is done
(:func:`load_cpu_kernels` waits for it; :mod:`fewbit.ops._cpu_loader`).
"""

from fewbit.ops._cpu_loader import load_cpu_kernels
from fewbit.ops._nonfinite import CAPACITY as NONFINITE_CAPACITY
from fewbit.ops._nonfinite import GradRules, derive_grad_rules, nonfinite_record_reference, patch_reference
from fewbit.ops._pointwise import decode_mul, encode, pointwise, table_tensors
from fewbit.ops._reference import (
    compute_dtype,
    decode_mul_reference,
    encode_reference,
    round_down_to_float32,
)

__all__ = [
    # autograd op
    "pointwise",
    # kernels (public for tests and benchmarks)
    "load_cpu_kernels",
    "encode",
    "decode_mul",
    "table_tensors",
    # torch's own backward rules (non-finite inputs, selects)
    "GradRules",
    "derive_grad_rules",
    "NONFINITE_CAPACITY",
    # pure-torch references
    "encode_reference",
    "decode_mul_reference",
    "nonfinite_record_reference",
    "patch_reference",
    "round_down_to_float32",
    "compute_dtype",
]
