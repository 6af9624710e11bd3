"""Fit few-bit tables: DP on a grid, then continuous refinement (docs/method.md §2-5).

Novikov et al., "Few-bit Backward" (ICML 2023): the optimal b-bit approximation of
``f'`` by a piecewise-constant ``q`` of ``2**b`` consecutive intervals minimises eq. 3;
sec. 3 / app. G solve it by dynamic programming, which we follow with a continuous
refinement of the borders. (Tables whose intervals share codes, which the format holds,
can do better at the same bits; they are not fitted: docs/method.md §4.)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Iterable, Mapping

import numpy as np

from fewbit import activations as _acts
from fewbit._checks import check_bits, is_int
from fewbit.table import Table, mirrored_code_map

from . import registry as _registry
from . import weights as _weights
from .objective import Objective, table_error

__all__ = ["fit", "fit_many", "approximation_error", "DEFAULT_GRID", "MAX_GRID", "DEFAULT_DOMAIN"]

#: Default number of DP grid cells on the fitted interval (``[A, B]``, or ``[0, B]`` when mirrored).
DEFAULT_GRID = 8000
#: Largest accepted ``grid``: the DP takes O(grid² · 2**bits) time (the default grid fits
#: in seconds; this one takes about 600 times longer) and O(grid · 2**bits) memory.
MAX_GRID = 200_000
DEFAULT_DOMAIN = (-10.0, 10.0)


def _check_domain(domain) -> tuple[float, float]:
    try:
        A, B = (float(d) for d in domain)
    except (TypeError, ValueError):
        raise ValueError(f"domain must be a pair (A, B) of finite numbers with A < B, got {domain!r}") from None
    if not (math.isfinite(A) and math.isfinite(B) and A < B):
        raise ValueError(f"domain must be a pair (A, B) of finite numbers with A < B, got {domain!r}")
    if not math.isfinite(B - A):
        raise ValueError(f"domain width B - A must be a finite float64, got {domain!r}")
    return A, B


def _command(func, fn, bits, domain, weight, grid, symmetric, params, refine) -> str:
    """The Python call that reproduces a fit: ``fit(fn, bits=3, ...)`` for one bit width,
    ``fit_many(fn, [1, 2, 3, 4], ...)`` for several; a histogram weight is written with its
    bins (``"histogram"`` alone did not run)."""
    args = [repr(fn), f"bits={bits!r}" if func == "fit" else repr(list(bits))]
    if domain != DEFAULT_DOMAIN:
        args.append(f"domain={domain!r}")
    if isinstance(weight, _weights.Weight) and weight.kind == "histogram":  # its bins, to run again
        args.append(f"weight=fewbit.solver.weights.histogram({list(weight.edges)!r}, {list(weight.densities)!r})")
    elif weight != "uniform":
        args.append(f"weight={weight!r}")
    if grid != DEFAULT_GRID:
        args.append(f"grid={grid!r}")
    if symmetric is not None:
        args.append(f"symmetric={symmetric!r}")
    if params:
        args.append(f"params={dict(params)!r}")
    if not refine:
        args.append("refine=False")
    return f"fewbit.solver.{func}({', '.join(args)})"


def _stepwise_table(sf, params, bits: int) -> Table:
    # exact: the objective is 0 whatever the weight
    base = dataclasses.replace(_acts.exact_table(sf.name, params), objective=0.0)
    if bits == 1:
        return base
    n_codes = 1 << bits
    values = list(base.values) + [0.0] * (n_codes - len(base.values))
    return Table(
        name=base.name,
        bits=bits,
        borders=base.borders,
        codes=base.codes,
        values=values,
        error=0.0,
        objective=0.0,
        params=base.params,
        domain=base.domain,
        weight=base.weight,
        symmetric=False,
        provenance={**base.provenance, "note": f"exact 1-bit table padded to {bits} bits (codes >= 2 unused)"},
    )


def _prepare(fn, bits_list, domain, weight, grid, symmetric, params):
    sf = _registry.get(fn)
    full = sf.params(params)
    if not sf.user:
        # what a table holds, as the runtime checks it (ELU's alpha past float32's range had
        # failed with "prefix integrals must be finite", naming no parameter, or written a
        # table that fewbit and torch then refused)
        _acts.check_table_params(sf.name, full)
    A, B = _check_domain(domain)
    w = _weights.parse(weight)
    if grid is None:
        grid = DEFAULT_GRID
    if not is_int(grid):
        raise ValueError(f"grid must be an integer number of cells, got {grid!r}")
    grid = int(grid)
    k_max = max(1 << b for b in bits_list)
    if grid < k_max:
        raise ValueError(f"grid must be at least 2**bits = {k_max} cells, got {grid}")
    if grid > MAX_GRID:
        raise ValueError(f"grid must be at most {MAX_GRID} cells (the DP takes O(grid**2 * 2**bits) time), got {grid}")
    if symmetric not in (None, True, False):
        raise ValueError(f"symmetric must be None, True or False, got {symmetric!r}")
    straddles = A < 0.0 < B
    if symmetric is None:
        # a user function's f' is checked numerically (it has no registry flag): an even one
        # had been fitted unmirrored, 3.1-3.6x the error of its mirrored table at 1-3 bits
        sym = (not sf.stepwise) and straddles and _registry.is_even(sf, full, max(-A, B))
    elif symmetric:
        if sf.stepwise:
            sym = False
        else:
            if not straddles:
                raise ValueError(f"symmetric=True needs a domain with A < 0 < B, got {(A, B)}")
            if not _registry.is_even(sf, full, max(-A, B)):
                raise ValueError(f"symmetric=True needs an even derivative, and {sf.name}' is not even")
            sym = True
    else:
        sym = False
    return sf, full, (A, B), w, grid, sym


# fit_many and fit spell out the same keyword arguments on purpose: they are the public
# signatures (help(), IDE completion, docs); _fit takes them positionally. Keep them in step.
def fit_many(
    fn: str,
    bits_list: Iterable[int],
    *,
    domain: tuple[float, float] = DEFAULT_DOMAIN,
    weight="uniform",
    grid: int | None = None,
    symmetric: bool | None = None,
    params: Mapping[str, float] | None = None,
    refine: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, Table]:
    """Fit tables for several bit widths at once, sharing the prefix integrals and one DP run.

    One DP run with ``K = 2**max(bits)`` pieces yields the optimum for every smaller ``K``
    (its table ``D[n, k]`` holds all of them), so ``fit_many(fn, [1, 2, 3, 4])`` costs about
    one ``fit(fn, 4)`` plus the refinements.

    Args: as :func:`fit`, with ``bits_list`` a non-empty iterable of bit widths in 1..8.

    Returns:
        ``{bits: Table}`` for each requested bit width.

    Raises:
        ValueError: as :func:`fit`, or for an empty ``bits_list``.
    """
    return _fit(fn, bits_list, domain, weight, grid, symmetric, params, refine, progress, "fit_many")


def _split_pieces(borders: np.ndarray, a: float, b: float, parts: int) -> np.ndarray:
    """The borders of ``[a, b]``'s pieces (``borders`` inside it, increasing) with each piece
    split into ``parts`` equal ones: ``(len(borders) + 1) * parts - 1`` borders."""
    edges = np.r_[a, np.asarray(borders, dtype=np.float64), b]
    steps = np.arange(parts, dtype=np.float64) / parts
    inner = (edges[:-1, None] + steps[None, :] * np.diff(edges)[:, None]).ravel()
    return inner[1:]


def _check_resolves(obj: Objective, grid: int, bits: int) -> None:
    """Warn when a normal weight is too narrow for the grid's cells to place ``2**bits``
    pieces in it (cells wider than ``16 sigma / 2**bits``): the DP's borders lie on the grid,
    and the refinement then stops in a local optimum. gelu, normal:1e-3 on [-10, 10],
    against the best (a domain of +-12 sigma): 2 bits, cells of 10 sigma 3.1x, 4 sigma 1.00x;
    3 bits, 2.5 sigma 1.00x; 4 bits, 2.5 sigma 3.6x, 1.25 sigma 1.00x."""
    w = obj.weight
    cell = (obj.b - obj.a) / grid
    if w.kind != "normal" or cell <= 16 * w.sigma / 2**bits:
        return
    need = math.ceil((obj.b - obj.a) * 2**bits / (16 * w.sigma))
    finer = f"grid >= {need}" if need <= MAX_GRID else f"a domain of about +-{12 * w.sigma:.3g}"
    warnings.warn(f"weight {w.spec} is narrower than the grid's cells ({cell:.3g} wide with grid={grid}): the "
                  f"borders cannot follow it and the fit can be several times worse than the best; pass {finer}",
                  RuntimeWarning, stacklevel=4)


def _fit(fn, bits_list, domain, weight, grid, symmetric, params, refine, progress, caller) -> dict[int, Table]:
    """:func:`fit_many`; ``caller`` ("fit" or "fit_many") names the call in the provenance."""
    if is_int(bits_list):
        bits_list = [bits_list]
    bits_list = sorted({check_bits(b) for b in bits_list})
    if not bits_list:
        raise ValueError("bits_list must hold at least one bit width in 1..8, got none")
    sf, full, dom, w, grid, sym = _prepare(fn, bits_list, domain, weight, grid, symmetric, params)
    nondefault = {k: v for k, v in full.items() if v != float(sf.defaults[k])}

    if sf.stepwise:
        if progress is not None:
            progress(0, 1)
        out = {b: _stepwise_table(sf, full, b) for b in bits_list}
        if progress is not None:
            progress(1, 1)
        return out

    from fewbit import __version__
    from .dp import backtrack, dp_chunks, dp_numba_tables
    from .refine import refine as _refine

    obj = Objective(sf, full, w, dom, symmetric=sym)
    _check_resolves(obj, grid, max(bits_list))
    t = obj.grid(grid)
    # Steps: the prefix integrals, each kernel call of the DP, one refinement per bit width.
    n_chunks = len(dp_chunks(t.size - 1, 1 << max(bits_list)))
    total = 1 + n_chunks + len(bits_list)

    def report(done: int) -> None:
        if progress is not None:
            progress(done, total)

    report(0)
    W, FW, F2 = obj.prefix(t)
    report(1)
    k_max = 1 << max(bits_list)
    _, Arg = dp_numba_tables(W, FW, F2, k_max, progress=lambda done, _: report(1 + done))
    n = t.size - 1
    out: dict[int, Table] = {}
    narrower: tuple[int, np.ndarray, float] | None = None  # (bits, borders, loss) of the last width
    for bits in bits_list:
        K = 1 << bits
        idx = backtrack(Arg, n, K)
        s = t[idx]
        if refine:
            s, y, loss = _refine(obj, s)
            if narrower is not None and narrower[2] < loss:
                # A grid too coarse for K pieces leaves the DP's borders a worse start than
                # the narrower table's (gelu, grid 17: 4 bits 1.54e-2 against 3 bits'
                # 1.19e-2, h60). Its pieces, each split evenly, are no worse; refined, kept
                # where better: more bits are never worse than fewer.
                s2, y2, loss2 = _refine(obj, _split_pieces(narrower[1], obj.a, obj.b, 1 << (bits - narrower[0])))
                if loss2 < loss:
                    s, y, loss = s2, y2, loss2
            narrower = (bits, s, loss)
        else:
            y, loss = obj.levels_and_loss(s)
        # mirrored: K pieces on [0, C] -> 2K - 1 intervals sharing K codes
        borders, codes = mirrored_code_map(s) if sym else (s.tolist(), list(range(K)))
        provenance = {
            "solver_version": __version__,
            "grid": grid,
            "domain": list(dom),
            "weight": w.spec,
            "refined": bool(refine),
            "command": _command(
                caller, fn, bits_list[0] if caller == "fit" else bits_list, dom,
                w if w.kind == "histogram" else w.spec, grid, symmetric,
                nondefault, refine,
            ),
        }
        table = Table(
            name=sf.name,
            bits=bits,
            borders=borders,
            codes=codes,
            values=y.tolist(),
            params=nondefault,
            domain=dom,
            weight=w.spec,
            symmetric=sym,
            provenance=provenance,
            objective=max(float(loss), 0.0),
        )
        out[bits] = dataclasses.replace(table, error=table_error(sf, full, table, dom))
        report(1 + n_chunks + len(out))
    return out


def fit(
    fn: str,
    bits: int,
    *,
    domain: tuple[float, float] = DEFAULT_DOMAIN,
    weight="uniform",
    grid: int | None = None,
    symmetric: bool | None = None,
    params: Mapping[str, float] | None = None,
    refine: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Table:
    """Fit the best ``bits``-bit table of ``f'``: ``2**bits`` consecutive intervals, one
    level each (mirrored for an even ``f'``), as the paper poses it (docs/method.md §2-5).

    Minimises ``L = sum_i int (f' - y_i)^2 w`` (Novikov et al., ICML 2023, eq. 3): an exact
    DP on a grid of ``grid`` cells (sec. 3, app. G), then continuous refinement of the
    borders. For an even ``f'`` the fit is done on ``[0, max(-A, B)]`` with the folded
    weight and mirrored: ``2**(bits + 1) - 1`` intervals share ``2**bits`` codes.

    Stepwise derivatives (ReLU family) are not fitted: the result is
    :func:`fewbit.activations.exact_table` (error 0). For ``bits > 1`` it is that same
    exact table padded to ``2**bits`` values (codes >= 2 unused) so that
    ``table.bits == bits``; use ``bits=1`` to save memory.

    Args:
        fn: registry name (``"gelu"``), alias (``"swish"``), or ``"package.module:callable"``
            naming a torch elementwise function (``f'`` by autograd in float64).
        bits: bits per element of the code, 1..8.
        domain: ``(A, B)``, finite, ``A < B``: the fitting interval (the weight is 0 outside).
        weight: ``"uniform"``, ``"normal:SIGMA"``, or a :class:`fewbit.solver.weights.Weight`
            (e.g. :func:`fewbit.solver.weights.histogram`).
        grid: DP grid cells on the fitted interval (default :data:`DEFAULT_GRID` = 8000);
            at least ``2**bits``, at most :data:`MAX_GRID` (200000). Time is O(grid^2 * 2**bits).
        symmetric: ``None`` mirrors when ``f'`` is even (the registry's flag; a user
            function's ``f'`` checked numerically on ``[-max(-A, B), max(-A, B)]``, to 1e-9
            of its largest value) and ``A < 0 < B``;
            ``True`` forces it (``ValueError`` if ``f'`` is not even); ``False`` never.
        params: the function's parameters, merged over its defaults.
        refine: refine the DP borders continuously (docs/method.md §5).
        progress: optional ``progress(done, total)`` callback (e.g. to drive a tqdm bar).

    Returns:
        Table: ``error`` is docs/method.md §3's error with ``w = 1`` on ``domain`` (not
        normalised, over the whole domain also for mirrored tables), whatever the fit weight;
        ``objective`` is the minimised ``L`` with the fit's ``weight`` (equal to ``error``,
        up to quadrature, for the uniform weight).

    Raises:
        ValueError: for ``bits`` outside 1..8, a bad domain, grid, weight or ``symmetric``,
            an unknown function or parameter, or a user function that cannot be loaded or
            has a non-finite derivative on the domain.
    """
    bits = check_bits(bits)
    return _fit(fn, [bits], domain, weight, grid, symmetric, params, refine, progress, "fit")[bits]


def approximation_error(table: Table, fn: str | None = None, *, domain: tuple[float, float] | None = None) -> float:
    """Method.md §3 error of ``table``: ``int_A^B (f'(x) - q(x))^2 dx`` (``w = 1``, not normalised).

    Integrated with composite Gauss-Legendre split at the table's borders and ``f'``'s
    kinks (accurate to rounding). ``q`` is looked up exactly as at runtime
    (``searchsorted(borders, x, right=False)``), so exact stepwise tables give 0.

    Args:
        table: the table (its ``params`` are used for ``f``).
        fn: function name or spec; default ``table.name``.
        domain: ``(A, B)``; default ``table.domain``.

    Returns:
        float: the error.

    Raises:
        ValueError: for an unknown function, bad domain, or params the function does not take.
    """
    if not isinstance(table, Table):
        raise TypeError(f"table must be a fewbit.table.Table, got {type(table).__name__}")
    sf = _registry.get(table.name if fn is None else fn)
    full = sf.params(table.params)
    dom = _check_domain(table.domain if domain is None else domain)
    return table_error(sf, full, table, dom)
