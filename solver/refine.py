"""Continuous refinement of DP borders (docs/method.md §5).

The DP optimum is exact only on the grid. Starting from it, :func:`refine` minimises
``L(s, y(s))`` (Novikov et al., eq. 3-5) over continuous borders with the analytic
gradient

    dL/ds_i = (y_i - y_{i-1}) (2 f'(s_i) - y_{i-1} - y_i) w(s_i),

levels ``y`` being recomputed from exact integrals at every step. Borders stay ordered
and inside ``(a, b)`` through the reparametrisation ``gaps = (b - a) * softmax(z)``,
``s_i = a + sum_{m < i} gaps_m``, and L-BFGS-B on ``z``. The result is accepted only if
``L`` did not increase.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from .objective import Objective

__all__ = ["refine", "borders_from_z", "z_from_borders"]


def z_from_borders(borders: np.ndarray, a: float, b: float) -> np.ndarray:
    """Inverse of :func:`borders_from_z` (``z`` has ``K`` entries, mean 0).

    ``z_m = log(gap_m / (b - a))`` minus its mean, ``gap_m`` the ``K`` gaps between
    ``a, borders..., b`` (docs/method.md §5).

    Args:
        borders: ``(K - 1,)`` strictly increasing floats inside ``(a, b)`` (not checked: a
            gap ``<= 0`` is taken as ``1e-300``).
        a, b: the interval, ``a < b``.

    Returns:
        float64 array ``(K,)`` with mean 0 (``[0.0]`` for no borders).
    """
    s = np.r_[a, np.asarray(borders, dtype=np.float64), b]
    gaps = np.diff(s) / (b - a)
    z = np.log(np.maximum(gaps, 1e-300))
    return z - z.mean()


def borders_from_z(z: np.ndarray, a: float, b: float) -> np.ndarray:
    """Interior borders ``(K - 1,)`` from ``z`` ``(K,)``: ordered and inside ``(a, b)``.

    ``s_i = a + (b - a) * sum_{m < i} softmax(z)_m`` (docs/method.md §5). In floating point
    a gap whose softmax weight underflows is 0, so two borders, or a border and ``a`` or
    ``b``, can coincide; :func:`refine` checks for that.

    Args:
        z: ``(K,)`` finite floats, ``K >= 1``.
        a, b: the interval, ``a < b``.

    Returns:
        float64 array ``(K - 1,)``, non-decreasing.
    """
    p = np.exp(z - z.max())
    p /= p.sum()
    return a + (b - a) * np.cumsum(p)[:-1]


def refine(
    objective: Objective,
    borders: np.ndarray,
    *,
    maxiter: int = 500,
    gtol: float = 1e-12,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Refine interior borders of a piecewise-constant fit.

    Borders that sit on a kink or jump of ``f'`` (the DP grid contains those points) are
    kept there: ``L`` is not differentiable in them (``dL/ds_i`` may change sign), and the
    DP put them there because it is the best place. The other borders move freely.

    Args:
        objective: the problem (``f'``, weight, interval ``[a, b]``).
        borders: ``(K - 1,)`` strictly increasing starting borders inside ``(a, b)``.
        maxiter: L-BFGS-B iterations at most.
        gtol: stop when the relative projected gradient falls below this.

    Returns:
        ``(borders, levels, loss)``: refined borders ``(K - 1,)``, optimal levels ``(K,)``
        and ``L`` (float). If refinement does not lower ``L``, the input borders are returned.

    Raises:
        ValueError: ``borders`` is not 1-D, not finite, not strictly increasing or not
            inside ``(a, b)`` (levels of NaN and a lower-looking loss came back).
    """
    a, b = objective.a, objective.b
    s0 = np.asarray(borders, dtype=np.float64)
    if s0.ndim != 1 or not np.isfinite(s0).all() or (s0.size and not (a < s0[0] and s0[-1] < b)) \
            or np.any(np.diff(s0) <= 0):
        raise ValueError(f"borders must be a 1-D, finite, strictly increasing array inside ({a!r}, {b!r}), "
                         f"got {np.array2string(s0, threshold=8)}")
    y0, L0 = objective.levels_and_loss(s0)
    if s0.size == 0 or L0 <= 0.0:
        return s0, y0, L0
    scale = 1.0 / L0

    # anchors: a, borders on kinks of f', b; free borders are grouped between anchors.
    # (A jump of the weight only changes the size of dL/ds_i, not its sign: no anchor.)
    bp = objective.kinks
    tol = 1e-12 * (b - a)
    on_bp = np.array([bp.size > 0 and np.min(np.abs(bp - x)) <= tol for x in s0], dtype=bool)
    anchors = np.r_[a, s0[on_bp], b]
    group = np.searchsorted(anchors, s0[~on_bp])  # gap index (1-based) of each free border
    free_idx = np.flatnonzero(~on_bp)
    if free_idx.size == 0:
        return s0, y0, L0
    gaps = [(anchors[k - 1], anchors[k], free_idx[group == k]) for k in range(1, anchors.size)]
    gaps = [g for g in gaps if g[2].size]
    sizes = [g[2].size + 1 for g in gaps]
    offsets = np.r_[0, np.cumsum(sizes)]

    def assemble(z):
        s = s0.copy()
        for (lo, hi, idx), o0, o1 in zip(gaps, offsets[:-1], offsets[1:]):
            s[idx] = borders_from_z(z[o0:o1], lo, hi)
        return s

    def fun(z):
        s = assemble(z)
        if np.any(np.diff(np.r_[a, s, b]) <= 0):
            return np.inf, np.zeros_like(z)
        y, L = objective.levels_and_loss(s)
        gs = objective.gradient(s, y)  # dL/ds_i
        gz = np.empty_like(z)
        for (lo, hi, idx), o0, o1 in zip(gaps, offsets[:-1], offsets[1:]):
            zz = z[o0:o1]
            # s_i = lo + sum_{m < i} g_m within the gap: dL/dg_m = sum_{i > m} dL/ds_i
            G = np.r_[np.cumsum(gs[idx][::-1])[::-1], 0.0]
            p = np.exp(zz - zz.max())
            p /= p.sum()
            # g = (hi - lo) softmax(z): dL/dz_l = (hi - lo) p_l (G_l - sum_m G_m p_m)
            gz[o0:o1] = (hi - lo) * p * (G - np.dot(G, p))
        return L * scale, gz * scale

    z0 = np.concatenate([z_from_borders(s0[idx], lo, hi) for lo, hi, idx in gaps])
    res = minimize(
        fun, z0, jac=True, method="L-BFGS-B",
        options={"maxiter": maxiter, "gtol": gtol, "ftol": 1e-15, "maxcor": 30},
    )
    s1 = assemble(res.x)
    if np.all(np.diff(np.r_[a, s1, b]) > 0):
        y1, L1 = objective.levels_and_loss(s1)
        if L1 <= L0:
            return s1, y1, L1
    return s0, y0, L0
