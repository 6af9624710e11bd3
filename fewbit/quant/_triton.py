"""Triton kernels of the group quantizer for CUDA (imported lazily; needs triton).

Same steps as :mod:`fewbit.quant._reference` (docs/method.md §7) for float16/bfloat16/float32
input (arithmetic in float32): a stats kernel (min/max per group, rounded-down stored
``m`` and ``s``), a codes kernel (8 codes per 64-bit little-endian word, its low ``bits``
bytes stored: the docs/method.md §6 stream) and a dequantize kernel. Bit-exactness with the
reference relies on IEEE-rounded division (``tl.math.div_rn``; Triton's ``/`` is not
correctly rounded on NVIDIA GPUs) and on launching with ``enable_fp_fusion=False`` so that
``(x - m) * s + u`` is not contracted into an FMA. The noise is the counter-based hash of
:func:`fewbit.quant._reference.uniform_noise`, computed here in uint32 arithmetic (native
on GPUs; the reference emulates it in int64).

The launchers are registered as ``fewbit::group_quantize_triton`` /
``fewbit::group_dequantize_triton`` with ``torch.library.triton_op`` and launch through
``torch.library.wrap_triton``, so ``torch.compile`` sees the kernels themselves (torchao
``mx_formats/kernels.py`` does the same); the ``cuda`` kernels of ``fewbit::group_quantize`` /
``fewbit::group_dequantize`` call these ops.

On a machine without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors
(see tests/quant/test_triton.py); they were not run on a GPU when written.
"""

# No ``from __future__ import annotations``: the interpreter of triton 3.0/3.1 recognises
# ``tl.constexpr`` parameters only from evaluated annotations, not from strings.
import torch
from torch.library import triton_op

from fewbit._checks import packed_nbytes
from fewbit.ops._triton import _groups, _load_unpack, _pack_store  # the one Triton packer; imports triton
from fewbit.ops._triton import cdiv, on_device, wrap_triton
from fewbit.quant._reference import affine_levels

import triton  # noqa: E402  (fewbit.ops._triton above raises NotImplementedError without it)
import triton.language as tl  # noqa: E402

__all__ = ["quantize", "dequantize"]

_MASK32 = 0xFFFFFFFF


@triton.jit
def _lowbias32(x):
    # x: uint32. Products wrap modulo 2**32 and >> is a logical shift on unsigned words;
    # both multipliers are typed uint32 explicitly (a literal >= 2**31 would otherwise be
    # typed by the front end's literal rules, which differ between Triton versions).
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _uniform(e, seed0, seed1):
    """u of the int64 flat indices e (fewbit.quant._reference.uniform_noise); seeds uint32."""
    j_lo = (e & 0xFFFFFFFF).to(tl.uint32)
    j_hi = (e >> 32).to(tl.uint32)
    h = _lowbias32(_lowbias32(j_lo ^ seed0) ^ seed1 ^ j_hi)
    return (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24


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
def _prev_stats(v, IS_BF16: tl.constexpr):
    """Largest stats-dtype value < v (v > 0 finite, on the stats grid)."""
    b = v.to(tl.int32, bitcast=True)
    if IS_BF16:
        b = b - 65536
    else:
        b = b - 1
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _stats_kernel(x_ptr, m_ptr, s_ptr, n, G, n_groups, levels, fmax,
                  IS_BF16: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                  N_ITER: tl.constexpr):
    pid = tl.program_id(0)
    gi = pid.to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    gmask = gi < n_groups
    lo = tl.full([BLOCK_GROUPS], float("inf"), tl.float32)
    hi = tl.full([BLOCK_GROUPS], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_GROUPS], tl.int32)
    # a constexpr trip count: a loop bound read from a runtime argument fails in the
    # interpreter of triton <= 3.6 with numpy >= 2.4 (it calls int() on a 1-element array)
    for it in range(N_ITER):
        j = it * BLOCK_G + tl.arange(0, BLOCK_G)
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
    # the division rounds to nearest: step s down once if r * s > levels (as the reference)
    s = tl.where(pos & (rng * s > levels), _prev_stats(s, IS_BF16), s)
    ok = ok & (s > 0)
    tl.store(m_ptr + gi, tl.where(ok, m, float("nan")), mask=gmask)
    tl.store(s_ptr + gi, tl.where(ok, s, float("nan")), mask=gmask)


@triton.jit
def _code(x, m, s, e, seed0, seed1, levels, offset, STOCHASTIC: tl.constexpr, BLOCK_W: tl.constexpr):
    """float32 codes ``floor((x - m) * s + u) + offset`` clamped to ``[0, levels]``, 0 where
    that is NaN (a non-finite group or stat); ``u`` the noise of the flat indices ``e``, or
    0.5 (nearest) if not ``STOCHASTIC``. The group quantizer's and the affine codes' rule."""
    if STOCHASTIC:
        u = _uniform(e, seed0.to(tl.uint32), seed1.to(tl.uint32))
    else:
        u = tl.full([BLOCK_W, 8], 0.5, tl.float32)
    qf = tl.floor((x - m) * s + u) + offset
    qf = tl.where(qf == qf, qf, 0.0)
    return tl.minimum(tl.maximum(qf, 0.0), levels)


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _codes_kernel(x_ptr, m_ptr, s_ptr, out_ptr, n, G, seed0, seed1, levels,
                  STOCHASTIC: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr):
    w, e = _groups(BLOCK_W)
    msk = e < n
    g = e // G
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    x = tl.load(x_ptr + e, mask=msk, other=0.0).to(tl.float32)
    qf = _code(x, m, s, e, seed0, seed1, levels, 0.0, STOCHASTIC, BLOCK_W)  # non-finite group: 0
    _pack_store(qf.to(tl.int32), w, out_ptr, n, BITS)  # codes past n are 0 (x = m = 0 there)


@triton.jit
def _round_half(y, e, seed0, seed1, OUT_BF16: tl.constexpr):
    """float32 ``y`` of the int64 flat indices ``e`` stochastically rounded to the grid of
    bfloat16 (``OUT_BF16``) or float16, as float32 values that dtype holds exactly:
    :func:`fewbit.quant._reference.stochastic_round_reference` bit for bit (seeds: the low
    and high words of the decode seed, int32). bfloat16 on the bit pattern: ``u < t -
    floor(t)`` is a carry out of the low 16 bits when ``0xFFFF - floor(u * 2**16)`` is added
    to them; float16 in float32 arithmetic (``ulp`` and ``1 / ulp`` are normal powers of
    two: every step is exact)."""
    u = _uniform(e, seed0.to(tl.uint32), seed1.to(tl.uint32))
    b = y.to(tl.uint32, bitcast=True)
    exp_mask = tl.full((), 0x7F800000, tl.uint32)
    special = (b & exp_mask) == exp_mask  # NaN or an infinity: kept
    sign = b & tl.full((), 0x80000000, tl.uint32)
    if OUT_BF16:
        r = tl.full((), 0xFFFF, tl.uint32) - (u * 65536.0).to(tl.uint32)
        z = (b + r) & tl.full((), 0xFFFF0000, tl.uint32)
        z = tl.where((z & exp_mask) == exp_mask, sign | tl.full((), 0x7F7F0000, tl.uint32), z)  # the largest
        z = tl.where(special, b, z)
    else:
        ex = ((b >> 23) & tl.full((), 0xFF, tl.uint32)).to(tl.int32)
        ep = tl.maximum(ex - 127, -14) - 10
        ulp = ((ep + 127) << 23).to(tl.float32, bitcast=True)
        t = tl.abs(y) * ((127 - ep) << 23).to(tl.float32, bitcast=True)
        k = tl.floor(t)
        a = (k + tl.where(u < t - k, 1.0, 0.0)) * ulp
        a = tl.where(special, tl.abs(y), tl.minimum(a, 65504.0))  # finite past the largest: the largest
        z = a.to(tl.uint32, bitcast=True) | sign
    return z.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _round_kernel(y_ptr, out_ptr, n, seed0, seed1, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    msk = e < n
    y = tl.load(y_ptr + e, mask=msk, other=0.0)
    tl.store(out_ptr + e, _round_half(y, e, seed0, seed1, OUT_BF16), mask=msk)


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _dequant_kernel(p_ptr, m_ptr, s_ptr, out_ptr, n, G, seed0, seed1,
                    BITS: tl.constexpr, BLOCK_W: tl.constexpr, OUT_BF16: tl.constexpr,
                    ROUND: tl.constexpr):
    w, e = _groups(BLOCK_W)
    q = _load_unpack(p_ptr, w, n, BITS)
    msk = e < n
    g = e // G
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    y = m + tl.math.div_rn(q.to(tl.float32), s)
    if ROUND:
        # stochastic rounding into the half dtype: y is then exact in it
        y = _round_half(y, e, seed0, seed1, OUT_BF16)
        if OUT_BF16:
            tl.store(out_ptr + e, (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=msk)
        else:
            tl.store(out_ptr + e, y.to(out_ptr.dtype.element_ty), mask=msk)
    elif OUT_BF16:
        # round to nearest even by hand (out_ptr is the int16 view of the bfloat16 output):
        # the interpreter truncates in .to(tl.bfloat16), GPUs round; this is the same on both
        b = y.to(tl.int32, bitcast=True)
        b = (b + (32767 + ((b >> 16) & 1))) >> 16
        tl.store(out_ptr + e, b.to(tl.int16), mask=msk)
    else:
        tl.store(out_ptr + e, y.to(out_ptr.dtype.element_ty), mask=msk)


def _as_int32(v: int) -> int:
    """The low 32 bits of ``v`` as a signed int32 value: every seed is passed as an i32
    argument (one compiled variant; the kernel reinterprets it as uint32)."""
    v &= _MASK32
    return v - (1 << 32) if v >= (1 << 31) else v


def _fmax(stats_dtype: torch.dtype) -> float:
    return float(torch.finfo(stats_dtype).max)


def stats(x, bits, group_size, stats_dtype, *, block_elems=4096):
    """Launch the stats kernel on a flat ``x`` (copied if not contiguous: the kernels read a
    pointer): float32 ``(mins, scales)`` of its groups of ``group_size`` on the
    ``stats_dtype`` grid (docs/method.md §7 steps 2-3; NaN for a group with a non-finite
    value). ``block_elems``: elements per stats tile."""
    x = x.contiguous()
    n = x.numel()
    G = group_size
    n_groups = -(-n // G)
    m = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    s = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    if n == 0:
        return m, s
    block_g = min(triton.next_power_of_2(G), block_elems)
    block_groups = max(1, block_elems // block_g)
    with on_device(x):
        wrap_triton(_stats_kernel)[(cdiv(n_groups, block_groups),)](
            x, m, s, n, G, n_groups, float((1 << bits) - 1), _fmax(stats_dtype),
            IS_BF16=stats_dtype == torch.bfloat16, BLOCK_GROUPS=block_groups, BLOCK_G=block_g,
            N_ITER=cdiv(G, block_g), enable_fp_fusion=False,
        )
    return m, s


def quantize(x, bits, group_size, seed, stochastic, stats_dtype, *, block_w=256, block_elems=4096):
    """Launch the stats and codes kernels on a flat ``x`` (float16/bfloat16/float32; copied
    if not contiguous).

    Returns ``(packed uint8, mins, scales)`` as the reference does. ``block_w`` (words of 8
    elements per program) and ``block_elems`` (elements per stats tile) are tuning knobs.
    """
    x = x.contiguous()
    n = x.numel()
    G = group_size
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    m, s = stats(x, bits, group_size, stats_dtype, block_elems=block_elems)
    if n == 0:
        return packed, m.to(stats_dtype), s.to(stats_dtype)
    levels = float((1 << bits) - 1)
    n_words = -(-n // 8)
    with on_device(x):
        wrap_triton(_codes_kernel)[(cdiv(n_words, block_w),)](
            x, m, s, packed, n, G, _as_int32(seed), _as_int32(seed >> 32), levels,
            STOCHASTIC=bool(stochastic), BITS=bits, BLOCK_W=block_w, enable_fp_fusion=False,
        )
    return packed, m.to(stats_dtype), s.to(stats_dtype)


def _round_flag(dtype: torch.dtype, stochastic: bool) -> bool:
    """Whether a decode into ``dtype`` rounds stochastically (float16/bfloat16, stochastic codes)."""
    return bool(stochastic) and dtype in (torch.float16, torch.bfloat16)


def stochastic_round(y, dtype, seed, *, block=1024):
    """Launch :func:`_round_kernel` on a flat contiguous float32 ``y``: ``(numel,)`` of
    ``dtype`` (float16/bfloat16), :func:`fewbit.quant._reference.stochastic_round_reference`."""
    y = y.contiguous()  # the kernel reads a pointer (a strided y had been read as contiguous; h74)
    out = torch.empty_like(y)
    if y.numel():
        with on_device(y):
            wrap_triton(_round_kernel)[(cdiv(y.numel(), block),)](
                y, out, y.numel(), _as_int32(seed), _as_int32(seed >> 32), OUT_BF16=dtype == torch.bfloat16,
                BLOCK=block, enable_fp_fusion=False,
            )
    return out.to(dtype)


def dequantize(packed, mins, scales, bits, group_size, numel, dtype, seed=0, stochastic=False, *, block_w=256):
    """Launch the dequantize kernel: ``(numel,)`` of ``dtype`` (float16/bfloat16/float32),
    rounded stochastically with the decode seed ``seed`` if ``stochastic`` (float16/bfloat16)."""
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    n_words = -(-numel // 8)
    bf16 = dtype == torch.bfloat16
    with on_device(packed):
        wrap_triton(_dequant_kernel)[(cdiv(n_words, block_w),)](
            packed, mins.to(packed.device, torch.float32).contiguous(),
            scales.to(packed.device, torch.float32).contiguous(),
            out.view(torch.int16) if bf16 else out, numel, group_size, _as_int32(seed), _as_int32(seed >> 32),
            BITS=bits, BLOCK_W=block_w, OUT_BF16=bf16, ROUND=_round_flag(dtype, stochastic),
            enable_fp_fusion=False,
        )
    return out


@triton_op("fewbit::group_quantize_triton", mutates_args=())
def _group_quantize_op(
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool, stats_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize(x, bits, group_size, seed, stochastic, stats_dtype)


@triton_op("fewbit::group_dequantize_triton", mutates_args=())
def _group_dequantize_op(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    numel: int, dtype: torch.dtype, seed: int = 0, stochastic: bool = False,
) -> torch.Tensor:
    return dequantize(packed, mins, scales, bits, group_size, numel, dtype, seed, stochastic)


@triton_op("fewbit::stochastic_round_triton", mutates_args=())
def _stochastic_round_op(y: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return stochastic_round(y, dtype, seed)


# --- the compressors of fewbit.quant.compressors (docs/compression.md §3-4) --------------
# Codes from given stats (one pair per row or per column) and DIVISION's block means, as
# fewbit.quant._reference.affine_codes_reference / affine_decode_reference /
# block_mean_reference (same rounding: div_rn, no FMA contraction).


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _affine_codes_kernel(x_ptr, m_ptr, s_ptr, out_ptr, n, rowlen, seed0, seed1, levels, offset,
                         PER_COL: tl.constexpr, STOCHASTIC: tl.constexpr, BITS: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    w, e = _groups(BLOCK_W)
    msk = e < n
    if PER_COL:
        g = e % rowlen
    else:
        g = e // rowlen
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    x = tl.load(x_ptr + e, mask=msk, other=0.0).to(tl.float32)
    qf = _code(x, m, s, e, seed0, seed1, levels, offset, STOCHASTIC, BLOCK_W)  # a NaN stat: 0
    qf = tl.where(msk, qf, 0.0)  # codes past n are 0
    _pack_store(qf.to(tl.int32), w, out_ptr, n, BITS)


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _affine_decode_kernel(p_ptr, m_ptr, s_ptr, out_ptr, n, rowlen, offset, seed0, seed1,
                          PER_COL: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr,
                          ROUND: tl.constexpr, OUT_BF16: tl.constexpr):
    w, e = _groups(BLOCK_W)
    q = _load_unpack(p_ptr, w, n, BITS)
    msk = e < n
    if PER_COL:
        g = e % rowlen
    else:
        g = e // rowlen
    m = tl.load(m_ptr + g, mask=msk, other=0.0)
    s = tl.load(s_ptr + g, mask=msk, other=1.0)
    y = m + tl.math.div_rn(q.to(tl.float32) - offset, s)
    if ROUND:
        y = _round_half(y, e, seed0, seed1, OUT_BF16)  # then exact in the half dtype
    tl.store(out_ptr + e, y, mask=msk)  # float32; the caller casts (to nearest, or exactly)


@triton.jit
def _block_mean_kernel(x_ptr, out_ptr, n_out, H, W, I, Hb, Wb,
                       BH: tl.constexpr, BW: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    msk = o < n_out
    i = o % I
    wb = (o // I) % Wb
    hb = (o // (I * Wb)) % Hb
    a = o // (I * Wb * Hb)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(BW):  # each column's rows summed in order, then the columns in order
        w_ = wb * BW + c
        col = tl.zeros([BLOCK], tl.float32)
        for r in range(BH):
            h = hb * BH + r
            ok = msk & (h < H) & (w_ < W)
            col += tl.load(x_ptr + ((a * H + h) * W + w_) * I + i, mask=ok, other=0.0).to(tl.float32)
        acc += col
    cnt = (tl.minimum(H - hb * BH, BH) * tl.minimum(W - wb * BW, BW)).to(tl.float32)
    tl.store(out_ptr + o, tl.math.div_rn(acc, cnt), mask=msk)


def affine_codes(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic, *, block_w=256):
    """Launch :func:`_affine_codes_kernel` on a flat ``x`` (float16/bfloat16/float32), copied
    if not contiguous: ``x.reshape(-1)`` of every other element of a last dim is a strided
    view, which the kernel had read as contiguous (ChannelWise and Softmax codes of other
    elements)."""
    x = x.contiguous()
    n = x.numel()
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    if n:
        with on_device(x):
            wrap_triton(_affine_codes_kernel)[(cdiv(-(-n // 8), block_w),)](
                x, mins.to(x.device, torch.float32).contiguous(), scales.to(x.device, torch.float32).contiguous(),
                packed, n, rowlen, _as_int32(seed), _as_int32(seed >> 32), float(affine_levels(bits, offset)),
                float(offset), PER_COL=bool(per_col), STOCHASTIC=bool(stochastic), BITS=bits, BLOCK_W=block_w,
                enable_fp_fusion=False,
            )
    return packed


def affine_decode(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed=0, stochastic=False, *,
                  block_w=256):
    """Launch :func:`_affine_decode_kernel`: ``(numel,)`` of ``dtype`` (float16/bfloat16/float32),
    rounded stochastically with the decode seed ``seed`` if ``stochastic`` (float16/bfloat16)."""
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if numel:
        with on_device(packed):
            wrap_triton(_affine_decode_kernel)[(cdiv(-(-numel // 8), block_w),)](
                packed, mins.to(packed.device, torch.float32).contiguous(),
                scales.to(packed.device, torch.float32).contiguous(), out, numel,
                rowlen, float(offset), _as_int32(seed), _as_int32(seed >> 32), PER_COL=bool(per_col), BITS=bits,
                BLOCK_W=block_w, ROUND=_round_flag(dtype, stochastic), OUT_BF16=dtype == torch.bfloat16,
                enable_fp_fusion=False,
            )
    return out.to(dtype)


def block_mean(x, bh, bw, *, block=1024):
    """Launch :func:`_block_mean_kernel` on ``x`` ``(A, H, W, I)``: float32 means."""
    a, h, w, i = x.shape
    out = torch.empty((a, -(-h // bh), -(-w // bw), i), dtype=torch.float32, device=x.device)
    if out.numel() and x.numel():
        with on_device(x):
            wrap_triton(_block_mean_kernel)[(cdiv(out.numel(), block),)](
                x.contiguous(), out, out.numel(), h, w, i, out.shape[1], out.shape[2],
                BH=bh, BW=bw, BLOCK=block, enable_fp_fusion=False,
            )
    return out


@triton_op("fewbit::affine_codes_triton", mutates_args=())
def _affine_codes_op(
    x: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int, per_col: bool,
    offset: int, seed: int, stochastic: bool,
) -> torch.Tensor:
    return affine_codes(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic)


@triton_op("fewbit::affine_decode_triton", mutates_args=())
def _affine_decode_op(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int, per_col: bool,
    offset: int, numel: int, dtype: torch.dtype, seed: int = 0, stochastic: bool = False,
) -> torch.Tensor:
    return affine_decode(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed, stochastic)


def pair_stats(pairs, bits, stats_dtype):
    """``fewbit::pair_stats`` on CUDA: the stats kernel on groups of 2 (float16/bfloat16/
    float32 ``pairs``), the stats in ``stats_dtype``."""
    m, s = stats(pairs, bits, 2, stats_dtype)
    return m.to(stats_dtype), s.to(stats_dtype)


@triton_op("fewbit::pair_stats_triton", mutates_args=())
def _pair_stats_op(pairs: torch.Tensor, bits: int, stats_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return pair_stats(pairs, bits, stats_dtype)


@triton_op("fewbit::block_mean_triton", mutates_args=())
def _block_mean_op(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    return block_mean(x, bh, bw)
