"""Which function and which table: the one place where an activation and its table are resolved.

:mod:`fewbit.functional`, :mod:`fewbit.modules` and the command line (``fewbit plot`` /
``fewbit error``) all come here. A function (``fn``) is a registry name or alias
(:data:`fewbit.activations.ACTIVATIONS`), a Hugging Face formula name
(:data:`fewbit.activations.FORMULAS`: its own forward, the tables of the entry it
computes), or a user ``"module:callable"``. Its table is resolved in this order
(docs/method.md §2):

1. stepwise function: the exact 1-bit table (whatever ``bits`` asks for), its borders
   from the parameters rounded as torch rounds them for the input's dtype;
2. a table shipped in ``fewbit.tables`` for (name, non-default params, bits);
3. the user cache ``$FEWBIT_CACHE_DIR/tables/`` (default
   ``platformdirs.user_cache_dir("fewbit")/tables/``); a cache file that cannot be read
   (corrupt, truncated, other schema version) is moved aside to ``<file>.corrupt``
   (``.corrupt.1``, ... : one set aside earlier is never overwritten) and the table is
   refitted (step 4, the warning names both files); a readable cache file whose table is
   for other parameters raises ValueError (it is never reused); a user function's file
   is named with a fingerprint of its derivative (:func:`_cache_path`: an edited function
   gets its own table);
4. otherwise the table is fitted by :func:`fewbit.solver.fit` with :data:`FIT_OPTIONS`
   (needs ``pip install "fewbit[solver]"``), written to the cache atomically, and a
   :class:`TableFittedWarning` says so. A user function whose derivative grows past the
   fit domain (``exp``, ``x**2``) is refused first (``ValueError``): no table of levels
   fitted there approximates it (``fewbit fit`` on a domain the user picks is not checked).

:func:`load_table` does all four and keeps the result in memory, keyed by (name,
non-default params, bits, border params), under one lock; :func:`find_table` does steps
1-3 only (plus the tables fitted earlier in this process) and never fits nor moves a file.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import threading
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import filelock
import torch

from fewbit import _traced
from fewbit._caches import remember
from fewbit._checks import check_bits
from fewbit.activations import (
    Activation,
    callable_params,
    canonical_params,
    check_table_params,
    exact_table,
    forward_callable,
    get_activation,
    get_formula,
    import_callable,
    merge_params,
    non_default_params,
    table_activation,
)
from fewbit.table import Table, TableFormatError, load_shipped, read_tables, table_filename, write_tables

__all__ = [
    "load_table",
    "find_table",
    "table_argument",
    "table_for",
    "cache_dir",
    "clear_table_cache",
    "TableFittedWarning",
    "FIT_OPTIONS",
    "ResolvedFn",
    "resolve_fn",
    "check_table_matches",
    "stepwise_params_for",
]

TableLike = Union[Table, str, os.PathLike]
FnLike = Union[str, Callable[..., torch.Tensor]]

#: Options passed to :func:`fewbit.solver.fit` when a table has to be fitted at run time.
#: ``grid`` is the number of DP grid cells (docs/method.md §4); smaller is faster and coarser.
FIT_OPTIONS: dict[str, Any] = {"domain": (-10.0, 10.0), "weight": "uniform", "grid": 4096}

#: Revision of what a fit returns, written into the provenance of every table the user cache
#: gets (``"cache_revision"``); a cached table of another revision is fitted again instead of
#: served. Bumped when a solver fix changes some function's table: 2, user functions' jumps
#: of f' and softplus at extreme parameters (their earlier tables had misplaced borders or
#: levels of 0); 3, user functions with an even f' mirrored (they had been fitted unmirrored,
#: 3.1-3.6x the error), and f' steeper than the fixed integration mesh resolved (celu with a
#: small alpha, softplus with a large beta: errors reported up to 11x too small).
CACHE_REVISION = 3


class TableFittedWarning(UserWarning):
    """A table was not shipped nor cached, so it was fitted (once) and cached.

    Issued by :func:`table_for` (and so :func:`load_table`); the message names the cache file, or
    says why the table could not be cached.
    """


_TABLES: dict[tuple, Table] = {}
#: ``(name, params items, bits, dtype) -> (table, op name, callable, full params)``: what a
#: gradient call of a registry function (fewbit.functional) resolves, made once per
#: setting; cleared with :data:`_TABLES`.
CALLS: dict[tuple, tuple] = {}
_LOCK = threading.RLock()


# --------------------------------------------------------------------------- functions


class ResolvedFn:
    """A resolved activation: a registry entry (or formula sharing one), or a user callable.

    Attributes:
        name: the name its tables are keyed by (canonical registry name, or the
            ``"module:callable"`` of a user function).
        act: the registry :class:`~fewbit.activations.Activation` whose tables it uses
            (``None`` for a user function).
        callable: its forward, ``callable(input, **params)``.
        op_name: the ``fn`` given to :func:`fewbit.ops.pointwise`: ``name``, or for a
            Hugging Face formula its ``"fewbit.activations:<formula>"`` (its forward is
            not the registry entry's kernel).

    Args:
        name: as the attribute.
        act: as the attribute.
        fn: the forward, ``fn(input, **params)``; for a user function :attr:`forward` wraps
            it (:func:`fewbit.activations.forward_callable`).
        op_name: as the attribute; ``None``: ``name``.
    """

    __slots__ = ("name", "act", "callable", "forward", "op_name")

    def __init__(self, name: str, act: Activation | None, fn: Callable[..., torch.Tensor],
                 op_name: str | None = None):
        self.name = name
        self.act = act
        self.callable = fn
        #: the forward as ``forward(input, **params)`` with float params (a user function's
        #: int arguments passed as ints: :func:`fewbit.activations.forward_callable`)
        self.forward = fn if act is not None else forward_callable(fn)
        self.op_name = op_name or name

    @property
    def default_bits(self) -> int:
        """The function's default bits: 1 for stepwise derivatives (exact), 3 otherwise."""
        return self.act.default_bits if self.act is not None else 3

    def full_params(self, params: Mapping[str, float] | None) -> dict[str, float]:
        """Every parameter, defaults filled in (``ValueError`` for unknown or non-finite ones)."""
        if self.act is not None:
            return canonical_params(self.act, params)
        # a user function's: its arguments with number defaults (fn(x, a=1.5))
        return merge_params(self.name, callable_params(self.callable), params)

    def table_params(self, params: Mapping[str, float] | None) -> dict[str, float]:
        """The parameters a table is keyed by: those not at their defaults (a user function's
        defaults are its signature's, as ``fewbit.solver`` fits it)."""
        if self.act is not None:
            return non_default_params(self.act, params)
        defaults = callable_params(self.callable)
        return {k: v for k, v in self.full_params(params).items() if v != defaults[k]}

    def border_params(self, full: dict[str, float], dtype: torch.dtype | None) -> dict[str, float]:
        """The parameters the borders of a stepwise function's exact table come from:
        ``full`` rounded as torch rounds them for inputs of ``dtype`` (``None``: unrounded).

        Raises:
            ValueError: naming the parameter and the value given, for a value the exact
                table refuses (``lambd < 0``), or one past the range of the dtype torch
                compares it in.
        """
        if dtype is None or self.act is None or not self.act.stepwise:
            return full
        rounded = stepwise_params_for(self.name, full, dtype)
        if self.act.exact is not None:
            try:  # the rules on the value torch compares with (-1e-46 is float32's -0.0)
                self.act.exact(rounded)
            except ValueError:
                self.act.exact(full)  # named with the value given where that is refused too
                raise
        return rounded

    def __call__(self, input: torch.Tensor, params: Mapping[str, float]) -> torch.Tensor:
        return self.forward(input, **params)


def resolve_fn(fn: FnLike) -> ResolvedFn:
    """Resolve a registry name, alias, formula name, ``"module:callable"`` or callable.

    Args:
        fn: a registry name or alias (``"gelu"``, ``"swish"``), a Hugging Face formula name
            (``"gelu_new"``), a ``"module:callable"`` string, or a module-level callable.

    Returns:
        ResolvedFn: for a formula, ``name`` and ``act`` are those of the registry entry whose
        tables it uses and ``callable`` is the formula; for a user function, ``act`` is
        ``None`` and ``name`` its ``"module:qualname"``.

    Raises:
        ValueError: an unknown name (with close matches) or a spec that does not import.
        TypeError: a callable that is not importable by its ``module:qualname`` (lambdas,
            local functions), or an object that is neither a string nor a callable.
    """
    if isinstance(fn, str):
        if ":" in fn:
            return ResolvedFn(fn, None, import_callable(fn))
        act = get_activation(fn)
        base = table_activation(fn)
        if base is act:
            return ResolvedFn(act.name, act, act.torch_fn)
        # A Hugging Face formula: its own forward (bit for bit), the tables of ``base``.
        return ResolvedFn(base.name, base, act.torch_fn, get_formula(act.name).spec)
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
        return ResolvedFn(name, None, fn)
    raise TypeError(f"fn must be a registry name, 'module:callable' or a callable, got {type(fn).__name__}")


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


def stepwise_params_for(name: str, full: dict[str, float], dtype: torch.dtype) -> dict[str, float]:
    """Round the border parameters of a stepwise function as torch does for ``dtype``.

    Args:
        name: canonical registry name.
        full: every parameter of the function (:meth:`ResolvedFn.full_params`); it must hold
            the border parameters (a missing one raises ``KeyError``).
        dtype: the input's dtype.

    Returns:
        dict: a copy of ``full`` with ``threshold`` (threshold) or ``min_val``/``max_val``
        (hardtanh) rounded to float32, or ``lambd`` (hardshrink, softshrink) rounded to
        ``dtype``; ``full`` itself (not a copy) for other functions and for float64.

    Raises:
        ValueError: for a border parameter that rounds to an infinity.
    """
    spec = _STEPWISE_BORDER_PARAMS.get(name)
    if spec is None or dtype == torch.float64:
        return full
    keys, cmp_dtype = spec
    cmp_dtype = cmp_dtype or dtype
    out = dict(full)
    for k in keys:
        out[k] = float(torch.tensor(full[k], dtype=torch.float64).to(cmp_dtype).item())
        if not math.isfinite(out[k]):
            cmp = str(cmp_dtype).removeprefix("torch.")
            raise ValueError(f"params: {k} of {name} must be within {cmp}'s range for a "
                             f"{str(dtype).removeprefix('torch.')} input (torch compares in {cmp}), got {full[k]!r}")
    return out


# --------------------------------------------------------------------------- files


def cache_dir() -> Path:
    """Directory of the user table cache, absolute: ``$FEWBIT_CACHE_DIR/tables`` if the
    variable is set (``~`` expanded, a relative path taken from the working directory at
    the call), else ``platformdirs.user_cache_dir("fewbit")/tables``.

    Returns:
        Path: absolute; not created here.
    """
    root = os.environ.get("FEWBIT_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("fewbit")
    return Path(root).expanduser().absolute() / "tables"


def clear_table_cache() -> None:
    """Forget the tables loaded in memory (files on disk are kept).

    The resolved gradient calls (:data:`CALLS`) are cleared too.
    """
    with _LOCK:
        _TABLES.clear()
        CALLS.clear()


def _params_tuple(params: Mapping[str, float]) -> tuple:
    return tuple(sorted((k, float(v)) for k, v in params.items()))


def check_table_matches(table: Table, name: str, params: Mapping[str, float], source: str) -> None:
    """``ValueError`` naming ``source`` unless ``table`` is for ``name`` and exactly ``params``
    (non-default ones): a table is never reused for another function or other parameters.

    Args:
        table: the table to check.
        name: the function's table name (:attr:`ResolvedFn.name`).
        params: its non-default parameters (:meth:`ResolvedFn.table_params`), compared as
            floats.
        source: where the table came from, for the message (a file path, ``"table"``).

    Returns:
        None.

    Raises:
        ValueError: if ``table.name != name`` or its ``params`` differ from ``params``.
    """
    if table.name != name:
        raise ValueError(f"{source}: table is for {table.name!r}, not {name!r}")
    if _params_tuple(table.params) != _params_tuple(params):
        raise ValueError(
            f"{source}: table was fitted for params {dict(table.params)}, not {dict(params)}; "
            "a table is never reused for other parameters"
        )


def _pick_bits(tables: Mapping[int, Table], bits: int | None, source: str) -> Table:
    """The ``bits``-bit table of a file's ``{bits: Table}``; ``None``: its only one."""
    if bits is None:
        if len(tables) != 1:
            raise ValueError(f"{source}: holds bits {sorted(tables)}; pass bits to choose one")
        return next(iter(tables.values()))
    if bits not in tables:
        raise TableFormatError(f"{source}: holds no {bits}-bit table (it has bits {sorted(tables)})")
    table = tables[bits]
    if table.bits != bits:
        raise TableFormatError(f"{source}: table under key {bits} has bits={table.bits}")
    return table


def _is_path(fn: Any) -> bool:
    return isinstance(fn, os.PathLike) or (isinstance(fn, str) and fn.endswith(".json"))


def _given_table(table: Any, bits: int | None, what: str) -> tuple[Table, str]:
    """A :class:`Table` (checked against ``bits``) or a JSON file (any ``str`` or PathLike)
    as ``(table, source)``; ``what`` names the argument in the TypeError."""
    if isinstance(table, Table):
        if bits is not None and table.bits != bits:
            raise ValueError(f"bits={bits} does not match the table's bits={table.bits}")
        return table, "table"
    if isinstance(table, (str, os.PathLike)):
        return _pick_bits(read_tables(table), bits, str(table)), str(table)
    raise TypeError(f"{what} must be a fewbit.table.Table or a path to a JSON table file, got {type(table).__name__}")


def table_argument(table: TableLike, fn: ResolvedFn, bits: int | None, full: Mapping[str, float]) -> Table:
    """The ``table`` argument of :func:`fewbit.functional.activation` and
    :class:`fewbit.modules.FewBitActivation`: a Table, or a JSON table file (``str`` or
    PathLike, any suffix), which must be for ``fn`` and its parameters ``full``.

    Args:
        table: a :class:`~fewbit.table.Table` or the path of a JSON table file.
        fn: from :func:`resolve_fn`.
        bits: the requested bits (not checked here), or ``None``: a Table's own bits, or a
            file's only table.
        full: every parameter of ``fn`` (:meth:`ResolvedFn.full_params`).

    Returns:
        Table: the given table, or the ``bits``-bit table of the file.

    Raises:
        TypeError: neither a Table nor a path.
        ValueError: bits or function or parameters do not match, or a user function's
            derivative grows past the table's domain (:func:`check_derivative_growth`);
            TableFormatError for a file that is unreadable or holds no ``bits``-bit table
            (``None``: more than one, a plain ValueError).
    """
    tab, source = _given_table(table, bits, "table")
    check_table_matches(tab, fn.name, fn.table_params(full), source)
    if fn.act is None:  # a user function: its table's end levels stand for f' past its domain
        key = (fn.name, id(fn.callable), _params_tuple(full), tuple(tab.domain))
        if key not in _GROWTH_CHECKED:  # once per function, parameters and domain (68 -> 236 us a call)
            _check_asymptotes(fn, dict(full), tab.domain)
            _GROWTH_CHECKED[key] = fn.callable  # held: its id stays its own
    return tab


#: (function name, id of its callable, parameters, domain) -> the callable, of the user
#: functions whose derivative :func:`table_argument` checked against a table's domain.
_GROWTH_CHECKED: dict = {}


# --------------------------------------------------------------------------- resolution


def _solver_missing(exc: ImportError) -> ImportError:
    return ImportError(
        f'fitting a few-bit table needs the solver dependencies (scipy, numba): '
        f'pip install "fewbit[solver]" ({exc})'
    )


def _set_aside(path: Path, exc: Exception, what: str = "an unreadable cache file") -> str:
    """Move a cache file that cannot be used (``what``: unreadable, or valid but for another
    setting) to ``<name>.corrupt`` (``<name>.corrupt.1``, ... if that exists: a file set
    aside earlier is never overwritten); return a note for the warning."""
    gone = f"; {what} was moved aside by another process ({exc})"  # a DDP rank starting alike
    for i in range(1000):
        aside = path.with_name(path.name + (".corrupt" if i == 0 else f".corrupt.{i}"))
        try:
            # a hard link never replaces an existing file (os.replace would)
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        except FileNotFoundError:  # another process moved it aside first
            return gone
        except OSError as err:  # no hard links on this file system: check, then rename
            if os.path.lexists(aside):
                continue
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return gone
            except OSError as err2:
                raise TableFormatError(
                    f"{path}: {what} ({exc}) and it cannot be moved aside ({err2}); delete it"
                ) from err
            return f"; {what} was moved to {aside} ({exc})"
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process removed it meanwhile
            pass
        except OSError as err:
            raise TableFormatError(
                f"{path}: {what} ({exc}); a copy is at {aside} but it cannot be removed ({err}); delete it"
            ) from exc
        return f"; {what} was moved to {aside} ({exc})"
    raise TableFormatError(f"{path}: {what} ({exc}) and 1000 copies are set aside already; delete them")


def check_derivative_growth(name: str, derivative: Callable[[torch.Tensor], Any],
                            domain: tuple[float, float]) -> None:
    """Refuse a function whose derivative grows past the fit domain ``(A, B)``.

    A table holds ``2**bits`` levels of ``f'`` fitted on its domain, and its end levels
    stand for ``f'`` past the domain; that suits a derivative that stays within the range
    it has on the domain (GELU, SiLU, softplus, atan: ``f'`` tends to constants). For
    ``exp`` the fit spends its levels on the right tail (``f'(10) = 22026``), and a 3-bit
    table gave 43.93 for every input in [-3, 3]; for ``x**2`` the levels past the domain
    are 4x off at 40. Checked in float64: ``|f'|`` at half and one and a half domain widths
    past each end (+-20 and +-40 for the default ``[-10, 10]``) against twice its largest
    value on 201 points of the domain.

    Args:
        name: the function, for the message.
        derivative: ``x`` (float64 tensor) -> ``f'(x)`` (anything ``torch.as_tensor``
            takes); a derivative that raises is not checked (the fit reports what it meets).
        domain: the fit domain.

    Raises:
        ValueError: naming the function and the derivative values.
    """
    lo, hi = float(domain[0]), float(domain[1])
    width = hi - lo
    inside = torch.linspace(lo, hi, 201, dtype=torch.float64)
    far = torch.tensor([lo - 1.5 * width, lo - 0.5 * width, hi + 0.5 * width, hi + 1.5 * width], dtype=torch.float64)
    try:
        d = torch.as_tensor(derivative(torch.cat([inside, far])), dtype=torch.float64).reshape(-1)
    except Exception:  # not differentiable in float64 here: the fit reports what it meets
        return
    on_domain = d[: inside.numel()]
    if not on_domain.isfinite().all():
        return  # the fit refuses a non-finite derivative on its domain, with its own message
    scale = max(float(on_domain.abs().max()), 1e-12)
    outside = d[inside.numel():]
    outside = torch.where(outside.isnan(), torch.zeros_like(outside), outside)  # undefined there: not judged
    if outside.isfinite().all() and float(outside.abs().max()) <= 2 * scale:
        return
    shown = ", ".join(f"f'({v:g}) = {float(g):.4g}" for v, g in zip(far.tolist(), outside))
    raise ValueError(
        f"{name}: its derivative grows past the fit domain ({lo:g}, {hi:g}) ({shown}; at most "
        f"{scale:.4g} on the domain): a few-bit table approximates f' by 2**bits levels fitted there and "
        "extends its end levels past it, which suits derivatives that stay in their range (GELU, SiLU, "
        "softplus). Use torch's function for this one"
    )


def _check_asymptotes(f: ResolvedFn, params: dict[str, float],
                      domain: tuple[float, float] | None = None) -> None:
    """:func:`check_derivative_growth` of a user function ``f`` (its derivative by torch's
    autograd), on ``domain`` (default: :data:`FIT_OPTIONS`'s)."""

    def derivative(x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        with torch.enable_grad():
            (d,) = torch.autograd.grad(f(x, params).sum(), x)
        return d.detach()

    check_derivative_growth(f.name, derivative, tuple(domain or FIT_OPTIONS["domain"]))


#: Points (float64, over :data:`FIT_OPTIONS`' domain) where a user function's derivative is
#: sampled for its cache file's fingerprint (:func:`_cache_path`): 0.005 apart on the
#: default domain (at 129 points, 0.156 apart, a kink moved from 0 to 0.1 was not seen).
_FINGERPRINT_POINTS = 4097


def _python_function(obj: Any) -> types.FunctionType | None:
    """The Python function behind ``obj`` (a function, a bound method, a callable object's
    ``__call__``), or None (a C function, a module, a type, an object whose attributes raise)."""
    try:
        fn = getattr(obj, "__func__", obj)
        if isinstance(fn, types.FunctionType):
            return fn
        if callable(obj) and not isinstance(obj, (type, types.ModuleType)):
            call = getattr(type(obj), "__call__", None)
            call = getattr(call, "__func__", call)
            if isinstance(call, types.FunctionType):
                return call
    except Exception:  # noqa: BLE001 - an attribute lookup that raises (torch.classes)
        return None
    return None


def _code_digest(obj: Any, _seen: set | None = None) -> str:
    """A digest of a user callable's Python code: its bytecode, constants (nested functions'
    code too), names, defaults and closure values, and the code of the functions of its own
    module it calls; ``""`` for what has none (a C function). Any edit of that source moves
    it, also one between the sampled points. Values by their contents, not ``repr`` (sets
    print in the order of the process's hash seed; default reprs print addresses); modules
    and classes by name; each function once (recursion, helpers calling each other)."""
    import hashlib

    fn = _python_function(obj)
    seen = set() if _seen is None else _seen
    if fn is None:
        return ""
    if id(fn) in seen:
        return f"<{fn.__module__}.{fn.__qualname__}>"
    seen.add(id(fn))
    code = fn.__code__

    def flat(c) -> list:
        out = [c.co_code, c.co_names, c.co_varnames]
        for const in c.co_consts:
            out.append(flat(const) if isinstance(const, types.CodeType) else value(const))
        return out

    def value(v, d: int = 0) -> str:  # no memory address, no hash-seed order
        if isinstance(v, types.ModuleType):
            return f"module {v.__name__}"
        if isinstance(v, type):
            return f"class {v.__module__}.{v.__qualname__}"
        if _python_function(v) is not None:
            return _code_digest(v, seen)
        if d > 6:
            return type(v).__qualname__
        if isinstance(v, (set, frozenset)):
            return "{" + ",".join(sorted(value(e, d + 1) for e in v)) + "}"
        if isinstance(v, (list, tuple)):
            return type(v).__name__ + "(" + ",".join(value(e, d + 1) for e in v) + ")"
        if isinstance(v, dict):
            return "dict(" + ",".join(sorted(f"{value(k, d + 1)}:{value(e, d + 1)}" for k, e in v.items())) + ")"
        if not isinstance(v, (torch.Tensor, torch.nn.Module)) and isinstance(getattr(v, "__dict__", None), dict):
            return type(v).__qualname__ + value(vars(v), d + 1)  # an object: its attributes
        try:
            text = repr(v)
        except Exception:  # noqa: BLE001 - a user object whose repr fails
            text = type(v).__qualname__
        return re.sub(r" at 0x[0-9a-fA-F]+", "", text)

    cells = []
    for c in fn.__closure__ or ():
        try:
            cells.append(value(c.cell_contents))
        except ValueError:  # an empty cell
            cells.append("<empty>")
    # functions of its own module that it calls (a helper edited since)
    module_globals = fn.__globals__
    helpers = [value(module_globals[n]) for n in sorted(set(code.co_names))
               if isinstance(module_globals.get(n), types.FunctionType)
               and module_globals[n].__module__ == fn.__module__]
    text = repr((flat(code), value(fn.__defaults__), value(fn.__kwdefaults__), cells, helpers))
    return hashlib.sha256(text.encode()).hexdigest()


def _fingerprint(f: ResolvedFn, params: dict[str, float]) -> str:
    """16 hex digits of SHA-256 over a user function's derivative (torch's autograd, float64;
    float32 for a function that takes no float64) at :data:`_FINGERPRINT_POINTS` points of
    the fit domain, each as an integer multiple of 10⁻⁶ of the largest magnitude: what its
    table approximates, so an edited function (or another one of the same
    ``module:callable`` name) gets another cache file. Relative to the largest value, so
    the last bits that differ between CPU kernels (a tail value of 5·10⁻¹⁵ against 0) do not
    move it, with that largest value itself to 7 significant digits (``3·tanh`` is not
    ``tanh``). The digest of the function's code (:func:`_code_digest`) goes in too: an edit
    that moves f' only between the sampled points is seen. ``"unchecked"`` when the derivative
    cannot be taken here (an in-place function, one without autograd): the fit then reports
    what is wrong with the function."""
    import hashlib

    lo, hi = FIT_OPTIONS["domain"]
    d = None
    for dtype in (torch.float64, torch.float32):  # float32 for a function that takes no float64
        base = torch.linspace(float(lo), float(hi), _FINGERPRINT_POINTS, dtype=dtype)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                x = base.clone().requires_grad_()
                y = f(x * 1.0, params)  # not the leaf: an in-place function is the fit's to refuse
                (d,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
            break
        except Exception:  # noqa: BLE001 - any failure of the user's function: the fit reports it
            continue
    else:
        return "unchecked"
    values = torch.zeros_like(base, dtype=torch.float64) if d is None else d.detach().double()
    finite = values[values.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    steps = (values / scale * 1e6) if scale > 0 else values * 0
    # the scale too (to 7 digits): x and 3x have the same shape of derivative, not one table
    text = f"{scale:.7g};" + ",".join(str(round(v)) if math.isfinite(v) else str(v) for v in steps.tolist())
    text += ";" + _code_digest(f.callable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_path(f: ResolvedFn, params: dict[str, float]) -> Path:
    """The user-cache file of ``f``'s tables for ``params``: ``table_filename(name, params)``
    for a registry function; for a user ``"module:callable"`` its name with
    ``#<fingerprint>`` (:func:`_fingerprint`), so that the table of an edited function is
    never reused for the new one (its backward would be the old function's derivative)."""
    if f.act is not None:
        return cache_dir() / table_filename(f.name, params)
    return cache_dir() / table_filename(f"{f.name}#{_fingerprint(f, params)}", params)


def _fit_and_cache(f: ResolvedFn, bits: int, params: dict[str, float], note: str = "") -> Table:
    """Step 4: fit with :data:`FIT_OPTIONS`, add to the cache file, warn."""
    try:
        solver = importlib.import_module("fewbit.solver")
    except ImportError as exc:
        raise _solver_missing(exc) from exc
    if not hasattr(solver, "fit"):
        raise ImportError('fewbit.solver.fit is not available: pip install "fewbit[solver]"')
    # None: the solver mirrors a table when f' is even (a user function's checked numerically)
    symmetric = bool(f.act.even) if f.act is not None else None
    with torch.inference_mode(False), torch.enable_grad():  # the fit differentiates the function
        return _fit_and_cache_grad(f, solver, symmetric, bits, params, note)


def _fit_and_cache_grad(f: ResolvedFn, solver, symmetric: bool | None, bits: int, params: dict[str, float],
                        note: str) -> Table:
    """:func:`_fit_and_cache` with autograd on (a first call under ``torch.inference_mode``)."""
    if f.act is None:
        _check_asymptotes(f, params)
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
    except ValueError as exc:
        if params and "finite in float32" in str(exc):
            # a derivative past float32's range (a user function's scale parameter): the
            # table's own check names a level, not the parameter that put it there
            shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
            raise ValueError(f"{f.name}({shown}): its derivative reaches past float32's range, which "
                             f"fewbit's tables cannot hold ({exc})") from exc
        raise
    check_table_matches(table, f.name, params, "fewbit.solver.fit")
    if table.bits != bits:
        raise RuntimeError(f"fewbit.solver.fit returned a {table.bits}-bit table for bits={bits}")
    table = dataclasses.replace(table, provenance={**table.provenance, "cache_revision": CACHE_REVISION})
    path = _cache_path(f, params)
    where = f"cached at {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # processes fitting other bit widths of this file at once: one read-modify-write at a
        # time (without the lock one of three concurrent fits was dropped from the file)
        with filelock.FileLock(f"{path}.lock", timeout=60):
            existing = read_tables(path) if path.exists() else {}
            existing = {b: t for b, t in existing.items() if b != bits}
            write_tables(path, [*existing.values(), table])
    except (OSError, ValueError) as exc:  # OSError: filelock.Timeout too; ValueError: TableFormatError, other fit options
        where = f"not cached ({exc})"
    shown = ", ".join(f"{k}={v:g}" for k, v in params.items())
    warnings.warn(
        f"fewbit: fitted a {bits}-bit table for {f.name}({shown}) with grid={FIT_OPTIONS['grid']}; {where}{note}",
        TableFittedWarning,
        stacklevel=5,  # here < _fit_and_cache < table_for < load_table (or a functional wrapper) < its caller
    )
    return table


def _lookup(f: ResolvedFn, bits: int, full: dict[str, float], nd: dict[str, float], bp: dict[str, float],
            set_aside: bool) -> tuple[Table | None, str, str]:
    """Steps 1-3 (exact, shipped, user cache), never fitting.

    Returns ``(table or None, source, note)``: ``source`` says where the table came from
    (``"exact"``, ``"fewbit.tables/<file>"`` or the cache file's path); ``note`` is set when
    an unreadable cache file, or a valid one for another function or other parameters, was
    moved aside (``set_aside``; otherwise TableFormatError or ValueError).
    With ``set_aside`` (the runtime, which may fit) a cached table of an earlier
    :data:`CACHE_REVISION` counts as absent when the solver is installed.
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
            check_table_matches(table, f.name, nd, source)
            return table, source, ""
    path = _cache_path(f, nd)
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
    try:
        for other in cached.values():
            check_table_matches(other, f.name, nd, str(path))
    except ValueError as exc:
        if not set_aside:
            raise
        # a valid file for another function or other parameters (copied, or written by
        # hand): ours to rebuild like an unreadable one, and kept beside
        return None, "", _set_aside(path, exc, "a cache file for another setting")
    if bits not in cached:
        return None, "", ""
    table = _pick_bits(cached, bits, str(path))
    if table.provenance.get("cache_revision") != CACHE_REVISION and set_aside and _solver_available():
        return None, "", ""  # fitted by an earlier solver (CACHE_REVISION): fitted again
    return table, str(path), ""


def _solver_available() -> bool:
    """Whether ``fewbit.solver`` imports (scipy and numba installed): without it a cached
    table of an earlier :data:`CACHE_REVISION` is served rather than refused."""
    try:
        importlib.import_module("fewbit.solver")
    except ImportError:
        return False
    return True


def table_for(f: ResolvedFn, bits: int | None, full: dict[str, float], dtype: torch.dtype | None) -> Table:
    """The table of a resolved function (steps 1-4), kept in memory.

    Args:
        f: from :func:`resolve_fn`.
        bits: checked bits, or ``None`` for the function's default.
        full: every parameter (:meth:`ResolvedFn.full_params`).
        dtype: the input's dtype: a stepwise function's borders are its parameters
            rounded as torch rounds them for that dtype (``None``: unrounded); the
            table's ``params`` stay the requested ones.

    Returns:
        Table: the same object for the same ``(name, params, bits, border params)`` until
        :func:`clear_table_cache`.

    Raises:
        ValueError: a shipped table is for other parameters, or the fit refuses (e.g. a
            user function whose derivative grows past the fit domain, or ``bits`` outside
            1..8, which is not checked here: a stepwise function gets its exact table
            whatever ``bits``).
        TableFormatError: a shipped file is corrupt, or a cache file that is unreadable or
            for another setting cannot be moved aside (one that can is moved to
            ``<file>.corrupt`` and the table refitted).
        ImportError: a table must be fitted and the solver dependencies are missing.
        RuntimeError: the solver returned a table of other bits.

    Warns:
        TableFittedWarning: when the table was fitted.
    """
    if torch.compiler.is_compiling():
        # traced by torch.compile: a cache miss (lock, files, maybe a fit) cannot be traced,
        # and a read of _TABLES would be guarded on the keys it had before the load
        return getattr(_traced.HOLDER, _table_for_trace(f.name, bits, tuple(full.items()), dtype))
    return _table(f, bits, full, dtype)


@_traced.host_side
def _table(f: ResolvedFn, bits: int | None, full: dict[str, float], dtype: torch.dtype | None) -> Table:
    """:func:`table_for` outside a trace."""
    bits = bits if bits is not None else f.default_bits
    if f.act is not None:
        check_table_params(f.name, full)  # named here, not by the table's own check
    nd = f.table_params(full)
    bp = f.border_params(full, dtype)
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
            table = _fit_and_cache(f, bits, nd, note)
        return remember(_TABLES, key, table)


@_traced.constant
def _table_for_trace(name: str, bits: int | None, full: tuple, dtype: torch.dtype | None) -> str:
    """:func:`table_for` from hashable arguments, run by torch.compile once, eagerly, while
    tracing (:func:`fewbit._traced.constant`): the table is held by :mod:`fewbit._traced` and its name
    returned. Without it a cold cache broke the graph (``fullgraph=True`` raised) on the
    lock of :func:`table_for`."""
    # _table, not table_for: torch.compiler.is_compiling() is still True while Dynamo runs this
    table = _table(resolve_fn(name), bits, dict(full), dtype)
    return _traced.hold(("table", name, bits, full, dtype), table)


def find_table(fn: FnLike, bits: int | None = None,
               params: Mapping[str, float] | None = None) -> tuple[Table | None, str]:
    """The table :func:`load_table` would return, found the same way, but never fitted.

    For the command line (``fewbit plot`` / ``fewbit error``), which must show the tables
    the runtime uses and must not fit one silently.

    Args:
        fn: as :func:`resolve_fn` (not a Table or a path, unlike :func:`load_table`).
        bits: bits per element, 1..8; ``None``: the function's default.
        params: the function's parameters (defaults filled in).

    Returns:
        ``(table, source)``: ``source`` is ``"exact"``, ``"fewbit.tables/<file>"``, the path
        of the user cache file, or ``"memory"`` (fitted earlier in this process, not
        cached); ``(None, "")`` when :func:`load_table` would have to fit the table.

    Raises:
        ValueError: as :func:`load_table`.
        TypeError: as :func:`resolve_fn` (e.g. a Table or an ``os.PathLike`` for ``fn``).
        TableFormatError: if a shipped or cached file is unreadable (the cached file is left
            where it is; :func:`load_table` would move it aside and refit).
    """
    if bits is not None:
        bits = check_bits(bits)
    f = resolve_fn(fn)
    if bits is None:
        bits = f.default_bits
    full = f.full_params(params)
    nd = f.table_params(full)
    table, source, _ = _lookup(f, bits, full, nd, full, set_aside=False)
    if table is None:
        table = _TABLES.get((f.name, _params_tuple(nd), bits, _params_tuple(full)))
        source = "memory" if table is not None else ""
    return table, source


def load_table(fn: FnLike | TableLike, bits: int | None = None, params: Mapping[str, float] | None = None) -> Table:
    """Resolve the few-bit table of an activation (steps 1-4 of :mod:`fewbit.resolve`).

    Args:
        fn: a registry name (``"gelu"``, ``"gelu_tanh"``, aliases such as ``"swish"``), a
            Hugging Face formula name (``"gelu_new"``, ``"gelu_fast"``: the tables of the
            function it computes), a ``"module:callable"`` string or module-level
            (importable) callable for a user activation, a :class:`~fewbit.table.Table`
            (returned as is), or a path to a JSON table file (``str`` ending in ``.json``
            or ``os.PathLike``).
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
        bits = check_bits(bits)
    if isinstance(fn, Table) or _is_path(fn):
        return _given_table(fn, bits, "fn")[0]
    f = resolve_fn(fn)
    return table_for(f, bits, f.full_params(params), None)
