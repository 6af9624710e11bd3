"""Memory report: what a training step keeps for backward, exactly and deduplicated.

Every tensor that autograd saves for backward passes through the saved-tensor pack hook
(:class:`torch.autograd.graph.saved_tensors_hooks`). :class:`SavedTensorRecorder` installs a
pack hook that wraps whatever hooks are already active (e.g. the group quantizer of
:mod:`fewbit.quant`, docs/method.md §7), so it sees what is *actually* stored: a plain tensor, or a
packed object whose ``.nbytes`` is counted. Plain tensors are deduplicated by the address of
their untyped storage (a storage saved by several ops, or several views of one storage, counts
once, with the storage's full size, since that is what stays alive); packed objects by
identity.

Categories:

- ``"activation"``: tensors saved inside a pointwise activation module (``nn.GELU``,
  ``nn.SiLU``, Hugging Face ``transformers.activations`` modules, fewbit modules). Vanilla,
  that is the activation's input (and any intermediates of its formula); with fewbit, the
  b-bit codes (Novikov et al., "Few-bit Backward", ICML 2023, sec. 3).
- ``"compressed"``: packed objects returned by another pack hook (group-quantized tensors,
  Chen et al., "ActNN", ICML 2021).
- ``"other"``: every other saved tensor (inputs of Linear/Conv/norms/attention, the loss).
- ``"parameters"``: saved tensors whose storage is a parameter or buffer of the model. They
  are reported but *not* included in ``saved_bytes``: they are held in memory anyway.

Example:
    >>> import torch, fewbit.memory
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    >>> rep = fewbit.memory.saved_tensor_report(model, torch.randn(4, 8))
    >>> rep.by_category["activation"]   # the GELU input: 4 * 32 float32
    512
"""

from __future__ import annotations

import contextlib
import gc
import math
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from fewbit._checks import check_bits, check_group_size, check_positive_int
from fewbit._saved import Kept, keep, unpack

__all__ = [
    "CATEGORIES",
    "Report",
    "SavedTensorRecorder",
    "resume_recording",
    "is_activation_module",
    "saved_tensor_report",
    "compare",
    "peak_allocated_bytes",
    "held_bytes",
    "VARIANTS",
]

#: Report categories, in display order.
CATEGORIES = ("activation", "compressed", "other", "parameters")

#: The variants of :func:`compare`.
VARIANTS = ("vanilla", "fewbit", "fewbit+quant")


def _activation_class_names() -> frozenset[str]:
    from fewbit.activations import ACTIVATIONS

    return frozenset(a.module for a in ACTIVATIONS.values() if a.module)


_TORCH_ACTIVATION_NAMES = _activation_class_names()


def is_activation_module(module: nn.Module) -> bool:
    """Whether ``module`` is a pointwise activation (torch, Hugging Face or fewbit).

    torch: the ``nn`` classes that fewbit mirrors (``GELU``, ``SiLU``, ``ReLU``, ...; not
    ``Softmax`` or ``MultiheadAttention``). Hugging Face: any module defined in
    ``transformers.activations`` (``GELUActivation``, ``NewGELUActivation``, ...) and the
    model-specific ones :func:`fewbit.convert_` replaces (BLOOM's ``BloomGelu``). fewbit:
    any module defined under ``fewbit.modules``.
    """
    cls = type(module)
    mod = cls.__module__ or ""
    if mod.startswith("fewbit.modules") or mod.startswith("fewbit.functional"):
        return True
    if mod == "transformers.activations":
        return True
    if mod.startswith("transformers."):
        from fewbit.convert import _hf_factories

        return cls in _hf_factories()[0]
    return mod.startswith("torch.nn.modules.activation") and cls.__name__ in _TORCH_ACTIVATION_NAMES


def _packed_nbytes(obj: Any) -> int:
    """Bytes held by a packed object: its ``nbytes`` (int or callable), or the sum over tensors in it."""
    nb = getattr(obj, "nbytes", None)
    if callable(nb):
        nb = nb()
    if isinstance(nb, int):
        return nb
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_packed_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_packed_nbytes(o) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_packed_nbytes(o) for o in vars(obj).values() if isinstance(o, (torch.Tensor, tuple, list, dict)))
    return 0


#: What :func:`_tensors_in` does not walk into: values, modules and what holds a model's
#: tensors (optimizers, schedulers), modules of code, functions.
_NOT_WALKED = (str, bytes, int, float, type, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
               types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _tensors_in(obj: Any, depth: int = 0):
    """The tensors inside a packed object of a user's saved-tensor hooks (``save_on_cpu``'s
    ``(device, tensor)``, fewbit's hand-over of a kept tensor to them) or a batch object:
    tuples, lists, sets, dicts, attributes and slots, a few levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4:
        return
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors_in(o, depth + 1)
    elif isinstance(obj, (set, frozenset)):
        for o in obj:
            yield from _tensors_in(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o, depth + 1)
    elif not isinstance(obj, _NOT_WALKED) and obj is not None:
        # an object's fields, dataclasses inside dataclasses too (a nested batch had been
        # missed: the planner's prediction short by the batch; h78); not what holds a
        # model's tensors (an optimizer or scheduler a batch refers to had added Adam's
        # moments to it, 0.09 -> 33.7 MB; h79), and not an object whose fields raise
        try:
            fields = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
            for cls in type(obj).__mro__:
                slots = getattr(cls, "__slots__", ())
                slots = (slots,) if isinstance(slots, str) else slots
                fields += [getattr(obj, n, None) for n in slots if n != "__weakref__"]
        except Exception:  # noqa: BLE001 - a dead weakref.proxy, a __getattr__ that raises
            return
        for o in fields:
            if not isinstance(o, nn.Parameter):
                yield from _tensors_in(o, depth + 1)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = st.data_ptr()
    if ptr == 0:  # empty storage
        return None
    return (str(t.device), ptr)


_ACTIVE: list["SavedTensorRecorder"] = []


def resume_recording():
    """``active_recorder.resume()`` for the innermost active recorder, else a no-op context
    (also when that recorder's hooks are the innermost already).

    Use it inside code that pushes its own saved-tensor hooks, so that a surrounding
    :class:`SavedTensorRecorder` still sees what is saved.
    """
    if _ACTIVE and not _ACTIVE[-1]._is_top():
        return _ACTIVE[-1].resume()
    return contextlib.nullcontext()


class SavedTensorRecorder:
    """Context manager that records every tensor saved for backward, deduplicated.

    It composes with saved-tensor hooks already active when it is entered (e.g.
    ``fewbit.compress_activations``): their pack hook runs first and the recorder counts its
    result (a tensor by storage, any other object by ``.nbytes``). Hooks entered *inside* the
    recorder replace it (torch applies only the innermost pair), so enter the recorder last.

    Args:
        model: if given, its parameters and buffers are recognised (category
            ``"parameters"``) and forward hooks attribute each saved tensor to the innermost
            running submodule (by qualified name; ``""`` is the model itself).

    Attributes:
        saved_bytes: bytes kept for backward, parameters excluded.
        by_category: ``{category: bytes}`` for :data:`CATEGORIES`.
        by_module: ``{module name: bytes}`` (parameters excluded).
        num_saved: number of pack-hook calls.
        num_unique: number of distinct storages / packed objects counted.
        savers: ``{key: (bytes, [module names])}`` for each storage or packed object counted
            (parameters excluded): the modules that saved it, in call order, each once. One
            with several names is one tensor that several modules keep (a ReLU's result and
            the next Linear's input); ``by_module`` counts it for the first.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self._stack: list[str] = []
        self._act_stack: list[bool] = []
        self._param_keys: set = set()
        self._handles: list = []
        self._mine: dict[int, Callable] = {}  # id -> pack closures made by this recorder
        self._pushed: list[bool] = []  # per running module: did its pre-hook re-push us?
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded (call between steps to reuse one recorder)."""
        self.by_category: dict[str, int] = {c: 0 for c in CATEGORIES}
        self.by_module: dict[str, int] = {}
        self.num_saved = 0
        self.num_unique = 0
        self._seen: dict[Any, None] = {}
        self.savers: dict[Any, tuple[int, list[str]]] = {}
        self._keep: list[Any] = []  # keeps packed objects alive so that id() stays unique
        self._packed: dict[Any, tuple[Any, str]] = {}  # key -> (packed object, category): re-read at exit

    @property
    def saved_bytes(self) -> int:
        return sum(v for k, v in self.by_category.items() if k != "parameters")

    # -- hooks --------------------------------------------------------------
    def _add(self, key: Any, nbytes: int, category: str) -> None:
        name = self._stack[-1] if self._stack else ""
        if category != "parameters":
            names = self.savers.setdefault(key, (nbytes, []))[1]
            if name not in names:
                names.append(name)
        if key in self._seen:
            return
        self._seen[key] = None
        self.num_unique += 1
        self.by_category[category] += nbytes
        if category != "parameters":
            self.by_module[name] = self.by_module.get(name, 0) + nbytes

    def _make_hooks(self, inner: tuple[Callable, Callable] | None) -> tuple[Callable, Callable]:
        """Pack/unpack hooks that record into ``self`` and delegate to ``inner`` (if any)."""

        def pack(t: torch.Tensor) -> Any:
            self.num_saved += 1
            in_activation = any(self._act_stack)
            packed = inner[0](t) if inner is not None else keep(t)
            held = packed.tensor if isinstance(packed, Kept) else packed
            # a packed object without nbytes is a user's hooks' container (save_on_cpu's
            # (device, tensor), fewbit's hand-over of a kept tensor to them): its tensors by
            # storage, parameters apart; counted whole, a parameter had been "compressed"
            # bytes and a storage saved twice counted twice (h75)
            tensors = [held] if isinstance(held, torch.Tensor) else (
                list(_tensors_in(packed)) if getattr(packed, "nbytes", None) is None else None)
            if tensors is not None:
                for held in tensors:
                    key = _storage_key(held)
                    if key is None:
                        pass
                    elif key in self._param_keys:
                        self._add(key, held.untyped_storage().nbytes(), "parameters")
                    else:
                        category = "activation" if in_activation else "other"
                        self._add(key, held.untyped_storage().nbytes(), category)
            else:
                self._keep.append(packed)
                category = "activation" if in_activation else "compressed"
                key = ("packed", id(packed))
                self._packed[key] = (packed, category)
                self._add(key, _packed_nbytes(packed), category)
            return packed

        def unpack_(packed: Any) -> torch.Tensor:
            return inner[1](packed) if inner is not None else unpack(packed)

        pack.inner = inner  # the hooks it delegates to (fewbit.convert looks through it)
        self._mine[id(pack)] = pack
        return pack, unpack_

    def _is_top(self) -> bool:
        top = self._top_hooks()
        return top is not None and id(top[0]) in self._mine

    @staticmethod
    def _top_hooks() -> tuple[Callable, Callable] | None:
        try:
            return torch._C._autograd._top_saved_tensors_default_hooks(False)
        except (AttributeError, TypeError):  # pragma: no cover - private API moved
            return None

    @contextlib.contextmanager
    def resume(self):
        """Record again on top of hooks pushed since this recorder was entered.

        torch applies only the innermost saved-tensor hooks, so a context that pushes its own
        hooks (e.g. ``fewbit.compress_activations`` entered inside one module's forward) hides
        the recorder. Entering ``recorder.resume()`` inside that context composes with it.
        """
        with torch.autograd.graph.saved_tensors_hooks(*self._make_hooks(self._top_hooks())):
            yield self

    def __enter__(self) -> "SavedTensorRecorder":
        self._stack = []
        self._act_stack = []
        self._handles = []
        self._param_keys = set()
        if self.model is not None:
            for p in list(self.model.parameters()) + list(self.model.buffers()):
                k = _storage_key(p)
                if k is not None:
                    self._param_keys.add(k)
            for name, mod in self.model.named_modules():
                is_act = is_activation_module(mod)

                def pre(m, args, _name=name, _act=is_act):
                    self._stack.append(_name)
                    self._act_stack.append(_act)
                    # Another pre-hook (e.g. fewbit.convert_'s compressor) pushed its own
                    # saved-tensor hooks: record on top of them for this module's forward.
                    push = not self._is_top()
                    if push:
                        torch._C._autograd._push_saved_tensors_default_hooks(
                            *self._make_hooks(self._top_hooks()))
                    self._pushed.append(push)

                def post(m, args, out, _name=name):
                    if self._stack and self._stack[-1] == _name:
                        self._stack.pop()
                        self._act_stack.pop()
                        if self._pushed.pop():
                            torch._C._autograd._pop_saved_tensors_default_hooks()

                # pre runs after hooks registered earlier, post before them (prepend).
                self._handles.append(mod.register_forward_pre_hook(pre))
                self._handles.append(mod.register_forward_hook(post, always_call=True, prepend=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*self._make_hooks(self._top_hooks()))
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pushed = []
        self._mine = {}
        # a packed object can shrink after its save in the same forward (the compressor
        # shares one copy of a tensor two modules saved, and frees the first: counted at
        # its pack-time size, a report had been 15 % over what the graph held; h75)
        for key, (packed, category) in self._packed.items():
            before, names = self.savers.get(key, (None, None))
            if before is None:
                continue
            delta = _packed_nbytes(packed) - before
            if delta:
                self.by_category[category] += delta
                self.by_module[names[0]] = self.by_module.get(names[0], 0) + delta
                self.savers[key] = (before + delta, names)
        self._packed = {}
        self._keep = []  # packed objects stay alive through the graph, not through us


@dataclass
class Report:
    """What one forward+backward step saved for backward.

    Attributes:
        saved_bytes: bytes kept for backward (unique storages and packed objects), parameters
            and buffers excluded.
        by_category: ``{"activation"|"compressed"|"other"|"parameters": bytes}``.
        by_module: ``{qualified module name: bytes}`` (innermost running module at save time).
        num_saved: number of tensors saved (pack-hook calls, before deduplication).
        num_unique: distinct storages / packed objects.
        peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated`` during the step (bytes);
            ``None`` on CPU.
        loss: the loss value of the step.
        saved_tensors: per floating tensor that ``fewbit.convert_``'s compressor took
            in the step, in save order: ``{"index", "module", "kind", "shape",
            "compressor", "bits", "bytes"}`` (``bits``: of the codes, per element; the
            dtype's width where a policy kept it exact), then the masks it packed at 1 bit
            (``"compressor": "mask"``, ``"index": -1``); empty for a model without one.
    """

    saved_bytes: int
    by_category: dict[str, int]
    by_module: dict[str, int] = field(default_factory=dict)
    num_saved: int = 0
    num_unique: int = 0
    peak_bytes: int | None = None
    loss: float = math.nan
    saved_tensors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """Bytes saved by pointwise activations (inputs or fewbit codes)."""
        return self.by_category["activation"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (``by_module`` included)."""
        return {
            "saved_bytes": self.saved_bytes,
            "activation_bytes": self.activation_bytes,
            "compressed_bytes": self.by_category["compressed"],
            "other_bytes": self.by_category["other"],
            "parameter_bytes": self.by_category["parameters"],
            "num_saved": self.num_saved,
            "num_unique": self.num_unique,
            "peak_bytes": self.peak_bytes,
            "loss": self.loss,
            "by_module": dict(self.by_module),
            "saved_tensors": [dict(r) for r in self.saved_tensors],
        }

    def bits_histogram(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """``{(compressor, bits): (tensors, elements, bytes)}`` over :attr:`saved_tensors`."""
        return bits_histogram(self.saved_tensors)

    def average_bits(self) -> float | None:
        """Bits per element of the compressed tensors' codes, weighted by elements (stats
        and 1-bit masks excluded: the average a policy's budget counts); None without
        :attr:`saved_tensors`."""
        hist = {k: v for k, v in self.bits_histogram().items() if k[0] != "mask"}
        elements = sum(e for _, e, _ in hist.values())
        return sum(k[1] * e for k, (_, e, _) in hist.items()) / elements if elements else None

    def format(self, top: int = 10) -> str:
        """A readable table in MiB, with the ``top`` largest modules (``top`` >= 0).

        Raises:
            ValueError: ``top`` is not an integer >= 0 (``-1`` had dropped the last module).
        """
        check_positive_int(top, "top", minimum=0)
        mib = 2.0**20
        lines = [f"saved for backward: {self.saved_bytes / mib:.3f} MiB "
                 f"({self.num_unique} unique of {self.num_saved} saved)"]
        for c in CATEGORIES:
            lines.append(f"  {c:<11} {self.by_category[c] / mib:10.3f} MiB")
        if self.peak_bytes is not None:
            lines.append(f"  peak CUDA   {self.peak_bytes / mib:10.3f} MiB")
        if self.saved_tensors:
            lines.extend(format_bits_histogram(self.saved_tensors, self.average_bits(), "compressed saved tensors"))
        mods = sorted(self.by_module.items(), key=lambda kv: -kv[1])[:top]
        if mods:
            lines.append("largest modules:")
            for name, b in mods:
                lines.append(f"  {name or '<model>':<40} {b / mib:10.3f} MiB")
        return "\n".join(lines)


def bits_histogram(saved_tensors: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int, int]]:
    """``{(compressor, bits): (tensors, elements, bytes)}`` over rows of
    :attr:`Report.saved_tensors` (``compressor``, ``bits``, ``shape``, ``bytes``), by bits."""
    out: dict[tuple[str, int], tuple[int, int, int]] = {}
    for r in saved_tensors:
        key = (r["compressor"], r["bits"])
        n, e, b = out.get(key, (0, 0, 0))
        out[key] = (n + 1, e + math.prod(r["shape"]), b + r["bytes"])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def format_bits_histogram(saved_tensors: list[dict[str, Any]], average_bits: float | None, what: str) -> list[str]:
    """The lines of :func:`bits_histogram`'s table: a header naming ``what`` and
    ``average_bits`` (:meth:`Report.average_bits`), then a row per (compressor, bits) with its
    tensors, elements, MiB and the bits held per element with statistics (DIVISION's block
    means, the outlier compressor's exact channels) beside the codes' width."""
    hist = bits_histogram(saved_tensors)
    if not hist:
        return [f"{what}: none compressed"]
    shown = (f"average {average_bits:.2f} bits per element, stats and 1-bit masks excluded"
             if average_bits is not None else "masks only")
    lines = [f"{what} by bits ({shown}; held: bits per element with statistics):"]
    for (name, bits), (n, e, b) in hist.items():
        held = f" {8 * b / e:6.2f} held" if e else ""
        lines.append(f"  {name:<11} {bits:>2} bits {n:5d} tensors {e:12d} elements {b / 2.0**20:10.3f} MiB{held}")
    return lines


#: Bytes of the sentinel allocation between the two runs of :func:`peak_allocated_bytes`'s
#: CPU measurement (an odd size no tensor of a step has).
_SENTINEL = 1_234_567


def peak_allocated_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak bytes allocated by torch's allocator during ``fn()`` above those allocated when
    it starts.

    On CUDA ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` at the start. On
    the CPU, which keeps no peak, the maximum over the call of the bytes of the tensors
    created minus those destroyed, from ``torch.profiler``'s memory timeline
    (``profile_memory=True``, what ``export_memory_timeline`` draws; the allocator's tensors,
    not the process's resident memory; frees inside composite ops included), over the
    second of two runs of ``fn`` (the CPU allocator reports no free of a block allocated
    before profiling began: after a first run those are the first run's). ``fn`` runs twice
    on the CPU, once on CUDA; under the profiler it is slower.

    Raises:
        ValueError: ``device`` is neither a CPU nor a CUDA device (a meta, MPS or XPU
            device had been measured as the CPU; h75).
        RuntimeError: the profiler's memory timeline lacks the marker between the runs
            (a torch whose private ``_memory_profile`` changed); on the CPU, a
            ``torch.profiler`` session is already running (``fn`` is not run): a second one
            ends it, and the caller's trace came back empty.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)) - start
    from torch.profiler import ProfilerActivity, profile

    if torch._C._autograd._profiler_enabled():
        raise RuntimeError("a torch.profiler session is running: the CPU peak is measured with a profiler "
                           "of its own, which would end that session")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
        sentinel = torch.empty(_SENTINEL, dtype=torch.uint8)  # marks the second run's start
        del sentinel
        fn()
    held, start, top, seen = 0, None, 0, 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action.name not in ("CREATE", "DESTROY"):
            continue
        held += size if action.name == "CREATE" else -size
        if start is None:
            seen += size == _SENTINEL and action.name == "DESTROY"
            if seen:
                start = top = held
        else:
            top = max(top, held)
    if start is None:
        raise RuntimeError("the sentinel allocation is missing from torch.profiler's memory timeline")
    return top - start


def held_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``objects`` (modules: their
    parameters, gradients and buffers; optimizers: their state; tensors, mappings, sequences
    and sets of them; None), each storage counted once; a sparse tensor by its indices and
    values.

    Raises:
        TypeError: an object of another type (a string, a number: it had counted 0; h75).
    """
    seen: set = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if t.layout == torch.sparse_coo:  # an Embedding(sparse=True)'s gradient had counted 0
            add(t._indices())
            add(t._values())
        elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            compressed, plain = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                                 else (t.ccol_indices(), t.row_indices()))
            add(compressed)
            add(plain)
            add(t.values())
        elif t.layout == torch.strided:
            key = _storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()

    def walk(o: Any) -> None:
        if isinstance(o, nn.Module):
            for p in o.parameters():
                add(p)
                add(p.grad)
            for b in o.buffers():
                add(b)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                walk(state)
        elif isinstance(o, torch.Tensor):
            add(o)
        elif isinstance(o, Mapping):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v)

    for o in objects:  # inside them anything else (an optimizer's step count) holds no storage
        if o is not None and not isinstance(o, (nn.Module, torch.optim.Optimizer, torch.Tensor, Mapping, list, tuple,
                                                set, frozenset)):
            raise TypeError(f"held_bytes takes modules, optimizers, tensors and mappings, sequences or sets of "
                            f"them; got {type(o).__name__} {o!r}"[:300])
        walk(o)
    return total


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().pow(2).mean()
    if isinstance(output, Mapping):
        values: Iterable[Any] = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        values = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            return v.float().pow(2).mean()
    raise TypeError(
        f"cannot find a loss in the model output of type {type(output).__name__}; pass loss_fn"
    )


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a one-element tensor (what ``loss_fn`` must return).

    Raises:
        TypeError: anything else, with what it is.
        ValueError: a loss that does not require grad (nothing would be saved).
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: nothing is saved for backward (no parameter of the "
                         "model requires grad and no input does; unfreeze the parameters to measure training)")
    return loss


def saved_tensor_report(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Report:
    """Run one forward+backward of ``model`` and report what was saved for backward.

    Saved-tensor hooks already active (``fewbit.compress_activations``) are composed with, so
    the report counts their packed output (see :class:`SavedTensorRecorder`).

    Args:
        model: any ``nn.Module``; gradients are accumulated into its parameters (call
            ``model.zero_grad()`` afterwards if that matters).
        inputs: a tensor (``model(inputs)``), a tuple/list (``model(*inputs)``) or a mapping
            (``model(**inputs)``, e.g. Hugging Face ``input_ids``/``labels``).
        loss_fn: ``loss_fn(output) -> scalar``. Default: ``output.loss`` when present (Hugging
            Face with labels), else the mean square of the first floating output that
            requires grad.

    Returns:
        A :class:`Report` (bytes are exact counts of unique storages / packed objects).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` or no loss can be found.
        ValueError: if the loss does not require grad (a frozen model on inputs that do not).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss_fn = loss_fn or _default_loss
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rec = SavedTensorRecorder(model)
    with torch.enable_grad():
        with rec:
            output = _call(model, inputs)
            loss = loss_fn(output)
        check_loss(loss)
        loss.backward()
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
    return Report(
        saved_tensors=_saved_tensors(model),
        saved_bytes=rec.saved_bytes,
        by_category=dict(rec.by_category),
        by_module=dict(rec.by_module),
        num_saved=rec.num_saved,
        num_unique=rec.num_unique,
        peak_bytes=peak,
        loss=float(loss.detach()),
    )


def _saved_tensors(model: nn.Module) -> list[dict[str, Any]]:
    """The per-tensor rows of :attr:`Report.saved_tensors` from ``model``'s compressor."""
    from fewbit.convert import compressor_of

    comp = compressor_of(model)
    if comp is None:
        return []
    return [
        {"index": r.index, "module": r.fqn, "kind": r.kind, "shape": list(r.shape),
         "compressor": r.compressor, "bits": r.bits, "bytes": r.nbytes}
        for r in [r for _, r in sorted(comp.records.items())] + comp.masks
    ]


def compare(
    model_factory: Callable[[], nn.Module],
    inputs: Any,
    *,
    bits: int = 3,
    saved_bits: int | str = 4,
    group_size: int = 256,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    variants: Iterable[str] = VARIANTS,
    average_bits: float | None = None,
    compressor: str = "group",
    fused_cross_entropy: bool = False,
    layer_bits: Mapping[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Saved-for-backward memory of one step for the vanilla and fewbit variants.

    - ``"vanilla"``: the model as built;
    - ``"fewbit"``: pointwise activations replaced by ``fewbit.convert_(model, bits=bits)``
      (Novikov et al., ICML 2023);
    - ``"fewbit+quant"``: the same, and the tensors saved by linear, conv, norm and attention
      layers group-quantized to ``saved_bits`` bits with groups of ``group_size``
      (``fewbit.convert_(model, fewbit.Config(activation_bits=bits, saved_bits=saved_bits,
      group_size=group_size))``; ActNN-style, docs/method.md §7; tensors below the quantizer's
      ``min_numel`` and those saved by the loss are kept as they are). With
      ``saved_bits="auto"`` the bits come from GACT's sensitivity on ``inputs`` (one
      ``summary.compressor.adapt`` call before the counted step; docs/compression.md §2);
      ``compressor`` picks DIVISION or Adacc's compressors instead of the group quantizer;
      ``fused_cross_entropy`` also computes a Hugging Face causal LM's loss with the exact
      chunked linear + cross-entropy (no saved logits; docs/compression.md §5);
      ``layer_bits`` gives some layer kinds other bits (``{"block": 4}``: ActNN's per-layer
      settings, ``fewbit.Config(layer_bits=...)``).

    Each variant gets a fresh model from ``model_factory`` (seeded with 0 before each call).

    Args:
        model_factory: ``() -> nn.Module``.
        inputs: as for :func:`saved_tensor_report`.
        bits: few-bit code width for activations, 1..8.
        saved_bits: compressor width, one of 1, 2, 4, 8, or ``"auto"`` (GACT).
        group_size: elements per quantization group (>= 1).
        loss_fn: as for :func:`saved_tensor_report`.
        variants: which of :data:`VARIANTS` to run.
        average_bits: GACT's budget with ``saved_bits="auto"`` (``fewbit.Config``).
        compressor: ``"group"``, ``"division"`` or ``"adacc"`` (``fewbit.Config``).
        fused_cross_entropy: ``fewbit.Config(fused_cross_entropy=...)`` of "fewbit+quant".
        layer_bits: ``fewbit.Config(layer_bits=...)`` of "fewbit+quant": layer kind -> bits
            (1, 2, 4, 8), with an integer ``saved_bits`` and the group quantizer.

    Returns:
        ``{variant: {"saved_bytes", "activation_bytes", "compressed_bytes", "other_bytes",
        "parameter_bytes", "peak_bytes", "loss", "converted", "saved_ratio",
        "activation_ratio", "saved_tensors", "average_bits"}}``; the ratios are vanilla /
        variant (``None`` when vanilla was not run or the variant's bytes are 0).
        ``converted`` is the number of activation modules replaced; ``saved_tensors`` and
        ``average_bits`` as :class:`Report` (fewbit+quant only); with ``layer_bits``,
        fewbit+quant's ``layer_bits_tensors``: ``{kind: tensors given that kind's bits}``.

    Raises:
        ValueError: for bits outside 1..8, saved_bits outside {1, 2, 4, 8, "auto"},
            average_bits, compressor or layer_bits refused by ``fewbit.Config``, group_size < 1 or an
            unknown variant; and when ``model_factory`` returns a model fewbit already
            converted (the same object as an earlier variant's).
        TypeError: ``model_factory`` is a model, not a callable that builds one, or what it
            returns is not an ``nn.Module``.
    """
    import fewbit

    bits = check_bits(bits, "bits")
    group_size = check_group_size(group_size)
    quant_config = fewbit.Config(  # validates saved_bits, average_bits, compressor
        activation_bits=bits, saved_bits=saved_bits, group_size=group_size, average_bits=average_bits,
        compressor=compressor, fused_cross_entropy=fused_cross_entropy, layer_bits=layer_bits,
    )
    variants = (variants,) if isinstance(variants, str) else tuple(variants)  # "vanilla": one variant
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {v!r}")

    if isinstance(model_factory, nn.Module) or not callable(model_factory):
        raise TypeError(
            f"model_factory must be a callable that builds a new model, e.g. lambda: MyModel(config), "
            f"got {'a ' + type(model_factory).__name__ + ' instance' if isinstance(model_factory, nn.Module) else type(model_factory).__name__}"
            " (each variant converts and steps its own model)"
        )
    out: dict[str, dict[str, Any]] = {}
    built: list[weakref.ref] = []  # the models of earlier variants, while something holds them
    for variant in variants:
        torch.manual_seed(0)
        model = model_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_factory must return a torch.nn.Module, got {type(model).__name__}")
        if any(r() is model for r in built) or _fewbit_converted(model):
            raise ValueError(
                f"model_factory must build a new model on each call: for variant {variant!r} it returned "
                f"a {type(model).__name__} that fewbit already converted (the same object as an earlier "
                "variant's?); build the model inside the factory"
            )
        built.append(weakref.ref(model))
        converted = 0
        if variant != "vanilla":
            config = quant_config if variant == "fewbit+quant" else fewbit.Config(
                activation_bits=bits, group_size=group_size
            )
            converted = _convert(model, config)
            if config.saved_bits == "auto":
                from fewbit.convert import compressor_of

                step_loss = loss_fn or _default_loss
                compressor_of(model).adapt(model, lambda m=model: step_loss(_call(m, inputs)))
        with warnings.catch_warnings():  # reported as layer_bits_tensors instead
            warnings.filterwarnings("ignore", message="layer_bits for .* changed nothing")
            rep = saved_tensor_report(model, inputs, loss_fn=loss_fn)
        d = rep.to_dict()
        d.pop("by_module")
        d["average_bits"] = rep.average_bits()
        d["converted"] = converted
        if variant == "fewbit+quant" and quant_config.layer_bits:
            d["layer_bits_tensors"] = _layer_bits_tensors(model)
        out[variant] = d
        # freed before the next variant is built: it sits in reference cycles (hooks), and on
        # a GPU it and its gradients were still allocated under the next one's peak
        del model
        gc.collect()
    base = out.get("vanilla")
    for d in out.values():
        for key, ratio in (("saved_bytes", "saved_ratio"), ("activation_bytes", "activation_ratio")):
            d[ratio] = (base[key] / d[key]) if base is not None and base[key] and d[key] else None
    return out


def _layer_bits_tensors(model: nn.Module) -> dict[str, int]:
    """``{kind: tensors}`` that ``Config(layer_bits=...)`` gave each kind's bits in the
    counted step(s) (:attr:`fewbit.quant.policies.LayerBitsPolicy.chosen`)."""
    from fewbit.convert import compressor_of
    from fewbit.quant.policies import layer_bits_chosen

    comp = compressor_of(model)
    return layer_bits_chosen(comp.policy) if comp is not None else {}


def _fewbit_converted(model: nn.Module) -> bool:
    """Whether :func:`fewbit.convert_` (or a plan) has been applied to ``model``: fewbit's
    forward hooks are on it or inside it (a model built with fewbit modules by hand is not)."""
    from fewbit import convert as fc

    hooks = (fc._StepHook, fc._EnterHook, fc._ActivationModeHook)
    return any(any(isinstance(h, hooks) for h in m._forward_pre_hooks.values()) or fc._has_plan_hooks(m)
               for m in model.modules())


def _convert(model: nn.Module, config: Any) -> int:
    """Apply ``fewbit.convert_(model, config)``; return the number of activation modules replaced."""
    import fewbit

    summary = fewbit.convert_(model, config)
    return len(summary.replaced)
