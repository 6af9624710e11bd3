"""Triton kernels of the group quantizer for CUDA (imported lazily; needs triton).

Same steps as :mod:`fewbit.quant._reference` (docs/method.md §7) for float16/bfloat16/float32
input (arithmetic in float32): a stats kernel (min/max per group, rounded-down stored
``m`` and ``s``), a codes kernel (8 codes per 64-bit little-endian word, its low ``bits``
bytes stored: the docs/method.md §6 stream) and a dequantize kernel. Bit-exactness with the
reference relies on IEEE-rounded division (``tl.math.div_rn``; Triton's ``/`` is not
correctly rounded on NVIDIA GPUs) and on launching with ``enable_fp_fusion=False`` so that
``(x - m) * s + u`` is not contracted into an FMA. The noise is the same counter-based
hash (computed in int64, like the torch reference).

On a machine without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors
(see tests/quant/test_triton.py); they were not run on a GPU when written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["quantize", "dequantize"]

_MASK32 = 0xFFFFFFFF


@triton.jit
def _mul32(x, C: tl.constexpr):
    # (x * C) mod 2**32 for int64 x in [0, 2**32), C < 2**32, without int64 overflow
    if C >= 2147483648:
        return (x * (C - 2147483648) + ((x & 1) << 31)) & 0xFFFFFFFF
    else:
        return (x * C) & 0xFFFFFFFF


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _floor_stats(v, IS_BF16: tl.constexpr):
    """Largest stats-dtype value <= v (v finite float32)."""
    if IS_BF16:
        b = v.to(tl.int32, bitcast=True)
        t = b & -65536  # 0xFFFF0000: truncation toward zero
        t = tl.where((b < 0) & (t != b), t + 65536, t)  # negative and inexact: one ulp down
        return t.to(tl.float32, bitcast=True)
    else:
        return v


@triton.jit
def _stats_kernel(x_ptr, m_ptr, s_ptr, n, G, n_groups, levels, fmax,
                  IS_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    gi = pid.to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    gmask = gi < n_groups
    lo = tl.full([BLOCK_GROUPS], float("inf"), tl.float32)
    hi = tl.full([BLOCK_GROUPS], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_GROUPS], tl.int32)
    for start in range(0, G, BLOCK_G):
        j = start + tl.arange(0, BLOCK_G)
        e = gi[:, None] * G + j[None, :]
        msk = gmask[:, None] & (j[None, :] < G) & (e < n)
        v = tl.load(x_ptr + e, mask=msk, other=0.0).to(tl.float32)
        nonfinite = (v != v) | (tl.abs(v) == float("inf"))
        bad = tl.maximum(bad, tl.max(nonfinite.to(tl.int32), axis=1))
        lo = tl.minimum(lo, tl.min(tl.where(msk, v, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(msk, v, float("-inf")), axis=1))
    ok = bad == 0
    m = _floor_stats(tl.where(ok, lo, 0.0), IS_BF16)
    ok = ok & (tl.abs(m) < float("inf"))
    rng = tl.where(ok, hi - m, 1.0)
    ok = ok & (tl.abs(rng) < float("inf"))
    pos = ok & (rng > 0)
    levels_v = tl.full([BLOCK_GROUPS], 1.0, tl.float32) * levels
    sr = tl.where(pos, tl.math.div_rn(levels_v, tl.where(pos, rng, 1.0)), 1.0)
    sr = tl.where(sr == float("inf"), fmax, sr)
    s = _floor_stats(sr, IS_BF16)
    ok = ok & (s > 0)
    tl.store(m_ptr + gi, tl.where(ok, m, float("nan")), mask=gmask)
    tl.store(s_ptr + gi, tl.where(ok, s, float("nan")), mask=gmask)


@triton.jit
def _codes_kernel(x_ptr, m_ptr, s_ptr, out_ptr, n, nbytes, G, seed0, seed1, levels,
                  STOCHASTIC: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    k = tl.arange(0, 8)
    e = w[:, None] * 8 + k[None, :]
    msk = e < n
    g = e // G
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    x = tl.load(x_ptr + e, mask=msk, other=0.0).to(tl.float32)
    if STOCHASTIC:
        h = _lowbias32(_lowbias32((e & 0xFFFFFFFF) ^ seed0.to(tl.int64)) ^ seed1.to(tl.int64))
        u = (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
    else:
        u = tl.full([BLOCK_W, 8], 0.5, tl.float32)
    t = (x - m) * s
    qf = tl.floor(t + u)
    qf = tl.where(qf == qf, qf, 0.0)  # non-finite group: code 0
    qf = tl.minimum(tl.maximum(qf, 0.0), levels)
    q = qf.to(tl.int64)
    word = tl.sum(q << (k[None, :] * BITS).to(tl.int64), axis=1)
    i = tl.arange(0, BITS)
    byte = (word[:, None] >> (8 * i[None, :]).to(tl.int64)) & 255
    bidx = w[:, None] * BITS + i[None, :]
    tl.store(out_ptr + bidx, byte.to(tl.uint8), mask=bidx < nbytes)


@triton.jit
def _dequant_kernel(p_ptr, m_ptr, s_ptr, out_ptr, n, nbytes, G,
                    BITS: tl.constexpr, BLOCK_W: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    i = tl.arange(0, BITS)
    bidx = w[:, None] * BITS + i[None, :]
    b = tl.load(p_ptr + bidx, mask=bidx < nbytes, other=0).to(tl.int64)
    word = tl.sum(b << (8 * i[None, :]).to(tl.int64), axis=1)
    k = tl.arange(0, 8)
    q = (word[:, None] >> (k[None, :] * BITS).to(tl.int64)) & ((1 << BITS) - 1)
    e = w[:, None] * 8 + k[None, :]
    msk = e < n
    g = e // G
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    y = m + tl.math.div_rn(q.to(tl.float32), s)
    if OUT_BF16:
        # round to nearest even by hand (out_ptr is the int16 view of the bfloat16 output):
        # the interpreter truncates in .to(tl.bfloat16), GPUs round; this is the same on both
        b = y.to(tl.int32, bitcast=True)
        b = (b + (32767 + ((b >> 16) & 1))) >> 16
        tl.store(out_ptr + e, b.to(tl.int16), mask=msk)
    else:
        tl.store(out_ptr + e, y.to(out_ptr.dtype.element_ty), mask=msk)


def _fmax(stats_dtype: torch.dtype) -> float:
    return float(torch.finfo(stats_dtype).max)


def quantize(x, bits, group_size, seed, stochastic, stats_dtype, *, block_w=256, block_elems=4096):
    """Launch the stats and codes kernels on a flat contiguous ``x`` (float16/bfloat16/float32).

    Returns ``(packed uint8, mins, scales)`` as the reference does. ``block_w`` (words of 8
    elements per program) and ``block_elems`` (elements per stats tile) are tuning knobs.
    """
    n = x.numel()
    G = group_size
    n_groups = -(-n // G)
    nbytes = (n * bits + 7) // 8
    dev = x.device
    m = torch.empty(n_groups, dtype=torch.float32, device=dev)
    s = torch.empty(n_groups, dtype=torch.float32, device=dev)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if n == 0:
        return packed, m.to(stats_dtype), s.to(stats_dtype)
    block_g = min(triton.next_power_of_2(G), block_elems)
    block_groups = max(1, block_elems // block_g)
    levels = float((1 << bits) - 1)
    _stats_kernel[(triton.cdiv(n_groups, block_groups),)](
        x, m, s, n, G, n_groups, levels, _fmax(stats_dtype),
        IS_BF16=stats_dtype == torch.bfloat16, BLOCK_GROUPS=block_groups, BLOCK_G=block_g,
        enable_fp_fusion=False,
    )
    n_words = -(-n // 8)
    _codes_kernel[(triton.cdiv(n_words, block_w),)](
        x, m, s, packed, n, nbytes, G, seed & _MASK32, (seed >> 32) & _MASK32, levels,
        STOCHASTIC=bool(stochastic), BITS=bits, BLOCK_W=block_w, enable_fp_fusion=False,
    )
    return packed, m.to(stats_dtype), s.to(stats_dtype)


def dequantize(packed, mins, scales, bits, group_size, numel, dtype, *, block_w=256):
    """Launch the dequantize kernel: ``(numel,)`` of ``dtype`` (float16/bfloat16/float32)."""
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    n_words = -(-numel // 8)
    bf16 = dtype == torch.bfloat16
    _dequant_kernel[(triton.cdiv(n_words, block_w),)](
        packed, mins.to(torch.float32).contiguous(), scales.to(torch.float32).contiguous(),
        out.view(torch.int16) if bf16 else out, numel, packed.numel(), group_size,
        BITS=bits, BLOCK_W=block_w, OUT_BF16=bf16, enable_fp_fusion=False,
    )
    return out
