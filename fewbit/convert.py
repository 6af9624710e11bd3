"""Convert a model in place: few-bit activations and compressed saved tensors.

:func:`convert_` (torchao ``quantize_`` style: an in-place verb, a frozen
:class:`Config`, ``filter_fn(module, fqn)``) does three things:

1. **Activations** (``config.activation_bits``): every ``torch.nn`` activation module
   that fewbit supports is replaced by its :mod:`fewbit.modules` twin with the same
   parameters (LeakyReLU slope, ELU alpha, Softplus beta/threshold, Hardtanh bounds,
   ``inplace``, ``approximate``), and so are the Hugging Face ``transformers``
   activation classes whose forward is mathematically one of fewbit's functions
   (table below). Backward then keeps a ``bits``-bit code per element instead of the
   input (Novikov et al., "Few-bit Backward", ICML 2023). Stepwise functions (ReLU,
   LeakyReLU, ...) always use their exact 1-bit table.
2. **Other layers' saved tensors** (``config.saved_bits``): the forward of every module
   of the selected kinds (``linear``, ``conv``, ``norm``, ``attention``) runs inside ONE
   shared :class:`fewbit.quant.ActivationCompressor` per converted model (entered in a
   forward pre-hook, left in a forward hook with ``always_call=True``), so what those
   layers save for backward is group-quantized to ``saved_bits`` bits per element
   (Chen et al., "ActNN", ICML 2021; docs/method.md §7) and a tensor saved by several layers
   is compressed once. Everything executed inside such a module is covered, including
   its submodules (e.g. the projections inside an ``...Attention`` module).
3. **Activations called as functions** (``config.activation_bits``, when ``filter_fn``
   accepts the root ``""``): ``F.gelu(h)``, ``h.relu()``, ``torch.relu_(h)``,
   ``F.silu``, ``F.mish``, ``F.elu``/``celu``/``selu``, ``F.hardswish`` and the stepwise
   functions, called anywhere in the model's forward, run as :mod:`fewbit.functional`'s:
   the same output bit for bit, ``activation_bits`` bits per element kept (stepwise: exact
   from 1 bit). A torch function mode pushed for the forward
   (:class:`fewbit._activation_calls.ActivationMode`) does it; ``sigmoid``, ``tanh``,
   ``softplus`` and ``logsigmoid`` are left to torch (gates, soft-capping and losses use
   them). The mode costs about 3 µs of Python per torch call in the forward, so a forward
   that calls no such function turns it off, and it looks again at forwards 2, 4, 8, ...
   (up to every 1024th). Under ``torch.compile`` the compiled graph keeps torch's calls.

Hugging Face classes replaced (``transformers.activations``, 4.40 to 5.x). Each is replaced
by a fewbit module that computes the very same expression, so forward outputs (and a
converted model's logits) are bit-identical; backward uses the fitted table of the
function the expression computes (:data:`fewbit.activations.FORMULAS`):

========================================  =========================================  =================
class                                     fewbit module (forward = HF's own)         table
========================================  =========================================  =================
``GELUActivation``                        ``GELU()`` (``F.gelu``)                    ``gelu``
``GELUActivation(use_gelu_python=True)``  ``FormulaActivation('gelu_python')``       ``gelu``
``GELUTanh`` / ``PytorchGELUTanh``        ``GELU('tanh')`` (``F.gelu``)              ``gelu_tanh``
``GELUTanh(use_gelu_tanh_python=True)``   ``FormulaActivation('gelu_python_tanh')``  ``gelu_tanh``
``NewGELUActivation``                     ``FormulaActivation('gelu_new')``          ``gelu_tanh``
``AccurateGELUActivation``                ``FormulaActivation('gelu_accurate')``     ``gelu_tanh``
``FastGELUActivation``                    ``FormulaActivation('gelu_fast')``         ``gelu_tanh`` (*)
``QuickGELUActivation``                   ``QuickGELU()``                            ``quick_gelu``
``SiLUActivation``                        ``SiLU()`` (``F.silu``)                    ``silu``
``MishActivation``                        ``Mish()`` (``F.mish``)                    ``mish``
``BloomGelu`` (BLOOM)                     ``FormulaActivation('bloom_gelu')``        ``gelu_tanh`` (*)
========================================  =========================================  =================

(*) FastGELU's constant 0.7978845608 and BLOOM's 0.79788456 are not quite sqrt(2/pi):
their derivatives are within 1.1e-12 and 3.1e-10 of gelu_tanh's. The others compute
exactly the table's function.

An HF module is recognised by its class and by what it computes: one whose ``act`` is not
one of the above (``AccurateGELUActivation`` with another ``precomputed_constant``, an
instance whose ``forward`` was replaced, e.g. by a hub kernel) is left alone and listed.

Not replaced, and listed in :attr:`ConversionSummary.unsupported` (their forward runs as it
is, so the torch activation functions it calls, ``F.gelu`` inside ``nn.GELU`` at the root
or HF's ``ClippedGELUActivation``, are taken over by item 3 like any call of the model's):
activations that are not
one of fewbit's pointwise functions or have learnable/random parameters (``PReLU``,
``RReLU``, ``GLU``, ``Softmax``/``LogSoftmax``/``Softmin``/``Softmax2d``, HF
``ClippedGELUActivation``, ``LaplaceActivation``, ``ReLUSquaredActivation``,
``SqrtSoftplusActivation``, ``XIELUActivation``), the root module itself if it is an
activation (it cannot be replaced in place), TorchScript submodules (compiled: nothing in
them can be replaced), and activation calls that are nodes of a ``torch.fx`` graph
(``torch.export(...).module()``, ``symbolic_trace`` of ``F.gelu(x)``; the latter are
taken over at run time by item 3, the former are ``aten`` ops and stay torch's).

What can be converted and what cannot:

- eager modules, ``torch.fx.GraphModule`` (its ``call_module`` activations), models inside
  ``nn.DataParallel`` / ``DistributedDataParallel`` and ``torch.compile`` wrappers
  (``OptimizedModule``: the wrapped model is converted in place and torch.compile
  recompiles it on the next call; fqns start with ``_orig_mod.``). With saved-tensor
  compression (``saved_bits``), ``nn.DataParallel``'s threads would share one compressor:
  its forward raises ``RuntimeError`` (use ``DistributedDataParallel``);
- a TorchScript model (``torch.jit.script`` / ``torch.jit.trace``) cannot: ``TypeError``.

Converting twice applies the new settings: fewbit modules already there get the new
``activation_bits`` (listed in :attr:`ConversionSummary.changed`; stepwise ones stay
exact at 1 bit), nothing is wrapped twice, and the compression hooks of an earlier
conversion are removed before new ones are registered.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fewbit import _norm_rows
from fewbit import modules as fm
from fewbit._checks import (
    check_average_bits, check_bits, check_bool, check_group_size, check_noise_norm, check_positive_int,
)
from fewbit._interrupted import caller_frame, finished, leave_mode, sweep_modes
from fewbit._saved import under_users_checkpoint
from fewbit.activations import ACTIVATIONS, get_activation
from fewbit.losses import _PATCH_ATTR, fused_loss_refusal
from fewbit.ops._pointwise import _compiling_or_recording, _transforms_active

__all__ = ["Config", "ConversionSummary", "convert_", "LAYER_KINDS", "layer_kind"]

#: Kinds of layers whose saved tensors :func:`convert_` can compress (:func:`layer_kind`;
#: ``block``: the model's repeated blocks, :func:`fewbit.planner.find_blocks`).
LAYER_KINDS: tuple[str, ...] = ("linear", "conv", "norm", "attention", "block")

#: ``Config.compressor`` values (docs/compression.md §1-§4).
COMPRESSOR_CHOICES: tuple[str, ...] = ("group", "division", "adacc")


@dataclass(frozen=True)
class Config:
    """What :func:`convert_` does.

    Args:
        activation_bits: bits per element kept by few-bit activations, 1..8, or ``None``
            to leave activations as they are (modules and calls an earlier conversion
            made few-bit stay so, at their bits). Stepwise functions always use 1 (exact).
        saved_bits: bits per element for the tensors saved by layers of kind ``layers``
            (group quantizer, docs/method.md §7), one of 1, 2, 4, 8; ``None`` (default)
            compresses nothing.
        group_size: elements per quantization group (>= 1); stats overhead is
            ``32 / group_size`` bits per element (bf16 min and scale).
        layers: kinds of layers whose saved tensors are compressed, from
            ``("linear", "conv", "norm", "attention", "block")``; ``"all"`` (or a tuple
            holding it) selects every kind. A single string is accepted. ``"block"``: the
            model's repeated blocks (a transformer's layers; :func:`fewbit.planner.find_blocks`)
            with everything saved inside them, also by code outside the other kinds (a gated
            MLP's product ``act(gate(x)) * up(x)``, mixture-of-experts layers, dropout masks).
        min_numel: saved tensors with fewer elements are kept as they are (>= 0).
        stochastic: unbiased stochastic rounding (True) or nearest rounding (False, with
            ``compressor="group"`` and fixed ``saved_bits`` only: DIVISION and Adacc round
            stochastically, GACT measures sensitivities from the rounding noise).
        average_bits: with ``saved_bits="auto"`` (required then, refused otherwise): the
            GACT budget, bits per element averaged over the tensors GACT plans, a number
            in [1, 32] (:class:`fewbit.quant.gact.GACTPolicy`; docs/compression.md §2).
            Attention's q and k, results saved for a nonlinear backward (softmax, tanh,
            sigmoid) and the inputs of torch's per-sample norm functions are not planned:
            8 bits each, on top of the budget (a 2-layer GPT-2 at ``average_bits=2``: 3.7
            bits per element over all compressed tensors).
            ``saved_bits="auto"`` gives each saved tensor 1, 2, 4, 8 bits or keeps it, by
            gradient sensitivity, re-planned by ``summary.compressor.adapt(model, closure, optimizer)``.
        compressor: how saved tensors are compressed (docs/compression.md): ``"group"``
            (ActNN group quantizer, default), ``"division"`` (DIVISION: exact block means +
            ``saved_bits``-bit residual; 1-D tensors get the group quantizer at
            ``saved_bits``) or ``"adacc"`` (Adacc's layer-specific choice:
            outlier-separated for linear/norm inputs, channel-wise for q/k/v, softmax for
            attention probabilities; the input of torch's norm functions at 8 bits whatever
            the compressor, as for the others; :class:`fewbit.quant.policies.AdaccPolicy`; saved_bits
            2, 4 or 8). With ``saved_bits="auto"`` only ``"group"``; with ``saved_bits=None``
            (nothing compressed) only the default.
        adapt_interval: ``saved_bits="auto"`` (another value is refused otherwise): the
            longest gap, in steps (``adapt`` calls), between two GACT re-plans, >= 1
            (default 1000); re-plans come at calls 1, 2, 4, 8, ... until the gap reaches it.
        noise_norm: ``saved_bits="auto"`` (likewise): how GACT measures gradient noise,
            ``"relative"`` (default; each element's noise divided by the root of its
            gradient's second moment, as Adam-family optimizers divide the update: the
            optimizer's own when ``adapt`` is given it) or ``"absolute"`` (GACT's
            Euclidean norm, for SGD); :class:`fewbit.quant.gact.GACTPolicy`.
        fused_cross_entropy: compute a Hugging Face ``*ForCausalLM`` model's loss (when
            ``labels`` are passed) with the exact chunked linear + cross-entropy of
            :func:`fewbit.losses.patch_causal_lm_`, so the logits are never saved for
            backward (docs/compression.md §5). Converting again with ``False`` undoes it.
        warmup_steps: training steps (optimizer steps) compressed at ``warmup_bits`` before
            ``saved_bits`` (or GACT, whose ``adapt`` re-plans start then) take over, an
            integer >= 0; 0 (default): no warm-up. Needs ``saved_bits``. More bits early keep
            a 2-bit run off the long early loss plateau that a GPT-2 seed in twelve stayed on
            (4 bits for 100 steps: README "Training"); the run's peak memory is the
            warm-up's. Steps are counted by :class:`fewbit.quant.policies.WarmupPolicy`
            (``step()`` of a ``torch.optim`` optimizer holding the model's parameters, or of
            any where none does, after a compressed forward); a new conversion starts a new
            warm-up.
        warmup_bits: bits per element during the warm-up, more than ``saved_bits`` (with
            ``saved_bits="auto"``: more than ``average_bits``), one of 1, 2, 4, 8 (Adacc: 2,
            4, 8); default 4.
        layer_bits: bits per element for the tensors saved by some layer kinds instead of
            ``saved_bits`` (ActNN's per-layer settings), a mapping from kinds in ``layers``
            to 1, 2, 4 or 8, e.g. ``{"block": 4}``; only with ``saved_bits`` 1, 2, 4 or 8
            and ``compressor="group"``; stored as a sorted tuple of ``(kind, bits)`` pairs.
            During a warm-up a kind gets the more of ``warmup_bits`` and its own. A tensor
            saved by several modules is compressed once, at the bits of its first save's
            kind (later saves share that copy). An empty mapping is ``None``. On
            LLaMA-style models the saves of the ``block`` kind (the gated MLP's product
            ``act(gate(x)) * up(x)``) caused most of the 2-bit gap to vanilla, and
            ``{"block": 4}`` narrowed it from 0.050 to 0.017 for 10 % more memory (README
            "Training on real data");
            :class:`fewbit.quant.policies.LayerBitsPolicy`.

    Raises:
        ValueError: naming the field, for any value outside the ranges above.
    """

    activation_bits: int | None = 3
    saved_bits: int | None = None
    group_size: int = 256
    layers: tuple[str, ...] = LAYER_KINDS
    min_numel: int = 4096
    stochastic: bool = True
    average_bits: float | None = None
    compressor: str = "group"
    adapt_interval: int = 1000
    noise_norm: str = "relative"
    fused_cross_entropy: bool = False
    warmup_steps: int = 0
    warmup_bits: int = 4
    layer_bits: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.activation_bits is not None:
            object.__setattr__(self, "activation_bits", check_bits(self.activation_bits, "activation_bits"))
        if self.saved_bits == "auto":
            object.__setattr__(self, "average_bits", check_average_bits(self.average_bits, " with saved_bits='auto'"))
            if self.compressor != "group":
                raise ValueError(f"compressor must be 'group' with saved_bits='auto', got {self.compressor!r}")
        else:
            if self.saved_bits is not None:
                from fewbit.quant import SUPPORTED_BITS  # here: importing fewbit.convert stays quantizer-free

                if isinstance(self.saved_bits, str):
                    raise ValueError(f"saved_bits must be one of {SUPPORTED_BITS}, 'auto' or None, got {self.saved_bits!r}")
                object.__setattr__(self, "saved_bits", check_bits(self.saved_bits, "saved_bits", SUPPORTED_BITS))
            if self.average_bits is not None:
                raise ValueError(
                    f"average_bits is only used with saved_bits='auto', got average_bits={self.average_bits!r} "
                    f"with saved_bits={self.saved_bits!r}"
                )
            # GACT's own settings, like average_bits: a value given for nothing is a mistake
            for name in ("adapt_interval", "noise_norm"):
                if getattr(self, name) != self.__dataclass_fields__[name].default:
                    raise ValueError(f"{name} is only used with saved_bits='auto', got {name}="
                                     f"{getattr(self, name)!r} with saved_bits={self.saved_bits!r}")
            if self.saved_bits is None and self.compressor != "group":
                raise ValueError(f"compressor is only used with saved_bits set (1, 2, 4, 8 or 'auto'), got "
                                 f"compressor={self.compressor!r} with saved_bits=None")
        if self.compressor not in COMPRESSOR_CHOICES:
            raise ValueError(f"compressor must be one of {COMPRESSOR_CHOICES}, got {self.compressor!r}")
        if self.compressor == "adacc" and self.saved_bits == 1:  # its q/k/v quantizer is symmetric: 2, 4, 8
            raise ValueError("saved_bits must be one of (2, 4, 8) with compressor='adacc' (its channel-wise "
                             "quantizer of values is symmetric), got 1")
        object.__setattr__(self, "adapt_interval", check_positive_int(self.adapt_interval, "adapt_interval"))
        check_noise_norm(self.noise_norm)
        object.__setattr__(self, "group_size", check_group_size(self.group_size))
        object.__setattr__(self, "min_numel", check_positive_int(self.min_numel, "min_numel", minimum=0))
        object.__setattr__(self, "stochastic", check_bool(self.stochastic, "stochastic"))
        if not self.stochastic and self.saved_bits == "auto":
            # GACT measures each tensor's sensitivity from its rounding noise: nearest rounding
            # has none, every sensitivity came out 0 and each call re-ran its measurement
            raise ValueError("stochastic=False (nearest rounding) cannot be used with saved_bits='auto': GACT "
                             "measures each tensor's sensitivity from its stochastic rounding noise")
        if not self.stochastic and self.compressor != "group" and self.saved_bits is not None:
            # DIVISION's and Adacc's compressors round stochastically only (their residual and
            # INT4 codes are unbiased that way): the flag had been ignored
            raise ValueError(f"stochastic=False (nearest rounding) is only used with compressor='group', got "
                             f"compressor={self.compressor!r}")
        object.__setattr__(self, "fused_cross_entropy", check_bool(self.fused_cross_entropy, "fused_cross_entropy"))
        self._check_warmup()
        layers = self.layers
        if isinstance(layers, str):
            layers = (layers,)
        if not isinstance(layers, (tuple, list)):  # a dict's keys, a set's order, bytes' ints: not meant
            raise ValueError(f"layers must be a tuple of {LAYER_KINDS} or 'all', got {self.layers!r}")
        layers = tuple(layers)
        bad = [k for k in layers if k not in LAYER_KINDS and k != "all"]
        if bad:
            raise ValueError(f"layers must be chosen from {LAYER_KINDS} or 'all', got {bad!r}")
        if not layers and self.saved_bits is not None:  # compresses nothing: a value given for nothing
            raise ValueError(f"layers must name at least one of {LAYER_KINDS} or 'all' with saved_bits="
                             f"{self.saved_bits!r}, got {self.layers!r} (saved_bits=None compresses nothing)")
        if "all" in layers:
            layers = LAYER_KINDS
        else:
            layers = tuple(k for k in LAYER_KINDS if k in layers)  # canonical order, no repeats
        object.__setattr__(self, "layers", layers)
        self._check_layer_bits()

    def _check_layer_bits(self) -> None:
        given = self.layer_bits
        if given is None:
            return
        if isinstance(given, Mapping):
            items = list(given.items())
        elif isinstance(given, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in given):
            items = list(given)  # the stored form (dataclasses.replace of a Config)
        else:
            raise ValueError(f"layer_bits must be a mapping from layer kinds to bits, e.g. {{'block': 4}}, "
                             f"got {given!r}")
        if isinstance(self.saved_bits, str) or self.saved_bits is None or self.compressor != "group":
            raise ValueError(f"layer_bits is only used with saved_bits 1, 2, 4 or 8 and compressor='group', got "
                             f"layer_bits={given!r} with saved_bits={self.saved_bits!r}, "
                             f"compressor={self.compressor!r}")
        from fewbit.quant import SUPPORTED_BITS

        if not items:  # the same as none: stored as None, so the two Configs are equal
            object.__setattr__(self, "layer_bits", None)
            return
        bits = {}
        for kind, b in items:
            if kind not in self.layers:
                raise ValueError(f"layer_bits keys must be layer kinds that layers compresses, {self.layers}, "
                                 f"got {kind!r}")
            if kind in bits:
                raise ValueError(f"layer_bits names kind {kind!r} twice, got {given!r}")
            bits[kind] = check_bits(b, f"layer_bits[{kind!r}]", SUPPORTED_BITS)
        object.__setattr__(self, "layer_bits", tuple(sorted(bits.items())))

    def _check_warmup(self) -> None:
        steps = check_positive_int(self.warmup_steps, "warmup_steps", minimum=0)
        object.__setattr__(self, "warmup_steps", steps)
        if not steps:
            if self.warmup_bits != self.__dataclass_fields__["warmup_bits"].default:  # given for nothing
                raise ValueError(f"warmup_bits is only used with warmup_steps >= 1, got warmup_bits="
                                 f"{self.warmup_bits!r} with warmup_steps=0")
            return
        if self.saved_bits is None:
            raise ValueError("warmup_steps is only used with saved_bits set (1, 2, 4, 8 or 'auto'), got "
                             f"warmup_steps={steps} with saved_bits=None")
        from fewbit.quant import SUPPORTED_BITS

        allowed = (2, 4, 8) if self.compressor == "adacc" else SUPPORTED_BITS
        bits = check_bits(self.warmup_bits, "warmup_bits", allowed)
        after = self.average_bits if self.saved_bits == "auto" else self.saved_bits
        if bits <= after:
            what = "average_bits" if self.saved_bits == "auto" else "saved_bits"
            raise ValueError(f"warmup_bits must be more than {what} (a warm-up keeps more bits than the run), "
                             f"got warmup_bits={bits} with {what}={after:g}")
        object.__setattr__(self, "warmup_bits", bits)


@dataclass
class ConversionSummary:
    """What :func:`convert_` did (returned by it; the model itself is converted in place).

    Attributes:
        model: the converted model (the same object that was passed in).
        config: the :class:`Config` used.
        replaced: ``{fqn: (old class name, repr of the new module)}``.
        changed: ``{fqn: (old repr, new repr)}`` of fewbit modules already in the model
            (an earlier conversion) whose ``bits`` were set to ``activation_bits``.
        unsupported: ``{fqn: class name (and why)}`` of activation modules not replaced. Their
            forward runs as it is, so the torch activation functions it calls (``F.gelu``
            inside a root ``nn.GELU`` or HF's ``ClippedGELUActivation``) run fewbit's where
            the model's calls are converted (``functional_bits``).
        compressed: ``{fqn: kind}`` of modules whose forward runs inside the compressor.
        compressor: the shared :class:`fewbit.quant.ActivationCompressor` (its ``stats``
            count bytes before/after), or ``None`` when ``saved_bits`` is ``None``.
        fused_cross_entropy: whether the model's loss is the fused linear + cross-entropy
            (``config.fused_cross_entropy``).
        functional_bits: bits per element kept by the activations the model's forward
            calls as functions (``F.gelu(h)``, ``h.relu()``; stepwise ones exact from 1
            bit), which run as :mod:`fewbit.functional`'s (``activation_bits``), or
            ``None`` when they are left to torch (``activation_bits=None``, or ``filter_fn``
            refuses the root ``""``).
        plan: the :class:`fewbit.Plan` applied by ``convert_(model, plan)``, else ``None``.
    """

    model: nn.Module
    config: Config
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    compressed: dict[str, str] = field(default_factory=dict)
    compressor: Any = None
    fused_cross_entropy: bool = False
    functional_bits: int | None = None
    plan: Any = None

    def __str__(self) -> str:
        c = self.config
        lines = [
            f"fewbit conversion of {type(self.model).__name__}: activation_bits={c.activation_bits}, "
            f"saved_bits={c.saved_bits}",
            f"  replaced {len(self.replaced)} activation module(s):",
        ]
        lines += [f"    {fqn or '<root>'}: {old} -> {new}" for fqn, (old, new) in self.replaced.items()]
        if self.changed:
            lines.append(f"  changed {len(self.changed)} fewbit module(s) already there:")
            lines += [f"    {fqn or '<root>'}: {old} -> {new}" for fqn, (old, new) in self.changed.items()]
        if self.unsupported:
            lines.append(f"  left {len(self.unsupported)} unsupported activation(s) unreplaced:")
            lines += [f"    {fqn or '<root>'}: {name}" for fqn, name in self.unsupported.items()]
            if self.functional_bits is not None:
                # "as they were" had hidden that their forwards' calls are the model's calls
                # too: a root nn.GELU's gradient was few-bit (h72)
                lines.append("    (a listed module's Python forward still runs: the torch activation functions it "
                             "calls, F.gelu in nn.GELU, are fewbit's, below)")
        if self.functional_bits is not None:
            lines.append(f"  activations called as functions in forward (F.gelu, F.relu, ...): fewbit's at "
                         f"{self.functional_bits} bits (stepwise: exact from 1 bit)")
        if c.saved_bits is not None:
            kinds = {}
            for k in self.compressed.values():
                kinds[k] = kinds.get(k, 0) + 1
            shown = ", ".join(f"{k}={n}" for k, n in kinds.items()) or "none"
            how = (f"GACT auto bits, average {c.average_bits:g}" if c.saved_bits == "auto"
                   else f"{c.saved_bits} bits, compressor={c.compressor}")
            if c.layer_bits:
                how += " (" + ", ".join(f"{k}: {b} bits" for k, b in c.layer_bits) + ")"
            if c.warmup_steps:
                how += f" ({c.warmup_bits} bits for the first {c.warmup_steps} training steps)"
            lines.append(
                f"  compressing saved tensors of {len(self.compressed)} module(s) ({shown}) at "
                f"{how}, group_size={c.group_size}"
            )
        if self.fused_cross_entropy:
            lines.append("  loss: fused linear + cross-entropy (no saved logits)")
        if self.plan is not None:
            lines.append(str(self.plan))
        return "\n".join(lines)


# --------------------------------------------------------------------------- activations

#: A factory makes the fewbit module for ``(module, bits)``, or returns a string saying why
#: that module is left as it is.
_Factory = Callable[[nn.Module, int], "nn.Module | str"]

#: torch activations whose derivative is stepwise: exact at 1 bit whatever ``bits`` says.
_STEPWISE = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.Threshold, nn.Hardshrink, nn.Softshrink, nn.Hardsigmoid)


def _torch_factories() -> dict[type, _Factory]:
    return {
        nn.GELU: lambda m, b: fm.GELU(m.approximate, bits=b),
        nn.SiLU: lambda m, b: fm.SiLU(m.inplace, bits=b),
        nn.SELU: lambda m, b: fm.SELU(m.inplace, bits=b),
        nn.ELU: lambda m, b: fm.ELU(m.alpha, m.inplace, bits=b),
        nn.CELU: lambda m, b: fm.CELU(m.alpha, m.inplace, bits=b),
        nn.Mish: lambda m, b: fm.Mish(m.inplace, bits=b),
        nn.Softplus: lambda m, b: fm.Softplus(m.beta, m.threshold, bits=b),
        nn.Sigmoid: lambda m, b: fm.Sigmoid(bits=b),
        nn.Tanh: lambda m, b: fm.Tanh(bits=b),
        nn.LogSigmoid: lambda m, b: fm.LogSigmoid(bits=b),
        nn.Softsign: lambda m, b: fm.Softsign(bits=b),
        nn.Tanhshrink: lambda m, b: fm.Tanhshrink(bits=b),
        nn.Hardswish: lambda m, b: fm.Hardswish(m.inplace, bits=b),
        # stepwise: exact at 1 bit
        nn.ReLU: lambda m, b: fm.ReLU(m.inplace, bits=1),
        nn.LeakyReLU: lambda m, b: fm.LeakyReLU(m.negative_slope, m.inplace, bits=1),
        nn.ReLU6: lambda m, b: fm.ReLU6(m.inplace, bits=1),
        nn.Hardtanh: lambda m, b: fm.Hardtanh(m.min_val, m.max_val, m.inplace, bits=1),
        nn.Threshold: lambda m, b: fm.Threshold(m.threshold, m.value, m.inplace, bits=1),
        nn.Hardshrink: lambda m, b: fm.Hardshrink(m.lambd, bits=1),
        nn.Softshrink: lambda m, b: fm.Softshrink(m.lambd, bits=1),
        nn.Hardsigmoid: lambda m, b: fm.Hardsigmoid(m.inplace, bits=1),
    }


_TORCH_UNSUPPORTED = (
    nn.PReLU, nn.RReLU, nn.GLU, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d,
)

_HF_UNSUPPORTED = (
    "ClippedGELUActivation", "LaplaceActivation", "ReLUSquaredActivation", "SqrtSoftplusActivation",
    "XIELUActivation",
)


def _is_method(fn: Any, cls: type, name: str) -> bool:
    """Whether ``fn`` is ``cls.<name>`` bound to an instance."""
    return getattr(fn, "__func__", None) is getattr(cls, name, object())


def _formula(name: str) -> _Factory:
    return lambda m, b: fm.FormulaActivation(name, bits=b)


def _hf_gelu(m: nn.Module, b: int) -> nn.Module | str:
    """``GELUActivation``: ``act`` is ``F.gelu`` or its ``_gelu_python`` erf formula."""
    act = getattr(m, "act", None)
    if act is F.gelu:
        return fm.GELU("none", bits=b)
    if _is_method(act, type(m), "_gelu_python"):
        return fm.FormulaActivation("gelu_python", bits=b)
    return f"its act is {act!r}, neither F.gelu nor _gelu_python"


def _hf_gelu_tanh(m: nn.Module, b: int) -> nn.Module | str:
    """``GELUTanh`` (``act``: ``partial(F.gelu, approximate='tanh')`` or the Python formula)
    and 4.x ``PytorchGELUTanh`` (no ``act``; forward is ``F.gelu(input, approximate='tanh')``)."""
    if not hasattr(m, "act"):
        return fm.GELU("tanh", bits=b)
    act = m.act
    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args and act.keywords == {
        "approximate": "tanh"
    }:
        return fm.GELU("tanh", bits=b)
    if _is_method(act, type(m), "_gelu_tanh_python"):
        return fm.FormulaActivation("gelu_python_tanh", bits=b)
    return f"its act is {act!r}, neither F.gelu(approximate='tanh') nor _gelu_tanh_python"


def _hf_gelu_accurate(m: nn.Module, b: int) -> nn.Module | str:
    c = getattr(m, "precomputed_constant", None)
    if c != math.sqrt(2 / math.pi):
        return f"precomputed_constant={c!r} is not sqrt(2/pi)"
    return fm.FormulaActivation("gelu_accurate", bits=b)


def _hf_mish(m: nn.Module, b: int) -> nn.Module | str:
    act = getattr(m, "act", None)
    if act is not F.mish:
        return f"its act is {act!r}, not F.mish"
    return fm.Mish(bits=b)


def _hf_factories() -> tuple[Mapping[type, _Factory], tuple[type, ...]]:
    """Factories for transformers.activations classes, if transformers is already imported
    (a model holding such modules has imported it; fewbit never imports it itself); made
    once per set of those modules (``fewbit.memory.is_activation_module`` asks per module)."""
    return _hf_factories_of(sys.modules.get("transformers.activations"),
                            sys.modules.get("transformers.models.bloom.modeling_bloom"))


@functools.lru_cache(maxsize=8)
def _hf_factories_of(acts, bloom) -> tuple[Mapping[type, _Factory], tuple[type, ...]]:
    if acts is None:
        return types.MappingProxyType({}), ()
    out: dict[type, _Factory] = {}

    def add(name: str, factory: _Factory) -> None:
        cls = getattr(acts, name, None)
        if isinstance(cls, type):
            out[cls] = factory

    add("GELUActivation", _hf_gelu)
    add("GELUTanh", _hf_gelu_tanh)
    add("PytorchGELUTanh", _hf_gelu_tanh)  # 4.x class; in 5.x the same class as GELUTanh
    add("NewGELUActivation", _formula("gelu_new"))
    add("AccurateGELUActivation", _hf_gelu_accurate)
    add("FastGELUActivation", _formula("gelu_fast"))
    add("QuickGELUActivation", lambda m, b: fm.QuickGELU(bits=b))
    add("SiLUActivation", lambda m, b: fm.SiLU(bits=b))
    add("MishActivation", _hf_mish)
    if bloom is not None and isinstance(getattr(bloom, "BloomGelu", None), type):
        # its forward is a custom autograd Function (GeLUFunction) of the same formula
        out[bloom.BloomGelu] = _formula("bloom_gelu")
    unsupported = tuple(c for c in (getattr(acts, n, None) for n in _HF_UNSUPPORTED) if isinstance(c, type))
    return types.MappingProxyType(out), unsupported  # shared: read-only


def _set_bits(m: nn.Module, bits: int) -> str | None:
    """Give a fewbit module that an earlier conversion (or the user) put there ``bits``.

    Returns ``None`` if it now has them (changed or not), or why it cannot.
    """
    if isinstance(m, _STEPWISE):
        return None  # exact at 1 bit: more bits could not change its gradient
    if isinstance(m, fm.FewBitActivation):
        if isinstance(m.fn, str) and ":" not in m.fn and get_activation(m.fn).stepwise:
            return None
        if m.table is not None:
            if m.table.bits != bits:
                return f"its {m.table.bits}-bit table was given at construction; bits={bits} not applied"
            return None
    m.bits = bits
    return None


def _script_module_error(model: nn.Module) -> TypeError:
    return TypeError(
        f"model is a TorchScript module ({type(model).__name__}, made by torch.jit.script or "
        "torch.jit.trace): its forward is compiled, so none of its modules can be replaced. Call "
        "fewbit.convert_ on the eager model instead (fewbit modules run in eager mode and under "
        "torch.compile, not in TorchScript)"
    )


#: Names of the registry's activations as functions in fx graph nodes (torch, aten, methods).
_GRAPH_NAMES = frozenset(ACTIVATIONS) | {"log_sigmoid"}


def _graph_activation_calls(gm: nn.Module) -> list[tuple[str, str]]:
    """``(node name, target)`` of the fx nodes of ``gm`` that call a supported activation as a
    function (``F.gelu``, ``torch.ops.aten.gelu.default``, ``x.sigmoid()``)."""
    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        schema = getattr(target, "_schema", None)
        if isinstance(target, str):  # call_method: x.sigmoid()
            name, shown = target, f"Tensor.{target}"
        elif schema is not None:  # an aten op: torch.ops.aten.gelu.default
            name, shown = schema.name.split("::")[-1], str(target)
        else:  # a Python function: torch.nn.functional.gelu
            name = getattr(target, "__name__", "")
            shown = f"{getattr(target, '__module__', None) or 'torch'}.{name}"
        if name.rstrip("_") in _GRAPH_NAMES:
            found.append((node.name, shown))
    return found


#: ``selected(module, fqn) -> bool``: whether ``filter_fn`` lets :func:`convert_` touch a module.
_Selected = Callable[[nn.Module, str], bool]


def _replacement(m: nn.Module, model: nn.Module, factory: _Factory, bits: int) -> nn.Module | str:
    """The fewbit module that replaces activation ``m``, or why ``m`` stays as it is."""
    if m is model:
        return "the root module cannot be replaced in place"
    if "forward" in vars(m):
        return "its forward was replaced on the instance"
    try:
        new = factory(m, bits)
    except ValueError as exc:  # parameters torch takes and fewbit has no table for
        return f"kept as torch's: {exc}"
    if isinstance(new, nn.Module):
        # what is registered on m moves to the replacement (_carry_over): a name the
        # replacement has would drop it from the state_dict
        clash = next((n for n in (*m._parameters, *m._buffers, *m._modules) if hasattr(new, n)), None)
        if clash is not None:
            return f"it holds {clash!r}, a name its fewbit replacement uses"
    return new


#: nn.Module's per-instance hook registries that a replacement takes over.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
               # state_dict's and load_state_dict's (h72: dropped before, while the docstring
               # said the hooks carry over)
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _carry_over(old: nn.Module, new: nn.Module) -> None:
    """Give replacement ``new`` what the user set on activation ``old``: its forward,
    forward-pre, backward, ``state_dict`` and ``load_state_dict`` hooks (the same
    registries, so the handles the user holds still remove them; hooks then receive ``new``
    as the module), the parameters, buffers
    (persistent or not) and submodules registered on it (so ``state_dict()`` keys and
    ``parameters()`` are unchanged; the same tensors, not copies) and its own attributes
    (those that are neither its constructor's arguments, nor something ``new`` has, nor
    ``old``'s own bound methods)."""
    for name, p in old._parameters.items():
        if not hasattr(new, name):
            new.register_parameter(name, p)
    for name, b in old._buffers.items():
        if not hasattr(new, name):
            new.register_buffer(name, b, persistent=name not in old._non_persistent_buffers_set)
    for name, m in old._modules.items():
        if not hasattr(new, name):
            new.add_module(name, m)
    for name in _HOOK_DICTS:
        if name in vars(old):
            hooks = vars(old)[name]
            object.__setattr__(new, name, hooks)
            for hook in hooks.values():  # load_state_dict's pre-hooks hold their module weakly
                if getattr(hook, "with_module", False) and isinstance(getattr(hook, "module", None), weakref.ref):
                    hook.module = weakref.ref(new)
    if "_is_full_backward_hook" in vars(old):
        object.__setattr__(new, "_is_full_backward_hook", old._is_full_backward_hook)
    try:
        fields = set(inspect.signature(type(old).__init__).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a class without an inspectable __init__
        fields = set()
    for key, value in vars(old).items():
        if key.startswith("_") or key in fields or key == "training" or hasattr(new, key):
            continue
        if inspect.ismethod(value) and value.__self__ is old:
            # old's own method (transformers' GELUActivation sets ``self.act = self._gelu_python``):
            # it would call the replaced module, keep it alive and pickle it with the model
            continue
        object.__setattr__(new, key, value)


def _replace_activations(model: nn.Module, bits: int, selected: _Selected, summary: ConversionSummary) -> None:
    """Phase 1 of :func:`convert_`: replace the activation modules of ``model`` in place.

    Fills ``summary.replaced``, ``.changed`` (fewbit modules already there, given ``bits``)
    and ``.unsupported`` (activation modules not replaced, with the reason). A module shared
    by several parents is replaced in every parent slot, so it stays shared. Hooks and
    attributes set on a replaced module carry over (:func:`_carry_over`).
    """
    factories = _torch_factories()
    hf_factories, hf_unsupported = _hf_factories()
    factories.update(hf_factories)
    unsupported = _TORCH_UNSUPPORTED + hf_unsupported
    fx = sys.modules.get("torch.fx")
    graph_module = getattr(fx, "GraphModule", ()) if fx is not None else ()
    new_for: dict[int, nn.Module] = {}
    scripted: list[str] = []  # fqn prefixes of TorchScript submodules
    for fqn, m in list(model.named_modules()):
        if any(fqn.startswith(p) for p in scripted):
            continue
        if isinstance(m, torch.jit.ScriptModule):
            scripted.append(fqn + ".")
            if selected(m, fqn):
                summary.unsupported[fqn] = (
                    f"{getattr(m, 'original_name', type(m).__name__)} (TorchScript: compiled, nothing in "
                    "it can be replaced; convert the eager module)"
                )
            continue
        if graph_module and isinstance(m, graph_module) and selected(m, fqn):
            for node, target in _graph_activation_calls(m):
                summary.unsupported[f"{fqn}.{node}" if fqn else node] = (
                    f"{target} (a function call in a torch.fx graph, not a module; convert the eager "
                    "model before torch.export / symbolic_trace)"
                )
        if isinstance(m, (fm._FewBit, fm.FewBitActivation)):
            if selected(m, fqn):
                before = repr(m)
                why = _set_bits(m, bits)
                if why is not None:
                    summary.unsupported[fqn] = f"{type(m).__name__} ({why})"
                elif repr(m) != before:
                    summary.changed[fqn] = (before, repr(m))
            continue
        factory = factories.get(type(m))
        if factory is None:
            if isinstance(m, unsupported) and selected(m, fqn):
                summary.unsupported[fqn] = type(m).__name__
            continue
        if not selected(m, fqn):
            continue
        new = _replacement(m, model, factory, bits)
        if isinstance(new, str):
            summary.unsupported[fqn] = f"{type(m).__name__} ({new})"
            continue
        new.train(m.training)
        _carry_over(m, new)
        new_for[id(m)] = new
        summary.replaced[fqn] = (type(m).__name__, repr(new))
    if not new_for:
        return
    for fqn, m in model.named_modules(remove_duplicate=False):  # a shared module's other paths
        if id(m) in new_for and fqn not in summary.replaced:
            summary.replaced[fqn] = (type(m).__name__, repr(new_for[id(m)]))
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_for:
                parent._modules[name] = new_for[id(child)]


# --------------------------------------------------------------------------- layer kinds


def layer_kind(module: nn.Module) -> str | None:
    """The kind of ``module`` for saved-tensor compression, or ``None``.

    ``linear``: ``nn.Linear`` (and subclasses), ``nn.Bilinear``, transformers ``Conv1D``;
    ``conv``: ``nn.Conv1d/2d/3d`` and transposed convolutions;
    ``norm``: LayerNorm, BatchNorm, InstanceNorm, GroupNorm, RMSNorm, LocalResponseNorm,
    and classes whose name ends with ``LayerNorm``/``RMSNorm``/``GroupNorm``/``BatchNorm``;
    ``attention``: ``nn.MultiheadAttention`` and classes whose name ends with ``Attention``.
    fewbit's own activation modules have no kind (they save packed codes only).
    """
    cls = type(module)
    name = cls.__name__
    if isinstance(module, fm._FewBit) or isinstance(module, fm.FewBitActivation):
        return None
    if isinstance(module, (nn.Linear, nn.Bilinear)) or (
        name == "Conv1D" and cls.__module__.startswith("transformers")
    ):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    norms = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
    if hasattr(nn, "RMSNorm"):
        norms = norms + (nn.RMSNorm,)
    if isinstance(module, norms) or name.endswith(("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")):
        return "norm"
    if isinstance(module, nn.MultiheadAttention) or name.endswith("Attention"):
        return "attention"
    return None


def normalization_size(module: nn.Module, shape: tuple[int, ...]) -> int | _norm_rows.Channels | None:
    """Elements of a tensor of ``shape`` saved by norm layer ``module`` that share one
    mean/variance, a contiguous run in C order; None where the backward is linear in the
    saved input or the runs are not known.

    - ``nn.LayerNorm``, ``nn.RMSNorm``: the product of ``normalized_shape`` (when
      ``shape`` ends with it);
    - other classes whose name ends with ``LayerNorm``/``RMSNorm`` (transformers' GPT-2,
      LLaMA, ...; they normalize the last dim): ``shape[-1]``, or None where it is 1 (a
      per-row statistic such as LLaMA's ``rsqrt`` of the mean square);
    - ``nn.InstanceNorm*`` of ``(N, C, *spatial)``: one channel plane, ``prod(spatial)``
      (None in eval mode with running statistics: an affine map);
      ``nn.GroupNorm``: ``prod(shape[1:]) // num_groups``;
    - ``nn.BatchNorm*`` on batch statistics (training, or no running statistics) of
      ``(N, C, *spatial)``: one channel plane, ``prod(spatial)``. Its statistics span the
      channel's ``N`` planes, but a group that spans two channels gives the channel of
      smaller scale the other's step: on 8 channels of scales 0.1 to 10 (6x6 planes), 2-bit
      groups of 256 put one draw's input gradient ~125x its norm off and the mean of 300
      draws 9.3x; groups inside planes, 0.03x and 0.0016x (``tests/quant/test_norm_rows.py``).
      ``(N, C)`` inputs and planes under ``fewbit._norm_rows.MIN_PLANE`` (32) elements have
      no useful contiguous run per channel: :class:`fewbit._norm_rows.Channels` (the
      compressor groups the ``(C, N, *spatial)`` copy inside each channel, at the norm
      inputs' 8 bits where a channel has fewer than ``fewbit._norm_rows.MIN_CHANNEL``).
      In eval mode (running statistics) the backward is linear in the input: None.

    Used for :attr:`fewbit.quant.policies.SavedTensorInfo.norm_size`.
    """
    if not shape:
        return None
    if isinstance(module, nn.LayerNorm) or (hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm)):
        return _norm_rows.layer_norm(module.normalized_shape, shape)
    if isinstance(module, nn.GroupNorm):
        return _norm_rows.group_norm(module.num_groups, shape)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        # in eval mode with running statistics (use_input_stats=False) an affine map: None
        input_statistics = module.training or not module.track_running_stats
        return _norm_rows.instance_norm(shape) if input_statistics else None
    if isinstance(module, nn.modules.batchnorm._NormBase):
        batch_statistics = module.training or not module.track_running_stats
        return _norm_rows.batch_norm(shape) if batch_statistics else None
    if type(module).__name__.endswith(("LayerNorm", "RMSNorm")):
        # a last dim of 1 is a per-row statistic (LLaMA's rsqrt of the mean square), not a row
        return shape[-1] if shape[-1] > 1 else None
    return None


# --------------------------------------------------------------------------- compression hooks


class _RootFrames(threading.local):
    """A thread's running forwards of a converted model (:attr:`_SharedCompressor.root_frames`).
    Its list is made in ``__init__`` (which runs in each thread), so ``torch.compile``'s guards
    see it alike on every call (one made on first use had recompiled the model at its
    second call)."""

    def __init__(self) -> None:
        self.frames: list = []


class _SharedCompressor:
    """One compressor per converted model, shared by all its hooks.

    Pickling/deep-copying keeps the settings and the policy's state (GACT's plan and
    schedule: :meth:`fewbit.quant.gact.GACTPolicy.state_dict`) and creates a fresh
    compressor (its cache and statistics belong to the original model's runs).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._make()

    def _make(self) -> None:
        from fewbit.quant import ActivationCompressor

        c = self.config
        self.compressor = ActivationCompressor(min_numel=c.min_numel, policy=_policy(c))
        self.compressor._auto_step = False  # _StepHook starts a pass per forward of the model
        self.entered: dict[int, int] = {}  # id(module) -> number of open enters
        self.root_depth = 0  # forwards of the model running (_StepHook, _StepExit)
        self._root_local = _RootFrames()  # per thread: root_frames
        #: weak reference to the converted model (set at conversion, or by its first forward
        #: after a copy; :func:`_check_not_shared`)
        self.root: weakref.ref | None = None
        #: whether layer_bits has been checked for kinds that got no tensor (:meth:`check_layer_bits`)
        self.layer_bits_checked = not c.layer_bits
        #: fqns of the converted modules entered outside the model's forward in this pass
        #: (None: the next one starts a pass; the model's forward ran, or none yet)
        self.pass_fqns: set[str] | None = None

    @property
    def root_frames(self) -> list:
        """This thread's forwards of the model running: tokens of their module calls
        (fewbit._interrupted)."""
        return self._root_local.frames

    @root_frames.setter
    def root_frames(self, frames: list) -> None:
        self._root_local.frames = frames

    def sync_root(self) -> None:
        """Forget the forwards of the model that a ``KeyboardInterrupt`` stopped without
        their exit hook (their frames have finished; fewbit._interrupted)."""
        frames = self.root_frames
        live = [f for f in frames if not finished(f)]
        if len(live) != len(frames):
            self.root_frames = live
            self.root_depth = max(self.root_depth - (len(frames) - len(live)), 0)

    def check_layer_bits(self, model: nn.Module) -> None:
        """After the first forward that compressed something: warn once if a kind of
        ``layer_bits`` got no tensor (a GPT-2's blocks save nothing of their own, so
        ``layer_bits={"block": 4}`` changes nothing there)."""
        if self.compressor.stats.compressed == 0:
            return  # nothing compressed yet (evaluation, no grad): look again next time
        self.layer_bits_checked = True
        from fewbit.quant.policies import layer_bits_chosen

        chosen = layer_bits_chosen(self.compressor.policy)
        unused = [k for k, _ in self.config.layer_bits if not chosen.get(k)]
        if unused:
            warnings.warn(
                f"layer_bits for {', '.join(map(repr, unused))} changed nothing in the first compressed forward "
                f"of {type(model).__name__}: no tensor saved by a layer of that kind itself took those bits (the "
                "innermost converted module's kind decides: a LLaMA block's gated-MLP product is the block's own, "
                "a GPT-2 block saves nothing of its own; norm inputs and softmax results get 8 bits whatever the "
                "kind; tensors under min_numel stay exact)",
                stacklevel=3,
            )

    def __getstate__(self) -> dict:
        policy = self.compressor.policy
        return {"config": self.config, "policy": policy.state_dict() if hasattr(policy, "state_dict") else None}

    def __setstate__(self, state: dict) -> None:
        self.config = state["config"]
        self._make()
        if state.get("policy") is not None:
            self.compressor.policy.load_state_dict(state["policy"])


def _policy(c: Config):
    """The per-tensor policy for ``c`` (fewbit.quant.policies; fewbit.quant.gact)."""
    from fewbit.quant.compressors import get_compressor
    from fewbit.quant.policies import AdaccPolicy, FixedPolicy, LayerBitsPolicy, WarmupPolicy, fallback_compressor

    def group(bits: int):
        return get_compressor("group", bits=bits, group_size=c.group_size, stochastic=c.stochastic)

    def fixed(bits: int, warm: bool = False):  # c's compressor at ``bits``
        if c.compressor == "adacc":
            return AdaccPolicy(bits, group_size=c.group_size)
        if c.compressor == "division":  # 1-D tensors: the group quantizer at the same bits
            division = get_compressor("division", bits=bits)
            return FixedPolicy(division, fallback_compressor(division, group_size=c.group_size, stochastic=c.stochastic))
        policy = FixedPolicy(group(bits))
        if c.layer_bits:  # (group only, Config checks it) a warm-up keeps the more of the two
            policy = LayerBitsPolicy(policy, {k: group(max(b, bits) if warm else b) for k, b in c.layer_bits})
        return policy

    if c.saved_bits == "auto":
        from fewbit.quant.gact import GACTPolicy

        policy = GACTPolicy(c.average_bits, adapt_interval=c.adapt_interval, noise_norm=c.noise_norm,
                            group_size=c.group_size, stochastic=c.stochastic)
    else:
        policy = fixed(c.saved_bits)
    return WarmupPolicy(fixed(c.warmup_bits, warm=True), policy, c.warmup_steps) if c.warmup_steps else policy


class _StepHook:
    """Forward pre-hook of the converted model: start a pass of the shared compressor
    (its tensors are numbered from 0 again; ActivationCompressor.step)."""

    def __init__(self, shared: _SharedCompressor) -> None:
        self.shared = shared

    def __call__(self, module: nn.Module, args: Any) -> None:
        if _compiling_or_recording():  # traced: no frames, no leftovers to look for
            self.shared.root_depth += 1
            return None
        if self.shared.root_frames:
            self.shared.sync_root()
        if self.shared.compressor.check_interrupted():
            self.shared.entered.clear()
        sweep_modes()
        self.shared.root_depth += 1
        self.shared.root_frames.append(caller_frame())
        if self.shared.root is None:  # a copy's first forward
            self.shared.root = weakref.ref(module)
        if not self.shared.compressor.active and not _compiling_or_recording():
            owned_by = getattr(self.shared.compressor.policy, "owned_by", None)
            if owned_by is not None:  # a warm-up counts the steps of this model's optimizers
                owned_by(module)
            self.shared.compressor.step()
            self.shared.pass_fqns = None
        return None


class _StepExit:
    """Forward hook of the converted model (always called): its forward is over
    (:class:`_StepHook`)."""

    def __init__(self, shared: _SharedCompressor) -> None:
        self.shared = shared

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.shared.root_depth = max(self.shared.root_depth - 1, 0)
        if not _compiling_or_recording() and self.shared.root_frames:  # traced: none recorded
            self.shared.root_frames.pop()
        if not self.shared.layer_bits_checked and self.shared.root_depth == 0:
            self.shared.check_layer_bits(module)
        return None


class _EnterHook:
    """Forward pre-hook: enter the shared compressor, unless grad is disabled (no_grad,
    inference_mode: nothing is saved for backward, and a torch-function mode would turn
    off torch's inference fast paths, e.g. ``nn.TransformerEncoderLayer``'s, whose nested
    tensors then fail outside them)."""

    def __init__(self, shared: _SharedCompressor, fqn: str = "", kind: str | None = None) -> None:
        self.shared = shared
        self.fqn = fqn
        self.kind = kind

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or _compiling_or_recording() or under_users_checkpoint() or _transforms_active():
            # under torch.func (grad, vmap, jacrev: per-sample gradients) saved-tensor hooks
            # are refused by torch: what is saved stays exact there
            return None
        shared = self.shared
        if shared.compressor.check_interrupted() or (shared.entered and not shared.compressor.active):
            shared.entered.clear()  # the enters a KeyboardInterrupt left (fewbit._interrupted)
        if shared.root_frames:
            shared.sync_root()
        if shared.root_depth == 0 and not shared.compressor.active:
            # a converted module entered outside the model's forward (the loop calls
            # model.backbone(x)): a pass starts when a module of the current one enters
            # again, i.e. at the next step (the save ordinals had never restarted, GACT's
            # plan was never applied and its records grew by every step; a pass per
            # module kept only the last one's)
            if shared.pass_fqns is None or self.fqn in shared.pass_fqns:
                shared.compressor.step()
                shared.pass_fqns = set()
            shared.pass_fqns.add(self.fqn)
        shared.compressor.enter_from(caller_frame())
        norm_size = functools.partial(normalization_size, module) if self.kind == "norm" else None
        self.shared.compressor._push_module(self.fqn, self.kind, norm_size)
        key = id(module)
        self.shared.entered[key] = self.shared.entered.get(key, 0) + 1
        return None


class _ExitHook:
    """Forward hook (always called, also when forward raises): leave the compressor,
    but only if this module's pre-hook entered it."""

    def __init__(self, shared: _SharedCompressor) -> None:
        self.shared = shared

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        key = id(module)
        n = self.shared.entered.get(key, 0)
        if n > 0:
            if n == 1:
                del self.shared.entered[key]
            else:
                self.shared.entered[key] = n - 1
            if self.shared.compressor.active:  # not left already (an interrupted forward's block)
                self.shared.compressor._pop_module()
                self.shared.compressor.__exit__(None, None, None)
        return None


#: ActivationModes pushed by :class:`_ActivationModeHook`s and not popped yet, of every
#: thread (weak: a mode goes with its last reference).
_PUSHED_MODES: weakref.WeakSet = weakref.WeakSet()


def _leave_mode(mode) -> None:
    """Leave a left-over ActivationMode (fewbit._interrupted.leave_mode)."""
    mode.frame = None
    _PUSHED_MODES.discard(mode)
    leave_mode(mode)


def _sweep_modes() -> None:
    """Leave this thread's ActivationModes whose forward stopped without its exit hook
    (a ``KeyboardInterrupt``), whichever hook pushed them."""
    me = threading.get_ident()
    for mode in list(_PUSHED_MODES):
        if mode.thread == me and finished(mode.frame):
            _leave_mode(mode)
    sweep_modes()


class _ActivationModeHook:
    """Forward pre-hook of the converted model: push a
    :class:`fewbit._activation_calls.ActivationMode` for its forward, so that activations
    called as functions run as fewbit's (:class:`_ActivationModeExit` pops it). Not while
    ``torch.compile`` traces (the compiled graph keeps torch's calls).

    The mode costs about 3 µs of Python per torch call in the forward. It is not pushed
    while grad is disabled (nothing is saved then). A forward with grad that calls no
    functional activation (every activation is a module, as in Hugging Face models) turns
    it off; it looks again at forwards 2, 4, 8, ... after that one (the gap doubling up to
    :data:`PROBE_GAP`), so a branch that calls one is found later.

    A forward interrupted by a ``BaseException`` that is not an ``Exception``
    (``KeyboardInterrupt``: Ctrl-C in a notebook) skips torch's always-called forward
    hooks, so the mode stayed pushed in that thread for good: every later forward, of any
    model, never converted ones included, ran its functional activations few-bit. Each
    mode keeps the frame of the module call that pushed it; once that call is off the stack
    the mode passes calls through, and the next fewbit pre-hook in the thread takes it off
    (:meth:`_drop_leftovers`, :func:`_sweep_modes`; fewbit._interrupted). A forward of the
    module called inside its own forward (recursion) keeps the outer call's mode."""

    #: The longest gap, in forwards, between two looks while the mode is off.
    PROBE_GAP = 1024

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self._local = threading.local()  # modes this thread pushed (None: none), innermost last
        self.forwards = 0  # forwards with grad seen
        self.off_until = 0  # while off: the forward count of the next look (0: on)
        self.gap = 1

    def __getstate__(self) -> dict:
        return {"bits": self.bits}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["bits"])

    def _drop_leftovers(self) -> None:
        """Leave what forwards of this module that stopped without their exit hook (see
        the class docstring) left in this thread: their modes off torch's function-mode
        stack, wherever they sit in it. Open forwards of the module (recursion) keep theirs."""
        entries = self._local.modes
        live = [e for e in entries if not finished(e[1])]
        if len(live) == len(entries):
            return
        for mode, frame in entries:
            if mode is not None and (mode, frame) not in live:
                _leave_mode(mode)
        entries[:] = live

    def __call__(self, module: nn.Module, args: Any) -> None:
        if _compiling_or_recording():
            return None
        frame = caller_frame()
        if not hasattr(self._local, "modes"):
            self._local.modes = []
        elif self._local.modes:  # a forward of this module is open, or was interrupted
            self._drop_leftovers()
        _sweep_modes()  # other hooks' leftovers (a model converted again, or a new one)
        if not torch.is_grad_enabled():  # nothing is saved for backward: torch's calls
            self._local.modes.append((None, frame))
            return None
        self.forwards += 1
        if self.forwards < self.off_until:
            self._local.modes.append((None, frame))  # off for this forward
            return None
        from fewbit._activation_calls import ActivationMode

        mode = ActivationMode(self.bits)
        mode.frame, mode.thread = frame, threading.get_ident()
        mode.__enter__()
        _PUSHED_MODES.add(mode)
        self._local.modes.append((mode, frame))
        return None

    def _popped(self, mode) -> None:
        if mode.hits:
            self.off_until, self.gap = 0, 1
        else:
            self.off_until = self.forwards + self.gap
            self.gap = min(2 * self.gap, self.PROBE_GAP)


class _ActivationModeExit:
    """Forward hook (always called, also when forward raises): pop the mode that ``enter``
    (the model's :class:`_ActivationModeHook`) pushed in this thread."""

    def __init__(self, enter: _ActivationModeHook) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        modes = getattr(self.enter._local, "modes", None)
        if modes and not _compiling_or_recording():
            mode = modes.pop()[0]
            if mode is not None:
                mode.frame = None
                _PUSHED_MODES.discard(mode)
                mode.__exit__(None, None, None)
                if sys.exc_info()[0] is None:  # a forward that raised proves nothing about its calls
                    self.enter._popped(mode)
        return None


class _ParametrizedHook:
    """Forward hook of a ``torch.nn.utils.parametrize.ParametrizationList`` in a model
    that compresses saved tensors: the weight it computes from parameters
    (``weight_norm``, ``spectral_norm``) is kept exact like a parameter
    (:func:`fewbit.quant.compressor.mark_parametrized`); at 2 bits it had been quantized
    like an activation (the gradient of the layer before, exact with a plain weight, 0.45 off)."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        # not while torch.compile traces (a compiled graph's saves are kept exact anyway; the
        # grad_fn read broke fullgraph=True)
        if isinstance(output, torch.Tensor) and output.requires_grad and not _compiling_or_recording():
            from fewbit.quant.compressor import mark_parametrized

            mark_parametrized(output)


def _remove_compression_hooks(module: nn.Module) -> None:
    for k, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, (_EnterHook, _StepHook, _ActivationModeHook)):
            del module._forward_pre_hooks[k]
            module._forward_pre_hooks_with_kwargs.pop(k, None)
    for k, hook in list(module._forward_hooks.items()):
        if isinstance(hook, (_ExitHook, _StepExit, _ActivationModeExit, _ParametrizedHook)):
            del module._forward_hooks[k]
            module._forward_hooks_with_kwargs.pop(k, None)
            module._forward_hooks_always_called.pop(k, None)


def _compresses_saved_tensors(model: nn.Module) -> bool:
    """Whether an earlier :func:`convert_` with a :class:`Config` set ``saved_bits`` on
    ``model`` or on a module inside it."""
    return any(isinstance(h, (_StepHook, _EnterHook)) for m in model.modules() for h in m._forward_pre_hooks.values())


def _has_plan_hooks(module: nn.Module) -> bool:
    """Whether a plan's group hooks (:mod:`fewbit.planner`) run on ``module`` (applied to
    the model or to one that holds it)."""
    return any(type(getattr(h, "__self__", None)).__name__ == "_GroupHook" for h in module._forward_pre_hooks.values())


def _check_not_shared(model: nn.Module) -> None:
    """Refuse a model holding a module whose compression hooks serve the compressor of a
    converted model that does not hold ``model`` (a module shared between two models, e.g.
    a backbone with two heads): the conversion would take the module over (the other
    model's forward then compressed it with this model's compressor and bits, unseen by its
    own, or left it uncompressed with ``saved_bits=None``). Hooks of a conversion of
    ``model``, of a module inside it, or of a model holding it (a submodule converted again
    on its own) are this conversion's to replace."""
    roots = {id(h.shared) for m in model.modules() for h in m._forward_pre_hooks.values() if isinstance(h, _StepHook)}
    for fqn, m in model.named_modules():
        for h in m._forward_pre_hooks.values():
            if not isinstance(h, _EnterHook) or id(h.shared) in roots or h.shared.root is None:
                continue
            other = h.shared.root()
            if other is None or any(x is model for x in other.modules()):
                continue
            if not any(x is m for x in other.modules()):  # hooks left from a model that let it go
                continue
            raise ValueError(
                f"module {fqn or '(root)'!r} ({type(m).__name__}) is compressed by another model that "
                f"fewbit.convert_ converted ({type(other).__name__}, which does not hold this model: a module "
                "shared between models); its hooks serve one compressor. Convert only one of the models, or "
                "convert the other one with saved_bits=None first"
            )


def _install_compression_hooks(
    model: nn.Module, config: Config, selected: _Selected, summary: ConversionSummary
) -> None:
    """Phase 2 of :func:`convert_`: remove the hooks of an earlier conversion, then, if
    ``config.saved_bits`` is set, run every selected module of a kind in ``config.layers``
    (:data:`LAYER_KINDS`) inside one shared compressor. Fills ``summary.compressed`` and
    ``summary.compressor``."""
    named = list(model.named_modules())
    for _, m in named:
        _remove_compression_hooks(m)
    if config.saved_bits is None:
        return
    shared = _SharedCompressor(config)
    shared.root = weakref.ref(model)
    summary.compressor = shared.compressor
    model.register_forward_pre_hook(_StepHook(shared))
    model.register_forward_hook(_StepExit(shared), always_call=True)
    blocks: set[str] = set()
    if "block" in config.layers:
        from fewbit._blocks import find_blocks

        try:
            blocks = {fqn for _, fqns in find_blocks(model) for fqn in fqns}
        except ValueError:  # no repeated blocks
            pass
    from torch.nn.utils.parametrize import ParametrizationList

    for _, m in named:
        if isinstance(m, ParametrizationList):
            m.register_forward_hook(_ParametrizedHook())
    for fqn, m in named:
        kind = "block" if fqn in blocks else layer_kind(m)
        if kind is None or kind not in config.layers or not selected(m, fqn):
            continue
        m.register_forward_pre_hook(_EnterHook(shared, fqn, kind))
        m.register_forward_hook(_ExitHook(shared), always_call=True)
        summary.compressed[fqn] = kind


def _install_activation_mode(model: nn.Module, config: Config, selected: _Selected,
                             summary: ConversionSummary, earlier: list[tuple[str, nn.Module, int]] = ()) -> None:
    """Phase 2 of :func:`convert_` for activations called as functions: with
    ``activation_bits`` set and the root selected, the model's forward runs inside an
    :class:`fewbit._activation_calls.ActivationMode` (hooks removed first by
    :func:`_install_compression_hooks`). Earlier conversions' modes (``earlier``: ``(fqn,
    module, bits)``) stay where this one changes nothing: all of them with
    ``activation_bits=None`` or a root left out, those of modules ``filter_fn`` leaves out
    otherwise (inner modes win for their module's calls), as converted modules stay (the
    calls had gone back to torch, or to the root's bits, while the modules stayed as they were)."""
    if config.activation_bits is not None and selected(model, ""):
        modes = [(model, config.activation_bits)]
        modes += [(m, bits) for fqn, m, bits in earlier if m is not model and not selected(m, fqn)]
    else:
        modes = [(m, bits) for _, m, bits in earlier]
    for module, bits in modes:
        enter = _ActivationModeHook(bits)
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(_ActivationModeExit(enter), always_call=True)
    summary.functional_bits = next((bits for module, bits in modes if module is model), None)


def compressor_of(model: nn.Module):
    """The :class:`fewbit.quant.ActivationCompressor` that :func:`convert_` attached to
    ``model`` (``summary.compressor``), or None if its saved tensors are not compressed.
    ``model`` may be the converted model in a wrapper: ``nn.DataParallel``,
    ``DistributedDataParallel`` (``.module``), ``torch.compile``'s ``OptimizedModule``
    (``._orig_mod``), FSDP1's or activation checkpointing's wrapper; the wrapper a training
    loop holds had given None (h76, h78)."""
    seen = set()
    while isinstance(model, nn.Module) and id(model) not in seen:
        seen.add(id(model))
        for hook in model._forward_pre_hooks.values():
            if isinstance(hook, _StepHook):
                return hook.shared.compressor
        inner = vars(model).get("_modules", {})
        nxt = inner.get("module") if isinstance(model, _WRAPPERS) else inner.get("_orig_mod")
        if nxt is None:  # FSDP1's and activation checkpointing's wrappers (not any module of one child:
            # the compressor of a backbone is not the outer model's, whose own saves it does not take; h79)
            nxt = inner.get("_fsdp_wrapped_module") or inner.get("_checkpoint_wrapped_module")
        model = nxt
    return None


def _wrappers() -> tuple:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return (DataParallel, DistributedDataParallel)


_WRAPPERS = _wrappers()


#: Set on a model whose fused loss :func:`convert_` installed (a re-conversion may undo only that one).
_FUSED_CE_ATTR = "_fewbit_convert_fused_ce"


def _is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face ``*ForCausalLM`` (or GPT-2-style ``*LMHeadModel``) model, or a class of
    the user's derived from one (``class MyLlama(LlamaForCausalLM)`` had been refused, "needs
    a Hugging Face *ForCausalLM model", which ``patch_causal_lm_`` takes; review h71; what its
    forward does is :func:`fewbit.losses.fused_loss_refusal`'s to judge)."""
    return any((cls.__module__ or "").startswith("transformers")
               and cls.__name__.endswith(("ForCausalLM", "LMHeadModel")) for cls in type(model).__mro__)


def _set_fused_cross_entropy(model: nn.Module, config: Config, summary: ConversionSummary) -> None:
    """Phase 3 of :func:`convert_`: patch (or unpatch) the loss of a causal LM."""
    from fewbit.losses import patch_causal_lm_, unpatch_causal_lm_

    ours = bool(vars(model).get(_FUSED_CE_ATTR))
    if ours and getattr(model, _PATCH_ATTR, None) is None:  # unpatched by hand since (unpatch_causal_lm_)
        del model.__dict__[_FUSED_CE_ATTR]
        ours = False
    if config.fused_cross_entropy and not ours:
        patch_causal_lm_(model)
        model.__dict__[_FUSED_CE_ATTR] = True
    elif not config.fused_cross_entropy and ours:
        unpatch_causal_lm_(model)
        del model.__dict__[_FUSED_CE_ATTR]
    summary.fused_cross_entropy = config.fused_cross_entropy


def _check_arguments(model: Any, config: Any, bits: Any, filter_fn: Any) -> Config:
    """Validate :func:`convert_`'s arguments; return the :class:`Config` to apply."""
    if not isinstance(model, nn.Module):
        hint = ""
        if type(model).__name__ == "ExportedProgram":
            hint = " (a torch.export program is not a module: convert the eager model before exporting)"
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}{hint}")
    if isinstance(model, torch.jit.ScriptModule):
        raise _script_module_error(model)
    if config is not None and bits is not None:
        raise ValueError(f"pass either config or bits, not both (got bits={bits!r} and a config)")
    if config is None:
        if bits is not None:  # the shorthand's own name in the error (Config's says activation_bits)
            check_bits(bits, "bits")
        config = Config() if bits is None else Config(activation_bits=bits)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a fewbit.Config or a fewbit.Plan, got {type(config).__name__}")
    if config.fused_cross_entropy and not _is_causal_lm(model):
        raise ValueError(f"fused_cross_entropy=True needs a Hugging Face *ForCausalLM model, got "
                         f"{type(model).__name__}")
    if config.fused_cross_entropy and not vars(model).get(_FUSED_CE_ATTR) and hasattr(model, _PATCH_ATTR):
        raise ValueError(f"fused_cross_entropy=True: model ({type(model).__name__}) is already patched by "
                         "fewbit.losses.patch_causal_lm_; call unpatch_causal_lm_ first")
    if config.fused_cross_entropy and (refusal := fused_loss_refusal(model)) is not None:
        raise ValueError(f"fused_cross_entropy=True: {refusal}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(module, fqn) -> bool or None, got {type(filter_fn).__name__}")
    return config


# --------------------------------------------------------------------------- convert_


def convert_(
    model: nn.Module,
    config: "Config | Plan | None" = None,
    *,
    bits: int | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> ConversionSummary:
    """Convert ``model`` in place to few-bit activations (and compressed saved tensors).

    Activations keep ``config.activation_bits`` bits per element for backward (Novikov
    et al., "Few-bit Backward", ICML 2023); tensors saved by the selected layers keep
    ``config.saved_bits`` bits per element plus per-group stats (ActNN, docs/method.md §7).
    Forward outputs are bit-identical (each new module computes the replaced module's own
    expression; see the table in :mod:`fewbit.convert`); parameters, buffers,
    ``state_dict()`` keys and ``training`` flags are unchanged; hooks and attributes set on
    a replaced activation module move to its replacement (the handles still remove them).
    Under ``torch.no_grad()`` / ``inference_mode`` nothing is compressed (nothing is saved)
    and torch's inference fast paths run as in the unconverted model. Converting again
    applies the new config: fewbit modules already there get the new ``activation_bits``
    (``.changed``), nothing is wrapped twice and hooks are never stacked.

    Args:
        model: an eager ``nn.Module`` (torch or Hugging Face ``transformers`` model),
            also inside ``nn.DataParallel`` (activations only: with ``saved_bits`` its
            replicas' threads would share one compressor, which raises ``RuntimeError``),
            ``DistributedDataParallel`` or a ``torch.compile`` wrapper, or a
            ``torch.fx.GraphModule``; not TorchScript.
        config: what to do; default ``Config()`` (3-bit activations, no saved-tensor
            compression). A :class:`fewbit.Plan` (from :func:`fewbit.plan`) applies that plan
            instead (:func:`fewbit.planner.apply_plan`; ``bits`` and ``filter_fn`` must be None).
        bits: shortcut for ``Config(activation_bits=bits)``; not together with ``config``.
        filter_fn: ``filter_fn(module, fqn) -> bool``; only modules for which it returns
            True are replaced or hooked (default: all). ``fqn`` is the dotted name from
            ``model.named_modules()`` (``""`` for the root). It is asked about every
            module, at every path of a module shared between parents, before anything
            changes (an exception leaves the model as it was); a shared module is
            converted if it is selected at any of its paths. Activations called as
            functions follow the root's answer for the whole forward, submodules left out
            included (item 3 above), and so do activation modules left out, whose forward
            calls them (an ``nn.GELU`` left out runs ``F.gelu``: fewbit's while the root is
            converted); to keep an activation exact, leave the root out.

    Returns:
        A :class:`ConversionSummary` (``.model`` is ``model`` itself, converted in place;
        ``.replaced``, ``.changed``, ``.unsupported``, ``.compressed``, ``.compressor``;
        ``print(summary)`` shows it). Like ``load_state_dict``, the in-place verb returns
        a report rather than the model.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` or is a TorchScript module
            (``torch.jit.script``/``trace``: compiled, nothing in it can be replaced),
            ``config`` is not a :class:`Config`, or ``filter_fn`` is not callable.
        ValueError: if both ``config`` and ``bits`` are given, or ``bits`` is out of range;
            ``config.fused_cross_entropy`` for a model that is not a Hugging Face causal LM;
            a :class:`Config` for a model that has a plan applied, or a plan for a model
            that compresses saved tensors by an earlier ``Config`` (the two would both
            compress the same tensors; :func:`fewbit.planner.remove_plan` undoes a plan);
            a model holding a module that another converted model compresses (a module
            shared between two models: its hooks serve one compressor).

    Example:
        >>> summary = fewbit.convert_(model, fewbit.Config(activation_bits=3, saved_bits=4))
        >>> print(summary)
    """
    if type(config).__name__ == "Plan" and type(config).__module__ == "fewbit.planner":
        if bits is not None or filter_fn is not None:
            raise ValueError("convert_(model, plan) takes neither bits nor filter_fn: the plan says what to do")
        _check_arguments(model, None, None, None)
        from fewbit.planner import apply_plan

        return apply_plan(model, config)
    config = _check_arguments(model, config, bits, filter_fn)
    if "_fewbit_plan_state" in vars(model) or any(_has_plan_hooks(m) for m in model.modules()):
        raise ValueError("model has a fewbit plan applied, or is part of a planned model (the plan decides each "
                         "saved tensor's compression); fewbit.planner.remove_plan on the planned model removes it "
                         "before a convert_(model, Config)")

    _check_not_shared(model)
    if config.saved_bits is not None and config.layers == ("block",):  # before anything changes
        from fewbit._blocks import find_blocks

        try:
            find_blocks(model)
        except ValueError as exc:
            raise ValueError(f"layers=('block',) compresses what the code of the model's repeated blocks saves, "
                             f"and {type(model).__name__} has none ({exc}); choose other layers") from None

    # every module's answer, at every path, before anything changes: a filter_fn that
    # raised on one module had left the model half converted (activations replaced, hooks
    # on some layers, no activation mode), and a shared module was asked about its first
    # path only (h72)
    answers: dict[int, bool] = {}
    if filter_fn is not None:
        for fqn, m in model.named_modules(remove_duplicate=False):
            answers[id(m)] = answers.get(id(m), False) or bool(filter_fn(m, fqn))

    def selected(m: nn.Module, fqn: str) -> bool:
        if filter_fn is None:
            return True
        answer = answers.get(id(m))
        return bool(filter_fn(m, fqn)) if answer is None else answer

    summary = ConversionSummary(model=model, config=config)
    if config.activation_bits is not None:
        _replace_activations(model, config.activation_bits, selected, summary)
    earlier = [(fqn, m, h.bits) for fqn, m in model.named_modules() for h in m._forward_pre_hooks.values()
               if isinstance(h, _ActivationModeHook)]  # earlier conversions' (of the model or a submodule)
    _install_compression_hooks(model, config, selected, summary)
    _install_activation_mode(model, config, selected, summary, earlier)
    _set_fused_cross_entropy(model, config, summary)
    return summary
