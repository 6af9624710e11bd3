"""Compressors of saved tensors: one interface, chosen per tensor (docs/compression.md).

A :class:`Compressor` turns one floating tensor into a :class:`Compressed` handle that
holds fewer bytes and gives back a tensor of the same shape, dtype and device. Every
compressor here is *unbiased* (``E[decompress(compress(x))] = x``, stochastic rounding)
and draws *fresh noise* on every call (one 64-bit seed from ``generator``, or from
fewbit's own noise stream, :func:`fewbit.manual_seed`, which leaves torch's generators alone);
docs/compression.md §1 says why both matter.

:class:`fewbit.quant.ActivationCompressor` applies one to every saved tensor it takes
(``compressor=``); :func:`get_compressor` builds one from its name, as ``fewbit.Config``
and the ``fewbit memory`` command do.

Compressors:
    ``"group"`` :class:`GroupQuantizer` -- ActNN's group-wise quantizer (docs/method.md §7).
    ``"keep"`` :class:`Keep` -- the tensor as it is (a choice of the per-tensor policies).
    ``"division"`` :class:`Division` -- DIVISION's exact block means + a Q-bit residual
    (docs/compression.md §3).
    ``"outlier"`` :class:`OutlierSeparated` -- Adacc's outlier channels kept exact, the rest
    row-wise INT4 (docs/compression.md §4).
    ``"channelwise"`` :class:`ChannelWise` -- symmetric, one scale per channel (q, k, v).
    ``"softmax"`` :class:`Softmax` -- a fixed grid on [0, 1] for probabilities.

Each new compressor has a pure-torch definition (``compress_reference``, kernels of
:mod:`fewbit.quant._reference`) that the numba (CPU) and Triton (CUDA) kernels match bit
for bit for the same generator state.
"""

from __future__ import annotations

import abc
import functools
import math
import numbers
from typing import Callable, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from fewbit._checks import MAX_GROUP_SIZE, check_bits, check_float64_range, check_float_tensor, check_positive_int
from fewbit.quant import _reference as _ref

__all__ = [
    "Compressed", "Compressor", "GroupQuantizer", "Keep", "Division", "OutlierSeparated", "ChannelWise",
    "Softmax", "COMPRESSORS", "get_compressor",
]


@runtime_checkable
class Compressed(Protocol):
    """What a :class:`Compressor` keeps for one tensor.

    Attributes:
        nbytes: bytes held (codes, statistics, exact parts), the figure counted in
            :class:`fewbit.quant.CompressionStats` and ``fewbit.memory``.
    """

    @property
    def nbytes(self) -> int: ...

    def decompress(self) -> torch.Tensor:
        """A contiguous tensor of the compressed tensor's shape, dtype and device."""
        ...


class Compressor(abc.ABC):
    """Interface of a saved-tensor compressor (subclass it to add one).

    Subclasses set :attr:`name`, implement :meth:`compress` and :meth:`bytes_per_element`,
    and may narrow :meth:`supports`. They must be unbiased and draw fresh noise per call
    (docs/compression.md §1); the tests of ``tests/quant/test_compressors.py`` check
    both for every entry of :data:`COMPRESSORS`.
    """

    #: Registry name (:data:`COMPRESSORS`).
    name: ClassVar[str] = ""

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Compressed:
        """Compress ``x`` (any shape, float16/bfloat16/float32/float64; not modified).

        Args:
            x: the tensor to compress.
            generator: a CPU ``torch.Generator`` for the noise seed; fewbit's own noise
                stream if None (:func:`fewbit.manual_seed`).
        """

    @abc.abstractmethod
    def bytes_per_element(self, x: torch.Tensor) -> float:
        """Bytes :meth:`compress` keeps per element of ``x`` (its shape and dtype; the
        value is not read), statistics included: the figure planners use."""

    def supports(self, x: torch.Tensor) -> bool:
        """Whether :meth:`compress` applies to ``x`` (shape/dtype); True by default."""
        return True

    def within(self, size: int) -> "Compressor":
        """The compressor for a tensor whose runs of ``size`` consecutive elements are each
        normalized on their own: the input of a per-sample normalization layer (each row
        its own mean and variance) or a softmax result (each row sums to 1)
        (:attr:`fewbit.quant.policies.SavedTensorInfo.norm_size`).

        A normalization layer's backward is not linear in its saved input: LayerNorm's is
        ``dx = rstd (g w - mean(g w) - x_hat mean(g w x_hat))``, ``x_hat = (x - mean) rstd``,
        whose last term is quadratic in the quantization error ``e``: its expectation gains
        ``rstd g_i w_i Var(e_i) rstd^2 / size``. That bias is small only when the error is
        small against each row's own spread, so the error's step must come from the row's
        own range, not from a range shared with rows of larger scale. On a LayerNorm(128)
        whose rows alternate between scales 1 and 30, 2-bit groups of 256 (two rows) gave
        the small rows' input gradient a bias of 6.0x its norm (400 draws); groups inside
        rows, 0.0068x (``tests/quant/test_norm_rows.py``). What is left, ``Var(e_i) /
        size`` in the row's units, grows with the row's largest elements; the input of
        torch's norm functions is therefore taken at 8 bits
        (:meth:`fewbit.quant.ActivationCompressor._within_norm`).

        Default: ``self`` (for compressors whose statistics are already per row of the
        last dim, or per element). :class:`GroupQuantizer` aligns its groups to the runs;
        :class:`Division` and :class:`ChannelWise`, whose statistics span rows, give the
        group quantizer at their ``bits`` with groups inside the runs.

        Raises:
            ValueError: ``size`` < 1.
        """
        check_positive_int(size, "size")
        return self

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in vars(self).items()))))


class GroupQuantizer(Compressor):
    """ActNN's group-wise quantizer (docs/method.md §7; :func:`fewbit.quant.quantize`).

    Args:
        bits: bits per element, one of 1, 2, 4, 8.
        group_size: elements per group sharing one (min, scale) pair.
        stochastic: stochastic (unbiased) rounding if True, nearest if False.
        stats_dtype: torch.bfloat16 or torch.float32 for the per-group stats.

    Bytes per element: ``bits / 8 + 2 * itemsize(stats_dtype) / group_size`` (one
    short group rounds up).

    Raises:
        ValueError / TypeError: as :func:`fewbit.quant.quantize`, at construction.
    """

    name = "group"

    def __init__(self, bits: int = 4, *, group_size: int = 256, stochastic: bool = True,
                 stats_dtype: torch.dtype = torch.bfloat16) -> None:
        from fewbit.quant import _validate_options

        _validate_options(bits, group_size, stats_dtype, None, stochastic)
        self.bits = int(bits)  # numpy integers too: equal quantizers hash alike
        self.group_size = int(group_size)
        self.stochastic = bool(stochastic)
        self.stats_dtype = stats_dtype

    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None):
        from fewbit.quant import quantize

        return quantize(x, self.bits, group_size=self.group_size, stochastic=self.stochastic,
                        stats_dtype=self.stats_dtype, generator=generator)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        groups = -(-n // self.group_size)
        stats = 2 * groups * torch.empty((), dtype=self.stats_dtype).element_size()
        return (-(-n * self.bits // 8) + stats) / n

    def within(self, size: int) -> "GroupQuantizer":
        """This quantizer with groups that never straddle two runs of ``size`` elements
        (:meth:`Compressor.within` says why).

        On ``scripts/train_lm.py``'s 2-layer GPT-2 (width 128: groups of 256 held two
        rows), 2-bit LayerNorm inputs alone (the rest exact) raised seed 1's validation loss
        from 2.29 to 2.45; with groups of one row, 2.30.

        Returns:
            ``self`` if ``size`` is a multiple of ``group_size``; else a quantizer with
            ``group_size = size`` if ``size < group_size`` (one group per run), the largest
            divisor of ``size`` below ``group_size`` if that is at least half of it, and
            ``size`` otherwise (one group per run: fewer stats, a coarser step).

        Raises:
            ValueError: ``size`` < 1.
        """
        size = check_positive_int(size, "size")
        if size % self.group_size == 0:  # self, not an equal quantizer the cache met first
            return self
        return _within(self, size)


@functools.lru_cache(maxsize=256)
def _within(q: GroupQuantizer, size: int) -> GroupQuantizer:
    g = q.group_size
    if size % g == 0:
        return q
    if size > g:
        d = next(d for d in range(g, 0, -1) if size % d == 0)
        g = d if 2 * d >= g else size
    else:
        g = size
    return GroupQuantizer(q.bits, group_size=g, stochastic=q.stochastic, stats_dtype=q.stats_dtype)


class _Kept:
    """A tensor kept as it is (the :class:`Keep` compressor's handle)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def decompress(self) -> torch.Tensor:
        return self.tensor


class Keep(Compressor):
    """No compression: the tensor is kept exactly (bytes per element = its itemsize).

    :class:`fewbit.quant.ActivationCompressor` hands such tensors straight back to
    autograd (counted as skipped for reason ``"kept"``), so they cost no copy.
    """

    name = "keep"

    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> _Kept:
        """``x`` itself, held as it is (checked as the other compressors check theirs).

        Raises:
            TypeError: ``x`` not a floating tensor, ``generator`` not a torch.Generator.
            ValueError: ``generator`` not on the CPU.
        """
        from fewbit.quant import _validate_generator

        check_float_tensor(x, "x")
        _validate_generator(generator)
        return _Kept(x)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        return float(x.element_size())


class _Kernels(NamedTuple):
    """The kernels a compressor runs: the torch.library ops (numba on CPU, Triton on CUDA)
    or their pure-torch definitions (:mod:`fewbit.quant._reference`)."""

    affine_codes: Callable
    affine_decode: Callable
    division_compress: Callable
    division_decode: Callable
    pair_stats: Callable


def _ops() -> _Kernels:
    ops = torch.ops.fewbit
    return _Kernels(ops.affine_codes, ops.affine_decode, ops.division_compress, ops.division_decode,
                    ops.pair_stats)


_REFERENCE = _Kernels(
    lambda x, m, s, bits, rowlen, per_col, offset, seed, stochastic: _ref.affine_codes_reference(
        x, m, s, bits, rowlen, per_col, offset, seed if stochastic else None),
    lambda *args, seed, stochastic: _ref.affine_decode_reference(*args, seed if stochastic else None),
    _ref.division_compress_reference,
    lambda *args, seed, stochastic: _ref.division_decode_reference(*args, seed if stochastic else None),
    lambda pairs, bits, stats_dtype: _ref.group_stats_reference(pairs, bits, 2, stats_dtype)[:2],
)


def _seed(generator: torch.Generator | None) -> int:
    from fewbit.quant import _draw_seed, _validate_generator

    _validate_generator(generator)
    return _draw_seed(generator)


def _range_stats(k: _Kernels, lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """Per-tensor float32 ``(m, s)`` (shape ``(1,)``) for values in ``[lo, hi]``: the group
    quantizer's rule (docs/method.md §7 steps 2-3, ``m`` rounded down, ``s`` stepped down so
    that ``(x - m) * s <= 2**bits - 1`` as computed); NaN for a non-finite ``lo``/``hi``."""
    return k.pair_stats(torch.stack([lo, hi]), bits, torch.float32)


class _Affine:
    """Codes ``q`` of a flat tensor and its stats: ``x_hat = m + (q - offset) / s``, stats
    per row of ``rowlen`` or per column (:func:`fewbit.quant._reference.affine_codes_reference`);
    ``decode_seed``: the seed of the stochastic rounding into float16/bfloat16 at decode
    (:func:`fewbit.quant._reference.decode_seed` of the codes' seed)."""

    __slots__ = ("packed", "mins", "scales", "bits", "rowlen", "per_col", "offset", "numel", "decode_seed")

    def __init__(self, packed, mins, scales, bits, rowlen, per_col, offset, numel, decode_seed):
        self.packed, self.mins, self.scales = packed, mins, scales
        self.bits, self.rowlen, self.per_col, self.offset, self.numel = bits, rowlen, per_col, offset, numel
        self.decode_seed = decode_seed

    @classmethod
    def encode(cls, k: _Kernels, x, mins, scales, bits, rowlen, per_col, offset, seed):
        rowlen = max(rowlen, 1)
        packed = k.affine_codes(x.reshape(-1), mins, scales, bits, rowlen, per_col, offset, seed, True)
        return cls(packed, mins, scales, bits, rowlen, per_col, offset, x.numel(), _ref.decode_seed(seed))

    def decode(self, k: _Kernels, dtype: torch.dtype) -> torch.Tensor:
        return k.affine_decode(self.packed, self.mins, self.scales, self.bits, self.rowlen, self.per_col,
                               self.offset, self.numel, dtype, seed=self.decode_seed, stochastic=True)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _KernelCompressor(Compressor):
    """A compressor with two sets of kernels: :meth:`compress` runs the ``torch.library``
    ops (numba on CPU, Triton on CUDA), :meth:`compress_reference` their pure-torch
    definitions (:mod:`fewbit.quant._reference`); both check ``x`` first. Subclasses set
    :attr:`min_dim` and implement ``_compress(x, generator, kernels)``."""

    #: Fewest dims :meth:`compress` takes (pooling and channels need a second dim).
    min_dim: ClassVar[int] = 0
    #: Whether the statistics span rows (one per tensor, or per column): then
    #: :meth:`within` gives the group quantizer at ``bits`` with groups inside the runs.
    stats_span_rows: ClassVar[bool] = False

    def within(self, size: int) -> Compressor:
        """:meth:`Compressor.within`: ``self``, or, if :attr:`stats_span_rows`, the group
        quantizer at ``bits`` with groups inside the runs of ``size`` elements."""
        if self.stats_span_rows:
            return GroupQuantizer(self.bits).within(size)
        return super().within(size)

    def supports(self, x: torch.Tensor) -> bool:
        """Tensors of :attr:`min_dim` or more dims (DIVISION pools over a spatial or token
        dim, the channel compressors need rows of channels)."""
        return x.dim() >= self.min_dim

    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Compressed:
        """See :meth:`Compressor.compress`.

        Raises:
            TypeError: ``x`` not a floating tensor, ``generator`` not a torch.Generator.
            ValueError: ``x`` has fewer than :attr:`min_dim` dims, or is float64 with
                magnitudes the statistics cannot hold (:data:`fewbit._checks.FLOAT64_MAX`).
        """
        self._check(x)
        return self._compress(x, generator, _ops())

    def compress_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Compressed:
        """:meth:`compress` with the pure-torch kernels (the definition; same result bit for bit)."""
        self._check(x)
        return self._compress(x, generator, _REFERENCE)

    def _check(self, x: torch.Tensor) -> None:
        check_float_tensor(x, "x")
        if not self.supports(x):
            raise ValueError(f"the {self.name!r} compressor needs at least {self.min_dim} dims; "
                             f"got a tensor of shape {tuple(x.shape)}")
        check_float64_range(x, "x")

    @abc.abstractmethod
    def _compress(self, x: torch.Tensor, generator: torch.Generator | None, k: _Kernels) -> Compressed:
        """Compress the checked ``x`` with the kernels ``k``."""


# --------------------------------------------------------------------------------------------
# DIVISION (Wang et al., "Division: memory efficient training via dual activation precision",
# ICML 2023, sec. 4, eq. 5-7; docs/compression.md §3)
# --------------------------------------------------------------------------------------------


def division_view(shape: torch.Size, block: int):
    """``((A, H, W, I), (bh, bw))``: how :class:`Division` views a tensor of ``shape``.

    4-D and more (conv maps ``(N, C, H, W)``, ``(N, C, D, H, W)``): 2-D ``block x block``
    pooling over the last two dims, ``A`` = the product of the others, ``I = 1``. 2-D and 3-D
    (token sequences ``(B, T, C)``, ``(T, C)``): 1-D pooling of ``block`` tokens over dim
    -2, ``W = 1``, ``I`` = the channels (dim -1).
    """
    # a block past a dim is that dim (its one partial block is averaged over the elements
    # present either way): the reference pads to whole blocks, and a block of 65536 on a
    # 720-element tensor had asked for 103 GB there (h68)
    if len(shape) >= 4:
        return (math.prod(shape[:-2]), shape[-2], shape[-1], 1), (min(block, max(shape[-2], 1)),
                                                                   min(block, max(shape[-1], 1)))
    return (math.prod(shape[:-2]), shape[-2], 1, shape[-1]), (min(block, max(shape[-2], 1)), 1)


class _DivisionCompressed:
    """:class:`Division`'s handle: the block means (input dtype) and the residual's codes."""

    __slots__ = ("lfc", "hfc", "view", "block", "shape", "dtype", "_k")

    def __init__(self, lfc, hfc, view, block, shape, dtype, kernels):
        self.lfc, self.hfc, self.view, self.block, self.shape, self.dtype = lfc, hfc, view, block, shape, dtype
        self._k = kernels

    @property
    def nbytes(self) -> int:
        return _nbytes(self.lfc, self.hfc.packed, self.hfc.mins, self.hfc.scales)

    def decompress(self) -> torch.Tensor:
        q = self.hfc
        y = self._k.division_decode(q.packed, self.lfc, q.mins, q.scales, *self.block, q.bits, self.view[1],
                                    self.view[2], self.dtype, seed=q.decode_seed, stochastic=True)
        return _ref.clamp_float16_(y).reshape(self.shape)


class Division(_KernelCompressor):
    """DIVISION: an exact low-frequency part and a ``bits``-bit high-frequency part.

    ``LFC = AvgPool_B(x)`` (block and stride ``block``) is kept exactly, in the dtype of
    ``x`` (computed in float32, or float64 for float64; float16/bfloat16 means are rounded
    to the input dtype and the residual is taken from the rounded means, so the
    reconstruction stays unbiased). ``HFC = x - Upsample(LFC)`` is quantized with
    stochastic rounding: ``q = floor((HFC - m) * s + u)``, ``m = min HFC`` (rounded down to
    the stats dtype), ``s = (2**bits - 1) / (max HFC - m)`` (the rule of docs/method.md §7:
    ``Δ = 1 / s``), ``u ~ U[0, 1)`` the counter-based noise; backward gets ``x_hat =
    Upsample(LFC) + m + q / s``, ``E[x_hat] = x`` (DIVISION eq. 5-7).

    Pooling and stats: 4-D and more (conv maps ``(N, C, H, W)``): ``block x block`` over the
    last two dims, one float32 ``(m, s)`` for the tensor (as DIVISION). 2-D and 3-D (token
    sequences ``(B, T, C)``): ``block`` tokens over dim -2 (the token dim of batch-first
    sequences), channels untouched, and one bfloat16 ``(m, s)`` per token (row of ``C``):
    tokens differ in scale, and one step for the tensor made the gradient noisy (on
    ``scripts/train_lm.py``'s GPT-2 at step 100, 2 bits: the mean over parameter tensors of
    the relative gradient variance 0.198 per tensor, 0.067 per token; the group
    quantizer at 2 bits 0.082). A size that ``block`` does not divide ends with a partial
    block averaged over the elements present (:func:`division_view`,
    :func:`fewbit.quant._reference.block_mean_reference`).

    Bytes per element (``x`` float32, sizes divisible by ``block``): conv maps ``4 /
    block**2 + bits / 8`` plus 8 bytes per tensor: 0.3125 at ``block = 8``, ``bits = 2``, a
    12.8x reduction (DIVISION Thm. 2, docs/compression.md §3); sequences ``4 / block + bits
    / 8 + 4 / C``.

    Non-finite input: a NaN or infinity makes its stats NaN: the whole tensor (conv maps),
    or every token whose residual it reaches (sequences: its own, and through the block
    mean the other tokens of its block), decompresses to NaN (never a finite wrong value).
    So does a finite input whose block sums (float32, in the order of the block) overflow:
    magnitudes above about ``3.4e38 / block²`` (conv maps: 5e36 at ``block = 8``) or ``/
    block`` (sequences), where the other compressors stay finite.

    Args:
        block: pooling block ``B``, 1 <= B <= 2**31 - 1 (8 in DIVISION); past a dim, that
            dim (:func:`division_view`).
        bits: ``Q``, bits per element of the residual: 1, 2, 4 or 8 (2 in DIVISION).

    Raises:
        ValueError: ``block`` out of range or ``bits`` not allowed (construction); :meth:`compress`
            of a tensor with fewer than 2 dims.
    """

    name = "division"
    stats_span_rows = True  # conv maps: one step per tensor; sequences: means over `block` tokens
    min_dim = 2

    def __init__(self, block: int = 8, bits: int = 2) -> None:
        self.block = check_positive_int(block, "block", maximum=MAX_GROUP_SIZE)
        self.bits = check_bits(bits, allowed=_ref.SUPPORTED_BITS)

    def _compress(self, x, generator, k: _Kernels) -> _DivisionCompressed:
        seed = _seed(generator)
        view, block = division_view(x.shape, self.block)
        x4 = x.detach().reshape(view)
        rows = block[1] == 1  # token sequences: stats per token
        lfc, packed, m, s = k.division_compress(x4, *block, self.bits, seed, rows)
        rowlen = view[2] * view[3] if rows else x.numel()
        q = _Affine(packed, m, s, self.bits, max(rowlen, 1), False, 0, x.numel(), _ref.decode_seed(seed))
        return _DivisionCompressed(lfc, q, view, block, x.shape, x.dtype, k)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        view, (bh, bw) = division_view(x.shape, self.block) if x.dim() >= 2 else ((1, n, 1, 1), (self.block, 1))
        a, h, w, i = view
        lfc = a * -(-h // bh) * -(-w // bw) * i * x.element_size()
        stats = 4 * a * h if bw == 1 else 8  # bfloat16 pairs per token, or float32 for the tensor
        return (lfc + -(-n * self.bits // 8) + stats) / n


# --------------------------------------------------------------------------------------------
# Adacc (Chen et al., "Adaptive Compression and Activation Checkpointing for LLM Memory
# Management", 2025, sec. 4.1; docs/compression.md §4)
# --------------------------------------------------------------------------------------------


def outlier_channels(x: torch.Tensor, z: float) -> torch.Tensor:
    """Adacc's outlier channels of ``x`` (channels = dim -1): ``S_i = sum |x[..., i]|``
    (float32, float64 for float64), ``z_i = (S_i - mean S) / std S`` (``std`` with Bessel's
    correction), the channels with ``z_i > z`` as sorted int32 indices. No channel is an
    outlier when ``std S`` is 0 or not finite (``z_i`` NaN), or when there is one channel
    (no spread to measure)."""
    if x.shape[-1] < 2:
        return torch.zeros(0, dtype=torch.int32, device=x.device)
    cdt = _ref.compute_dtype(x.dtype)
    S = x.reshape(-1, x.shape[-1]).abs().sum(dim=0, dtype=cdt)
    zs = (S - S.mean()) / S.std()
    return torch.nonzero(zs > z).reshape(-1).to(torch.int32)


class _OutlierCompressed:
    """:class:`OutlierSeparated`'s handle: outlier columns exact, the rest group-quantized."""

    __slots__ = ("rest", "exact", "index", "shape", "dtype", "_dequantize")

    def __init__(self, rest, exact, index, shape, dtype, dequantize):
        self.rest, self.exact, self.index, self.shape, self.dtype = rest, exact, index, shape, dtype
        self._dequantize = dequantize

    @property
    def nbytes(self) -> int:
        return self.rest.nbytes + _nbytes(self.exact, self.index)

    def decompress(self) -> torch.Tensor:
        y = self._dequantize(self.rest)
        if y.numel() == 0:  # a last dim of 0 has no (-1, 0) view
            return y.reshape(self.shape)
        y = y.view(-1, self.shape[-1])
        if self.index.numel():
            y[:, self.index.long()] = self.exact
        return y.reshape(self.shape)


class OutlierSeparated(_KernelCompressor):
    """Adacc's outlier-separated compressor (Linear, LayerNorm, GELU inputs).

    Channels (dim -1) whose ``z``-score of ``S_i = sum |x[..., i]|`` exceeds ``z``
    (:func:`outlier_channels`) are kept exactly, in the input dtype, with their int32
    indices, and set to zero in a copy of ``x``; the copy is quantized row-wise (one row =
    one position's ``C`` channels, in its own layout, no transpose) by the group quantizer
    with ``group_size = C``, ``bits`` bits and bfloat16 row stats (docs/method.md §7:
    stochastic, unbiased; a non-finite row decompresses to NaN). Kernels: those of
    :func:`fewbit.quant.quantize` (numba / Triton); the selection is torch.

    Bytes per element (:meth:`bytes_per_element` is the figure without outliers: it does
    not read values): ``bits / 8 + 4 / C`` (row stats), plus, per outlier channel,
    ``(rows * itemsize + 4) / numel``.

    Args:
        z: z-score threshold (3 in Adacc).
        bits: bits per element of the rest: 1, 2, 4 or 8 (INT4 in Adacc).

    Raises:
        ValueError: ``z`` not finite and > 0, ``bits`` not allowed; :meth:`compress` of a tensor
            with fewer than 2 dims.
    """

    name = "outlier"
    min_dim = 2

    def __init__(self, z: float = 3.0, bits: int = 4) -> None:
        if isinstance(z, bool) or not isinstance(z, numbers.Real) or not math.isfinite(z) or z <= 0:
            # z <= 0 marks channels at or under the mean as outliers (every channel at -5),
            # kept exact: more bytes than the tensor (h68)
            raise ValueError(f"z must be a finite number > 0 (a z-score threshold; 3 in Adacc), got {z!r}")
        self.z = float(z)
        self.bits = check_bits(bits, allowed=_ref.SUPPORTED_BITS)

    def _compress(self, x, generator, k: _Kernels) -> _OutlierCompressed:
        import fewbit.quant as Q

        ref = k is _REFERENCE
        quantize = Q.quantize_reference if ref else Q.quantize
        dequantize = Q.dequantize_reference if ref else Q.dequantize
        c = x.shape[-1]
        h = x.detach().reshape(-1, c) if x.numel() else x.detach().reshape(0, max(c, 1))
        index = outlier_channels(h, self.z) if h.numel() else torch.zeros(0, dtype=torch.int32, device=x.device)
        exact = h[:, index.long()].contiguous()
        if index.numel():
            h = h.clone()
            h[:, index.long()] = 0
        rest = quantize(h, self.bits, group_size=max(c, 1), generator=generator)
        return _OutlierCompressed(rest, exact, index, x.shape, x.dtype, dequantize)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        rows = -(-n // max(x.shape[-1] if x.dim() else 1, 1))
        return (-(-n * self.bits // 8) + 4 * rows) / n


class _ChannelCompressed:
    __slots__ = ("codes", "shape", "dtype", "_k")

    def __init__(self, codes, shape, dtype, kernels):
        self.codes, self.shape, self.dtype, self._k = codes, shape, dtype, kernels

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes.packed, self.codes.scales)  # the mins are 0 (not stored)

    def decompress(self) -> torch.Tensor:
        c = self.codes  # its mins are 0: made for the decode only, not held
        full = _Affine(c.packed, torch.zeros_like(c.scales), c.scales, c.bits, c.rowlen, c.per_col, c.offset,
                       c.numel, c.decode_seed)
        return full.decode(self._k, self.dtype).reshape(self.shape)


class ChannelWise(_KernelCompressor):
    """Symmetric quantization with one scale per channel (Adacc's compressor for q, k, v).

    Per channel ``c`` (dim -1): ``a_c = max |x[..., c]|``, ``L = 2**(bits-1) - 1``,
    ``s_c = L / a_c`` in float32, rounded down (and stepped down once if ``a_c * s_c > L``
    as computed: the rule of docs/method.md §7, ``s_c = 1`` for ``a_c = 0``); ``q =
    floor(x * s_c + u)`` in ``[-L, L]`` stored as ``q + L`` in ``bits`` bits; ``x_hat = q /
    s_c`` (0 is exact). Stochastic rounding: unbiased. A channel holding a NaN or infinity
    decompresses to NaN (that channel only).

    Default 8 bits: fewbit's attention keeps q and k at 8 bits because softmax exponentiates
    their quantization noise (docs/compression.md §1: 9x the gradient noise of eager
    attention at 4 bits); Adacc's INT4 for q, k, v is ``bits=4``.

    Bytes per element: ``bits / 8`` plus ``4 * C / numel`` (one float32 scale per channel).

    Args:
        bits: 2, 4 or 8.

    Raises:
        ValueError: ``bits`` not allowed; :meth:`compress` of a tensor with fewer than 2 dims.
    """

    name = "channelwise"
    stats_span_rows = True
    min_dim = 2

    def __init__(self, bits: int = 8) -> None:
        self.bits = check_bits(bits, allowed=(2, 4, 8))

    def _compress(self, x, generator, k: _Kernels) -> _ChannelCompressed:
        seed = _seed(generator)
        c = x.shape[-1]
        cdt = _ref.compute_dtype(x.dtype)
        flat = x.detach().reshape(-1)
        if flat.numel():
            a = flat.view(-1, c).abs().amax(dim=0).to(cdt)  # NaN-propagating
        else:
            a = torch.zeros(c, dtype=cdt, device=x.device)
        # per channel, the rule of docs/method.md §7 on the range [0, a] at L levels (m = 0)
        pairs = torch.stack([torch.zeros_like(a), a], dim=1).reshape(-1)
        _, s = k.pair_stats(pairs, self.bits - 1, torch.float32)
        zeros = torch.zeros_like(s)
        offset = (1 << (self.bits - 1)) - 1
        codes = _Affine.encode(k, flat, zeros, s, self.bits, c, True, offset, seed)
        codes.mins = None  # zeros: not held (they were, uncounted: 4 bytes a channel)
        return _ChannelCompressed(codes, x.shape, x.dtype, k)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        return (-(-n * self.bits // 8) + 4 * (x.shape[-1] if x.dim() else 1)) / n


class _SoftmaxCompressed:
    __slots__ = ("codes", "shape", "dtype", "_k")

    def __init__(self, codes, shape, dtype, kernels):
        self.codes, self.shape, self.dtype, self._k = codes, shape, dtype, kernels

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes.packed, self.codes.mins, self.codes.scales)

    @property
    def fixed_grid(self) -> bool:
        """Whether the fixed grid ``k / (2**bits - 1)`` was used (values in [0, 1])."""
        return bool(self.codes.mins.eq(0).all() and self.codes.scales.eq((1 << self.codes.bits) - 1).all())

    def decompress(self) -> torch.Tensor:
        return self.codes.decode(self._k, self.dtype).reshape(self.shape)


class Softmax(_KernelCompressor):
    """Asymmetric quantization on the fixed grid of [0, 1] (Adacc's compressor for softmax
    outputs and attention scores).

    ``q = floor(x * (2**bits - 1) + u)``, ``x_hat = q / (2**bits - 1)``: 0 and 1 are exact,
    no statistics are needed, stochastic rounding is unbiased. A tensor with a value
    outside [0, 1] falls back to its own range (``m = min``, ``s = (2**bits - 1) / (max -
    m)``, the rule of docs/method.md §7): still unbiased, never clipped; a NaN or infinity
    makes the whole tensor decompress to NaN. The check costs one min/max pass and no
    device synchronisation (the choice is made on device). A per-row max scale would cut
    the noise of long rows with a small max, at 4 bytes per row: not done.

    Bytes per element: ``bits / 8`` plus 8 bytes per tensor (the two float32 stats, fixed
    or not, so that the handle is one shape).

    Args:
        bits: 1, 2, 4 or 8 (default 4).

    Raises:
        ValueError: ``bits`` not allowed.
    """

    name = "softmax"

    def __init__(self, bits: int = 4) -> None:
        self.bits = check_bits(bits, allowed=_ref.SUPPORTED_BITS)

    def _compress(self, x, generator, k: _Kernels) -> _SoftmaxCompressed:
        seed = _seed(generator)
        cdt = _ref.compute_dtype(x.dtype)
        flat = x.detach().reshape(-1)
        levels = float((1 << self.bits) - 1)
        m = torch.zeros(1, device=x.device, dtype=torch.float32)  # float32 stats whatever torch's default dtype
        s = torch.full((1,), levels, device=x.device, dtype=torch.float32)
        if flat.numel():
            lo, hi = torch.aminmax(flat.to(cdt))
            m_own, s_own = _range_stats(k, lo, hi, self.bits)
            fixed = (lo >= 0) & (hi <= 1)  # False for NaN
            m, s = torch.where(fixed, m, m_own), torch.where(fixed, s, s_own)
        codes = _Affine.encode(k, flat, m, s, self.bits, flat.numel(), False, 0, seed)
        return _SoftmaxCompressed(codes, x.shape, x.dtype, k)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        return (-(-n * self.bits // 8) + 8) / n


#: name -> Compressor class, for :func:`get_compressor` (``Config``, the ``memory`` CLI).
COMPRESSORS: dict[str, type[Compressor]] = {
    "group": GroupQuantizer, "keep": Keep, "division": Division, "outlier": OutlierSeparated,
    "channelwise": ChannelWise, "softmax": Softmax,
}


def get_compressor(name: str, **options) -> Compressor:
    """The compressor registered as ``name`` (:data:`COMPRESSORS`), built with ``options``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the names), or an
            option is out of range (raised by the compressor).
        TypeError: an option the compressor does not take.
    """
    cls = COMPRESSORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"compressor must be one of {', '.join(sorted(COMPRESSORS))}; got {name!r}")
    return cls(**options)
