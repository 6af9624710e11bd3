"""The few-bit pointwise activation: exact forward, b-bit codes saved, table backward.

Novikov et al., "Few-bit Backward", ICML 2023, sec. 3 (docs/method.md §1):
forward ``y = f(x)`` (torch's own kernel), ``c = code(x)`` packed at ``bits`` bits per
element; backward ``grad_x = grad_y * values[c]``.
"""

from __future__ import annotations

import struct
import threading
import weakref
from typing import Callable, Mapping

import torch
import torch.autograd.forward_ad as _fwad

from fewbit import _traced
from fewbit._caches import call_key, remember
from fewbit._checks import check_float_tensor
from fewbit.activations import ACTIVATIONS, ALIASES, canonical_params, forward_callable, get_activation, import_callable
from fewbit.ops import _cpu_loader
from fewbit.ops import _ops  # noqa: F401  (registers fewbit::encode / fewbit::decode_mul)
from fewbit.ops._ops import _encode_reference_path as encode_reference_path
from fewbit.ops._nonfinite import CAPACITY, derive_grad_rules, nonfinite_record_reference, patch_reference
from fewbit.ops._reference import compute_dtype, decode_mul_reference, round_down_to_float32
from fewbit.table import Table

__all__ = ["pointwise", "encode", "decode_mul", "table_tensors", "DecodeMul"]

_lock = threading.Lock()
_table_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_fn_cache: dict[str, tuple[Callable[..., torch.Tensor], object]] = {}


@_traced.host_side
def table_tensors(
    table: Table, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table as kernel-ready tensors for inputs of ``dtype`` on ``device``, cached.

    One set of tensors exists per (table contents, device, compute dtype); every call
    shares them (nothing is copied per call).

    Returns:
        ``(borders, codes, values)``: ``borders`` ``(m-1,)`` float64 for float64 inputs,
        else float32 rounded DOWN (exact comparisons, see
        :func:`fewbit.ops.round_down_to_float32`); ``codes`` ``(m,)`` int64; ``values``
        ``(2**bits,)`` in the compute dtype (float64 for float64, else float32).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cdt = compute_dtype(dtype)
    key = (table.bits, table.borders, table.codes, table.values, device, cdt)
    hit = _table_cache.get(key)
    if hit is not None:
        return hit
    with _lock:
        hit = _table_cache.get(key)
        if hit is None:
            b64 = torch.tensor(table.borders, dtype=torch.float64)
            borders = b64 if cdt == torch.float64 else round_down_to_float32(b64)
            codes = torch.tensor(table.codes, dtype=torch.int64)
            values = torch.tensor(table.values, dtype=torch.float64).to(cdt)
            hit = tuple(t.to(device) for t in (borders, codes, values))
            remember(_table_cache, key, hit)
    return hit


def _lookup_fn(fn: str) -> tuple[Callable[..., torch.Tensor], object]:
    if not isinstance(fn, str):
        raise TypeError(f"fn must be a registry name or a 'package.module:callable' string, got {type(fn).__name__}")
    if ":" in fn:
        return forward_callable(import_callable(fn)), None  # ValueError naming fn; int arguments as ints
    act = get_activation(fn)  # ValueError for unknown names
    return act.torch_fn, act


def _resolve_fn(fn: str) -> tuple[Callable[..., torch.Tensor], object]:
    """``(callable, Activation or None)`` for a registry name or ``"package.module:callable"``."""
    hit = _fn_cache.get(fn)
    if hit is None:
        hit = _fn_cache[fn] = _lookup_fn(fn)
    return hit


def _require_table(table) -> None:
    if not isinstance(table, Table):
        raise TypeError(f"table must be a fewbit.table.Table, got {type(table).__name__}")


def _check_table(table: Table, act, full_params: Mapping[str, float]) -> None:
    _require_table(table)
    if act is None:
        return
    tname = ALIASES.get(table.name, table.name)
    if tname in ACTIVATIONS:
        if tname != act.name:
            raise ValueError(f"table is for {table.name!r}, not for fn {act.name!r}")
        if canonical_params(act, table.params) != dict(full_params):
            raise ValueError(
                f"table for {act.name} was made for params {canonical_params(act, table.params)}, "
                f"got params {dict(full_params)}"
            )


_patch_cache: dict[tuple, torch.Tensor] = {}
_prepared: dict[tuple, tuple[bool, int, bytes, str | None]] = {}


def _patch_key(patch: tuple[float, ...]) -> bytes:
    """A patch's 24 float64s as bytes: a dict key that holds NaN (a tuple of floats holding
    NaN equals no other tuple, so every setting had added a row of its own)."""
    return struct.pack(f"<{len(patch)}d", *patch)


@_traced.host_side
def _patch_tensor(patch: bytes, device: torch.device, cdt: torch.dtype) -> torch.Tensor:
    """The shared device tensor of a patch (fewbit.ops._nonfinite; :func:`_patch_key`),
    cached like the values, the oldest dropped past :data:`fewbit._caches.LIMIT`."""
    key = (patch, device, cdt)
    hit = _patch_cache.get(key)
    if hit is None:
        with _lock:
            hit = _patch_cache.get(key)
            if hit is None:
                row = struct.unpack(f"<{len(patch) // 8}d", patch)
                hit = remember(_patch_cache, key, torch.tensor(row, dtype=torch.float64).to(cdt).to(device))
    return hit


@_traced.host_side
def _prepare(fn: str, params: tuple, table: Table, dtype: torch.dtype, device: torch.device) -> tuple:
    """``(select_zero, classes, patch, what)`` of torch's backward rules for this
    setting (:func:`fewbit.ops._nonfinite.derive_grad_rules`), cached; ``what`` names a
    fitted table in the double-backward error (``None`` for an exact table).

    It also fills the tensor caches of this setting (table tensors, patch). Traced code
    (torch.compile) reaches it only through :func:`_setting_for_trace`.
    """
    key = (fn, params, table.bits, table.borders, table.codes, table.values, table.weight, dtype, device)
    hit = _prepared.get(key)
    if hit is not None:
        return hit
    torch_fn, _ = _lookup_fn(fn)  # not _resolve_fn: its cache is read by traced code first
    rules = derive_grad_rules(torch_fn, dict(params), table, dtype, device)
    values = table_tensors(table, device, dtype)[2]
    patch = _patch_key(rules.patch)
    if rules.classes:
        _patch_tensor(patch, values.device, values.dtype)
    what = None if table.weight == "exact" else f"{fn} ({table.bits}-bit fitted table)"
    hit = (rules.select_zero, rules.classes, patch, what)
    with _lock:
        remember(_prepared, key, hit)
    return hit


@_traced.constant
def _setting_for_trace(fn: str, params: tuple, table: Table, dtype: torch.dtype, device: torch.device) -> str:
    """What the traced path (torch.compile, torch.func) needs of a setting: ``(select_zero,
    classes, what, borders, codes, values, patch)`` (:func:`_prepare`, :func:`table_tensors`,
    the patch or None), held by :mod:`fewbit._traced` under the name returned. torch.compile
    runs it once, eagerly, while tracing (:func:`fewbit._traced.constant`): its caches' locks and torch's
    autograd probes are never traced, and the traced code reads no cache dict, whose
    snapshot would miss a setting prepared later in the same trace."""
    select_zero, classes, patch, what = _prepare(fn, params, table, dtype, device)
    borders, codes, values = table_tensors(table, device, dtype)
    patch = _patch_tensor(patch, values.device, values.dtype) if classes else None
    key = ("setting", fn, params, table.bits, table.borders, table.codes, table.values, table.weight, dtype,
           values.device)
    return _traced.hold(key, (select_zero, classes, what, borders, codes, values, patch))


_ARE_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def _recording_program() -> bool:
    """Whether ``torch.jit.trace`` or ``torch.export`` records a program of the forward: then
    fewbit's activations run torch's own function and its hooks stand aside (a program for
    deployment; the few-bit backward saves memory in training, and tracing it crashed
    ``torch.jit.trace`` and failed ``torch.export`` in a fresh process).

    Export is read from torch's flag, not from ``torch.compiler.is_exporting()``, which
    Dynamo evaluated from a table where it is always True (pytorch/pytorch#176347, fixed by
    #176499; torch 2.13 reads the flag there; on an H100 with torch 2.11 fewbit stood aside
    under every ``torch.compile``, saved what torch saves and gave torch's gradient: a
    compiled model's peak memory equal to the vanilla one's)."""
    return torch.jit.is_tracing() or _exporting()


def _exporting() -> bool:
    """Whether ``torch.export`` runs: ``torch.compiler._is_exporting_flag``, which export
    sets and Dynamo reads as the module attribute it is. torch 2.4 and 2.5 have neither the
    flag nor ``torch.compiler.is_exporting``: there export is not told apart (False). A
    strict export (``strict=True``, Dynamo) sets the flag in torch 2.13 but not in some
    earlier versions (2.7.1 is reported), where it records fewbit's ops; the non-strict
    default sets it."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def _compiling_or_recording() -> bool:
    """``torch.compile`` (or ``torch.export``) traces, or ``torch.jit.trace`` records: hooks
    that push saved-tensor hooks or torch-function modes stand aside."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap, ...) is running; True if unknown."""
    return True if _ARE_TRANSFORMS_ACTIVE is None else bool(_ARE_TRANSFORMS_ACTIVE())


try:
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _interpreters
except ImportError:  # pragma: no cover - other torch layouts
    _interpreters = None


def _forward_mode_active() -> bool:
    """Whether a forward-mode transform (``torch.func.jvp``, ``jacfwd``, ``hessian``) is
    among the running torch.func transforms (call only when :func:`_transforms_active`)."""
    if _interpreters is None:
        return False
    return any(i.key() == _TransformType.Jvp for i in _interpreters())


class DecodeMul(torch.autograd.Function):
    """``fewbit::decode_mul`` as a differentiable function of ``grad_output``.

    The op is linear in ``grad_output`` and diagonal, so its derivative applied to
    ``grad_grad`` is the op itself applied to ``grad_grad``; nothing flows to the codes,
    values or record. Used by the pointwise backward when a graph of the backward is
    built (``create_graph=True``, ``torch.func``); written with ``setup_context`` so that
    ``torch.func`` transforms accept it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(grad, packed, values, bits, nonfinite, patch, select_zero):
        return torch.ops.fewbit.decode_mul(grad, packed, values, bits, nonfinite, patch, select_zero)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, packed, values, bits, nonfinite, patch, select_zero = inputs
        ctx.save_for_backward(packed, values, nonfinite, patch)
        ctx.bits, ctx.select_zero = bits, select_zero

    @staticmethod
    def backward(ctx, grad_grad):
        packed, values, nonfinite, patch = ctx.saved_tensors
        gg = DecodeMul.apply(grad_grad, packed, values, ctx.bits, nonfinite, patch, ctx.select_zero)
        return gg, None, None, None, None, None, None


class _NoSecondDerivative(torch.autograd.Function):
    """Identity on a few-bit gradient of a fitted table; differentiating it raises.

    ``d/dx (grad * q(x))`` needs ``f''(x)``, which b-bit codes of a fitted table cannot
    give (``q`` is piecewise constant; its derivative is 0 where torch's ``f''`` is not),
    so a double backward through it would silently drop that term.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_input, anchor, what):
        # anchor: an empty tensor computed from the activation's input x, so that this
        # node lies on every path from the gradient back to x (and to grad_output)
        return grad_input.view_as(grad_input)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.what = inputs[2]

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(
            f"fewbit: double backward through {ctx.what} is not supported: its gradient comes from a "
            "fitted few-bit table, and the second-derivative term f''(x) cannot be formed from the saved "
            "b-bit codes (it would silently be 0). Use torch's own activation where a gradient of a "
            "gradient is needed (gradient penalty, Hessian products); stepwise activations (ReLU family, "
            "exact tables) support it exactly."
        )


def _forward(x, borders, codes, values, patch, bits, fn, params, inplace, classes, capacity, select_zero, what,
             anchor):
    """``(y, packed, record)`` through the ``torch.ops.fewbit`` ops (torch.compile and
    torch.func; eager calls take :class:`_FewBitPointwiseDirect`): codes (and the
    non-finite record, of a fixed ``capacity``) from the exact ``x``, before any in-place
    write; then ``y = fn(x)``."""
    record = None
    if classes == 0:
        packed = torch.ops.fewbit.encode(x, borders, codes, bits)
    else:  # fixed capacity: no data-dependent Python (CUDA, compile, torch.func)
        packed, record = torch.ops.fewbit.encode_nonfinite(x, borders, codes, bits, classes, capacity)
    y = fn(x, **params)
    if inplace:
        x.copy_(y)
        y = x
    return y, packed, record


def _save(ctx, inputs, packed, record) -> None:
    x, _, _, values, patch, bits, _, _, inplace, _, _, select_zero, what, anchor = inputs
    if inplace:
        ctx.mark_dirty(x)
    if record is None:
        ctx.save_for_backward(packed, values)
    else:
        ctx.save_for_backward(packed, values, record, patch)
    ctx.bits, ctx.select_zero, ctx.what = bits, select_zero, what
    # An attribute, not a saved tensor: it holds no data (0 elements) and no reference
    # back to this node; saving it would count as a saved activation.
    ctx.anchor = anchor


def _unpack_saved(ctx) -> tuple:
    """``(packed, values, record, patch)`` as saved by :func:`_save` or the direct node."""
    saved = ctx.saved_tensors
    return (saved[0], saved[1]) + ((saved[2], saved[3]) if len(saved) > 2 else (None, None))


def _backward_graph(grad_output, packed, values, record, patch, bits, select_zero, what, anchor):
    """The backward when a graph of it is being built (``create_graph=True``,
    ``torch.func``): differentiable in ``grad_output``; for a fitted table (``what`` set)
    differentiating it again raises (:class:`_NoSecondDerivative`)."""
    grad_input = DecodeMul.apply(grad_output, packed, values, bits, record, patch, select_zero)
    if what is not None:
        grad_input = _NoSecondDerivative.apply(grad_input, anchor, what)
    return grad_input


def _backward(ctx, grad_output):
    packed, values, record, patch = _unpack_saved(ctx)
    if torch.is_grad_enabled():  # a graph of the backward is being built
        return _backward_graph(grad_output, packed, values, record, patch, ctx.bits, ctx.select_zero, ctx.what,
                               ctx.anchor)
    return torch.ops.fewbit.decode_mul(grad_output, packed, values, ctx.bits, record, patch, ctx.select_zero)


class _FewBitPointwise(torch.autograd.Function):
    """Autograd of :func:`pointwise` for ``torch.func`` (``setup_context`` style; the
    codes and record are outputs so that ``setup_context`` can save them): saves only the
    packed codes and the shared values (plus, when the input had NaN or inf of a recorded
    class, their record and the shared patch; fewbit.ops._nonfinite)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return _forward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, packed, record = output
        ctx.mark_non_differentiable(*(t for t in (packed, record) if t is not None))
        _save(ctx, inputs, packed, record)

    @staticmethod
    def backward(ctx, grad_output, _packed, _record):
        return (_backward(ctx, grad_output),) + (None,) * 13


class _FewBitPointwiseEager(torch.autograd.Function):
    """The same in the ``forward(ctx, ...)`` style, used when no ``torch.func`` transform
    is active: it returns only ``y`` (fewer outputs for autograd to wrap), and ``apply``
    of a ``setup_context`` Function binds its arguments with ``inspect.signature`` on
    every call; together tens of microseconds per call."""

    @staticmethod
    def forward(ctx, *args):
        y, packed, record = _forward(*args)
        _save(ctx, args, packed, record)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        return (_backward(ctx, grad_output),) + (None,) * 13


def pointwise(
    input: torch.Tensor,
    table: Table,
    fn: str,
    params: Mapping[str, float] | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Apply a pointwise activation with a few-bit backward (Novikov et al., ICML 2023).

    Forward is exactly ``get_activation(fn).torch_fn(input, **params)`` (torch's own
    kernel, bitwise equal). If a gradient is needed, ``code(input)`` of the exact input
    value is packed at ``table.bits`` bits per element and is, with the table's shared
    values tensor, all that is saved for backward: ``ceil(numel * bits / 8)`` bytes.
    Backward returns ``grad_output * values[code]`` rounded as documented in
    :mod:`fewbit.ops._reference` (fp16/bf16 grads multiply in float32).

    Where torch's own backward differs from ``grad * level`` the gradient is torch's
    (rules derived once from torch per function, parameters, table, dtype and device;
    :mod:`fewbit.ops._nonfinite`):

    - NaN and +-inf inputs get torch's gradient at NaN/+-inf (e.g. NaN for GELU). Their
      positions are recorded at encode time; on CPU in eager mode that costs nothing when
      all inputs are finite and 8 bytes per such element otherwise; on CUDA, under
      ``torch.compile`` and ``torch.func`` (no host read) ``8 * (1 + 1024)`` bytes per call, and past 1024
      such elements in one call the whole gradient of that call is NaN (loud).
    - Exact (stepwise) tables give +0 where the level is 0 (torch's select), so their
      gradient equals torch's bit for bit also for NaN or infinite ``grad_output``.

    Double backward (``create_graph=True``, gradient penalties, ``torch.func.grad`` of
    ``torch.func.grad``): the backward is linear in ``grad_output`` and differentiable in
    it. The term ``grad * f''(x)`` is 0 for the piecewise-constant ``q``: exact for exact
    (stepwise) tables, where torch's ``f''`` is 0 too, so those support it exactly. For a
    fitted table that term cannot be formed from b-bit codes: differentiating its
    gradient raises ``RuntimeError`` (computing the gradient with ``create_graph=True``
    or under ``torch.func.grad`` / ``torch.func.vjp`` works).

    Args:
        input: any shape (0-d and empty allowed), float16/bfloat16/float32/float64, any
            layout and device with a backend (CPU: numba, CUDA: Triton).
        table: the :class:`fewbit.table.Table` of ``fn`` for these ``params``.
        fn: registry name (``"gelu"``, see :mod:`fewbit.activations`) or
            ``"package.module:callable"`` taking ``(input, **params)``.
        params: the activation's parameters (registry defaults filled in).
        inplace: write ``y`` into ``input`` and return it (codes are computed first), as
            torch's ``inplace=True`` activations; autograd tracks it (``mark_dirty``).
            torch's in-place checks run before anything is written: a leaf that requires
            grad (a ``Parameter``) or a view of one raises ``RuntimeError`` and is left
            untouched.

    Returns:
        ``y`` of ``input``'s shape and dtype (``input`` itself when ``inplace``).

    Raises:
        TypeError: if ``input`` is not a floating tensor, ``table`` not a Table, or ``fn``
            not a string.
        ValueError: for an unknown ``fn``, bad ``params``, or a table made for another
            function or other parameters.
        RuntimeError: for ``inplace=True`` on a tensor torch refuses to modify in place
            (before writing), and when differentiating the gradient of a fitted table.
    """
    check_float_tensor(input, "input")
    torch_fn, act = _resolve_fn(fn)
    full = canonical_params(act, params) if act is not None else dict(params or {})
    _check_table(table, act, full)
    return _apply(input, table, fn, torch_fn, full, inplace)


def _requires_grad(t: torch.Tensor) -> bool:
    """``t.requires_grad``, also for a vmap BatchedTensor (which reports False) over a
    tensor that requires grad at an outer level: ``vmap(f)(x)`` then ``backward()`` had run
    torch's function, saving the whole input, with torch's gradient (h69)."""
    if t.requires_grad:
        return True
    if not _transforms_active() or torch.compiler.is_compiling():
        # traced: Dynamo cannot trace the unwrapping, and a graph break inside vmap cannot
        # be resumed (torch.compile of vmap(module) had worked, then crashed; h73): torch's
        # function there, as before
        return False
    f = torch._C._functorch
    while f.is_batchedtensor(t):
        t = f.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def _apply(
    input: torch.Tensor, table: Table, fn: str, torch_fn: Callable[..., torch.Tensor], full: dict, inplace: bool
) -> torch.Tensor:
    """:func:`pointwise` with its arguments already checked and resolved: ``torch_fn`` is
    what ``fn`` names and ``full`` its parameters with defaults filled in, ``table``
    matches them. :mod:`fewbit.functional` calls this after its own checks, so that a
    call checks its input and resolves its function once."""
    if not (torch.is_grad_enabled() and _requires_grad(input)) or _recording_program():
        y = torch_fn(input, **full)
        if inplace:
            return input.copy_(y)
        return y
    compiling = torch.compiler.is_compiling()
    if inplace and not compiling:
        _check_inplace(input)
    transforms = _transforms_active()
    if (transforms and _forward_mode_active()) or (not compiling and _has_tangent(input)):
        # forward-mode AD (torch.func.hessian = jacfwd(jacrev), jvp of a gradient, a dual
        # tensor of torch.autograd.forward_ad) needs the tangent f'(x) t, which torch's
        # function gives exactly; there is no memory to save
        y = torch_fn(input, **full)
        return input.copy_(y) if inplace else y
    if not compiling and not transforms and _plain(input):
        return _direct(input, _plan(table, fn, full, input.dtype, input.device, torch_fn), inplace)
    name = _setting_for_trace(fn, tuple(full.items()), table, input.dtype, input.device)
    select_zero, classes, what, borders, codes, values, patch = getattr(_traced.HOLDER, name)
    # torch.compile and torch.func: a fixed record capacity (no data-dependent Python)
    args = (input, borders, codes, values, patch, table.bits, torch_fn, full, inplace, classes, CAPACITY,
            select_zero, what, _anchor(input, what))
    if transforms:
        return _FewBitPointwise.apply(*args)[0]
    return _FewBitPointwiseEager.apply(*args)


def _apply_planned(
    input: torch.Tensor, table: Table, fn: str, torch_fn: Callable[..., torch.Tensor], full: dict, inplace: bool,
    plan: _Plan,
) -> torch.Tensor:
    """:func:`_apply` for a call that needs the gradient (checked by the caller) whose
    :class:`_Plan` the caller already has (:mod:`fewbit.functional` keeps it per setting,
    device included): the eager node at once, or :func:`_apply` under torch.compile or a
    torch.func transform."""
    if _compiling_or_recording() or _transforms_active() or not _plain(input):
        return _apply(input, table, fn, torch_fn, full, inplace)
    if inplace:
        _check_inplace(input)
    return _direct(input, plan, inplace)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _plain(input: torch.Tensor) -> bool:
    """Whether the eager node may run on ``input``: a plain tensor (or Parameter) and no
    ``TorchDispatchMode`` active. The node calls the kernels with the tensors' memory
    (numba arrays, Triton pointers), which a FakeTensor or a wrapper subclass (DTensor)
    does not have, and which ``make_fx`` and other dispatch modes (FakeTensorMode,
    FlopCounterMode, a user's logging mode) would not see; those take the ``torch.ops``
    path. A wrapper subclass had reached the raw Triton launch with a null data pointer,
    and a ``make_fx`` graph recorded without the codes' kernel gave another gradient."""
    return type(input) in _PLAIN_TYPES and not _dispatch_modes() and not _has_tangent(input)


def _has_tangent(input: torch.Tensor) -> bool:
    """Whether ``input`` is a dual tensor of ``torch.autograd.forward_ad`` (a tangent at the
    current level): the few-bit node has no forward-mode rule, and it had raised
    ``NotImplementedError`` where ``nn.GELU`` gives the tangent."""
    return _fwad._current_level >= 0 and _fwad.unpack_dual(input).tangent is not None


def _check_inplace(input: torch.Tensor) -> None:
    """torch's own in-place checks for an ``input`` that requires grad (a leaf, a view of
    one, a view that cannot be rebased), run by a self-copy that writes nothing: they raise
    before ``input`` is touched, with torch's message. A tensor that is neither a leaf nor
    a view passes them all and is not copied: the copy would add a node to the graph (a
    zero gradient, a sum and a contiguous gradient each backward)."""
    if input._base is not None or input.grad_fn is None:
        input.copy_(input)


def _direct(input: torch.Tensor, plan: _Plan, inplace: bool) -> torch.Tensor:
    """The eager node :class:`_FewBitPointwiseDirect` on ``input``. Its anchor is passed
    in a tuple, so it is not an input of the node: the backward has no edge to the
    anchor's ``narrow_copy`` node (one node fewer to run each backward; 10 µs of a 2^10
    float32 GELU forward+backward on the CI VM), and it is reached only from a graph of
    the backward (``create_graph=True``), where it is needed."""
    holder = (_anchor(input, plan.what),)
    if _is_wrapped(input):  # a tensor left over from a torch.func transform: the full apply
        return _FewBitPointwiseDirect.apply(input, plan, inplace, holder)
    return _direct_apply(input, plan, inplace, holder)


def _anchor(input: torch.Tensor, what) -> torch.Tensor | None:
    """For a fitted table (``what`` set), an empty copy of a slice of ``input``: it
    carries ``input``'s autograd history into the backward (no data, nothing of ``input``
    saved), so that :class:`_NoSecondDerivative` lies on the path to ``input`` and double
    backward raises (no f'' from codes); one small op per call."""
    if what is None:
        return None
    return torch.narrow_copy(input.reshape(-1) if input.dim() == 0 else input, 0, 0, 0)


# --------------------------------------------------------------------------- eager path
# Eager calls (no torch.compile, no torch.func transform) skip the torch.library
# dispatcher (tens of microseconds of Python per call, docs/kernels.md) and call the
# backend kernels directly, with the table already in the form each backend reads,
# made once per (table, fn, params, dtype, device) and cached here.


class _Plan:
    """Everything a direct call needs for one setting, made once (:func:`_plan`)."""

    __slots__ = ("fn", "params", "bits", "values", "patch", "select_zero", "classes", "what", "backend", "kb", "kc",
                 "kv", "tb", "tc", "tv", "torch_fn", "full")

    @_traced.host_side
    def __init__(self, table: Table, fn: str, full: Mapping[str, float], dtype: torch.dtype, device: torch.device,
                 backend: str, torch_fn: Callable[..., torch.Tensor] | None = None):
        select_zero, classes, patch, what = _prepare(fn, tuple(full.items()), table, dtype, device)
        borders, codes, values = table_tensors(table, device, dtype)
        self.fn, self.params, self.bits, self.values = fn, tuple(full.items()), table.bits, values
        # the forward function and its keyword arguments (part of the plan's key)
        self.torch_fn = torch_fn if torch_fn is not None else _resolve_fn(fn)[0]
        self.full = dict(full)
        self.patch = _patch_tensor(patch, values.device, values.dtype) if classes else None
        self.select_zero, self.classes, self.what, self.backend = select_zero, classes, what, backend
        if backend == "numba":
            # the kernels' arrays (numpy views, so a call converts nothing) and the same
            # tensors for the reference kernels that stand in while numba loads
            self.tb = borders.detach().contiguous()  # already in the compare dtype
            self.tc = codes.detach().to(torch.int64).contiguous()
            v = values.detach()
            self.tv = v.to(torch.float64 if v.dtype == torch.float64 else torch.float32).contiguous()
            self.kb, self.kc, self.kv = self.tb.numpy(), self.tc.numpy(), self.tv.numpy()
        else:  # Triton (and its CPU stand-in in the tests): int32 codes, as the kernels read them
            self.kb, self.kc, self.kv = borders, codes.to(torch.int32), values


_plans: dict[int, tuple[weakref.ref, dict[tuple, _Plan]]] = {}


def _drop_plans(key: int, ref: weakref.ref) -> None:
    entry = _plans.get(key)
    if entry is not None and entry[0] is ref:
        del _plans[key]


def _plan(table: Table, fn: str, full: Mapping[str, float], dtype: torch.dtype, device: torch.device,
          torch_fn: Callable[..., torch.Tensor] | None = None) -> _Plan:
    """The cached :class:`_Plan` of a setting. Keyed by the table object (its identity,
    checked through a weak reference, and dropped with it), so a call hashes no
    borders or values."""
    entry = _plans.get(id(table))
    if entry is None or entry[0]() is not table:
        ref = weakref.ref(table, lambda r, k=id(table): _drop_plans(k, r))
        entry = _plans[id(table)] = (ref, {})
    key = (fn, call_key(full), dtype, device, torch_fn)
    plan = entry[1].get(key)
    if plan is None:
        backend = "numba" if device.type == "cpu" else ("triton" if device.type == "cuda" else "reference")
        plan = remember(entry[1], key, _Plan(table, fn, full, dtype, device, backend, torch_fn))
    return plan


def _host_record(x: torch.Tensor, classes: int, count: int) -> torch.Tensor | None:
    """The non-finite record of ``x`` when the encode pass counted ``count`` NaN and inf
    (fewbit.ops._nonfinite): None if none of ``classes``, else all of them listed, 8 bytes
    each. (Capped at :data:`CAPACITY` as on CUDA, a masked sigmoid gate with 1025 ``-inf``
    inputs had an all-NaN gradient where torch's is finite.)"""
    if count == 0:
        return None
    record = nonfinite_record_reference(x, classes, 0)
    k = int(record[0])
    if k == 0:
        return None
    return nonfinite_record_reference(x, classes, k)


def _triton():
    from fewbit.ops import _triton as mod

    return mod


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation ``perm`` for which ``t.permute(perm)`` is contiguous, when ``t`` is
    dense but not contiguous (channels_last, a transposed tensor); ``None`` when ``t`` is
    contiguous or has gaps or overlaps (those are copied). The eager node codes ``t`` in
    its memory order, so that such an input is read where it lies instead of copied, and
    the gradient comes back in the input's layout, as torch's does."""
    if t.is_contiguous():
        return None
    strides, sizes = t.stride(), t.shape
    perm = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d])))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return tuple(inv)


def _direct_forward(x, plan: _Plan, inplace, perm=None):
    """``(y, packed, record)`` of an eager call: the kernels called directly. With
    ``perm`` (:func:`_memory_order`; numba and Triton backends only) the codes and the
    record follow ``x.permute(perm)``, ``x``'s memory order; ``y`` has ``x``'s shape and
    layout either way."""
    torch_fn, full = plan.torch_fn, plan.full
    xe = x if perm is None else x.permute(perm)
    if plan.backend == "numba":
        if _cpu_loader.ready():
            from fewbit.ops import _cpu

            packed, count = _cpu.encode_arrays(xe, plan.kb, plan.kc, plan.bits, plan.classes != 0)
        else:  # numba still loading (fewbit.ops._cpu_loader): the reference, same codes
            packed = encode_reference_path(xe, plan.tb, plan.tc, plan.bits)
            count = int(x.isfinite().logical_not().sum()) if plan.classes else 0
        record = _host_record(xe, plan.classes, count) if count else None
    elif plan.backend == "triton":
        y, packed, record = _triton_forward(_triton(), xe, plan, torch_fn, full, inplace)
        if perm is not None:
            y = x if inplace else y.permute(_inverse(perm))
        return y, packed, record
    else:  # another device: the ops' default (reference) kernels
        return _forward(x, plan.kb, plan.kc, plan.values, plan.patch, plan.bits, torch_fn, full, inplace,
                        plan.classes, CAPACITY, plan.select_zero, plan.what, None)
    y = torch_fn(x, **full)
    if inplace:
        return x.copy_(y), packed, record
    return y, packed, record


def _triton_forward(tr, x, plan: _Plan, torch_fn, full, inplace):
    """The Triton eager forward: one fused kernel where ``tr`` offers one whose ``y`` is
    torch's bit for bit (``tr.FUSED_EAGER``), else the encoder and then torch's function."""
    if plan.fn in getattr(tr, "FUSED_EAGER", ()):
        into = inplace and x.is_contiguous()  # the kernel writes y only into a contiguous tensor
        y, packed, record = tr.forward_encode_triton(x, plan.kb, plan.kc, plan.bits, plan.classes, CAPACITY,
                                                     plan.fn, plan.params, x if into else None, traceable=False)
        if inplace and not into:  # a view with gaps: codes from the exact x, then y written back
            y = x.copy_(y)
        return y, packed, record
    record = None
    if plan.classes:
        packed, record = tr.encode_nonfinite_triton(x, plan.kb, plan.kc, plan.bits, plan.classes, CAPACITY,
                                                    traceable=False)
    else:
        packed = tr.encode_triton(x, plan.kb, plan.kc, plan.bits, traceable=False)
    y = torch_fn(x, **full)
    if inplace:
        return x.copy_(y), packed, record
    return y, packed, record


def _direct_backward(plan: _Plan, grad, packed, record):
    if plan.backend == "numba":
        if _cpu_loader.ready():
            from fewbit.ops import _cpu

            out = _cpu.decode_mul_arrays(grad, packed, plan.kv, plan.bits, plan.select_zero)
        else:  # numba still loading: the reference, same gradient
            out = decode_mul_reference(grad, packed, plan.tv, plan.bits, select_zero=plan.select_zero)
        return out if record is None else patch_reference(out, grad, record, plan.patch)
    if plan.backend == "triton":
        return _triton().decode_mul_triton(grad, packed, plan.kv, plan.bits, nonfinite=record,
                                           patch=None if record is None else plan.patch,
                                           select_zero=plan.select_zero, traceable=False)
    return torch.ops.fewbit.decode_mul(grad, packed, plan.values, plan.bits, record,
                                       None if record is None else plan.patch, plan.select_zero)


class _FewBitPointwiseDirect(torch.autograd.Function):
    """The eager autograd node: kernels called directly (:func:`_direct_forward`), few
    arguments; saves what the other two save (packed codes and the shared values; the
    non-finite record and the shared patch when the input had any)."""

    @staticmethod
    def forward(ctx, x, plan, inplace, anchor):
        # anchor: a 1-tuple holding the anchor (see _direct)
        # the reference backend (devices other than CPU and CUDA) codes x in logical order
        ctx.perm = perm = _memory_order(x) if plan.backend != "reference" else None
        y, packed, record = _direct_forward(x, plan, inplace, perm)
        if inplace:
            ctx.mark_dirty(x)
        if record is None:
            ctx.save_for_backward(packed, plan.values)
        else:
            ctx.save_for_backward(packed, plan.values, record, plan.patch)
        ctx.plan, ctx.anchor = plan, anchor[0]
        return y

    @staticmethod
    def backward(ctx, grad_output):
        plan, perm = ctx.plan, ctx.perm
        packed, values, record, patch = _unpack_saved(ctx)
        if perm is not None:  # the codes follow the input's memory order
            grad_output = grad_output.permute(perm)
        if torch.is_grad_enabled():  # a graph of the backward is being built
            grad_input = _backward_graph(grad_output, packed, values, record, patch, plan.bits, plan.select_zero,
                                         plan.what, ctx.anchor)
        else:
            grad_input = _direct_backward(plan, grad_output, packed, record)
        if perm is not None:
            grad_input = grad_input.permute(_inverse(perm))
        return grad_input, None, None, None


# Eager calls with no torch.func transform active apply the node with torch's C++
# ``_FunctionBase.apply``: ``torch.autograd.Function.apply`` adds only what transforms need
# (it unwraps dead functorch wrappers, then calls the same), microseconds of Python a call.
_direct_apply = super(torch.autograd.Function, _FewBitPointwiseDirect).apply


def _is_wrapped(t: torch.Tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if check is None else bool(check(t))


def encode(input: torch.Tensor, table: Table) -> torch.Tensor:
    """Packed codes of ``input`` for ``table`` (docs/method.md §2, §6).

    Args:
        input: any shape, float16/bfloat16/float32/float64 (flattened in C order).
        table: a :class:`fewbit.table.Table`.

    Returns:
        ``(ceil(numel * table.bits / 8),)`` uint8 on ``input.device``; bit-identical to
        :func:`fewbit.ops.encode_reference`.

    Raises:
        TypeError: for a non-floating ``input`` or a non-Table ``table``.
    """
    check_float_tensor(input, "input")
    _require_table(table)
    borders, codes, _ = table_tensors(table, input.device, input.dtype)
    return torch.ops.fewbit.encode(input.detach(), borders, codes, table.bits)


def decode_mul(grad_output: torch.Tensor, packed: torch.Tensor, table: Table) -> torch.Tensor:
    """``grad_output * values[code]`` for codes packed by :func:`encode`.

    Args:
        grad_output: any shape, float16/bfloat16/float32/float64.
        packed: uint8 stream of at least ``ceil(numel * table.bits / 8)`` bytes.
        table: the table the codes were made with.

    Returns:
        Contiguous tensor of ``grad_output``'s shape and dtype, bit-identical to
        :func:`fewbit.ops.decode_mul_reference` (rounding documented there).

    Raises:
        TypeError: for a non-floating ``grad_output``, non-uint8 ``packed`` or non-Table.
        ValueError: if ``packed`` is too short.
    """
    check_float_tensor(grad_output, "grad_output")
    _require_table(table)
    _, _, values = table_tensors(table, grad_output.device, grad_output.dtype)
    return torch.ops.fewbit.decode_mul(grad_output, packed, values, table.bits)
