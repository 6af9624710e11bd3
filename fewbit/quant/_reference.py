"""Pure-torch reference of the group quantizer (docs/method.md §7): the definition.

Every backend (numba on CPU, Triton on CUDA) must produce the same packed codes and the
same stored statistics bit for bit. The steps, per group of ``group_size`` elements
(the last group is short; it is *not* padded with values, only the flat stream is):

1. ``lo = min(x_g)``, ``hi = max(x_g)`` in the compute dtype (float64 for float64
   input, float32 otherwise).
2. ``m = floor_S(lo)``: the largest value of the stats dtype ``S`` that is ``<= lo``.
   Rounding *down* (instead of to nearest) keeps ``x - m >= 0``, so the clamp at 0 never
   cuts a value and stochastic rounding stays unbiased.
3. ``r = hi - m``; ``s_raw = (2**b - 1) / r`` (``s_raw = 1`` when ``r == 0``: the
   ``max == min`` guard; ``s_raw`` = the largest finite ``S`` value when the division
   overflows); ``s = floor_S(s_raw)``, again rounded down; then, if ``r * s > 2**b - 1``
   (both rounded in the compute dtype), ``s`` is replaced by the next smaller ``S`` value.
   The correction is needed because ``s_raw`` is the *nearest* compute-dtype value to the
   quotient and may lie above it (with ``S`` = float32, ``floor_S`` is the identity);
   one step always suffices (the ``S`` spacing at ``s`` is at least the rounding error of
   the division). Since rounding is monotonic, ``0 <= (x - m) * s <= 2**b - 1`` then holds
   *as computed* for every ``x`` of the group, and the clamp never cuts a value.
4. ``q = clamp(floor((x - m) * s + u), 0, 2**b - 1)`` with ``m`` and ``s`` the *stored*
   values (two separately rounded operations, no fused multiply-add), ``u = 0.5`` for
   nearest rounding or the counter-based uniform of :func:`uniform_noise`.
5. Dequantize: ``x_hat = m + q / s`` in the compute dtype, cast to the input dtype: for
   float16/bfloat16 input of stochastic codes, by stochastic rounding with the decode's own
   seed (:func:`stochastic_round_reference`, :func:`decode_seed`), so that ``E[x_hat] = x``
   holds in the input dtype too; to nearest for nearest codes.

Non-finite groups: if a group holds a NaN or an infinity (or its range overflows the
compute dtype or the stats dtype), its stored ``m`` and ``s`` are NaN and its codes 0,
so it dequantizes to NaN *for that group only*; other groups are untouched. A NaN in the
gradient is what mixed-precision loss scalers look for, so the overflow is not hidden.
Limits of this rule: a finite group whose range is within a few percent of the compute
dtype's largest value (float32 values near 1.6e38 and beyond: ``s`` is then a coarse
subnormal of the stats dtype) can have ``q / s`` overflow and decode to +-inf instead of
NaN; a float16 value within one code step of 65504 decodes clamped (:func:`clamp_float16_`),
so ``E[x_hat] = x`` fails there by up to 2**-8 of the range.

Random numbers: :func:`uniform_noise` is the one definition of ``u``, a counter-based hash
of the flat element index and a 64-bit seed (the numba and Triton kernels implement it, in
32-bit unsigned arithmetic), so CPU, CUDA and this reference draw the same ``u`` for the
same seed and the stochastic path is testable bit for bit. How the seed is drawn (on the
CPU, whatever the device of ``x``) is in ``fewbit/quant/__init__.py``.
"""

from __future__ import annotations

import torch

from fewbit.ops._reference import compute_dtype  # one rule for every fewbit kernel
from fewbit.packing import pack_reference, unpack_reference

__all__ = [
    "uniform_noise",
    "decode_seed",
    "stochastic_round_reference",
    "round_to_dtype",
    "floor_to_dtype",
    "prev_in_dtype",
    "group_stats_reference",
    "quantize_codes_reference",
    "quantize_reference",
    "group_quantize_reference",
    "dequantize_reference",
    "compute_dtype",
    "affine_codes_reference",
    "affine_decode_reference",
    "block_mean_reference",
    "upsample_blocks",
    "division_stats_layout",
    "division_encode_reference",
    "division_compress_reference",
    "division_decode_reference",
]

#: Bits per element the group quantizer supports (whole codes per byte: 8, 4, 2 or 1).
SUPPORTED_BITS = (1, 2, 4, 8)

_MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash-prospector): x ^= x >> 16; x *= C1; x ^= x >> 15;
# x *= C2; x ^= x >> 16, all mod 2**32.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow."""
    if c < (1 << 31):
        return (x * c) & _MASK32
    # x * c = x * (c - 2**31) + x * 2**31, and x * 2**31 mod 2**32 = (x & 1) << 31.
    return (x * (c - (1 << 31)) + ((x & 1) << 31)) & _MASK32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def uniform_noise(numel: int, seed: int, device=None, start: int = 0) -> torch.Tensor:
    """Counter-based uniform noise ``u`` in [0, 1) used by stochastic rounding: the definition.

    For the flat element index ``j`` (``j_lo``/``j_hi`` its low/high 32 bits) and the 64-bit
    ``seed`` (``s0``/``s1`` its low/high 32 bits), all operations on unsigned 32-bit words::

        h = lowbias32(lowbias32(j_lo ^ s0) ^ s1 ^ j_hi)
        u = (h >> 8) * 2**-24

    (24 random bits, exactly representable in float32). ``lowbias32`` is Chris Wellons'
    integer hash (hash-prospector): ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
    x *= 0x846CA68B; x ^= x >> 16`` modulo 2**32. A counter-based generator (Salmon et al.,
    "Parallel random numbers: as easy as 1, 2, 3", SC 2011) needs no state and no noise
    tensor, and gives every element the same ``u`` on every backend and device.
    Here the 32-bit products are computed in int64 without overflow (:func:`_mul32`).

    Args:
        numel: number of values.
        seed: integer in ``[0, 2**64)``.
        device: device of the result.
        start: flat index of the first value.

    Returns:
        ``(numel,)`` float32 tensor.
    """
    s0 = seed & _MASK32
    s1 = (seed >> 32) & _MASK32
    j = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    h = _lowbias32(_lowbias32((j & _MASK32) ^ s0) ^ s1 ^ (j >> 32))
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


def clamp_float16_(y: torch.Tensor) -> torch.Tensor:
    """``y`` (a decoded tensor) clamped in place to float16's finite range when it is
    float16. A decode's statistics or steps can land just past +-65504 (a bfloat16 min
    rounded down below float16's range, ``m + q / s`` past 65504, a DIVISION block mean
    near the top plus one residual step) and round to +-inf, though the input was finite;
    NaN of a non-finite input stays NaN."""
    if y.dtype == torch.float16:
        y.clamp_(-65504.0, 65504.0)
    return y


#: XOR-ed into a compression's noise seed to give the seed of its decode's rounding
#: (:func:`decode_seed`): both 32-bit halves nonzero, the top bit clear.
DECODE_SEED_SALT = 0x1E3779B97F4A7C15

def decode_seed(seed: int) -> int:
    """The seed of the stochastic rounding into float16/bfloat16 at the decode of a tensor
    whose codes were drawn with the noise seed ``seed``: ``seed ^`` :data:`DECODE_SEED_SALT`
    (``< 2**63`` as ``seed``). Both 32-bit halves change, so the hash's first round
    (:func:`uniform_noise`) reads a different word for every element and the decode's noise
    is independent of the codes' noise; changing the high half alone would make it a
    function of the codes' noise."""
    return seed ^ DECODE_SEED_SALT


#: ``(mantissa bits, smallest normal exponent, largest finite)`` of the half-precision
#: dtypes :func:`stochastic_round_reference` rounds to.
HALF_GRIDS = {
    torch.float16: (10, -14, float(torch.finfo(torch.float16).max)),
    torch.bfloat16: (7, -126, float(torch.finfo(torch.bfloat16).max)),
}


def stochastic_round_reference(y: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``y`` (float32) stochastically rounded to the grid of ``dtype`` (float16 or
    bfloat16), returned as float32 values that ``dtype`` holds exactly: the definition.

    Decoding computes ``m + q / s`` in float32. Rounding that to the nearest half-precision
    value is off by up to half an ulp *in expectation* wherever the codes' step is below an
    ulp (8-bit codes), so ``E[x_hat] != x``. Rounding up with probability equal to the
    distance to the value below, in ulps, keeps ``E[x_hat] = x`` (Gupta et al., "Deep
    learning with limited numerical precision", ICML 2015, eq. 2)::

        ulp = 2**(max(e, e_min) - p)         e: the binary exponent of |y| (float32's field)
        t = |y| / ulp                        exact (a power of two)
        |x_hat| = (floor(t) + [u < t - floor(t)]) * ulp,  with y's sign

    with ``(p, e_min)`` = (10, -14) for float16, (7, -126) for bfloat16 (:data:`HALF_GRIDS`;
    below ``2**e_min`` the grid is the dtype's subnormals) and ``u`` the
    :func:`uniform_noise` of the flat index under the decode's own seed
    (:func:`decode_seed`). The probabilities are exact where ``t - floor(t)`` lies on u's
    grid of ``2**-24``: every bfloat16 case, and float16 from ``|y| >= 2**-24``; below, the
    value ``2**-24`` is taken with probability ``ceil(t * 2**24) / 2**24`` instead of ``t``
    (off by at most ``2**-48``). A finite ``y`` that would round past the dtype's largest
    value gives the largest (with ``y``'s sign); NaN and infinities are kept. Computed here
    in float64, where every step is exact; the kernels do it in float32 arithmetic or on
    the bit pattern, with the same result bit for bit.

    Args:
        y: float32 tensor, any shape (read in C order, flat index from 0).
        dtype: torch.float16 or torch.bfloat16.
        seed: the 64-bit noise seed.

    Returns:
        float32 tensor of ``y``'s shape.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16.
    """
    if dtype not in HALF_GRIDS:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    p, e_min, largest = HALF_GRIDS[dtype]
    u = uniform_noise(y.numel(), seed, device=y.device).view(y.shape).to(torch.float64)
    e = (((y.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=e_min).to(torch.int64) - p
    ulp = ((e + 1023) << 52).view(torch.float64)
    t = y.to(torch.float64).abs() * ((1023 - e) << 52).view(torch.float64)
    k = torch.floor(t)
    z = torch.copysign((k + (u < t - k).to(torch.float64)) * ulp, y.to(torch.float64))
    z = torch.where(torch.isfinite(y), z.clamp(-largest, largest), z)
    return z.to(torch.float32)


def round_to_dtype(y: torch.Tensor, dtype: torch.dtype, seed: int | None,
                   stochastic_round=stochastic_round_reference) -> torch.Tensor:
    """A decoded ``y`` (the compute dtype) in ``dtype``: rounded to nearest if ``seed`` is
    None or ``dtype`` is float32/float64, else by ``stochastic_round(y, dtype, seed)``
    (:func:`stochastic_round_reference`, or a backend's kernel with its signature)."""
    if seed is None or dtype not in HALF_GRIDS or y.numel() == 0:
        return y.to(dtype)
    return stochastic_round(y, dtype, seed).to(dtype)


def floor_to_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest value of ``dtype`` that is ``<= v`` (elementwise), returned in ``dtype``."""
    c = v.to(dtype)
    above = c.to(v.dtype) > v
    down = torch.nextafter(c, torch.full_like(c, float("-inf")))
    return torch.where(above, down, c)


def prev_in_dtype(v: torch.Tensor) -> torch.Tensor:
    """Largest value of ``v.dtype`` that is ``< v`` (elementwise, ``v`` finite), in ``v.dtype``."""
    w = v.to(torch.float64)  # exact for float16/bfloat16/float32; below v by one float64 ulp:
    w = torch.nextafter(w, torch.full_like(w, float("-inf")))
    return floor_to_dtype(w, v.dtype)


def group_stats_reference(x: torch.Tensor, bits: int, group_size: int, stats_dtype: torch.dtype):
    """Per-group stored ``(mins, scales)`` and a finite-group mask (docs/method.md §7 steps 1-3).

    Args:
        x: ``(numel,)`` floating tensor (flattened input).

    Returns:
        ``mins``, ``scales``: ``(ceil(numel / group_size),)`` in ``stats_dtype``;
        ``ok``: ``(n_groups,)`` bool, False for non-finite groups (whose stats are NaN).
    """
    cdt = compute_dtype(x.dtype)
    n = x.numel()
    n_groups = -(-n // group_size)
    xc = x.reshape(-1).to(cdt)
    # rows of the groups' width, padded to whole rows; a group wider than the tensor is the
    # tensor (padding it to group_size took memory in group_size: 1.7 GiB for 2**27)
    width = min(group_size, max(n, 1))
    pad = n_groups * width - n
    lo_src = torch.cat([xc, xc.new_full((pad,), float("inf"))]).reshape(n_groups, width)
    hi_src = torch.cat([xc, xc.new_full((pad,), float("-inf"))]).reshape(n_groups, width)
    lo = lo_src.amin(dim=1)  # propagates NaN
    hi = hi_src.amax(dim=1)
    ok = torch.isfinite(lo) & torch.isfinite(hi)
    m = floor_to_dtype(torch.where(ok, lo, torch.zeros_like(lo)), stats_dtype)
    mc = m.to(cdt)
    ok &= torch.isfinite(mc)
    rng = hi - mc
    ok &= torch.isfinite(rng)
    levels = float((1 << bits) - 1)
    safe_rng = torch.where(ok & (rng > 0), rng, torch.ones_like(rng))
    # a tensor numerator: ``float / tensor`` is computed as ``reciprocal * float`` in torch
    s_raw = torch.where(rng > 0, torch.full_like(rng, levels) / safe_rng, torch.ones_like(rng))
    s_max = torch.finfo(stats_dtype).max
    s_raw = torch.where(torch.isinf(s_raw), torch.full_like(s_raw, s_max), s_raw)
    s = floor_to_dtype(s_raw, stats_dtype)
    # s_raw is the division rounded to *nearest*: step s down once if r * s > levels
    over = rng * s.to(cdt) > levels
    s = torch.where(over, prev_in_dtype(s), s)
    ok &= s.to(cdt) > 0
    nan = torch.full_like(m, float("nan"))
    return torch.where(ok, m, nan), torch.where(ok, s, nan), ok


def quantize_codes_reference(
    x: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    seed: int | None,
) -> torch.Tensor:
    """Codes ``q`` (int64, ``(numel,)``) from the stored stats (docs/method.md §7 step 4)."""
    cdt = compute_dtype(x.dtype)
    n = x.numel()
    xc = x.reshape(-1).to(cdt)
    gidx = torch.arange(n, device=x.device) // group_size
    m = mins.to(cdt)[gidx]
    s = scales.to(cdt)[gidx]
    if seed is None:
        u = torch.full((n,), 0.5, dtype=cdt, device=x.device)
    else:
        u = uniform_noise(n, seed, device=x.device).to(cdt)
    t = (xc - m) * s
    v = torch.floor(t + u)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # non-finite groups -> code 0
    return v.clamp(0, (1 << bits) - 1).to(torch.int64)


def quantize_reference(
    x: torch.Tensor, bits: int, group_size: int, seed: int | None, stats_dtype: torch.dtype,
):
    """Reference group quantizer on a flat tensor.

    Args:
        x: any shape, floating dtype (read flattened in C order).
        bits: 1, 2, 4 or 8 bits per element.
        group_size: elements per group.
        seed: 64-bit seed of the counter-based noise, or None for nearest rounding.
        stats_dtype: dtype of the stored per-group min and scale.

    Returns:
        ``(packed, mins, scales)``: ``(ceil(numel * bits / 8),)`` uint8 codes in the
        docs/method.md §6 stream layout, and two ``(ceil(numel / group_size),)`` stats tensors.
    """
    flat = x.reshape(-1)
    if flat.numel() == 0:
        empty = torch.empty(0, dtype=stats_dtype, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), empty, empty.clone()
    mins, scales, _ = group_stats_reference(flat, bits, group_size, stats_dtype)
    q = quantize_codes_reference(flat, mins, scales, bits, group_size, seed)
    return pack_reference(q, bits), mins, scales


def group_quantize_reference(x, bits, group_size, seed, stochastic, stats_dtype):
    """:func:`quantize_reference` with the arguments of ``fewbit::group_quantize``
    (``seed`` ignored unless ``stochastic``)."""
    return quantize_reference(x, bits, group_size, seed if stochastic else None, stats_dtype)


def dequantize_reference(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    numel: int, dtype: torch.dtype, seed: int | None = None,
) -> torch.Tensor:
    """Reference dequantizer: ``x_hat = m + q / s`` per group, ``(numel,)`` in ``dtype``,
    rounded to float16/bfloat16 stochastically with the decode seed ``seed``
    (:func:`round_to_dtype`; to nearest if None)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=packed.device)
    cdt = compute_dtype(dtype)
    q = unpack_reference(packed, bits, numel).to(cdt)
    gidx = torch.arange(numel, device=packed.device) // group_size
    m = mins.to(cdt)[gidx]
    s = scales.to(cdt)[gidx]
    return round_to_dtype(m + q / s, dtype, seed)


# ---------------------------------------------------------------------------------------
# The compressors of fewbit.quant.compressors (docs/compression.md §3-4): their pure-torch
# definitions. Two shared pieces: stochastic codes from given stats (one per row or one per
# column of a flat tensor viewed as rows), and DIVISION's block means in a fixed order.
# ---------------------------------------------------------------------------------------


def stats_index(numel: int, rowlen: int, per_col: bool, device=None) -> torch.Tensor:
    """Index of the stats of every flat element ``e``: ``e % rowlen`` (one pair per column of
    the ``(numel // rowlen, rowlen)`` view) if ``per_col``, else ``e // rowlen`` (per row)."""
    e = torch.arange(numel, device=device)
    return e % rowlen if per_col else e // rowlen


def affine_levels(bits: int, offset: int) -> int:
    """The largest affine code: ``2**bits - 1``, or ``2 * offset`` for signed codes shifted by
    ``offset`` (a symmetric quantizer's ``[-L, L]``: the channel maximum's ``L + u`` can round
    up to ``L + 1`` in float32 for ``u`` near 1, which decoded past the range, to inf at
    float32's maximum)."""
    return 2 * offset if offset else (1 << bits) - 1


def affine_codes_reference(
    x: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int,
    per_col: bool, offset: int, seed: int | None,
) -> torch.Tensor:
    """Packed codes ``q = clamp(floor((x - m) * s + u) + offset, 0, affine_levels(bits, offset))``
    of a flat ``x`` with the stats ``(m, s)`` of :func:`stats_index` (float32, or float64 for
    float64 ``x``); a NaN stat gives code 0. ``offset`` shifts signed codes (symmetric
    quantizers) into ``[0, 2 * offset]``. Returns ``(ceil(numel * bits / 8),)`` uint8
    (docs/method.md §6)."""
    cdt = compute_dtype(x.dtype)
    n = x.numel()
    g = stats_index(n, rowlen, per_col, x.device)
    m, s = mins.to(cdt)[g], scales.to(cdt)[g]
    u = (torch.full((n,), 0.5, dtype=cdt, device=x.device) if seed is None
         else uniform_noise(n, seed, device=x.device).to(cdt))
    v = torch.floor((x.reshape(-1).to(cdt) - m) * s + u) + offset
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return pack_reference(v.clamp(0, affine_levels(bits, offset)).to(torch.int64), bits)


def affine_decode_reference(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int,
    per_col: bool, offset: int, numel: int, dtype: torch.dtype, seed: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`affine_codes_reference`: ``m + (q - offset) / s``, ``(numel,)`` in
    ``dtype`` (:func:`round_to_dtype` with the decode seed ``seed``)."""
    cdt = compute_dtype(dtype)
    q = unpack_reference(packed, bits, numel).to(cdt)
    g = stats_index(numel, rowlen, per_col, packed.device)
    return round_to_dtype(mins.to(cdt)[g] + (q - offset) / scales.to(cdt)[g], dtype, seed)


def block_mean_reference(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """DIVISION's low-frequency part: means of ``bh x bw`` blocks over dims 1 and 2 of
    ``x`` ``(A, H, W, I)``, ``(A, ceil(H / bh), ceil(W / bw), I)`` in the compute dtype.

    The definition every backend follows bit for bit (one rounding per addition, sums
    starting at +0): per column ``w`` of a block, its rows summed in increasing order (the
    column sums of a row-block vectorise along the row); then the block's column sums
    added in increasing ``w``; the mean is ``sum / count``, ``count`` the number of elements
    present (a last block cut by the border is averaged over what is there: "ceil"
    pooling, DIVISION's padding left out).
    """
    cdt = compute_dtype(x.dtype)
    a, h, w, i = x.shape
    hb, wb = -(-h // bh), -(-w // bw)
    xp = torch.zeros(a, hb * bh, wb * bw, i, dtype=cdt, device=x.device)
    xp[:, :h, :w] = x.to(cdt)  # padding zeros: s + 0 == s (s is never -0: sums start at +0)
    xr = xp.view(a, hb, bh, wb, bw, i)
    col = torch.zeros(a, hb, wb, bw, i, dtype=cdt, device=x.device)
    for r in range(bh):
        col = col + xr[:, :, r]
    acc = torch.zeros(a, hb, wb, i, dtype=cdt, device=x.device)
    for c in range(bw):
        acc = acc + col[:, :, :, c]
    rows = (h - torch.arange(hb, device=x.device) * bh).clamp(max=bh)
    cols = (w - torch.arange(wb, device=x.device) * bw).clamp(max=bw)
    count = (rows[:, None] * cols[None, :]).to(cdt)
    return acc / count[None, :, :, None]


def upsample_blocks(lfc: torch.Tensor, bh: int, bw: int, h: int, w: int) -> torch.Tensor:
    """``lfc`` ``(A, Hb, Wb, I)`` repeated over its ``bh x bw`` blocks, cut to ``(A, h, w, I)``
    (nearest upsampling)."""
    up = lfc.repeat_interleave(bh, dim=1).repeat_interleave(bw, dim=2)
    return up[:, :h, :w]


def division_stats_layout(shape, row_stats: bool) -> tuple[int, torch.dtype]:
    """``(count, dtype)`` of DIVISION's residual stats for a view of ``shape`` ``(A, H, W, I)``:
    one float32 ``(m, s)`` pair for the tensor, or with ``row_stats`` one bfloat16 pair per
    row ``(a, h)``."""
    return (shape[0] * shape[1], torch.bfloat16) if row_stats else (1, torch.float32)


def division_encode_reference(x, lfc, bh, bw, bits, seed, row_stats=False, affine_codes=affine_codes_reference):
    """DIVISION's residual ``HFC = x - Upsample(lfc)`` quantized per tensor, or per row
    (docs/compression.md §3).

    Args:
        x: ``(A, H, W, I)`` input (its view, :func:`fewbit.quant.compressors.division_view`).
        lfc: ``(A, ceil(H / bh), ceil(W / bw), I)`` the *stored* block means (read in the
            compute dtype: the residual is taken from what decompression will add back).
        bits: bits per element of the codes.
        seed: 64-bit noise seed (stochastic rounding).
        row_stats: one ``(m, s)`` per row ``(a, h)`` of ``W * I`` elements (a token's
            channels in a sequence's view), stored as bfloat16, instead of one float32 pair
            for the tensor.
        affine_codes: the codes kernel (this reference's, or a backend's with its signature).

    Returns:
        ``(packed, mins, scales)``: the codes (docs/method.md §6 stream) and the residual's
        ``m``, ``s``: ``(1,)`` float32, or ``(A * H,)`` bfloat16 with ``row_stats`` (the
        group quantizer's rule for its min and max, docs/method.md §7; NaN where the
        residual has a NaN or an infinity).
    """
    cdt = compute_dtype(x.dtype)
    a, h, w, i = x.shape
    rows, stats_dtype = division_stats_layout(x.shape, row_stats)
    hfc = (x.to(cdt) - upsample_blocks(lfc.to(cdt), bh, bw, h, w)).reshape(-1)
    if hfc.numel() == 0:
        zero = torch.zeros(rows, dtype=stats_dtype, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), zero, zero.clone()
    lo, hi = torch.aminmax(hfc.view(rows, -1), dim=1)  # NaN-propagating
    mins, scales, _ = group_stats_reference(torch.stack([lo, hi], 1).reshape(-1), bits, 2, stats_dtype)
    rowlen = hfc.numel() // rows
    return affine_codes(hfc, mins, scales, bits, rowlen, False, 0, seed), mins, scales


def division_compress_reference(x, bh, bw, bits, seed, row_stats=False, block_mean=block_mean_reference,
                                affine_codes=affine_codes_reference):
    """DIVISION's compression of ``x`` ``(A, H, W, I)``: ``(lfc, packed, mins, scales)``, the
    block means (:func:`block_mean_reference`) rounded to ``x``'s dtype, then
    :func:`division_encode_reference` of the residual from those stored means."""
    lfc = block_mean(x, bh, bw).to(x.dtype)
    return (lfc, *division_encode_reference(x, lfc, bh, bw, bits, seed, row_stats, affine_codes=affine_codes))


def division_decode_reference(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=None,
                              affine_decode=affine_decode_reference, round_to=round_to_dtype):
    """``x_hat = Upsample(lfc) + (m + q / s)``: ``(A, h, w, I)`` in ``dtype`` (inverse of
    :func:`division_encode_reference`; ``affine_decode`` as its ``affine_codes``), rounded
    by ``round_to(y, dtype, seed)`` (:func:`round_to_dtype`, or a backend's). One stat
    pair per tensor, or (``A * h`` pairs) per row of ``w * I`` elements."""
    cdt = compute_dtype(dtype)
    up = upsample_blocks(lfc.to(cdt), bh, bw, h, w)
    n = up.numel()
    hfc = affine_decode(packed, mins, scales, bits, max(n // max(mins.numel(), 1), 1), False, 0, n, cdt)
    return round_to((up + hfc.view(up.shape)).contiguous(), dtype, seed)
