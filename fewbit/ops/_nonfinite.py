"""Non-finite inputs and torch's own backward rules: the record, the patch, the select.

The b-bit codes of a few-bit activation (docs/method.md §1, §2) cannot say "NaN" or
"infinite": all ``2**bits`` codes are derivative levels, NaN falls in the last interval
and +-inf in the outermost ones. torch's backward at such an input is usually something
else (GELU: NaN for every ``grad_output``; Hardshrink at NaN: 0), so this module keeps
what is needed to give torch's gradient there, and defines it in pure torch; every
backend (numba, Triton, the reference) does exactly this.

**Classes.** An element of ``x`` is of class 0 (NaN), 1 (+inf) or 2 (-inf). A *class
mask* (bit ``k`` = class ``k``, :data:`NAN`, :data:`POSINF`, :data:`NEGINF`) says which
classes are recorded: only those at which the codes alone would not give torch's
gradient (derived once per function, parameters, table, dtype and device by
:func:`derive_grad_rules`; 0 for e.g. ReLU, whose exact codes are already right at NaN
and +-inf).

**Record** (made at encode time, saved for backward): an int64 tensor of shape
``(1 + C,)``; ``record[0]`` is the number of elements of recorded classes (counted in
full, also past ``C``), ``record[1 + j]`` for ``j < min(count, C)`` is
``index << 2 | class`` (``index`` of the element in ``x`` flattened in C order). Entries
are in ascending index order on CPU and in an unspecified order on CUDA (programs append
with one atomic add each); slots past the count are 0. ``C`` is the capacity,
``record.numel() - 1``: :data:`CAPACITY` where the count is not known on the host
(CUDA, ``torch.compile``, ``torch.func``), the exact count on CPU in eager mode (no cost when all inputs
are finite: nothing is saved then).

Memory: ``8 * (1 + C)`` bytes per activation call: 8200 bytes at ``C = 1024``; on CPU in
eager mode 0 bytes when all inputs are finite and ``8 * (1 + count)`` otherwise.

**Past capacity** (``count > C``; on CUDA, under ``torch.compile`` and ``torch.func``): the rows are
not all known, so the whole gradient of that call is NaN (decided on the device, no host
sync): a loud signal, never a silently wrong gradient. Such counts come from diverged
runs, and from masks written as ``-inf`` into a gate (a masked sigmoid), whose exact
gradient is finite: on the CPU in eager mode every one is recorded.

**Patch** (shared, per function/parameters/table/dtype/device, like the table values):
``(3, 8)`` floats in the compute dtype (float64 for float64 gradients, else float32),
row ``k`` for class ``k``: ``[mode, d, o_nan, o_pinf, o_ninf, o_pzero, o_nzero, d2]``.
For a recorded element of class ``k`` and incoming gradient ``g``:

=====================  =======================================================
``g``                  gradient
=====================  =======================================================
NaN, +inf, -inf        ``o_nan``, ``o_pinf``, ``o_ninf``
+0, -0                 ``o_pzero``, ``o_nzero``
other (finite, != 0)   ``d`` if ``mode`` else ``(g * d) * d2`` (one rounding to
                       the dtype at the end, as in decode)
=====================  =======================================================

which is torch's backward at that element, e.g. GELU at NaN: ``g * NaN``; Hardshrink at
NaN: 0 (a select); Tanhshrink at +inf: ``g - g * 0`` (+0 for +-0, NaN for +-inf).

**Select where the level is 0.** torch's backward of the stepwise functions is a select
(``x <= 0 ? 0 : grad`` for ReLU), not a multiply: with a NaN or infinite ``grad_output``
it gives 0 where ``grad * 0.0`` gives NaN, and +0 where ``-1 * 0.0`` is -0. For exact
tables (``weight == "exact"``) whose zero levels torch selects (all stepwise registry
functions; not LeakyReLU with ``negative_slope=0``, which torch multiplies) the decode
gives +0 for those codes, so the gradient is torch's bit for bit.

**torch's own inconsistency.** torch's CPU kernels for SELU, ELU, CELU, Hardswish,
Hardtanh, ReLU6, Hardshrink and Softshrink give a different value at a NaN input in their
vectorised body than in the scalar tail (the last < 2 vector widths of a contiguous
tensor), e.g. Hardtanh: 0 in the body, ``grad`` in the tail. The rules are derived on the
input's device from a contiguous tensor long enough to be all vector body, i.e. they
follow what torch gives for all but a few elements of a real-sized tensor.
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from fewbit.ops._reference import compute_dtype
from fewbit.table import Table

__all__ = [
    "NAN",
    "POSINF",
    "NEGINF",
    "CAPACITY",
    "GradRules",
    "record_nbytes",
    "nonfinite_record_reference",
    "patch_reference",
    "derive_grad_rules",
]

NAN, POSINF, NEGINF = 1, 2, 4  # class-mask bits of classes 0, 1, 2
#: Entries of the fixed-capacity record (CUDA, torch.compile).
CAPACITY = 1024
_PATCH_ROW = 8


def record_nbytes(capacity: int = CAPACITY) -> int:
    """Bytes of a record of ``capacity`` entries: ``8 * (1 + capacity)``."""
    return 8 * (1 + capacity)


def _classes_of(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flat.isnan(), flat == math.inf, flat == -math.inf


def nonfinite_record_reference(input: torch.Tensor, classes: int, capacity: int) -> torch.Tensor:
    """Reference record of the non-finite elements of ``input`` (module docstring).

    Args:
        input: any shape, floating dtype, flattened in C order.
        classes: class mask (:data:`NAN` | :data:`POSINF` | :data:`NEGINF`), 0..7.
        capacity: entries kept, ``C >= 0``.

    Returns:
        ``(1 + capacity,)`` int64 on ``input.device``: the count, then ``index << 2 |
        class`` in ascending index order, zeros past the count.
    """
    if not 0 <= classes <= 7:
        raise ValueError(f"classes must be a mask in 0..7, got {classes}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    flat = input.detach().reshape(-1)
    isn, pinf, ninf = _classes_of(flat)
    keep = torch.zeros_like(isn)
    if classes & NAN:
        keep |= isn
    if classes & POSINF:
        keep |= pinf
    if classes & NEGINF:
        keep |= ninf
    idx = keep.nonzero().reshape(-1)
    cls = torch.where(isn[idx], 0, torch.where(pinf[idx], 1, 2))
    out = torch.zeros(1 + capacity, dtype=torch.int64, device=input.device)
    out[0] = idx.numel()
    k = min(capacity, idx.numel())
    out[1 : 1 + k] = ((idx << 2) | cls)[:k]
    return out


def patch_reference(
    grad_input: torch.Tensor, grad_output: torch.Tensor, record: torch.Tensor, patch: torch.Tensor
) -> torch.Tensor:
    """Reference patch: ``grad_input`` with the recorded elements replaced (docstring).

    Args:
        grad_input: the decoded gradient, any shape, dtype of ``grad_output``.
        grad_output: the incoming gradient (same numel, C order).
        record: ``(1 + C,)`` int64 from encode.
        patch: ``(24,)`` (or ``(3, 8)``) in the compute dtype of ``grad_output``.

    Returns:
        A new contiguous tensor of ``grad_input``'s shape and dtype: all NaN if
        ``record[0] > C``, else ``grad_input`` with each recorded element set to its
        class's rule.
    """
    dtype = grad_output.dtype
    cdt = compute_dtype(dtype)
    out = grad_input.reshape(-1).clone()
    cap = record.numel() - 1
    count = int(record[0])
    if count > cap:
        return torch.full_like(grad_input, math.nan).contiguous()
    e = record[1 : 1 + count].to(out.device)
    idx, cls = e >> 2, e & 3
    p = patch.reshape(3, _PATCH_ROW).to(device=out.device, dtype=cdt)[cls]
    g = grad_output.reshape(-1)[idx].to(cdt)
    r = torch.where(p[:, 0] != 0, p[:, 1], (g * p[:, 1]) * p[:, 7])
    r = torch.where(g == 0, torch.where(g.signbit(), p[:, 6], p[:, 5]), r)
    r = torch.where(g == -math.inf, p[:, 4], r)
    r = torch.where(g == math.inf, p[:, 3], r)
    r = torch.where(g.isnan(), p[:, 2], r)
    out[idx] = r.to(dtype)
    return out.reshape(grad_input.shape)


# --------------------------------------------------------------------------- torch's rules


@dataclass(frozen=True)
class GradRules:
    """What torch's backward does beyond ``grad * level`` for one activation setting.

    Attributes:
        select_zero: decode gives +0 (a select) for codes whose level is 0.
        classes: class mask of the non-finite inputs to record (0: none).
        patch: 24 floats, the ``(3, 8)`` patch rows of the module docstring.
    """

    select_zero: bool = False
    classes: int = 0
    patch: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0) * 3


_X_OF_CLASS = (math.nan, math.inf, -math.inf)


def _probe_grads(dtype: torch.dtype) -> torch.Tensor:
    """NaN, +inf, -inf, +0, -0, then finite non-zero values of every magnitude."""
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randn(48, generator=gen, dtype=torch.float64)
    rnd = rnd * torch.logspace(-6, 6, 48, dtype=torch.float64)
    finite = torch.cat([
        torch.tensor([1.0, -1.0, 2.5, -0.1, 3.0, fi.tiny, -fi.tiny, fi.smallest_normal / 4,
                      fi.max, -fi.max, fi.max / 1.5, -fi.max / 2, fi.max / 4, fi.max / 16], dtype=torch.float64),
        rnd.clamp(-fi.max, fi.max),
    ]).to(dtype)
    finite = finite[finite != 0]
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=dtype)
    return torch.cat([special, finite])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, any NaN equal to any NaN."""
    na, nb = a.isnan(), b.isnan()
    if not torch.equal(na, nb):
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~na].contiguous().view(ints), b[~nb].contiguous().view(ints))


def _torch_grad(fn, params, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """torch's ``grad_input`` of ``fn`` at ``x`` for ``g`` (1-D, same length), evaluated
    in a contiguous tensor whose length is a multiple of 64 (all vector body); ``None``
    if torch cannot differentiate ``fn``."""
    n = x.numel()
    m = max(64, -(-n // 64) * 64)
    # (a leaf made by a factory: requires_grad_() is refused inside torch.func transforms)
    xp = torch.empty(m, dtype=x.dtype, device=x.device, requires_grad=True)
    with torch.no_grad():
        xp.copy_(torch.cat([x, x[:1].expand(m - n)]))
    gp = torch.cat([g, g[:1].expand(m - n)]).contiguous()
    try:
        with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
            y = fn(xp, **params)
            if not isinstance(y, torch.Tensor) or not y.requires_grad or y.shape != xp.shape:
                return None  # not differentiable by torch, or not elementwise
            # d/dx sum(y * g) reaches y as 1 * g = g exactly: torch's grad_input for g,
            # without a grad_outputs tensor (whose shape check imports
            # torch.fx.experimental.symbolic_shapes and sympy on first use: 0.5 s)
            (gx,) = torch.autograd.grad((y * gp.to(y.dtype)).sum(), xp, allow_unused=True)
    except Exception as exc:  # a user function that fails on the probe: keep the table's gradient
        warnings.warn(
            f"fewbit: could not evaluate torch's gradient of {getattr(fn, '__name__', fn)} on a 1-D probe "
            f"({type(exc).__name__}: {exc}); its gradient at NaN/inf inputs is the table's",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    if gx is None or gx.dtype != x.dtype:
        return None
    return gx.detach()[:n].cpu()


def _decoded(g: torch.Tensor, level: float, cdt: torch.dtype, select: bool) -> torch.Tensor:
    """What the codes alone give for level ``level``: ``g * level`` rounded, or +0."""
    v = torch.tensor(level, dtype=torch.float64).to(cdt)
    if select and level == 0:
        return torch.zeros_like(g)
    return (g.to(cdt) * v).to(g.dtype)


def _interval_points(table: Table, dtype: torch.dtype) -> list[tuple[int, float]]:
    """One ``dtype`` value inside each interval of ``table`` (where one exists)."""
    b = table.borders
    out = []
    for i in range(len(b) + 1):
        lo = b[i - 1] if i > 0 else -math.inf
        hi = b[i] if i < len(b) else math.inf
        if math.isfinite(lo) and math.isfinite(hi):
            cands = [(lo + hi) / 2, hi]
        elif math.isfinite(hi):
            cands = [hi - 1.0, hi]
        elif math.isfinite(lo):
            cands = [lo + 1.0, 2 * abs(lo) + 1.0]
        else:
            cands = [0.0]
        bt = torch.tensor(b, dtype=torch.float64)
        for c in cands:
            xd = torch.tensor(c, dtype=torch.float64).to(dtype)
            if not torch.isfinite(xd):
                continue
            if int(torch.searchsorted(bt, xd.double().reshape(1), right=False)) == i:
                out.append((i, float(xd)))
                break
    return out


def _row(o: torch.Tensor, mode: float, d: float, d2: float = 1.0) -> list[float]:
    return [mode, d] + [float(v) for v in o[:5].to(torch.float64)] + [d2]


def _mul(g: torch.Tensor, cdt: torch.dtype, d: float, d2: float = 1.0) -> torch.Tensor:
    """``(g * d) * d2`` in ``cdt``, rounded once to ``g.dtype`` (the decode's rounding)."""
    dv = torch.tensor(d, dtype=torch.float64).to(cdt)
    d2v = torch.tensor(d2, dtype=torch.float64).to(cdt)
    return ((g.to(cdt) * dv) * d2v).to(g.dtype)


def _overflow_factor(grad_at, dtype: torch.dtype, cdt: torch.dtype) -> float | None:
    """For a gradient ``(g * c) * 0`` (0 unless ``g * c`` overflows, e.g. SELU at -inf:
    ``g * scale * alpha * exp(-inf)``): a ``cdt`` factor ``c`` that overflows at exactly
    the same ``dtype`` gradients as torch's, from the smallest positive ``g`` at which
    torch's gradient is not finite (bisection over the bit patterns of ``dtype``)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.finfo(dtype).bits // 8]
    to_g = lambda k: torch.tensor([k], dtype=ints).view(dtype)  # noqa: E731
    lo = int(torch.tensor([1.0], dtype=dtype).view(ints))
    hi = int(torch.tensor([torch.finfo(dtype).max], dtype=dtype).view(ints))
    if torch.isfinite(grad_at(to_g(hi))).all() or not torch.isfinite(grad_at(to_g(lo))).all():
        return None
    while hi - lo > 1:  # grad_at(lo) finite, grad_at(hi) not
        mid = (lo + hi) // 2
        if torch.isfinite(grad_at(to_g(mid))).all():
            lo = mid
        else:
            hi = mid
    t, tp = Fraction(float(to_g(hi))), Fraction(float(to_g(lo)))
    fi = torch.finfo(cdt)
    # round-to-nearest overflows from max + ulp(max) / 2 on
    big = torch.tensor(fi.max, dtype=cdt)
    ulp = Fraction(fi.max) - Fraction(float(torch.nextafter(big, torch.zeros_like(big))))
    limit = Fraction(fi.max) + ulp / 2
    c = torch.tensor(float(limit / t), dtype=torch.float64).to(cdt)
    while Fraction(float(c)) * t < limit:
        c = torch.nextafter(c, torch.tensor(math.inf, dtype=cdt))
    while Fraction(float(torch.nextafter(c, torch.tensor(-math.inf, dtype=cdt)))) * t >= limit:
        c = torch.nextafter(c, torch.tensor(-math.inf, dtype=cdt))
    if Fraction(float(c)) * tp >= limit:
        return None
    return float(c)


def _fit_patch(g: torch.Tensor, o: torch.Tensor, cdt: torch.dtype, d_candidates, grad_at) -> list[float] | None:
    """``[mode, d, o_nan, o_pinf, o_ninf, o_pzero, o_nzero, d2]`` reproducing torch's
    ``o`` bit for bit on the probe grads ``g`` (``g[5] == 1``), or ``None``."""
    gf, of = g[5:], o[5:]
    if _same(of, of[:1].expand_as(of)):  # a constant (a select)
        return _row(o, 1.0, float(of[0]))
    for d in d_candidates:  # one multiply
        if d is not None and _same(_mul(gf, cdt, d), of):
            return _row(o, 0.0, d)
    if float(o[5]) == 0.0:  # (g * c) * 0: NaN where g * c overflows
        c = _overflow_factor(grad_at, g.dtype, cdt)
        if c is not None and _same(_mul(gf, cdt, c, float(o[5])), of):
            return _row(o, 0.0, c, float(o[5]))
    return None


def _derive(fn, params, table: Table, dtype: torch.dtype, device: torch.device) -> GradRules:
    cdt = compute_dtype(dtype)
    g = _probe_grads(dtype)
    values = table.values
    codes = table.codes

    select = False
    zero_iv = [i for i in range(len(codes)) if values[codes[i]] == 0.0]
    if table.weight == "exact" and zero_iv:
        pts = [(i, x) for i, x in _interval_points(table, dtype) if i in zero_iv]
        select = bool(pts)
        for _, xv in pts:
            x = torch.full_like(g, xv)
            o = _torch_grad(fn, params, x.to(device), g.to(device))
            if o is None or not _same(o, torch.zeros_like(o)):
                select = False
                break

    classes = 0
    patch = list(GradRules().patch)
    for k, xv in enumerate(_X_OF_CLASS):
        o = _torch_grad(fn, params, torch.full_like(g, xv).to(device), g.to(device))
        if o is None:
            continue
        level = values[codes[0] if xv == -math.inf else codes[-1]]
        if _same(o, _decoded(g, level, cdt, select)):
            continue
        # d: torch's gradient at grad_output = 1 in the compute dtype, or in dtype (o[5])
        d_cdt = _torch_grad(fn, params, torch.full((1,), xv, dtype=cdt, device=device),
                            torch.ones(1, dtype=cdt, device=device))
        cands = [float(d_cdt[0]) if d_cdt is not None else None, float(o[5])]

        def grad_at(gv, xv=xv):
            return _torch_grad(fn, params, torch.full_like(gv, xv).to(device), gv.to(device))

        row = _fit_patch(g, o, cdt, cands, grad_at)
        if row is None:
            warnings.warn(
                f"fewbit: torch's gradient of {getattr(fn, '__name__', fn)} at x={xv} ({dtype}) is not "
                "grad_output times constants; fewbit's gradient there is NaN for finite grad_output",
                RuntimeWarning,
                stacklevel=3,
            )
            row = _row(o, 1.0, math.nan)
        classes |= 1 << k
        patch[k * _PATCH_ROW : (k + 1) * _PATCH_ROW] = row
    return GradRules(select_zero=select, classes=classes, patch=tuple(patch))


def _keep(t):
    return t


def derive_grad_rules(
    fn: Callable[..., torch.Tensor],
    params: Mapping[str, float],
    table: Table,
    dtype: torch.dtype,
    device: torch.device | str,
) -> GradRules:
    """torch's backward rules for ``fn(x, **params)`` with ``table``, derived from torch.

    Evaluates torch's own backward (callers cache the result): at one point of every
    zero-level interval of an exact table (is it a select?), and at NaN, +inf and -inf
    with probe gradients NaN, +-inf, +-0 and finite values of every magnitude (module
    docstring). A class is recorded only where the codes alone differ from torch.

    Args:
        fn: the activation, ``fn(input, **params)``.
        params: its parameters.
        table: the table in use.
        dtype: input dtype.
        device: the input's device (torch's rules differ between CPU and CUDA at NaN).

    Returns:
        :class:`GradRules`.
    """
    device = torch.device(device)
    if device.type == "meta":  # no values to probe (shapes only): the CPU's rules, no warning
        device = torch.device("cpu")
    # Outside any torch.func transform, autocast, torch function mode (fewbit's own modes
    # would send torch's F.gelu to fewbit's) or the caller's saved-tensor hooks (the probes
    # are not part of the user's graph). torch.func transforms disable saved-tensor hooks
    # themselves (then pushing ours raises, and there is nothing to hide).
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._C._DisableFuncTorch())
        stack.enter_context(torch._C.DisableTorchFunction())
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_keep, _keep))
        except RuntimeError:
            pass
        return _derive(fn, dict(params), table, dtype, device)
