"""Refinement (docs/method.md §5): gradient, never worse than DP, best against independent optimisers."""

import numpy as np
import pytest
from scipy import integrate, optimize

from fewbit.solver import approximation_error, fit, registry, weights
from fewbit.table import load_shipped
from fewbit.solver.dp import dp_numba, prefix_integrals
from fewbit.solver.objective import Objective
from fewbit.solver.refine import borders_from_z, refine, z_from_borders


def _objective(name, weight="uniform", domain=(-10.0, 10.0), symmetric=False):
    sf = registry.get(name)
    return Objective(sf, sf.params(), weights.parse(weight), domain, symmetric=symmetric)


@pytest.mark.parametrize(
    "name,weight,symmetric",
    [("gelu", "uniform", False), ("silu", "normal:2.0", False), ("sigmoid", "uniform", True), ("mish", "normal:1.5", False)],
)
def test_gradient_matches_finite_differences(name, weight, symmetric):
    obj = _objective(name, weight, symmetric=symmetric)
    rng = np.random.default_rng(0)
    s = np.sort(rng.uniform(obj.a + 0.3, obj.b - 0.3, 5))
    y, _ = obj.levels_and_loss(s)
    g = obj.gradient(s, y)
    h = 1e-5
    for i in range(s.size):
        sp, sm = s.copy(), s.copy()
        sp[i] += h
        sm[i] -= h
        fd = (obj.loss(sp) - obj.loss(sm)) / (2 * h)
        assert g[i] == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_reparametrisation_roundtrip():
    s = np.array([-3.0, -1.0, 0.5, 7.0])
    z = z_from_borders(s, -10.0, 10.0)
    np.testing.assert_allclose(borders_from_z(z, -10.0, 10.0), s, rtol=1e-13)


@pytest.mark.parametrize("name", ["gelu", "silu", "selu", "softsign", "hardswish"])
@pytest.mark.parametrize("K", [2, 4, 8])
def test_refined_never_worse_than_dp(name, K):
    sf = registry.get(name)
    obj = _objective(name, symmetric=sf.even)
    t = obj.grid(300)  # coarse grid: refinement has room to improve
    W, FW, F2 = prefix_integrals(obj, t)
    c_dp, idx = dp_numba(W, FW, F2, K)
    s0 = t[idx]
    L0 = obj.loss(s0)
    assert L0 == pytest.approx(c_dp, rel=1e-9, abs=1e-13)  # the DP cost is the exact L of its borders
    s1, y1, L1 = refine(obj, s0)
    assert L1 <= L0
    assert np.all(np.diff(np.r_[obj.a, s1, obj.b]) > 0)
    assert L1 == pytest.approx(obj.loss(s1), rel=1e-12)
    # at the refined optimum the gradient is negligible (except in borders held on a jump of f')
    g = obj.gradient(s1, y1)
    free = np.array([not np.any(np.abs(obj.kinks - x) < 1e-9) for x in s1], dtype=bool)
    assert np.max(np.abs(g[free]), initial=0.0) <= 1e-6 * max(1.0, L1)


def _independent_loss(name, borders, A=-10.0, B=10.0):
    """Uniform-weight L from scipy.integrate.quad and f differences only (no fewbit quadrature)."""
    sf = registry.get(name)
    f = lambda x: float(sf.f(x))  # noqa: E731
    g2 = integrate.quad(lambda x: float(sf.df(x)) ** 2, A, B, limit=400, epsabs=1e-13, points=[0.0])[0]
    s = np.r_[A, np.sort(borders), B]
    return g2 - sum((f(b) - f(a)) ** 2 / (b - a) for a, b in zip(s[:-1], s[1:]))


@pytest.mark.parametrize("name,bits", [("gelu", 1), ("gelu", 2), ("silu", 2), ("tanh", 1)])
def test_shipped_table_is_best_against_differential_evolution(name, bits):
    t = load_shipped(name)[bits]
    K = 1 << bits
    n_free = K - 1  # mirrored: K - 1 borders on (0, 10), mirrored to 2K - 2
    sf = registry.get(name)
    fv = lambda x: float(sf.f(x))  # noqa: E731

    # maximise sum (dF)^2 / ds <=> minimise L (uniform weight); independent of fewbit's integrals
    def neg_gain(b):
        if t.symmetric:
            b = np.r_[-b[::-1], b]
        s = np.r_[-10.0, np.sort(b), 10.0]
        d = np.diff(s)
        if np.any(d <= 1e-9):
            return 1e9
        return -sum((fv(hi) - fv(lo)) ** 2 / (hi - lo) for lo, hi in zip(s[:-1], s[1:]))

    lo = 0.0 if t.symmetric else -10.0
    res = optimize.differential_evolution(
        neg_gain, [(lo, 10.0)] * n_free, seed=0, tol=1e-12, maxiter=300, polish=True
    )
    b_de = res.x if not t.symmetric else np.r_[-res.x[::-1], res.x]
    L_de = _independent_loss(name, b_de)
    L_fit = _independent_loss(name, t.borders)
    assert L_fit <= L_de * (1 + 1e-7)
    assert t.error == pytest.approx(L_fit, rel=1e-7)


def test_fit_is_best_against_random_restarts():
    obj = _objective("silu", domain=(-6.0, 6.0))
    t = fit("silu", 2, domain=(-6.0, 6.0), grid=2000)
    rng = np.random.default_rng(3)
    best = np.inf
    for _ in range(12):
        s0 = np.sort(rng.uniform(-6.0, 6.0, 3))
        best = min(best, refine(obj, s0)[2])
    assert t.error <= best * (1 + 1e-9)
    assert approximation_error(t) == pytest.approx(t.error, rel=1e-12)


def test_shipped_mirrored_table_is_best_against_random_restarts():
    # sigmoid, 3 bits: 7 free borders on [0, 10] (folded weight), mirrored to 15 intervals
    t = load_shipped("sigmoid")[3]
    obj = _objective("sigmoid", symmetric=True)
    rng = np.random.default_rng(7)
    best = np.inf
    for _ in range(6):
        s0 = np.sort(rng.uniform(0.0, 6.0, 7))
        best = min(best, refine(obj, s0)[2])
    assert t.error <= best * (1 + 1e-9)
    # and its borders are a stationary point of the folded objective
    s = np.asarray(t.borders)[7:]
    y, L = obj.levels_and_loss(s)
    assert L == pytest.approx(t.error, rel=1e-10)
    assert np.max(np.abs(obj.gradient(s, y))) < 1e-7


@pytest.mark.parametrize("borders", [[1.0, -1.0, 0.0], [-20.0, 0.0, 20.0], [np.nan, 0.0, 1.0], [0.0, 0.0],
                                     [[0.0, 1.0]]])
def test_refine_refuses_borders_it_cannot_refine(borders):
    """Unsorted, repeated, non-finite or out-of-domain borders gave levels of NaN and a
    lower-looking loss, with no error."""
    sf = registry.get("gelu")
    obj = Objective(sf, sf.params({}), weights.uniform(), (-10, 10))
    with pytest.raises(ValueError, match=r"borders must be a 1-D, finite, strictly increasing array inside"):
        refine(obj, np.array(borders))
