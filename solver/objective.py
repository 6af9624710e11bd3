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

Steep derivatives. Cells of ``1 / FINE_CELLS_PER_UNIT`` resolve an ``f'`` that varies on a
scale ~1, not one that varies on a scale far below it (celu with ``alpha = 1e-3``: scale
``alpha``; softplus with ``beta = 5000``: scale ``1 / beta``). There GL8 on 1/16-cells gave
errors up to 11x too small (celu ``alpha = 5e-4``, 1 bit: 2.21e-5 reported, 2.50e-4 true),
and refinement, minimising that wrong loss, made softplus ``beta = 5000`` at 2 bits truly
worse (6.19e-5 -> 6.92e-5). So every mesh here is refined adaptively
(:func:`resolve_cells`): a cell is bisected until Gauss-Legendre on it agrees with
Gauss-Legendre on its two halves, and ``int f'`` on it with the exact ``f(b) - f(a)``, to
``ADAPT_RTOL`` relative / ``ADAPT_ATOL`` absolute. For an ``f'`` that the uniform cells
already resolve (every registry function at its default parameters) no cell is split and
every result is bit-for-bit what it was.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from fewbit.table import Table

from . import weights as _weights
from .registry import SolverFunction

__all__ = ["Objective", "GL_NODES", "gauss_legendre", "resolve_cells", "table_error"]

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
#: Adaptive refinement of a mesh (:func:`resolve_cells`): a cell is kept when, for every
#: integrand ``phi``, ``|GL8(cell) - GL8(halves)| <= ADAPT_RTOL |GL8(halves)| + ADAPT_ATOL
#: * h * max|phi|`` (``h`` the cell's length, ``max|phi|`` over the whole mesh's nodes) ...
ADAPT_RTOL = 1e-10
ADAPT_ATOL = 1e-13
#: ... and GL8 of ``f'`` on it agrees with the exact ``f(b) - f(a)`` to these (looser: the
#: check is for features the nodes miss altogether, and a registry ``f`` may differ from
#: the primitive of its ``f'`` by 3e-8 relative: hardsigmoid's float32 slope) ...
EXACT_RTOL = 1e-6
EXACT_ATOL = 1e-9
#: ... else it is bisected, at most this many times (1/16 * 2**-40 ~ 6e-14: far below any
#: scale a float64 ``f'`` on a domain of width ~1..1e6 can resolve) ...
ADAPT_MAX_DEPTH = 40
#: ... and no more once the cells being bisected number this many (an ``f'`` that wiggles
#: everywhere: the mesh stays bounded; what is resolved by then is kept).
ADAPT_MAX_CELLS = 1 << 18
#: A kink of ``f'`` is a jump (refinement keeps a border on it) when ``f'`` changes across
#: it by more than this fraction of ``max |f'|``; a continuous kink (celu and elu with
#: ``alpha = 1`` at 0: ``f'(0-) = f'(0+) = 1``) is none: ``L`` is C^1 in a border there.
JUMP_RTOL = 1e-6


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


def _gl_integrals(lo: np.ndarray, hi: np.ndarray, integrands) -> tuple[np.ndarray, np.ndarray]:
    """GL8 integrals ``(m, n)`` of the ``m`` integrands over the ``n`` cells ``[lo, hi]``
    and each integrand's largest finite ``|value|`` at the nodes ``(m,)``."""
    h = hi - lo
    x = lo[:, None] + h[:, None] * _GL_X[None, :]
    vals = np.asarray(integrands(x), dtype=np.float64)  # (m, n, GL_NODES)
    with np.errstate(invalid="ignore", over="ignore"):
        I = (vals * (h[:, None] * _GL_W[None, :])[None]).sum(axis=2)
        a = np.abs(vals)
        big = np.where(np.isfinite(a), a, 0.0).reshape(vals.shape[0], -1).max(axis=1, initial=0.0)
    return I, big


def resolve_cells(edges: np.ndarray, integrands, exact=None, scale: np.ndarray | None = None) -> np.ndarray:
    """Adaptive bisection of a mesh until GL8 resolves the integrands on every cell.

    A cell ``[lo, hi]`` (length ``h``) is accepted when for each integrand ``phi_j``

        |GL8_[lo,hi](phi_j) - GL8_[lo,mid](phi_j) - GL8_[mid,hi](phi_j)|
            <= ADAPT_RTOL * |GL8 of the halves| + ADAPT_ATOL * h * scale_j

    (the difference estimates the error of GL8 on the cell, which is the rule then used on
    it), and, where ``exact`` gives ``int phi_0`` (``int f'`` as ``f(b) - f(a)``), GL8 of
    ``phi_0`` agrees with it to ``EXACT_RTOL`` / ``EXACT_ATOL`` plus its rounding error. The exact
    check catches what the halving test alone cannot: a feature narrower than the node
    spacing that both rules miss (celu's ``exp(x / alpha)`` beside a cell end for a tiny
    ``alpha``). Otherwise the cell is bisected and its halves are tested in turn, at most
    :data:`ADAPT_MAX_DEPTH` times; the work is proportional to the cells split (a few
    dozen per steep feature), not to the mesh.

    Args:
        edges: ``(n + 1,)`` increasing; no kink of an integrand inside a cell.
        integrands: ``integrands(x) -> (m, *x.shape)`` float64 values at nodes ``x``.
        exact: optional ``exact(lo, hi, scale_0) -> (value, err)`` of ``int phi_0`` per cell, ``err``
            its rounding error (``nan`` value: unknown there).
        scale: ``(m,)`` the integrands' magnitudes for the absolute tolerance; default
            their largest ``|value|`` at the nodes of ``edges``' cells.

    Returns:
        The refined edges: ``edges`` itself if no cell needed splitting, else a sorted
        superset of it.
    """
    edges = np.asarray(edges, dtype=np.float64)
    lo, hi = edges[:-1], edges[1:]
    I, big = _gl_integrals(lo, hi, integrands)
    scale = big if scale is None else np.asarray(scale, dtype=np.float64)
    new = []
    for _ in range(ADAPT_MAX_DEPTH):
        if lo.size == 0 or lo.size > ADAPT_MAX_CELLS:
            break
        mid = 0.5 * (lo + hi)
        h = hi - lo
        Il, _ = _gl_integrals(lo, mid, integrands)
        Ir, _ = _gl_integrals(mid, hi, integrands)
        H = Il + Ir
        with np.errstate(invalid="ignore", over="ignore"):
            tol = ADAPT_RTOL * np.abs(H) + ADAPT_ATOL * scale[:, None] * h[None, :]
            bad = (np.abs(I - H) > tol).any(axis=0)  # NaN (a non-finite f'): not split here
            if exact is not None:
                v, err = exact(lo, hi, scale[0])
                tol0 = EXACT_RTOL * np.abs(v) + EXACT_ATOL * scale[0] * h + err
                bad |= np.abs(I[0] - v) > tol0
        bad &= (lo < mid) & (mid < hi)
        if not bad.any():
            break
        m = mid[bad]
        new.append(m)
        lo, hi = np.r_[lo[bad], m], np.r_[m, hi[bad]]
        I = np.concatenate([Il[:, bad], Ir[:, bad]], axis=1)
    if not new:
        return edges
    return np.unique(np.concatenate([edges, *new]))


def _exact_df_integral(sf: SolverFunction, params: Mapping[str, float]):
    """``exact(lo, hi)`` for :func:`resolve_cells`: ``int_lo^hi f'`` per cell from the
    function's own cell integral or primitive, and its rounding error; ``None`` for a
    user function (its ``f`` through torch is no cheaper than quadrature, and need not
    be a primitive of ``f'`` off its found jumps) and a stepwise one (``f`` jumps:
    hardshrink, threshold; ``f'`` is constant between kinks anyway).

    The rounding error counts ``eps |x| max|f'|`` besides ``eps |f|``: ``f`` is often
    formed with cancellation (gelu_tanh's ``x (1 + tanh(...)) / 2`` at ``x = -7`` is
    ~1e-16 with an error ~1e-15)."""
    if sf.user or sf.stepwise:
        return None

    def exact(lo, hi, scale):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if sf.integral_impl is not None:
                v = np.asarray(sf.integral_impl(lo, hi, params), dtype=np.float64)
                err = 16.0 * _EPS * np.abs(v)
            else:
                F = sf.primitive_impl or sf.f_impl
                Flo = np.asarray(F(lo, params), dtype=np.float64)
                Fhi = np.asarray(F(hi, params), dtype=np.float64)
                v = Fhi - Flo
                err = 8.0 * _EPS * (np.abs(Flo) + np.abs(Fhi) + (np.abs(lo) + np.abs(hi)) * scale)
            bad = ~(np.isfinite(v) & np.isfinite(err))
            return np.where(bad, np.nan, v), np.where(bad, np.inf, err)

    return exact


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
        self._exact = _exact_df_integral(sf, self.params)
        # the border-independent fine mesh, refined where f' or w is steep (resolve_cells)
        base = _subdivide(np.r_[self.a, self.breakpoints, self.b], self.fine_step())
        _, self._scale = _gl_integrals(base[:-1], base[1:], self._integrands)
        steep = resolve_cells(base, self._integrands, self._exact, self._scale)
        #: the adaptively refined fine mesh (``None``: the uniform one resolves f' and w)
        self._steep_mesh = steep if steep.size > base.size else None
        #: whether f' or w varies on a scale below the uniform fine mesh's cells (celu with
        #: a small alpha, softplus with a large beta): likely below the DP grid's too
        self.steep = self._steep_mesh is not None
        #: kinks of f' where it jumps (``|f'(k+) - f'(k-)| > JUMP_RTOL max |f'|``), inside (a, b)
        self.jumps = self._find_jumps()
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

    def _integrands(self, x: np.ndarray) -> np.ndarray:
        """``f'``, ``f' w``, ``f'^2 w`` and ``w`` at nodes ``x``: what the fine mesh resolves."""
        with np.errstate(invalid="ignore", over="ignore"):
            g = self.df(x)
            w = self.density(x)
            gw = g * w
            return np.stack([g, gw, g * gw, w])

    def _find_jumps(self) -> np.ndarray:
        """The kinks at which ``f'`` jumps, from its values 256 ulps either side (beyond the
        point itself, where ``f'`` is torch's one-sided value, and beyond a user function's
        jump, a transition over <= 64 ulps: :func:`fewbit.solver.registry.find_jumps`)."""
        k = self.kinks
        if k.size == 0:
            return k
        d = 256.0 * np.spacing(np.abs(k))
        with np.errstate(invalid="ignore", over="ignore"):
            left, right = self.df(k - d), self.df(k + d)
            ref = max(float(self._scale[0]), float(np.max(np.abs(np.r_[left, right]), initial=0.0)))
            jump = ~(np.abs(right - left) <= JUMP_RTOL * ref)  # a non-finite side: a jump
        return k[jump]

    def resolve(self, edges: np.ndarray) -> np.ndarray:
        """``edges`` refined until GL8 resolves ``f'`` and the weight on every cell
        (:func:`resolve_cells`); ``edges`` itself where it already does."""
        return resolve_cells(edges, self._integrands, self._exact, self._scale)

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
        """Prefix integrals ``W, FW, F2`` at the grid points ``t`` (each ``(n + 1,)``, starting at 0).

        A grid cell on which GL8 does not resolve ``f'`` (:meth:`resolve`; e.g. celu
        ``alpha = 5e-4`` on the default grid's 0.0025-cells) is integrated over its
        adaptive sub-cells, so the DP's costs are ``L`` of its borders to rounding.
        """
        t = np.asarray(t, dtype=np.float64)
        fine = self.resolve(t)
        if fine.size > t.size:
            start = np.searchsorted(fine, t[:-1])
            W, FW, F2 = (np.add.reduceat(v, start) for v in self.cell_integrals(fine))
        else:
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
        """The fine mesh with the ``borders`` put in: uniform cells of :meth:`fine_step`
        between breakpoints and borders, or, where ``f'`` or ``w`` is steep, the adaptive
        border-independent mesh with the borders inserted (splitting a resolved cell keeps
        it resolved, and ``L`` stays smooth in the borders)."""
        borders = np.asarray(borders, dtype=np.float64)
        if self._steep_mesh is not None:
            b = borders[(borders > self.a) & (borders < self.b)]
            return np.unique(np.r_[self._steep_mesh, b])
        pts = np.r_[self.a, self.breakpoints, borders, self.b]
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
    that is exact (stepwise functions) has error 0. Composite GL8 on cells of 1/16 split
    at the kinks and borders, refined adaptively where ``f'`` is steep
    (:func:`resolve_cells` on ``f'`` and ``(f' - q)^2``: relative accuracy ~``ADAPT_RTOL``).
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
    full = dict(params)

    def integrands(x):
        with np.errstate(invalid="ignore", over="ignore"):
            g = sf.df_impl(x, full)
            r = g - table.evaluate(x)
            return np.stack([g, r * r])

    edges = resolve_cells(edges, integrands, _exact_df_integral(sf, full))
    hh = np.diff(edges)
    x = edges[:-1, None] + hh[:, None] * _GL_X[None, :]
    gw = hh[:, None] * _GL_W[None, :]
    q = table.evaluate(x)
    g = sf.df_impl(x, dict(params))
    if not np.all(np.isfinite(g)):
        raise ValueError(f"fn: the derivative of {sf.name} is not finite on the domain {domain}")
    r = g - q
    return float(math.fsum((r * r * gw).ravel()))
