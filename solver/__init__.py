"""fewbit.solver: offline fitting of few-bit tables (docs/method.md §2-5).

Novikov et al., "Few-bit Backward" (ICML 2023): the b-bit table of an activation's
derivative minimises ``L = sum_i int (f' - y_i)^2 w`` (eq. 3); an exact dynamic program on
a grid (sec. 3, app. G) followed by continuous refinement of the borders finds it.

This package imports numba and scipy; ``import fewbit`` never imports it.

Public API:
    fit, fit_many, approximation_error   -- fit tables / measure their error
    registry (get, names)                -- analytic f, f' of every supported activation
    weights (uniform, normal, histogram, parse)
    dp (dp_numba, dp_numpy, brute_force), refine (refine)
"""

from __future__ import annotations

from . import registry, weights
from .fit import DEFAULT_DOMAIN, DEFAULT_GRID, MAX_GRID, approximation_error, fit, fit_many
from .registry import get, names

__all__ = [
    # fitting
    "fit", "fit_many", "approximation_error", "DEFAULT_GRID", "MAX_GRID", "DEFAULT_DOMAIN",
    # functions and weights
    "registry", "get", "names", "weights",
]
