"""numba kernels of fewbit's CPU backend (imported lazily by :mod:`fewbit.ops._cpu`).

Written for the loop vectoriser (docs/kernels.md): ``error_model="numpy"``, loops over
slices starting at 0, no fastmath (it would break NaN comparisons), chunks of
``_CHUNK`` elements per parallel iteration with the codes of a chunk in a uint8 buffer:

- encode, up to 15 borders: ``c = codes[0] + sum_j (d_j if not (x <= b_j))`` unrolled
  with the borders as scalars, padded with +inf and ``d = 0`` to 1, 3, 7 or 15 (+inf
  padding is never crossed by a finite x or +inf, and adds 0 for NaN); ~1.5x faster
  than the pass-per-border form below;
- encode, more borders: ``cb = codes[0]``, then for each border ``j`` one vectorised pass
  ``cb += (codes[j+1] - codes[j]) mod 256 if not (x <= b_j)`` (uint8 lanes; modular
  sums give exactly ``codes[i(x)]``); NaN is above every border as in searchsorted
  (a branch-free binary search per element measured 5x slower even at 255 borders);
- pack: 8 codes -> one 64-bit little-endian word -> its low ``bits`` bytes (docs/method.md §6);
- decode: the inverse unpack, then ``grad * values[code]`` (a select tree on the code
  bits for bits <= 4, which vectorises without gathers), and +0 where the level is 0 for
  tables whose zero levels torch selects; bfloat16 in and out through int16 bit
  patterns (exact widening; round-to-nearest-even narrowing, NaN -> 0x7FC0);
- non-finite inputs: encode counts them per chunk (``v - v != 0``) when asked; the
  rare path that lists them and patches the gradient is pure torch
  (:mod:`fewbit.ops._nonfinite`).
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

_CHUNK = 4096  # elements per parallel chunk (a multiple of 8)


def _widen(xs):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_ov(xs):
    if xs.dtype == types.int16 or xs.dtype == types.uint16:  # bfloat16 bit patterns

        def impl(xs):
            m = xs.shape[0]
            ub = np.empty(m, np.uint32)
            for i in range(m):
                ub[i] = np.uint32(np.uint16(xs[i])) << np.uint32(16)
            return ub.view(np.float32)

        return impl

    def impl(xs):
        return xs

    return impl


def _prod_buf(os_):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_prod_buf, inline="always")
def _prod_buf_ov(os_):
    if os_.dtype == types.uint16:

        def impl(os_):
            return np.empty(os_.shape[0], np.float32)

        return impl

    def impl(os_):
        return os_

    return impl


def _store(os_, prod):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_store, inline="always")
def _store_ov(os_, prod):
    if os_.dtype == types.uint16:  # bfloat16 bit patterns, prod is float32

        def impl(os_, prod):
            ub = prod.view(np.uint32)
            for i in range(os_.shape[0]):
                u = ub[i]
                r = (u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16)
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    r = np.uint32(0x7FC0)
                os_[i] = np.uint16(r)

        return impl

    def impl(os_, prod):  # prod is os_ itself (see _prod_buf)
        pass

    return impl


# _codes_u1 / _u3 / _u7 / _u15 repeat one line per border on purpose: borders held as
# scalars (registers) let LLVM vectorise the loop; a loop over a borders array does not.
@njit(error_model="numpy", cache=True, nogil=True)
def _codes_u1(xf, cb, c0, b0, d0):
    """Codes for up to 1 borders (padded with +inf / 0), unrolled (vectorises)."""
    for i in range(xf.shape[0]):
        v = xf[i]
        c = c0
        c += d0 if not (v <= b0) else np.int32(0)
        cb[i] = np.uint8(c & 255)


@njit(error_model="numpy", cache=True, nogil=True)
def _codes_u3(xf, cb, c0, b0, b1, b2, d0, d1, d2):
    """Codes for up to 3 borders (padded with +inf / 0), unrolled (vectorises)."""
    for i in range(xf.shape[0]):
        v = xf[i]
        c = c0
        c += d0 if not (v <= b0) else np.int32(0)
        c += d1 if not (v <= b1) else np.int32(0)
        c += d2 if not (v <= b2) else np.int32(0)
        cb[i] = np.uint8(c & 255)


@njit(error_model="numpy", cache=True, nogil=True)
def _codes_u7(xf, cb, c0, b0, b1, b2, b3, b4, b5, b6, d0, d1, d2, d3, d4, d5, d6):
    """Codes for up to 7 borders (padded with +inf / 0), unrolled (vectorises)."""
    for i in range(xf.shape[0]):
        v = xf[i]
        c = c0
        c += d0 if not (v <= b0) else np.int32(0)
        c += d1 if not (v <= b1) else np.int32(0)
        c += d2 if not (v <= b2) else np.int32(0)
        c += d3 if not (v <= b3) else np.int32(0)
        c += d4 if not (v <= b4) else np.int32(0)
        c += d5 if not (v <= b5) else np.int32(0)
        c += d6 if not (v <= b6) else np.int32(0)
        cb[i] = np.uint8(c & 255)


@njit(error_model="numpy", cache=True, nogil=True)
def _codes_u15(xf, cb, c0, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14):
    """Codes for up to 15 borders (padded with +inf / 0), unrolled (vectorises)."""
    for i in range(xf.shape[0]):
        v = xf[i]
        c = c0
        c += d0 if not (v <= b0) else np.int32(0)
        c += d1 if not (v <= b1) else np.int32(0)
        c += d2 if not (v <= b2) else np.int32(0)
        c += d3 if not (v <= b3) else np.int32(0)
        c += d4 if not (v <= b4) else np.int32(0)
        c += d5 if not (v <= b5) else np.int32(0)
        c += d6 if not (v <= b6) else np.int32(0)
        c += d7 if not (v <= b7) else np.int32(0)
        c += d8 if not (v <= b8) else np.int32(0)
        c += d9 if not (v <= b9) else np.int32(0)
        c += d10 if not (v <= b10) else np.int32(0)
        c += d11 if not (v <= b11) else np.int32(0)
        c += d12 if not (v <= b12) else np.int32(0)
        c += d13 if not (v <= b13) else np.int32(0)
        c += d14 if not (v <= b14) else np.int32(0)
        cb[i] = np.uint8(c & 255)


@njit(inline="always")
def _codes_linear(xf, borders, codes, cb):
    m = xf.shape[0]
    c0 = np.uint8(codes[0])
    for i in range(m):
        cb[i] = c0
    for j in range(borders.shape[0]):
        bj = borders[j]
        dj = np.uint8((codes[j + 1] - codes[j]) & 255)
        for i in range(m):
            cb[i] += dj if not (xf[i] <= bj) else np.uint8(0)


@njit(inline="always")
def _pack(cb, os_, bits):
    for q in range(cb.shape[0] // 8):
        w = np.uint64(0)
        for k in range(8):
            w |= np.uint64(cb[8 * q + k]) << np.uint64(k * bits)
        for t in range(bits):
            os_[bits * q + t] = np.uint8((w >> np.uint64(8 * t)) & np.uint64(255))


@njit(inline="always")
def _pack_tail(cb, os_, bits):
    w = np.uint64(0)
    for k in range(cb.shape[0]):
        w |= np.uint64(cb[k]) << np.uint64(k * bits)
    for t in range(os_.shape[0]):
        os_[t] = np.uint8((w >> np.uint64(8 * t)) & np.uint64(255))


@njit(inline="always")
def _count_nonfinite(xf):
    """Number of NaN and +-inf in ``xf``: ``v - v`` is 0 exactly for finite ``v``
    (vectorises: one subtract, one compare, one add per element)."""
    c = 0
    for i in range(xf.shape[0]):
        v = xf[i]
        c += 0 if (v - v) == 0 else 1
    return c


@njit(parallel=True, error_model="numpy", cache=True, nogil=True)
def encode(x, borders, codes, out, bits, count_nonfinite):
    """Packed codes of ``x`` (1-D, float32/float64 or bf16 bits as int16) into ``out``.

    ``borders``: ``(nb,)`` in the compare dtype; ``codes``: ``(nb + 1,)`` int64.
    Returns the number of non-finite elements of ``x`` if ``count_nonfinite``, else 0
    (counted per chunk while the chunk is in cache; fewbit.ops._nonfinite).
    """
    return _encode_body(x, borders, codes, out, bits, count_nonfinite)


@njit(error_model="numpy", cache=True, nogil=True)
def encode_serial(x, borders, codes, out, bits, count_nonfinite):
    """:func:`encode` on the calling thread only, for small inputs: a parallel launch
    costs microseconds, and on a loaded machine a wait for a descheduled worker."""
    return _encode_body(x, borders, codes, out, bits, count_nonfinite)


@njit(inline="always")
def _encode_body(x, borders, codes, out, bits, count_nonfinite):
    n = x.shape[0]
    nfull = n // 8 * 8
    nb = borders.shape[0]
    K = 1 if nb <= 1 else (3 if nb <= 3 else (7 if nb <= 7 else (15 if nb <= 15 else 0)))
    bp = np.full(16, np.inf, borders.dtype)
    dp = np.zeros(16, np.int32)
    for j in range(min(nb, 16)):
        bp[j] = borders[j]
        dp[j] = np.int32(codes[j + 1] - codes[j])
    c0 = np.int32(codes[0])
    nchunks = (nfull + _CHUNK - 1) // _CHUNK
    total = 0
    for ch in prange(nchunks):
        e0 = ch * _CHUNK
        e1 = min(e0 + _CHUNK, nfull)
        xf = _widen(x[e0:e1])
        cb = np.empty(e1 - e0, np.uint8)
        if K == 1:
            _codes_u1(xf, cb, c0, bp[0], dp[0])
        elif K == 3:
            _codes_u3(xf, cb, c0, bp[0], bp[1], bp[2], dp[0], dp[1], dp[2])
        elif K == 7:
            _codes_u7(xf, cb, c0, bp[0], bp[1], bp[2], bp[3], bp[4], bp[5], bp[6],
                      dp[0], dp[1], dp[2], dp[3], dp[4], dp[5], dp[6])
        elif K == 15:
            _codes_u15(xf, cb, c0, bp[0], bp[1], bp[2], bp[3], bp[4], bp[5], bp[6], bp[7],
                       bp[8], bp[9], bp[10], bp[11], bp[12], bp[13], bp[14],
                       dp[0], dp[1], dp[2], dp[3], dp[4], dp[5], dp[6], dp[7],
                       dp[8], dp[9], dp[10], dp[11], dp[12], dp[13], dp[14])
        else:
            _codes_linear(xf, borders, codes, cb)
        _pack_dispatch(cb, out[e0 // 8 * bits:e1 // 8 * bits], bits)
        total += _count_nonfinite(xf) if count_nonfinite else 0
    if nfull < n:
        xf = _widen(x[nfull:n])
        cb = np.empty(n - nfull, np.uint8)
        _codes_linear(xf, borders, codes, cb)  # < 8 elements
        _pack_tail(cb, out[nfull // 8 * bits:], bits)
        total += _count_nonfinite(xf) if count_nonfinite else 0
    return total


@njit(inline="always")
def _unpack_full(ps, cb, bits):
    mask = np.uint64((1 << bits) - 1)
    for q in range(cb.shape[0] // 8):
        w = np.uint64(0)
        for t in range(bits):
            w |= np.uint64(ps[bits * q + t]) << np.uint64(8 * t)
        for k in range(8):
            cb[8 * q + k] = np.uint8((w >> np.uint64(k * bits)) & mask)


@njit(inline="always")
def _unpack_tail(ps, cb, bits):
    """The last ``m < 8`` codes ``cb`` from the ``ceil(m * bits / 8)`` bytes ``ps`` (inverse of
    :func:`_pack_tail`)."""
    mask = np.uint64((1 << bits) - 1)
    w = np.uint64(0)
    for t in range((cb.shape[0] * bits + 7) // 8):  # packed_nbytes, inside the kernel
        w |= np.uint64(ps[t]) << np.uint64(8 * t)
    for k in range(cb.shape[0]):
        cb[k] = np.uint8((w >> np.uint64(k * bits)) & mask)


@njit(inline="always")
def pack_codes(cb, os_, bits):
    """Pack the uint8 codes ``cb`` (any length ``m``) into the ``ceil(m * bits / 8)`` bytes
    ``os_``: the stream of docs/method.md §6, equal to :func:`fewbit.packing.pack_reference`.
    The one numba packer of fewbit (few-bit ops and group quantizer)."""
    mfull = cb.shape[0] // 8 * 8
    _pack_dispatch(cb[:mfull], os_[:mfull // 8 * bits], bits)
    if mfull < cb.shape[0]:
        _pack_tail(cb[mfull:], os_[mfull // 8 * bits:], bits)


@njit(inline="always")
def unpack_codes(ps, cb, bits):
    """Inverse of :func:`pack_codes` (:func:`fewbit.packing.unpack_reference`): the
    ``cb.shape[0]`` codes from the bytes ``ps``."""
    mfull = cb.shape[0] // 8 * 8
    _unpack_dispatch(ps, cb[:mfull], bits)
    if mfull < cb.shape[0]:
        _unpack_tail(ps[mfull // 8 * bits:], cb[mfull:], bits)


# The two dispatchers below repeat one call per bit width on purpose: a literal ``bits``
# lets numba unroll the inner loops of _pack / _unpack_full (a runtime width does not).
@njit(inline="always")
def _unpack_dispatch(ps, cb, bits):
    if bits == 1:
        _unpack_full(ps, cb, 1)
    elif bits == 2:
        _unpack_full(ps, cb, 2)
    elif bits == 3:
        _unpack_full(ps, cb, 3)
    elif bits == 4:
        _unpack_full(ps, cb, 4)
    elif bits == 5:
        _unpack_full(ps, cb, 5)
    elif bits == 6:
        _unpack_full(ps, cb, 6)
    elif bits == 7:
        _unpack_full(ps, cb, 7)
    else:
        _unpack_full(ps, cb, 8)


@njit(inline="always")
def _pack_dispatch(cb, os_, bits):
    if bits == 1:
        _pack(cb, os_, 1)
    elif bits == 2:
        _pack(cb, os_, 2)
    elif bits == 3:
        _pack(cb, os_, 3)
    elif bits == 4:
        _pack(cb, os_, 4)
    elif bits == 5:
        _pack(cb, os_, 5)
    elif bits == 6:
        _pack(cb, os_, 6)
    elif bits == 7:
        _pack(cb, os_, 7)
    else:
        _pack(cb, os_, 8)


@njit(inline="always")
def _times(g, val, zsel):
    """``g * val``, or +0 where ``zsel`` and ``val == 0`` (torch's select)."""
    p = g * val
    return abs(val) if (zsel and val == 0) else p  # abs(val) is +0 of val's type


# _mul_lut spells out a select tree per bit width (numba cannot unroll one from a loop):
# v{i} = values[i]; s{b}_{l}_{j} = node j of level l of the tree for b bits, chosen by code
# bit l; val{b} = the root. Loop variables carry the width (i{b}, cc{b}) so that numba types
# each branch's variables apart.
@njit(error_model="numpy", cache=True, nogil=True)
def _mul_lut(gf, cb, values, prod, bits, zsel):
    """``prod = gf * values[cb]`` (+0 where the level is 0 if ``zsel``); for bits <= 4 a
    select tree on the code bits (no gather: ~1.5x faster here), else an indexed load."""
    m = gf.shape[0]
    if bits == 1:
        v0 = values[0]; v1 = values[1]
        for i1 in range(m):
            cc1 = cb[i1]
            val1 = v1 if (cc1 >> np.uint8(0)) & np.uint8(1) else v0
            prod[i1] = _times(gf[i1], val1, zsel)
    elif bits == 2:
        v0 = values[0]; v1 = values[1]; v2 = values[2]; v3 = values[3]
        for i2 in range(m):
            cc2 = cb[i2]
            s2_0_0 = v1 if (cc2 >> np.uint8(0)) & np.uint8(1) else v0
            s2_0_1 = v3 if (cc2 >> np.uint8(0)) & np.uint8(1) else v2
            val2 = s2_0_1 if (cc2 >> np.uint8(1)) & np.uint8(1) else s2_0_0
            prod[i2] = _times(gf[i2], val2, zsel)
    elif bits == 3:
        v0 = values[0]; v1 = values[1]; v2 = values[2]; v3 = values[3]; v4 = values[4]; v5 = values[5]; v6 = values[6]; v7 = values[7]
        for i3 in range(m):
            cc3 = cb[i3]
            s3_0_0 = v1 if (cc3 >> np.uint8(0)) & np.uint8(1) else v0
            s3_0_1 = v3 if (cc3 >> np.uint8(0)) & np.uint8(1) else v2
            s3_0_2 = v5 if (cc3 >> np.uint8(0)) & np.uint8(1) else v4
            s3_0_3 = v7 if (cc3 >> np.uint8(0)) & np.uint8(1) else v6
            s3_1_0 = s3_0_1 if (cc3 >> np.uint8(1)) & np.uint8(1) else s3_0_0
            s3_1_1 = s3_0_3 if (cc3 >> np.uint8(1)) & np.uint8(1) else s3_0_2
            val3 = s3_1_1 if (cc3 >> np.uint8(2)) & np.uint8(1) else s3_1_0
            prod[i3] = _times(gf[i3], val3, zsel)
    elif bits == 4:
        v0 = values[0]; v1 = values[1]; v2 = values[2]; v3 = values[3]
        v4 = values[4]; v5 = values[5]; v6 = values[6]; v7 = values[7]
        v8 = values[8]; v9 = values[9]; v10 = values[10]; v11 = values[11]
        v12 = values[12]; v13 = values[13]; v14 = values[14]; v15 = values[15]
        for i4 in range(m):
            cc4 = cb[i4]
            s4_0_0 = v1 if (cc4 >> np.uint8(0)) & np.uint8(1) else v0
            s4_0_1 = v3 if (cc4 >> np.uint8(0)) & np.uint8(1) else v2
            s4_0_2 = v5 if (cc4 >> np.uint8(0)) & np.uint8(1) else v4
            s4_0_3 = v7 if (cc4 >> np.uint8(0)) & np.uint8(1) else v6
            s4_0_4 = v9 if (cc4 >> np.uint8(0)) & np.uint8(1) else v8
            s4_0_5 = v11 if (cc4 >> np.uint8(0)) & np.uint8(1) else v10
            s4_0_6 = v13 if (cc4 >> np.uint8(0)) & np.uint8(1) else v12
            s4_0_7 = v15 if (cc4 >> np.uint8(0)) & np.uint8(1) else v14
            s4_1_0 = s4_0_1 if (cc4 >> np.uint8(1)) & np.uint8(1) else s4_0_0
            s4_1_1 = s4_0_3 if (cc4 >> np.uint8(1)) & np.uint8(1) else s4_0_2
            s4_1_2 = s4_0_5 if (cc4 >> np.uint8(1)) & np.uint8(1) else s4_0_4
            s4_1_3 = s4_0_7 if (cc4 >> np.uint8(1)) & np.uint8(1) else s4_0_6
            s4_2_0 = s4_1_1 if (cc4 >> np.uint8(2)) & np.uint8(1) else s4_1_0
            s4_2_1 = s4_1_3 if (cc4 >> np.uint8(2)) & np.uint8(1) else s4_1_2
            val4 = s4_2_1 if (cc4 >> np.uint8(3)) & np.uint8(1) else s4_2_0
            prod[i4] = _times(gf[i4], val4, zsel)
    else:
        for ig in range(m):
            prod[ig] = _times(gf[ig], values[cb[ig]], zsel)


@njit(parallel=True, error_model="numpy", cache=True, nogil=True)
def decode_mul(g, packed, values, out, bits, select_zero):
    """``out = g * values[code]`` (1-D; float32/float64, or bf16 bits as uint16 with
    float32 values); with ``select_zero``, +0 where the level is 0."""
    _decode_mul_body(g, packed, values, out, bits, select_zero)


@njit(error_model="numpy", cache=True, nogil=True)
def decode_mul_serial(g, packed, values, out, bits, select_zero):
    """:func:`decode_mul` on the calling thread only (small inputs, see :func:`encode_serial`)."""
    _decode_mul_body(g, packed, values, out, bits, select_zero)


@njit(inline="always")
def _decode_mul_body(g, packed, values, out, bits, select_zero):
    n = g.shape[0]
    nchunks = (n + _CHUNK - 1) // _CHUNK
    for ch in prange(nchunks):
        e0 = ch * _CHUNK
        e1 = min(e0 + _CHUNK, n)
        m = e1 - e0
        cb = np.empty(m, np.uint8)
        unpack_codes(packed[e0 // 8 * bits:], cb, bits)  # a partial group only in the last chunk
        gf = _widen(g[e0:e1])
        os_ = out[e0:e1]
        prod = _prod_buf(os_)
        _mul_lut(gf, cb, values, prod, bits, select_zero)
        _store(os_, prod)
