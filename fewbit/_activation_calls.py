"""torch's functional activations, as calls :mod:`fewbit.functional` can take over.

A model converted by :func:`fewbit.convert_` has its activation *modules* replaced; an
activation written as a function call inside a forward (``F.gelu(h)``, ``h.relu()``,
``torch.relu_(h)``) is not a module, and is reached only while the call is made, by a torch
function mode (:class:`ActivationMode`). This module is the one table of those calls:
which torch callables are which :mod:`fewbit.functional` function, and how their
arguments bind. :mod:`fewbit.quant.nonlinear` uses its stepwise part.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fewbit._interrupted import finished, leave_mode
from fewbit._saved import under_checkpoint
from fewbit.activations import checked_params
from fewbit.ops._pointwise import _compiling_or_recording

__all__ = ["ARGS", "STEPWISE_NAMES", "CALLS", "SIGNATURES", "Signature", "bind", "plain_input", "run", "ActivationMode"]

#: fewbit.functional name -> torch's argument names after ``input``, in torch's order.
ARGS: dict[str, tuple[str, ...]] = {
    # stepwise: exact from a 1-bit code, whatever the bits
    "relu": ("inplace",),
    "relu6": ("inplace",),
    "leaky_relu": ("negative_slope", "inplace"),
    "hardtanh": ("min_val", "max_val", "inplace"),
    "threshold": ("threshold", "value", "inplace"),
    "hardshrink": ("lambd",),
    "softshrink": ("lambd",),
    "hardsigmoid": ("inplace",),
    # smooth: a fitted table of ``bits`` bits. Only names used as activations and nothing
    # else: ``sigmoid``/``tanh`` (gates, soft-capping), ``softplus``/``logsigmoid`` (losses)
    # are left to torch.
    "gelu": ("approximate",),
    "silu": ("inplace",),
    "mish": ("inplace",),
    "elu": ("alpha", "inplace"),
    "celu": ("alpha", "inplace"),
    "selu": ("inplace",),
    "hardswish": ("inplace",),
}

#: The stepwise names of :data:`ARGS`.
STEPWISE_NAMES = frozenset({"relu", "relu6", "leaky_relu", "hardtanh", "threshold", "hardshrink", "softshrink",
                            "hardsigmoid"})


@dataclass(frozen=True)
class Signature:
    """How one torch callable takes its arguments after ``input``: positional-or-keyword
    names in order, keyword-only names, and ``fixed``: torch's arguments that
    :mod:`fewbit.functional` does not have (``elu``'s ``scale``, ``input_scale``), taken over
    only at these values."""

    positional: tuple[str, ...]
    keyword_only: tuple[str, ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()


def _signature(f: Callable, name: str, aten_name: str) -> Signature:
    """``f``'s own signature: a Python function's (``F.elu(input, alpha, inplace)``), else
    its aten schema's (``torch._C._nn.elu(self, alpha, scale, input_scale)``, ``F.gelu``'s
    keyword-only ``approximate``)."""
    try:
        params = list(inspect.signature(f).parameters.values())[1:]
    except (TypeError, ValueError):  # a builtin: its aten operator's schema
        args = getattr(torch.ops.aten, aten_name).default._schema.arguments[1:]
        positional = tuple(a.name for a in args if not a.kwarg_only)
        keyword_only = tuple(a.name for a in args if a.kwarg_only)
        fixed = tuple((a.name, a.default_value) for a in args if a.name not in ARGS[name])
        return Signature(positional, keyword_only, fixed)
    return Signature(tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
                     tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY))


def _calls() -> tuple[dict[Callable, tuple[str, bool]], dict[Callable, Signature]]:
    out: dict[Callable, tuple[str, bool]] = {}
    signatures: dict[Callable, Signature] = {}
    for name in ARGS:
        for owner in (F, torch, torch.Tensor, torch._C._nn):
            for suffix in ("", "_"):
                f = getattr(owner, name + suffix, None)
                if callable(f) and f not in out:
                    out[f] = (name, suffix == "_")
                    signatures[f] = _signature(f, name, name + suffix)
    return out, signatures


#: torch callables (functions, tensor methods, in-place forms) -> (fewbit.functional name,
#: whether the callable itself is the in-place form).
CALLS: dict[Callable, tuple[str, bool]]
#: torch callables -> how each takes its arguments (:class:`Signature`).
SIGNATURES: dict[Callable, Signature]
CALLS, SIGNATURES = _calls()


def bind(func: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Keyword arguments of ``fewbit.functional.<name>`` for a call ``func(*args, **kwargs)``
    of a callable of :data:`CALLS`, bound by ``func``'s own signature, or None where they do
    not bind or torch's own behaviour differs (torch then runs the call and raises its own
    error, if any): an argument ``func`` does not take (``inplace`` of ``torch.relu``), a
    keyword-only one given by position, an argument fewbit.functional has not at a value
    other than torch's default (``torch._C._nn.elu``'s ``scale``)."""
    name, inplace_fn = CALLS[func]
    signature = SIGNATURES[func]
    names = ("input",) + signature.positional
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if (k not in names and k not in signature.keyword_only) or k in bound:
            return None
        bound[k] = v
    if "input" not in bound:
        return None
    for k, default in signature.fixed:
        if k in bound:
            v = bound.pop(k)
            if type(v) not in (int, float) or v != default:
                return None
    if inplace_fn:
        if "inplace" in bound or "inplace" not in ARGS[name]:
            return None  # no in-place form in fewbit.functional
        bound["inplace"] = True
    if not _accepted(name, bound):
        return None  # torch's own behaviour (its result, or its own error)
    return bound


#: (name, parameters) -> whether fewbit.functional takes them (plain numbers only)
_ACCEPTED: dict[tuple, bool] = {}


def _accepted(name: str, bound: dict[str, Any]) -> bool:
    """Whether ``fewbit.functional.<name>`` takes the parameters of a bound call: a value
    torch takes but fewbit refuses (a non-finite ``negative_slope`` or ``threshold``,
    ``hardshrink``'s negative ``lambd``, ``celu``'s ``alpha <= 0``, a degenerate
    ``hardtanh`` range, ``gelu``'s unknown ``approximate``) leaves the call to torch."""
    if name == "gelu":
        return bound.get("approximate", "none") in ("none", "tanh")
    params = {k: v for k, v in bound.items() if k not in ("input", "inplace")}
    if not params:
        return True
    plain = all(type(v) in (int, float, bool) for v in params.values())
    key = (name, tuple(params.items())) if plain else None
    hit = _ACCEPTED.get(key) if plain else None
    if hit is None:
        try:
            checked_params(name, params)
            hit = True
        except (TypeError, ValueError):
            hit = False
        if plain:
            _ACCEPTED[key] = hit
    return hit


def plain_input(x: Any, min_numel: int = 1) -> bool:
    """Whether ``x`` is an input fewbit.functional takes over: a plain strided floating
    tensor that requires grad, with at least ``min_numel`` elements."""
    return (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.requires_grad
        and x.is_floating_point()
        and x.layout == torch.strided
        and x.numel() >= max(min_numel, 1)
    )


def run(name: str, bound: dict, bits: int) -> torch.Tensor:
    """``fewbit.functional.<name>(**bound, bits=bits)`` (stepwise names at 1 bit)."""
    import fewbit.functional as FF

    return getattr(FF, name)(**bound, bits=1 if name in STEPWISE_NAMES else bits)


class ActivationMode(TorchFunctionMode):
    """Runs the functional activations of :data:`CALLS` as :mod:`fewbit.functional`'s
    few-bit functions: the same output bit for bit, ``bits`` bits per element kept for
    backward (stepwise ones: exact from 1 bit) instead of their input or result.

    :func:`fewbit.convert_` pushes it for the whole forward of a converted model
    (``Config.activation_bits``). Calls without grad, on inputs that do not require grad,
    tensor subclasses, every call while ``torch.compile`` traces, and calls inside a
    non-reentrant ``torch.utils.checkpoint`` (its recomputation in backward runs outside
    this mode, so it would save torch's tensors where the forward saved codes: torch's
    "different number of tensors" error; the checkpoint drops what they save anyway) go to
    torch unchanged.

    Args:
        bits: bits per element for the smooth activations, 1..8.
    """

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.bits = bits
        #: calls of :data:`CALLS` seen (taken over or not)
        self.hits = 0
        #: the module call that pushed it (fewbit.convert_'s hook), its thread; ``left_over``:
        #: by a forward a KeyboardInterrupt stopped (fewbit._interrupted.leave_mode)
        self.frame = None
        self.thread = None
        self.left_over = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = CALLS.get(func)
        if hit is None or self.left_over or _compiling_or_recording() or not torch.is_grad_enabled() or under_checkpoint():
            return func(*args, **kwargs)
        if self.frame is not None and finished(self.frame):
            leave_mode(self)  # torch has it stashed now: the next sweep takes it off the stack
            return func(*args, **kwargs)
        self.hits += 1
        bound = bind(func, args, kwargs)
        if bound is None or not plain_input(bound["input"]):
            return func(*args, **kwargs)
        return run(hit[0], bound, self.bits)
