"""Weights ``w(x) >= 0`` of the fitting objective (docs/method.md §3, Novikov et al. eq. 3).

The objective ``L = sum_i int (f' - y_i)^2 w`` is weighted by where activations' inputs
fall. Three kinds, all zero outside their support:

- :func:`uniform` on ``[A, B]`` (``w = 1``, the default and the weight of reported errors);
- :func:`normal` with standard deviation ``sigma`` (density of N(0, sigma^2), restricted
  to the fitting domain);
- :func:`histogram`: an empirical density given by bin edges and densities.

A weight knows its density, the points where it is not smooth (``breakpoints``, put on
the DP grid so that per-cell quadrature stays exact), and whether it is piecewise
constant (then ``int f' w`` is exact from ``f`` itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Weight", "uniform", "normal", "histogram", "parse"]


@dataclass(frozen=True)
class Weight:
    """A weight function for the objective.

    Args:
        kind: ``"uniform"``, ``"normal"`` or ``"histogram"``.
        spec: the string recorded in tables (``"uniform"``, ``"normal:2.0"``, ``"histogram"``).
        edges: for piecewise-constant weights, ``(m + 1,)`` increasing bin edges
            (``None`` for uniform: then ``w = 1`` on the whole fitting domain).
        densities: ``(m,)`` densities ``>= 0`` per bin.
        sigma: standard deviation of the normal weight.

    A mirrored fit (docs/method.md §2) uses ``w(x) + w(-x)`` on ``x >= 0``; that folding, and the
    restriction to the fitting domain, are done by :class:`fewbit.solver.objective.Objective`.

    The constructor does not check its fields: build weights with :func:`uniform`,
    :func:`normal`, :func:`histogram` or :func:`parse`, which do.
    """

    kind: str
    spec: str
    edges: tuple[float, ...] | None = None
    densities: tuple[float, ...] | None = None
    sigma: float | None = None

    @property
    def piecewise_constant(self) -> bool:
        """True for uniform and histogram weights."""
        return self.kind != "normal"

    def __call__(self, x) -> np.ndarray:
        """``w(x)`` (float64, same shape as ``x``); uniform is 1 everywhere (restricted by the domain).

        Raises:
            ValueError: for a ``kind`` other than ``"uniform"``, ``"normal"``, ``"histogram"``.
        """
        x = np.asarray(x, dtype=np.float64)
        if self.kind == "uniform":
            return np.ones_like(x)
        if self.kind == "normal":
            s = self.sigma
            return np.exp(-0.5 * (x / s) ** 2) / (s * math.sqrt(2.0 * math.pi))
        if self.kind == "histogram":
            e = np.asarray(self.edges)
            d = np.asarray(self.densities)
            idx = np.searchsorted(e, x, side="right") - 1
            inside = (idx >= 0) & (idx < d.size)
            return np.where(inside, d[np.clip(idx, 0, d.size - 1)], 0.0)
        raise ValueError(f"unknown weight kind {self.kind!r}")

    def breakpoints(self) -> tuple[float, ...]:
        """Points where ``w`` jumps (bin edges)."""
        if self.kind == "histogram":
            return tuple(self.edges)
        return ()


def uniform() -> Weight:
    """``w = 1`` on the fitting domain ``[A, B]``.

    Returns:
        Weight: kind and spec ``"uniform"``.
    """
    return Weight("uniform", "uniform")


def normal(sigma: float) -> Weight:
    """Density of N(0, ``sigma``^2), restricted to the fitting domain.

    Args:
        sigma: standard deviation, a finite number > 0 (converted to float).

    Returns:
        Weight: kind ``"normal"``, spec ``"normal:<repr(float(sigma))>"`` (e.g. ``"normal:2.0"``).

    Raises:
        ValueError: unless ``sigma`` is finite and > 0.
    """
    try:
        s = float(sigma)
    except (TypeError, ValueError):
        raise ValueError(f"weight: sigma must be a number > 0, got {sigma!r}") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"weight: sigma must be finite and > 0, got {sigma!r}")
    return Weight("normal", f"normal:{s!r}", sigma=s)


def histogram(edges, densities) -> Weight:
    """Empirical density: ``densities[k]`` on ``[edges[k], edges[k+1])``, 0 outside.

    Args:
        edges: ``(m + 1,)`` strictly increasing finite bin edges.
        densities: ``(m,)`` finite densities ``>= 0``, not all 0 (e.g. ``np.histogram(..., density=True)``).
            They need not integrate to 1.

    Returns:
        Weight: kind and spec ``"histogram"``, ``edges`` and ``densities`` as float tuples
        (array-likes are flattened).

    Raises:
        ValueError: for non-increasing or non-finite edges, a length mismatch, negative or
            non-finite densities, or all densities 0.
    """
    e = np.asarray(edges, dtype=np.float64).reshape(-1)
    d = np.asarray(densities, dtype=np.float64).reshape(-1)
    if e.size < 2 or not np.all(np.isfinite(e)) or np.any(np.diff(e) <= 0):
        raise ValueError(f"weight: histogram edges must be >= 2 finite, strictly increasing values, got {e.tolist()[:8]}")
    if d.size != e.size - 1:
        raise ValueError(f"weight: histogram needs len(edges) - 1 = {e.size - 1} densities, got {d.size}")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError("weight: histogram densities must be finite and >= 0")
    if not np.any(d > 0):
        raise ValueError("weight: histogram densities must not all be 0")
    return Weight("histogram", "histogram", edges=tuple(e.tolist()), densities=tuple(d.tolist()))


def parse(spec) -> Weight:
    """A weight from a CLI string (``"uniform"``, ``"normal:SIGMA"``) or a :class:`Weight`.

    Args:
        spec: ``"uniform"`` or ``"normal:SIGMA"`` (case and surrounding whitespace ignored),
            or a :class:`Weight`. A histogram has no string form: pass :func:`histogram`'s result.

    Returns:
        Weight: ``spec`` itself if it is one, else :func:`uniform` or :func:`normal`.

    Raises:
        ValueError: for an unknown string or a bad ``SIGMA``.
        TypeError: for anything that is neither a string nor a :class:`Weight`.
    """
    if isinstance(spec, Weight):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"weight must be a str ('uniform', 'normal:SIGMA') or a Weight, got {type(spec).__name__}")
    s = spec.strip().lower()
    if s == "uniform":
        return uniform()
    if s.startswith("normal:"):
        arg = s.split(":", 1)[1]
        try:
            sigma = float(arg)
        except ValueError:
            raise ValueError(f"weight: 'normal:SIGMA' needs a number SIGMA > 0, got {spec!r}") from None
        return normal(sigma)
    if s == "normal":
        raise ValueError("weight: give the standard deviation as 'normal:SIGMA', e.g. 'normal:1.0'")
    raise ValueError(
        f"weight must be 'uniform' or 'normal:SIGMA' (a histogram is passed as "
        f"fewbit.solver.weights.histogram(edges, densities)), got {spec!r}"
    )

