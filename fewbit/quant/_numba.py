"""CPU kernels of the group quantizer in numba (imported lazily, never by ``import fewbit``).

They implement exactly the steps of :mod:`fewbit.quant._reference` (docs/method.md §7), so the
stored stats and the packed codes are bit-identical to the reference for both rounding
modes (the noise is the same counter-based hash). Per chunk of groups (about 16K
elements, one prange iteration): the stats of each group from its min/max (computed before
by torch's vectorised amin/amax), the codes of each group into a scratch buffer (branch-free
loops that LLVM vectorises), then whole bytes packed (docs/method.md §6); the stream layout equals
the 64-bit-word packing of docs/kernels.md. Arithmetic is in the dtype of ``x`` (float32 or
float64); no fastmath, so no FMA
contraction: ``(x - m) * s + u`` is rounded twice as in torch.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

if numba.config.THREADING_LAYER == "default":  # docs/kernels.md: omp beats workqueue here
    try:
        numba.config.THREADING_LAYER = "omp"
    except Exception:  # pragma: no cover - layer already fixed by another import
        pass

_MASK32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", cache=True)
def _lowbias32(x):
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


@njit(inline="always", cache=True)
def _floor_to_grid(v, mant_bits, min_exp, fmax):
    """Largest value with ``mant_bits`` significant bits (exponent >= min_exp) <= v.

    ``v`` finite float64; returns float64 (``-inf``/``inf`` past ``fmax``).
    """
    if v == 0.0:
        return v
    e = math.frexp(v)[1]  # v = f * 2**e, 0.5 <= |f| < 1
    q = math.ldexp(1.0, max(e - mant_bits, min_exp))
    r = np.floor(v / q) * q
    if r > fmax:
        return np.inf
    if r < -fmax:
        return -np.inf
    return r


@njit(inline="always", cache=True)
def _uniform(e, s0, s1):
    """``u`` of flat index ``e`` (:func:`fewbit.quant._reference.uniform_noise`), uint64 words < 2**32."""
    j = np.uint64(e)
    h = _lowbias32(_lowbias32((j & _MASK32) ^ s0) ^ s1 ^ (j >> np.uint64(32)))
    return np.float32(h >> np.uint64(8)) * np.float32(2.0 ** -24)


@njit(inline="always", cache=True)
def _prev_on_grid(v, mant_bits, min_exp, fmax):
    """Largest grid value ``< v`` for ``v > 0`` on the grid (float64 in and out)."""
    f, e = math.frexp(v)
    return _floor_to_grid(math.ldexp(f - 2.0 ** -53, e), mant_bits, min_exp, fmax)  # v - 1 ulp64


@njit(parallel=True, error_model="numpy", cache=True)
def quantize_kernel(x, lo_arr, hi_arr, bits, group_size, chunk_groups, seed, stochastic, mant_bits,
                    min_exp, fmax, consts, out_packed, out_m, out_s):
    """Fill ``out_packed`` (uint8), ``out_m``/``out_s`` (dtype of x, values on the stats grid).

    ``lo_arr``/``hi_arr``: per-group min and max of ``x`` (NaN-propagating, computed by
    torch's vectorised ``amin``/``amax``: a scalar min/max loop does not vectorise here).
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
    one = consts[1]
    half = consts[2]
    fmax_c = consts[3]
    zero = consts[4]
    for c in prange(n_chunks):
        g0 = c * chunk_groups
        g1 = min(g0 + chunk_groups, n_groups)
        # 1. stats of every group of the chunk
        for g in range(g0, g1):
            lo = lo_arr[g]
            hi = hi_arr[g]
            ok = (lo - lo) == zero and (hi - hi) == zero  # both finite (not NaN, not inf)
            if ok:
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
        # 2. codes of the chunk into a scratch buffer (branch-free loops that vectorise),
        #    then packed into whole bytes (the chunk starts on a byte boundary)
        e0 = g0 * G
        e1 = min(g1 * G, n)
        L = e1 - e0
        L8 = (L + 7) // 8 * 8
        sc = np.zeros(L8, np.uint8)
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
                for i in range(b - a):
                    t = (xs[i] - m) * s
                    qf = np.floor(t + _uniform(a + i, s0, s1))
                    cs[i] = np.uint8(min(max(qf, zero), levels))
            else:
                for i in range(b - a):
                    t = (xs[i] - m) * s
                    qf = np.floor(t + half)
                    cs[i] = np.uint8(min(max(qf, zero), levels))
        _pack_chunk(sc, L, bits, out_packed[e0 * bits // 8:(e0 * bits // 8) + (L * bits + 7) // 8])


@njit(inline="always", cache=True)
def _pack_chunk(sc, L, bits, out):
    """Pack the codes ``sc`` (zero-padded to a multiple of 8) into ``out`` (docs/method.md §6)."""
    nb = out.shape[0]
    if bits == 8:
        for j in range(nb):
            out[j] = sc[j]
    elif bits == 4:
        for j in range(nb):
            out[j] = sc[2 * j] | (sc[2 * j + 1] << 4)
    elif bits == 2:
        for j in range(nb):
            out[j] = sc[4 * j] | (sc[4 * j + 1] << 2) | (sc[4 * j + 2] << 4) | (sc[4 * j + 3] << 6)
    else:
        for j in range(nb):
            v = sc[8 * j]
            for k in range(1, 8):
                v |= sc[8 * j + k] << k
            out[j] = v


@njit(inline="always", cache=True)
def _unpack_chunk(p, bits, sc):
    """Inverse of :func:`_pack_chunk`: ``sc`` (length a multiple of 8) from the bytes ``p``."""
    nb = p.shape[0]
    if bits == 8:
        for j in range(nb):
            sc[j] = p[j]
    elif bits == 4:
        for j in range(nb):
            v = p[j]
            sc[2 * j] = v & 15
            sc[2 * j + 1] = v >> 4
    elif bits == 2:
        for j in range(nb):
            v = p[j]
            sc[4 * j] = v & 3
            sc[4 * j + 1] = (v >> 2) & 3
            sc[4 * j + 2] = (v >> 4) & 3
            sc[4 * j + 3] = v >> 6
    else:
        for j in range(nb):
            v = p[j]
            for k in range(8):
                sc[8 * j + k] = (v >> k) & 1


@njit(parallel=True, error_model="numpy", cache=True)
def dequantize_kernel(packed, m_arr, s_arr, bits, group_size, chunk_groups, out):
    """``out[e] = m + q / s`` in the dtype of ``out`` (float32 or float64)."""
    n = out.shape[0]
    G = group_size
    n_groups = (n + G - 1) // G
    n_chunks = (n_groups + chunk_groups - 1) // chunk_groups
    for c in prange(n_chunks):
        g0 = c * chunk_groups
        g1 = min(g0 + chunk_groups, n_groups)
        e0 = g0 * G
        e1 = min(g1 * G, n)
        L = e1 - e0
        sc = np.zeros((L + 7) // 8 * 8, np.uint8)
        o0 = e0 * bits // 8
        _unpack_chunk(packed[o0:o0 + (L * bits + 7) // 8], bits, sc)
        for g in range(g0, g1):
            a = g * G
            b = min(a + G, n)
            m = m_arr[g]
            s = s_arr[g]
            cs = sc[a - e0:b - e0]
            ys = out[a:b]
            for i in range(b - a):
                ys[i] = m + np.float32(cs[i]) / s
