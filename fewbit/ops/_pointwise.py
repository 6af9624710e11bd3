"""The few-bit pointwise activation: exact forward, b-bit codes saved, table backward.

Novikov et al., "Few-bit Backward", ICML 2023, sec. 3 (docs/method.md §1):
forward ``y = f(x)`` (torch's own kernel), ``c = code(x)`` packed at ``bits`` bits per
element; backward ``grad_x = grad_y * values[c]``.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping

import torch

from fewbit.activations import ACTIVATIONS, ALIASES, canonical_params, get_activation, import_callable
from fewbit.ops import _ops  # noqa: F401  (registers fewbit::encode / fewbit::decode_mul)
from fewbit.ops._reference import compute_dtype, round_down_to_float32
from fewbit.table import Table

__all__ = ["pointwise", "encode", "decode_mul", "table_tensors"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_lock = threading.Lock()
_table_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_fn_cache: dict[str, tuple[Callable[..., torch.Tensor], object]] = {}


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
            _table_cache[key] = hit
    return hit


def _resolve_fn(fn: str) -> tuple[Callable[..., torch.Tensor], object]:
    """``(callable, Activation or None)`` for a registry name or ``"package.module:callable"``."""
    hit = _fn_cache.get(fn)
    if hit is not None:
        return hit
    if not isinstance(fn, str):
        raise TypeError(f"fn must be a registry name or a 'package.module:callable' string, got {type(fn).__name__}")
    if ":" in fn:
        obj = import_callable(fn)  # ValueError naming fn
        hit = (obj, None)
    else:
        act = get_activation(fn)  # ValueError for unknown names
        hit = (act.torch_fn, act)
    _fn_cache[fn] = hit
    return hit


def _require_float(t, name: str) -> None:
    """TypeError naming ``name`` unless ``t`` is a float16/bfloat16/float32/float64 tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor, got {got}")


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


class _FewBitPointwise(torch.autograd.Function):
    """Autograd of :func:`pointwise`: saves only the packed codes and the shared values."""

    @staticmethod
    def forward(ctx, x, borders, codes, values, bits, fn, params, inplace):
        packed = torch.ops.fewbit.encode(x, borders, codes, bits)  # from the exact x, first
        y = fn(x, **params)
        if inplace:
            x.copy_(y)
            ctx.mark_dirty(x)
            y = x
        ctx.save_for_backward(packed, values)
        ctx.bits = bits
        return y

    @staticmethod
    def backward(ctx, grad_output):
        packed, values = ctx.saved_tensors
        grad_input = torch.ops.fewbit.decode_mul(grad_output, packed, values, ctx.bits)
        return grad_input, None, None, None, None, None, None, None


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

    Args:
        input: any shape (0-d and empty allowed), float16/bfloat16/float32/float64, any
            layout and device with a backend (CPU: numba, CUDA: Triton).
        table: the :class:`fewbit.table.Table` of ``fn`` for these ``params``.
        fn: registry name (``"gelu"``, see :mod:`fewbit.activations`) or
            ``"package.module:callable"`` taking ``(input, **params)``.
        params: the activation's parameters (registry defaults filled in).
        inplace: write ``y`` into ``input`` and return it (codes are computed first), as
            torch's ``inplace=True`` activations; autograd tracks it (``mark_dirty``).

    Returns:
        ``y`` of ``input``'s shape and dtype (``input`` itself when ``inplace``).

    Raises:
        TypeError: if ``input`` is not a floating tensor, ``table`` not a Table, or ``fn``
            not a string.
        ValueError: for an unknown ``fn``, bad ``params``, or a table made for another
            function or other parameters.
    """
    _require_float(input, "input")
    torch_fn, act = _resolve_fn(fn)
    full = canonical_params(act, params) if act is not None else dict(params or {})
    _check_table(table, act, full)
    if not (torch.is_grad_enabled() and input.requires_grad):
        y = torch_fn(input, **full)
        if inplace:
            return input.copy_(y)
        return y
    borders, codes, values = table_tensors(table, input.device, input.dtype)
    return _FewBitPointwise.apply(input, borders, codes, values, table.bits, torch_fn, full, inplace)


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
    _require_float(input, "input")
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
    _require_float(grad_output, "grad_output")
    _require_table(table)
    _, _, values = table_tensors(table, grad_output.device, grad_output.dtype)
    return torch.ops.fewbit.decode_mul(grad_output, packed, values, table.bits)
