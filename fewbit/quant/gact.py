"""GACT auto-precision: per-tensor bits from gradient sensitivity (docs/compression.md §2).

Liu et al., "GACT: Activation Compressed Training for Generic Network Architectures",
ICML 2022. With stochastic rounding at ``b_l`` bits per element of saved tensor ``l`` the
gradient variance is bounded by ``Σ_l c_l S(b_l)``, ``S(b) = (2^b - 1)^-2`` (GACT Thm. 2);
:class:`GACTPolicy` estimates the sensitivities ``c_l`` (GACT Alg. 1) and gives each tensor
the bits of :func:`allocate_bits` (GACT eq. 4: minimise ``Σ c_l S(b_l)`` subject to
``Σ b_l D_l <= average_bits · Σ D_l``), from {1, 2, 4, 8, keep}. By default each element
of the gradient noise is measured relative to that element's gradient scale, as an
Adam-family optimizer's update sees it (``noise_norm``; the optimizer's second moment when
:meth:`GACTPolicy.adapt` is given the optimizer); GACT's plain norm is
``noise_norm="absolute"``.

Through ``fewbit.convert_``::

    summary = fewbit.convert_(model, fewbit.Config(saved_bits="auto", average_bits=2))
    for x, y in loader:
        summary.compressor.adapt(model, lambda: loss_fn(model(x), y), opt)  # re-plans when due
        loss = loss_fn(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import collections
import copy
import heapq
import math
import os
import sys
import warnings
from collections.abc import Sequence

import torch

from fewbit._checks import check_average_bits, check_bool, check_noise_norm, check_optimizer, check_positive_int
from fewbit.quant.compressors import GroupQuantizer, Keep
from fewbit.quant.policies import Policy, SavedTensorInfo

__all__ = ["GACTPolicy", "allocate_bits", "variance_factor", "CANDIDATE_BITS"]

#: Quantized widths a tensor can get; above them it is kept exact (its dtype's width).
CANDIDATE_BITS: tuple[int, ...] = (1, 2, 4, 8)


def variance_factor(bits: int) -> float:
    """``S(b) = (2^b - 1)^-2`` for ``b`` in :data:`CANDIDATE_BITS`; 0 for a kept tensor
    (``b`` > 8). GACT Thm. 2."""
    if bits > CANDIDATE_BITS[-1]:
        return 0.0
    return 1.0 / float((1 << bits) - 1) ** 2


#: Elements per chunk of :func:`_rounding_variances` (rounded down to whole groups): its
#: scratch is a few float32 copies of one chunk, not of the tensor.
_VARIANCE_CHUNK = 1 << 20


def _rounding_variances(x: torch.Tensor, group_size: int) -> list[float]:
    """Mean variance per element of stochastic rounding of ``x`` group-quantized at each of
    :data:`CANDIDATE_BITS`, in ``x``'s units squared.

    An element at ``f`` of its way between two levels ``s_b`` apart is rounded up with
    probability ``f``: its variance is ``s_b² f (1 − f)``, ``s_b = (max − min) / (2^b − 1)``
    of its group (ActNN eq. 3; groups of ``group_size`` elements of ``x`` read in C order,
    as :func:`fewbit.quant.quantize` reads it). GACT's ``S(b) = (2^b − 1)^-2`` (Thm. 2)
    is this up to a factor that is the same at every width only when ``f`` is spread
    evenly between levels; at 1 bit ``f`` is the element's place in its group's range, and
    most elements of a bell-shaped group sit mid-range where ``f (1 − f)`` is near its
    largest, ¼, against the even spread's ⅙.

    Args:
        x: any shape, a floating dtype (read as float32); not modified.
        group_size: elements per group, >= 1.

    Returns:
        One float per width of :data:`CANDIDATE_BITS`: ``mean(s_b² f (1 − f))`` over the
        elements (nan where ``x`` holds a non-finite value; 0 for an empty or constant one).
    """
    flat = x.detach().reshape(-1)
    n = flat.numel()
    totals = torch.zeros(len(CANDIDATE_BITS), dtype=torch.float64, device=flat.device)
    chunk = max(_VARIANCE_CHUNK // group_size, 1) * group_size
    for start in range(0, n, chunk):
        part = flat[start:start + chunk].float()
        size = part.numel()
        groups = -(-size // group_size)
        if groups * group_size > size:  # the last group is short: padded with its own last element
            part = torch.cat([part, part[-1:].expand(groups * group_size - size)])
        part = part.view(groups, group_size)
        lo = part.amin(1, keepdim=True)
        span = part.amax(1, keepdim=True) - lo
        t = (part - lo) / torch.where(span > 0, span, torch.ones_like(span))  # the place in the range, [0, 1]
        for i, bits in enumerate(CANDIDATE_BITS):
            levels = float((1 << bits) - 1)
            f = torch.frac(t * levels)
            v = (span / levels).square() * f * (1 - f)
            totals[i] += v.reshape(-1)[:size].sum(dtype=torch.float64)
    return (totals / max(n, 1)).tolist()


def _variance_factors(variances: Sequence[float] | None, probe_bits: int) -> list[float]:
    """The variance factor of each width of :data:`CANDIDATE_BITS` for one tensor, on
    :func:`variance_factor`'s scale at the probe's width: ``S(probe) · V(b) / V(probe)``,
    ``V`` of :func:`_rounding_variances` on the tensor the probe measured, so that the
    sensitivity ``c_l`` measured at ``probe_bits`` prices every width by that tensor's own
    rounding variance. ``S(b)`` itself where ``V`` is missing, 0 or not finite."""
    standard = [variance_factor(b) for b in CANDIDATE_BITS]
    if variances is None:
        return standard
    probe = variances[CANDIDATE_BITS.index(probe_bits)]
    if not (math.isfinite(probe) and probe > 0) or not all(math.isfinite(v) for v in variances):
        return standard
    return [variance_factor(probe_bits) * v / probe for v in variances]


def _factor(factors: Sequence[float], bits: int) -> float:
    """A tensor's variance factor at ``bits`` (:func:`_variance_factors`); 0 where it is kept."""
    return factors[CANDIDATE_BITS.index(bits)] if bits in CANDIDATE_BITS else 0.0


def _agree(flags: list[bool], device: torch.device, how: str) -> list[bool]:
    """``flags`` made the same on every rank of the default process group: each one's AND
    (``how="all"``) or OR (``"any"``) over the ranks, in one all-reduce; as given in one
    process. A re-plan's branches (measure, skip a non-finite or all-zero step, plan) decide
    how many forwards and backwards :meth:`GACTPolicy.adapt` runs, each a collective under
    DDP: decided per rank, they had hung the job (h78)."""
    from fewbit.quant import _world

    if _world() == 1:
        return flags
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    op = torch.distributed.ReduceOp.MIN if how == "all" else torch.distributed.ReduceOp.MAX
    torch.distributed.all_reduce(t, op=op)
    return [bool(v) for v in t.tolist()]


def _restore_buffers(buffers: list) -> None:
    """Copy back each ``(buffer, copy)``. Every one: kernels update some in place without
    moving their version counter (BatchNorm's running mean and variance)."""
    with torch.no_grad():
        for b, saved in buffers:
            # .data: b.copy_ moved the version counter, and a graph alive across the call
            # that saved b (a BatchNorm's statistics in eval mode, micro-batches) refused its
            # backward (h76)
            b.data.copy_(saved)


def allocate_bits(
    sensitivity: Sequence[float],
    numel: Sequence[int],
    budget_bits: float,
    keep_bits: Sequence[int],
    min_bits: Sequence[int] | None = None,
    factors: Sequence[Sequence[float]] | None = None,
) -> list[int]:
    """Greedy solution of GACT eq. 4: per-tensor bits under a total-bits budget.

    Every tensor starts at its ``min_bits`` (1 bit by default); the upgrade (to the next of 1, 2, 4, 8, keep) with the
    largest variance decrease per extra bit, ``c_l (S(b) - S(b')) / ((b' - b) D_l)``, is
    applied while it fits in the budget; an upgrade that does not fit ends that tensor's
    upgrades. O(L log L) for L tensors (at most 4 upgrades each). With ``S(b)`` the decrease
    per bit shrinks from one width to the next, so for tensors of equal size the greedy
    choice is optimal (with measured ``factors`` only where they keep that order: a
    tensor whose elements sit mostly at its groups' ends, as a ReLU output's zeros, has a
    1-bit factor far under ``S(1)``) (tests/quant/test_gact.py compares it with brute
    force); for unequal sizes it
    is the knapsack greedy, which can miss the optimum when an upgrade does not fit (5 of
    200 random 1-4 tensor cases in that test's setting, each within 1.6x of it).

    Args:
        sensitivity: ``c_l >= 0`` per tensor.
        numel: ``D_l`` (elements) per tensor.
        budget_bits: ``B``, total bits for all tensors' codes (stats not counted).
        keep_bits: bits per element of each tensor kept exact (32 for float32, 16 for
            bf16/fp16).
        min_bits: the fewest bits of each tensor, one of :data:`CANDIDATE_BITS` (default
            1 for all); counted in the budget first.
        factors: each tensor's variance factor at each width of :data:`CANDIDATE_BITS`, in
            place of ``S(b)`` (default ``S(b)`` for all; a kept tensor's is 0).
            :class:`GACTPolicy` passes each tensor's own rounding variance, scaled to
            ``S`` at the probe's width.

    Returns:
        Bits per tensor (``keep_bits[l]`` where it is kept exact). If the minimum bits
        exceed the budget, the minimums are dropped (every tensor starts at 1 bit); if
        even 1 bit each exceeds it, every tensor gets 1 bit.

    Raises:
        ValueError: lengths differ, a ``min_bits`` entry not in :data:`CANDIDATE_BITS`, or
            a ``factors`` entry not of one value per width.
    """
    n = len(numel)
    if min_bits is None:
        min_bits = [CANDIDATE_BITS[0]] * n
    if factors is None:
        factors = [[variance_factor(b) for b in CANDIDATE_BITS]] * n
    if not (len(sensitivity) == n == len(keep_bits) == len(min_bits) == len(factors)):
        raise ValueError("sensitivity, numel, keep_bits, min_bits and factors must have the same length")
    if any(len(f) != len(CANDIDATE_BITS) for f in factors):
        raise ValueError(f"factors entries must hold one value per width of {CANDIDATE_BITS}")
    if any(b not in CANDIDATE_BITS for b in min_bits):
        raise ValueError(f"min_bits entries must be in {CANDIDATE_BITS}, got {list(min_bits)!r}")
    if sum(b * d for b, d in zip(min_bits, numel)) > budget_bits:
        min_bits = [CANDIDATE_BITS[0]] * n
    levels = [CANDIDATE_BITS + (int(k),) for k in keep_bits]
    variance = [tuple(float(v) for v in f) + (0.0,) for f in factors]  # by level; kept: 0
    level = [CANDIDATE_BITS.index(b) for b in min_bits]
    used = float(sum(b * d for b, d in zip(min_bits, numel)))

    def entry(i: int):
        b, b2 = levels[i][level[i]], levels[i][level[i] + 1]
        drop = variance[i][level[i]] - variance[i][level[i] + 1]
        gain = float(sensitivity[i]) * drop / ((b2 - b) * max(numel[i], 1))
        return (-gain, i)

    heap = [entry(i) for i in range(n) if level[i] + 1 < len(levels[i])]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        cost = (levels[i][level[i] + 1] - levels[i][level[i]]) * numel[i]
        if used + cost > budget_bits:
            continue
        used += cost
        level[i] += 1
        if level[i] + 1 < len(levels[i]):
            heapq.heappush(heap, entry(i))
    return [levels[i][level[i]] for i in range(n)]


#: Added to the root of a gradient's second-moment estimate before dividing by it
#: (``noise_norm="relative"`` without an optimizer's state); torch's Adam and AdamW add the
#: same ``eps`` (1e-8) to the root of their second moment.
_RELATIVE_EPS = 1e-8

#: The second moment given to an element whose estimate is exactly 0, as a fraction of its
#: parameter tensor's mean: where a whole row or column of the probe gradient is 0 (a dead
#: ReLU unit), or an element neither the optimizer nor the probe gradient has seen move,
#: ``eps`` alone would weigh its noise 10^16 times; such an element weighs 100x (in norm)
#: what the tensor's mean scale would give it.
_MOMENT_FLOOR = 1e-4


def _matrix_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, columns)``: ``(shape[0], numel / shape[0])`` for two or more dims,
    ``(1, numel)`` else (a tensor of no elements too)."""
    rows = t.shape[0] if t.dim() >= 2 else 1
    return t.reshape(rows, t.numel() // rows if rows else 0)


#: Elements per block when a parameter tensor's noise norms and weights are made a block of
#: rows at a time: a measuring call holds float64 temporaries of this size, not of its
#: largest parameter (GPT-2's 38.6 M-element embedding: 0.3 GiB each).
_BLOCK = 1 << 20


def _blocks(shape: torch.Size):
    """``(start, stop)`` of the consecutive blocks of about :data:`_BLOCK` elements of a
    tensor of ``shape``: ranges of its first dim for two or more dims (rows of its
    :func:`_matrix_view`), of its elements for a vector (FSDP's flat parameters are 1-D),
    ``(0, 1)`` for a scalar."""
    if len(shape) == 0:
        return iter(((0, 1),))
    n = shape[0]
    step = max(1, _BLOCK // max(math.prod(shape[1:]), 1)) if len(shape) >= 2 else _BLOCK
    return ((i, min(i + step, n)) for i in range(0, n, step))


def _block(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Block ``start:stop`` (:func:`_blocks`) of ``t`` as rows of its :func:`_matrix_view`
    (a vector's as one row): a copy of the block only where ``t`` is not contiguous (a
    channels_last weight), never of the whole tensor."""
    if t.dim() >= 2:
        return t[start:stop].reshape(stop - start, -1)
    return t[start:stop].reshape(1, -1) if t.dim() == 1 else t.reshape(1, 1)


def _squared_weights(v: torch.Tensor, eps: float, floor: float) -> torch.Tensor:
    """``1 / (√v + eps)²`` (``v``'s dtype; ``v`` is overwritten, a temporary), with ``v``
    where it is exactly 0 replaced by ``floor``
    (``_MOMENT_FLOOR`` · the tensor's mean ``v``). Only exact zeros: a small ``v`` is what
    Adam divides by (rarely seen tokens' rows); a build that floored every ``v`` under 10⁻⁴
    of the mean (and weighed by Adam's state alone) trained gact2 0.04 worse on GPT-2
    (``scripts/train_lm.py``, six seeds)."""
    return v.masked_fill_(v <= 0, floor).sqrt_().add_(eps).reciprocal_().square_()


class _Weights:
    """The squared weights of one parameter tensor's noise over its :func:`_matrix_view`,
    made a block at a time (:meth:`rows`; :func:`_blocks`) from what they are computed from
    (factors, the optimizer's state), never held whole: a full float32 copy per parameter
    held 4 bytes per parameter through the call, and the rank-1 fallback 4 more."""

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Block ``start:stop`` (:func:`_blocks`: rows of a matrix, elements of a vector) as
        :func:`_block` shapes it (float32, float64 for a float64 state; broadcastable to it).
        float32 as the weights always were: made at every run, in float64 they cost 5x."""
        raise NotImplementedError

    def full(self, shape: torch.Size) -> torch.Tensor:
        """All of them, shaped as the matrix view of a tensor of ``shape`` (tests)."""
        rows, columns = _matrix_view(torch.empty(shape, device="meta")).shape
        units = shape[0] if len(shape) >= 2 else (shape[0] if len(shape) == 1 else 1)
        return self.rows(0, units).expand(rows, columns)


class _Constant(_Weights):
    """One weight for every element (a vector's, or 0 for a tensor with nothing to weigh by)."""

    def __init__(self, value: float, device: torch.device) -> None:
        self.value = torch.tensor(value, dtype=torch.float64, device=device)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.value


class _Rank1(_Weights):
    """``v_ij = R_i C_j / S`` (:func:`_rank1_weights`), squared weights of it."""

    def __init__(self, row_means: torch.Tensor, column_means: torch.Tensor, mean: float) -> None:
        # (rows, 1), (1, columns), float32: the product is made at every run
        self.row_means, self.column_scale = row_means.float(), (column_means / mean).float()
        self.floor = _MOMENT_FLOOR * mean  # the mean of v is S

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return _squared_weights(self.row_means[start:stop] * self.column_scale, _RELATIVE_EPS, self.floor)


class _NextMoment(_Weights):
    """The second moment an optimizer's next step divides by (:func:`_optimizer_weights`),
    squared weights of it: ``(keep · v + fresh · g0²) / correction``, at least ``peak``."""

    def __init__(self, v, peak, g0, keep: float, fresh: float, correction: float, eps: float) -> None:
        self.v, self.peak, self.g0 = v, peak, g0  # g0: the probe gradient's part, shaped as v
        self.keep, self.fresh, self.correction, self.eps = keep, fresh, correction, eps
        self.floor = 0.0

    def moment(self, start: int, stop: int) -> torch.Tensor:
        dtype = torch.promote_types(self.v.dtype, torch.float32)
        g2 = _block(self.g0, start, stop).to(self.v.device, dtype).square()
        nxt = torch.add(g2.mul_(self.fresh), _block(self.v, start, stop).to(dtype), alpha=self.keep)  # read only
        if self.peak is not None:
            nxt = torch.maximum(nxt, _block(self.peak, start, stop).to(dtype))
        return nxt.div_(self.correction)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return _squared_weights(self.moment(start, stop), self.eps, self.floor)


def _rank1_weights(g0: torch.Tensor, params: list[torch.Tensor]) -> list:
    """Per parameter tensor, the squared weights (:class:`_Weights`) of each element's noise
    from the probe gradient ``g0``'s rank-1 second moment, over its :func:`_matrix_view`:
    ``v_ij = R_i C_j / S``, ``R``, ``C`` the row and column means of ``g0²`` and ``S`` its
    mean (Adafactor's factored second moment, Shazeer & Stern, ICML 2018, eq. 4, from one
    sample); a vector: ``v = S``; weight ``1 / (√v + eps)²``, an exactly-zero ``v`` at
    ``_MOMENT_FLOOR · S``. A tensor whose ``g0`` is 0 throughout gives nothing to weigh its
    noise against: weight 0."""
    out = []
    for q, p in zip(g0.split([p.numel() for p in params]), params):
        t = q.view(p.shape)
        rows, columns = _matrix_view(t).shape
        matrix = p.dim() >= 2
        row_means = torch.empty(rows if matrix else 0, 1, dtype=torch.float64, device=q.device)
        column_sums = torch.zeros(1, columns if matrix else 0, dtype=torch.float64, device=q.device)
        total = torch.zeros((), dtype=torch.float64, device=q.device)
        for start, stop in _blocks(t.shape):
            g2 = _block(t, start, stop).double().square()
            total += g2.sum()
            if matrix:
                row_means[start:stop] = g2.mean(1, keepdim=True)
                column_sums += g2.sum(0, keepdim=True)
        mean = float(total) / q.numel() if q.numel() else 0.0
        if not mean > 0:
            out.append(_Constant(0.0, q.device))
        elif p.dim() < 2:
            out.append(_Constant(1.0 / (math.sqrt(mean) + _RELATIVE_EPS) ** 2, q.device))
        else:
            out.append(_Rank1(row_means, column_sums / rows, mean))
    return out


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    """``Σ t²`` in float64 (0-d, on ``t``'s device), a block (:func:`_blocks`) at a time."""
    total = t.new_zeros((), dtype=torch.float64)
    for start, stop in _blocks(t.shape):
        total = total + _block(t, start, stop).double().square().sum()
    return total


def _tensor_scales(g0: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The alert's weights: per parameter tensor ``1 / (rms(g0_p) + eps)`` (float64, CPU,
    one per tensor); 0 for a tensor whose ``g0`` is 0 throughout."""
    rms = torch.stack([_square_sum(q.view(p.shape)).div(max(q.numel(), 1)).sqrt()
                       for q, p in zip(g0.split([p.numel() for p in params]), params)]).cpu()
    return torch.where(rms > 0, (rms + _RELATIVE_EPS).reciprocal(), torch.zeros_like(rms))


def _optimizer_weights(optimizer, params: list[torch.Tensor], fallback: list, g0: torch.Tensor) -> list:
    """Per parameter tensor, the squared weights ``1 / (√v + eps)²`` (:class:`_NextMoment`)
    of the second moment ``v`` the ``optimizer``'s next update divides by when its gradient is
    the probe gradient ``g0``, with the group's ``eps``: :class:`torch.optim.Adam`, ``AdamW``,
    ``NAdam``, ``RAdam``, ``SparseAdam`` (``(β2 · exp_avg_sq + (1 − β2) g0²) / (1 − β2^(t+1))``;
    AMSGrad: its running maximum), ``RMSprop`` (non-centered: ``α · square_avg + (1 − α)
    g0²``) or ``Adagrad`` (``sum + g0²``), after their first step, an exactly-zero ``v`` at
    ``_MOMENT_FLOOR`` · its mean; ``fallback[k]`` where there is none (another optimizer, a
    parameter it does not hold, no step taken yet, a state that is 0 throughout or not
    finite)."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for q, p, other in zip(g0.split([p.numel() for p in params]), params, fallback):
        group = groups.get(id(p))
        state = optimizer.state.get(p) if group is not None else None
        v = None
        if state and float(state.get("step", 0)) > 0:
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                                      torch.optim.SparseAdam)):
                beta2, step = float(group["betas"][1]), float(state["step"])
                v, keep, fresh, correction = state.get("exp_avg_sq"), beta2, 1.0 - beta2, 1.0 - beta2 ** (step + 1)
                peak = state.get("max_exp_avg_sq") if group.get("amsgrad") else None
            elif isinstance(optimizer, torch.optim.RMSprop) and not group.get("centered", False):
                alpha = float(group["alpha"])
                v, keep, fresh, correction, peak = state.get("square_avg"), alpha, 1.0 - alpha, 1.0, None
            elif isinstance(optimizer, torch.optim.Adagrad):
                v, keep, fresh, correction, peak = state.get("sum"), 1.0, 1.0, 1.0, None
        if isinstance(v, torch.Tensor) and v.shape == p.shape and not v.is_sparse and v.numel():
            peak = peak if isinstance(peak, torch.Tensor) and peak.shape == p.shape else None
            eps = float(group["eps"])
            if isinstance(optimizer, (torch.optim.SparseAdam, torch.optim.RAdam)):
                # they add eps to √v before the bias correction: √(v/c) + eps/√c
                eps /= math.sqrt(correction)
            weights = _NextMoment(v, peak, q.view(p.shape), keep, fresh, correction, eps)
            total = v.new_zeros((), dtype=torch.float64)
            for start, stop in _blocks(v.shape):  # the mean (not finite if a block is not)
                total = total + weights.moment(start, stop).sum(dtype=torch.float64)
            mean = float(total) / v.numel()
            if math.isfinite(mean) and mean > 0:
                weights.floor = _MOMENT_FLOOR * mean
                out.append(weights)
                continue
        out.append(other)
    return out


def _noise_norms(params: list[torch.Tensor], current, reference: torch.Tensor, weights: list
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per parameter tensor ``p``, ``‖d_p · w_p‖²`` and ``‖d_p‖²`` (float64, 1-D, on the
    gradients' device) of ``d = current − reference``: ``current`` the parameters' dense
    ``.grad`` (None) or a flat tensor, ``reference`` a flat one (:func:`_flat_grads`),
    ``weights[p]`` :class:`_Weights` or None for 1. A block of rows at a time (the
    difference exact, in float64): temporaries of :data:`_BLOCK` elements, not of a tensor."""
    sizes = [p.numel() for p in params]
    refs = reference.split(sizes)
    currents = (_dense_grad(p) for p in params) if current is None else current.split(sizes)
    weighted, plain = [], []
    for p, c, r, w in zip(params, currents, refs, weights):
        c, r = c.view(p.shape), r.view(p.shape)
        wsum = psum = c.new_zeros((), dtype=torch.float64)
        for start, stop in _blocks(p.shape):
            # a copy (a float64 .grad's .double() would be the gradient itself), then in place:
            # one float64 block, the difference exact
            sq = _block(c, start, stop).to(torch.float64, copy=True).sub_(_block(r, start, stop).to(c.device))
            sq.square_()
            psum = psum + sq.sum()
            if w is not None:
                wsum = wsum + sq.mul_(w.rows(start, stop).to(sq.device)).sum()
        plain.append(psum)
        weighted.append(psum if w is None else wsum)
    return torch.stack(weighted), torch.stack(plain)


def _flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' dense gradients (zeros where None) as one flat tensor, float32 (float64
    if a parameter is): 4 bytes per parameter, the one full copy a measuring call keeps (the
    probe gradient; float64 copies of it and of each run's gradient held 16 bytes)."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    return torch.cat([_dense_grad(p).reshape(-1).to(dtype) for p in params])


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` detached and dense (a sparse gradient, ``nn.Embedding(sparse=True)``'s,
    densified; None: zeros of ``p``'s shape)."""
    g = p.grad
    if g is None:
        return torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
    return (g.to_dense() if g.layout != torch.strided else g).detach()


#: How many SGD-variance estimates :class:`GACTPolicy` keeps (the alert reads the last).
_VARIANCE_HISTORY = 64

#: Seed offset between the forwards of one probe run's closure (a large odd constant: the
#: forwards' seeds fall far apart).
_PASS_STRIDE = 0x9E3779B97F4A7C15

_FEWBIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _outside_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, for a call in the function that calls this one,
    that names the first frame outside fewbit and torch: the user's ``adapt`` call however
    many fewbit frames are between (a :class:`~fewbit.quant.policies.WarmupPolicy` adds one),
    the user's forward for a warning from a saved-tensor hook."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((_FEWBIT_DIR, _TORCH_DIR)):
        frame, level = frame.f_back, level + 1
    return level


def _backward(loss: torch.Tensor, params: list[torch.Tensor], aside: dict) -> None:
    """``loss.backward()`` for a measuring run of :meth:`GACTPolicy.adapt`, leaving alone
    what is not the run's: the ``.grad`` of the other leaves it reaches (a loss-side head
    outside the converted model, a GAN's other network, an input that requires grad) is
    put back after it (they had taken every run's gradient, and the training step after
    the call used the head's at 5 times its value: 4 runs + its own), and the
    post-accumulate-grad hooks of those leaves and of ``params`` (torch's optimizer step
    in backward; hooks registered during the call too) are moved into ``aside`` (id ->
    (tensor, [(handle id, hook)])), which :func:`_restore_hooks` puts back. A plain
    ``backward`` (not ``inputs=params``, which skips reentrant checkpoints' recomputation:
    their parameters had no gradient), with ``retain_graph`` (a part of the graph built
    before the call is not freed). Leaves reached only inside a reentrant checkpoint are
    not seen."""
    others = _other_leaves(loss, params)
    held = [(v, v.grad) for v in others]
    for v in (*params, *others):
        hooks = v._post_accumulate_grad_hooks
        if hooks:
            aside.setdefault(id(v), (v, []))[1].extend(hooks.items())
            hooks.clear()  # the dict torch holds for the tensor: emptied, not replaced
    for v in others:
        v.grad = None
    try:
        # retain_graph: a part of the graph built before the call (features computed outside
        # the closure) serves every run and the training step after it; the closure's own
        # part goes with the run's loss
        loss.backward(retain_graph=True)
    except RuntimeError as exc:
        if "backward through the graph a second time" in str(exc):
            raise TypeError("closure must return the loss without calling backward on it: adapt runs the "
                            "backward of each measuring run itself (a torch.optim closure, which calls "
                            "backward, is not one); or the loss reaches a graph built before the call "
                            "whose backward has run") from exc
        raise
    finally:
        for v, g in held:
            v.grad = g


def _other_leaves(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves ``loss.backward()`` accumulates into (its graph's ``AccumulateGrad``
    nodes), other than ``params``."""
    ids = {id(p) for p in params}
    out, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in ids:
            out.append(leaf)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _restore_hooks(aside: dict) -> None:
    """Put back the hooks :func:`_backward` moved aside, after any registered since."""
    for v, hooks in aside.values():
        current = v._post_accumulate_grad_hooks
        if current is None:
            v._post_accumulate_grad_hooks = collections.OrderedDict(hooks)
        else:
            current.update(hooks)


def _keep_bits(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * 8


class GACTPolicy(Policy):
    """Group quantizer at per-tensor bits chosen by gradient sensitivity (GACT).

    ``Config(saved_bits="auto", average_bits=B)`` builds one; the converted model's
    ``summary.compressor.adapt(model, closure, optimizer)`` (:meth:`adapt`) is the one call per
    training step it needs.

    Tensors are identified by their index in the pass's save order
    (:class:`~fewbit.quant.policies.SavedTensorInfo`), stable for a static graph. Until
    the first :meth:`adapt`, and for an index the last adapt did not see, every tensor
    gets the largest of 1, 2, 4, 8 not above ``average_bits``. The attention's q and k
    always get 8 bits (:mod:`fewbit.quant.attention`), in the sensitivity runs too, and
    are left out of the allocation and of its budget: the attention's backward
    exponentiates their error (``P = exp(q kᵀ/√d − lse)``), so their gradient noise is
    not the ``c_l S(b)`` of GACT's model and is not measured by a 4-bit probe (left to
    the allocation, they got 1 bit on a 2-layer GPT-2 at ``average_bits=2`` and the
    model trained far worse than vanilla: validation loss 2.67 and 2.71 against
    2.29–2.44, ``scripts/train_lm.py``'s main-job recipe). Tensors saved outside the
    converted modules (the loss's logits and log-softmax) are not taken by the compressor
    at all: they stay exact.

    Args:
        average_bits: the budget, bits per element over the allocated tensors
            (``Σ b_l D_l <= average_bits Σ D_l``; stats excluded), 1 <= average_bits <= 32.
        adapt_interval: the longest gap between re-plans. :meth:`adapt` re-plans on its
            calls 1, 2, 4, 8, ... (the gap doubles) until the gap reaches
            ``adapt_interval``, then every ``adapt_interval`` calls (default 1000).
            The sensitivities move most early in training: on the 2-layer GPT-2 of
            ``scripts/train_lm.py`` the absolute ``c_l`` of ``mlp.c_proj``'s input fell
            about 370x and that of the attention's v rose about 140x between steps 0 and 100,
            so a plan made only at step 0 starves tensors that later need 4 bits.
        probe_bits: the width every tensor is quantized at during the sensitivity runs
            (default 4; ``c_l = ½‖g0 − g1‖² / S(probe_bits)``).
        group_size, stats_dtype: of the group quantizers
            (:class:`~fewbit.quant.compressors.GroupQuantizer`).
        stochastic: must be True (the sensitivities are measured from the stochastic
            rounding noise: nearest rounding has none, and every ``c_l`` was 0).
        alert_ratio: warn (once) when the planned compression variance ``Σ c_l S(b_l)``
            exceeds ``alert_ratio`` times the SGD gradient variance; default 1.0, i.e.
            when compression noise dominates. The SGD variance is estimated from pairs
            of consecutive steps: the re-plan's probe gradient ``g0`` is kept (float32,
            one copy of the gradient) until the next :meth:`adapt` call, which computes
            the probe gradient ``g0'`` of its own batch (one extra forward+backward when
            that call does not re-plan itself); then
            ``σ² ≈ ½‖g0' − g0‖² − Σ c_l S(probe_bits)`` (two independent batches, each
            gradient carrying the probe's compression noise). Both sides of the
            comparison weigh each parameter tensor's noise by one scale, ``1 / (rms(g0_p)
            + 1e-8)`` of the re-plan's ``g0`` (kept with it; with or without an optimizer;
            0 for a tensor whose ``g0`` is 0 throughout, an expert the batch did not use),
            not elementwise as the plan does: an element whose re-plan gradient was 0 (an
            embedding row of a token not in that batch) has its second moment at the
            floor, and the next batch's gradient there, weighed 10⁴x, made ``σ²`` 10⁴x the
            compression variance on a small untied-embedding model, where one scale per tensor gives
            3x; an optimizer's moments move between the two calls and do not exist at the
            first. One optimizer step of drift between the two adds to the estimate, so
            the alert errs on the quiet side. (Comparing gradients of calls far apart, as
            the doubling schedule makes them, measured the training drift instead: about
            100 against a compression variance of 0.01-0.5, absolute norm, on
            ``scripts/train_lm.py``'s GPT-2.)
        norm_min_bits: the fewest bits of a tensor saved inside a per-sample normalization
            layer (LayerNorm, RMSNorm, GroupNorm, InstanceNorm: those with
            :attr:`~fewbit.quant.policies.SavedTensorInfo.norm_size`), default 2. The input
            of torch's own norm functions (``F.layer_norm``, ...; role ``"norm_input"``) is
            not planned: it gets 8 bits, as q and k; the floor holds for the saves of norms
            written in Python (transformers' RMSNorm: two copies of ``x``). Their
            backward is quadratic in the quantization error, so its variance turns into a
            bias (:meth:`fewbit.quant.compressors.Compressor.within`) that ``c_l S(b)``
            does not count and that grows 9x from 2 bits to 1. On ``scripts/train_lm.py``'s
            GPT-2 at step 100, a plan with two LayerNorm inputs at 1 bit gave a gradient bias
            of 1-3 % of the norm of a dozen parameters' gradients (e.g. ``wpe`` 2.6 %, 27
            standard errors over 96 draws). Training loss was the same with and without
            the floor over 6 seeds (2.422 against 2.423 at 600 steps; run-to-run spread
            0.03-0.1), so the floor is for the bias, not a measured gain.
        noise_norm: how the gradient noise ``‖g0 − g1‖²`` is measured, in ``c_l`` and in
            the alert's SGD variance. ``"relative"`` (default): each element is divided by
            ``(√v + eps)``, ``v`` an estimate of that element's squared gradient, as an
            Adam-family optimizer divides its update, so what is measured is the noise of
            the update: when :meth:`adapt` is given the optimizer, the second moment its
            next step divides by with the probe gradient as that step's gradient
            (:func:`_optimizer_weights`: Adam, AdamW, NAdam, RAdam, SparseAdam with their bias
            correction and ``eps``, which RAdam and SparseAdam add before the correction; non-centered RMSprop, Adagrad; RAdam's first steps are
            not adaptive and are weighed the same), else a rank-1 estimate from the probe
            gradient (row mean x column mean / mean of ``g0²`` per parameter tensor,
            Adafactor's factored second moment, Shazeer & Stern, ICML 2018; one mean for a
            vector). Where either is exactly 0 it is 10⁻⁴ of its tensor's mean
            (``_MOMENT_FLOOR``: a dead unit's column has ``v = 0``, and ``eps`` alone would
            weigh its noise 10¹⁶x; a small ``v`` is kept: it is what Adam divides by); an
            optimizer's next-step moment that is 0 throughout a tensor or not finite gives
            way to the rank-1 estimate, and a tensor whose probe gradient is 0 throughout
            is left out (weight 0). The alert weighs each parameter tensor by one scale
            (``alert_ratio``). Per
            element, not per tensor: GPT-2's fused ``c_attn`` weight holds the query, key
            and value columns, and early in training the query and key gradients are far
            smaller than the value's; one scale per tensor (an earlier build's) hid the
            noise that the attention's ``v`` sends into them, rated ``v`` 60-1.2·10⁴x lower
            than the optimizer's weights at step 16 and gave it 1 bit, and gact2 trained
            above vanilla (``scripts/train_lm.py``, six seeds, validation loss +0.058 ±
            0.026 against vanilla; with the rank-1 estimate +0.029 ± 0.020; with AdamW's
            next-step second moment, as ``scripts/train_lm.py`` passes it, +0.027 ± 0.017).
            ``"absolute"``: GACT's plain Euclidean norm (GACT Alg. 1), the right one for
            SGD. On ``scripts/train_lm.py``'s GPT-2 (AdamW) at ``average_bits=2``, the
            absolute norm gave 1 bit to the inputs of the attention's and MLP's first
            linears, whose weights get small gradients, while the LM head, which
            dominates the absolute norm, got 4-8; seed 0 then stalled (validation loss
            3.37 at step 100 against vanilla's 2.92) and ended at 2.618 against vanilla's
            2.436.
        seed: seed of the generator that draws the sensitivity runs' noise seeds.

    Attributes:
        bits: ``{index: bits}`` of the last plan (the dtype's width = kept exact), by the
            tensors' order in the pass it measured; later passes find a tensor's bits by
            its place in its module (:attr:`~fewbit.quant.policies.SavedTensorInfo.key`),
            and a tensor the plan did not see gets ``initial_bits`` (at least
            ``norm_min_bits`` for a norm's input).
        sensitivity: ``{index: c_l}`` of the last plan, in the plan's weights (``noise_norm``)
            (squared gradient units for ``"absolute"``, dimensionless for ``"relative"``).
        numel: ``{index: D_l}`` of the tensors the last plan saw.
        variance_factors: ``{index: [factor at 1, 2, 4, 8 bits]}`` of the last plan: each
            tensor's own stochastic-rounding variance at each width, measured on the tensor
            the probe quantized and scaled to ``S(probe_bits)`` at the probe's width
            (:func:`_rounding_variances`), which the allocation and
            ``compression_variance`` take in place of GACT's ``S(b)``. At 1 bit most
            elements of a bell-shaped group sit mid-range, and ``S(1)`` under-priced 1 bit:
            a tensor's measured gradient variance at 1 bit was 1.18-1.34x ``c_l S(1)`` on
            ``scripts/train_lm.py``'s GPT-2 (0.93-1.04x at 2 and 4 bits).
        compression_variance: ``Σ c_l S(b_l)`` of the last plan, in the alert's weights
            (``alert_ratio``: one per parameter tensor).
        gradient_variance: the SGD gradient-variance estimate of the latest pair of
            consecutive calls (nan before the first pair), in the alert's weights. The
            latest, not a running mean: the variance moves with training (on
            ``scripts/train_lm.py``'s GPT-2, gact2, with one weight per parameter tensor
            (an earlier build), seeds 2 and 3: 0.65e5-4.6e5 over the run, against a planned
            compression variance of 0.56e4-1.5e5; absolute norm: from about 4 at steps
            2-3 to 0.3 at steps 64-65, against 0.003-0.35).
        skipped_nonfinite: calls of :meth:`adapt` that measured nothing because a
            probe gradient or a sensitivity was not finite.
        skipped_zero: due re-plans that measured nothing because every sensitivity was
            0 (a zero gradient); the plan stays and the next call tries again.

    Raises:
        ValueError: naming the argument, for any value out of range.
    """

    decides_qk = True

    def __init__(
        self,
        average_bits: float,
        *,
        adapt_interval: int = 1000,
        probe_bits: int = 4,
        group_size: int = 256,
        stochastic: bool = True,
        stats_dtype: torch.dtype = torch.bfloat16,
        alert_ratio: float = 1.0,
        norm_min_bits: int = 2,
        noise_norm: str = "relative",
        seed: int = 0,
    ) -> None:
        self.average_bits = check_average_bits(average_bits)
        if not check_bool(stochastic, "stochastic"):
            raise ValueError("stochastic must be True: GACT measures each tensor's sensitivity from its "
                             "stochastic rounding noise (nearest rounding has none)")
        self.adapt_interval = check_positive_int(adapt_interval, "adapt_interval")
        if probe_bits not in CANDIDATE_BITS:
            raise ValueError(f"probe_bits must be one of {CANDIDATE_BITS}, got {probe_bits!r}")
        self.probe_bits = probe_bits
        if not isinstance(alert_ratio, (int, float)) or not alert_ratio > 0:
            raise ValueError(f"alert_ratio must be a number > 0, got {alert_ratio!r}")
        self.alert_ratio = float(alert_ratio)
        if norm_min_bits not in CANDIDATE_BITS:
            raise ValueError(f"norm_min_bits must be one of {CANDIDATE_BITS}, got {norm_min_bits!r}")
        self.norm_min_bits = norm_min_bits
        self.noise_norm = check_noise_norm(noise_norm)
        self.initial_bits = max(b for b in CANDIDATE_BITS if b <= self.average_bits)
        self._quantizers = {
            b: GroupQuantizer(b, group_size=group_size, stochastic=stochastic, stats_dtype=stats_dtype)
            for b in CANDIDATE_BITS
        }
        self._keep = Keep()
        self._gen = torch.Generator().manual_seed(int(seed))
        self.bits: dict[int, int] = {}
        self._by_key: dict[tuple, int] = {}  # SavedTensorInfo.key -> planned bits
        self._key_numel: dict[tuple, int] = {}  # SavedTensorInfo.key -> elements when last planned
        self.sensitivity: dict[int, float] = {}
        self.numel: dict[int, int] = {}
        self.variance_factors: dict[int, list[float]] = {}
        self.compression_variance = math.nan
        self.gradient_variance = math.nan
        self.skipped_nonfinite = 0
        self.skipped_zero = 0
        self._calls = 0
        self._next_plan = 1  # the call number of the next re-plan
        self._gap = 1  # doubles after each re-plan, up to adapt_interval
        self._probe: tuple[int, int] | None = None  # (base seed, index whose seed changes)
        self._seen: dict[int, SavedTensorInfo] = {}
        self._variances: dict[int, list[float]] = {}  # the probe's tensors' _rounding_variances, by index
        # (call, g0, the alert's per-tensor scales or None, Σ c_l S(probe) in them)
        self._last_g0: tuple[int, torch.Tensor, torch.Tensor | None, float] | None = None
        self._variance_pairs: list[float] = []  # the SGD-variance estimates of the last pairs of calls
        self._warned = False
        self._pass = 0  # the forward of the closure a probe run is in (1, 2, ...)

    #: Training forwards that packed tensors before the first :meth:`adapt`, and whether a
    #: re-plan that measured nothing was reported (class defaults: a policy pickled by an
    #: earlier build has neither).
    _unplanned_passes = 0
    _warned_empty = False
    #: The same for the last plan's variance factors (read only: a plan sets the instance's).
    variance_factors: dict = {}

    @property
    def default(self):
        return self._quantizers[self.initial_bits]

    def __repr__(self) -> str:
        return (f"GACTPolicy(average_bits={self.average_bits}, adapt_interval={self.adapt_interval}, "
                f"planned={len(self.bits)})")

    # pack time ---------------------------------------------------------------------------
    def observe(self, info):
        if self._probe is not None and info.index == 0:  # a forward of the closure starts (it may run several)
            self._pass += 1
        if self._probe is not None and info.role is None:  # q, k, nonlinear results, norm inputs: fixed 8 bits
            self._seen[info.index] = info

    def choose(self, x, info):
        if self._calls == 0 and self._probe is None and info.index == 0:
            self._unplanned_pass()
        if info.role is not None:  # q, k, nonlinear results, norm inputs: not allocated, 8 bits, also in the sensitivity runs
            return self._quantizers[8]
        if self._probe is not None:
            if self._probe[1] == -1 and info.index not in self._variances:  # the first run: each tensor's own S(b)
                q = self._quantizers[self.probe_bits]
                if info.norm_size is not None:
                    q = q.within(info.norm_size)
                # the layout the compressor quantizes: a BatchNorm's channels from the
                # (C, N, ...) copy (priced on the tensor's C order, a 1-bit factor had been
                # 0.78x the true one; h73)
                layout = x.movedim(1, 0) if info.channel_major and x.dim() > 1 else x
                self._variances[info.index] = _rounding_variances(layout, q.group_size)
            return self._quantizers[self.probe_bits]
        # by the tensor's place in its module (SavedTensorInfo.key), not its place in the
        # pass: a tensor skipped elsewhere (a smaller last batch under min_numel) would move
        # every later tensor onto another's bits (a norm's input onto 1 bit)
        b = self._by_key.get(info.key) if info.key is not None else self.bits.get(info.index)
        if b is None:  # not in the plan: the starting bits, and never under a norm's floor
            b = self.initial_bits if info.norm_size is None else max(self.initial_bits, self.norm_min_bits)
        return self._quantizers[b] if b in self._quantizers else self._keep

    def generator(self, info):
        if self._probe is None:
            return None
        base, flipped = self._probe
        # each forward of a closure that runs the model twice (R-Drop, a consistency loss)
        # draws its own noise, as training does: with one seed per index the two forwards'
        # noise was the same, and every sensitivity 4x a single forward's where training's
        # variance is 2x (h62). The first forward's seeds are those of a one-forward closure.
        seed = (base + 2 * info.index + (info.index == flipped) + (self._pass - 1) * _PASS_STRIDE) % (1 << 63)
        return torch.Generator().manual_seed(seed)

    def _unplanned_pass(self) -> None:
        """A training forward packed tensors and :meth:`adapt` never ran: warn once, at the
        second such forward (the first may precede a loop's first ``adapt``)."""
        self._unplanned_passes += 1
        if self._unplanned_passes == 2:
            warnings.warn(
                f"GACT: saved_bits='auto' has planned nothing: adapt() was never called, so every saved tensor "
                f"gets the starting {self.initial_bits} bits, not bits by sensitivity under "
                f"average_bits={self.average_bits:g}; call fewbit.convert.compressor_of(model).adapt(model, closure, "
                "optimizer) once per training step, before its forward",
                RuntimeWarning, stacklevel=_outside_stacklevel())

    # sensitivity ---------------------------------------------------------------------------
    def adapt(self, model: torch.nn.Module, closure,
              optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> bool:
        """Re-plan on this call if it is due: calls 1, 2, 4, 8, ... (the gap doubles up to
        ``adapt_interval``), then every ``adapt_interval`` calls.

        GACT Alg. 1: one forward+backward (``closure()`` then ``backward``) gives ``g0``,
        every tensor quantized at ``probe_bits`` with its own fixed noise seed; then one
        run per tensor ``l`` with only ``l``'s seed changed gives ``g1`` and
        ``c_l = ½‖g0 − g1‖² / S(probe_bits)``, each element weighted as ``noise_norm``
        says. Everything else is replayed identically
        (torch's CPU and CUDA RNG states are restored before each run and after the
        call, so dropout masks match and the training stream is untouched; fewbit's noise
        stream likewise, which other compressors the closure runs draw from, a GAN's
        second converted model). The ``.grad`` of every leaf a run's backward reaches (the
        parameters, a loss-side module's, an input that requires grad) are put back,
        and their post-accumulate-grad hooks (torch's optimizer step in backward) are set
        aside during the runs (:func:`_backward`). Then :func:`allocate_bits`. The call right
        after a re-plan, if it does not re-plan itself, runs one forward+backward of its
        own batch for the SGD-variance estimate behind ``alert_ratio``; other calls run
        nothing. A call whose probe gradient or sensitivities are not finite (a loss
        spike, an overflowing float16 step) measures nothing: the plan stays, and a due
        re-plan is tried again at the next call (``skipped_nonfinite`` counts them); so
        does a re-plan whose sensitivities are all 0 (``skipped_zero``). Buffers the
        forward updates in place (BatchNorm's running statistics) are put back after
        each run, so the call leaves the model as it found it; buffers of modules outside
        ``model`` that the closure runs (a loss-side BatchNorm) are updated by every run,
        so keep such modules inside ``model``.

        Under ``torch.distributed`` (world size > 1) a re-plan is a collective: every rank
        runs one probe per tensor any rank saw (a rank whose batch saved fewer tensors,
        under ``min_numel``, had run fewer backwards, each a DDP all-reduce: its training
        step's gradient was averaged with another rank's probe, the ranks' weights drifted
        apart, and the job hung; h76), so every rank calls ``adapt`` at the same steps,
        as DDP's training steps are.

        Args:
            model: the converted model (its parameters that require grad are differentiated).
            closure: ``() -> loss``, the forward of this step's batch (scalar tensor).
            optimizer: the training's optimizer, optional. With ``noise_norm="relative"``
                the plan weighs the noise of each parameter it keeps a second moment for
                (:func:`_optimizer_weights`: Adam, AdamW, NAdam, RAdam, SparseAdam,
                non-centered RMSprop, Adagrad, after their first step) elementwise by
                ``1 / (√v + eps)``, as the update is; other parameters (and every one
                without an optimizer) by a rank-1 estimate from the probe gradient
                (:func:`_rank1_weights`). Read, not modified, and no reference to it is
                kept. A list of optimizers weighs each parameter by the one holding it
                (``[SparseAdam(embedding), AdamW(rest)]``); sparse gradients
                (``nn.Embedding(sparse=True)``) are measured as the dense gradients they
                stand for.

        Returns:
            True if it re-planned.

        Raises:
            TypeError: if ``model`` is not an ``nn.Module``, ``closure`` is not callable
                or ``optimizer`` is not a ``torch.optim.Optimizer``, a list of them or None
                (checked on every call), or ``closure`` does not return a scalar tensor, or
                calls ``backward`` on it itself (a ``torch.optim`` closure).
            ValueError: ``optimizer`` (or one of the list) holds none of the model's
                parameters that require grad (checked on the calls that measure).
            ValueError: if ``model`` has no parameter that requires grad (the
                sensitivities are measured on the parameters' gradient).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(closure):
            raise TypeError(f"closure must be callable, () -> loss, got {type(closure).__name__}")
        optimizers = check_optimizer(optimizer)
        calls = self._calls + 1
        replan = calls >= self._next_plan
        pair = self._last_g0 is not None and self._last_g0[0] == calls - 1
        if not replan and not pair:  # most calls: nothing to run, not even a walk over the parameters
            self._calls = calls
            self._last_g0 = None
            return False
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no parameter that requires grad: GACT measures each saved tensor's "
                             "sensitivity on the parameters' gradient")
        trainable = {id(p) for p in params}
        for opt in optimizers:
            if not any(id(p) in trainable for g in opt.param_groups for p in g["params"]):
                raise ValueError(f"optimizer holds none of the model's parameters that require grad "
                                 f"({type(opt).__name__} of another model?)")
        self._calls = calls
        schedule = (self._next_plan, self._gap)
        if replan:
            self._next_plan = self._calls + self._gap
            self._gap = min(2 * self._gap, self.adapt_interval)
        from fewbit.quant import _noise_stream, _world

        grads = [p.grad for p in params]
        # a training step's post-accumulate-grad hooks (torch's optimizer step in backward)
        # are set aside during the runs (_backward): each run had stepped the optimizer
        aside: dict = {}
        # fewbit's noise stream, which other compressors the closure runs draw from (a GAN's
        # second converted model): replayed for each run, put back after the call
        streams = _noise_stream.snapshot()
        # buffers the forward updates in place (BatchNorm's running statistics and
        # num_batches_tracked) are put back after each run: the measurement must leave
        # the model as the training left it
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        base = int(torch.randint(0, 1 << 62, (), generator=self._gen))
        try:
            with torch.random.fork_rng(devices=devices):
                cpu_state = torch.get_rng_state()
                cuda_states = [torch.cuda.get_rng_state(d) for d in devices]

                def run(flipped: int) -> None:  # leaves this run's gradient in the parameters' .grad
                    _restore_buffers(buffers)
                    _noise_stream.restore(streams)
                    torch.set_rng_state(cpu_state)
                    for d, s in zip(devices, cuda_states):
                        torch.cuda.set_rng_state(s, d)
                    for p in params:
                        p.grad = None
                    self._probe = (base, flipped)
                    self._pass = 0
                    try:
                        with torch.enable_grad():
                            loss = closure()
                            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                                raise TypeError("closure must return the loss, a scalar tensor")
                            _backward(loss, params, aside)
                    finally:
                        self._probe = None


                self._seen, self._variances = {}, {}
                run(-1)
                g0 = _flat_grads(params)
                seen, self._seen = self._seen, {}
                variances, self._variances = self._variances, {}
                s = variance_factor(self.probe_bits)
                sens, alert = {}, {}
                finite = bool(torch.isfinite(g0).all())
                if replan:  # every rank takes the same branches (_agree: a rank that skipped had hung the rest)
                    (finite,) = _agree([finite], g0.device, "all")
                relative = self.noise_norm == "relative"
                scales = None
                runs = sorted(seen)
                if replan and finite:
                    # the alert's weights: one per parameter tensor (kept with g0 for the pair);
                    # the plan's: the optimizer's second moments where it has them, else rank-1
                    scales = _tensor_scales(g0, params) if relative else None
                    weights = [None] * len(params)
                    if relative:
                        weights = _rank1_weights(g0, params)
                        for opt in optimizers:  # each weighs the parameters it holds
                            weights = _optimizer_weights(opt, params, weights, g0)
                    alert_weights = None if scales is None else scales.square().to(g0.device)
                    if _world() > 1:
                        # every rank runs the same passes: under DDP each backward is a collective,
                        # and a rank that saw fewer tensors (a smaller batch under min_numel) had
                        # paired its training step's all-reduce with another rank's probe run
                        gathered = [None] * _world()
                        torch.distributed.all_gather_object(gathered, runs)
                        runs = sorted(set().union(*gathered))
                    for index in runs:
                        run(index)
                        if index not in seen:
                            continue
                        weighted, plain = _noise_norms(params, None, g0, weights)
                        alert_sum = plain.sum() if alert_weights is None else (plain * alert_weights).sum()
                        c, a = torch.stack([weighted.sum(), alert_sum]).tolist()
                        sens[index], alert[index] = 0.5 * c / s, 0.5 * a / s
                    (finite,) = _agree([all(math.isfinite(v) for v in sens.values())], g0.device, "all")
        finally:
            _restore_buffers(buffers)
            _noise_stream.restore(streams)
            _restore_hooks(aside)
            for p, g in zip(params, grads):
                p.grad = g
        if finite and replan and not runs:  # no rank saw a tensor to measure (DDP: all ranks decide alike)
            # every save of the forward was kept exact or held at fixed bits (inputs that
            # do not require grad, tensors under min_numel): nothing was measured. It had
            # counted as a re-plan and set an empty plan (h62). The plan stays; the schedule
            # keeps its back-off (retried at every call, a model with nothing to allocate
            # paid a forward and backward more each step, h64)
            self._last_g0 = None
            if not self._warned_empty:
                self._warned_empty = True
                warnings.warn(
                    "GACT: the closure's forward saved no tensor whose bits GACT allocates (every save was kept "
                    "exact or held at fixed bits: inputs that do not require grad, tensors under min_numel), so "
                    "nothing was measured; the plan stays until a re-plan measures something", RuntimeWarning,
                    stacklevel=_outside_stacklevel())
            return False
        positive = any(v > 0 for v in sens.values())
        if finite and replan:  # measured on some rank: on every rank, or none
            (positive,) = _agree([positive], g0.device, "any")
        if finite and replan and not positive:
            # a zero gradient (a zero loss, a batch masked out) measures nothing either: a
            # plan from all-zero sensitivities would be ties broken by position
            self._next_plan, self._gap = self._calls + 1, schedule[1]
            self._last_g0 = None
            self.skipped_zero += 1
            return False
        if not finite:
            # an overflowing step (a loss spike, fp16 without a scaler's skip) measures nothing:
            # the plan stays, and the measurement is tried again at the next call
            self._next_plan, self._gap = (self._calls + 1, schedule[1]) if replan else schedule
            self._last_g0 = None
            self.skipped_nonfinite += 1
            return False
        if pair:
            self._pair_variance(g0, params)
        if replan:
            if seen and any(v > 0 for v in sens.values()):
                # a rank that measured nothing itself (another rank did), or only zeros (its
                # zero loss beside another rank's, without DDP's averaging: a plan from
                # zeros, and an alert silenced; h79) keeps its plan
                self._plan(seen, sens, alert, {i: _variance_factors(variances.get(i), self.probe_bits) for i in seen})
            self._last_g0 = (self._calls, g0, scales, s * sum(alert.values()))
        self._check_variance()
        return replan

    def schedule(self) -> tuple:
        """The re-plan schedule: calls so far, the next re-plan's call, the gap, the last
        measurement (:meth:`fewbit.quant.policies.Policy.schedule`)."""
        return (self._calls, self._next_plan, self._gap, self._last_g0)

    def set_schedule(self, state: tuple) -> None:
        self._calls, self._next_plan, self._gap, self._last_g0 = state

    #: The attributes :meth:`state_dict` saves (the plan, the schedule, the estimates).
    _STATE = ("bits", "_by_key", "_key_numel", "sensitivity", "numel", "variance_factors", "compression_variance",
              "gradient_variance", "skipped_nonfinite", "skipped_zero", "_calls", "_next_plan", "_gap", "_last_g0",
              "_variance_pairs", "_warned")

    def state_dict(self) -> dict:
        """The policy's state: its plan, re-plan schedule, variance estimates and the
        generator of its measurement seeds (plain Python values and CPU tensors; saves with
        ``torch.save`` and loads with ``torch.load(weights_only=True)``). Save it beside the
        model's and optimizer's state to resume a GACT run exactly; a converted model's
        pickle and ``copy.deepcopy`` carry it."""
        state = {name: copy.deepcopy(getattr(self, name)) for name in self._STATE if name != "_last_g0"}
        # the probe gradient lives on the model's device between calls; the state holds a CPU copy
        state["_last_g0"] = None if self._last_g0 is None else tuple(
            t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t for t in self._last_g0)
        state["generator"] = self._gen.get_state()
        state["settings"] = self._settings()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Under ``torch.distributed`` every rank restores the
        same state: ranks on different re-plan schedules run different collectives in
        :meth:`adapt`, and the job hangs.

        Raises:
            ValueError: ``state`` is not a GACT policy state (an entry missing, a generator
                state torch refuses), or one of a policy with other settings
                (``average_bits``, ``adapt_interval``, ...). Nothing is changed then.
        """
        if isinstance(state, dict) and "_key_numel" not in state:  # saved by an earlier build
            state = {**state, "_key_numel": {}}
        if isinstance(state, dict) and "variance_factors" not in state:  # saved by an earlier build
            state = {**state, "variance_factors": {}}
        missing = [k for k in (*self._STATE, "generator", "settings") if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"state is not a GACTPolicy.state_dict(): it lacks {', '.join(missing)}")
        if state["settings"] != self._settings():
            raise ValueError(f"state is of a GACT policy with other settings: {state['settings']} "
                             f"against this policy's {self._settings()}")
        scratch = torch.Generator()  # the generator's state checked before anything is changed
        try:
            scratch.set_state(state["generator"])
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"state's generator is not a CPU torch.Generator state: {exc}") from None
        values = {name: copy.deepcopy(state[name]) for name in self._STATE}
        for name, value in values.items():
            setattr(self, name, value)
        self._gen.set_state(scratch.get_state())

    def _settings(self) -> dict:
        return {"average_bits": self.average_bits, "adapt_interval": self.adapt_interval,
                "probe_bits": self.probe_bits, "norm_min_bits": self.norm_min_bits, "noise_norm": self.noise_norm}

    def _plan(self, seen: dict[int, SavedTensorInfo], sens: dict[int, float], alert: dict[int, float],
              factors: dict[int, list[float]] | None = None) -> None:
        order = sorted(sens)
        factors = {i: (factors or {}).get(i) or _variance_factors(None, self.probe_bits) for i in order}
        # Tensors of the last plans this pass did not save (a short batch's, under min_numel;
        # an expert no token reached) keep their bits: a re-plan on a short batch had sent
        # them back to the starting bits until the next one, up to adapt_interval calls (2.2
        # bits held at average_bits=3, h62). The budget is over them too, at their stored
        # sizes scaled to this pass (by the seen tensors' sizes now against stored): a short
        # batch's seen tensors beside the others' full-batch sizes had a negative budget and
        # 1 bit each, and each tensor's largest size kept for good broke the budget of every
        # later pass on shorter sequences (h64, h67)
        size = [seen[i].numel for i in order]
        seen_keys = {seen[i].key for i in order}
        earlier = {k: b for k, b in self._by_key.items() if k not in seen_keys and k in self._key_numel}
        stored = sum(self._key_numel[seen[i].key] for i in order if seen[i].key in self._key_numel)
        now = sum(n for i, n in zip(order, size) if seen[i].key in self._key_numel)
        scale = now / stored if stored else 1.0
        earlier_size = {k: self._key_numel[k] * scale for k in earlier}
        budget = (self.average_bits * (sum(size) + sum(earlier_size.values()))
                  - sum(b * earlier_size[k] for k, b in earlier.items()))
        keep = [_keep_bits(seen[i].dtype) for i in order]
        floor = [self.norm_min_bits if seen[i].norm_size is not None else CANDIDATE_BITS[0] for i in order]
        bits = allocate_bits([sens[i] for i in order], size, budget, keep, floor, [factors[i] for i in order])
        self.bits = dict(zip(order, bits))
        self._by_key = {**earlier, **{seen[i].key: b for i, b in zip(order, bits) if seen[i].key is not None}}
        self._key_numel = {**{k: self._key_numel[k] for k in earlier},
                           **{seen[i].key: n for i, n in zip(order, size) if seen[i].key is not None}}
        self.sensitivity = sens
        self.numel = {i: seen[i].numel for i in seen}
        self.variance_factors = {i: factors[i] for i in order}
        self.compression_variance = sum(alert[i] * _factor(factors[i], b) for i, b in self.bits.items())

    def _pair_variance(self, g: torch.Tensor, params: list[torch.Tensor]) -> None:
        """One SGD-variance estimate from this call's probe gradient and the last re-plan's,
        weighted by that re-plan's per-tensor scales (:func:`_tensor_scales`, kept with it)."""
        _, last, scales, probe_variance = self._last_g0
        self._last_g0 = None
        if last.shape != g.shape or not (scales is None or (isinstance(scales, torch.Tensor) and len(scales) == len(params))):
            return  # the parameters changed between the calls
        _, plain = _noise_norms(params, g, last.to(g.device), [None] * len(params))
        half = 0.5 * float(plain.sum() if scales is None else (plain * scales.to(plain.device).square()).sum())
        self._variance_pairs.append(max(half - probe_variance, 0.0))
        # the last ones only: the list had grown by one per pair for good, and every
        # state_dict copied it
        del self._variance_pairs[:-_VARIANCE_HISTORY]
        self.gradient_variance = self._variance_pairs[-1]

    def _check_variance(self) -> None:
        if math.isnan(self.gradient_variance):
            return
        if not self._warned and self.compression_variance > self.alert_ratio * self.gradient_variance:
            self._warned = True
            warnings.warn(
                f"GACT: compression variance {self.compression_variance:.3g} exceeds {self.alert_ratio:g} x the "
                f"SGD gradient variance {self.gradient_variance:.3g}: compression noise dominates the gradient "
                f"noise at average_bits={self.average_bits:g}; consider more bits",
                RuntimeWarning,
                stacklevel=_outside_stacklevel(),
            )
