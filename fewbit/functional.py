"""Few-bit activations as functions, with torch's own signatures plus ``bits``.

Every function here computes exactly what its ``torch.nn.functional`` twin computes in
forward (bit for bit), but keeps only a ``bits``-bit code per element for backward and
multiplies the incoming gradient by the code's level (Novikov et al., "Few-bit Backward",
ICML 2023, eq. 1-2; docs/method.md §1)::

    forward:  y = f(x),  c = code(x)          (bits per element, packed)
    backward: grad_x = grad_y * values[c]

Memory kept for backward: ``ceil(numel * bits / 8)`` bytes instead of
``numel * x.element_size()``. Stepwise functions (ReLU, LeakyReLU, Hardtanh, ReLU6,
Threshold, Hardshrink, Softshrink, Hardsigmoid) have an exact 1-bit table, so their
gradient equals torch's; smooth functions (GELU, SiLU, ...) use a fitted table and their
gradient is a piecewise-constant approximation.

When autograd does not need the input's gradient (``torch.no_grad()``, inference, or an
input that does not require grad), the functions call torch directly and never load a
table.

Tables are resolved by :mod:`fewbit.resolve` (exact -> shipped -> user cache -> fit, see
there); :func:`load_table`, :func:`cache_dir`, :func:`clear_table_cache`,
:class:`TableFittedWarning` and :data:`FIT_OPTIONS` are re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from fewbit._caches import call_key, remember
from fewbit._checks import check_bits, check_float_tensor
from fewbit.ops._pointwise import (
    _apply,
    _apply_planned,
    _plan,
    _recording_program,
    _requires_grad,
    _transforms_active,
)
from fewbit.resolve import CALLS as _CALLS
from fewbit.resolve import (  # noqa: F401  (re-exported: public names, and private ones tests use)
    FIT_OPTIONS,
    _TABLES,
    FnLike,
    ResolvedFn,
    TableFittedWarning,
    TableLike,
    cache_dir,
    clear_table_cache,
    find_table as _find_table,
    load_table,
    resolve_fn as _resolve_fn,
    stepwise_params_for as _stepwise_params_for,
    table_argument,
    table_for,
)
from fewbit.table import Table

__all__ = [
    # table resolution (fewbit.resolve)
    "load_table",
    "cache_dir",
    "clear_table_cache",
    "TableFittedWarning",
    "FIT_OPTIONS",
    # generic entry point
    "activation",
    # smooth activations (fitted tables, default 3 bits)
    "gelu",
    "silu",
    "selu",
    "elu",
    "celu",
    "mish",
    "softplus",
    "sigmoid",
    "tanh",
    "logsigmoid",
    "softsign",
    "tanhshrink",
    "hardswish",
    "quick_gelu",
    # stepwise activations (exact 1-bit tables)
    "relu",
    "leaky_relu",
    "relu6",
    "hardtanh",
    "threshold",
    "hardshrink",
    "softshrink",
    "hardsigmoid",
]


def _needs_grad(input: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and _requires_grad(input)


# --------------------------------------------------------------------------- core


def _pointwise(input: torch.Tensor, table: Table, f: ResolvedFn, params: dict[str, float], inplace: bool) -> torch.Tensor:
    # input checked, f resolved, table matched here: fewbit.ops does none of it again
    return _apply(input, table, f.op_name, f.forward, params, inplace)


def _registry(
    input: torch.Tensor,
    name: str,
    params: dict[str, float],
    bits: int,
    inplace: bool,
    torch_call: Callable[[], torch.Tensor],
) -> torch.Tensor:
    if isinstance(input, torch.fx.Proxy):
        # torch.fx.symbolic_trace (torchvision's feature extractors, quantize_fx): the
        # graph records torch's function, as torch.export's does
        return torch_call()
    # A gradient call of a setting (name, params, bits, dtype, device) already checked and
    # resolved once goes straight to the op with its cached plan: the checks of the first
    # call hold for it (dtype and device are in the key; bits must be an int, so 3.0 or
    # True are checked as the first time).
    if (type(bits) is int and torch.is_grad_enabled() and type(input) is torch.Tensor and input.requires_grad
            and input.layout == torch.strided and not torch.compiler.is_compiling() and not torch.jit.is_tracing()):
        # (not while compiling: torch.compile guarded on the cache's contents, and an eager
        # call of the same setting made the compiled model compile again; not while tracing:
        # torch.jit.trace's check traces again under no_grad, which takes the slow path, and a
        # trace after a training step failed "Graphs differed across invocations")
        try:
            # a tensor parameter (alpha=torch.tensor(0.5)) hashes by identity: a key per call
            # would grow the cache without bound, so such calls are resolved every time
            key = None if params and any(isinstance(v, torch.Tensor) for v in params.values()) else (
                name, call_key(params), bits, input.dtype, input.device)
            hit = _CALLS.get(key) if key is not None else None
        except TypeError:  # an unhashable parameter: checked below
            key = hit = None
        if hit is not None:
            return _apply_planned(input, hit[0], hit[1], hit[2], hit[3], inplace, hit[4])
    else:
        key = None
    integer = isinstance(input, torch.Tensor) and not (input.is_floating_point() or input.is_complex())
    sparse = isinstance(input, torch.Tensor) and input.layout != torch.strided
    if not (sparse or integer):
        check_float_tensor(input)
    bits = check_bits(bits)
    f = _resolve_fn(name)
    full = f.full_params(params)
    if sparse or integer or not _needs_grad(input) or _recording_program():
        # integer, bool: torch's call, as the module a converted model replaced (relu of
        # integer offsets); no gradient to code. Checked as a float call first.
        # sparse: torch's function and gradient (no codes for them); torch.jit.trace, torch.export
        return torch_call()
    table = table_for(f, bits, full, input.dtype)
    if key is not None and not torch.compiler.is_compiling() and not _transforms_active():
        plan = _plan(table, f.op_name, full, input.dtype, input.device, f.forward)
        remember(_CALLS, key, (table, f.op_name, f.forward, full, plan))
    return _pointwise(input, table, f, full, inplace)


def activation(
    input: torch.Tensor,
    fn: FnLike,
    *,
    table: TableLike | None = None,
    bits: int | None = None,
    params: Mapping[str, float] | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Apply any elementwise activation with few-bit backward.

    Forward is exactly ``fn(input, **params)``; backward is
    ``grad_output * table.values[code(input)]`` (docs/method.md §1).

    Args:
        input: tensor of any shape, float16/bfloat16/float32/float64.
        fn: a registry name (``"gelu"``) or alias, a Hugging Face formula name
            (``"gelu_new"``, ``"gelu_fast"``, ...: forward is that formula bit for bit,
            backward the tables of the function it computes;
            :data:`fewbit.activations.FORMULAS`), a ``"module:callable"`` string, or a
            module-level callable ``fn(input, **params) -> Tensor`` that is elementwise
            (it is passed on by its ``"module:callable"`` name, so it must be importable).
        table: the :class:`~fewbit.table.Table` or a JSON table file (``str`` or
            ``os.PathLike``, any suffix) to use; ``None`` resolves it with
            :func:`load_table`. A table made for another function or
            other parameters is refused.
        bits: bits per element, 1..8; ``None``: the table's bits, or the function's
            default (3; 1 for stepwise functions).
        params: keyword parameters of ``fn`` (``{"alpha": 0.5}``).
        inplace: overwrite ``input`` with the result; refused (``RuntimeError``, nothing
            written) where torch refuses an in-place write, as for a ``Parameter``.

    Returns:
        Tensor of the shape and dtype of ``input``.

    Raises:
        TypeError: if ``input`` is not a dense float16/bfloat16/float32/float64 tensor,
            or ``table`` is neither a Table nor a path.
        ValueError: for bits outside 1..8, an unknown function or parameter, or a table
            that does not match ``fn``/``params``/``bits``.
        TableFormatError: (a ValueError) if the table file is missing, unreadable, of
            another schema version, or holds no ``bits``-bit table; names the file.
        RuntimeError: see :func:`gelu` (double backward of a fitted table; in-place
            writes torch refuses).

    Gradient semantics (NaN/inf inputs, selects, double backward, ``torch.func``) as in
    :func:`gelu`, for user functions too.
    """
    if isinstance(input, torch.fx.Proxy):  # torch.fx.symbolic_trace: torch's function, as in _registry
        f = _resolve_fn(fn)
        out = f(input, f.full_params(params))
        return input.copy_(out) if inplace else out
    check_float_tensor(input)
    if bits is not None:
        bits = check_bits(bits)
    f = _resolve_fn(fn)
    full = f.full_params(params)
    if not _needs_grad(input):
        out = f(input, full)
        return input.copy_(out) if inplace else out
    if table is None:
        tab = table_for(f, bits, full, input.dtype)
    else:
        tab = table_argument(table, f, bits, full)
    return _pointwise(input, tab, f, full, inplace)


# --------------------------------------------------------------------------- smooth


def gelu(input: torch.Tensor, approximate: str = "none", *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.gelu` (Novikov et al., ICML 2023, eq. 1-2).

    Forward is ``F.gelu(input)`` bit for bit; backward is
    ``grad_input = grad_output * values[code(input)]`` with a fitted ``bits``-bit table.
    The other functions of this module follow the same contract.

    Args:
        input: tensor of any shape ``(*)``, float16/bfloat16/float32/float64, any strides.
            A sparse tensor (a layout other than ``torch.strided``) is passed to torch's
            function: torch's result and gradient, its saved tensors uncompressed.
        approximate: ``'none'`` (erf) or ``'tanh'`` (uses the ``gelu_tanh`` table).
        bits: bits per element kept for backward, 1..8.

    Where torch's own backward is not ``grad_output * level``, the gradient is torch's
    (rules derived once from torch; :mod:`fewbit.ops._nonfinite`):

    - NaN and +-inf inputs get torch's gradient at that element (NaN for GELU at NaN, so a
      diverging run is not hidden). Their positions are recorded in the forward: nothing
      on CPU when all inputs are finite, ``8 * (1 + 1024)`` bytes per call on CUDA and
      under ``torch.compile``; past 1024 such elements in one call the whole gradient of
      that call is NaN.
    - Exact (stepwise) tables select 0 where torch does, so e.g. :func:`relu` gives
      torch's gradient bit for bit also for NaN or infinite ``grad_output``.
    - Double backward (gradient penalty, ``create_graph=True`` then differentiating,
      nested ``torch.func.grad``): exact for stepwise functions (``f''`` is 0 there as in
      torch); for a fitted table it raises ``RuntimeError``, since the ``f''(x)`` term
      cannot be formed from b-bit codes and would silently be 0. ``torch.func.grad``,
      ``vjp``, ``vmap`` and ``jacrev`` of the first derivative work.

    Returns:
        Tensor of shape ``(*)`` and the dtype of ``input``; its gradient has the input's
        dtype. Kept for backward: ``ceil(numel * bits / 8)`` bytes of codes plus the
        ``2**bits`` table values, instead of ``numel * element_size`` bytes.

    Raises:
        TypeError: if ``input`` is not a tensor. An integer or bool tensor goes to torch's
            function, as into the module a converted model replaced (``relu`` of integer
            offsets): its result, or its error (``gelu``: ``NotImplementedError``).
        ValueError: for ``approximate`` not in ``{'none', 'tanh'}`` or ``bits`` not an
            integer in 1..8.
        RuntimeError: when differentiating this gradient again (fitted table, above);
            for ``inplace=True`` (the functions that take it), when torch refuses the
            in-place write (a leaf that requires grad, e.g. a ``Parameter``, or a view of
            one), raised before anything is written, with torch's message.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    name = "gelu" if approximate == "none" else "gelu_tanh"
    return _registry(input, name, {}, bits, False, lambda: F.gelu(input, approximate=approximate))


def silu(input: torch.Tensor, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.silu` (``x * sigmoid(x)``); see :func:`gelu`."""
    return _registry(input, "silu", {}, bits, inplace, lambda: F.silu(input, inplace=inplace))


def selu(input: torch.Tensor, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.selu`; see :func:`gelu`."""
    return _registry(input, "selu", {}, bits, inplace, lambda: F.selu(input, inplace=inplace))


def elu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.elu`; a non-default ``alpha`` uses its own table
    (fitted once into the user cache, see :func:`load_table`); otherwise see :func:`gelu`."""
    return _registry(input, "elu", {"alpha": alpha}, bits, inplace, lambda: F.elu(input, alpha, inplace))


def celu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.celu`; a non-default ``alpha`` uses its own table
    (fitted once into the user cache, see :func:`load_table`); otherwise see :func:`gelu`."""
    return _registry(input, "celu", {"alpha": alpha}, bits, inplace, lambda: F.celu(input, alpha, inplace))


def mish(input: torch.Tensor, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.mish`; see :func:`gelu`."""
    return _registry(input, "mish", {}, bits, inplace, lambda: F.mish(input, inplace=inplace))


def softplus(input: torch.Tensor, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.softplus`; non-default ``beta``/``threshold``
    use their own table."""
    params = {"beta": beta, "threshold": threshold}
    return _registry(input, "softplus", params, bits, False, lambda: F.softplus(input, beta, threshold))


def sigmoid(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.sigmoid` (even derivative: mirrored table); see :func:`gelu`."""
    return _registry(input, "sigmoid", {}, bits, False, lambda: torch.sigmoid(input))


def tanh(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.tanh` (even derivative: mirrored table); see :func:`gelu`."""
    return _registry(input, "tanh", {}, bits, False, lambda: torch.tanh(input))


def logsigmoid(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.logsigmoid`; see :func:`gelu`."""
    return _registry(input, "logsigmoid", {}, bits, False, lambda: F.logsigmoid(input))


def softsign(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.softsign` (even derivative); see :func:`gelu`."""
    return _registry(input, "softsign", {}, bits, False, lambda: F.softsign(input))


def tanhshrink(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.tanhshrink` (even derivative); see :func:`gelu`."""
    return _registry(input, "tanhshrink", {}, bits, False, lambda: F.tanhshrink(input))


def hardswish(input: torch.Tensor, inplace: bool = False, *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.hardswish`; see :func:`gelu`."""
    return _registry(input, "hardswish", {}, bits, inplace, lambda: F.hardswish(input, inplace=inplace))


def quick_gelu(input: torch.Tensor, *, bits: int = 3) -> torch.Tensor:
    """Few-bit QuickGELU, ``x * sigmoid(1.702 * x)`` (CLIP; Hugging Face ``QuickGELUActivation``)."""
    return _registry(input, "quick_gelu", {}, bits, False, lambda: input * torch.sigmoid(1.702 * input))


# --------------------------------------------------------------------------- stepwise


def relu(input: torch.Tensor, inplace: bool = False, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.relu`: exact gradient from a 1-bit code.

    ``bits`` is accepted for symmetry (validated, 1..8); the exact 1-bit table is used for
    every value, so backward keeps ``ceil(numel / 8)`` bytes and equals torch's gradient
    bit for bit, also at NaN/+-inf inputs and for NaN/inf ``grad_output`` (Hardsigmoid's
    level is the float32 ``1/6`` torch multiplies by in every dtype). Double backward is exact. The other stepwise functions below follow
    the same contract; shapes, dtypes and errors as in :func:`gelu`.
    """
    return _registry(input, "relu", {}, bits, inplace, lambda: F.relu(input, inplace=inplace))


def leaky_relu(input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.leaky_relu`: exact gradient from a 1-bit code."""
    return _registry(
        input, "leaky_relu", {"negative_slope": negative_slope}, bits, inplace,
        lambda: F.leaky_relu(input, negative_slope, inplace),
    )


def relu6(input: torch.Tensor, inplace: bool = False, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.relu6`: exact gradient from a 1-bit code."""
    return _registry(input, "relu6", {}, bits, inplace, lambda: F.relu6(input, inplace=inplace))


def hardtanh(
    input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *, bits: int = 1
) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.hardtanh`: exact gradient from a 1-bit code.

    Raises:
        ValueError: if ``min_val >= max_val`` (when a gradient is needed).
    """
    return _registry(
        input, "hardtanh", {"min_val": min_val, "max_val": max_val}, bits, inplace,
        lambda: F.hardtanh(input, min_val, max_val, inplace),
    )


def threshold(
    input: torch.Tensor, threshold: float, value: float, inplace: bool = False, *, bits: int = 1
) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.threshold`: exact gradient from a 1-bit code."""
    th = threshold
    return _registry(
        input, "threshold", {"threshold": th, "value": value}, bits, inplace,
        lambda: F.threshold(input, th, value, inplace),
    )


def hardshrink(input: torch.Tensor, lambd: float = 0.5, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.hardshrink`: exact gradient from a 1-bit code."""
    return _registry(input, "hardshrink", {"lambd": lambd}, bits, False, lambda: F.hardshrink(input, lambd))


def softshrink(input: torch.Tensor, lambd: float = 0.5, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.softshrink`: exact gradient from a 1-bit code."""
    return _registry(input, "softshrink", {"lambd": lambd}, bits, False, lambda: F.softshrink(input, lambd))


def hardsigmoid(input: torch.Tensor, inplace: bool = False, *, bits: int = 1) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.hardsigmoid`: exact gradient from a 1-bit code."""
    return _registry(input, "hardsigmoid", {}, bits, inplace, lambda: F.hardsigmoid(input, inplace=inplace))
