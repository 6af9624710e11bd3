"""torch.library ops of the group quantizer: schemas, fake kernels and one kernel per device.

``fewbit::group_quantize(x, bits, group_size, seed, stochastic, stats_dtype)
-> (packed, mins, scales)`` and ``fewbit::group_dequantize(packed, mins, scales, bits,
group_size, numel, dtype) -> x_hat`` take a flat contiguous input. Backends, one rule for
both op families (docs/kernels.md):

- ``cpu``: numba (:mod:`fewbit.quant._cpu`); float16/bfloat16 read through a float32 copy;
- ``cuda``: Triton (:mod:`fewbit.quant._triton`, ``torch.library.triton_op``s) for
  float16/bfloat16/float32, the torch reference for float64 (Triton has no ``frexp`` for
  the float64 stats rounding);
- ``Meta`` and fake tensors: the fake kernels;
- any other device: the pure-torch reference (:mod:`fewbit.quant._reference`).

User arguments are validated by the public functions of :mod:`fewbit.quant`; the ops check
theirs through ``torch._check_*``, also in the fake kernels (as :mod:`fewbit.ops._ops`).
Importing this module does not import numba or triton.
"""

from __future__ import annotations

import torch

from fewbit._checks import FLOAT_DTYPES, packed_nbytes
from fewbit.ops._ops import trace_into_triton
from fewbit.quant import _reference as ref

__all__ = ["group_quantize", "group_dequantize"]

def _check_args(bits: int, group_size: int, dtype: torch.dtype) -> None:
    # as fewbit.ops._ops: a failed check raises through torch._check_value / torch._check_type
    if bits not in ref.SUPPORTED_BITS:
        torch._check_value(False, lambda: f"bits must be one of {ref.SUPPORTED_BITS}, got {bits}")
    if group_size < 1:
        torch._check_value(False, lambda: f"group_size must be >= 1, got {group_size}")
    if dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"dtype must be a floating-point dtype, got {dtype}")


@torch.library.custom_op("fewbit::group_quantize", mutates_args=())
def group_quantize(
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool,
    stats_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default kernel (devices without their own backend): the pure-torch reference."""
    _check_args(bits, group_size, x.dtype)
    return ref.group_quantize_reference(x, bits, group_size, seed, stochastic, stats_dtype)


@group_quantize.register_fake
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype)
    n = x.numel()
    g = (n + group_size - 1) // group_size
    return (
        x.new_empty((packed_nbytes(n, bits),), dtype=torch.uint8),
        x.new_empty((g,), dtype=stats_dtype),
        x.new_empty((g,), dtype=stats_dtype),
    )


@group_quantize.register_kernel("cpu")
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype)
    from fewbit.quant import _cpu

    return _cpu.quantize_cpu(x, bits, group_size, seed, stochastic, stats_dtype)


@group_quantize.register_kernel("cuda")
def _group_quantize_cuda(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype)
    if x.dtype == torch.float64 or x.numel() == 0:
        return ref.group_quantize_reference(x, bits, group_size, seed, stochastic, stats_dtype)
    from fewbit.quant import _triton  # noqa: F401  (registers fewbit::group_*_triton)

    return torch.ops.fewbit.group_quantize_triton(x, bits, group_size, seed, stochastic, stats_dtype)


@torch.library.custom_op("fewbit::group_dequantize", mutates_args=())
def group_dequantize(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    numel: int, dtype: torch.dtype,
) -> torch.Tensor:
    """Default kernel (devices without their own backend): the pure-torch reference."""
    _check_args(bits, group_size, dtype)
    return ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype)


@group_dequantize.register_fake
def _(packed, mins, scales, bits, group_size, numel, dtype):
    _check_args(bits, group_size, dtype)
    return packed.new_empty((numel,), dtype=dtype)


@group_dequantize.register_kernel("cpu")
def _(packed, mins, scales, bits, group_size, numel, dtype):
    _check_args(bits, group_size, dtype)
    from fewbit.quant import _cpu

    return _cpu.dequantize_cpu(packed, mins, scales, bits, group_size, numel, dtype)


@group_dequantize.register_kernel("cuda")
def _group_dequantize_cuda(packed, mins, scales, bits, group_size, numel, dtype):
    _check_args(bits, group_size, dtype)
    if dtype == torch.float64 or numel == 0:
        return ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype)
    from fewbit.quant import _triton  # noqa: F401  (registers fewbit::group_*_triton)

    return torch.ops.fewbit.group_dequantize_triton(packed, mins, scales, bits, group_size, numel, dtype)


trace_into_triton(group_quantize, _group_quantize_cuda)
trace_into_triton(group_dequantize, _group_dequantize_cuda)
