"""The torch function mode an active compressor pushes (docs/compression.md §1).

Saved-tensor hooks see what is saved, not which op saves it. Some ops need more than an
unbiased quantizer of what they save: fused attention rebuilds softmax from an exact
logsumexp (:mod:`fewbit.quant.attention`), and ops whose backward is not linear in what
they save turn the quantization variance into a bias (:mod:`fewbit.quant.nonlinear`).
:class:`CompressionMode` sees every torch function call made while the compressor is active
and hands those calls to the module that handles them.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch.overrides import TorchFunctionMode

from fewbit._saved import under_checkpoint
from fewbit.quant import attention, nonlinear

__all__ = ["CompressionMode"]

#: Serial numbers of the calls the mode sees (one per call; ``next`` is atomic under the GIL).
_SERIAL = itertools.count()

# Every callable some module here handles: one set lookup per call for all the others.
_ROUTED = frozenset(attention.ROUTED) | frozenset(nonlinear.STEPWISE) | frozenset(nonlinear.KEEP) | frozenset(
    nonlinear.NORMS)


# runs a Python function that dispatches __torch_function__ itself past that dispatch (its
# body), once; None where torch has no such primitive (fewbit.quant.attention, one home)
_redispatch = attention._redispatch

#: Argument types whose composites are re-entered (a tensor subclass overriding, say,
#: ``F.dropout`` must get that call, which the redispatch would skip).
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: Types of the aten ops that ``torch.ops.aten.NAME`` (and ``.default``) calls pass the mode.
_ATEN_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)

#: Modules of torch's Python composites: functions that dispatch __torch_function__ at their
#: top, then call other torch functions.
_COMPOSITE_MODULES = frozenset({"torch.nn.functional", "torch.functional"})
_composites: dict = {}


def _is_composite(func) -> bool:
    """Whether ``func`` is one of torch's Python composites (a plain Python function of
    :data:`_COMPOSITE_MODULES`), whose body the mode should see (cached per callable)."""
    known = _composites.get(func)
    if known is None:
        known = (_redispatch is not None and isinstance(func, types.FunctionType)
                 and getattr(func, "__module__", None) in _COMPOSITE_MODULES)
        try:
            _composites[func] = known
        except TypeError:  # unhashable
            pass
    return known


class CompressionMode(TorchFunctionMode):
    """Reroutes the calls of :mod:`fewbit.quant.attention` (``F.scaled_dot_product_attention``)
    and :mod:`fewbit.quant.nonlinear` (stepwise activations, ops whose backward is not
    linear in what they save, normalization functions) while a compressor is active.

    Pushed by :class:`~fewbit.quant.ActivationCompressor` (its outermost ``with``). Calls
    without grad, every call while ``torch.compile`` traces (a compiled graph saves its
    own tensors, which the compressor keeps exact) and every call inside a
    ``torch.utils.checkpoint`` (:func:`fewbit._saved.under_checkpoint`), go to torch
    unchanged.

    Args:
        compressor: the :class:`~fewbit.quant.ActivationCompressor` that pushes the mode.
    """

    def __init__(self, compressor) -> None:
        super().__init__()
        self.compressor = compressor
        self._local = compressor._local
        self.left_over = False  # its compressor left an interrupted forward's block (fewbit._interrupted)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or self.left_over:
            # a compiled graph keeps torch's calls (and no serial to guard on); a mode whose
            # compressor left the block an interrupted forward had left open (fewbit._interrupted)
            return func(*args, **kwargs)
        # the call's arguments and serial, for the compressor's pack hook: a copy of a tensor
        # is shared with this call's save only if its other arguments do not depend on that
        # tensor and the copy was not made by this same call
        local = self._local
        outer = getattr(local, "call", None)
        local.call = (args, kwargs, next(_SERIAL), func)
        try:
            if not torch.is_grad_enabled() or under_checkpoint():
                # inside a checkpoint (its hooks innermost) what is saved is the checkpoint's:
                # torch's calls, alike in the forward and the recomputation
                return func(*args, **kwargs)
            if func not in _ROUTED:
                if isinstance(func, _ATEN_OPS):
                    # torch.ops.aten.gelu(x): not the Python names the tables list
                    out = nonlinear.reroute_aten(self.compressor, func, args, kwargs)
                    return func(*args, **kwargs) if out is nonlinear.NOT_HANDLED else out
                if _is_composite(func) and all(t in _PLAIN for t in types):  # a subclass's override runs as before
                    # torch's Python composites run their body with the mode off: re-entered
                    # with it on, so that the calls inside are seen (F.lp_pool1d's abs,
                    # relu and pow(1 / p) were quantized: the input gradient off by 2.8x
                    # its norm at 4 bits; F.local_response_norm's pow(beta) and division)
                    with self:
                        return _redispatch(func, types, args, kwargs)
                return func(*args, **kwargs)
            out = attention.reroute(self, func, types, args, kwargs)
            if out is nonlinear.NOT_HANDLED:
                out = nonlinear.reroute(self.compressor, func, args, kwargs)
                if out is nonlinear.NOT_HANDLED:
                    return func(*args, **kwargs)
            return out
        finally:
            local.call = outer
