"""CPU backend (numba) of ``fewbit::group_quantize`` and ``fewbit::group_dequantize``.

Loaded on the first CPU call, never at ``import fewbit``. The kernels live in
:mod:`fewbit.quant._numba`; this module prepares their arguments. numba is imported, its
threading layer chosen and its thread count set exactly as for the few-bit ops
(:mod:`fewbit.ops._cpu`, docs/kernels.md): a missing numba raises ``NotImplementedError``
naming what to install.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fewbit._checks import packed_nbytes
from fewbit.ops._cpu import _set_threads  # imports numba (or raises), picks the threading layer
from fewbit.ops._reference import compute_dtype
from fewbit.quant import _numba
from fewbit.quant import _reference as ref

__all__ = ["quantize_cpu", "dequantize_cpu", "chunk_groups", "affine_codes_cpu", "affine_decode_cpu", "block_mean_cpu",
           "division_encode_cpu", "division_compress_cpu", "division_decode_cpu", "pair_stats_cpu"]

# (significant bits, exponent of the smallest spacing, largest finite value) per stats dtype
_GRID = {
    torch.float32: (24, -149, float(torch.finfo(torch.float32).max)),
    torch.bfloat16: (8, -133, float(torch.finfo(torch.bfloat16).max)),
}


def chunk_groups(group_size: int, target: int = 16384) -> int:
    """Groups per parallel chunk of the CPU kernels: a multiple of ``8 / gcd(G, 8)`` (so a
    chunk holds a multiple of 8 elements, whole bytes of codes), about ``target`` elements."""
    k = 8 // math.gcd(group_size, 8)
    return k * max(1, target // (k * group_size))


def quantize_cpu(x, bits, group_size, seed, stochastic, stats_dtype):
    """``(packed, mins, scales)`` of a flat CPU tensor, bit-identical to
    :func:`fewbit.quant._reference.quantize_reference` (float16/bfloat16 through a float32 copy)."""
    n = x.numel()
    g = -(-n // group_size)
    packed = torch.empty((packed_nbytes(n, bits),), dtype=torch.uint8)
    if n == 0:
        empty = torch.empty(0, dtype=stats_dtype)
        return packed, empty, empty.clone()
    cdt = compute_dtype(x.dtype)
    xc = x.detach().reshape(-1).to(cdt).contiguous()
    m = torch.empty(g, dtype=cdt)
    s = torch.empty(g, dtype=cdt)
    mant, min_exp, fmax = _GRID[stats_dtype]
    np_dt = np.float64 if cdt == torch.float64 else np.float32
    consts = np.array([float((1 << bits) - 1), 1.0, 0.5, fmax, 0.0], dtype=np_dt)
    _set_threads()
    _numba.quantize_kernel(
        xc.numpy(), bits, group_size, chunk_groups(group_size), np.uint64(seed),
        bool(stochastic), mant, min_exp, fmax, consts, packed.numpy(), m.numpy(), s.numpy(),
    )
    return packed, m.to(stats_dtype), s.to(stats_dtype)


def _round_kind(dtype: torch.dtype, stochastic: bool) -> int:
    """The decode kernels' ``kind`` (:func:`fewbit.quant._numba.round_half`): stochastic
    rounding into a half-precision ``dtype``, or none (a float32/float64 result, or nearest
    codes: the final cast rounds to nearest)."""
    if not stochastic:
        return _numba.ROUND_NONE
    return {torch.bfloat16: _numba.ROUND_BF16, torch.float16: _numba.ROUND_FP16}.get(dtype, _numba.ROUND_NONE)


def dequantize_cpu(packed, mins, scales, bits, group_size, numel, dtype, seed=0, stochastic=False):
    """``(numel,)`` of ``dtype``, bit-identical to :func:`fewbit.quant._reference.dequantize_reference`
    (with ``seed if stochastic else None``)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    cdt = compute_dtype(dtype)
    out = torch.empty(numel, dtype=cdt)
    _set_threads()
    _numba.dequantize_kernel(
        packed.contiguous().numpy(), mins.to(cdt).contiguous().numpy(),
        scales.to(cdt).contiguous().numpy(), bits, group_size, chunk_groups(group_size), np.uint64(seed),
        _round_kind(dtype, stochastic), out.numpy(),
    )
    return out if cdt == dtype else out.to(dtype)


def _np_dtype(cdt: torch.dtype):
    return np.float64 if cdt == torch.float64 else np.float32


def affine_codes_cpu(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic):
    """Packed codes, bit-identical to :func:`fewbit.quant._reference.affine_codes_reference`."""
    n = x.numel()
    packed = torch.empty((packed_nbytes(n, bits),), dtype=torch.uint8)
    if n == 0:
        return packed
    cdt = compute_dtype(x.dtype)
    consts = np.array([float(ref.affine_levels(bits, offset)), 0.5, 0.0, float(offset)], dtype=_np_dtype(cdt))
    _set_threads()
    _numba.affine_codes_kernel(
        x.detach().reshape(-1).to(cdt).contiguous().numpy(), mins.to(cdt).contiguous().numpy(),
        scales.to(cdt).contiguous().numpy(), rowlen, bool(per_col), np.uint64(seed), bool(stochastic),
        bits, consts, packed.numpy(),
    )
    return packed


def affine_decode_cpu(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed=0, stochastic=False):
    """``(numel,)`` of ``dtype``, bit-identical to :func:`fewbit.quant._reference.affine_decode_reference`
    (with ``seed if stochastic else None``)."""
    cdt = compute_dtype(dtype)
    out = torch.empty(numel, dtype=cdt)
    if numel:
        _set_threads()
        _numba.affine_decode_kernel(
            packed.contiguous().numpy(), mins.to(cdt).contiguous().numpy(), scales.to(cdt).contiguous().numpy(),
            rowlen, bool(per_col), bits, np.array([float(offset)], dtype=_np_dtype(cdt)), np.uint64(seed),
            _round_kind(dtype, stochastic), out.numpy(),
        )
    return out if cdt == dtype else out.to(dtype)


def block_mean_cpu(x, bh, bw):
    """DIVISION's block means, bit-identical to :func:`fewbit.quant._reference.block_mean_reference`."""
    cdt = compute_dtype(x.dtype)
    a, h, w, i = x.shape
    out = torch.empty((a, -(-h // bh), -(-w // bw), i), dtype=cdt)
    if out.numel() and x.numel():
        _set_threads()
        _numba.block_mean_kernel(x.detach().to(cdt).contiguous().numpy(), bh, bw, out.numpy())
    return out


def _pair_stats(lo, hi, bits, stats_dtype, np_dt):
    """Stored ``(mins, scales)`` in ``stats_dtype`` of each ``(lo[i], hi[i])`` (numpy, the
    compute dtype ``np_dt``; NaN where either is not finite), bit-identical to
    ``ref.group_stats_reference`` of the pairs."""
    m = np.empty(lo.shape[0], np_dt)
    s = np.empty(lo.shape[0], np_dt)
    mant, min_exp, fmax = _GRID[stats_dtype]
    consts = np.array([float((1 << bits) - 1), 1.0, 0.5, fmax, 0.0], dtype=np_dt)
    _numba.pair_stats_kernel(lo, hi, mant, min_exp, fmax, consts, m, s)
    return torch.from_numpy(m).to(stats_dtype), torch.from_numpy(s).to(stats_dtype)


def pair_stats_cpu(pairs, bits, stats_dtype):
    """``(mins, scales)`` of each pair ``(pairs[2i], pairs[2i+1])`` (``fewbit::pair_stats``),
    bit-identical to ``ref.group_stats_reference(pairs, bits, 2, stats_dtype)[:2]``."""
    cdt = compute_dtype(pairs.dtype)
    p = pairs.detach().to(cdt).contiguous().numpy().reshape(-1, 2)
    lo = np.minimum(p[:, 0], p[:, 1])  # NaN-propagating, as the reference's amin
    hi = np.maximum(p[:, 0], p[:, 1])
    return _pair_stats(lo, hi, bits, stats_dtype, _np_dtype(cdt))


def _division_stats(shape, lo, hi, ok, row_stats, bits, cdt):
    """``(mins, scales)`` from the residual's min/max per row (``row_stats``) or per
    row-block (reduced to one pair for the tensor), in :func:`ref.division_stats_layout`'s
    dtype; bit-identical to ``ref.group_stats_reference`` of the pairs."""
    _, stats_dtype = ref.division_stats_layout(shape, row_stats)
    np_dt = _np_dtype(cdt)
    if not row_stats:
        nan = float("nan")
        lo, hi = (np.array([lo.min()], np_dt), np.array([hi.max()], np_dt)) if ok.all() else (
            np.array([nan], np_dt), np.array([nan], np_dt))
    return _pair_stats(lo, hi, bits, stats_dtype, np_dt)


def _division_codes(xf, lf, shape, bh, bw, bits, seed, mins, scales, cdt):
    """The residual's packed codes from the stats (one pair, or one per row)."""
    _, h, w, i = shape
    packed = torch.empty(packed_nbytes(xf.shape[0], bits), dtype=torch.uint8)
    consts = np.array([float((1 << bits) - 1), 0.0], dtype=_np_dtype(cdt))
    _numba.division_codes_kernel(xf, lf, h, w, i, bh, bw, np.uint64(seed), bits, consts,
                                 mins.to(cdt).numpy(), scales.to(cdt).numpy(), packed.numpy())
    return packed


def _minmax_buffers(x, lfc_rows, row_stats, dtype):
    a, h = x.shape[:2]
    n = a * h if row_stats else a * lfc_rows
    return np.empty(n, dtype), np.empty(n, dtype), np.ones(n, np.bool_)


def division_encode_cpu(x, lfc, bh, bw, bits, seed, row_stats=False):
    """``(packed, mins, scales)``, bit-identical to
    :func:`fewbit.quant._reference.division_encode_reference` (fused: two passes over ``x``,
    the residual never materialised)."""
    cdt = compute_dtype(x.dtype)
    if x.numel() == 0:  # no codes: the reference's empty stats
        return ref.division_encode_reference(x, lfc, bh, bw, bits, seed, row_stats)
    xf = x.detach().to(cdt).contiguous().reshape(-1).numpy()
    lf = lfc.to(cdt).contiguous().numpy()
    _, h, w, i = x.shape
    lo, hi, ok = _minmax_buffers(x, lf.shape[1], row_stats, xf.dtype)
    _set_threads()
    _numba.division_minmax_kernel(xf, lf, h, w, i, bh, bw, bool(row_stats), lo, hi, ok)
    mins, scales = _division_stats(x.shape, lo, hi, ok, row_stats, bits, cdt)
    return _division_codes(xf, lf, x.shape, bh, bw, bits, seed, mins, scales, cdt), mins, scales


def division_compress_cpu(x, bh, bw, bits, seed, row_stats=False):
    """``(lfc, packed, mins, scales)``, bit-identical to
    :func:`fewbit.quant._reference.division_compress_reference`. Float32/float64 input (means
    stored in the compute dtype): the block means and the residual's min/max in one pass over
    ``x``, the codes in a second; float16/bfloat16: the means, rounded to the input dtype,
    then :func:`division_encode_cpu`."""
    cdt = compute_dtype(x.dtype)
    if x.dtype != cdt or x.numel() == 0:
        lfc = block_mean_cpu(x, bh, bw).to(x.dtype)
        return (lfc, *division_encode_cpu(x, lfc, bh, bw, bits, seed, row_stats))
    a, h, w, i = x.shape
    xc = x.detach().contiguous()  # float32/float64: the compute dtype
    lfc = torch.empty((a, -(-h // bh), -(-w // bw), i), dtype=cdt)
    lo, hi, ok = _minmax_buffers(x, lfc.shape[1], row_stats, _np_dtype(cdt))
    _set_threads()
    _numba.block_mean_minmax_kernel(xc.numpy(), bh, bw, lfc.numpy(), bool(row_stats), lo, hi, ok)
    mins, scales = _division_stats(x.shape, lo, hi, ok, row_stats, bits, cdt)
    packed = _division_codes(xc.reshape(-1).numpy(), lfc.numpy(), x.shape, bh, bw, bits, seed, mins, scales, cdt)
    return lfc, packed, mins, scales


def division_decode_cpu(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=0, stochastic=False):
    """``(A, h, w, I)`` of ``dtype``, bit-identical to
    :func:`fewbit.quant._reference.division_decode_reference` (one stat pair per tensor or
    per row; with ``seed if stochastic else None``)."""
    cdt = compute_dtype(dtype)
    a, _, _, i = lfc.shape
    out = torch.empty((a, h, w, i), dtype=cdt)
    if out.numel():
        _set_threads()
        _numba.division_decode_kernel(packed.contiguous().numpy(), lfc.to(cdt).contiguous().numpy(), h, w, i,
                                      bh, bw, bits, mins.to(cdt).contiguous().numpy(),
                                      scales.to(cdt).contiguous().numpy(), np.uint64(seed),
                                      _round_kind(dtype, stochastic), out.view(-1).numpy())
    return out if cdt == dtype else out.to(dtype)
