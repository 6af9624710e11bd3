"""Per-tensor compression policies: which compressor takes which saved tensor.

An :class:`fewbit.quant.ActivationCompressor` asks its policy, for every floating tensor it
takes, for a :class:`~fewbit.quant.compressors.Compressor` (``Keep`` = left exact). The
policy sees what is known at pack time (:class:`SavedTensorInfo`): shape and dtype, the
index in the pass's save order, the innermost converted module (fqn and kind, set by
``fewbit.convert_``'s hooks) and the tensor's role. ``fewbit.Config(compressor=...)`` and
``Config(saved_bits="auto")`` pick one:

========================  =================================================================
policy                    compressor of each saved tensor
========================  =================================================================
:class:`FixedPolicy`      one compressor for all (``"group"``: ActNN; ``"division"``)
:class:`LayerBitsPolicy`  another policy, with other bits for some layer kinds
                          (``Config(layer_bits={"block": 4})``; ActNN's per-layer settings)
:class:`AdaccPolicy`      by layer kind (Adacc, Zhang et al. 2024; docs/compression.md §4)
``GACTPolicy``            group quantizer at per-tensor bits from gradient sensitivity
                          (:mod:`fewbit.quant.gact`; GACT, Liu et al., ICML 2022)
:class:`WarmupPolicy`     another policy at more bits for the first training steps, then
                          the policy asked for (``Config(warmup_steps=...)``)
========================  =================================================================

Write your own by subclassing :class:`Policy` (``choose``, and ``default`` for the
compressor reported as ``ActivationCompressor.compressor``).
"""

from __future__ import annotations

import abc
import math
import weakref
from dataclasses import dataclass

import torch

from fewbit.quant.compressors import Compressor, get_compressor

__all__ = ["SavedTensorInfo", "Policy", "FixedPolicy", "LayerBitsPolicy", "AdaccPolicy", "WarmupPolicy",
           "compressor_bits", "fallback_compressor", "layer_bits_chosen"]


@dataclass(frozen=True)
class SavedTensorInfo:
    """What a policy knows about one saved tensor at pack time.

    Attributes:
        index: position among the tensors the compressor took in this pass (0, 1, ...;
            reset by :meth:`fewbit.quant.ActivationCompressor.step`, which ``fewbit.convert_``
            calls at the start of every forward of the converted model). Stable from pass
            to pass for a static graph.
        shape: the tensor's shape.
        dtype: its dtype.
        fqn: dotted name of the innermost converted module running (``""`` for the
            root), or None outside ``fewbit.convert_``'s hooks.
        kind: that module's kind (``fewbit.convert.layer_kind``: ``linear``, ``conv``,
            ``norm``, ``attention``), or None.
        role: ``"qk"`` for the query/key that :mod:`fewbit.quant.attention` saves (it picks
            their compressor itself, 8 bits); ``"result"`` for a result saved for its op's
            own backward when that backward is not linear in it (softmax and log-softmax,
            e.g. eager attention's probabilities; tanh; sigmoid), which the compressor
            takes at 8 bits (softmax: in rows) whatever the policy chooses, unless it
            keeps it exact; ``"norm_input"`` for the input of a per-sample normalization
            call (LayerNorm, RMSNorm, GroupNorm, InstanceNorm: saved once for a backward
            quadratic in it), taken at 8 bits inside its rows likewise
            (:meth:`fewbit.quant.ActivationCompressor._within_norm`); else None.
        norm_size: inside a normalization layer whose backward is not linear in ``x``,
            the elements of ``x`` (in C order) that share one mean/variance, a contiguous run
            (:func:`fewbit.convert.normalization_size`: LayerNorm's ``normalized_shape``,
            InstanceNorm's channel plane, a training BatchNorm's channel plane, ...; a
            BatchNorm's ``(N, C)`` input or planes under 32 elements: the channel's ``N *
            prod(spatial)`` elements, which the compressor takes from the ``(C, N, ...)``
            copy, :class:`fewbit._norm_rows.Channels`); for a
            softmax or log-softmax ``"result"`` over the last dim, its row length; else None. The
            compressor the policy chooses for such a tensor is replaced by its
            :meth:`~fewbit.quant.compressors.Compressor.within` ``(norm_size)``: statistics
            inside each row.
        key: ``(fqn, n)``: the tensor is that module's ``n``-th save in this pass (every
            save counted, also those kept exact); unlike ``index`` it does not move when
            a tensor is skipped (under ``min_numel`` on a smaller last batch) or a branch
            in another module did not run. :class:`~fewbit.quant.gact.GACTPolicy` finds a tensor's
            planned bits by it. None when made by hand.
        channel_major: the compressor takes the tensor as its ``(C, N, ...)`` copy (a
            BatchNorm's channels, :class:`fewbit._norm_rows.Channels`): its groups run over
            that copy's C order, not the tensor's.
    """

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fqn: str | None = None
    kind: str | None = None
    role: str | None = None
    norm_size: int | None = None
    key: tuple | None = None
    channel_major: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def compressor_bits(compressor: Compressor, dtype: torch.dtype) -> int:
    """Bits per element of a compressor's codes (``bits``; a :class:`Keep` gives the
    dtype's width), as shown in the memory report (stats not included)."""
    if compressor.name == "keep":
        return torch.empty((), dtype=dtype).element_size() * 8
    return int(getattr(compressor, "bits", 0))


class Policy(abc.ABC):
    """Maps each saved tensor to a compressor (subclass it to add a policy)."""

    #: Whether :meth:`choose` also picks the compressor of the attention's q and k
    #: (``role="qk"``); if False they get :mod:`fewbit.quant.attention`'s 8 bits.
    decides_qk: bool = False

    @property
    @abc.abstractmethod
    def default(self) -> Compressor:
        """The compressor shown as ``ActivationCompressor.compressor`` (what the attention's
        8-bit q/k rule compares against, :mod:`fewbit.quant.attention`)."""

    @abc.abstractmethod
    def choose(self, x: torch.Tensor, info: SavedTensorInfo) -> Compressor:
        """The compressor for saved tensor ``x`` (not modified; do not read its values
        unless needed: it runs at every save)."""

    def observe(self, info: SavedTensorInfo) -> None:
        """Called for every floating tensor taken, also those whose compressor the
        attention picks (``role="qk"``), before :meth:`choose`; does nothing by default."""

    def generator(self, info: SavedTensorInfo) -> torch.Generator | None:
        """A generator for this tensor's noise seed, or None for the compressor's own
        (GACT's sensitivity runs fix each tensor's seed through it)."""
        return None

    def adapt(self, model: torch.nn.Module, closure, optimizer=None) -> bool:
        """Re-plan from the model's gradients; a policy with nothing to learn returns False."""
        return False

    def schedule(self):
        """A snapshot of the re-plan schedule :meth:`adapt` advances (None: it has none);
        :meth:`set_schedule` puts it back after a call that measured nothing."""
        return None

    def set_schedule(self, state) -> None:
        """Restore a :meth:`schedule` snapshot."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(default={self.default!r})"


def fallback_compressor(compressor: Compressor, *, group_size: int = 256, stochastic: bool = True) -> Compressor:
    """What :class:`FixedPolicy` uses for a tensor ``compressor`` does not support
    (``compressor.supports(x)`` False, e.g. a 1-D tensor for DIVISION): the group quantizer
    (ActNN) at the compressor's ``bits`` (its residual or code width), or, for a compressor
    without ``bits`` in 1, 2, 4, 8, the tensor kept exact (:class:`Keep`)."""
    from fewbit.quant.compressors import Keep

    bits = getattr(compressor, "bits", None)
    if compressor.name in ("keep", "group") or bits not in (1, 2, 4, 8):
        return Keep()
    return get_compressor("group", bits=bits, group_size=group_size, stochastic=stochastic)


class FixedPolicy(Policy):
    """Every tensor gets ``compressor`` (``fewbit.Config(compressor="group"|"division")``),
    or ``fallback`` where ``compressor.supports(x)`` is False.

    Args:
        compressor: the compressor of every supported tensor.
        fallback: the compressor of the others; default :func:`fallback_compressor`
            (DIVISION at Q bits: the group quantizer at Q bits, so a 1-D tensor costs
            about what DIVISION would, never an error in the middle of a forward).

    Raises:
        TypeError: ``compressor`` or ``fallback`` is not a
            :class:`~fewbit.quant.compressors.Compressor`.
    """

    def __init__(self, compressor: Compressor, fallback: Compressor | None = None) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a fewbit.quant.compressors.Compressor, got {type(compressor).__name__}")
        if fallback is None:
            fallback = fallback_compressor(compressor)
        elif not isinstance(fallback, Compressor):
            raise TypeError(f"fallback must be a fewbit.quant.compressors.Compressor, got {type(fallback).__name__}")
        self.compressor = compressor
        self.fallback = fallback

    @property
    def default(self) -> Compressor:
        return self.compressor

    def choose(self, x, info):
        return self.compressor if self.compressor.supports(x) else self.fallback

    def __repr__(self) -> str:
        return f"FixedPolicy({self.compressor!r}, fallback={self.fallback!r})"


class LayerBitsPolicy(Policy):
    """``policy``, except that the tensors saved inside layers of a kind in ``by_kind`` get
    that kind's compressor (``fewbit.Config(layer_bits=...)``; ActNN's per-layer settings).

    The kind is :attr:`SavedTensorInfo.kind`, the innermost converted module's
    (``fewbit.convert.layer_kind``: ``linear``, ``conv``, ``norm``, ``attention``,
    ``block``); a tensor that kind's compressor does not support goes to ``policy``. Roles
    the compressor decides itself (attention's q/k, norm inputs, softmax results: 8 bits)
    stay as they are. A tensor saved by several modules is compressed once, when it is
    first saved (the later saves share that copy), so its first saver's kind decides.

    Args:
        policy: the policy of every other tensor.
        by_kind: ``{kind: compressor}``.

    Raises:
        TypeError: ``policy`` is not a :class:`Policy` or a value of ``by_kind`` not a
            :class:`~fewbit.quant.compressors.Compressor`.
    """

    def __init__(self, policy: Policy, by_kind: dict[str, Compressor]) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a fewbit.quant.policies.Policy, got {type(policy).__name__}")
        for kind, compressor in by_kind.items():
            if not isinstance(compressor, Compressor):
                raise TypeError(f"by_kind[{kind!r}] must be a fewbit.quant.compressors.Compressor, got "
                                f"{type(compressor).__name__}")
        self.policy = policy
        self.by_kind = dict(by_kind)
        #: tensors given each kind's compressor so far (a kind whose layers save nothing of
        #: their own stays at 0: GPT-2's blocks, whose saves are their submodules')
        self.chosen: dict[str, int] = dict.fromkeys(self.by_kind, 0)

    @property
    def default(self) -> Compressor:
        return self.policy.default

    @property
    def decides_qk(self) -> bool:
        return self.policy.decides_qk

    def observe(self, info: SavedTensorInfo) -> None:
        self.policy.observe(info)

    def choose(self, x, info):
        compressor = self.by_kind.get(info.kind)
        if compressor is not None and compressor.supports(x):
            if info.role not in ("result", "norm_input"):  # those the compressor sets to 8 bits
                self.chosen[info.kind] = self.chosen.get(info.kind, 0) + 1
            return compressor
        return self.policy.choose(x, info)

    def generator(self, info):
        return self.policy.generator(info)

    def __repr__(self) -> str:
        return f"LayerBitsPolicy({self.policy!r}, by_kind={self.by_kind!r})"


def layer_bits_chosen(policy: Policy) -> dict[str, int]:
    """``{kind: tensors}`` that the :class:`LayerBitsPolicy` instances inside ``policy``
    (itself, or a :class:`WarmupPolicy`'s warm-up and later policies, at any depth) have
    given their kind's compressor so far, summed (:attr:`LayerBitsPolicy.chosen`); ``{}``
    if it has none."""
    chosen: dict[str, int] = {}
    todo = [policy]
    while todo:
        p = todo.pop()
        if isinstance(p, LayerBitsPolicy):
            for kind, n in p.chosen.items():
                chosen[kind] = chosen.get(kind, 0) + n
        todo += [q for q in (getattr(p, "warm", None), getattr(p, "policy", None)) if isinstance(q, Policy)]
    return chosen


class AdaccPolicy(Policy):
    """Adacc's layer-specific compressors (docs/compression.md §4; Adacc, Zhang et al. 2024).

    - tensors saved inside ``linear`` and ``norm`` modules and activation inputs (no kind):
      ``"outlier"`` (outlier channels with z-score > 3 exact, the rest row-wise at ``bits``),
      except the input of torch's per-sample norm functions (LayerNorm, RMSNorm, GroupNorm,
      InstanceNorm), which the compressor takes at 8 bits inside its rows whatever this
      policy chooses (its backward is quadratic in it; role ``"norm_input"``);
    - inside ``attention`` modules: the q and k that the attention's backward recomputes the
      softmax from (role ``"qk"``) the group quantizer at 8 bits, in groups inside one head
      channel's run of tokens (:mod:`fewbit.quant.attention`). Adacc's channel-wise scale
      is shared by every head, batch item and token: a common offset of +30 in one q/k
      channel of a GPT-2 biased the ``c_attn`` and ``wte`` gradients by 4-7 standard
      errors over 150 draws (16 % of dq's norm on one attention; h68). The softmax's own
      result is the compressor's 8-bit group quantizer inside its rows whatever this policy
      chooses (role ``"result"``: its backward is not linear in it); other tensors with
      every value in [0, 1] (checked with one min/max reduction: probabilities another op
      saves; dropout's output, scaled by ``1 / (1 - p)``, is over 1 and takes the
      channel-wise one) ``"softmax"`` at ``bits``; v and the rest ``"channelwise"`` at ``bits``
      (in eager attention also the q and kᵀ its matmul saves, whose backward is linear in
      them);
    - inside ``conv`` modules: the group quantizer at ``bits`` (Adacc covers transformers).

    Args:
        bits: bits per element of the outlier, softmax and channel-wise compressors.
        group_size: the group quantizer's group for conv tensors and q, k.

    Raises:
        ValueError: a compressor that is not registered (:data:`COMPRESSORS`), or ``bits``
            out of one of their ranges.
    """

    decides_qk = True

    def __init__(self, bits: int = 4, *, group_size: int = 256) -> None:
        self.bits = bits
        self.outlier = get_compressor("outlier", bits=bits)
        self.softmax = get_compressor("softmax", bits=bits)
        self.channelwise = get_compressor("channelwise", bits=bits)
        self.qk = get_compressor("group", bits=8, group_size=group_size)
        self.group = get_compressor("group", bits=bits, group_size=group_size)

    @property
    def default(self) -> Compressor:
        return self.outlier

    def choose(self, x, info):
        if info.role == "qk":
            chosen = self.qk
        elif info.kind == "attention":
            with torch.no_grad():
                if x.numel() and bool((x.amin() >= 0) & (x.amax() <= 1)):
                    chosen = self.softmax
                else:
                    chosen = self.channelwise
        elif info.kind == "conv":
            chosen = self.group
        else:
            chosen = self.outlier
        return chosen if chosen.supports(x) else self.group

    def __repr__(self) -> str:
        return f"AdaccPolicy(bits={self.bits})"


class WarmupPolicy(Policy):
    """``warm`` for the first ``steps`` training steps, then ``policy``
    (``fewbit.Config(warmup_steps=..., warmup_bits=...)``).

    Why: at 2 bits a run can stay on the early loss plateau much longer than vanilla (a GPT-2
    seed in twelve ended 0.12 above vanilla, README "Training"); 4 bits for the first 100
    steps, then 2, trained like vanilla on all twelve seeds and six noise draws of the bad
    one. The run's peak memory is then that of the warm-up's bits.

    A training step is counted when an optimizer steps after this policy's compressor took
    a saved tensor (since the step counted before): ``step()`` of a ``torch.optim.Optimizer``,
    seen through torch's global step hooks
    (``torch.optim.optimizer.register_optimizer_step_post_hook``): the steps of optimizers
    holding a parameter of the model (:meth:`owned_by`; ``fewbit.convert_`` sets it at the
    model's forward; a GAN's other network's steps do not count, also those before its own
    optimizer's first), or, as long as none of those has stepped, of any optimizer (one over
    float32 master copies of the weights, over a prompt outside a frozen model, over FSDP1's
    flat parameters). So gradient accumulation counts one step
    per optimizer step, several optimizers stepping after one backward count once, a step
    ``torch.amp.GradScaler`` skips (it does not call ``step()``) and forwards without grad
    none. Weights updated without a ``torch.optim`` optimizer never end the warm-up. The
    switch takes effect at the next forward; the policy in use is :attr:`current`. A new
    ``fewbit.convert_`` of the model starts a new warm-up.

    Args:
        warm: the policy of the warm-up (e.g. ``FixedPolicy`` of the group quantizer at 4 bits).
        policy: the policy from step ``steps + 1`` on; its :meth:`adapt` (GACT's re-plans)
            starts then: during the warm-up ``adapt`` is the warm policy's (nothing to learn).
        steps: training steps under ``warm``, an integer >= 1.

    Raises:
        TypeError: ``warm`` or ``policy`` is not a :class:`Policy`.
        ValueError: ``steps`` is not an integer >= 1.
    """

    def __init__(self, warm: Policy, policy: Policy, steps: int) -> None:
        from fewbit._checks import check_positive_int

        for name, value in (("warm", warm), ("policy", policy)):
            if not isinstance(value, Policy):
                raise TypeError(f"{name} must be a fewbit.quant.policies.Policy, got {type(value).__name__}")
        self.warm = warm
        self.policy = policy
        self.steps = check_positive_int(steps, "steps")
        self._own_steps = self._any_steps = 0  # steps of the model's optimizers, of any optimizer
        # a tensor taken since the step counted before: by the model's optimizers, by any
        self._saved_own = self._saved_any = False
        self._handle = None
        self._model = None  # weak reference to the model whose optimizers count (owned_by)
        self._owner_seen = False  # an optimizer holding the model's parameters has stepped
        self._watch()

    def owned_by(self, model: torch.nn.Module) -> None:
        """Count the steps of optimizers that hold a parameter of ``model`` (weakly
        referenced) apart from any optimizer's (:attr:`steps_done`); without a model,
        every optimizer's steps are the model's."""
        if self._model is None or self._model() is not model:
            self._model = weakref.ref(model)

    def _owns(self, optimizer) -> bool:
        model = self._model() if self._model is not None else None
        if model is None:
            return True
        mine = {id(p) for p in model.parameters()}
        return any(id(p) in mine for group in getattr(optimizer, "param_groups", ()) for p in group["params"])

    @property
    def steps_done(self) -> int:
        """Training steps counted so far: those of the model's optimizers, or of any optimizer
        while none of the model's has stepped (:meth:`load_state_dict` restores it)."""
        return self._own_steps if self._owner_seen else self._any_steps

    @property
    def current(self) -> Policy:
        """``warm`` during the first :attr:`steps` training steps, ``policy`` after."""
        return self.warm if self.steps_done < self.steps else self.policy

    def _watch(self) -> None:
        """Count optimizer steps while warming up (a weak reference: the hook does not keep
        the policy, or the model holding it, alive)."""
        if self._handle is None and self.steps_done < self.steps:
            ref = weakref.ref(self)

            def counted(optimizer, args, kwargs):
                me = ref()
                if me is None or me.steps_done >= me.steps:  # freed, or warmed up: nothing to count
                    return
                me._count(optimizer)

            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handle = register_optimizer_step_post_hook(counted)
            weakref.finalize(self, self._handle.remove)

    def _count(self, optimizer=None) -> None:
        own = optimizer is None or self._owns(optimizer)
        if own:
            self._owner_seen = True
            if self._saved_own:
                self._saved_own = False
                self._own_steps += 1
        if self._saved_any:
            self._saved_any = False
            self._any_steps += 1
        # The hook is not removed here: torch calls the step hooks while iterating over its
        # dict of them, and removing one there raised "OrderedDict mutated during iteration"
        # as soon as another warm-up's hook followed (two converted models, a GAN's G and D).
        # It does nothing from now on and is removed at the next save (:meth:`_unwatch`).

    def _unwatch(self) -> None:
        """Remove the step hook once the warm-up is over (outside torch's hook loop)."""
        if self._handle is not None and self.steps_done >= self.steps:
            self._handle.remove()
            self._handle = None

    @property
    def default(self) -> Compressor:
        return self.current.default

    @property
    def decides_qk(self) -> bool:  # the policy in use's
        return self.current.decides_qk

    def observe(self, info: SavedTensorInfo) -> None:
        if self._handle is not None and self.steps_done >= self.steps:
            self._unwatch()
        self._saved_own = self._saved_any = True
        self.current.observe(info)

    def choose(self, x, info):
        return self.current.choose(x, info)

    def generator(self, info):
        return self.current.generator(info)

    def adapt(self, model, closure, optimizer=None) -> bool:
        return self.current.adapt(model, closure, optimizer)

    def schedule(self):
        return self.current.schedule()

    def set_schedule(self, state) -> None:
        self.current.set_schedule(state)

    def state_dict(self) -> dict:
        """``{"steps_done": int, "owner_seen": bool, "policy": the policy's state_dict() or
        None}``: save it beside the model's to resume a run with a warm-up exactly (a
        converted model's pickle and ``copy.deepcopy`` carry it)."""
        inner = self.policy.state_dict() if hasattr(self.policy, "state_dict") else None
        return {"steps_done": self.steps_done, "owner_seen": self._owner_seen, "policy": inner}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is not a ``WarmupPolicy.state_dict()`` (its
                ``steps_done`` not an integer >= 0), or the inner policy refuses its part.
                Nothing is changed then.
        """
        from fewbit._checks import is_int

        if not isinstance(state, dict) or not is_int(state.get("steps_done")) or state["steps_done"] < 0:
            raise ValueError(f"state is not a WarmupPolicy.state_dict(): it needs steps_done, an integer >= 0, "
                             f"got {state!r:.200}")
        if state.get("policy") is not None:
            if not hasattr(self.policy, "load_state_dict"):
                raise ValueError(f"state holds a policy state, but {type(self.policy).__name__} has none")
            self.policy.load_state_dict(state["policy"])
        self._own_steps = self._any_steps = int(state["steps_done"])
        self._owner_seen = bool(state.get("owner_seen", False))
        self._saved_own = self._saved_any = False
        self._unwatch()
        self._watch()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handle"] = None  # a hook is per process; __setstate__ registers the copy's own
        state["_model"] = None  # a weak reference: the copy's model sets its own (owned_by)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._watch()

    def __repr__(self) -> str:
        return f"WarmupPolicy({self.warm!r}, {self.policy!r}, steps={self.steps}, steps_done={self.steps_done})"
