"""Exact fused linear + cross-entropy for language-model heads (docs/compression.md §5).

``F.cross_entropy(F.linear(input, weight, bias), target)`` materialises the ``(N, V)``
logits and autograd keeps their log-softmax for backward: for GPT-2 (vocabulary V = 50257)
4 x V bytes per token in float32, 49 MiB for a 256-token example. :func:`linear_cross_entropy` computes the same loss and the same gradients, exactly
(no approximation), a chunk of tokens at a time, so that at most ``chunk_size x V`` logits
exist at once and nothing of size ``N x V`` is saved for backward. The idea is that of
Liger-Kernel's fused linear cross-entropy (Hsu et al., "Liger Kernel: Efficient Triton
Kernels for LLM Training", arXiv:2410.10989, 2024) and of Cut Cross-Entropy (Wijmans et
al., "Cut Your Losses in Large-Vocabulary Language Models", ICLR 2025); the code is ours.

:func:`patch_causal_lm_` makes a Hugging Face ``*ForCausalLM`` model compute its loss this
way when ``labels`` are passed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import numbers
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fewbit._checks import check_float_tensor, check_positive_int, is_int
from fewbit._interrupted import caller_frame, finished
from fewbit.ops._nonfinite import _same
from fewbit.ops._pointwise import _compiling_or_recording, _recording_program, _transforms_active

__all__ = [
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "fused_loss_refusal",
    "logit_transform",
    "patch_causal_lm_",
    "unpatch_causal_lm_",
    "DEFAULT_CHUNK_LOGITS",
]

#: Logits per chunk when ``chunk_size`` is None: ``chunk_size = max(1, 2**24 // V)`` tokens,
#: i.e. 64 MiB of float32 logits at a time (333 tokens for GPT-2's V = 50257).
DEFAULT_CHUNK_LOGITS = 2**24

_REDUCTIONS = ("none", "mean", "sum")
_HALF = (torch.float16, torch.bfloat16)


# linear_cross_entropy_reference repeats the signature of linear_cross_entropy on purpose: it
# is the unfused twin, called with exactly the same arguments by the tests and benchmarks.
def linear_cross_entropy_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The unfused computation that :func:`linear_cross_entropy` reproduces (tests, benchmarks).

    ``F.cross_entropy(F.linear(input, weight, bias).float(), target, ...)`` for float16 /
    bfloat16 inputs (the logits upcast as torch's autocast and Hugging Face's
    ``ForCausalLMLoss`` do), without the upcast otherwise. Saves the ``(N, V)`` float32
    log-softmax for backward.
    """
    logits = F.linear(input, weight, bias)
    if logits.dtype in _HALF:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing).reshape(
                               target.shape if reduction == "none" else ())


def _chunks(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, ignore_index: int,
                label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and safe target of one chunk of accumulation-dtype logits, which it
    turns into log-probabilities in place (``z - lse``, what the gradient's softmax takes).

    loss_i = -(1 - eps) log p_{i, t_i} - (eps / V) sum_c log p_{i, c}, torch's
    ``(1 - eps) * nll + eps / V * sum_c (-log p_c)`` (0 on ignored rows). The smoothing
    term sums the log-probabilities, not ``lse - mean(z)``: logits with a large common
    offset (a bias of 1e4) had lost it to cancellation (3.7e-4 off in float32, torch 4e-5).
    The row's maximum is taken off before the logsumexp, as torch's log_softmax does:
    ``z - lse`` rounded the lse to the ulp of the offset, and the gradients were 2.4-4.4x
    torch's error at a bias of 1e4 (h71).
    """
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    shifted = logits.sub_(m)  # exact (Sterbenz) near the max, as torch's log_softmax
    logp = shifted.sub_(torch.logsumexp(shifted, dim=-1, keepdim=True))
    safe = torch.where(valid, target, 0)
    loss = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).neg_()
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - (label_smoothing / logp.shape[-1]) * logp.sum(-1)
    return torch.where(valid, loss, 0.0), safe


def _run_chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    chunk_size: int,
    row_scale: torch.Tensor | None,
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss per row and, where ``need`` says so, the gradients, one chunk of rows at a time.

    ``x`` (N, H), ``weight`` (V, H), ``bias`` (V,) or None, ``target`` (N,) int64.
    ``row_scale`` (N,) in the accumulation dtype multiplies each row's gradient of the loss
    wrt its logits, d loss_i / d z_i = softmax(z_i) - (1 - eps) onehot(t_i) - eps / V; it is
    None when no gradient is wanted. ``need`` = (grad input, grad weight, grad bias).

    Returns ``(loss (N,), grad_input (N, H) | None, grad_weight (V, H) | None,
    grad_bias (V,) | None)``; the loss in the accumulation dtype (float32 for half inputs),
    the gradients in the dtypes of ``x``, ``weight``, ``bias``.
    """
    n, v = x.shape[0], weight.shape[0]
    acc = torch.float32 if x.dtype in _HALF else x.dtype
    loss = torch.empty(n, dtype=acc, device=x.device)
    want = row_scale is not None
    wanted = _wanted_grads(bias, row_scale, need)
    grad_input = torch.empty_like(x) if wanted[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=x.device) if wanted[1] else None
    grad_bias = torch.zeros(v, dtype=acc, device=x.device) if wanted[2] else None
    for start, stop in _chunks(n, chunk_size):
        xc, tc = x[start:stop], target[start:stop]
        valid = tc != ignore_index
        logits = F.linear(xc, weight, bias).to(acc)  # the logits of F.linear, then upcast
        loss_c, safe = _chunk_loss(logits, tc, valid, ignore_index, label_smoothing)
        loss[start:stop] = loss_c
        if not want:
            continue
        # softmax - (1 - eps) onehot - eps / V, in place of the log-probabilities chunk.
        g = logits.exp_()
        g.scatter_add_(-1, safe.unsqueeze(-1), g.new_full((stop - start, 1), -(1.0 - label_smoothing)))
        if label_smoothing:
            g.sub_(label_smoothing / v)
        g.mul_(torch.where(valid, row_scale[start:stop], 0.0).unsqueeze(-1))
        if grad_bias is not None:
            grad_bias += g.sum(0)
        gm = g.to(x.dtype)  # the gradient of the logits as F.linear's backward gets it
        if grad_input is not None:
            grad_input[start:stop] = gm @ weight
        if grad_weight is not None:
            if gm.dtype == acc:
                grad_weight.addmm_(gm.t(), xc)
            else:  # float16/bfloat16 product, accumulated over the chunks in float32
                grad_weight += (gm.t() @ xc).to(acc)
    return (
        loss,
        grad_input,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


# The chunk loop as one custom op: torch.compile calls it opaquely. Traced, the backward's
# recomputed logits were the forward's to Inductor (common subexpressions of the joint graph),
# and a matrix product is not recomputed, so the compiled graph saved every chunk's logits: a
# patched GPT-2 kept 14.5 MB under torch.compile against 8.7 eager (unpatched: 14.5 / 17.1).
@torch.library.custom_op(
    "fewbit::linear_cross_entropy_chunks", mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
           "int chunk_size, Tensor? row_scale, bool[] need, bool check_target) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _chunks_op(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, row_scale, need, check_target):
    if check_target:  # the forward's call (the backward's target is the same tensor)
        _check_target(target, ignore_index, weight.shape[0])
    out = _run_chunks(x, weight, bias, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                      chunk_size=chunk_size, row_scale=row_scale, need=tuple(need))
    return tuple(x.new_empty(0) if t is None else t for t in out)


@_chunks_op.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, row_scale, need, check_target):
    # the strides _run_chunks gives: grad_input like x, the others contiguous (a transposed
    # weight's empty_like had made Inductor fail, or with its size asserts off be wrong)
    acc = torch.float32 if x.dtype in _HALF else x.dtype
    wanted = _wanted_grads(bias, row_scale, need)
    return (x.new_empty(x.shape[0], dtype=acc),
            torch.empty_like(x) if wanted[0] else x.new_empty(0),
            weight.new_empty(weight.shape) if wanted[1] else x.new_empty(0),
            bias.new_empty(bias.shape) if wanted[2] else x.new_empty(0))


def _wanted_grads(bias, row_scale, need) -> tuple[bool, bool, bool]:
    """Which gradients :func:`_run_chunks` returns (the others are None): the one rule for it,
    the op's fake kernel and :func:`_chunked`."""
    want = row_scale is not None
    return want and need[0], want and need[1], want and need[2] and bias is not None


def _chunked(x, weight, bias, target, *, ignore_index, label_smoothing, chunk_size, row_scale, need,
             check_target=True):
    """:func:`_run_chunks` through ``fewbit::linear_cross_entropy_chunks``: the same
    ``(loss, grad_input, grad_weight, grad_bias)``, None for a gradient not asked for."""
    out = torch.ops.fewbit.linear_cross_entropy_chunks(x, weight, bias, target, ignore_index, label_smoothing,
                                                       chunk_size, row_scale, list(need), check_target)
    wanted = _wanted_grads(bias, row_scale, need)
    return (out[0], *(g if w else None for g, w in zip(out[1:], wanted)))


def _reduce(loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / count if reduction == "mean" else total


def _row_scale(grad_output: torch.Tensor, count: torch.Tensor, reduction: str, n: int) -> torch.Tensor:
    """d out / d loss_i for every row, times the incoming gradient ((N,), accumulation dtype)."""
    if reduction == "none":
        return grad_output.reshape(n)
    scale = grad_output / count if reduction == "mean" else grad_output
    return scale.reshape(1).expand(n)


class _LinearCrossEntropy(torch.autograd.Function):
    """Autograd of the fused loss; see :func:`linear_cross_entropy` for what is saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size,
                grad_in_forward):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        acc = torch.float32 if x.dtype in _HALF else x.dtype
        count = (target != ignore_index).sum().to(acc)
        ctx.reduction, ctx.grad_in_forward = reduction, grad_in_forward and any(need)
        ctx.ignore_index, ctx.label_smoothing, ctx.chunk_size = ignore_index, label_smoothing, chunk_size
        if ctx.grad_in_forward:
            # Liger-Kernel's way: the gradients for an incoming gradient of 1, scaled in backward.
            scale = _row_scale(torch.ones((), dtype=acc, device=x.device), count, reduction, x.shape[0])
            loss, gi, gw, gb = _chunked(x, weight, bias, target, ignore_index=ignore_index,
                                           label_smoothing=label_smoothing, chunk_size=chunk_size,
                                           row_scale=scale, need=need)
            ctx.save_for_backward(gi, gw, gb)
            # the versions of the inputs (not kept: weak references), checked at backward as
            # torch checks what it saves: a weight changed in place between forward and
            # backward (an optimizer step before a delayed backward) had given the gradients
            # of the old weight. x is often a reshape's view, gone after the call: its base.
            # (not while traced: a compiled graph's versions are symbols it cannot return)
            # (inference tensors keep no version: no in-place change of them is allowed anyway)
            ctx.versions = [] if _compiling_or_recording() else [
                (weakref.ref(t if t._base is None else t._base), t._version) for t in (x, weight, bias)
                if t is not None and not t.is_inference()]
        else:
            # Cut Cross-Entropy's way: keep the inputs, recompute each chunk's logits in backward.
            loss, *_ = _chunked(x, weight, bias, target, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, chunk_size=chunk_size, row_scale=None,
                                   need=need)
            ctx.save_for_backward(x, weight, bias, target, count)
        return _reduce(loss, count, reduction)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fewbit.linear_cross_entropy does not support double backward (create_graph=True); "
                "use fewbit.losses.linear_cross_entropy_reference for higher-order gradients")
        need = ctx.needs_input_grad[:3]
        if ctx.grad_in_forward:
            gi, gw, gb = ctx.saved_tensors
            for ref, version in ctx.versions:
                t = ref()
                if t is not None and t._version != version:
                    raise RuntimeError(
                        "one of the variables needed for gradient computation has been modified by an "
                        f"inplace operation: an input of fewbit.linear_cross_entropy (shape {tuple(t.shape)}) "
                        f"is at version {t._version}; expected version {version} instead "
                        "(grad_in_forward=True computed the gradients from the inputs as they were)")
            out = [None if g is None or not nd else _times(g, grad_output) for g, nd in zip((gi, gw, gb), need)]
        else:
            x, weight, bias, target, count = ctx.saved_tensors
            scale = _row_scale(grad_output.to(count.dtype), count, ctx.reduction, x.shape[0])
            _, gi, gw, gb = _chunked(x, weight, bias, target, ignore_index=ctx.ignore_index,
                                     label_smoothing=ctx.label_smoothing, chunk_size=ctx.chunk_size,
                                     row_scale=scale, need=need, check_target=False)
            out = [gi, gw, gb]
        return (*out, None, None, None, None, None, None)


#: Elements per float32 piece of :func:`_times`.
_TIMES_CHUNK = 1 << 20


def _times(g: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``g * grad_output`` (a 0-d incoming gradient) for gradients stored in forward. A
    float16 ``g`` is multiplied in float32, a piece of ``_TIMES_CHUNK`` elements at a time:
    a loss scale such as GradScaler's 2**16 is inf in float16, and ``grad_output.to(g.dtype)``
    made every gradient non-finite."""
    if g.dtype != torch.float16:
        return g * grad_output.to(g.dtype)
    go = grad_output.to(torch.float32)
    out = torch.empty_like(g)
    for src, dst in zip(g.view(-1).split(_TIMES_CHUNK), out.view(-1).split(_TIMES_CHUNK)):
        dst.copy_(src.to(torch.float32).mul_(go))
    return out


def _check_args(input, weight, target, bias, ignore_index, reduction, label_smoothing, chunk_size,
                grad_in_forward) -> None:
    check_float_tensor(input, "input")
    check_float_tensor(weight, "weight")
    if input.dim() < 1 or input.shape[-1] < 1:
        raise ValueError(f"input must have shape (..., H) with H >= 1 features, got shape {tuple(input.shape)}")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        raise ValueError(f"weight must have shape (V, H) with H = input.shape[-1] = {input.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have V >= 1 rows (classes), got shape {tuple(weight.shape)}")
    if weight.dtype != input.dtype:
        raise ValueError(f"weight must have the dtype of input ({input.dtype}), got {weight.dtype}")
    if bias is not None:
        check_float_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],) or bias.dtype != input.dtype:
            raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},) and dtype {input.dtype}, "
                             f"got shape {tuple(bias.shape)} and dtype {bias.dtype}")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        what = f"dtype {target.dtype}" if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target must be an int64 (or uint8) tensor of class indices, got {what}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("target", target)):
        if t is not None and t.device != input.device:  # torch's error too; on meta, values were garbage
            raise ValueError(f"{name} must be on input's device ({input.device}), got {t.device}")
    if not is_int(ignore_index) or not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"ignore_index must be an integer in [-2**63, 2**63), got {ignore_index!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= label_smoothing <= 1.0):  # NumPy's floats too, as torch takes them
        raise ValueError(f"label_smoothing must be a real number in [0.0, 1.0], got {label_smoothing!r}")
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if not isinstance(grad_in_forward, bool):
        raise ValueError(f"grad_in_forward must be True or False, got {grad_in_forward!r}")
    if grad_in_forward and reduction == "none":
        raise ValueError("grad_in_forward=True needs reduction 'mean' or 'sum' (the per-token incoming "
                         "gradient of reduction='none' is known only in backward), got reduction='none'")
    # the target's range is checked by fewbit::linear_cross_entropy_chunks (_check_target), when
    # it runs: data-dependent, so that torch.compile, vmap and torch.export need not trace it


def _has_tangent(*tensors) -> bool:
    """Whether a forward-mode AD level is on and one of ``tensors`` is a dual tensor
    (``torch.autograd.forward_ad.make_dual``): the chunk op has no forward-AD rule, so such a
    call runs unfused, as under ``torch.func`` (the fused loss had given no tangent)."""
    if torch.autograd.forward_ad._current_level < 0:
        return False
    return any(t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _check_target(target: torch.Tensor, ignore_index: int, v: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if bad.any():
        raise ValueError(f"target must be in [0, {v - 1}] or ignore_index ({ignore_index}), "
                         f"got {int(target[bad].reshape(-1)[0])}")


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    grad_in_forward: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target)`` without materialising the logits.

    Exact: the loss and the gradients are those of the unfused computation up to
    floating-point summation order (docs/compression.md §5). The tokens are processed
    ``chunk_size`` at a time; per chunk the logits z = x Wᵀ + b are computed in ``input``'s
    dtype (as ``F.linear`` does), upcast to float32 for float16/bfloat16 (as torch's
    autocast does for ``cross_entropy``), and reduced to the logsumexp and the loss. The
    gradient wrt the logits of row i is ``s_i (softmax(z_i) - (1 - eps) onehot(t_i) - eps / V)``
    (s_i: 1/n for ``"mean"`` over the n non-ignored rows, 1 for ``"sum"``, the incoming
    gradient for ``"none"``; 0 for ignored rows), so grad input = G W, grad weight = Gᵀ x,
    grad bias = Σ_i G_i, accumulated chunk by chunk.

    Memory kept for backward (N tokens, H features, V classes, b bytes per element):

    - torch (unfused): the log-softmax, N·V·4 bytes (float32, also for float16/bfloat16
      logits upcast for the loss), plus ``input`` (N·H·b);
    - ``grad_in_forward=False`` (default, the Cut Cross-Entropy way): ``input`` (N·H·b, a
      view of the caller's tensor, often saved by the layer before anyway), ``target``
      (8·N) and ``weight``/``bias`` (parameters, held anyway); backward recomputes each
      chunk's logits: one extra N·V·H matmul;
    - ``grad_in_forward=True`` (the Liger-Kernel way): the gradients, computed in forward
      for an incoming gradient of 1 and scaled in backward: grad input (N·H·b), grad weight
      (V·H·b) and grad bias (V·b) where they are needed; no extra matmul. In float32 smaller
      than torch's only when N > H tokens (768 for GPT-2). In float16 the gradients are
      rounded before a loss scale can lift them: entries below float16's range are 0
      (GradScaler's scale does not help, as it does for the default); prefer the default
      or bfloat16 there. Under ``torch.compile`` it runs as the default: its check that no
      input was changed in place before backward (an optimizer step before a delayed
      backward) needs eager version counters.

    At most ``chunk_size`` x V logits (and their gradient, in place) exist at once.

    Args:
        input: (..., H) floating tensor (float16, bfloat16, float32, float64).
        weight: (V, H), ``input``'s dtype.
        target: ``input.shape[:-1]``, int64 (or uint8, as torch's) class indices in [0, V)
            or ``ignore_index``.
        bias: (V,) or None, ``input``'s dtype.
        ignore_index: target value that contributes neither loss nor gradient; ``"mean"``
            averages over the other tokens (all ignored: NaN, as torch).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (loss of shape ``target.shape``,
            0 at ignored tokens).
        label_smoothing: eps in [0, 1]: torch's ``(1 - eps) * nll + eps * mean_c(-log p_c)``.
        chunk_size: tokens per chunk (>= 1); None: ``max(1, 2**24 // V)``
            (:data:`DEFAULT_CHUNK_LOGITS` logits per chunk).
        grad_in_forward: compute the gradients in forward (see above); needs ``reduction``
            ``"mean"`` or ``"sum"``.

    Returns:
        The loss: a scalar, or ``target.shape`` for ``"none"``; float32 for float16/bfloat16
        inputs, else ``input``'s dtype.

    Raises:
        TypeError: ``input``, ``weight`` or ``bias`` is not a floating tensor.
        ValueError: a shape, dtype or value out of range (the message names the argument),
            including target values outside [0, V) other than ``ignore_index``, ``H = 0``,
            ``input`` on a device other than cpu/cuda (meta: no values to compute), or
            ``weight``, ``bias`` or ``target`` on another device than ``input``.
        RuntimeError: in a double backward (``create_graph=True``).

    Under ``torch.autocast``, ``input``, ``weight`` and ``bias`` are cast to the autocast
    dtype first, as ``F.linear`` would be (float64 tensors are not cast, as there). Under
    ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``: per-sample gradients) and
    while ``torch.jit.trace``/``torch.export`` record a program, the unfused computation
    runs, in the same dtypes (the logits are materialised there).

    Example:
        >>> import torch, fewbit
        >>> x = torch.randn(6, 16, requires_grad=True); w = torch.randn(100, 16, requires_grad=True)
        >>> t = torch.tensor([3, 7, -100, 0, 99, 5])
        >>> loss = fewbit.linear_cross_entropy(x, w, t, chunk_size=4)
        >>> ref = torch.nn.functional.cross_entropy(x @ w.T, t)
        >>> bool(torch.allclose(loss, ref))
        True
    """
    device_type = input.device.type if isinstance(input, torch.Tensor) else "cpu"
    if device_type not in ("cpu", "cuda"):  # before autocast, which knows no meta
        raise ValueError(f"input must be on a cpu or cuda device (the loss is computed there), got {input.device}")
    if torch.is_autocast_enabled(device_type) and isinstance(input, torch.Tensor):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):  # autocast's rule: floating tensors but float64 (F.linear leaves those)
            eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            return t.to(dtype) if eligible else t

        input, weight, bias = cast(input), cast(weight), cast(bias)
    if isinstance(target, torch.Tensor) and target.dtype == torch.uint8:  # torch takes Long or Byte
        target = target.long()
    _check_args(input, weight, target, bias, ignore_index, reduction, label_smoothing, chunk_size,
                grad_in_forward)
    v, h = weight.shape
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_LOGITS // v)
    x = input.reshape(-1, h)
    t = target.reshape(-1)
    with torch.autocast(device_type, enabled=False):
        if _transforms_active() or _recording_program() or _has_tangent(x, weight, bias):
            # torch.func (grad, vmap, jacrev) runs torch's ops, not a custom Function, and
            # torch.jit.trace / torch.export record them: the unfused computation, logits
            # materialised, in the dtypes the fused one uses
            logits = F.linear(x, weight, bias)
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            loss = F.cross_entropy(logits, t, ignore_index=int(ignore_index), reduction=reduction,
                                   label_smoothing=float(label_smoothing))
        elif torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in (x, weight, bias)):
            # traced (torch.compile), grad_in_forward runs as the default: its check that no
            # input changed in place before backward reads version counters, which a trace
            # does not have, and a weight stepped in place before a delayed backward gave
            # the old weight's gradients silently (h71); the default's saved inputs are
            # checked by autograd, compiled or not
            loss = _LinearCrossEntropy.apply(x, weight, bias, t, int(ignore_index), reduction,
                                             float(label_smoothing), int(chunk_size),
                                             grad_in_forward and not _compiling_or_recording())
        else:  # evaluation: the loss only (autograd would still ask the Function for gradients)
            rows, *_ = _chunked(x, weight, bias, t, ignore_index=int(ignore_index),
                                   label_smoothing=float(label_smoothing), chunk_size=int(chunk_size),
                                   row_scale=None, need=(False, False, False))
            count = (t != ignore_index).sum().to(rows.dtype)
            loss = _reduce(rows, count, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


# ---------------------------------------------------------------------------------------
# Hugging Face *ForCausalLM models
# ---------------------------------------------------------------------------------------

_PATCH_ATTR = "_fewbit_fused_cross_entropy"


@dataclass
class _Patch:
    head: nn.Linear
    chunk_size: int | None
    grad_in_forward: bool
    fallback: Any  # the model's loss function before patching
    had_loss_function: bool
    previous_loss_function: Any
    handles: list = field(default_factory=list)
    #: this thread's running forwards (_Running): threads sharing a model (an evaluation or
    #: generation thread beside training) had read each other's hidden states as logits
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def __getstate__(self) -> dict:  # deepcopy, pickle: no running forward is copied
        d = dict(self.__dict__)
        d.pop("_local")
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._local = threading.local()
        _eager_checks()

    def __post_init__(self) -> None:
        _eager_checks()

    @property
    def running(self) -> "_Running":
        running = getattr(self._local, "running", None)
        if running is None:
            running = self._local.running = _Running()
        return running


@dataclass
class _Running:
    """A thread's forwards of a patched model."""

    #: per running forward, innermost last: [labels given?, (the fused loss, its grad_fn
    #: when made) or None, the frame
    #: of its module call (fewbit._interrupted: a KeyboardInterrupt skips the hook that pops it),
    #: its output embedding (the patched head, or an nn.DataParallel replica's copy of it)]
    active: list = field(default_factory=list)
    hidden: torch.Tensor | None = None  # what lm_head returned instead of the logits
    hidden_version: int | None = 0  # its version counter then (an in-place change moves it)
    hidden_copy: torch.Tensor | None = None  # an inference tensor's copy (it has no version counter)

    def labelled(self) -> bool:
        """Whether the innermost running forward has labels (one a ``KeyboardInterrupt``
        stopped does not count)."""
        active = self.active
        if not _compiling_or_recording():  # traced (model.forward compiled alone): no frames to ask
            while active and finished(active[-1][2]):
                active.pop()
        return bool(active) and active[-1][0]

    def head(self, patch: _Patch) -> nn.Module:
        """The output embedding of the innermost running forward (an ``nn.DataParallel``
        replica's own copy in its thread), else the patched one."""
        return self.active[-1][3] if self.active else patch.head


def _causal_lm_fused_loss(patch: _Patch, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                          vocab_size: int, num_items_in_batch: Any = None, ignore_index: int = -100,
                          shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` on the hidden states (same shift, mean and sum),
    with ``head``'s weight and bias."""
    weight, bias = head.weight, head.bias
    # transformers' ForCausalLMLoss uses vocab_size to view the logits as (-1, vocab_size);
    # a model passing logits.shape[-1] (Inkling's) passed the hidden size here
    if weight.shape[0] != vocab_size and vocab_size != hidden.shape[-1]:
        raise ValueError(f"vocab_size ({vocab_size}) must equal the rows of the output embedding "
                         f"weight ({weight.shape[0]})")
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                shift_labels.reshape(-1).to(hidden.device), bias,
                                ignore_index=ignore_index, reduction=reduction, chunk_size=patch.chunk_size,
                                grad_in_forward=patch.grad_in_forward)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


#: ``{class: signature of its forward or None}`` (:func:`_forward_signature`).
_SIGNATURES: dict = {}


def _forward_signature(cls: type) -> inspect.Signature | None:
    # a dict, not functools.lru_cache: torch.compile traces the pre-hook that reads it,
    # and warned of "silent incorrectness" at an lru_cache-wrapped function (h71); the
    # patch fills it, so a traced forward only reads it
    if cls not in _SIGNATURES:
        try:
            _SIGNATURES[cls] = inspect.signature(cls.forward)
        except (TypeError, ValueError):
            _SIGNATURES[cls] = None
    return _SIGNATURES[cls]


class _HeadForward:
    """The patched ``lm_head.forward``: the hidden states themselves while a forward with
    labels runs (recorded for the loss), else the head's own forward."""

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        patch = self.patch
        running = patch.running
        if running.labelled():
            if hidden_states.grad_fn is not None and not _compiling_or_recording():
                # a view of its own: a use of the "logits" beside the loss function (a z-loss
                # on their logsumexp) is then told apart, in the graph, from the model's own
                # uses of its hidden states (_check_returned_loss)
                hidden_states = hidden_states.view_as(hidden_states)
            running.hidden = hidden_states
            _EAGER[0](running, hidden_states)
            return hidden_states
        head = running.head(patch)
        return type(head).forward(head, hidden_states)


def _note_version(running: "_Running", hidden_states: torch.Tensor) -> None:
    """Record the hidden states' version counter (an inference tensor's copy: it has none).
    Run eagerly under torch.compile (:data:`_EAGER`)."""
    if hidden_states.is_inference():
        running.hidden_version, running.hidden_copy = None, hidden_states.clone()
    else:
        running.hidden_version, running.hidden_copy = hidden_states._version, None


def _changed(hidden: torch.Tensor, running: _Running) -> bool:
    """Whether ``hidden`` (what the head returned) was changed in place since: its version
    counter, or for an inference tensor (``torch.inference_mode``, which keeps none) its bits
    against the copy the head kept (``_same``: any NaN equal to any NaN)."""
    if running.hidden_version is not None:
        return hidden._version != running.hidden_version
    return not _same(hidden, running.hidden_copy)


#: ``[_note_version, _changed]`` run eagerly under torch.compile (``torch.compiler.disable``):
#: traced, a tensor's ``_version`` is the trace's own, and a compiled model that masked its
#: logits in place got a silently wrong loss (h71). Made by the first :class:`_Patch`, not
#: at import: ``torch.compiler.disable`` imports ``torch._dynamo`` (and triton: seconds).
_EAGER: list = []


def _eager_checks() -> None:
    if not _EAGER:
        _EAGER[:] = [torch.compiler.disable(_note_version), torch.compiler.disable(_changed)]


class _TransformedLogits(RuntimeError):
    """The model changed its logits between ``lm_head`` and the loss (raised by the fused loss;
    :func:`fewbit.plan` then profiles the unfused loss instead)."""


class _LossFunction:
    """The patched ``model.loss_function``: the fused loss on the recorded hidden states while
    a forward with labels runs, else the model's loss function from before patching."""

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    def __call__(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        patch = self.patch
        running = patch.running
        if running.labelled():
            if logits is None or logits is not running.hidden or _EAGER[1](logits, running):
                # a transform between the head and the loss, also one in place (Chameleon's
                # masked image tokens, xLSTM's soft cap in eval mode): it acted on the hidden
                # states, so the fused loss would be silently wrong
                raise _TransformedLogits(
                    "the model's loss function did not get the output of its lm_head unchanged (the "
                    "model transforms its logits, perhaps in place), so the fused cross-entropy cannot "
                    "compute it; convert without it (fewbit.Config(fused_cross_entropy=False), "
                    "fewbit.plan(..., fused_cross_entropy=False)) or call fewbit.losses.unpatch_causal_lm_(model)")
            loss = _causal_lm_fused_loss(patch, running.head(patch), logits, labels, vocab_size,
                                         num_items_in_batch, ignore_index, shift_labels)
            # the forward's loss must come from it (_PostHook), and nothing else from the
            # logits: its node as made here (an in-place `loss += aux` moves loss.grad_fn)
            running.active[-1][1] = (loss, loss.grad_fn)
            return loss
        return patch.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)


def _replica_of(head: nn.Module, patch: _Patch) -> bool:
    """Whether ``head`` is an ``nn.DataParallel`` replica of ``patch``'s head (torch copies
    the head's ``__dict__``, its patched forward included, into each replica)."""
    forward = vars(head).get("forward") if isinstance(head, nn.Module) else None
    return getattr(head, "_is_replica", False) and isinstance(forward, _HeadForward) and forward.patch is patch


class _PreHook:
    """Forward pre-hook of the patched model: notes whether this forward has labels, and
    refuses to run with an output embedding other than the patched one."""

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, kwargs):
        patch = self.patch
        signature = _forward_signature(type(module))
        try:
            labels = signature.bind_partial(module, *args, **kwargs).arguments.get("labels")
        except (TypeError, AttributeError):
            labels = kwargs.get("labels")
        head = module.get_output_embeddings()
        if head is not patch.head and not _replica_of(head, patch):
            if labels is None:  # the replaced head is not patched: it computes its logits itself
                head = patch.head
            else:
                raise RuntimeError(
                    f"{type(module).__name__}'s output embedding was replaced after "
                    "fewbit.losses.patch_causal_lm_; call fewbit.losses.unpatch_causal_lm_(model) before "
                    "replacing it and patch the model again after")
        if labels is not None and not isinstance(vars(module).get("_loss_function"), _LossFunction):
            # the user's loss would get the hidden states as logits
            raise RuntimeError(
                f"{type(module).__name__}'s loss_function was replaced after fewbit.losses.patch_causal_lm_; "
                "call fewbit.losses.unpatch_causal_lm_(model) (fewbit.Config(fused_cross_entropy=False)) to "
                "use your own loss: the fused loss computes transformers' ForCausalLMLoss only")
        running = patch.running
        if running.active:  # forwards a KeyboardInterrupt stopped (their post-hook never ran)
            running.active[:] = [e for e in running.active if not finished(e[2])]
            if not running.active:  # their hidden states (and graph) go before this forward's
                running.hidden, running.hidden_copy = None, None
        frame = None if _compiling_or_recording() else caller_frame()  # traced: no frames
        # the exception being handled where the forward starts (a forward run inside an
        # except block): the post-hook tells a forward that raised by a different one
        running.active.append([labels is not None, None, frame, head, sys.exc_info()[1]])


def _computed_from(returned: torch.Tensor, loss: torch.Tensor, depth: int = 16) -> bool:
    """Whether ``returned`` is ``loss`` or computed from it within ``depth`` autograd nodes
    (an auxiliary loss added, a scale: breadth first, so a deep auxiliary branch, an MoE's
    router loss through the whole model, is not searched before the loss's own node); True
    when either has no graph (no grad: nothing to tell by)."""
    if returned is loss or returned.grad_fn is None or loss.grad_fn is None:
        return True
    target, level, seen = loss.grad_fn, [returned.grad_fn], set()
    for _ in range(depth):
        if any(node is target for node in level):
            return True
        seen.update(level)
        level = [n for node in level for n, _ in node.next_functions if n is not None and n not in seen]
        if not level:
            break
    return False


def _reaches_beside(returned: torch.Tensor, skip, target: torch.Tensor, depth: int = 16) -> bool:
    """Whether ``returned``'s graph reaches ``target``'s node within ``depth`` autograd nodes
    other than through the node ``skip`` (breadth first, as :func:`_computed_from`)."""
    goal = target.grad_fn
    if returned.grad_fn is None or goal is None or skip is None:
        return False
    level, seen = [returned.grad_fn], set()
    for _ in range(depth):
        if any(node is goal for node in level):
            return True
        seen.update(level)
        level = [n for node in level if node is not skip
                 for n, _ in node.next_functions if n is not None and n not in seen]
        if not level:
            break
    return False


def _check_returned_loss(module: nn.Module, output: Any, computed: tuple | None,
                         logits: torch.Tensor | None = None) -> None:
    """Raise if a forward with labels returned a loss other than (or not computed from) the
    fused loss its ``self.loss_function`` gave (``computed``: that loss and its node when
    made), or one that also used the ``logits`` (what the lm_head returned: the hidden
    states) otherwise: the lm_head gave it the hidden states, so a loss it computed
    otherwise is wrong."""
    how = "fewbit.losses.unpatch_causal_lm_(model) (fewbit.Config(fused_cross_entropy=False))"
    if computed is None:  # the head's output went to a cross-entropy of the model's own
        raise RuntimeError(
            f"{type(module).__name__}'s forward ran its lm_head with labels but did not compute its loss with "
            "self.loss_function, so the fused cross-entropy could not compute it and the loss it returned "
            f"was computed from the hidden states; call {how}")
    computed, node = computed
    returned = output[0] if isinstance(output, tuple) and output else getattr(output, "loss", None)
    if torch.is_tensor(returned) and not _computed_from(returned, computed):
        # a subclass that calls super().forward, then computes a loss of its own from the
        # output's logits (the hidden states here)
        raise RuntimeError(
            f"{type(module).__name__}'s forward returned a loss not computed from what its self.loss_function "
            f"returned (a loss of its own from the logits, which the fused cross-entropy leaves as hidden "
            f"states); call {how}")
    if torch.is_tensor(returned) and logits is not None and _reaches_beside(returned, node, logits):
        # more than the cross-entropy from the logits (Bamba's z-loss on their logsumexp):
        # computed from the hidden states, the loss would be silently wrong
        raise _TransformedLogits(
            f"{type(module).__name__}'s forward computed its loss from the logits besides self.loss_function "
            f"(e.g. a z-loss on their logsumexp), and the fused cross-entropy leaves them as hidden states; "
            f"call {how}")


class _PostHook:
    """Forward hook of the patched model: drops the hidden states it returned as logits."""

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    def __call__(self, module, args, kwargs, output):
        running = self.patch.running
        if not running.active:
            return None
        (active, computed, _, _, handled), hidden = running.active.pop(), running.hidden
        running.hidden, running.hidden_copy = None, None  # the copy also when the loss raised
        if not active or hidden is None:
            return None
        if sys.exc_info()[1] is handled:  # else the forward raised: its error stands
            # (not "no exception": a forward run in an except block had skipped the check,
            # and the planner's retry of a refused step returned a wrong loss silently)
            _check_returned_loss(module, output, computed, hidden)
        if isinstance(output, tuple):
            return tuple(o for o in output if o is not hidden)
        if getattr(output, "logits", None) is hidden:
            return type(output)(**{k: v for k, v in output.items() if k != "logits"})
        return None


#: Config fields of transformers models that transform the logits between the ``lm_head``
#: and the loss, or compute more from them than the cross-entropy, with the values that do
#: not: Gemma 2/3's soft cap, Cohere's scale, xLSTM's soft cap (applied in place in eval
#: mode), RecurrentGemma's soft cap, MuseGlimmer's multiplier, Falcon-H1's head multiplier
#: (None only: transformers 5.24 applies a scale of 1 too, a new tensor the fused loss
#: cannot take); Bamba's z-loss on the
#: logits' logsumexp (None, 0). Not ``logits_scaling``: Granite and HyperCLOVA X scale the
#: logits by it, but MiniCPM3 the hidden states before the head, which the fused loss takes.
#: Those and others are refused at their first forward with labels (a new tensor between the
#: head and the loss, or a further use of the logits: :func:`_check_returned_loss`), where
#: ``fewbit.plan`` falls back on the unfused loss.
_LOGIT_TRANSFORMS: dict[str, tuple] = {
    **dict.fromkeys(("final_logit_softcapping", "logit_scale", "output_multiplier_scale",
                     "output_logit_soft_cap", "logits_soft_cap", "output_multiplier", "lm_head_multiplier"),
                    (None,)),
    "z_loss_coefficient": (None, 0, 0.0),
}


def logit_transform(model: nn.Module) -> str | None:
    """Which transform of the logits a transformers model's config names (``"config.name =
    value"``, also in its text config), or None: such models cannot take the fused loss
    (:func:`patch_causal_lm_` refuses them; ``fewbit.plan`` does not choose it for them),
    or that computes more than the cross-entropy from them (Bamba's ``z_loss_coefficient``)."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    configs = [("config", config)]
    try:
        text = get_text() if callable(get_text) else None
    except (TypeError, ValueError, AttributeError):
        text = None
    if text is not None and text is not config:
        configs.append(("config.text_config", text))
    for where, cfg in configs:
        for name, neutral in _LOGIT_TRANSFORMS.items():
            value = getattr(cfg, name, None)
            if not any(value is v or (v is not None and value == v) for v in neutral):
                return f"{where}.{name} = {value!r}"
    return None


def _computes_loss_with_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` names ``self.loss_function``, or delegates (``super().forward``)
    to a base class's forward that does. A forward that names it without calling it is
    caught at the forward (``_PostHook``)."""
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        if not callable(forward):
            continue
        names = getattr(inspect.unwrap(forward), "__code__", _NO_CODE).co_names
        if "loss_function" in names:
            return True
        if not ("super" in names and "forward" in names):  # computes its loss itself (BART's)
            return False
    return False


_NO_CODE = (lambda: None).__code__  # co_names ()


@functools.lru_cache(maxsize=None)
def _writes_into_logits(cls: type) -> str | None:
    """The statement of ``cls.forward`` (and of the base classes' forwards it reaches by
    ``super().forward``) that changes the head's output in place, or None: ``logits[...] =
    v``, ``logits += v``, ``logits.masked_fill_(...)``, where ``logits`` is a name assigned
    ``self.lm_head(...)``.
    The fused loss hands the head's input on in its place, so such a write changes the
    hidden states (Chameleon masks its image tokens: an IndexError when an image token's id
    was past the hidden size, else the check at the loss; h71). None where the source is
    not readable (the check at the loss remains)."""
    for klass in cls.__mro__:  # a super().forward chain's forwards (_computes_loss_with_loss_function)
        forward = vars(klass).get("forward")
        if not callable(forward):
            continue
        written = _written_in(forward)
        if written is not None:
            return written
        names = getattr(inspect.unwrap(forward), "__code__", _NO_CODE).co_names
        if not ("super" in names and "forward" in names):  # a subclass's forward that does not
            return None  # delegate (a subclass of Chameleon's calling super() had been passed, h77)
    return None


def _written_in(forward) -> str | None:
    """:func:`_writes_into_logits` of one forward's source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    heads = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
             and node.value.func.attr == "lm_head" for t in node.targets if isinstance(t, ast.Name)}

    def named(node) -> bool:
        return isinstance(node, ast.Name) and node.id in heads

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        hit = any(isinstance(t, ast.Subscript) and named(t.value) for t in targets) or (
            isinstance(node, ast.AugAssign) and named(node.target))
        hit = hit or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and named(node.func.value)
                      and node.func.attr.endswith("_") and not node.func.attr.startswith("_"))
        if hit:
            return ast.unparse(node).split("\n")[0]
    return None


def fused_loss_refusal(model: nn.Module) -> str | None:
    """Why :func:`patch_causal_lm_` cannot compute ``model``'s loss exactly, or None if it can.

    It can when ``model`` is a transformers model whose forward takes ``labels`` and computes
    its loss as ``self.loss_function(self.lm_head(hidden), labels, ...)``, with
    ``model.get_output_embeddings()`` a plain ``nn.Linear`` (a subclass whose own ``forward``
    would be skipped is refused: DoryForCausalLM's head scales its logits), the loss function
    transformers' ``ForCausalLMLoss`` (not one set by the user, nor another loss type: a
    masked-LM loss has no shift), a forward that calls ``self.loss_function`` (BART's,
    Whisper's, Marian's ``*ForCausalLM`` compute the cross-entropy inline), and no logit
    transform named by its config (:func:`logit_transform`). A model patched already is
    judged by the loss function it had before."""
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) and isinstance(model, nn.Module) else None
    if not isinstance(head, nn.Linear) or not hasattr(model, "loss_function") or not hasattr(model, "config"):
        return (f"model must be a transformers *ForCausalLM model with a Linear output embedding and a "
                f"loss_function, got {name}")
    if type(head).forward is not nn.Linear.forward and not isinstance(vars(head).get("forward"), _HeadForward):
        return (f"model ({name})'s output embedding is a {type(head).__name__}, whose forward is not "
                "nn.Linear's: the fused loss, which takes its weight and bias only, would skip it")
    signature = _forward_signature(type(model))
    if signature is None or "labels" not in signature.parameters:
        return f"model ({name}).forward takes no 'labels' argument"
    if not _computes_loss_with_loss_function(type(model)):
        return (f"model ({name}).forward does not compute its loss with self.loss_function (it computes the "
                "cross-entropy itself, or reaches the base class's forward otherwise than by super().forward), "
                "so the fused loss cannot take its place")
    written = _writes_into_logits(type(model))
    if written is not None:
        return (f"model ({name}).forward changes its logits in place before the loss ({written}); the fused "
                "loss, which never makes the logits, would not match it")
    patch = getattr(model, _PATCH_ATTR, None)
    loss_function = patch.fallback if patch is not None else model.loss_function
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # not a transformers model then
        return f"model ({name}) is not a transformers model (transformers' ForCausalLMLoss is not importable)"
    if loss_function is not ForCausalLMLoss:
        what = getattr(loss_function, "__name__", type(loss_function).__name__)
        return (f"model ({name})'s loss_function is {what}, not transformers' ForCausalLMLoss, which is the "
                "loss the fused cross-entropy computes")
    transform = logit_transform(model)
    if transform is not None:
        return f"model ({name}) transforms its logits before the loss ({transform}); the fused loss would not match it"
    return None


def patch_causal_lm_(model: nn.Module, *, chunk_size: int | None = None, grad_in_forward: bool = False) -> nn.Module:
    """Make a Hugging Face ``*ForCausalLM`` model compute its loss with :func:`linear_cross_entropy`.

    In place. When ``labels`` are passed to ``model(...)``, the output embedding
    (``model.get_output_embeddings()``, the ``lm_head``) returns its input instead of the
    logits, and the model's ``loss_function`` (transformers' documented setter) computes
    Hugging Face's causal-LM loss from it with the fused, chunked loss: labels shifted by one
    (or ``shift_labels`` if given), ``ignore_index`` (-100) ignored, the mean over the other
    tokens, or the sum divided by ``num_items_in_batch`` when the Trainer passes it. The
    output's ``logits`` is then None (with ``return_dict=False`` it is left out of the tuple,
    as None fields are). Without ``labels`` the model computes and returns its logits as
    before. The saved ``(tokens, vocab)`` log-softmax disappears from the memory kept
    for backward (docs/compression.md §5).

    transformers has no hook between the hidden states and the ``lm_head``, so the head's
    ``forward`` is replaced on the instance (the module, its weight and the weight tying are
    unchanged); :func:`unpatch_causal_lm_` restores it. Models that transform the logits
    between the head and the loss (Gemma 2's ``final_logit_softcapping``, Cohere's
    ``logit_scale``, Chameleon's write into its logits in its forward's source) are
    refused: the fused loss would be wrong for them.

    Args:
        model: a transformers ``PreTrainedModel`` whose forward computes
            ``self.loss_function(logits, labels, vocab_size, **kwargs)`` from
            ``self.lm_head(hidden_states)`` (GPT-2, Llama, Mistral, Qwen2, ...).
        chunk_size: tokens per chunk, as in :func:`linear_cross_entropy`.
        grad_in_forward: as in :func:`linear_cross_entropy`.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` is not such a model (:func:`fused_loss_refusal` says why: a
            head whose class has its own forward, a loss function other than
            ``ForCausalLMLoss``, a loss computed without ``self.loss_function``, logits
            transformed before the loss, by the config or by a write in the forward's
            source), or is already patched; ``chunk_size`` or
            ``grad_in_forward`` is invalid.
        RuntimeError: at a forward with labels, if the model's loss function was given
            something other than the head's output, was replaced after patching, or was
            not called.

    Example:
        >>> import torch, transformers, fewbit
        >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
        >>> model = fewbit.losses.patch_causal_lm_(transformers.GPT2LMHeadModel(cfg))
        >>> out = model(torch.randint(0, 50, (2, 8)), labels=torch.randint(0, 50, (2, 8)))
        >>> out.logits is None, out.loss.shape
        (True, torch.Size([]))
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a transformers *ForCausalLM model, got {type(model).__name__}")
    if hasattr(model, _PATCH_ATTR):
        raise ValueError(f"model ({type(model).__name__}) is already patched; call unpatch_causal_lm_ first")
    refusal = fused_loss_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if not isinstance(grad_in_forward, bool):
        raise ValueError(f"grad_in_forward must be True or False, got {grad_in_forward!r}")
    head = model.get_output_embeddings()

    had = "_loss_function" in vars(model)
    patch = _Patch(head=head, chunk_size=chunk_size, grad_in_forward=grad_in_forward,
                   fallback=model.loss_function, had_loss_function=had,
                   previous_loss_function=vars(model).get("_loss_function"))
    # Callable objects, not closures: copy.deepcopy(model) maps their ``patch`` (and its head)
    # to the copy's, and torch.save / pickle can store them.
    head.forward = _HeadForward(patch)
    model.loss_function = _LossFunction(patch)
    patch.handles = [
        model.register_forward_pre_hook(_PreHook(patch), with_kwargs=True),
        model.register_forward_hook(_PostHook(patch), with_kwargs=True, always_call=True),
    ]
    setattr(model, _PATCH_ATTR, patch)
    return model


def unpatch_causal_lm_(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_causal_lm_` in place: the head's forward, the loss function (unless
    one was set since: it stays), the hooks.

    Raises:
        ValueError: ``model`` was not patched.
    """
    patch = getattr(model, _PATCH_ATTR, None)
    if patch is None:
        raise ValueError(f"model ({type(model).__name__}) is not patched by fewbit.losses.patch_causal_lm_")
    for handle in patch.handles:
        handle.remove()
    if "forward" in vars(patch.head):
        del patch.head.forward
    if not isinstance(vars(model).get("_loss_function"), _LossFunction):
        pass  # the user set a loss function of their own since: theirs stays
    elif patch.had_loss_function:
        model._loss_function = patch.previous_loss_function
    else:
        del model._loss_function
    delattr(model, _PATCH_ATTR)
    return model
