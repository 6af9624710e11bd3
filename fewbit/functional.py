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

Tables are resolved by :func:`load_table`:

1. stepwise function: the exact 1-bit table (whatever ``bits`` asks for);
2. a table shipped in ``fewbit.tables`` for (name, non-default params, bits);
3. the user cache ``$FEWBIT_CACHE_DIR/tables/`` (default
   ``platformdirs.user_cache_dir("fewbit")/tables/``); a cache file that cannot be read
   (corrupt, truncated, other schema version) is moved aside to ``<file>.corrupt`` and
   the table is refitted (step 4, the warning names both files); a readable cache file
   whose table is for other parameters raises ValueError (it is never reused);
4. otherwise the table is fitted by :func:`fewbit.solver.fit` (needs
   ``pip install "fewbit[solver]"``), written to the cache atomically, and a
   :class:`TableFittedWarning` says so.

Loaded tables are kept in memory, keyed by (name, non-default params, bits).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import torch
import torch.nn.functional as F

from fewbit.activations import (
    Activation,
    canonical_params,
    exact_table,
    get_activation,
    import_callable,
    non_default_params,
)
from fewbit.table import Table, TableFormatError, load_shipped, read_tables, table_filename, write_tables

__all__ = [
    # table resolution
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

TableLike = Union[Table, str, os.PathLike]
FnLike = Union[str, Callable[..., torch.Tensor]]

#: Options passed to :func:`fewbit.solver.fit` when a table has to be fitted at run time.
#: ``grid`` is the number of DP grid cells (docs/method.md §4); smaller is faster and coarser.
FIT_OPTIONS: dict[str, Any] = {"domain": (-10.0, 10.0), "weight": "uniform", "grid": 4096}


class TableFittedWarning(UserWarning):
    """A table was not shipped nor cached, so it was fitted (once) and cached."""


_TABLES: dict[tuple, Table] = {}
_LOCK = threading.RLock()


# --------------------------------------------------------------------------- validation


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return bits


def _check_input(input: Any) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got dtype {input.dtype}")


def _needs_grad(input: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and input.requires_grad


# Border parameters of stepwise functions, and the dtype torch compares them in for a
# reduced-precision input (None: the input's own dtype). torch rounds the Python float
# parameter before comparing, so the exact table must use the rounded value to give
# torch's gradient bit for bit (e.g. float32 x == float32(0.3) is not above
# threshold=0.3 in torch, although 0.30000001192 > 0.3 in float64).
_STEPWISE_BORDER_PARAMS: dict[str, tuple[tuple[str, ...], torch.dtype | None]] = {
    "threshold": (("threshold",), torch.float32),
    "hardtanh": (("min_val", "max_val"), torch.float32),
    "hardshrink": (("lambd",), None),
    "softshrink": (("lambd",), None),
}


def _stepwise_params_for(name: str, full: dict[str, float], dtype: torch.dtype) -> dict[str, float]:
    """Round the border parameters of a stepwise function as torch does for ``dtype``."""
    spec = _STEPWISE_BORDER_PARAMS.get(name)
    if spec is None or dtype == torch.float64:
        return full
    keys, cmp_dtype = spec
    cmp_dtype = cmp_dtype or dtype
    out = dict(full)
    for k in keys:
        out[k] = float(torch.tensor(full[k], dtype=torch.float64).to(cmp_dtype).item())
    return out


# --------------------------------------------------------------------------- functions


class _Fn:
    """A resolved activation: registry entry or user callable."""

    __slots__ = ("name", "act", "callable")

    def __init__(self, name: str, act: Activation | None, fn: Callable[..., torch.Tensor]):
        self.name = name
        self.act = act
        self.callable = fn

    def full_params(self, params: Mapping[str, float] | None) -> dict[str, float]:
        if self.act is not None:
            return canonical_params(self.act, params)
        out = {}
        for k, v in dict(params or {}).items():
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"parameter {k} of {self.name} must be finite, got {v}")
            out[str(k)] = v
        return out

    def table_params(self, params: Mapping[str, float] | None) -> dict[str, float]:
        """The parameters a table is keyed by (non-default ones for registry functions)."""
        if self.act is not None:
            return non_default_params(self.act, params)
        return self.full_params(params)

    def __call__(self, input: torch.Tensor, params: Mapping[str, float]) -> torch.Tensor:
        return self.callable(input, **params)


def _resolve_fn(fn: FnLike) -> _Fn:
    if isinstance(fn, str):
        if ":" in fn:
            return _Fn(fn, None, import_callable(fn))
        act = get_activation(fn)
        return _Fn(act.name, act, act.torch_fn)
    if callable(fn):
        name = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
        try:
            same = import_callable(name) is fn
        except (ValueError, TypeError):
            same = False
        if not same:
            raise TypeError(
                f"fn {fn!r} is not importable as 'module:callable' (lambdas and local functions "
                "are not); define it at module level or pass its 'module:callable' name"
            )
        return _Fn(name, None, fn)
    raise TypeError(f"fn must be a registry name, 'module:callable' or a callable, got {type(fn).__name__}")


# --------------------------------------------------------------------------- tables


def cache_dir() -> Path:
    """Directory of the user table cache: ``$FEWBIT_CACHE_DIR/tables`` if the variable is
    set, else ``platformdirs.user_cache_dir("fewbit")/tables``."""
    root = os.environ.get("FEWBIT_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("fewbit")
    return Path(root) / "tables"


def clear_table_cache() -> None:
    """Forget the tables loaded in memory (files on disk are kept)."""
    with _LOCK:
        _TABLES.clear()


def _params_tuple(params: Mapping[str, float]) -> tuple:
    return tuple(sorted((k, float(v)) for k, v in params.items()))


def _check_table_matches(table: Table, name: str, params: Mapping[str, float], source: str) -> None:
    if table.name != name:
        raise ValueError(f"{source}: table is for {table.name!r}, not {name!r}")
    if _params_tuple(table.params) != _params_tuple(params):
        raise ValueError(
            f"{source}: table was fitted for params {dict(table.params)}, not {dict(params)}; "
            "a table is never reused for other parameters"
        )


def _pick_bits(tables: Mapping[int, Table], bits: int, source: str) -> Table:
    if bits not in tables:
        raise TableFormatError(f"{source}: holds no {bits}-bit table (it has bits {sorted(tables)})")
    table = tables[bits]
    if table.bits != bits:
        raise TableFormatError(f"{source}: table under key {bits} has bits={table.bits}")
    return table


def _is_path(fn: Any) -> bool:
    return isinstance(fn, os.PathLike) or (isinstance(fn, str) and fn.endswith(".json"))


def _read_table_file(path: str | os.PathLike, bits: int) -> Table:
    return _pick_bits(read_tables(path), bits, str(path))


def _solver_missing(exc: ImportError) -> ImportError:
    return ImportError(
        f'fitting a few-bit table needs the solver dependencies (scipy, numba): '
        f'pip install "fewbit[solver]" ({exc})'
    )


def _set_aside(path: Path, exc: Exception) -> str:
    """Move an unreadable cache file to ``<name>.corrupt`` (``<name>.corrupt.1``, ... if
    that exists: a file set aside earlier is never overwritten); return a note for the
    warning."""
    for i in range(1000):
        aside = path.with_name(path.name + (".corrupt" if i == 0 else f".corrupt.{i}"))
        try:
            # a hard link never replaces an existing file (os.replace would)
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError as err:  # no hard links on this file system: check, then rename
            if os.path.lexists(aside):
                continue
            try:
                os.rename(path, aside)
            except OSError as err2:
                raise TableFormatError(
                    f"{path}: unreadable cached table ({exc}) and it cannot be moved aside ({err2}); delete it"
                ) from err
            return f"; the unreadable cache file was moved to {aside} ({exc})"
        try:
            os.unlink(path)
        except OSError as err:
            raise TableFormatError(
                f"{path}: unreadable cached table ({exc}); a copy is at {aside} but it cannot be "
                f"removed ({err}); delete it"
            ) from exc
        return f"; the unreadable cache file was moved to {aside} ({exc})"
    raise TableFormatError(
        f"{path}: unreadable cached table ({exc}) and 1000 copies are set aside already; delete them"
    )


def _fit_and_cache(f: _Fn, bits: int, params: dict[str, float], full: dict[str, float], note: str = "") -> Table:
    try:
        solver = importlib.import_module("fewbit.solver")
    except ImportError as exc:
        raise _solver_missing(exc) from exc
    if not hasattr(solver, "fit"):
        raise ImportError('fewbit.solver.fit is not available: pip install "fewbit[solver]"')
    symmetric = bool(f.act.even) if f.act is not None else False
    try:
        table = solver.fit(
            f.name,
            bits,
            domain=tuple(FIT_OPTIONS["domain"]),
            weight=FIT_OPTIONS["weight"],
            grid=int(FIT_OPTIONS["grid"]),
            symmetric=symmetric,
            params=params,
        )
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in {"scipy", "numba"}:
            raise _solver_missing(exc) from exc
        raise
    _check_table_matches(table, f.name, params, "fewbit.solver.fit")
    if table.bits != bits:
        raise RuntimeError(f"fewbit.solver.fit returned a {table.bits}-bit table for bits={bits}")
    path = cache_dir() / table_filename(f.name, params)
    where = f"cached at {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existing = read_tables(path) if path.exists() else {}
        existing = {b: t for b, t in existing.items() if b != bits}
        write_tables(path, [*existing.values(), table])
    except (OSError, ValueError) as exc:  # ValueError: TableFormatError, or a file of other fit options
        where = f"not cached ({exc})"
    shown = ", ".join(f"{k}={v:g}" for k, v in params.items())
    warnings.warn(
        f"fewbit: fitted a {bits}-bit table for {f.name}({shown}) with grid={FIT_OPTIONS['grid']}; {where}{note}",
        TableFittedWarning,
        stacklevel=4,
    )
    return table


def _lookup(f: _Fn, bits: int, full: dict[str, float], nd: dict[str, float], bp: dict[str, float],
            set_aside: bool) -> tuple[Table | None, str, str]:
    """Steps 1-3 of the module docstring (exact, shipped, user cache), never fitting.

    Returns ``(table or None, source, note)``: ``source`` says where the table came from
    (``"exact"``, ``"fewbit.tables/<file>"`` or the cache file's path); ``note`` is set when
    an unreadable cache file was moved aside (``set_aside``; otherwise TableFormatError).
    """
    if f.act is not None and f.act.stepwise:
        # Exact at 1 bit: more bits could not make the gradient more exact.
        table = exact_table(f.name, bp)
        if bp != full:
            table = dataclasses.replace(table, params=nd)
        return table, "exact", ""
    if f.act is not None:
        shipped = load_shipped(f.name, nd)
        if shipped and bits in shipped:
            source = f"fewbit.tables/{table_filename(f.name, nd)}"
            table = _pick_bits(shipped, bits, source)
            _check_table_matches(table, f.name, nd, source)
            return table, source, ""
    path = cache_dir() / table_filename(f.name, nd)
    if not path.exists():
        return None, "", ""
    try:
        cached = read_tables(path)
    except TableFormatError as exc:
        if not set_aside:
            raise
        # The cache is ours and can be rebuilt: set the unreadable file aside (never
        # deleted) and refit; the warning says so.
        return None, "", _set_aside(path, exc)
    if bits not in cached:
        return None, "", ""
    table = _pick_bits(cached, bits, str(path))
    _check_table_matches(table, f.name, nd, str(path))
    return table, str(path), ""


def _keys(f: _Fn, params: Mapping[str, float] | None, border_params: Mapping[str, float] | None):
    """``(full params, non-default params, border params)`` of a request."""
    full = f.full_params(params)
    nd = f.table_params(full)
    bp = dict(border_params) if border_params is not None else full
    return full, nd, bp


def _load(f: _Fn, bits: int, params: Mapping[str, float] | None, border_params: Mapping[str, float] | None = None) -> Table:
    """Resolve (and cache in memory) a table. ``border_params``: for stepwise functions,
    the parameters rounded as torch rounds them for the input dtype; the table's borders
    come from them while its ``params`` stay the requested ones."""
    full, nd, bp = _keys(f, params, border_params)
    key = (f.name, _params_tuple(nd), bits, _params_tuple(bp))
    table = _TABLES.get(key)
    if table is not None:
        return table
    with _LOCK:
        table = _TABLES.get(key)
        if table is not None:
            return table
        table, _, note = _lookup(f, bits, full, nd, bp, set_aside=True)
        if table is None:
            table = _fit_and_cache(f, bits, nd, full, note)
        _TABLES[key] = table
        return table


def _find_table(fn: FnLike, bits: int | None = None,
                params: Mapping[str, float] | None = None) -> tuple[Table | None, str]:
    """The table :func:`load_table` would return, found the same way, but never fitted.

    For the command line (``fewbit plot`` / ``fewbit error``), which must show the tables
    the runtime uses and must not fit one silently.

    Returns:
        ``(table, source)``: ``source`` is ``"exact"``, ``"fewbit.tables/<file>"``, the path
        of the user cache file, or ``"memory"`` (fitted earlier in this process, not
        cached); ``(None, "")`` when :func:`load_table` would have to fit the table.

    Raises:
        ValueError: as :func:`load_table`.
        TableFormatError: if a shipped or cached file is unreadable (the cached file is left
            where it is; :func:`load_table` would move it aside and refit).
    """
    if bits is not None:
        bits = _check_bits(bits)
    f = _resolve_fn(fn)
    if bits is None:
        bits = f.act.default_bits if f.act is not None else 3
    full, nd, bp = _keys(f, params, None)
    table, source, _ = _lookup(f, bits, full, nd, bp, set_aside=False)
    if table is None:
        table = _TABLES.get((f.name, _params_tuple(nd), bits, _params_tuple(bp)))
        source = "memory" if table is not None else ""
    return table, source


def load_table(fn: FnLike | TableLike, bits: int | None = None, params: Mapping[str, float] | None = None) -> Table:
    """Resolve the few-bit table of an activation.

    Args:
        fn: a registry name (``"gelu"``, ``"gelu_tanh"``, aliases such as ``"swish"``), a
            ``"module:callable"`` string or module-level (importable) callable for a user
            activation, a :class:`~fewbit.table.Table` (returned as is), or a path to a
            JSON table file (``str`` ending in ``.json`` or ``os.PathLike``).
        bits: bits per element, 1..8; ``None`` is the function's default (1 for stepwise
            functions, 3 otherwise; for a Table, its own bits). For stepwise functions
            the exact 1-bit table is returned for every ``bits``: its gradient is exact.
        params: the function's parameters in torch's names (``{"alpha": 0.5}``); only the
            non-default ones select the table. Ignored for a Table or a file.

    Returns:
        The :class:`~fewbit.table.Table`; its ``params`` equal the requested non-default
        parameters (a table fitted for other parameters is never reused).

    Raises:
        ValueError: for bits outside 1..8, an unknown function or parameter, or a Table
            whose bits differ from ``bits``.
        TableFormatError: (a ValueError) if a JSON file is unreadable, of another schema,
            or holds no table for ``bits``; the message names the file.
        ImportError: if a table must be fitted and the solver dependencies are missing
            (``pip install "fewbit[solver]"``).

    Example:
        >>> load_table("gelu", 3).bits
        3
        >>> load_table("relu", 4).bits   # exact at 1 bit
        1
    """
    if bits is not None:
        bits = _check_bits(bits)
    if isinstance(fn, Table):
        if bits is not None and fn.bits != bits:
            raise ValueError(f"bits={bits} does not match the table's bits={fn.bits}")
        return fn
    if _is_path(fn):
        if bits is None:
            tables = read_tables(fn)
            if len(tables) != 1:
                raise ValueError(f"{fn}: holds bits {sorted(tables)}; pass bits to choose one")
            return next(iter(tables.values()))
        return _read_table_file(fn, bits)
    f = _resolve_fn(fn)
    if bits is None:
        bits = f.act.default_bits if f.act is not None else 3
    return _load(f, bits, params)


# --------------------------------------------------------------------------- core


def _pointwise(input: torch.Tensor, table: Table, f: _Fn, params: dict[str, float], inplace: bool) -> torch.Tensor:
    # input checked, f resolved, table matched here: fewbit.ops does none of it again
    from fewbit.ops._pointwise import _apply

    return _apply(input, table, f.name, f.callable, params, inplace)


def _registry(
    input: torch.Tensor,
    name: str,
    params: dict[str, float],
    bits: int,
    inplace: bool,
    torch_call: Callable[[], torch.Tensor],
) -> torch.Tensor:
    _check_input(input)
    bits = _check_bits(bits)
    f = _resolve_fn(name)
    full = f.full_params(params)
    if not _needs_grad(input):
        return torch_call()
    table = _load(f, bits, full, _border_params(f, full, input.dtype))
    return _pointwise(input, table, f, full, inplace)


def _border_params(f: _Fn, full: dict[str, float], dtype: torch.dtype) -> dict[str, float] | None:
    if f.act is not None and f.act.stepwise:
        return _stepwise_params_for(f.name, full, dtype)
    return None


def _table_arg(table: Any, bits: int | None) -> tuple[Table, str]:
    """The ``table`` argument of :func:`activation`: a Table, or any ``str``/PathLike as a
    JSON table file (whatever its suffix)."""
    if isinstance(table, Table):
        return load_table(table, bits), "table"
    if isinstance(table, (str, os.PathLike)):
        if bits is None:
            tables = read_tables(table)
            if len(tables) != 1:
                raise ValueError(f"table {table}: holds bits {sorted(tables)}; pass bits to choose one")
            return next(iter(tables.values())), str(table)
        return _read_table_file(table, bits), str(table)
    raise TypeError(
        f"table must be a fewbit.table.Table or a path to a JSON table file, got {type(table).__name__}"
    )


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
        input: tensor of any shape, floating dtype.
        fn: a registry name (``"gelu"``), a ``"module:callable"`` string, or a
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
        TypeError: if ``input`` is not a floating-point tensor, or ``table`` is neither a
            Table nor a path.
        ValueError: for bits outside 1..8, an unknown function or parameter, or a table
            that does not match ``fn``/``params``/``bits``.
        TableFormatError: (a ValueError) if the table file is missing, unreadable, of
            another schema version, or holds no ``bits``-bit table; names the file.
        RuntimeError: see :func:`gelu` (double backward of a fitted table; in-place
            writes torch refuses).

    Gradient semantics (NaN/inf inputs, selects, double backward, ``torch.func``) as in
    :func:`gelu`, for user functions too.
    """
    _check_input(input)
    if bits is not None:
        bits = _check_bits(bits)
    f = _resolve_fn(fn)
    full = f.full_params(params)
    if not _needs_grad(input):
        out = f(input, full)
        return input.copy_(out) if inplace else out
    if table is None:
        default_bits = f.act.default_bits if f.act is not None else 3
        tab = _load(f, bits if bits is not None else default_bits, full, _border_params(f, full, input.dtype))
    else:
        tab, source = _table_arg(table, bits)
        _check_table_matches(tab, f.name, f.table_params(full), source)
    return _pointwise(input, tab, f, full, inplace)


# --------------------------------------------------------------------------- smooth


def gelu(input: torch.Tensor, approximate: str = "none", *, bits: int = 3) -> torch.Tensor:
    """Few-bit :func:`torch.nn.functional.gelu` (Novikov et al., ICML 2023, eq. 1-2).

    Forward is ``F.gelu(input)`` bit for bit; backward is
    ``grad_input = grad_output * values[code(input)]`` with a fitted ``bits``-bit table.
    The other functions of this module follow the same contract.

    Args:
        input: tensor of any shape ``(*)``, float16/bfloat16/float32/float64, any strides.
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
        TypeError: if ``input`` is not a floating-point tensor.
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
    bit for bit, also at NaN/+-inf inputs and for NaN/inf ``grad_output`` (one exception:
    torch's Hardsigmoid multiplies float64 gradients by the float32 ``1/6``, fewbit by
    the float64 one). Double backward is exact. The other stepwise functions below follow
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
