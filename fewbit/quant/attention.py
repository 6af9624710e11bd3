"""Fused attention whose backward sees one consistent forward (docs/compression.md §1).

``F.scaled_dot_product_attention`` (flash, memory-efficient and cuDNN kernels on CUDA, the
flash kernel on CPU) saves ``q, k, v``, its output and the exact row logsumexp ``lse``;
backward rebuilds the attention matrix as ``P = exp(q kᵀ · scale - lse)``. When a
saved-tensor compressor hands back dequantized ``q̂, k̂`` (and ``out``) but the exact
``lse``, the rows of ``P`` no longer sum to one and the error is exponentiated.

:func:`scaled_dot_product_attention` is torch's function with another backward. Forward
runs torch's SDPA on the caller's tensors, unchanged (same kernel, same dropout draws, the
same output bit for bit) and saves only ``q, k, v`` (through the active saved-tensor hooks,
so a compressor quantizes them), the ``attn_mask`` as it is (never quantized: it may hold
-inf or the dtype's min), and, when ``dropout_p > 0``, the generator state before the call.
Backward dequantizes ``q̂, k̂, v̂``, replays the generator, recomputes SDPA from them under
``enable_grad`` (same enabled backends) and differentiates that: ``out``, ``lse`` and ``P``
are all functions of ``q̂, k̂, v̂``, so backward is the exact gradient of a genuine attention
(rows sum to one, no overflow at any bit width). Nothing ``T x T`` is kept between forward
and backward (the recomputation uses the same fused kernel, O(T) memory), and no output or
logsumexp is kept. The price is one extra SDPA forward in backward.

Design options, measured with ``python scripts/bench_attention_noise.py --draws 32 --gain
2`` (one causal attention: batch 4, 4 heads, 128 tokens, head dim 32, q/k/v entries of std
2, fp32, CPU; mean over 32 draws of ``|g - g_exact| / |g_exact|`` for the stacked ``Wq, Wk,
Wv`` gradient -- the input gradient's is within 1 % of it, 5 % for torch SDPA at 2 bits;
only what the attention itself saves is compressed):

==========================================  =======  =======  =======  ========
saved by the attention                       1 bit    2 bits   4 bits   8 bits
==========================================  =======  =======  =======  ========
eager: q, k, P, v at b bits                  13.5     1.63     0.311    0.0256
torch SDPA: q, k, v, out at b, lse exact     nan      6.8e8    2.68     0.0652
torch SDPA, q and k at 8 bits                7.82     2.27     0.456    0.0652
recompute, q, k, v at b bits                 3.83     1.59     0.546    0.0353
recompute, q, k at 8 bits, v at b (chosen)   2.45     0.712    0.146    0.0084
==========================================  =======  =======  =======  ========

(At ``--gain 1``, 4 bits: 0.211, 0.328, 0.167, 0.241, 0.112.) Recomputing removes the
inconsistency, but with q and k at b bits the logits ``q̂ k̂ᵀ`` carry the error of both
factors, times the other's magnitude, into the softmax: noisier than eager attention, which
quantizes P itself. With q and k at 8 bits the recomputed P is nearly exact and the noise
comes from v alone: below eager at every width (2-2.5x at 2-4 bits). Under an 8-bit
compressor, q and k at 8 bits would still be noisier than eager (0.035 vs 0.026), so they
are kept exact (0.0084). Giving the tensors that feed an exponential more bits follows
GACT's per-tensor allocation by sensitivity (Liu et al., ICML 2022). Memory per token and
layer (``D`` model width, ``H`` heads, ``T`` tokens; plus the group stats): eager keeps
``(3 D + H T) b`` bits, this function ``16 D + D b`` for b < 8. The GPT-2 of
``scripts/train_lm.py`` (D = 256, H = 4, T = 256) at 4 bits: 7168 vs 5120 bits. The bias
(backward is nonlinear in ``q̂, k̂``) is second order in the quantization step: see
tests/quant/test_gradient_statistics.py.

Interception: while an :class:`~fewbit.quant.ActivationCompressor` is active (inside a
module converted by ``fewbit.convert_``, or a ``with fewbit.compress_activations(...)``
block), :class:`fewbit.quant.mode.CompressionMode` reroutes every call of
``torch.nn.functional.scaled_dot_product_attention`` (Hugging Face ``"sdpa"`` attention,
``nn.MultiheadAttention`` with ``need_weights=False`` through
``F.multi_head_attention_forward``, user code) whose ``q, k, v`` the compressor would
quantize to this function. Calls without grad, on tensor subclasses or nested tensors, or
with nothing to compress go to torch's SDPA unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import torch.nn.functional as F

from fewbit._saved import keep, unpack
from fewbit.quant.compressor import KEEP_EXACT_ADVICE, compress_custom_saves
from fewbit.quant.nonlinear import NOT_HANDLED

__all__ = ["scaled_dot_product_attention", "reroute", "QK_BITS"]

_SDPA = F.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
# torch.overrides.redispatch_function, or the private primitive behind it in releases that do
# not export it. Without either, the SDPA call inside F.multi_head_attention_forward is not
# rerouted (it stays torch's, with the inconsistency of docs/compression.md §1).
_redispatch = getattr(torch.overrides, "redispatch_function", None)
if _redispatch is None and hasattr(torch._C, "_skip_one_hop_torch_function"):
    _redispatch = torch._C._skip_one_hop_torch_function
#: The torch callables :func:`reroute` looks at.
ROUTED = (_SDPA, _MHA_FORWARD)

_STATE = threading.local()


class _Bypass:
    """Inside: calls of SDPA go to torch unchanged (our own forward and recomputation)."""

    def __enter__(self):
        self.prev = getattr(_STATE, "bypass", False)
        _STATE.bypass = True

    def __exit__(self, *exc):
        _STATE.bypass = self.prev


def _no_saved_tensor_hooks():
    """Saved-tensor hooks that keep what is saved inside exact, whatever hooks are active
    (:func:`fewbit._saved.keep`: a detached alias, so SDPA's saved out and lse close no
    reference cycle through out -> grad_fn -> out, which leaked about 3 MiB a call at
    batch 8 x 4 heads x 128 tokens x 32)."""
    return torch.autograd.graph.saved_tensors_hooks(keep, unpack)


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _sdpa_backends():
    """The SDPA backends enabled now (``torch.nn.attention.sdpa_kernel``), or None."""
    try:
        from torch.nn.attention import _cur_sdpa_kernel_backends
    except ImportError:  # pragma: no cover - private helper moved
        return None
    return _cur_sdpa_kernel_backends()


def _backends_as(backends):
    """``sdpa_kernel(backends)``: the recomputation uses the kernels forward was allowed."""
    if not backends or backends == _sdpa_backends():
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def _leaf(t: torch.Tensor | None, requires_grad: bool) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().requires_grad_(requires_grad)


class _RecomputedSDPA(torch.autograd.Function):
    """Forward: torch's SDPA on (q, k, v). Saves qs, ks, vs: q, k, v themselves or dense
    copies of them (``_saved_copy``); with ``exact_qk``, qs and ks detached, which a
    compressor keeps as they are. Backward: gradients for qs, ks, vs (and a float
    attn_mask) from SDPA recomputed on what was saved."""

    @staticmethod
    def forward(ctx, q, k, v, qs, ks, vs, attn_mask, dropout_p, is_causal, scale, enable_gqa, exact_qk):
        ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.enable_gqa = dropout_p, is_causal, scale, enable_gqa
        ctx.rng = (q.device, _rng_state(q.device)) if dropout_p > 0 else None
        ctx.mask_is_tensor = isinstance(attn_mask, torch.Tensor)
        ctx.backends = _sdpa_backends()
        mask = attn_mask.detach() if ctx.mask_is_tensor else None
        # Run SDPA with grad mode and requires_grad as the caller had them: torch picks its
        # kernel from them (e.g. flash vs. memory-efficient on some GPUs), so the output is
        # the caller's bit for bit. The throw-away graph keeps nothing past this call.
        with torch.enable_grad(), _no_saved_tensor_hooks(), _Bypass():
            out = _SDPA(
                _leaf(q, q.requires_grad), _leaf(k, k.requires_grad), _leaf(v, v.requires_grad),
                attn_mask=_leaf(attn_mask, attn_mask.requires_grad) if ctx.mask_is_tensor else attn_mask,
                dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )
        if exact_qk:
            qs, ks = qs.detach(), ks.detach()
        ctx.save_for_backward(qs, ks, vs, mask)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # a backward with create_graph=True
            raise RuntimeError(_DOUBLE_BACKWARD)
        qs, ks, vs, mask = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask_grad = ctx.mask_is_tensor and need[6] and mask.is_floating_point()
        with torch.enable_grad(), _no_saved_tensor_hooks(), _Bypass(), _backends_as(ctx.backends):
            q, k, v = _leaf(qs, need[3]), _leaf(ks, need[4]), _leaf(vs, need[5])
            m = _leaf(mask, True) if mask_grad else mask
            if ctx.rng is not None:
                device, state = ctx.rng
                current = _rng_state(device)
                _set_rng_state(device, state)
            try:
                out = _SDPA(q, k, v, attn_mask=m, dropout_p=ctx.dropout_p, is_causal=ctx.is_causal,
                            scale=ctx.scale, enable_gqa=ctx.enable_gqa)
            finally:
                if ctx.rng is not None:
                    _set_rng_state(device, current)
            inputs = [t for t, n in ((q, need[3]), (k, need[4]), (v, need[5]), (m, mask_grad)) if n]
            grads = iter(torch.autograd.grad(out, inputs, grad_out) if inputs else ())
        gq = next(grads) if need[3] else None
        gk = next(grads) if need[4] else None
        gv = next(grads) if need[5] else None
        gm = next(grads) if mask_grad else None
        return None, None, None, gq, gk, gv, gm, None, None, None, None, None


def _dense(t: torch.Tensor) -> bool:
    from fewbit.quant.compressor import _dense_non_overlapping

    return _dense_non_overlapping(t)


def _saved_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy (in the graph) if ``t`` is a strided view that requires
    grad: compressors take dense tensors only, and a kept view would also keep its base
    (e.g. the whole fused qkv projection) alive."""
    if t.requires_grad and not _dense(t):
        from fewbit.quant.compressor import _is_parameter

        if not _is_parameter(t):
            return t.contiguous()
    return t


# This backward differentiates an attention recomputed from detached copies: a graph of it
# would not reach the caller's q, k and v, so the second-order terms would be dropped (with
# torch's once_differentiable, silently: a gradient penalty through it was off by 0.38 of
# its norm even with nothing quantized).
_DOUBLE_BACKWARD = (
    "fewbit: a backward with create_graph=True (a gradient penalty, a Hessian-vector product, MAML) "
    "reached scaled_dot_product_attention under fewbit's compression, whose backward recomputes the "
    "attention from its saved copies and has no second derivative. " + KEEP_EXACT_ADVICE
)


#: Bits per element of the saved q and k under a compressor of fewer bits; under an 8-bit
#: compressor they are kept as they are (see the module docstring for the measurements).
#: Their groups lie inside one head channel's run of tokens (``(..., head_dim, T)`` order;
#: :meth:`fewbit.quant.ActivationCompressor._compress`): ``32 / min(T, group_size)`` bits
#: per element of statistics on top, 0.125 from 256 tokens on.
QK_BITS = 8


class _PackAt:
    """Saved-tensor hooks around one ``apply``: ``tensors`` go to the hooks below (the
    compressor, or a recorder wrapping it) with ``comp.compressor`` set to the group
    quantizer at ``bits`` (other settings of the compressor's own, if it has them)."""

    def __init__(self, comp, tensors, bits: int) -> None:
        self.comp, self.tensors, self.bits = comp, tensors, bits
        self.ctx = None

    def _pack(self, t):
        if not any(t is u for u in self.tensors):
            return self.inner[0](t)
        from fewbit.quant.compressors import GroupQuantizer

        old = self.comp.compressor
        self.comp.compressor = GroupQuantizer(
            self.bits, group_size=getattr(old, "group_size", 256), stochastic=getattr(old, "stochastic", True),
            stats_dtype=getattr(old, "stats_dtype", torch.bfloat16),
        )
        try:
            return self.inner[0](t)
        finally:
            self.comp.compressor = old

    def __enter__(self):
        self.inner = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self.inner is not None:
            self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self.inner[1])
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        # torch keeps the hooks (this bound ``_pack``) with each saved variable for the graph's
        # life: holding q and k here kept them exact beside their 8-bit copies until backward
        # (GPT-2 at 4 bits: 2 MiB per layer that the memory report did not see)
        self.tensors = ()


def _active_compressor():
    """The compressor of the innermost active :class:`~fewbit.quant.mode.CompressionMode`,
    or None."""
    from torch.overrides import _get_current_function_mode_stack

    from fewbit.quant.mode import CompressionMode

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CompressionMode):
            return mode.compressor
    return None


#: The dtypes autocast casts (float64 and others are left as they are).
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_args(query, key, value, attn_mask):
    """``query, key, value, attn_mask`` as autocast would hand them to SDPA (one of its
    lower-precision ops): cast to the autocast dtype when autocast is on for their device.
    The backward recomputes SDPA outside autocast, so it must see the dtypes the forward
    computed in (LLaMA under CPU bf16 autocast: fp32 q and k from the rotary step, bf16 v)."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        return t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE and t.dtype != dtype else t

    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = cast(attn_mask)
    return cast(query), cast(key), cast(value), attn_mask


def _apply(comp, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    query, key, value, attn_mask = _autocast_args(query, key, value, attn_mask)
    qs, ks, vs = _saved_copy(query), _saved_copy(key), _saved_copy(value)
    args = (query, key, value, qs, ks, vs, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # this Function's saves are q, k, v for a backward that recomputes from them: compressed
    # also when it is called directly (outside a call the mode sees, where a custom
    # Function's saves are kept exact)
    with compress_custom_saves():
        if comp is None:
            return _RecomputedSDPA.apply(*args, False)
        if comp.compressor.name == "keep" or getattr(comp.compressor, "bits", 0) >= QK_BITS:
            return _RecomputedSDPA.apply(*args, True)
        with _PackAt(comp, (qs, ks), QK_BITS):
            return _RecomputedSDPA.apply(*args, False)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` that saves only q, k, v.

    Same arguments, shapes, dtypes, output (bit for bit: torch's SDPA computes it) and
    errors as torch's function. Backward recomputes SDPA from the saved (possibly
    dequantized) ``q, k, v`` and the saved ``attn_mask``, replaying the dropout draws, so
    that the attention matrix backward uses is the softmax of the logits it is
    differentiated at (see the module docstring for why, and the measured errors). Without
    saved-tensor compression the gradient equals torch's up to floating-point rounding.

    Inside an active :class:`~fewbit.quant.ActivationCompressor` of ``bits < 8``, ``q`` and
    ``k`` are saved at :data:`QK_BITS` (8) bits per element and ``v`` at ``bits``; under an
    8-bit compressor ``q`` and ``k`` are kept as they are. Elsewhere the active saved-tensor
    hooks (if any) decide.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)`` (``(..., H_kv, S, E)`` with ``enable_gqa``).
        value: ``(..., S, Ev)``.
        attn_mask: bool (True = attend) or float (added to the logits), broadcastable to
            ``(..., L, S)``; saved exact (never quantized). A float mask that requires grad
            gets its gradient.
        dropout_p: dropout probability on the attention weights.
        is_causal: upper-left causal mask (not together with ``attn_mask``).
        scale: logit scale, default ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention (key/value with fewer heads).

    Returns:
        ``(..., L, Ev)``, the dtype of ``query``.

    Memory kept for backward: ``q, k, v`` as above (strided views that require grad are
    saved as dense copies, so that the compressor can take them and their base is not
    kept alive), the mask, and for ``dropout_p > 0`` one generator state (CPU: about
    5 KB; CUDA: 16 bytes).
    """
    return _apply(_active_compressor(), query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bind(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    if len(args) > len(_SDPA_ARGS):
        return None
    bound = dict(zip(_SDPA_ARGS, args))
    for name, value in kwargs.items():
        if name not in _SDPA_ARGS or name in bound:
            return None  # let torch raise its own error
        bound[name] = value
    if not all(n in bound for n in _SDPA_ARGS[:3]):
        return None
    return bound


def _plain(t: Any) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_nested
        and t.is_floating_point()
        and t.device.type != "meta"
    )


def reroute(mode, func, types, args: tuple, kwargs: dict) -> Any:
    """The SDPA part of :class:`~fewbit.quant.mode.CompressionMode` (grad enabled, not
    compiling): a call of ``F.scaled_dot_product_attention`` goes to
    :func:`scaled_dot_product_attention` when ``query, key, value`` are plain strided
    floating tensors, and at least one of them requires grad, is not a parameter and has at
    least ``compressor.min_numel`` elements (so the compressor will quantize it);
    ``F.multi_head_attention_forward`` is re-entered with ``mode`` active so that the SDPA
    call inside it is seen too. Returns :data:`~fewbit.quant.nonlinear.NOT_HANDLED` for
    other calls."""
    if func is _SDPA and not getattr(_STATE, "bypass", False):
        bound = _bind(args, kwargs)
        if bound is not None:
            qkv = (bound["query"], bound["key"], bound["value"])
            mask = bound.get("attn_mask")
            if (
                all(_plain(t) for t in qkv)
                and (mask is None or type(mask) in (torch.Tensor, torch.nn.Parameter))
                and any(_compressible(mode.compressor, t) for t in qkv)
            ):
                full = dict(zip(_SDPA_ARGS, (None, None, None, None, 0.0, False, None, False)))
                full.update(bound)
                return _apply(mode.compressor, *(full[n] for n in _SDPA_ARGS))
    elif func is _MHA_FORWARD and _redispatch is not None:
        # A Python function that dispatches __torch_function__ itself: run its body
        # with the mode on again, or the SDPA call inside would not be seen.
        with mode:
            return _redispatch(func, types, args, kwargs)
    return NOT_HANDLED


def _compressible(comp, t: torch.Tensor) -> bool:
    from fewbit.quant.compressor import _is_parameter

    return t.requires_grad and t.numel() >= max(comp.min_numel, 1) and not _is_parameter(t)
