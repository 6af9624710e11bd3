"""CPU kernels of the group quantizer in numba (imported lazily, never by ``import fewbit``).

They implement exactly the steps of :mod:`fewbit.quant._reference` (docs/method.md §7), so the
stored stats and the packed codes are bit-identical to the reference for both rounding
modes (the noise is the same counter-based hash). Per chunk of groups (about 16K
elements, one prange iteration): the stats of each group from its min/max (computed in the
same pass, :func:`minmax`: a compare-and-select loop runs at memory speed), the codes of each group into a scratch buffer (branch-free
loops that LLVM vectorises), then packed by the few-bit ops' packer
(:func:`fewbit.ops._cpu_kernels.pack_codes`, the docs/method.md §6 stream; a chunk starts on
a byte boundary). Arithmetic is in the dtype of ``x`` (float32 or float64); no fastmath, so
no FMA contraction: ``(x - m) * s + u`` is rounded twice as in torch.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from fewbit.ops import _cpu as _  # noqa: F401  (numba imported, its threading layer chosen)
from fewbit.ops._cpu_kernels import pack_codes, unpack_codes  # the one numba packer

_MASK32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", cache=True)
def _floor_to_grid(v, mant_bits, min_exp, fmax):
    """Largest value with ``mant_bits`` significant bits (exponent >= min_exp) <= v.

    ``v`` finite float64; returns float64: ``fmax`` above it (the largest finite value
    ``<= v``, as :func:`fewbit.quant._reference.floor_to_dtype`), ``-inf`` below ``-fmax``.
    """
    if v == 0.0:
        return v
    e = math.frexp(v)[1]  # v = f * 2**e, 0.5 <= |f| < 1
    q = math.ldexp(1.0, max(e - mant_bits, min_exp))
    r = np.floor(v / q) * q
    if r > fmax:
        return fmax
    if r < -fmax:
        return -np.inf
    return r


def _lowbias32_ir(builder, x):
    """LLVM IR of one round of lowbias32 on the i32 value ``x`` (modulo 2**32)."""
    def c(v):
        return ir.Constant(ir.IntType(32), v)

    x = builder.xor(x, builder.lshr(x, c(16)))
    x = builder.mul(x, c(0x7FEB352D))
    x = builder.xor(x, builder.lshr(x, c(15)))
    x = builder.mul(x, c(0x846CA68B))
    return builder.xor(x, builder.lshr(x, c(16)))


def _u24_ir(builder, h):
    """LLVM IR of ``(h >> 8) * 2**-24`` (float32) of the i32 hash ``h``."""
    f = builder.uitofp(builder.lshr(h, ir.Constant(ir.IntType(32), 8)), ir.FloatType())
    return builder.fmul(f, ir.Constant(ir.FloatType(), 2.0 ** -24))


@intrinsic
def _uniform32(typingctx, e, s0, s1):
    """``u`` of flat index ``e`` (:func:`fewbit.quant._reference.uniform_noise`; ``s0``, ``s1``
    uint64 words < 2**32), float32: the hash of :mod:`fewbit.quant._reference` (two rounds
    of lowbias32), written as 32-bit LLVM IR. numba widens uint32 arithmetic to 64 bits, so the vectorised loops multiplied
    8 lanes of 64 bits (``vpmullq``); in 32 bits LLVM multiplies 16 lanes (``vpmulld``):
    0.76 -> 0.55 ns an element for a codes loop on the CI VM, bit for bit the same
    (compress + decompress, 2 bits, 1 thread, ``scripts/bench_quant.py``: group quantizer
    at 2**20 float32 2.14 -> 2.42 GB/s; at 2**24, bound by page faults, within noise)."""
    if not isinstance(e, types.Integer):
        return None
    sig = types.float32(e, s0, s1)

    def codegen(context, builder, signature, args):
        e_, s0_, s1_ = args
        i32 = ir.IntType(32)
        e_ = builder.sext(e_, ir.IntType(64)) if e_.type.width < 64 else e_
        lo = builder.trunc(e_, i32)
        hi = builder.trunc(builder.lshr(e_, ir.Constant(e_.type, 32)), i32)
        h = _lowbias32_ir(builder, builder.xor(lo, builder.trunc(s0_, i32)))
        h = _lowbias32_ir(builder, builder.xor(builder.xor(h, builder.trunc(s1_, i32)), hi))
        return _u24_ir(builder, h)

    return sig, codegen


@njit(inline="always", cache=True)
def _uniform(e, s0, s1):
    """:func:`_uniform32`, callable from Python too (an intrinsic is usable only inside
    compiled code); inlined into the kernels, so the same machine code."""
    return _uniform32(e, s0, s1)


@intrinsic
def _uniform_lo(typingctx, i, lo, s0, s1x):
    """:func:`_uniform32` of flat index ``e = lo + i`` for ``lo + i < 2**32`` within the
    piece, given ``lo`` (the low word of the piece's first index) and ``s1x = s1 ^ hi``
    (its high word folded into the seed): all in 32 bits, so a vectorised loop over ``i``
    carries no 64-bit lanes (on an AVX2 VM the 64-bit index and its split into two words
    took a quarter of an affine codes loop: 1.45 -> 1.07-1.11 ns an element at 2**20)."""
    if not isinstance(i, types.Integer):
        return None
    sig = types.float32(i, lo, s0, s1x)

    def codegen(context, builder, signature, args):
        i_, lo_, s0_, s1x_ = args
        i32 = ir.IntType(32)
        e_lo = builder.add(builder.trunc(i_, i32), builder.trunc(lo_, i32))
        h = _lowbias32_ir(builder, builder.xor(e_lo, builder.trunc(s0_, i32)))
        h = _lowbias32_ir(builder, builder.xor(h, builder.trunc(s1x_, i32)))
        return _u24_ir(builder, h)

    return sig, codegen


@njit(inline="always", cache=True)
def _lanes32(e0, n, s1):
    """``(lo, s1x, k)`` for the noise of the flat indices ``e0 .. e0 + n - 1``:
    :func:`_uniform_lo`'s arguments (the low word of ``e0``, ``s1`` with its high word folded
    in) and how many of the indices lie below the next multiple of 2**32 (those take the
    32-bit lanes; the rest :func:`_uniform`)."""
    lo = np.uint64(e0) & _MASK32
    return lo, s1 ^ (np.uint64(e0) >> np.uint64(32)), min(n, (1 << 32) - np.int64(lo))


@njit(inline="always", cache=True)
def _noise(e0, out, s0, s1):
    """``out[i] = u(e0 + i)`` (:func:`_uniform`) for ``i < len(out)``: 32-bit lanes
    (:func:`_uniform_lo`) up to the next multiple of 2**32, the 64-bit index past it."""
    n = out.shape[0]
    lo, s1x, k = _lanes32(e0, n, s1)
    for i in range(k):
        out[i] = _uniform_lo(i, lo, s0, s1x)
    for i in range(k, n):
        out[i] = _uniform(e0 + i, s0, s1)


@intrinsic
def _f32_bits(typingctx, y):
    """The bit pattern of the float32 ``y``, as a uint32."""
    if not isinstance(y, types.Float):
        return None

    def codegen(context, builder, signature, args):
        (y_,) = args
        if y_.type != ir.FloatType():
            y_ = builder.fptrunc(y_, ir.FloatType())
        return builder.bitcast(y_, ir.IntType(32))

    return types.uint32(y), codegen


@intrinsic
def _f32_from_bits(typingctx, b):
    """The float32 of the low 32 bits of the integer ``b``."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        (b_,) = args
        i32 = ir.IntType(32)
        if b_.type.width > 32:
            b_ = builder.trunc(b_, i32)
        elif b_.type.width < 32:
            b_ = builder.zext(b_, i32)
        return builder.bitcast(b_, ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def _round_bf16(typingctx, y, u):
    """float32 ``y`` stochastically rounded to bfloat16's grid with the uniform float32 ``u``
    (:func:`fewbit.quant._reference.stochastic_round_reference`), branch-free 32-bit LLVM IR
    (a loop of it vectorises): ``u < t - floor(t)`` is a carry out of the low 16 bits when
    ``0xFFFF - floor(u * 2**16)`` is added to them; a carry into the all-ones exponent gives
    the largest finite value; NaN and infinities are kept."""
    if not (isinstance(y, types.Float) and isinstance(u, types.Float)):
        return None

    def codegen(context, builder, signature, args):
        y_, u_ = (v if v.type == ir.FloatType() else builder.fptrunc(v, ir.FloatType()) for v in args)
        i32 = ir.IntType(32)

        def c(v):
            return ir.Constant(i32, v)
        b = builder.bitcast(y_, i32)
        r = builder.sub(c(0xFFFF), builder.fptoui(builder.fmul(u_, ir.Constant(ir.FloatType(), 65536.0)), i32))
        z = builder.and_(builder.add(b, r), c(-65536))  # 0xFFFF0000
        exp = c(0x7F800000)
        special = builder.icmp_unsigned("==", builder.and_(b, exp), exp)
        over = builder.icmp_unsigned("==", builder.and_(z, exp), exp)
        big = builder.or_(builder.and_(b, c(-0x80000000)), c(0x7F7F0000))
        z = builder.select(special, b, builder.select(over, big, z))
        return builder.bitcast(z, ir.FloatType())

    return types.float32(y, u), codegen


#: ``round_half``'s ``kind``: the dtype a decode rounds its float32 result to.
ROUND_NONE, ROUND_BF16, ROUND_FP16 = 0, 1, 2


@njit(inline="always", cache=True)
def _round_fp16(y, u):
    """float32 ``y`` stochastically rounded to float16's grid with the uniform float32 ``u``
    (:func:`fewbit.quant._reference.stochastic_round_reference`) in float32 arithmetic:
    ``ulp`` and ``1 / ulp`` are normal powers of two, so every step is exact; branch-free."""
    b = np.int64(_f32_bits(y))
    ex = (b >> 23) & 0xFF
    e = max(ex - 127, -14) - 10
    a = abs(y)
    t = a * _f32_from_bits((127 - e) << 23)
    k = np.floor(t)
    z = (k + (np.float32(1.0) if u < t - k else np.float32(0.0))) * _f32_from_bits((e + 127) << 23)
    z = a if ex == 0xFF else min(z, np.float32(65504.0))  # NaN, infinities kept; finite past the largest: the largest
    return -z if b >= 0x80000000 else z


@njit(inline="always", cache=True)
def _round_one(y, u, kind):
    return _round_bf16(y, u) if kind == ROUND_BF16 else _round_fp16(y, u)


@njit(inline="always", cache=True)
def round_half(ys, e0, s0, s1, kind):
    """``ys`` (float32, the flat indices ``e0, e0 + 1, ...``) rounded in place to the grid
    of bfloat16 (``kind`` :data:`ROUND_BF16`, :func:`_round_bf16`) or float16
    (:data:`ROUND_FP16`, :func:`_round_fp16`) by
    :func:`fewbit.quant._reference.stochastic_round_reference`, bit for bit; nothing for
    :data:`ROUND_NONE`. The noise is drawn inline (as :func:`_noise`: 32-bit lanes up to the
    next multiple of 2**32): one pass, no scratch (2**22 bfloat16 values at 8 bits, 1
    thread: a decode took 9.7 ms with a noise buffer, 6.0 ms inline, 3.2 ms rounding to
    nearest)."""
    if kind == ROUND_NONE:
        return
    n = ys.shape[0]
    lo, s1x, k = _lanes32(e0, n, s1)
    for i in range(k):
        ys[i] = _round_one(ys[i], _uniform_lo(i, lo, s0, s1x), kind)
    for i in range(k, n):
        ys[i] = _round_one(ys[i], _uniform(e0 + i, s0, s1), kind)


@njit(inline="always", cache=True)
def _prev_on_grid(v, mant_bits, min_exp, fmax):
    """Largest grid value ``< v`` for ``v > 0`` on the grid (float64 in and out)."""
    f, e = math.frexp(v)
    return _floor_to_grid(math.ldexp(f - 2.0 ** -53, e), mant_bits, min_exp, fmax)  # v - 1 ulp64


@njit(inline="always", cache=True)
def minmax(xs):
    """``(lo, hi, finite)`` of a non-empty 1-D array: its min and max, and whether every
    value is finite (a NaN is skipped by the compare-and-select loop, so it is reported
    through ``finite``; an infinity shows in ``lo``/``hi`` and clears ``finite`` too)."""
    lo = xs[0]
    hi = xs[0]
    nan = False
    for i in range(xs.shape[0]):
        v = xs[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
        nan |= v != v
    return lo, hi, not nan and (lo - lo) == 0 and (hi - hi) == 0


@njit(inline="always", cache=True)
def affine_stats(lo, hi, mant_bits, min_exp, fmax, consts, out_m, out_s, g):
    """Stored ``(m, s)`` of one group from its ``lo``/``hi`` (both finite), into
    ``out_m[g]``/``out_s[g]`` (NaN if not representable): docs/method.md §7 steps 2-3, as
    :func:`fewbit.quant._reference.group_stats_reference`. ``consts`` as in :func:`quantize_kernel`."""
    levels = consts[0]
    one = consts[1]
    fmax_c = consts[3]
    out_m[g] = _floor_to_grid(np.float64(lo), mant_bits, min_exp, fmax)
    m = out_m[g]  # the stored value, in the dtype of x
    ok = np.isfinite(m)
    if ok:
        # Every intermediate goes through out_s[g] so that it is rounded to the
        # dtype of x exactly as torch rounds it (numba may widen scalars).
        out_s[g] = hi - m
        rng = out_s[g]
        ok = np.isfinite(rng)
        if ok:
            out_s[g] = one
            if rng > 0:
                out_s[g] = levels / rng
                if np.isinf(out_s[g]):
                    out_s[g] = fmax_c
            out_s[g] = _floor_to_grid(np.float64(out_s[g]), mant_bits, min_exp, fmax)
            # the division rounds to nearest: step down once if r * s > levels
            # (product rounded in the dtype of x, as in the codes loop)
            out_m[g] = rng * out_s[g]
            if out_m[g] > levels:
                out_s[g] = _prev_on_grid(np.float64(out_s[g]), mant_bits, min_exp, fmax)
            out_m[g] = m
            ok = out_s[g] > 0
    if not ok:
        out_m[g] = np.nan
        out_s[g] = np.nan


@njit(parallel=True, error_model="numpy", cache=True)
def quantize_kernel(x, bits, group_size, chunk_groups, seed, stochastic, mant_bits,
                    min_exp, fmax, consts, out_packed, out_m, out_s):
    """Fill ``out_packed`` (uint8), ``out_m``/``out_s`` (dtype of x, values on the stats grid).

    ``consts`` (dtype of x) = [2**bits - 1, 1, 0.5, largest finite stats value, 0]: typed
    constants, so float32 arithmetic is never promoted to float64 by a Python literal.
    """
    n = x.shape[0]
    G = group_size
    n_groups = (n + G - 1) // G
    n_chunks = (n_groups + chunk_groups - 1) // chunk_groups
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    levels = consts[0]
    half = consts[2]
    zero = consts[4]
    for c in prange(n_chunks):
        g0 = c * chunk_groups
        g1 = min(g0 + chunk_groups, n_groups)
        # 1. stats of every group of the chunk, from its min and max
        for g in range(g0, g1):
            lo, hi, ok = minmax(x[g * G:min(g * G + G, n)])
            if ok:
                affine_stats(lo, hi, mant_bits, min_exp, fmax, consts, out_m, out_s, g)
            else:
                out_m[g] = np.nan
                out_s[g] = np.nan
        # 2. codes of the chunk into a scratch buffer (branch-free loops that vectorise),
        #    then packed into whole bytes (the chunk starts on a byte boundary)
        e0 = g0 * G
        e1 = min(g1 * G, n)
        L = e1 - e0
        sc = np.zeros(L, np.uint8)
        us = np.empty(L if stochastic else 0, np.float32)
        if stochastic:
            _noise(e0, us, s0, s1)
        for g in range(g0, g1):
            a = g * G
            b = min(a + G, n)
            m = out_m[g]
            s = out_s[g]
            if not (s == s):
                continue  # non-finite group: codes 0
            xs = x[a:b]
            cs = sc[a - e0:b - e0]
            if stochastic:
                u = us[a - e0:b - e0]
                for i in range(b - a):
                    t = (xs[i] - m) * s
                    qf = np.floor(t + u[i])
                    cs[i] = np.uint8(min(max(qf, zero), levels))
            else:
                for i in range(b - a):
                    t = (xs[i] - m) * s
                    qf = np.floor(t + half)
                    cs[i] = np.uint8(min(max(qf, zero), levels))
        o0 = e0 * bits // 8  # chunks hold whole bytes of codes (chunk_groups)
        pack_codes(sc, out_packed[o0:o0 + (L * bits + 7) // 8], bits)  # packed_nbytes, inside the kernel


@njit(error_model="numpy", cache=True)
def pair_stats_kernel(lo, hi, mant_bits, min_exp, fmax, consts, out_m, out_s):
    """Stored ``(m, s)`` of each ``(lo[g], hi[g])`` pair (:func:`affine_stats`; NaN where
    either is not finite): :func:`fewbit.quant._reference.group_stats_reference` of the
    pairs, without its thirty small torch ops (0.49 ms a DIVISION compression on the CI
    VM). ``consts`` as in :func:`quantize_kernel`."""
    for g in range(lo.shape[0]):
        if np.isfinite(lo[g]) and np.isfinite(hi[g]):
            affine_stats(lo[g], hi[g], mant_bits, min_exp, fmax, consts, out_m, out_s, g)
        else:
            out_m[g] = np.nan
            out_s[g] = np.nan


@njit(parallel=True, error_model="numpy", cache=True)
def dequantize_kernel(packed, m_arr, s_arr, bits, group_size, chunk_groups, seed, kind, out):
    """``out[e] = m + q / s`` in the dtype of ``out`` (float32 or float64), then
    :func:`round_half` of each chunk (``kind``, the decode seed ``seed``)."""
    n = out.shape[0]
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    G = group_size
    n_groups = (n + G - 1) // G
    n_chunks = (n_groups + chunk_groups - 1) // chunk_groups
    for c in prange(n_chunks):
        g0 = c * chunk_groups
        g1 = min(g0 + chunk_groups, n_groups)
        e0 = g0 * G
        e1 = min(g1 * G, n)
        L = e1 - e0
        sc = np.empty(L, np.uint8)
        unpack_codes(packed[e0 * bits // 8:], sc, bits)  # chunks hold whole bytes of codes
        for g in range(g0, g1):
            a = g * G
            b = min(a + G, n)
            m = m_arr[g]
            s = s_arr[g]
            cs = sc[a - e0:b - e0]
            ys = out[a:b]
            for i in range(b - a):
                ys[i] = m + np.float32(cs[i]) / s
        round_half(out[e0:e1], e0, s0, s1, kind)


# --- the compressors of fewbit.quant.compressors (docs/compression.md §3-4) --------------

#: Elements per parallel chunk of the affine kernels (a multiple of 8: whole bytes of codes).
AFFINE_CHUNK = 16384


@njit(inline="always", cache=True)
def _affine_code(t, u, off, zero, levels):
    """The code of ``t = (x - m) * s``: ``floor(t + u) + off`` clamped to ``[0, levels]``,
    0 where it is NaN (a NaN stat); all operands in the dtype of x."""
    qf = np.floor(t + u) + off
    qf = qf if qf == qf else zero
    return np.uint8(min(max(qf, zero), levels))


@njit(parallel=True, error_model="numpy", cache=True)
def affine_codes_kernel(x, m_arr, s_arr, rowlen, per_col, seed, stochastic, bits, consts, out_packed):
    """Codes of :func:`fewbit.quant._reference.affine_codes_reference` into ``out_packed``.

    ``x`` flat (float32 or float64), viewed as rows of ``rowlen``; stats ``m_arr``/``s_arr``
    (dtype of x) per row, or per column if ``per_col``. ``consts`` (dtype of x) = [2**bits
    - 1, 0.5, 0, offset]. Chunks of :data:`AFFINE_CHUNK` elements, each cut into pieces of
    one row (constant stats per row, stats read along the row per column: both vectorise).
    """
    n = x.shape[0]
    n_chunks = (n + AFFINE_CHUNK - 1) // AFFINE_CHUNK
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    levels = consts[0]
    half = consts[1]
    zero = consts[2]
    off = consts[3]
    for c in prange(n_chunks):
        e0 = c * AFFINE_CHUNK
        e1 = min(e0 + AFFINE_CHUNK, n)
        sc = np.empty(e1 - e0, np.uint8)
        us = np.empty(e1 - e0 if stochastic else 0, np.float32)
        if stochastic:
            _noise(e0, us, s0, s1)
        e = e0
        while e < e1:
            r = e // rowlen
            c0 = e - r * rowlen
            k = min(e1, e + rowlen - c0) - e
            xs = x[e:e + k]
            cs = sc[e - e0:e - e0 + k]
            u = us[e - e0:e - e0 + k]
            if per_col:
                ms = m_arr[c0:c0 + k]
                ss = s_arr[c0:c0 + k]
                for i in range(k):
                    cs[i] = _affine_code((xs[i] - ms[i]) * ss[i], u[i] if stochastic else half, off, zero, levels)
            else:
                mm = m_arr[r]
                sv = s_arr[r]
                for i in range(k):
                    cs[i] = _affine_code((xs[i] - mm) * sv, u[i] if stochastic else half, off, zero, levels)
            e += k
        o0 = e0 * bits // 8
        pack_codes(sc, out_packed[o0:o0 + ((e1 - e0) * bits + 7) // 8], bits)


@njit(parallel=True, error_model="numpy", cache=True)
def affine_decode_kernel(packed, m_arr, s_arr, rowlen, per_col, bits, consts, seed, kind, out):
    """``out = m + (q - offset) / s`` (:func:`fewbit.quant._reference.affine_decode_reference`),
    stats as in :func:`affine_codes_kernel`; ``consts`` (dtype of out) = [offset]; then
    :func:`round_half` of each chunk (``kind``, the decode seed ``seed``)."""
    n = out.shape[0]
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    n_chunks = (n + AFFINE_CHUNK - 1) // AFFINE_CHUNK
    off = consts[0]
    for c in prange(n_chunks):
        e0 = c * AFFINE_CHUNK
        e1 = min(e0 + AFFINE_CHUNK, n)
        sc = np.empty(e1 - e0, np.uint8)
        unpack_codes(packed[e0 * bits // 8:], sc, bits)
        e = e0
        while e < e1:
            r = e // rowlen
            c0 = e - r * rowlen
            k = min(e1, e + rowlen - c0) - e
            ys = out[e:e + k]
            cs = sc[e - e0:e - e0 + k]
            if per_col:
                ms = m_arr[c0:c0 + k]
                ss = s_arr[c0:c0 + k]
                for i in range(k):
                    ys[i] = ms[i] + (cs[i] - off) / ss[i]
            else:
                mm = m_arr[r]
                sv = s_arr[r]
                for i in range(k):
                    ys[i] = mm + (cs[i] - off) / sv
            e += k
        round_half(out[e0:e1], e0, s0, s1, kind)


@njit(inline="always", cache=True)
def _column_block_means(col, W, I, bw, rows, acc):
    """``acc[wb, i]``: the mean of block ``wb``'s columns ``col[w * I + i]`` (sums over
    ``rows`` rows), added in the reference's order from 0, divided by the count in float64
    and rounded once to the dtype of ``acc``. The sum runs in a local, not in ``acc``: an
    update of ``acc`` in place is a store and a reload per column (it may alias ``col``),
    which made this tail cost 4x the row sums before it on conv maps. With channels
    (``I > 1``, token sequences) the loops along ``i`` vectorise instead."""
    for wb in range(acc.shape[0]):
        w0 = wb * bw
        w1 = min(w0 + bw, W)
        cnt = rows * (w1 - w0)
        if I == 1:
            acc[wb, 0] = 0
            t = acc[wb, 0]  # 0 in the dtype of acc
            for w in range(w0, w1):
                t += col[w]
            acc[wb, 0] = t / cnt
            continue
        a = acc[wb]
        a[:] = 0
        for w in range(w0, w1):
            cw = col[w * I:(w + 1) * I]
            for i in range(I):
                a[i] += cw[i]
        for i in range(I):
            a[i] = a[i] / cnt


@njit(inline="always", cache=True)
def _block_means(xf, a, hb, H, W, I, bh, bw, col, acc):
    """Means of row-block ``(a, hb)`` (:func:`fewbit.quant._reference.block_mean_reference`,
    the same order of additions) into ``acc`` ``(Wb, I)``; ``col`` a ``W * I`` scratch. The
    column sums accumulate row by row (a vectorised loop along the row), then each block
    adds its columns. The division by the count is done in float64 and rounded once to
    float32: the correctly rounded float32 quotient (53 >= 2 * 24 + 2 bits)."""
    WI = W * I
    col[:] = 0
    h0 = hb * bh
    h1 = min(h0 + bh, H)
    for h in range(h0, h1):
        row = xf[(a * H + h) * WI:(a * H + h + 1) * WI]
        for k in range(WI):
            col[k] += row[k]
    _column_block_means(col, W, I, bw, h1 - h0, acc)


@njit(inline="always", cache=True)
def _task_chunks(tasks, task_elems):
    """Row-block tasks per parallel chunk (about :data:`AFFINE_CHUNK` elements each, so the
    scratch rows are allocated once per chunk, not per task) and the number of chunks."""
    per = max(1, AFFINE_CHUNK // max(task_elems, 1))
    return per, (tasks + per - 1) // per


@njit(parallel=True, error_model="numpy", cache=True)
def block_mean_kernel(x, bh, bw, out):
    """DIVISION's block means: ``x`` ``(A, H, W, I)`` flat rows, ``out`` ``(A, ceil(H / bh),
    ceil(W / bw), I)``, both float32 or both float64; one row-block per task."""
    A, H, W, I = x.shape
    Hb = out.shape[1]
    xf = x.reshape(A * H * W * I)
    per, chunks = _task_chunks(A * Hb, bh * W * I)
    for c in prange(chunks):
        col = np.empty(W * I, x.dtype)
        for t in range(c * per, min((c + 1) * per, A * Hb)):
            a = t // Hb
            _block_means(xf, a, t - a * Hb, H, W, I, bh, bw, col, out[a, t - a * Hb])


@njit(inline="always", cache=True)
def _upsample(lfc_row, bw, I, k0, L, buf):
    """``buf[j] = up[k0 + j]`` for ``j < L``, ``up[w * I + i] = lfc_row[w // bw, i]``: a
    piece of one row of the upsampled block means (the whole row: ``k0 = 0, L = W * I``).
    Block by block: one division for the piece, none per element."""
    w = k0 // I
    i = k0 - w * I
    wb = w // bw
    r = w - wb * bw  # position in block wb
    j = 0
    if I == 1:  # conv maps: one channel per position, runs of bw equal values
        while j < L:
            m = min(bw - r, L - j)
            v = lfc_row[wb, 0]
            for t in range(m):
                buf[j + t] = v
            j += m
            r = 0
            wb += 1
        return
    while j < L:
        m = min(I - i, L - j)
        for t in range(m):
            buf[j + t] = lfc_row[wb, i + t]
        j += m
        i = 0
        r += 1
        if r == bw:
            r = 0
            wb += 1


# DIVISION's residual, fused (fewbit.quant._reference.division_encode_reference /
# division_decode_reference, bit for bit): ``xf`` is the flat input (compute dtype) of the view
# ``(A, H, W, I)``, ``lfc`` ``(A, Hb, Wb, I)`` the stored block means in the compute dtype;
# one task per row-block ``(a, hb)`` upsamples its means into a row buffer once, then walks
# its rows: the residual ``x - up`` is never materialised.


@njit(inline="always", cache=True)
def _rows_minmax(xf, buf, e0, rows, scratch):
    """Min, max and finiteness of the residual ``x - buf`` over ``rows`` rows of ``len(buf)``
    from flat index ``e0``. Reduced per column first (independent lanes, so the loop
    vectorises), then across the columns; min and max do not depend on the order.
    ``scratch`` rows 1-5: the column minima and maxima in two buffers each, read from one
    and written to the other by turns (an update in place, ``lo[k] = v if v < lo[k] else
    lo[k]``, becomes a masked store, microcoded on AMD CPUs: 1.14 against 0.29 ns an
    element), and the non-finite flags (``v - v`` summed: NaN where a residual is NaN or
    infinite)."""
    WI = buf.shape[0]
    bad = scratch[5]
    lov = scratch[1]
    hiv = scratch[2]
    xs = xf[e0:e0 + WI]
    for k in range(WI):
        v = xs[k] - buf[k]
        lov[k] = v
        hiv[k] = v
        bad[k] = v - v
    for h in range(1, rows):
        src = 1 + 2 * ((h - 1) & 1)  # the buffers of the rows before: 1, 2 or 3, 4
        dst = 4 - src  # 3, 4 or 1, 2
        lo_in = scratch[src]
        hi_in = scratch[src + 1]
        lo_out = scratch[dst]
        hi_out = scratch[dst + 1]
        xs = xf[e0 + h * WI:e0 + (h + 1) * WI]
        for k in range(WI):
            v = xs[k] - buf[k]
            lo = lo_in[k]
            hi = hi_in[k]
            lo_out[k] = v if v < lo else lo
            hi_out[k] = v if v > hi else hi
            bad[k] += v - v
    last = 1 + 2 * ((rows - 1) & 1)
    lov = scratch[last]
    hiv = scratch[last + 1]
    lo = lov[0]
    hi = hiv[0]
    nan = False
    for k in range(WI):
        lo = lov[k] if lov[k] < lo else lo
        hi = hiv[k] if hiv[k] > hi else hi
        nan |= bad[k] != 0
    return lo, hi, not nan and (lo - lo) == 0 and (hi - hi) == 0


@njit(inline="always", cache=True)
def _minmax_task(xf, lfc, a, hb, H, W, I, bh, bw, scratch, row_stats, out_lo, out_hi, out_ok):
    """Row-block ``(a, hb)``'s residual min/max: one entry (``out_*[a * Hb + hb]``) or, with
    ``row_stats``, one per row (``out_*[a * H + h]``: min and max, both NaN if a value of the
    row is not finite, whose stats are NaN either way; ``out_ok`` unused). ``scratch``:
    ``(6, W * I)``, its first row the upsampled means (:func:`_rows_minmax` uses the others)."""
    buf = scratch[0]
    _upsample(lfc[a, hb], bw, I, 0, W * I, buf)
    WI = W * I
    h0 = hb * bh
    h1 = min(h0 + bh, H)
    if row_stats:
        tmp = scratch[1]
        for h in range(h0, h1):
            r = a * H + h
            xs = xf[r * WI:(r + 1) * WI]
            for k in range(WI):
                tmp[k] = xs[k] - buf[k]
            lo, hi, finite = minmax(tmp)
            out_lo[r] = lo if finite else np.nan
            out_hi[r] = hi if finite else np.nan
    else:
        t = a * lfc.shape[1] + hb
        out_lo[t], out_hi[t], out_ok[t] = _rows_minmax(xf, buf, (a * H + h0) * WI, h1 - h0, scratch)


@njit(parallel=True, error_model="numpy", cache=True)
def division_minmax_kernel(xf, lfc, H, W, I, bh, bw, row_stats, out_lo, out_hi, out_ok):
    """The residual's min/max (:func:`_minmax_task`) of every row-block, from the stored
    block means ``lfc`` (compute dtype)."""
    A = lfc.shape[0]
    Hb = lfc.shape[1]
    per, chunks = _task_chunks(A * Hb, bh * W * I)
    for c in prange(chunks):
        scratch = np.empty((6, W * I), xf.dtype)
        for t in range(c * per, min((c + 1) * per, A * Hb)):
            a = t // Hb
            _minmax_task(xf, lfc, a, t - a * Hb, H, W, I, bh, bw, scratch, row_stats, out_lo, out_hi, out_ok)


@njit(inline="always", cache=True)
def _block_means_range(xf, a, hb, H, W, I, bh, bw, zero, scratch, acc):
    """:func:`_block_means` of row-block ``(a, hb)`` into ``acc``, and its residual's min, max
    and finiteness (as :func:`_rows_minmax`) from the same pass over its rows. Within a
    block the residual is ``x - m`` with one mean ``m`` per column, and rounding is monotone,
    so ``min fl(x - m) = fl(min x - m)``: the columns' min and max of ``x`` are taken beside
    their sums (in the two-buffer form of :func:`_rows_minmax`), and the means subtracted
    from them at the end, bit for bit the residual's min and max. ``zero``: 0 in the dtype
    of ``xf``; ``scratch``: ``(6, W * I)``, row 0 the column sums."""
    WI = W * I
    col = scratch[0]
    bad = scratch[5]
    h0 = hb * bh
    h1 = min(h0 + bh, H)
    if h1 - h0 == 8:  # DIVISION's B = 8: all rows in one loop, nothing stored between rows
        _eight_rows_range(xf[(a * H + h0) * WI:(a * H + h1) * WI], WI, zero, scratch)
        return _blocks_range(W, I, bw, h1 - h0, scratch, acc)
    row = xf[(a * H + h0) * WI:(a * H + h0 + 1) * WI]
    lov = scratch[1]
    hiv = scratch[2]
    for k in range(WI):
        v = row[k]
        col[k] = zero + v  # the reference's order of additions (0 + v: -0.0 sums to +0.0)
        lov[k] = v
        hiv[k] = v
        bad[k] = v - v
    for h in range(h0 + 1, h1):
        src = 1 + 2 * ((h - h0 - 1) & 1)
        dst = 4 - src
        lo_in = scratch[src]
        hi_in = scratch[src + 1]
        lo_out = scratch[dst]
        hi_out = scratch[dst + 1]
        row = xf[(a * H + h) * WI:(a * H + h + 1) * WI]
        for k in range(WI):
            v = row[k]
            col[k] += v
            lo = lo_in[k]
            hi = hi_in[k]
            lo_out[k] = v if v < lo else lo
            hi_out[k] = v if v > hi else hi
            bad[k] += v - v
    last = 1 + 2 * ((h1 - h0 - 1) & 1)
    if last != 1:
        scratch[1, :] = scratch[3]
        scratch[2, :] = scratch[4]
    return _blocks_range(W, I, bw, h1 - h0, scratch, acc)


@njit(inline="always", cache=True)
def _eight_rows_range(rows, WI, zero, scratch):
    """Column sums (the reference's order, from ``zero``, 0 in the dtype of ``rows``), min,
    max and non-finite flags of 8 rows of ``WI`` (flat ``rows``) into ``scratch`` rows 0, 1,
    2 and 5, in one loop: no partial result is stored and reloaded between rows (3.4x faster
    than row by row at 64 columns in a micro-benchmark)."""
    col = scratch[0]
    lov = scratch[1]
    hiv = scratch[2]
    bad = scratch[5]
    r0 = rows[0:WI]
    r1 = rows[WI:2 * WI]
    r2 = rows[2 * WI:3 * WI]
    r3 = rows[3 * WI:4 * WI]
    r4 = rows[4 * WI:5 * WI]
    r5 = rows[5 * WI:6 * WI]
    r6 = rows[6 * WI:7 * WI]
    r7 = rows[7 * WI:8 * WI]
    for k in range(WI):
        v0 = r0[k]
        v1 = r1[k]
        v2 = r2[k]
        v3 = r3[k]
        v4 = r4[k]
        v5 = r5[k]
        v6 = r6[k]
        v7 = r7[k]
        col[k] = (((((((zero + v0) + v1) + v2) + v3) + v4) + v5) + v6) + v7
        a0 = v0 if v0 < v1 else v1
        a1 = v2 if v2 < v3 else v3
        a2 = v4 if v4 < v5 else v5
        a3 = v6 if v6 < v7 else v7
        a0 = a0 if a0 < a1 else a1
        a2 = a2 if a2 < a3 else a3
        lov[k] = a0 if a0 < a2 else a2
        b0 = v0 if v0 > v1 else v1
        b1 = v2 if v2 > v3 else v3
        b2 = v4 if v4 > v5 else v5
        b3 = v6 if v6 > v7 else v7
        b0 = b0 if b0 > b1 else b1
        b2 = b2 if b2 > b3 else b3
        hiv[k] = b0 if b0 > b2 else b2
        bad[k] = (((v0 - v0) + (v1 - v1)) + ((v2 - v2) + (v3 - v3))) + (((v4 - v4) + (v5 - v5)) + ((v6 - v6) + (v7 - v7)))


@njit(inline="always", cache=True)
def _blocks_range(W, I, bw, rows, scratch, acc):
    """From a row-block's column sums, min, max and flags (``scratch`` rows 0, 1, 2, 5):
    its block means into ``acc`` ``(Wb, I)`` (added in the reference's order, divided in
    float64, rounded once) and its residual's min, max and finiteness, ``min x - m``,
    ``max x - m`` per column."""
    col = scratch[0]
    lov = scratch[1]
    hiv = scratch[2]
    bad = scratch[5]
    _column_block_means(col, W, I, bw, rows, acc)
    nan = False
    lo = np.inf
    hi = -np.inf
    for wb in range(acc.shape[0]):
        w0 = wb * bw
        w1 = min(w0 + bw, W)
        for w in range(w0, w1):
            for i in range(I):
                k = w * I + i
                m = acc[wb, i]
                rlo = lov[k] - m
                rhi = hiv[k] - m
                lo = rlo if rlo < lo else lo
                hi = rhi if rhi > hi else hi
                nan |= bad[k] != 0
    return lo, hi, not nan and (lo - lo) == 0 and (hi - hi) == 0


@njit(parallel=True, error_model="numpy", cache=True)
def block_mean_minmax_kernel(x, bh, bw, out, row_stats, out_lo, out_hi, out_ok):
    """:func:`block_mean_kernel` and :func:`division_minmax_kernel` in one pass over ``x``
    (only when the means are stored in the compute dtype, float32/float64 input): with one
    range per row-block, from the columns' min and max (:func:`_block_means_range`); with
    ``row_stats``, each row's residual range right after its block's means, while its rows
    are in cache."""
    A, H, W, I = x.shape
    Hb = out.shape[1]
    xf = x.reshape(A * H * W * I)
    per, chunks = _task_chunks(A * Hb, bh * W * I)
    for c in prange(chunks):
        scratch = np.empty((6, W * I), x.dtype)
        zero = np.zeros(1, x.dtype)[0]
        for t in range(c * per, min((c + 1) * per, A * Hb)):
            a = t // Hb
            hb = t - a * Hb
            if row_stats:
                _block_means(xf, a, hb, H, W, I, bh, bw, scratch[0], out[a, hb])
                _minmax_task(xf, out, a, hb, H, W, I, bh, bw, scratch, row_stats, out_lo, out_hi, out_ok)
            else:
                out_lo[t], out_hi[t], out_ok[t] = _block_means_range(xf, a, hb, H, W, I, bh, bw, zero, scratch,
                                                                     out[a, hb])


@njit(inline="always", cache=True)
def _row_position(e, WI, H, bh):
    """Where flat index ``e`` lies in the view ``(A, H, W, I)`` with row-blocks of ``bh``
    rows: ``(row, a, hb, hr, k)``, the flat row ``a * H + h``, its ``a``, its row-block
    ``hb``, its row within the block ``hr`` and the offset ``k`` in the row."""
    row = e // WI
    a = row // H
    h = row - a * H
    hb = h // bh
    return row, a, hb, h - hb * bh, e - row * WI


@njit(inline="always", cache=True)
def _next_row(row, a, hb, hr, H, bh):
    """The position of the next row (:func:`_row_position` without its three 64-bit
    divisions, on rows of 64 elements as many per 64 codes) and whether it starts a new
    row-block."""
    hr += 1
    if (hb * bh + hr) == H:  # the next sample's first row
        return row + 1, a + 1, 0, 0, True
    if hr == bh:
        return row + 1, a, hb + 1, 0, True
    return row + 1, a, hb, hr, False


@njit(inline="always", cache=True)
def _up_row(lfc_row, bw, I, WI, buf, wide):
    """The codes and decode kernels' row buffer at a new row-block: its whole upsampled row,
    or nothing for rows longer than a chunk (``wide``: :func:`_up_piece` builds each piece)."""
    if not wide:
        _upsample(lfc_row, bw, I, 0, WI, buf)


@njit(inline="always", cache=True)
def _up_piece(lfc_row, bw, I, k0, L, buf, wide):
    """The upsampled means of elements ``k0 .. k0 + L`` of the current row: a slice of the
    row buffer, or (``wide``) that piece alone, built now into its start."""
    if wide:
        _upsample(lfc_row, bw, I, k0, L, buf)
        return buf[0:L]
    return buf[k0:k0 + L]


@njit(parallel=True, error_model="numpy", cache=True)
def division_codes_kernel(xf, lfc, H, W, I, bh, bw, seed, bits, consts, mins, scales, out_packed):
    """Codes ``floor((x - up - m) * s + u)`` (clamped; 0 for NaN stats), packed. One task per
    chunk of :data:`AFFINE_CHUNK` elements (whole bytes of codes): its codes go to a
    chunk-sized scratch in cache and are packed at once; the upsampled means of a row are
    rebuilt only when the row-block changes (rows longer than a chunk: the chunk's piece of
    its row, each time; building the whole row in every chunk, 8 times over for rows of
    2**17, had cost 22 ns an element). ``consts`` (compute dtype) = [2**bits - 1, 0];
    ``mins``, ``scales`` (compute dtype): one pair for the tensor, or one per row ``(a, h)``."""
    WI = W * I
    n = xf.shape[0]
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    levels = consts[0]
    zero = consts[1]
    per_row = mins.shape[0] > 1
    wide = WI > AFFINE_CHUNK  # rows longer than a chunk: each chunk upsamples its own piece
    for c in prange((n + AFFINE_CHUNK - 1) // AFFINE_CHUNK):
        e0 = c * AFFINE_CHUNK
        e1 = min(e0 + AFFINE_CHUNK, n)
        sc = np.empty(e1 - e0, np.uint8)
        us = np.empty(e1 - e0, np.float32)
        _noise(e0, us, s0, s1)
        buf = np.empty(min(WI, AFFINE_CHUNK), xf.dtype)
        row, a, hb, hr, k0 = _row_position(e0, WI, H, bh)
        _up_row(lfc[a, hb], bw, I, WI, buf, wide)
        e = e0
        while e < e1:
            L = min(WI - k0, e1 - e)  # this row's elements in the chunk
            m = mins[row] if per_row else mins[0]
            s = scales[row] if per_row else scales[0]
            xs = xf[e:e + L]
            bs = _up_piece(lfc[a, hb], bw, I, k0, L, buf, wide)
            cs = sc[e - e0:e - e0 + L]
            u = us[e - e0:e - e0 + L]
            for j in range(L):
                qf = np.floor(((xs[j] - bs[j]) - m) * s + u[j])
                qf = qf if qf == qf else zero
                cs[j] = np.uint8(min(max(qf, zero), levels))
            e += L
            row, a, hb, hr, new_block = _next_row(row, a, hb, hr, H, bh)
            k0 = 0
            if new_block and e < e1:
                _up_row(lfc[a, hb], bw, I, WI, buf, wide)
        o0 = e0 * bits // 8
        pack_codes(sc, out_packed[o0:o0 + ((e1 - e0) * bits + 7) // 8], bits)


@njit(parallel=True, error_model="numpy", cache=True)
def division_decode_kernel(packed, lfc, H, W, I, bh, bw, bits, mins, scales, seed, kind, out):
    """``out = up + (m + q / s)`` (flat, compute dtype); one task per chunk of
    :data:`AFFINE_CHUNK` elements, unpacked into a chunk-sized scratch, then
    :func:`round_half` of the chunk (``kind``, the decode seed ``seed``); ``mins``,
    ``scales``: one pair for the tensor, or one per row ``(a, h)``."""
    WI = W * I
    s0 = np.uint64(seed) & _MASK32
    s1 = (np.uint64(seed) >> np.uint64(32)) & _MASK32
    n = out.shape[0]
    per_row = mins.shape[0] > 1
    wide = WI > AFFINE_CHUNK  # rows longer than a chunk: each chunk upsamples its own piece
    for c in prange((n + AFFINE_CHUNK - 1) // AFFINE_CHUNK):
        e0 = c * AFFINE_CHUNK
        e1 = min(e0 + AFFINE_CHUNK, n)
        sc = np.empty(e1 - e0, np.uint8)
        unpack_codes(packed[e0 * bits // 8:], sc, bits)
        buf = np.empty(min(WI, AFFINE_CHUNK), out.dtype)
        row, a, hb, hr, k0 = _row_position(e0, WI, H, bh)
        _up_row(lfc[a, hb], bw, I, WI, buf, wide)
        e = e0
        while e < e1:
            L = min(WI - k0, e1 - e)
            m = mins[row] if per_row else mins[0]
            s = scales[row] if per_row else scales[0]
            ys = out[e:e + L]
            bs = _up_piece(lfc[a, hb], bw, I, k0, L, buf, wide)
            cs = sc[e - e0:e - e0 + L]
            for j in range(L):
                ys[j] = bs[j] + (m + np.float32(cs[j]) / s)
            e += L
            row, a, hb, hr, new_block = _next_row(row, a, hb, hr, H, bh)
            k0 = 0
            if new_block and e < e1:
                _up_row(lfc[a, hb], bw, I, WI, buf, wide)
        round_half(out[e0:e1], e0, s0, s1, kind)
