"""The fitting objective and its exact integrals (docs/method.md §3; Novikov et al., eq. 3-5).

    L(s, y) = sum_i int_{s_i}^{s_{i+1}} (f'(x) - y_i)^2 w(x) dx

An :class:`Objective` binds ``f'`` (float64, with its kinks), a weight restricted to the
fitting interval, and for a mirrored fit (docs/method.md §2) folds the problem onto
``[0, C]``: ``L`` over ``[A, B]`` of a mirrored table equals the folded ``L`` with weight
``w(x) + w(-x)`` on ``[0, C]``, ``C = max(-A, B)``.

Integrals use a composite Gauss-Legendre rule whose cells never straddle a kink of
``f'``, a jump of ``w``, or a border, so they are accurate to rounding for the smooth
pieces. A user function's kinks are the jumps of its ``f'`` found numerically on the
interval (:func:`fewbit.solver.registry.find_jumps`). For piecewise-constant weights
``int f' w`` over a cell is ``w * (f(b) - f(a))``, exactly (registry functions), or the
function's own stable cell integral (softplus), or quadrature where ``f(b) - f(a)`` cancels.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from fewbit.table import Table

from . import weights as _weights
from .registry import SolverFunction

__all__ = ["Objective", "GL_NODES", "gauss_legendre", "table_error"]

#: Gauss-Legendre nodes per cell.
GL_NODES = 8
#: Cells per unit length for the "exact" integrals (refinement and reported errors).
FINE_CELLS_PER_UNIT = 16
#: Cells of the reported error's uniform mesh at most; a wider domain gets a graded mesh.
MAX_ERROR_CELLS = 20000
#: A cell's ``f(b) - f(a)`` stands for ``int_a^b f'`` unless its rounding error exceeds this
#: fraction of ``(b - a) max |f'|`` (then quadrature: :meth:`Objective._f_integrals`).
_CANCEL_TOL = 1e-10
_EPS = float(np.finfo(np.float64).eps)


def _graded(points: np.ndarray, h: float, ratio: float = 1.05) -> np.ndarray:
    """Sorted ``points`` with every gap split into cells of length ``h`` next to its ends,
    growing by ``ratio`` towards its middle: O(log(gap / h)) cells per gap instead of
    gap / h, for domains too wide for a uniform mesh."""
    p = np.unique(points)
    out = [p]
    for lo, hi in zip(p[:-1], p[1:]):
        half = 0.5 * (hi - lo)
        k = np.arange(int(math.ceil(math.log1p(half * (ratio - 1.0) / h) / math.log(ratio))) + 1)
        s = h * (ratio**k - 1.0) / (ratio - 1.0)
        s = s[(s > 0) & (s < half)]
        out += [lo + s, hi - s, [lo + half]]
    return np.unique(np.concatenate(out))


def gauss_legendre(n: int = GL_NODES) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights on ``[0, 1]`` (``n`` points)."""
    x, w = np.polynomial.legendre.leggauss(n)
    return 0.5 * (x + 1.0), 0.5 * w


_GL_X, _GL_W = gauss_legendre(GL_NODES)


def _subdivide(points: np.ndarray, h: float) -> np.ndarray:
    """Sorted unique ``points`` with every gap split into equal cells of length <= ``h``."""
    p = np.unique(points)
    gaps = np.diff(p)
    counts = np.maximum(1, np.ceil(gaps / h).astype(np.int64))
    starts = np.repeat(p[:-1], counts)
    steps = np.repeat(gaps / counts, counts)
    offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty(counts.sum() + 1)
    out[:-1] = starts + steps * offs
    out[-1] = p[-1]
    # exact original points (no rounding drift at the ends of gaps)
    out[np.cumsum(counts)[:-1]] = p[1:-1]
    return out


class Objective:
    """``f'``, weight and interval of one fit.

    Args:
        sf: the function (registry or user).
        params: full parameter dict (defaults filled in).
        weight: the weight (restricted to ``domain``).
        domain: ``(A, B)``, finite, ``A < B``.
        symmetric: fold onto ``[0, max(-A, B)]`` (needs ``A < 0 < B`` and an even ``f'``).

    Raises:
        ValueError: if the weight has no mass on the domain.
    """

    def __init__(
        self,
        sf: SolverFunction,
        params: Mapping[str, float],
        weight: _weights.Weight,
        domain: tuple[float, float],
        symmetric: bool = False,
    ) -> None:
        self.sf = sf
        self.params = dict(params)
        self.weight = weight
        self.domain = (float(domain[0]), float(domain[1]))
        self.symmetric = bool(symmetric)
        A, B = self.domain
        if symmetric:
            self.a, self.b = 0.0, max(-A, B)
        else:
            self.a, self.b = A, B
        if sf.kink_finder is None:  # analytic kinks (folded for a mirrored fit)
            kinks = set(sf.kinks_impl(self.params))
            if symmetric:
                kinks = {abs(p) for p in kinks}
        else:  # a user function's: the jumps of its f' found on the fitted interval
            kinks = set(sf.kinks_on(self.params, self.a, self.b))
        pts = set(weight.breakpoints()) | {A, B}
        if symmetric:
            pts = {abs(p) for p in pts}
        pts |= kinks
        #: points where f' jumps or kinks, inside (a, b)
        self.kinks = np.array(sorted(p for p in kinks if self.a < p < self.b), dtype=np.float64)
        #: kinks of f' and jumps of the (restricted, folded) weight, inside (a, b)
        self.breakpoints = np.array(sorted(p for p in pts if self.a < p < self.b), dtype=np.float64)
        self.use_f = not sf.user and weight.piecewise_constant
        if weight.kind == "normal":  # exactly: a narrow peak falls between quadrature nodes
            s = weight.sigma * math.sqrt(2.0)
            if A >= 0:  # a tail: erfc keeps what erf rounds to 1 - 1
                w_total = 0.5 * (math.erfc(A / s) - math.erfc(B / s))
            elif B <= 0:
                w_total = 0.5 * (math.erfc(-B / s) - math.erfc(-A / s))
            else:
                w_total = 0.5 * (math.erf(B / s) - math.erf(A / s))
        else:
            edges = _subdivide(np.r_[self.a, self.breakpoints, self.b], (self.b - self.a) / 256)
            w_total = self.cell_integrals(edges, with_f=False)[0].sum()
        if not w_total > 0:
            raise ValueError(f"weight: {weight.spec} has no mass on the domain {self.domain}")

    # -- pointwise -----------------------------------------------------------------------
    def df(self, x: np.ndarray) -> np.ndarray:
        """``f'(x)`` (float64)."""
        return self.sf.df_impl(np.asarray(x, dtype=np.float64), self.params)

    def density(self, x: np.ndarray) -> np.ndarray:
        """The (restricted, folded) weight at ``x``."""
        A, B = self.domain
        x = np.asarray(x, dtype=np.float64)

        def base(z):
            return self.weight(z) * ((z >= A) & (z <= B))

        return base(x) + base(-x) if self.symmetric else base(x)

    # -- cell integrals ------------------------------------------------------------------
    def cell_integrals(self, edges: np.ndarray, with_f: bool = True):
        """Per-cell ``int w``, ``int f' w``, ``int f'^2 w`` over ``[edges[k], edges[k+1]]``.

        Args:
            edges: ``(n + 1,)`` increasing float64; no kink or weight jump inside a cell.

        Returns:
            ``(W, FW, F2)``, each ``(n,)`` float64 (``FW``, ``F2`` are ``None`` unless ``with_f``).

        Raises:
            ValueError: if ``f'`` is not finite somewhere on the domain.
        """
        lo, hi = edges[:-1], edges[1:]
        h = hi - lo
        x = lo[:, None] + h[:, None] * _GL_X[None, :]
        gw = h[:, None] * _GL_W[None, :]
        if self.weight.piecewise_constant:
            d = self.density(0.5 * (lo + hi))
            W = d * h
            wx = d[:, None] * gw
        else:
            wx = self.density(x) * gw
            W = wx.sum(axis=1)
        if not with_f:
            return W, None, None
        g = self.df(x)
        if not np.all(np.isfinite(g)):
            bad = x[~np.isfinite(g)][0]
            raise ValueError(f"fn: the derivative of {self.sf.name} is not finite at x={float(bad)!r} on the domain")
        F2 = (g * g * wx).sum(axis=1)
        if self.use_f:
            FW = d * self._f_integrals(edges, g, gw)
        else:
            FW = (g * wx).sum(axis=1)
        return W, FW, F2

    def _f_integrals(self, edges: np.ndarray, g: np.ndarray, gw: np.ndarray) -> np.ndarray:
        """``int f'`` per cell as differences of the primitive (``f``), exact up to rounding.

        Where a difference has lost its digits (primitive values far larger than their
        change: softplus' ``~log(2) / beta`` for a tiny ``beta``, ``x + 1e300``), the
        function's own cell integral instead (``integral_impl``), or Gauss-Legendre
        quadrature of ``f'`` (``g`` at the nodes, ``gw`` the node weights).
        """
        sf = self.sf
        lo, hi = edges[:-1], edges[1:]
        if sf.primitive_impl is None and sf.integral_impl is not None:
            return np.asarray(sf.integral_impl(lo, hi, self.params), dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            F = np.asarray((sf.primitive_impl or sf.f_impl)(edges, self.params), dtype=np.float64)
            out = np.diff(F)
            # each difference's rounding error against 1e-10 of (b - a) * max |f'| (these cells)
            err = _EPS * (np.abs(F[:-1]) + np.abs(F[1:]))
            lost = ~(err <= _CANCEL_TOL * (hi - lo) * float(np.max(np.abs(g))))
        if lost.any():
            if sf.integral_impl is not None:
                alt = np.asarray(sf.integral_impl(lo[lost], hi[lost], self.params), dtype=np.float64)
            else:
                alt = (g[lost] * gw[lost]).sum(axis=1)
            out = out.copy()
            out[lost] = alt
        return out

    def grid(self, n: int) -> np.ndarray:
        """``n`` uniform cells on ``[a, b]`` with every interior kink / weight jump put in.

        A grid point closer than ``1e-9 (b - a)`` to a breakpoint is replaced by it; other
        breakpoints add a point. Returns ``(n' + 1,)`` increasing points, ``n' >= n``.
        """
        t = np.linspace(self.a, self.b, n + 1)
        bp = self.breakpoints
        if bp.size:
            tol = 1e-9 * (self.b - self.a)
            pos = np.clip(np.searchsorted(bp, t), 1, bp.size)
            dist = np.minimum(np.abs(t - bp[pos - 1]), np.abs(t - bp[np.minimum(pos, bp.size - 1)]))
            near = dist < tol
            near[0] = near[-1] = False
            t = np.unique(np.r_[t[~near], bp])
        return t

    def prefix(self, t: np.ndarray):
        """Prefix integrals ``W, FW, F2`` at the grid points ``t`` (each ``(n + 1,)``, starting at 0)."""
        W, FW, F2 = self.cell_integrals(t)
        z = np.zeros(1)
        return np.r_[z, np.cumsum(W)], np.r_[z, np.cumsum(FW)], np.r_[z, np.cumsum(F2)]

    # -- pieces ----------------------------------------------------------------------------
    def fine_step(self) -> float:
        """Cell length of the "exact" integrals: resolves ``f'`` (scale ~1), a narrow normal
        weight (``sigma / 8``) and small domains, with at most ~20000 cells."""
        h = min(1.0 / FINE_CELLS_PER_UNIT, (self.b - self.a) / 64)
        if self.weight.kind == "normal":
            h = min(h, self.weight.sigma / 8)
        return max(h, (self.b - self.a) / 20000)

    def _fine(self, borders: np.ndarray) -> np.ndarray:
        pts = np.r_[self.a, self.breakpoints, np.asarray(borders, dtype=np.float64), self.b]
        pts = pts[(pts >= self.a) & (pts <= self.b)]
        return _subdivide(pts, self.fine_step())

    def levels(self, borders: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Optimal levels for interior ``borders`` ``(K - 1,)`` (sorted, inside ``(a, b)``).

        Returns:
            ``(y, edges, piece)``: levels ``(K,)`` (weighted means of ``f'``; the plain mean
            for a piece without weight), the fine cell edges and each cell's piece index.
        """
        borders = np.asarray(borders, dtype=np.float64)
        edges = self._fine(borders)
        W, FW, _ = self.cell_integrals(edges)
        mid = 0.5 * (edges[:-1] + edges[1:])
        piece = np.searchsorted(borders, mid)
        K = borders.size + 1
        Wp = np.bincount(piece, W, minlength=K)
        FWp = np.bincount(piece, FW, minlength=K)
        y = np.empty(K)
        ok = Wp > 0
        y[ok] = FWp[ok] / Wp[ok]
        if not ok.all():
            # plain mean of f' over a piece the weight does not see
            h = np.diff(edges)
            x = edges[:-1, None] + h[:, None] * _GL_X[None, :]
            g = (self.df(x) * (h[:, None] * _GL_W[None, :])).sum(axis=1)
            y[~ok] = (np.bincount(piece, g, minlength=K) / np.bincount(piece, h, minlength=K))[~ok]
        return y, edges, piece

    def loss(self, borders: np.ndarray, y: np.ndarray | None = None) -> float:
        """``L(borders, y)`` evaluated directly as ``sum int (f' - y_i)^2 w`` (no cancellation).

        ``y=None`` uses the optimal levels.
        """
        return self.levels_and_loss(borders, y)[1]

    def levels_and_loss(self, borders: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, float]:
        """Optimal levels ``(K,)`` and ``L`` at those levels (or at ``y`` if given)."""
        borders = np.asarray(borders, dtype=np.float64)
        y_opt, edges, piece = self.levels(borders)
        y = y_opt if y is None else np.asarray(y, dtype=np.float64)
        h = np.diff(edges)
        x = edges[:-1, None] + h[:, None] * _GL_X[None, :]
        gw = h[:, None] * _GL_W[None, :]
        if self.weight.piecewise_constant:
            wx = self.density(0.5 * (edges[:-1] + edges[1:]))[:, None] * gw
        else:
            wx = self.density(x) * gw
        r = self.df(x) - y[piece][:, None]
        return y_opt, float((r * r * wx).sum())

    def gradient(self, borders: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``dL/ds_i = (y_i - y_{i-1}) (2 f'(s_i) - y_{i-1} - y_i) w(s_i)`` (docs/method.md §3)."""
        s = np.asarray(borders, dtype=np.float64)
        return (y[1:] - y[:-1]) * (2.0 * self.df(s) - y[:-1] - y[1:]) * self.density(s)


def table_error(sf: SolverFunction, params: Mapping[str, float], table: Table,
                domain: tuple[float, float]) -> float:
    """Method.md §3 error of a table: ``int_A^B (f'(x) - q(x))^2 dx`` with ``w = 1``.

    ``q`` is :meth:`fewbit.table.Table.evaluate`, the lookup the runtime does, so a table
    that is exact (stepwise functions) has error 0.
    """
    A, B = float(domain[0]), float(domain[1])
    b = np.asarray(table.borders, dtype=np.float64)
    kinks = list(sf.kinks_on(dict(params), A, B))
    pts = np.r_[A, kinks, b[(b > A) & (b < B)], B]
    h = min(1.0 / FINE_CELLS_PER_UNIT, (B - A) / 64)
    if (B - A) / h <= MAX_ERROR_CELLS:
        edges = _subdivide(pts, h)
    else:  # e.g. [-1e6, 1e6]: a uniform mesh would take gigabytes
        edges = _graded(np.r_[pts, [0.0] if A < 0.0 < B else []], h)
    hh = np.diff(edges)
    x = edges[:-1, None] + hh[:, None] * _GL_X[None, :]
    gw = hh[:, None] * _GL_W[None, :]
    q = table.evaluate(x)
    g = sf.df_impl(x, dict(params))
    if not np.all(np.isfinite(g)):
        raise ValueError(f"fn: the derivative of {sf.name} is not finite on the domain {domain}")
    r = g - q
    return float(math.fsum((r * r * gw).ravel()))
