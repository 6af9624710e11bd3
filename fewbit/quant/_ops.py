"""torch.library ops of the group quantizer, one kernel per device.

``fewbit::group_quantize(x, bits, group_size, seed, stochastic, stats_dtype)
-> (packed, mins, scales)`` and ``fewbit::group_dequantize(packed, mins, scales, bits,
group_size, numel, dtype) -> x_hat`` take a flat contiguous input. Kernels:

- ``cpu``: numba (:mod:`fewbit.quant._numba`), float16/bfloat16 read through a float32 copy;
- ``cuda``: Triton (:mod:`fewbit.quant._triton`) for float16/bfloat16/float32 input, the
  torch reference for float64 (Triton has no ``frexp`` for the float64 stats rounding);
- any other device: NotImplementedError naming the devices that have a kernel.

Arguments are validated by the public functions in :mod:`fewbit.quant`; these ops assume
valid input. Importing this module does not import numba or triton.
"""

from __future__ import annotations

import torch

from fewbit.quant import _reference as ref

__all__ = ["group_quantize", "group_dequantize", "chunk_groups"]

# (significant bits, exponent of the smallest spacing, largest finite value) per stats dtype
_GRID = {
    torch.float32: (24, -149, float(torch.finfo(torch.float32).max)),
    torch.bfloat16: (8, -133, float(torch.finfo(torch.bfloat16).max)),
}


def chunk_groups(group_size: int, target: int = 16384) -> int:
    """Groups per parallel chunk of the CPU kernels: a multiple of ``8 / gcd(G, 8)`` (so a
    chunk holds a multiple of 8 elements, whole bytes of codes), about ``target`` elements."""
    import math

    k = 8 // math.gcd(group_size, 8)
    return k * max(1, target // (k * group_size))


def _n_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


@torch.library.custom_op("fewbit::group_quantize", mutates_args=())
def group_quantize(
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool,
    stats_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError(
        f"fewbit::group_quantize has kernels for cpu and cuda tensors, got device {x.device.type!r}"
    )


@group_quantize.register_fake
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    n = x.numel()
    g = _n_groups(n, group_size)
    return (
        x.new_empty(((n * bits + 7) // 8,), dtype=torch.uint8),
        x.new_empty((g,), dtype=stats_dtype),
        x.new_empty((g,), dtype=stats_dtype),
    )


@group_quantize.register_kernel("cpu")
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    n = x.numel()
    g = _n_groups(n, group_size)
    packed = torch.empty(((n * bits + 7) // 8,), dtype=torch.uint8)
    if n == 0:
        empty = torch.empty(0, dtype=stats_dtype)
        return packed, empty, empty.clone()
    import numpy as np

    from fewbit.quant import _numba

    cdt = ref.compute_dtype(x.dtype)
    xc = x.detach().reshape(-1).to(cdt).contiguous()
    m = torch.empty(g, dtype=cdt)
    s = torch.empty(g, dtype=cdt)
    mant, min_exp, fmax = _GRID[stats_dtype]
    levels = float((1 << bits) - 1)
    np_dt = np.float64 if cdt == torch.float64 else np.float32
    consts = np.array([levels, 1.0, 0.5, fmax, 0.0], dtype=np_dt)
    # per-group min/max by torch (vectorised, NaN-propagating), the rest in numba
    lo = torch.empty(g, dtype=cdt)
    hi = torch.empty(g, dtype=cdt)
    nf = n // group_size
    if nf:
        full = xc[: nf * group_size].view(nf, group_size)
        torch.amin(full, dim=1, out=lo[:nf])
        torch.amax(full, dim=1, out=hi[:nf])
    if nf < g:
        tail = xc[nf * group_size:]
        lo[nf] = tail.amin()
        hi[nf] = tail.amax()
    _numba.quantize_kernel(
        xc.numpy(), lo.numpy(), hi.numpy(), bits, group_size, chunk_groups(group_size), np.uint64(seed), bool(stochastic),
        mant, min_exp, fmax, consts, packed.numpy(), m.numpy(), s.numpy(),
    )
    return packed, m.to(stats_dtype), s.to(stats_dtype)


@group_quantize.register_kernel("cuda")
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    if x.dtype == torch.float64 or x.numel() == 0:
        return ref.quantize_reference(x, bits, group_size, seed if stochastic else None, stats_dtype)
    from fewbit.quant import _triton

    return _triton.quantize(x, bits, group_size, seed, stochastic, stats_dtype)


@torch.library.custom_op("fewbit::group_dequantize", mutates_args=())
def group_dequantize(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    numel: int, dtype: torch.dtype,
) -> torch.Tensor:
    raise NotImplementedError(
        f"fewbit::group_dequantize has kernels for cpu and cuda tensors, got device "
        f"{packed.device.type!r}"
    )


@group_dequantize.register_fake
def _(packed, mins, scales, bits, group_size, numel, dtype):
    return packed.new_empty((numel,), dtype=dtype)


@group_dequantize.register_kernel("cpu")
def _(packed, mins, scales, bits, group_size, numel, dtype):
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    from fewbit.quant import _numba

    cdt = ref.compute_dtype(dtype)
    out = torch.empty(numel, dtype=cdt)
    _numba.dequantize_kernel(
        packed.contiguous().numpy(), mins.to(cdt).contiguous().numpy(),
        scales.to(cdt).contiguous().numpy(), bits, group_size, chunk_groups(group_size), out.numpy(),
    )
    return out if cdt == dtype else out.to(dtype)


@group_dequantize.register_kernel("cuda")
def _(packed, mins, scales, bits, group_size, numel, dtype):
    if dtype == torch.float64 or numel == 0:
        return ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype)
    from fewbit.quant import _triton

    return _triton.dequantize(packed, mins, scales, bits, group_size, numel, dtype)
