"""Compression of the tensors autograd saves for backward (docs/method.md §7; ActNN, GACT).

:class:`ActivationCompressor` installs ``torch.autograd.graph.saved_tensors_hooks``:
every floating tensor that an operation saves for backward inside ``with comp:`` is
replaced by a :class:`~fewbit.quant.QuantizedTensor` (group quantizer, ``bits`` per
element + stats), bool masks are packed losslessly at 1 bit, and the rest is kept as is.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_leaves

from fewbit import _norm_rows, _saved
from fewbit._checks import check_optimizer, check_positive_int, float64_out_of_range
from fewbit._interrupted import finished, leave_mode, remove_saved_tensors_hooks, sweep_modes
from fewbit._saved import Kept, keep

__all__ = ["ActivationCompressor", "CompressionStats", "SavedTensorRecord", "compress_activations"]

_BIT_WEIGHTS = {}  # device -> uint8 [1, 2, 4, ..., 128]


def _bit_weights(device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return w


def _pack_bool(t: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> ``(ceil(numel / 8),)`` uint8, bit ``j % 8`` of byte ``j // 8`` (docs/method.md §6, b=1)."""
    flat = t.reshape(-1).contiguous().view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _bit_weights(t.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    bits = (packed[:, None] & _bit_weights(packed.device)) != 0
    return bits.reshape(-1)[:numel]


@dataclass
class CompressionStats:
    """Counters of one :class:`ActivationCompressor` (reset with :meth:`reset`).

    Attributes:
        bytes_before: bytes (numel * itemsize) of the tensors that were compressed.
        bytes_after: bytes held for them (packed codes + stats, or packed bool bits).
        bytes_skipped: bytes of the saved tensors left uncompressed, counted at every save
            that holds a storage not already held exact (later saves of one are
            :attr:`deduplicated`).
        skipped_bytes: reason -> bytes of :attr:`bytes_skipped` (``parameter`` bytes are
            held by the model anyway).
        compressed: floating tensors quantized.
        packed_bool: bool tensors and float {0, c} masks packed at 1 bit (lossless).
        deduplicated: saves answered with an existing compressed copy, or of a storage
            another save of this pass already holds exact (no new bytes).
        skipped: reason -> count: ``parameter`` (nn.Parameter, leaf requiring grad, a
            view of one, or a dtype cast of one: autocast's weight copies), ``dtype``
            (integer/uint8 codes/complex), ``small`` (< min_numel), ``layout`` (sparse,
            meta, or a view with overlapping/zero strides),
            ``no_grad`` (floating tensors that do not require grad: op statistics such as
            SDPA's logsumexp, model inputs), ``statistic`` (results of ``rsqrt``, ``sqrt``
            and ``reciprocal`` saved for their own backward, which is not linear in them:
            a Python RMSNorm's ``rsqrt`` of the mean square; and any tensor of 2 or more
            dims whose last dim is 1, a per-row statistic such as a divisor ``std +
            eps``), ``nonlinear`` (saved by a call whose backward is not linear in them:
            ``gelu``, ``x ** 3``, ``abs``, a division, ...; :mod:`fewbit.quant.nonlinear`;
            or results a recurrent kernel saves for such a backward: oneDNN's LSTM cell
            state, cuDNN's RNN outputs), ``unseen`` (saved outside every torch call the compression mode
            sees: a custom ``autograd.Function``'s ``save_for_backward``, TorchScript; its
            backward is unknown),
            ``kept`` (left exact by a :class:`~fewbit.quant.compressors.Keep` compressor),
            ``checkpoint`` (the inputs a reentrant ``torch.utils.checkpoint`` saves),
            ``range`` (float64 tensors with magnitudes beyond what float32 statistics
            hold: :data:`fewbit._checks.FLOAT64_MAX`).
    """

    bytes_before: int = 0
    bytes_after: int = 0
    bytes_skipped: int = 0
    compressed: int = 0
    packed_bool: int = 0
    deduplicated: int = 0
    skipped: dict = field(default_factory=dict)
    skipped_bytes: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``bytes_before / bytes_after`` over the compressed tensors (nan if none)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else float("nan")

    def reset(self) -> None:
        self.bytes_before = self.bytes_after = self.bytes_skipped = 0
        self.compressed = self.packed_bool = self.deduplicated = 0
        self.skipped = {}
        self.skipped_bytes = {}


@dataclass(frozen=True)
class SavedTensorRecord:
    """One floating tensor an :class:`ActivationCompressor` compressed in the current pass
    (:attr:`ActivationCompressor.records`; the per-tensor rows of ``fewbit.memory``).

    Attributes:
        index: position in the pass's save order (see :class:`fewbit.quant.policies.SavedTensorInfo`);
            ``-1`` for a 1-bit mask (:attr:`ActivationCompressor.masks`), which no policy sees.
        fqn: innermost converted module (None outside ``fewbit.convert_``'s hooks).
        kind: its layer kind, or None.
        shape: the tensor's shape.
        dtype: its dtype.
        compressor: registry name of the compressor used (``"keep"``: left exact;
            ``"mask"``: a bool or float {0, c} mask packed losslessly at 1 bit).
        bits: bits per element of its codes (the dtype's width for ``"keep"``; stats excluded).
        nbytes: bytes held for it (codes, stats, exact parts).
    """

    index: int
    fqn: str | None
    kind: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    compressor: str
    bits: int
    nbytes: int


class _Handle:
    """What autograd keeps instead of a saved tensor: a compressor's
    :class:`~fewbit.quant.compressors.Compressed` (``qt``) or packed bool bits."""

    __slots__ = ("qt", "bool_bits", "mask_value", "shape", "dtype", "device", "__weakref__")

    def __init__(self, qt, bool_bits, shape, dtype, device, mask_value=None):
        self.qt = qt
        self.bool_bits = bool_bits
        self.mask_value = mask_value  # 0-d tensor c of a float {0, c} mask packed at 1 bit
        self.shape = shape
        self.dtype = dtype
        self.device = device

    @property
    def nbytes(self) -> int:
        if self.qt is not None:
            return self.qt.nbytes
        return self.bool_bits.numel()

    @property
    def lossy(self) -> bool:
        """Whether the unpacked tensor is an estimate (codes with rounding noise), not the saved values."""
        qt = self.qt
        if qt is None:  # packed bool bits
            return False
        if isinstance(qt, _Shared):
            return getattr(qt.target, "lossy", False)
        return True

    def unpack(self) -> torch.Tensor:
        if self.qt is not None:
            return self.qt.decompress()
        n = 1
        for d in self.shape:
            n *= d
        bits = _unpack_bool(self.bool_bits, n).reshape(self.shape)
        if self.mask_value is None:
            return bits
        return bits.to(self.dtype) * self.mask_value


class _ChannelMajor:
    """A :class:`~fewbit.quant.compressors.Compressed` of ``(N, C, *spatial)`` made from its
    ``(C, N, *spatial)`` copy, so that groups lie inside one channel (a training BatchNorm's
    ``(N, C)`` input: :class:`fewbit._norm_rows.Channels`); decompresses to the original
    layout, contiguous."""

    __slots__ = ("qt",)

    def __init__(self, qt):
        self.qt = qt

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes

    def decompress(self) -> torch.Tensor:
        return self.qt.decompress().movedim(0, 1).contiguous()


#: Log-softmax results below this (``log`` of float32's smallest normal, about -87.34) are
#: quantized apart from the rest of their row by :class:`_UnderflowKept`: their ``exp`` is
#: under 1.2e-38, so they do not count in log-softmax's backward ``g - exp(y) sum(g)``.
UNDERFLOW_LOG = math.log(torch.finfo(torch.float32).tiny)


class _UnderflowKept:
    """A :class:`~fewbit.quant.compressors.Compressed` of a log-softmax result whose entries
    below :data:`UNDERFLOW_LOG` (masked logits written as ``-inf``, ``finfo.min``, ``-1e9``
    or ``-1e4``; the tail of a peaked distribution) are taken apart: a 1-bit mask of them
    (the 1-bit stream of docs/method.md §6); of those, the ones equal to their row's
    smallest value (a ``masked_fill``'s entries are all ``c - logsumexp``, the same float)
    exact from one value per row holding one (a 1-bit mask over the rows along the
    softmax's dim) and a second 1-bit mask over the low entries; the others (a peaked distribution's tail, a second or an additive mask)
    gathered into a :class:`_LogGrid`; and the result with all of them replaced by their
    row's smallest other value, quantized as before.

    Why: one such entry set its group's range. ``-inf`` made the group NaN, ``finfo.min``
    and ``-1e9`` too (the range overflows), ``-1e4`` a step of 40 at 8 bits: the weight
    gradient of a cross-entropy over masked logits came out NaN, or 300 times its norm
    off, where its exact value is finite (``exp(y) = 0``). In groups of their own on a
    linear grid, a mask value set the tail's step (a soft-target cross-entropy over a
    peaked, masked result 1.1 times its norm off) and float32's cancellation decoded a
    tail next to ``-1e9`` as 0 (a plain cross-entropy 4.8 times off); the log grid keeps
    every tail value below :data:`UNDERFLOW_LOG`, each within a few percent.

    The values serve the other ops that save the same result and read them (an entropy's
    ``p * logp``, a soft-target cross-entropy ``-(q * logp).sum()``). Costs 1 bit per
    element and per row, 1 bit and (for the tail) about 1 byte per low entry, and one value
    per row holding one, for results that hold a low entry only (kept exact where that is
    more than the result's own bytes). A view of the result saved by a later op (``logp[:, :-1] * w``)
    is not seen as one, and is quantized with its low entries, as any tensor holding
    them."""

    __slots__ = ("qt", "dim", "mask", "count", "rows", "fill", "at_fill", "tail")

    def __init__(self, qt, dim: int, mask: torch.Tensor, count: int, rows: torch.Tensor, fill: torch.Tensor,
                 at_fill: torch.Tensor, tail) -> None:
        self.qt = qt
        self.dim = dim  # the softmax's
        self.mask = mask  # packed: the low entries
        self.count = count  # how many
        self.rows = rows  # packed, over the rows (t's shape, dim of size 1): those holding one
        self.fill = fill  # 1-D: the smallest value of each row holding one
        self.at_fill = at_fill  # packed, over the low entries: equal to their row's fill
        self.tail = tail  # the other low entries' _LogGrid; None if none

    @property
    def nbytes(self) -> int:
        n = self.qt.nbytes + self.mask.numel() + self.rows.numel() + self.at_fill.numel()
        n += self.fill.numel() * self.fill.element_size()
        return n + (self.tail.nbytes if self.tail is not None else 0)

    def decompress(self) -> torch.Tensor:
        y = self.qt.decompress()
        mask = _unpack_bool(self.mask, y.numel()).view(y.shape)
        shape = [1 if d == self.dim else n for d, n in enumerate(y.shape)]
        fill = y.new_zeros(shape)
        fill[_unpack_bool(self.rows, fill.numel()).view(shape)] = self.fill.to(y.dtype)
        low = fill.expand_as(y)[mask]
        if self.tail is not None:
            # float64 -> the result's dtype: the top of a grid at -finfo.max rounds past it
            tail = self.tail.decompress().clamp_(min=-torch.finfo(y.dtype).max)
            low[~_unpack_bool(self.at_fill, self.count)] = tail.to(y.dtype)
        y[mask] = low
        return y


class _LogGrid:
    """Negative values ``y`` (a log-softmax's tail, below :data:`UNDERFLOW_LOG`) at ``bits``
    bits: per group of ``group_size``, a grid uniform in ``log(-y)`` between the group's
    extremes (float64 ``lo`` and ``step``), each value rounded to one of its two
    neighbouring grid points with the probability that makes the mean of ``y`` itself
    exact (stochastic; the nearer one if not). The noise is uniform float32 from a CPU
    generator seeded with one draw of the given generator or of fewbit's noise stream
    (codes do not depend on the device). A log grid holds tails of mixed scale (-90 beside
    -1e9 or -3.4e38) with every value within a step's ratio, where a linear grid's step
    was set by the largest and float32 cancelled the rest to 0. Computed in float64 and
    the noise drawn a chunk of groups at a time (those temporaries of
    :data:`_LOG_GRID_CHUNK` values; the codes, and a padded copy of a tail that is not a
    whole number of groups, are of the tail's size). Bytes: 1 per value (a byte per code)
    and 16 per group."""

    __slots__ = ("codes", "lo", "step", "numel", "group_size")

    def __init__(self, codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, numel: int, group_size: int) -> None:
        self.codes, self.lo, self.step, self.numel, self.group_size = codes, lo, step, numel, group_size

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + 8 * (self.lo.numel() + self.step.numel())

    @staticmethod
    def compress(y: torch.Tensor, bits: int, group_size: int, stochastic: bool, generator) -> "_LogGrid":
        from fewbit.quant import _draw_seed

        n, levels = y.numel(), (1 << bits) - 1
        flat = y.detach().reshape(-1)
        pad = (-n) % group_size
        if pad:
            flat = torch.cat([flat, flat[-1:].expand(pad)])
        flat = flat.view(-1, group_size)
        cpu = torch.Generator().manual_seed(_draw_seed(generator)) if stochastic else None
        codes = torch.empty(flat.shape, dtype=torch.uint8, device=y.device)
        lo = torch.empty(flat.shape[0], 1, dtype=torch.float64, device=y.device)
        step = torch.empty_like(lo)
        rows = max(1, _LOG_GRID_CHUNK // group_size)
        for start in range(0, flat.shape[0], rows):
            part = slice(start, start + rows)
            log = torch.log(-flat[part].double())
            lo[part] = log.amin(1, keepdim=True)
            step[part] = (log.amax(1, keepdim=True) - lo[part]) / levels
            k = ((log - lo[part]) / step[part]).floor().nan_to_num_(0.0).clamp_(0, max(levels - 1, 0))
            below = torch.exp(lo[part] + k * step[part])
            p = ((-flat[part].double() - below) / (torch.exp(lo[part] + (k + 1) * step[part]) - below))
            p = p.nan_to_num_(0.0).clamp_(0, 1)  # a group of equal values (step 0): its one level
            if cpu is not None:  # drawn a chunk at a time: the numbers of one whole draw
                up = torch.rand(p.shape, generator=cpu, dtype=torch.float32).to(y.device) < p
            else:
                up = p >= 0.5
            codes[part] = (k + up).to(torch.uint8)
        codes = codes.reshape(-1)
        return _LogGrid(codes[:n].clone() if pad else codes, lo, step, n, group_size)

    def decompress(self) -> torch.Tensor:
        """float64 (the caller casts, at most the dtype's largest magnitude)."""
        codes = self.codes.double()
        pad = (-self.numel) % self.group_size
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad)])
        return (-torch.exp(self.lo + codes.view(-1, self.group_size) * self.step)).reshape(-1)[: self.numel]


#: Values of a :class:`_LogGrid` computed at once (its float64 temporaries: a few MiB).
_LOG_GRID_CHUNK = 1 << 16


def _without_underflow(t: torch.Tensor, dim: int, compressor, group_size: int, generator) -> _UnderflowKept | None:
    """:class:`_UnderflowKept` of ``t`` (its entries below :data:`UNDERFLOW_LOG` apart,
    replaced by the smallest other value of their row along ``dim``, 0 in a row with none),
    ``compressor`` (a group quantizer) on the rest, a :class:`_LogGrid` of its bits and
    ``group_size`` (the ActivationCompressor's, not ``compressor``'s rows) on the tail; None if ``t`` holds none (it is compressed as it is). Reads
    whether it holds one on the host (a device synchronisation on a GPU per log-softmax
    result saved; gathering the low entries, decompressing them, and whether there is a
    tail, take a few more for results that hold one). Always masking had cost a result of
    4096 x 32000 float32 six times the compression time and 630 MB more peak memory on
    the CPU."""
    mask = t < UNDERFLOW_LOG
    if not bool(mask.any()):
        return None
    inf = torch.tensor(torch.inf, dtype=t.dtype, device=t.device)
    floor = torch.where(mask, inf, t).amin(dim=dim, keepdim=True)
    floor = torch.where(torch.isfinite(floor), floor, torch.zeros((), dtype=t.dtype, device=t.device))
    fill = t.amin(dim=dim, keepdim=True)
    rows = mask.any(dim=dim, keepdim=True)
    low = t[mask]
    at_fill = (t == fill)[mask]
    tail = low[~at_fill]
    tail_qt = None
    if tail.numel():
        tail_qt = _LogGrid.compress(tail, compressor.bits, group_size, compressor.stochastic, generator)
    rest = compressor.compress(torch.where(mask, floor, t), generator=generator)
    return _UnderflowKept(rest, dim, _pack_bool(mask), low.numel(), _pack_bool(rows), fill[rows], _pack_bool(at_fill),
                          tail_qt)


class _TokenMajor(_ChannelMajor):
    """A :class:`~fewbit.quant.compressors.Compressed` of attention's ``q`` or ``k``
    ``(..., T, head_dim)`` made from its ``(..., head_dim, T)`` copy (a transpose of each
    head's ``T x head_dim`` matrix), so that groups lie inside one head channel's run of
    ``T`` tokens; decompresses to the original layout, contiguous."""

    __slots__ = ()

    def decompress(self) -> torch.Tensor:
        return self.qt.decompress().transpose(-1, -2).contiguous()


class _Shared:
    """A :class:`_Handle`'s payload once a later save of the same tensor holds it in a way
    that serves both saves (exact, or a copy grouped inside a norm's rows or channels):
    the first copy is freed and its save unpacks ``target`` (a :class:`_Handle` or a
    :class:`~fewbit._saved.Kept`) reshaped to its own shape."""

    __slots__ = ("target", "shape")
    nbytes = 0

    def __init__(self, target, shape):
        self.target = target
        self.shape = shape

    def decompress(self) -> torch.Tensor:
        return self.target.unpack().reshape(self.shape)


class _ViewHandle:
    """A saved tensor with the same elements, in C order, as one already packed in
    ``base``: it holds no bytes of its own and unpacks to ``base`` reshaped."""

    __slots__ = ("base", "shape", "__weakref__")

    def __init__(self, base: _Handle, shape):
        self.base = base
        self.shape = shape

    nbytes = 0

    @property
    def lossy(self) -> bool:
        return self.base.lossy

    def unpack(self) -> torch.Tensor:
        return self.base.unpack().reshape(self.shape)


def _two_valued_scale(t: torch.Tensor) -> torch.Tensor | None:
    """``c`` if every element of ``t`` is +0 or one finite ``c`` (a dropout mask), else None.

    The answer is read from the device once (one host sync on CUDA): the conditions are
    combined there, not read one by one (three syncs per save before)."""
    c = t.amax()
    ok = torch.isfinite(c) & (c != 0) & ((t == c) | ((t == 0) & ~torch.signbit(t))).all()
    return c if bool(ok) else None


#: Floating dtypes the compressors take; other floating tensors (float8) are kept exact.
_COMPRESSIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: autograd nodes of views, layout copies and dtype casts: a chain of them from a saved
#: tensor back to a parameter's ``AccumulateGrad`` makes the tensor a copy of the parameter.
_VIEW_OR_CAST_NODES = frozenset({
    "ToCopyBackward0", "CloneBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "SplitBackward0",
    "SplitWithSizesBackward0", "UnsafeSplitBackward0", "UnsafeSplitWithSizesBackward0", "SliceBackward0",
    "SelectBackward0", "UnbindBackward0", "NarrowBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward2", "ExpandBackward0", "AsStridedBackward0", "DiagonalBackward0",
    "ViewAsRealBackward0", "ViewAsComplexBackward0",
})


def _view_or_cast_chain(fn, steps: int = 9):
    """The autograd nodes from ``fn`` back through views, layout copies and casts
    (:data:`_VIEW_OR_CAST_NODES`, each with one input): ``fn``, its input, ..., up to the first
    node of another kind (included: a parameter's ``AccumulateGrad``), at most ``steps`` nodes
    (chains are short; an activation stops at its first node)."""
    for _ in range(steps):
        if fn is None:
            return
        yield fn
        if type(fn).__name__ not in _VIEW_OR_CAST_NODES:
            return
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return
        fn = inputs[0]


#: ``id(grad_fn)`` -> weak reference to a tensor a parametrization computed from
#: parameters alone (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``,
#: ``orthogonal``), registered by :func:`mark_parametrized`; an entry goes with its tensor.
_PARAMETRIZED: dict[int, weakref.ref] = {}


def mark_parametrized(t: torch.Tensor) -> None:
    """Register ``t``, a weight computed by a parametrization from parameters, as one:
    the compressor keeps it (and its views and casts) exact like a parameter. ``fewbit.convert_``
    calls it from a forward hook on each ``ParametrizationList`` of the model."""
    fn = t.grad_fn
    if fn is None:
        return
    key = id(fn)

    def drop(ref: weakref.ref, key: int = key) -> None:
        if _PARAMETRIZED.get(key) is ref:
            del _PARAMETRIZED[key]

    _PARAMETRIZED[key] = weakref.ref(t, drop)


def _parametrized(fn):
    """The parametrization's weight whose ``grad_fn`` is ``fn``, or None."""
    ref = _PARAMETRIZED.get(id(fn))
    t = ref() if ref is not None else None
    return t if t is not None and t.grad_fn is fn else None


def _is_parameter(t: torch.Tensor) -> bool:
    """nn.Parameter, a leaf that requires grad, a parametrization's weight
    (:func:`mark_parametrized`), or a copy of one, no larger than it, through views, layout
    copies and dtype casts (``weight.t()``, ``in_proj_weight.chunk(3)``, and autocast's
    bf16/fp16 weight copies, which it caches for the whole autocast region, of those
    views too): a weight quantized for backward gave each weight gradient its own relative
    error (0.85 at 2 bits on a 512 x 512 Linear; under CPU bf16 autocast ``x @ W.t()`` and
    cross-attention's in-projection weights were quantized until the chain was followed)."""
    for u in (t, t._base):
        if u is None:
            continue
        if isinstance(u, torch.nn.Parameter) or (u.is_leaf and u.requires_grad):
            return True
        for fn in _view_or_cast_chain(u.grad_fn):
            source = _parametrized(fn) if _PARAMETRIZED else None
            if source is not None:
                if u.numel() <= source.numel():
                    return True
                break
            if type(fn).__name__ == "AccumulateGrad":
                # a copy no larger than the parameter. A batch-sized copy (learned queries
                # expanded over the batch and reshaped, or a weight so expanded and cast by
                # autocast) is compressed like an activation: unbiased, each element with
                # its own noise, and B times the parameter's memory if it were kept
                variable = getattr(fn, "variable", None)
                if variable is None or u.numel() <= variable.numel():
                    return True
                break  # t._base (a view of a parameter shares its memory) is looked at next
    return False


def _weight_positions() -> dict:
    """torch function -> position of its ``weight`` argument (also taken by keyword)."""
    F = torch.nn.functional
    out = dict.fromkeys((F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                         F.conv_transpose3d, F.prelu, torch.conv1d, torch.conv2d, torch.conv3d,
                         torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d, torch.prelu), 1)
    out.update(dict.fromkeys((F.bilinear, torch.bilinear, F.layer_norm, torch.layer_norm, F.group_norm,
                              torch.group_norm, F.rms_norm, torch.rms_norm), 2))
    out.update({F.batch_norm: 3, F.instance_norm: 3, torch.batch_norm: 1, torch.instance_norm: 1})
    return out


#: The calls whose ``weight`` argument is a weight whatever computed it (:func:`_is_call_weight`).
_WEIGHT_POSITIONS = _weight_positions()

#: Calls whose argument at this position (or keyword) is a weight only where it derives from
#: a parameter at least its size (:func:`_from_a_larger_parameter`): transformers' Conv1D
#: (GPT-2) computes ``torch.addmm(bias, x, weight)``, but ``addmm``'s ``mat2`` is an
#: activation elsewhere (a graph network's ``addmm(b, attention, h)``, h59).
_MAYBE_WEIGHT_POSITIONS = {torch.addmm: (2, "mat2")}


def _from_a_larger_parameter(w: torch.Tensor) -> bool:
    """Whether ``w`` is computed, within 8 autograd nodes, from a parameter of at least its
    elements (a pruned or scaled weight), breadth first."""
    level, seen = [w.grad_fn], set()
    for _ in range(8):
        nxt = []
        for fn in level:
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if type(fn).__name__ == "AccumulateGrad":
                variable = getattr(fn, "variable", None)
                if variable is not None and variable.numel() >= w.numel():
                    return True
                continue
            nxt.extend(f for f, _ in fn.next_functions if f is not None)
        if not nxt:
            return False
        level = nxt
    return False


def _is_call_weight(t: torch.Tensor, call) -> bool:
    """Whether ``t``, saved by the torch call ``call`` (``(args, kwargs, serial, func)`` of
    :class:`fewbit.quant.mode.CompressionMode`), is that call's ``weight`` argument (a
    Linear's, a convolution's, a norm's), a view of it or a cast copy of it (autocast's).

    A weight computed in the forward from parameters is not a parameter but is one for
    backward: quantized like an activation, each weight gradient before it took its noise
    (at 2 bits the first layer's weight gradient 0.45 off its norm with the old
    ``torch.nn.utils.weight_norm``, 0.47 with ``spectral_norm``, 0.56 with ``prune``, 0.44
    with an equalized learning rate's ``F.linear(x, W * c)``, and 0.46-0.84 with a
    parametrization added after ``fewbit.convert_``). Kept exact whatever computed it: a
    weight an input generates (a hypernetwork's, StyleGAN2's modulated convolution, 2.9x
    the bytes held at 2 bits) is kept exact too, which costs memory, not accuracy."""
    if call is None or len(call) < 4:
        return False
    func, args, kwargs = call[3], call[0], call[1]
    pos, name, maybe = _WEIGHT_POSITIONS.get(func), "weight", False
    if pos is None:
        pos, name = _MAYBE_WEIGHT_POSITIONS.get(func, (None, None))
        maybe = True
    if pos is None:
        return False
    w = args[pos] if len(args) > pos else kwargs.get(name)
    if not isinstance(w, torch.Tensor) or t.numel() > w.numel():
        return False
    if maybe and not _from_a_larger_parameter(w):
        return False
    if t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() and t.device == w.device:
        return True
    goal = w.grad_fn  # autocast's cast copy (and views of it): a short chain to the weight's node
    return goal is not None and any(fn is goal for fn in _view_or_cast_chain(t.grad_fn))


def _dense_non_overlapping(t: torch.Tensor) -> bool:
    """True if the elements of ``t`` occupy ``numel`` distinct, adjacent memory slots."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _non_overlapping(t: torch.Tensor) -> bool:
    """True if no two elements of ``t`` share a memory slot (gaps allowed: a ``chunk`` or a
    strided slice of a larger tensor; not a stride-0 ``expand`` or an overlapping
    ``as_strided``). Sufficient test: with the dims sorted by stride, each stride is larger
    than the span of the dims before it."""
    span = 0  # offset of the last element reached by the dims so far
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if st <= span:
            return False
        span += st * (sz - 1)
    return True


class ActivationCompressor:
    """Compress the tensors saved for backward inside ``with`` blocks (ActNN-style).

    Floating tensors with at least ``min_numel`` elements are compressed by
    ``compressor`` (default: the group quantizer at ``bits``, :func:`fewbit.quant.quantize`,
    docs/method.md §7) and decompressed when backward needs them; bool tensors (dropout and other masks) are packed losslessly at 1 bit.
    Untouched: parameters (``nn.Parameter``, leaves that require grad, and views of
    them), integer and uint8 tensors (indices, fewbit codes), complex, sparse and
    overlapping (expanded) tensors, tensors smaller than ``min_numel``, and floating
    tensors that do not require grad (but for masks holding only 0 and one value c, e.g.
    CPU dropout's 0 or 1/(1-p), packed losslessly at 1 bit). The last are the statistics an op saves about its
    input (the logsumexp of ``scaled_dot_product_attention``, the mean and rstd of a
    norm): backward exponentiates or divides by them, so quantizing them biases the
    gradient (a 2-layer GPT-2 diverged with the logsumexp at 4 bits). The cost: a saved
    model input that does not require grad (the images into a first Conv) stays exact.

    A tensor saved by several operations (the q, k and v projections of one input) is
    compressed once: saves are keyed by (storage address, storage offset, shape, stride,
    dtype, device, version counter) while the tensor (or the base it is a view of) is
    alive; the key cache holds only weak references, so nothing is kept alive by it and
    an entry disappears when autograd frees the last graph that holds the compressed copy.

    The instance is re-entrant: ``with comp:`` may be used many times, nested, and by
    several modules (fewbit.convert enters it in a forward pre-hook and exits it in the
    forward hook). Unpacked tensors are contiguous, of the saved shape, dtype and device.

    Args:
        bits: bits per element, one of 1, 2, 4, 8.
        group_size: elements per quantization group.
        min_numel: tensors with fewer elements are kept as they are (default 4096: below
            that the stats and the bookkeeping are not worth it).
        stochastic: stochastic (unbiased) rounding if True, nearest if False.
        stats_dtype: torch.bfloat16 or torch.float32 for the per-group min and scale.
        generator: a CPU ``torch.Generator`` that supplies the noise seeds (one 64-bit draw
            per compressed tensor). If None (default), they come from fewbit's own noise
            stream, seeded from torch's seed (see the note below).
        compressor: a :class:`fewbit.quant.compressors.Compressor` applied to every
            floating tensor taken (then ``bits``, ``group_size``, ``stochastic`` and
            ``stats_dtype`` are not used); default ``GroupQuantizer(bits, group_size=...,
            stochastic=..., stats_dtype=...)``. With :class:`~fewbit.quant.compressors.Keep`
            the tensors are handed back as they are (counted as skipped, ``"kept"``).
        policy: a :class:`fewbit.quant.policies.Policy` that picks the compressor of each
            floating tensor from its :class:`~fewbit.quant.policies.SavedTensorInfo`
            (:class:`~fewbit.quant.policies.AdaccPolicy`, :class:`fewbit.quant.gact.GACTPolicy`,
            ...); not together with ``compressor``. Default: ``FixedPolicy(compressor)``.

    Note:
        Random numbers. Every compressed tensor gets a new 64-bit seed, so no two
        tensors, layers, steps or compressor instances reuse a noise pattern (a replayed
        pattern is a bias that SGD does not average away; docs/compression.md §1). With
        ``generator=None`` the seeds come from fewbit's own noise streams
        (:func:`fewbit.manual_seed`), never from torch's generators: a converted model
        draws the same dropout masks and data order as the vanilla model under the same
        seed. There is one stream per torch seed, made from the seed and torch's state at
        its first draw, so the same seed and program give the same gradients in a fresh
        process; a torch seed used before in the process goes on with its stream (fresh
        noise, not a replay). To replay a run within one process with the *same* seed, call
        ``fewbit.manual_seed(seed)`` (it seeds torch too), or pass a ``generator`` seeded
        by you and reuse it across steps.

    In-place changes. A tensor kept as it is (a parameter, a small, integer or ``keep``
        tensor) is checked when backward reads it, as torch checks saved tensors without
        hooks: if it was changed in place after the forward saved it (an optimizer step
        before ``backward``), backward raises torch's ``RuntimeError`` ("... modified by an
        inplace operation"), never computes a gradient from the changed values. A
        compressed copy holds the values as saved, so backward gives the gradient of the
        forward that ran (:mod:`fewbit._saved`).

    Passes. The tensors of one *pass* (one forward) are numbered in save order, which
    per-tensor policies key on: :meth:`step` starts a pass. ``fewbit.convert_`` calls it
    in a forward pre-hook of the converted model; used directly, every outermost ``with``
    block is a pass.

    Attributes:
        stats: :class:`CompressionStats` counters, accumulated over every use.
        policy: the :class:`~fewbit.quant.policies.Policy`.
        records: ``{index: SavedTensorRecord}`` of the floating tensors compressed (or
            kept by the policy) in the current pass.

    Raises:
        ValueError: for ``bits``, ``group_size``, ``min_numel`` or ``stats_dtype`` out of
            range, a ``generator`` that is not on the CPU, or both ``compressor`` and ``policy``.
        TypeError: for a ``generator`` that is not a ``torch.Generator``, a ``compressor``
            that is not a Compressor or a ``policy`` that is not a Policy.

    Example:
        >>> comp = ActivationCompressor(bits=4)
        >>> with comp:
        ...     loss = model(x).sum()
        >>> loss.backward()
        >>> comp.stats.ratio  # about 7.8 for float32 activations
    """

    def __init__(
        self,
        bits: int = 4,
        *,
        group_size: int = 256,
        min_numel: int = 4096,
        stochastic: bool = True,
        stats_dtype: torch.dtype = torch.bfloat16,
        generator: torch.Generator | None = None,
        compressor=None,
        policy=None,
    ):
        from fewbit.quant import _validate_options
        from fewbit.quant.compressors import Compressor, GroupQuantizer
        from fewbit.quant.policies import FixedPolicy, Policy

        _validate_options(bits, group_size, stats_dtype, generator, stochastic)
        check_positive_int(min_numel, "min_numel", minimum=0)
        if policy is not None:
            if compressor is not None:
                raise ValueError("pass either compressor or policy, not both")
            if not isinstance(policy, Policy):
                raise TypeError(f"policy must be a fewbit.quant.policies.Policy or None, got {type(policy).__name__}")
        else:
            if compressor is None:
                compressor = GroupQuantizer(bits, group_size=group_size, stochastic=stochastic, stats_dtype=stats_dtype)
            elif not isinstance(compressor, Compressor):
                raise TypeError(
                    f"compressor must be a fewbit.quant.compressors.Compressor or None, got {type(compressor).__name__}"
                )
            policy = FixedPolicy(compressor)
        self.policy = policy
        self._default = compressor = policy.default
        #: The policy's default Compressor (fewbit.quant.attention swaps it for q and k).
        self.compressor = compressor
        self.bits = getattr(compressor, "bits", bits)
        self.group_size = group_size
        self.min_numel = min_numel
        self.stochastic = bool(stochastic)
        self.stats_dtype = stats_dtype
        self.generator = generator  # None: fewbit's noise stream (fewbit.manual_seed), read at each draw
        self.stats = CompressionStats()
        self._stack: list = []
        self._owner: int | None = None  # the thread inside the blocks (threading.get_ident)
        #: the module call whose pre-hook entered first (:meth:`enter_from`), while inside
        self._frame = None
        self._outer = None  # the user's saved-tensor hooks under the outermost entry (_users_hooks)
        self._marked = None  # (hold, storage) of the last _mark_kept
        self._where: list = []  # (fqn, kind, norm_size) of the converted modules running, innermost last
        self._index = 0
        self._ordinals: dict = {}  # fqn -> saves of that module in this pass
        self._saves = 0  # every save packed, kept or not, since construction
        self._auto_step = True  # fewbit.convert_ sets False and calls step() per forward
        self.records: dict = {}
        #: The masks packed at 1 bit in the current pass (bool tensors, float {0, c} dropout
        #: masks), in save order: :class:`SavedTensorRecord` rows with index -1.
        self.masks: list = []
        #: What results saved for their own nonlinear backward get (RESULT_BITS).
        self._result_compressor = GroupQuantizer(RESULT_BITS, group_size=group_size, stochastic=stochastic,
                                                 stats_dtype=stats_dtype)
        # key -> (weakref to the tensor or its base, weakref to the handle, the norm layout
        # it was grouped for or None, its index in records or None, the serial of the call
        # that made it or None)
        self._cache: dict = {}
        # (storage, device, version) -> weakref to the tensor or its base, of storages kept
        # exact by a call whose backward is not linear in what it saves
        # (fewbit.quant.nonlinear); _keep_depth > 0 inside one
        self._kept: dict = {}
        self._keep_depth = 0
        # (input, scope) of the per-sample norm calls running (_within_norm), innermost last
        self._norm_inputs: list = []
        # .call: (args, kwargs, serial, func) of the torch call running under CompressionMode, or None
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ActivationCompressor(policy={self.policy!r}, min_numel={self.min_numel})"

    def __getstate__(self) -> dict:
        self.check_interrupted()
        if self._stack:
            raise RuntimeError("an ActivationCompressor cannot be copied or pickled inside its own `with` block "
                               "(a forward is running): copy or save it between training steps")
        state = self.__dict__.copy()
        del state["_local"]  # per thread, and only set while a call runs
        state["_frame"] = state["_outer"] = state["_marked"] = None
        # what live graphs hold (weak references, which cannot be pickled): not state
        state["_kept"], state["_cache"] = {}, {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_norm_inputs", [])  # pickled by an earlier build
        self.__dict__.setdefault("_frame", None)
        self.__dict__.setdefault("masks", [])
        self.__dict__.setdefault("_outer", None)
        self.__dict__.setdefault("_marked", None)
        self._local = threading.local()

    # passes and policies -------------------------------------------------------------
    def step(self) -> None:
        """Start a pass: the next tensor taken gets index 0 and :attr:`records` and
        :attr:`masks` are emptied;
        :attr:`compressor` follows the policy's ``default`` (a
        :class:`~fewbit.quant.policies.WarmupPolicy` changes it after its warm-up)."""
        self._index = 0
        self._ordinals = {}
        self.records = {}
        self.masks = []
        default = self.policy.default
        if default is not self._default:
            self._default = self.compressor = default
            self.bits = getattr(default, "bits", self.bits)

    def adapt(self, model: torch.nn.Module, closure,
              optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> bool:
        """Let the policy re-plan (GACT: :meth:`fewbit.quant.gact.GACTPolicy.adapt`); call
        it once per training step, before the step's forward. ``closure()`` runs the
        model's forward on the step's batch and returns the scalar loss (no backward).
        ``optimizer`` (optional): the training's optimizer, or a list of its optimizers,
        whose second moments GACT weighs the gradient noise by
        (:meth:`fewbit.quant.gact.GACTPolicy.adapt`).

        Returns:
            True if the policy re-planned now; False otherwise (also for fixed policies,
            for which the call does nothing).

        A forward the policy runs that saves no tensor through this compressor (``model``
        or ``closure`` not the converted model's; a ``torch.compile``'d forward; one whose
        saves all belong to ``torch.utils.checkpoint``) measures nothing: a
        ``RuntimeWarning`` says so, it returns False, and the re-plan is tried again at the
        next call. A call that raises leaves the re-plan schedule as it was too.

        Raises:
            TypeError: ``closure`` is not callable, ``optimizer`` not a
                ``torch.optim.Optimizer``, a list of them or None (and the policy's own
                checks).
        """
        if not callable(closure):
            raise TypeError(f"closure must be callable, () -> loss, got {type(closure).__name__}")
        check_optimizer(optimizer)

        def counted():
            before = self._saves
            loss = closure()
            if self._saves == before:
                raise _NothingSaved
            return loss

        schedule = self.policy.schedule()
        try:
            return self.policy.adapt(model, counted, optimizer)
        except BaseException as exc:
            if schedule is not None:  # a failed call does not use up a re-plan
                self.policy.set_schedule(schedule)
            if not isinstance(exc, _NothingSaved):
                raise
        warnings.warn(
            "adapt: the closure's forward saved no tensor through this compressor, so nothing was measured "
            "(no re-plan): pass the model it was converted into (fewbit.convert.compressor_of(model)) and a "
            "closure that runs that model's forward eagerly (a torch.compile'd forward, or one whose saves "
            "all belong to torch.utils.checkpoint, saves none here)", RuntimeWarning, stacklevel=2)
        return False

    def _push_module(self, fqn: str, kind: str | None, norm_size=None) -> None:
        """Enter converted module ``fqn`` of ``kind``; ``norm_size(shape) -> int | None``
        gives :attr:`~fewbit.quant.policies.SavedTensorInfo.norm_size` of a tensor it saves.

        A norm module written in Python (transformers' RMSNorm) saves its input for ``pow``
        and for ``x * rsqrt(...)`` in two calls: two independent copies at the policy's
        bits (:meth:`_may_share`), so the quadratic term takes one rounding error in each
        factor and its mean is exact; its input is not taken at :data:`RESULT_BITS` as the
        input of torch's norm functions is (:meth:`_within_norm`). Measured on
        ``scripts/train_lm.py --arch llama`` at 2 bits, seeds 0-2: one shared 8-bit copy
        instead gave 1.9277 / 1.8741 / 1.8920 against 1.9051 / 1.8699 / 1.8922, for 3.49
        MiB saved instead of 3.20."""
        self._where.append((fqn, kind, norm_size))

    def _pop_module(self) -> None:
        if self._where:
            self._where.pop()

    def _keeping(self, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)`` with everything it saves kept exact (reason
        ``nonlinear``; fewbit.quant.nonlinear)."""
        self._keep_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._keep_depth -= 1

    def _within_norm(self, size: int | None, per_sample: bool, x: torch.Tensor, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)``, a normalization function whose input ``x`` has rows of
        ``size`` elements, with that ``norm_size`` (unless a converted norm module running
        it gave one already; fewbit.quant.nonlinear).

        ``per_sample`` (LayerNorm, RMSNorm, GroupNorm, InstanceNorm): ``x``, saved once for
        a backward that is quadratic in it, gets :data:`RESULT_BITS` inside its rows
        (``SavedTensorInfo.role == "norm_input"``), whatever the policy chose unless it keeps
        it exact. LayerNorm's ``dx = rstd (g w - mean(g w) - x_hat mean(g w x_hat))`` gains
        ``-rstd^3 g_i w_i Var(e_i) / size`` in the mean (docs/compression.md §1), and a
        row's step is set by its largest elements: on a LayerNorm(768) with one channel
        30x the others, 2-bit groups inside rows gave the input gradient a bias of 1.4 % of
        its norm (400 draws, mean z**2 11; 2 bits bound it by 1/9 whatever the size); at 8
        bits 0.01 % (z**2 1.1). A BatchNorm on batch statistics (``per_sample`` False) shares
        one mean over ``N * plane`` elements, and its input keeps the policy's bits."""
        outer = self._where[-1] if self._where else (None, None, None)
        marked = per_sample and size is not None
        if marked:  # the input of the innermost norm call, and its scope
            self._norm_inputs.append((x, next(_NORM_SCOPES)))
        try:
            if size is None or outer[2] is not None:
                return func(*args, **kwargs)
            # the input, or a view of its elements in the same order (F.instance_norm saves a
            # (1, N * C, *spatial) view of its (N, C, *spatial) input): rows of `size` in C order
            numel = x.numel()
            self._where.append((outer[0], outer[1], lambda s: size if math.prod(s) == numel else None))
            try:
                return func(*args, **kwargs)
            finally:
                self._where.pop()
        finally:
            if marked:
                self._norm_inputs.pop()

    def _norm_input(self, t: torch.Tensor) -> int | None:
        """The scope (a serial) of the innermost per-sample norm call running
        (:meth:`_within_norm`) if ``t`` (a floating save with a norm's row layout) is its
        input ``x``, a view of its elements or a copy torch made of it below the call
        (:func:`_copy_of`); else None. The kernels save copies: ``torch.instance_norm`` of
        ``x.contiguous()``, ``native_group_norm`` of a non-contiguous ``x`` made contiguous,
        CUDA autocast's float32 cast of a half ``x`` for ``layer_norm`` and ``group_norm``;
        matched by data pointer alone, they had kept the policy's 2 bits (InstanceNorm2d on
        a channels_last input: 1.8 % bias). Saves of one scope share one copy (its cache
        layout carries the scope): its error taken twice is the 8-bit one."""
        if not self._norm_inputs:
            return None
        x, scope = self._norm_inputs[-1]
        if t.numel() != x.numel():
            return None
        return scope if t.data_ptr() == x.data_ptr() or _copy_of(t, x) else None

    # context manager -------------------------------------------------------------------
    def enter_from(self, frame) -> "ActivationCompressor":
        """:meth:`__enter__` from a module's forward pre-hook (``fewbit.convert_``'s), whose
        exit is a forward hook that a ``KeyboardInterrupt`` skips: ``frame`` is that module
        call's (:func:`fewbit._interrupted.caller_frame`); once it has stopped executing
        with the block still open, the block is left over and is left
        (:meth:`check_interrupted`)."""
        self.check_interrupted()
        sweep_modes()
        self.__enter__()
        if len(self._stack) == 1:
            self._frame = frame
        return self

    def check_interrupted(self) -> bool:
        """Leave every block that a forward interrupted by a ``BaseException`` other than
        an ``Exception`` (``KeyboardInterrupt``) left open (fewbit._interrupted): its
        saved-tensor hooks and :class:`~fewbit.quant.mode.CompressionMode` had stayed on
        in the thread, and quantized what every later model saved. Returns whether it did."""
        if not self._stack or self._frame is None or not finished(self._frame):
            return False
        self._abandon()
        return True

    def _abandon(self) -> None:
        n = len(self._stack)
        mode, self._mode = self._mode, None
        self._stack.clear()
        self._frame = None
        self._outer = None
        self._where.clear()
        for _ in range(n):  # torch's saved-tensor hooks: ours, wherever they sit (hooks a user
            # entered since keep their place; popping only from the top had left ours under
            # them for good, quantizing every later model's saves)
            if not remove_saved_tensors_hooks(self._pack, self._unpack):
                break
        if mode is not None:
            leave_mode(mode)
        self._owner = None

    def __enter__(self) -> "ActivationCompressor":
        """Install the saved-tensor hooks; the outermost entry also pushes
        :class:`fewbit.quant.mode.CompressionMode`, which reroutes
        ``F.scaled_dot_product_attention`` to a backward that recomputes from the saved q,
        k, v (torch's fused kernels rebuild softmax from an exact logsumexp that quantized
        q, k no longer match), and the calls whose backward is not linear in what they save
        (:mod:`fewbit.quant.nonlinear`; docs/compression.md §1)."""
        me = threading.get_ident()
        with _OWNER_LOCK:  # the check and the claim in one step (two threads entering at once)
            if self._owner is not None and self._owner != me:
                # the pass's state (the modules running, the save ordinals, the mode, which
                # torch keeps per thread) is this instance's: two threads inside it at once
                # (the replicas of nn.DataParallel share a converted model's compressor)
                # popped each other's modes and left calls unrouted (abs quantized:
                # gradients 0.57 off)
                raise RuntimeError(
                    "this ActivationCompressor is already in use by another thread: nn.DataParallel's replicas "
                    "share a converted model's compressor; train with one process per GPU "
                    "(DistributedDataParallel), or give each thread its own compressor")
            self._owner = me
        try:
            if not self._stack:
                self._outer = _users_hooks()
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            if not self._stack:
                if self._auto_step:
                    self.step()
                mode = _compression_mode(self)
                try:
                    mode.__enter__()
                except BaseException:
                    ctx.__exit__(None, None, None)
                    raise
                self._mode = mode
            self._stack.append(ctx)
        except BaseException:
            if not self._stack:
                self._owner = None
            raise
        return self

    def __exit__(self, *exc) -> None:
        if not self._stack:
            raise RuntimeError("ActivationCompressor.__exit__ without a matching __enter__")
        ctx = self._stack.pop()
        try:
            if not self._stack:
                mode, self._mode = self._mode, None
                if _top_function_mode() is mode:
                    mode.__exit__(*exc)
                else:  # a mode entered inside the block and left over by an interrupt is on
                    # top (an interrupted converted model's): popping the top had left ours on
                    leave_mode(mode)
        finally:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] == self._pack and top[1] == self._unpack:
                ctx.__exit__(*exc)
            else:  # likewise for the saved-tensor hooks: ours, wherever they sit
                remove_saved_tensors_hooks(self._pack, self._unpack)
            if not self._stack:
                self._frame = None
                self._outer = None
                self._owner = None  # released last: another thread may enter now

    @property
    def active(self) -> bool:
        """True while inside at least one ``with`` block of this instance."""
        return bool(self._stack)

    # hooks -------------------------------------------------------------------------------
    def _skip(self, t: torch.Tensor, reason: str):
        nbytes = t.numel() * t.element_size()
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        self.stats.skipped_bytes[reason] = self.stats.skipped_bytes.get(reason, 0) + nbytes
        self.stats.bytes_skipped += nbytes
        return keep(t)  # checked for in-place changes on unpack, as torch does (fewbit._saved)

    def _pack(self, t: torch.Tensor):
        self._marked = None
        packed = self._pack_one(t)
        outer = self._outer
        if outer is not None and type(packed) is Kept:
            # what is kept exact goes through the user's hooks (save_on_cpu around a
            # converted model): torch applies the innermost pair only, and they had seen no
            # tensor saved inside a compressed layer (h72)
            users = _UsersPacked(outer[0](t), outer[1])
            if self._marked is not None and self._marked[0] is packed:
                # the storage stays registered as held exact while the graph holds the
                # user's packing: dropped with the Kept, later saves of it were quantized
                # (a gradient 0.77 off under save_on_cpu, h73)
                self._mark_kept(users, self._marked[1])
            return users
        return packed

    def _pack_one(self, t: torch.Tensor):
        if self._frame is not None and self.check_interrupted():
            return keep(t)  # the save of a forward after an interrupted one: not ours
        # this save's place among its module's saves in the pass, every save counted (a
        # tensor skipped on one batch, under min_numel, must not move the others)
        self._saves += 1
        fqn = self._where[-1][0] if self._where else None
        ordinal = self._ordinals.get(fqn, 0)
        self._ordinals[fqn] = ordinal + 1
        if t.layout != torch.strided or t.device.type == "meta":
            return self._skip(t, "layout")
        if _is_parameter(t) or _is_call_weight(t, getattr(self._local, "call", None)):
            return self._skip(t, "parameter")
        is_bool = t.dtype == torch.bool
        if not (is_bool or t.dtype in _COMPRESSIBLE_DTYPES):  # ints, complex, float8: exact
            return self._skip(t, "dtype")
        if t.numel() < max(self.min_numel, 1):
            return self._skip(t, "small")
        if t.dtype == torch.float64 and float64_out_of_range(t) is not None:
            return self._skip(t, "range")  # values the float32/bfloat16 statistics cannot hold
        if getattr(self._local, "call", None) is None and _saved_by_checkpoint():
            # a reentrant checkpoint's inputs: backward recomputes the whole block from
            # them, through its norms, softmax and activations, which are not linear in them
            return self._skip(t, "checkpoint")
        if not _non_overlapping(t):  # an expanded view: its elements are not its bytes
            return self._skip(t, "layout")
        mask_value = None
        if not is_bool and not t.requires_grad:
            # Non-differentiable floats saved for backward are statistics of the op that
            # saved them (SDPA's logsumexp, a norm's mean/rstd): backward rebuilds e.g.
            # softmax as exp(s - lse), so a quantization error in them is exponentiated
            # into a biased gradient. They are kept exact, except {0, c} masks (CPU
            # dropout saves 0 or 1/(1-p) as floats), which are packed losslessly at 1 bit.
            # The check reads the device (a host sync on CUDA), so a storage already held
            # exact is not checked again: a LLaMA's rotary cos and sin, saved four times in
            # every layer, had cost 12 syncs per layer and step.
            storage = _storage_key(t)
            if self._held_exact(storage):
                self.stats.deduplicated += 1
                return self._mark_kept(keep(t), storage)  # this graph's hold counts too
            with torch.no_grad():
                mask_value = _two_valued_scale(t)
            if mask_value is None:
                return self._mark_kept(self._skip(t, "no_grad"), storage)
        elif not is_bool and (_result_of(t) in _EXACT_RESULTS or _per_row_statistic(t) or _norm_statistic(t)):
            return self._skip(t, "statistic")
        elif not is_bool and _nonlinear_result(t):
            return self._mark_kept(self._skip(t, "nonlinear"), _storage_key(t))  # later saves reuse it
        elif (not is_bool and self._stack and getattr(self._local, "call", None) is None
              and not getattr(_CUSTOM_SAVES, "compressible", False)):
            # saved outside every torch call the mode sees: a custom autograd.Function's
            # save_for_backward, TorchScript. Its backward is unknown (BLOOM's GeLUFunction:
            # tanh of what it saves; fused attention and SwiGLU kernels), so the save is
            # kept exact: quantized, BLOOM's GELU input biased the weight gradient by 6 %
            # of its norm (6000 draws, 8.5 standard errors)
            self._warn_unseen()
            return self._mark_kept(self._skip(t, "unseen"), _storage_key(t))  # later saves reuse it
        # A contiguous tensor is keyed by the elements it covers, not its shape: a reshaped
        # view of a tensor already packed (eager attention's matmul saves the probabilities
        # as a (B*H, T, T) view of the (B, H, T, T) softmax result) reuses that copy.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.device, t._version) + (
            (t.numel(),) if t.is_contiguous() else (tuple(t.shape), t.stride())
        )
        if not is_bool and mask_value is None:
            # Kept exact is keyed by storage: any view of a storage kept exact (the other half
            # of a fused projection split with chunk) is held anyway.
            storage = _storage_key(t)
            held = self._held_exact(storage)
            if self._keep_depth:  # inside a call whose backward is not linear in it
                if not held:
                    return self._mark_kept(self._skip(t, "nonlinear"), storage)
            if held:  # its storage is kept exact: a quantized copy would only add bytes
                self.stats.deduplicated += 1
                return self._mark_kept(keep(t), storage)  # this graph's hold counts too
        # A norm layer needs groups inside its rows or channels (Compressor.within): a copy
        # another module made first, with groups across them, does not serve it.
        fn = self._where[-1][2] if self._where else None
        rows = fn(tuple(t.shape)) if fn is not None and not is_bool and mask_value is None else None
        # the layout this save needs of a copy: a norm's rows, or attention's q/k groups (8
        # bits inside head channels; a Linear's 2-bit copy of the same tensor made first had
        # served the q of `sdpa(h.unsqueeze(1), k, v)`: dq off by 0.71 of its norm)
        layout = rows
        scope = self._norm_input(t) if rows is not None else None
        norm_input = scope is not None
        if norm_input:  # RESULT_BITS inside the rows: a copy at the policy's bits does not serve it
            layout = (_NORM_INPUT_LAYOUT, rows, scope)
        if self.compressor is not self._default and not is_bool and mask_value is None:
            layout = _QK_LAYOUT
        hit = self._cache.get(key)
        earlier = None  # a live copy of this tensor that does not serve this save
        if hit is not None:
            anchor, handle = hit[0](), hit[1]()
            # a norm's input saved twice inside one norm call (torch's CPU rms_norm: for the
            # square and for x * rsqrt) shares its RESULT_BITS copy (the layout carries the
            # call's scope): at 8 bits the error taken twice is the single save's (_within_norm)
            if anchor is not None and handle is not None and (
                    (norm_input and hit[2] == layout) or self._may_share(t, hit[4])):
                if layout is None or hit[2] == layout:
                    self.stats.deduplicated += 1
                    return handle if tuple(handle.shape) == tuple(t.shape) else _ViewHandle(handle, t.shape)
                earlier = (handle, hit[3], hit[2])
        if is_bool or mask_value is not None:
            with torch.no_grad():
                bits = t if is_bool else t != 0
                handle = _Handle(None, _pack_bool(bits), t.shape, t.dtype, t.device, mask_value)
            self.stats.packed_bool += 1
            fqn, kind = self._where[-1][:2] if self._where else (None, None)
            self.masks.append(SavedTensorRecord(-1, fqn, kind, tuple(t.shape), t.dtype, "mask", 1, handle.nbytes))
        else:
            handle = self._compress(t, rows, ordinal, norm_input)
            if handle is None:
                # held exact: later saves of its storage keep it too (a compressed copy by
                # another module would only add bytes)
                kept = self._mark_kept(self._skip(t, "kept"), _storage_key(t))
                if earlier is not None:  # and an earlier save's copy is not needed any more
                    self._share(earlier, kept, None, t)
                return kept
            if earlier is not None and earlier[2] is None:
                # the earlier save (which needed no layout) uses this copy: one copy held
                self._share(earlier, handle, self.records.get(self._index - 1), t)
        self.stats.bytes_before += t.numel() * t.element_size()
        self.stats.bytes_after += handle.nbytes
        anchor = t._base if t._base is not None else t
        cache = self._cache

        def _drop(ref, key=key, cache=cache):
            entry = cache.get(key)
            if entry is not None and entry[1] is ref:
                del cache[key]

        record = self._index - 1 if handle.qt is not None else None
        call = getattr(self._local, "call", None)
        self._cache[key] = (weakref.ref(anchor), weakref.ref(handle, _drop), layout, record,
                            call[2] if call is not None else None)
        return handle

    def _share(self, earlier: tuple, target, record, t: torch.Tensor) -> None:
        """Point the earlier save's ``(handle, record index, layout)`` of ``t`` at ``target`` (a new
        copy whose groups also serve it, with ``record``; or a Kept, ``record`` None) and
        free its own copy, adjusting :attr:`stats` and its row of :attr:`records`."""
        handle, index, _ = earlier
        if handle.qt is None or isinstance(handle.qt, _Shared):
            return
        self.stats.bytes_after -= handle.qt.nbytes
        self.stats.bytes_before -= t.numel() * t.element_size()
        handle.qt = _Shared(target, handle.shape)
        old = self.records.get(index) if index is not None else None
        if old is not None:
            if record is None:  # held exact
                bits = torch.finfo(t.dtype).bits
                self.records[index] = replace(old, compressor="keep", bits=bits, nbytes=0)
            else:
                self.records[index] = replace(old, compressor=record.compressor, bits=record.bits, nbytes=0)

    def _may_share(self, t: torch.Tensor, serial) -> bool:
        """Whether the save of ``t`` now may use a copy an earlier save made (one noise draw
        for both): only if no other argument of the saving call depends on ``t``.

        Otherwise a gradient can take the same rounding error twice: in ``x * lin(x)`` the
        Linear's weight gradient is ``Q(x)^T (g * Q(x))``, whose mean is off by
        ``sum g Var(Q(x))`` on the diagonal when both factors are one copy (0.38 of the
        gradient's norm at 2 bits), and exact in the mean with two independent copies.
        A chain through a shared copy needs the later saving call to take, besides ``t``,
        something computed from it; parallel uses (the q, k, v projections of one input,
        attention's probabilities saved by softmax and by ``P @ V``) share. A save outside
        a torch call the mode sees (a custom ``autograd.Function``'s ``save_for_backward``)
        gets its own copy, and so does a second save by the call that made the copy
        (``F.bilinear(x, x, W)``'s weight gradient ``Q(x)^T g Q(x)``; ``F.rms_norm``,
        which saves ``x`` for ``pow`` and for ``x * rsqrt(...)`` inside one call).
        ``serial``: the serial of the call that made the copy (None: unknown)."""
        call = getattr(self._local, "call", None)
        if call is None or call[2] == serial:
            return False
        base = t._base if t._base is not None else t
        ptr = base.untyped_storage().data_ptr()
        others = [a for a in tree_leaves(call[:2]) if isinstance(a, torch.Tensor)
                  and a.grad_fn is not None and a.untyped_storage().data_ptr() != ptr]
        if not others:
            return True
        targets = {n for n in (t.grad_fn, base.grad_fn) if n is not None}
        return not any(_depends_on(a.grad_fn, targets, base) for a in others)

    def _warn_unseen(self) -> None:
        """Say once per compressor that a save outside every call the mode sees was kept
        exact: a model whose layers are custom ``autograd.Function`` s (float8 or fused
        matmuls) would otherwise lose their compression with only a stats entry to show."""
        if getattr(self, "_warned_unseen", False):
            return
        self._warned_unseen = True
        who = _custom_function_name() or "a custom torch.autograd.Function or TorchScript code"
        warnings.warn(
            f"fewbit kept exact a tensor saved by {who}: its backward is unknown, and a quantized save is "
            "only safe for a backward linear in it (reason 'unseen' in the compression stats; said once per "
            "compressor). For code whose backward is linear in what it saves (a custom matmul), run it inside "
            "fewbit.quant.compress_custom_saves()", RuntimeWarning, stacklevel=2)

    def _mark_kept(self, held: Kept, storage: tuple) -> Kept:
        """Register ``storage`` (data pointer, device, version) as held exact while ``held``
        (the pack hook's result, which a graph holds) or another registered hold of it lives:
        later saves of any view of it are kept too; returns ``held``. Tied to the graphs'
        holds, not to the caller's tensor: a tensor the user kept alive (a GAN's
        ``fake.detach()``) had registered its storage past its graph's end, and a later
        graph kept ``fake`` exact instead of compressing it."""
        refs = self._kept.setdefault(storage, [])
        refs.append(weakref.ref(held, functools.partial(_drop_kept, self._kept, storage)))
        self._marked = (held, storage)  # the last registration (_pack hands it to the user's hooks' result)
        return held

    def _held_exact(self, storage: tuple) -> bool:
        """Whether a live graph holds ``storage`` exact (:meth:`_mark_kept`)."""
        return any(ref() is not None for ref in self._kept.get(storage, ()))

    def _compress(self, t: torch.Tensor, norm_size, ordinal: int, norm_input: bool = False):
        """The policy's (or attention's forced) compressor on floating ``t``; None if kept.
        ``norm_size``: the saving norm module's layout for ``t`` (``norm_size(shape)`` of
        :meth:`_push_module`; an int, a :class:`fewbit._norm_rows.Channels` or None);
        ``ordinal``: its place among its module's saves (``SavedTensorInfo.key``);
        ``norm_input``: ``t`` is a per-sample norm's input (:meth:`_within_norm`)."""
        from fewbit.quant.policies import SavedTensorInfo, compressor_bits

        forced = self.compressor is not self._default  # fewbit.quant.attention's q and k
        fqn, kind = self._where[-1][:2] if self._where else (None, None)
        channels = isinstance(norm_size, _norm_rows.Channels)  # BatchNorm's (N, C): channel-major
        if channels:
            norm_size = norm_size.size
        role = "qk" if forced else None
        if _result_of(t) in _NONLINEAR_RESULTS:
            role, norm_size = "result", _softmax_rows(t)
        elif norm_input and not forced and not channels:
            role = "norm_input"
        elif channels and not forced and norm_size < _norm_rows.MIN_CHANNEL:
            role = "norm_input"  # a BatchNorm channel of few elements (_norm_rows.MIN_CHANNEL)
        info = SavedTensorInfo(self._index, tuple(t.shape), t.dtype, fqn, kind, role, norm_size, (fqn, ordinal),
                               channels)
        self._index += 1
        self.policy.observe(info)
        compressor = self.compressor if forced and not self.policy.decides_qk else self.policy.choose(t, info)
        if role in ("result", "norm_input") and compressor.name != "keep":
            compressor = self._result_compressor
        if norm_size is not None:  # statistics inside each normalized row (Compressor.within)
            compressor = compressor.within(norm_size)
        # Attention's q and k (the recomputed softmax is not linear in them): groups inside
        # one head channel's run of tokens (of one batch item and head), not across
        # channels. One channel with a large common offset (+30 in q and k) set the step of
        # 16 rows x all channels, and the recomputed probabilities turned that noise into a
        # bias of 13 % of dq's norm. Runs shorter than a group get groups of one run.
        qk_channels = role == "qk" and t.dim() >= 2 and t.shape[-1] > 1 and compressor.name == "group"
        if qk_channels:
            compressor = compressor.within(t.shape[-2])
        if compressor.name != "keep" and (not compressor.supports(t)
                                           or compressor.bytes_per_element(t) >= t.element_size()):
            # a policy that hands a tensor to a compressor that cannot take it: kept exact,
            # never an error in the middle of the user's forward; and one whose statistics
            # would cost more than the tensor (rows of 2 elements of a BatchNorm's (2, C)
            # input: 4 bytes of stats per 2 elements)
            from fewbit.quant.compressors import Keep

            compressor = Keep()
        if compressor.name == "keep":
            qt = None
        else:
            generator = self.policy.generator(info) or self.generator
            with torch.no_grad():
                if channels and role in (None, "norm_input"):
                    qt = _ChannelMajor(compressor.compress(t.detach().movedim(1, 0).contiguous(), generator=generator))
                elif qk_channels:
                    qt = _TokenMajor(compressor.compress(t.detach().transpose(-1, -2).contiguous(), generator=generator))
                elif (role == "result" and _result_of(t) == "LogSoftmaxBackward0" and t.dim()
                      and (masked := _without_underflow(t.detach(), _saved_dim(t), compressor, self.group_size,
                                                         generator)) is not None):
                    qt = masked
                else:
                    qt = compressor.compress(t.detach(), generator=generator)
            if isinstance(qt, _UnderflowKept) and qt.nbytes >= t.numel() * t.element_size():
                # rows of two entries: a value and a mask bit per row cost more than the
                # result itself (a (200000, 2) float32 result: 2.05 MB against 1.6)
                from fewbit.quant.compressors import Keep

                qt, compressor = None, Keep()
            else:
                self.stats.compressed += 1
        nbytes = qt.nbytes if qt is not None else t.numel() * t.element_size()
        self.records[info.index] = SavedTensorRecord(
            info.index, fqn, kind, info.shape, t.dtype, compressor.name, compressor_bits(compressor, t.dtype), nbytes
        )
        return None if qt is None else _Handle(qt, None, t.shape, t.dtype, t.device)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, (_Handle, _ViewHandle)):
            if torch.is_grad_enabled() and packed.lossy and _builds_graph_of_backward():
                raise RuntimeError(_DOUBLE_BACKWARD)
            return packed.unpack()
        if isinstance(packed, (Kept, _UsersPacked)):
            return packed.unpack()
        return packed


class _UsersPacked:
    """A tensor kept exact, packed by the user's saved-tensor hooks (:func:`_users_hooks`)."""

    __slots__ = ("packed", "unpack_hook", "__weakref__")  # weakly referenced: ActivationCompressor._kept

    def __init__(self, packed, unpack_hook) -> None:
        self.packed, self.unpack_hook = packed, unpack_hook

    def unpack(self) -> torch.Tensor:
        return self.unpack_hook(self.packed)


def _users_hooks() -> tuple | None:
    """The saved-tensor hooks in force around a converted forward, if they are the user's
    (``torch.autograd.graph.save_on_cpu``, a user's own pair), not a checkpoint's (which
    fewbit stands aside for) or fewbit's own (a memory report's recorder, the planner's
    capture, another converted model's compressor). Torch applies only the innermost pair:
    the tensors fewbit keeps exact are handed on to these; compressed ones stay fewbit's
    (their codes and statistics, on the tensor's device)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or _saved.checkpoint_hooks() is not None:
        return None
    module = getattr(top[0], "__module__", None) or ""
    if module == "fewbit" or module.startswith("fewbit."):
        return None
    return top


#: The cache layout of attention's q and k copies (ActivationCompressor._pack).
_QK_LAYOUT = "qk"
#: The cache layout of a per-sample norm's input, ``(_NORM_INPUT_LAYOUT, rows, scope)``:
#: RESULT_BITS inside rows, shared within one norm's scope (ActivationCompressor._norm_input).
_NORM_INPUT_LAYOUT = "norm_input"
#: Serials of per-sample norm scopes (``next`` is atomic under the GIL).
_NORM_SCOPES = itertools.count()


class _NothingSaved(Exception):
    """Raised out of :meth:`ActivationCompressor.adapt`'s closure: its forward saved nothing here."""


_FUNCTION_FILE = torch.autograd.function.__file__


def _builds_graph_of_backward() -> bool:
    """Whether this unpack (with grad mode on) is a node of a backward that builds a graph
    of itself (``create_graph=True``): it runs inside a backward, and not in a Python
    ``autograd.Function``'s ``backward``, which may have turned grad mode on itself (to
    recompute in backward: an ordinary ``backward()`` then unpacks with grad on). Outside
    a backward (a direct unpack, as the planner's timing) it is not."""
    if torch._C._current_graph_task_id() == -1:
        return False
    # a device thread's backward may have no Python frame above; an apply frame above is a
    # Python Function's backward (BackwardCFunction.apply)
    return next(_apply_frames(sys._getframe(1).f_back), None) is None


def _apply_frames(f, limit: int | None = None):
    """The frames of ``torch.autograd.function``'s ``apply`` (a custom Function's
    ``apply``, ``BackwardCFunction.apply``) among ``f`` and its callers, innermost first,
    looking at ``limit`` frames at most (None: all)."""
    n = 0
    while f is not None and (limit is None or n < limit):
        if f.f_code.co_filename == _FUNCTION_FILE and f.f_code.co_name == "apply":
            yield f
        f = f.f_back
        n += 1


# Raised when a backward that builds a graph of itself (create_graph=True) unpacks a
# compressed tensor. Its gradient is still an unbiased estimate, but what is computed from it
# next is not linear in it: the gradient penalty |dL/dx|^2 of a Linear -> x * sigmoid(x) ->
# Linear under 2-bit groups had weight gradients off by 0.38 of their norm over 300 draws
# (noise alone: 0.02), the quantization variance turned into a bias.
#: What to do about a gradient of a gradient through compressed saves (also the advice of
#: :mod:`fewbit.quant.attention`'s error).
KEEP_EXACT_ADVICE = (
    "Keep saved tensors exact for such a model: run its forward outside fewbit.compress_activations, "
    "or convert it with fewbit.Config(saved_bits=None) (activations only)"
)
_DOUBLE_BACKWARD = (
    "fewbit: a backward with create_graph=True (a gradient penalty, a Hessian-vector product, "
    "MAML) reached a saved tensor that fewbit compressed: its rounding noise would enter the "
    "gradient of the gradient squared, a bias rather than noise. " + KEEP_EXACT_ADVICE
)


#: Bits of a tensor saved once for a backward that is not linear in it, whatever the policy
#: chose (unless it kept it exact): a result saved for its op's own backward (softmax,
#: log-softmax, tanh, sigmoid; :data:`_NONLINEAR_RESULTS`) and the input of a per-sample
#: normalization (LayerNorm, RMSNorm, GroupNorm, InstanceNorm;
#: :meth:`ActivationCompressor._within_norm`). The bias such a backward makes of the
#: quantization variance falls with the step squared: (2^2 - 1)^2 / (2^8 - 1)^2 = 1/7225 of
#: 2 bits'.
RESULT_BITS = 8

# Results that their producing op saves for its own backward, which is not linear in them,
# so a quantization variance becomes a bias (docs/compression.md §1), by the grad_fn that
# produced them.
#
# Softmax's backward is ``dx = y (g - sum(y g))``, quadratic in ``y``: each probability's
# variance becomes a bias ``Var(e_i) g_i`` against a true term ``y_i (g_i - mean)`` that is
# small for small probabilities; log-softmax's ``dx = g - exp(y) sum(g)`` exponentiates the
# error. Eager attention (transformers' ``eager`` implementation, ``nn.MultiheadAttention``
# with ``need_weights=True``) saves its probabilities this way: on ``scripts/train_lm.py``'s
# GPT-2 after 300 steps, 2-bit groups biased the whole gradient by 11 % of its norm (48
# draws, 11 standard errors). They get RESULT_BITS in row groups; then the bias is below
# what 48 draws resolve (tests/quant/test_softmax_results.py).
#
# tanh's backward is ``g (1 - y^2)`` and sigmoid's ``g y (1 - y)``: each result's variance
# becomes a bias ``-Var(e) g``, largest where the true derivative is smallest (saturated
# units). Gemma's logit and attention soft-capping ``c tanh(s / c)``, LSTM/GRU gates written
# in Python and gating ``x * sigmoid(...)`` save them this way. With 2-bit groups, inputs of
# scale 2, the input gradient averaged over 400 draws was off by 13 % (tanh) and 12 %
# (sigmoid) of its norm; at RESULT_BITS, below 0.5 %. They keep the policy's group layout
# (their values lie in [-1, 1] or [0, 1] whatever the row).
_NONLINEAR_RESULTS = frozenset({"SoftmaxBackward0", "LogSoftmaxBackward0", "TanhBackward0", "SigmoidBackward0"})
#
# rsqrt's backward is ``-r^3 g / 2``, sqrt's ``g / (2 y)``, reciprocal's ``-y^2 g``: the
# error is cubed or divided by, and these results are per-row statistics of different
# scales (a Python RMSNorm, as in LLaMA, saves ``rsqrt(mean(x^2))``), which no group's
# linear grid fits. They are kept exact, like the norms' own mean and rstd: on an RMSNorm
# over 8192 rows of 64 with row scales spread over e^(+-2), 2-bit groups of 256 rows gave
# an input gradient off by 9.5x its norm (600 draws); kept, by 0.009x.
_EXACT_RESULTS = frozenset({"RsqrtBackward0", "SqrtBackward0", "ReciprocalBackward0"})
#
# The recurrent kernels save their own outputs for a backward that is not linear in them,
# inside one call the mode sees as a whole (``torch.lstm``): oneDNN's LSTM (CPU) its final
# cell state ``cy`` (output 2; ``tanh(c_T)`` in backward: mean z**2 46 when only ``cy`` was
# quantized, 0.9 for its output or ``hy``), cuDNN's and MIOpen's RNNs (not measured: every
# result kept).
_NONLINEAR_RESULTS_EXACT = frozenset({"CudnnRnnBackward0", "MiopenRnnBackward0"})
_NONLINEAR_RESULT_OUTPUTS = {"MkldnnRnnLayerBackward0": frozenset({2})}


def _storage_key(t: torch.Tensor) -> tuple:
    """The key of ``t``'s storage in :attr:`ActivationCompressor._kept` (data pointer,
    device, version): any view of a storage held exact is held anyway."""
    return (t.untyped_storage().data_ptr(), t.device, t._version)


#: Autograd nodes of ops that only move, reshape or cast their input's elements.
_COPY_NODES = frozenset({
    "CloneBackward0", "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
    "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "AliasBackward0",
})


def _copy_of(t: torch.Tensor, x: torch.Tensor, depth: int = 4) -> bool:
    """Whether ``t`` was made from ``x`` by at most ``depth`` ops that only copy, reshape or
    cast its elements (:data:`_COPY_NODES`), following ``t``'s autograd graph (both require
    grad)."""
    node, target = t.grad_fn, x.grad_fn
    for _ in range(depth):
        if node is None or type(node).__name__ not in _COPY_NODES or not node.next_functions:
            return False
        node = node.next_functions[0][0]
        if node is None:
            return False
        if target is not None and node is target:
            return True
        if target is None and getattr(node, "variable", None) is x:  # x a leaf: its AccumulateGrad
            return True
    return False


def _custom_function_name() -> str | None:
    """The name of the custom ``autograd.Function`` whose ``apply`` is running (the pack
    hook runs inside it when its ``save_for_backward`` is packed), or None."""
    for f in _apply_frames(sys._getframe(1), limit=12):
        cls = f.f_locals.get("cls")
        if isinstance(cls, type):
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def _norm_statistic(t: torch.Tensor) -> bool:
    """Whether ``t`` is a statistic a normalization kernel returns beside its output (output
    1 or 2 of ``native_layer_norm``, ``native_group_norm``, ``native_batch_norm``,
    ``_fused_rms_norm``: the mean and the reciprocal standard deviation). Kept exact for the
    reason of :data:`_EXACT_RESULTS` (backward multiplies by ``rstd`` and its powers).
    ``native_group_norm`` returns them as outputs that require grad, of shape ``(N,
    groups)``, so the ``no_grad`` and per-row rules miss them: a GroupNorm(32, 64) on a batch
    of 128 (4096 statistics, ``min_numel``) quantized them at 2 bits, and its input gradient
    was off by 2.2 % of its norm over 200 draws (mean z**2 2.3)."""
    return t.output_nr > 0 and (_result_of(t) or "").endswith("NormBackward0")


def _nonlinear_result(t: torch.Tensor) -> bool:
    """Whether ``t`` is a result its producing op saves for a backward that is not linear
    in it and the mode could not reroute (:data:`_NONLINEAR_RESULTS_EXACT`): kept exact,
    and so is every other save of it (the next Linear's input)."""
    name = _result_of(t)
    if name in _NONLINEAR_RESULTS_EXACT:
        return True
    outputs = _NONLINEAR_RESULT_OUTPUTS.get(name)
    return outputs is not None and t.output_nr in outputs


def _per_row_statistic(t: torch.Tensor) -> bool:
    """Whether ``t``'s last dim is 1 (and it has another): a keepdim reduction broadcast
    against its rows (a divisor ``std + eps`` or ``norm + eps``, a row scale), kept exact for
    the reason of :data:`_EXACT_RESULTS`, whatever produced it. The op that saves it often
    divides by it (``x / d`` saves ``d``; its backward is ``-g x / d^2``), which the pack hook
    cannot see (it sees the producer, not the consumer). A Python LayerNorm ``a (x - mean) /
    (std + eps) + b`` ("The Annotated Transformer") quantized in 2-bit groups of 256 rows
    gave an input gradient off by 1708x its norm (a divisor rounded towards 0;
    tests/quant/test_norm_rows.py). Such tensors are ``1/C`` of their rows' bytes. Only the
    last dim: a size-1 dim elsewhere is as often data (the ``(B, 1, T, D)`` q, k and v of
    single-head attention, a one-channel map); a channels-first norm over dim 1 (ConvNeXt's)
    divides by a ``sqrt`` result, kept exact by :data:`_EXACT_RESULTS`."""
    return t.dim() >= 2 and t.shape[-1] == 1


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def _saved_by_checkpoint() -> bool:
    """Whether the save being packed (one no torch call of the mode made: a custom
    ``autograd.Function``'s) comes from ``torch.utils.checkpoint``'s reentrant
    ``CheckpointFunction``, i.e. a frame of that module is among the callers. With 2 bits
    its quantized block input gave GPT-2's gradient a bias of 2.2 standard errors."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if f.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        f = f.f_back
    return False


#: Most autograd nodes :func:`_depends_on` visits before it answers "depends".
_MAX_VISITED = 4096


def _depends_on(node, targets: set, leaf: torch.Tensor) -> bool:
    """Whether the graph behind ``node`` reaches one of ``targets`` (autograd nodes), or,
    with no targets, the AccumulateGrad node of ``leaf``. Nodes made before the oldest
    target (lower sequence number, same thread) cannot depend on it and are not walked;
    past :data:`_MAX_VISITED` nodes the answer is True (the caller then makes its own copy)."""
    floor = min(n._sequence_nr() for n in targets) if targets else -1
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if not targets and type(n).__name__ == "AccumulateGrad" and n.variable is leaf:
            return True
        if len(seen) >= _MAX_VISITED:
            return True
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen and (not targets or nxt._sequence_nr() >= floor):
                seen.add(nxt)
                stack.append(nxt)
    return False


def _drop_kept(kept: dict, key, ref) -> None:
    refs = kept.get(key)
    if refs is not None:
        refs[:] = [r for r in refs if r is not ref]
        if not refs:
            del kept[key]


def _top_function_mode():
    """The innermost torch function mode of this thread, or None."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    return stack[-1] if stack else None


def _result_of(t: torch.Tensor) -> str | None:
    """The class name of the autograd node that produced ``t`` (None for a leaf)."""
    fn = t.grad_fn
    return None if fn is None else type(fn).__name__


def _saved_dim(t: torch.Tensor) -> int:
    """The dim of the softmax / log-softmax that produced ``t`` (-1 if its node does not
    say), in ``[0, t.dim())``."""
    dim = getattr(t.grad_fn, "_saved_dim", None)
    dim = -1 if dim is None else int(dim)
    if dim >= 1 << 63:  # the saved int64 comes back as its unsigned value
        dim -= 1 << 64
    return dim % max(t.dim(), 1)


def _softmax_rows(t: torch.Tensor) -> int | None:
    """The row length of a softmax / log-softmax result ``t`` if the op ran over its last
    dim (rows contiguous in C order), else None."""
    if getattr(t.grad_fn, "_saved_dim", None) is None or not t.dim():
        return None
    return t.shape[-1] if _saved_dim(t) == t.dim() - 1 else None


_CUSTOM_SAVES = threading.local()
#: Guards :attr:`ActivationCompressor._owner`'s check and claim (one lock for all instances:
#: an instance stays picklable).
_OWNER_LOCK = threading.Lock()


@contextlib.contextmanager
def compress_custom_saves():
    """Inside: what code outside every torch call the compression mode sees saves (a custom
    ``torch.autograd.Function``'s ``save_for_backward``, TorchScript) is compressed like any
    other saved tensor, instead of kept exact (reason ``unseen`` in
    :class:`CompressionStats`).

    Only for code whose backward is linear in each tensor it saves (a custom matmul or
    convolution kernel): an unbiased quantizer keeps such a gradient unbiased, but not a
    backward that takes a nonlinear function of what it saved (BLOOM's ``GeLUFunction``:
    ``tanh`` of its input; fused attention, SwiGLU, RMSNorm kernels), where the rounding
    noise becomes a bias (docs/compression.md §1). Per thread; nests.

    Example::

        with fewbit.compress_activations(4), fewbit.quant.compress_custom_saves():
            y = MyLinearFunction.apply(x, w)
    """
    outer = getattr(_CUSTOM_SAVES, "compressible", False)
    _CUSTOM_SAVES.compressible = True
    try:
        yield
    finally:
        _CUSTOM_SAVES.compressible = outer


def compress_activations(bits: int = 4, **options) -> ActivationCompressor:
    """A fresh :class:`ActivationCompressor`, for ``with fewbit.compress_activations(4): ...``.

    Saved floating tensors of any shape and dtype are group-quantized to ``bits`` bits
    per element plus ``2 * 16 / group_size`` bits per element of bf16 stats (ActNN,
    Chen et al., ICML 2021; docs/method.md §7); unpacked copies have the saved shape and dtype.

    Args: as :class:`ActivationCompressor` (``bits`` one of 1, 2, 4, 8; the keyword-only
    ``group_size``, ``min_numel``, ``stochastic``, ``stats_dtype``, ``generator``).

    Returns:
        A new compressor (its ``stats`` count bytes before/after inside its blocks).

    Raises:
        ValueError: for ``bits``, ``group_size``, ``min_numel`` or ``stats_dtype`` out of
            range, or a ``generator`` that is not on the CPU.
        TypeError: for a ``generator`` that is not a ``torch.Generator``, or an unknown option.
    """
    return ActivationCompressor(bits, **options)


def _compression_mode(comp: ActivationCompressor):
    """The TorchFunctionMode an active compressor pushes (fewbit.quant.mode)."""
    from fewbit.quant.mode import CompressionMode

    return CompressionMode(comp)
