"""fit / fit_many / approximation_error: validation, symmetry, known values (docs/method.md §8)."""

import numpy as np
import pytest

from fewbit import activations
from fewbit.solver import approximation_error, fit, fit_many, registry, weights
from fewbit.solver.dp import dp_numba
from fewbit.solver.objective import Objective
from fewbit.table import Table, load_shipped

def _dp_cost(name, bits, domain, symmetric):
    sf = registry.get(name)
    obj = Objective(sf, sf.params(), weights.uniform(), domain, symmetric=symmetric)
    W, FW, F2 = obj.prefix(obj.grid(GRID))
    return dp_numba(W, FW, F2, 1 << bits)[0]


STEPWISE = [n for n, a in activations.ACTIVATIONS.items() if a.stepwise]
GRID = 2000  # small grid for speed; refinement makes the result grid-independent


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=0), "bits must be an integer in 1..8, got 0"),
        (dict(bits=9), "bits must be an integer in 1..8, got 9"),
        (dict(bits=2.0), "bits must be an integer in 1..8"),
        (dict(bits=2, domain=(1.0, -1.0)), "domain must be"),
        (dict(bits=2, domain=(-np.inf, 1.0)), "domain must be"),
        (dict(bits=2, domain=3), "domain must be"),
        (dict(bits=4, grid=8), "grid must be at least 2\\*\\*bits = 16 cells, got 8"),
        (dict(bits=2, params={"alpha": 1.0}), "gelu takes no parameters; got alpha"),
        (dict(bits=2, weight="normal:-1"), "sigma must be finite and > 0"),
        (dict(bits=2, weight="normal"), "normal:SIGMA"),
        (dict(bits=2, weight="cauchy"), "weight must be 'uniform' or 'normal:SIGMA'"),
        (dict(bits=2, symmetric=True), "needs an even derivative"),
        (dict(bits=2, symmetric="yes"), "symmetric must be None, True or False"),
    ],
)
def test_fit_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit("gelu", **kwargs)


@pytest.mark.parametrize("name, params, match", [
    ("elu", {"alpha": 1e300}, "alpha of elu must be within float32's range"),
    ("elu", {"alpha": 1e39}, "alpha of elu must be within float32's range"),
    ("leaky_relu", {"negative_slope": 1e300}, "negative_slope of leaky_relu must be within float32's range"),
])
def test_fit_refuses_parameters_no_table_holds(name, params, match):
    """The runtime's rule for what a table holds: ``fit("elu", params={"alpha": 1e300})``
    failed with "prefix integrals must be finite" (no parameter named), and alpha=1e39 wrote
    a table that fewbit and torch then refused."""
    with pytest.raises(ValueError, match=match):
        fit(name, 1, grid=200, params=params)


def test_fit_validation_other():
    with pytest.raises(ValueError, match="unknown activation"):
        fit("gelux", 2)
    with pytest.raises(ValueError, match="symmetric=True needs a domain with A < 0 < B"):
        fit("sigmoid", 2, domain=(0.0, 5.0), symmetric=True)
    with pytest.raises(TypeError, match="weight must be a str"):
        fit("gelu", 2, weight=1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        weights.histogram([0, 2, 1], [1, 1])
    with pytest.raises(ValueError, match="not all be 0"):
        weights.histogram([0, 1, 2], [0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        weights.histogram([0, 1, 2], [1, -1])
    with pytest.raises(ValueError, match="len\\(edges\\) - 1 = 2"):
        weights.histogram([0, 1, 2], [1])
    with pytest.raises(ValueError, match="no mass on the domain"):
        fit("gelu", 1, weight=weights.histogram([20, 30], [1.0]), grid=100)
    with pytest.raises(ValueError, match="bits_list must hold"):
        fit_many("gelu", [])


@pytest.mark.parametrize("name", STEPWISE)
def test_relu_family_is_exact(name):
    t = fit(name, 1)
    assert t == activations.exact_table(name)
    assert t.error == 0.0
    assert approximation_error(t) == 0.0
    t2 = fit(name, 2)  # padded exact table (documented choice)
    assert t2.bits == 2 and len(t2.values) == 4 and t2.borders == t.borders and t2.codes == t.codes
    assert t2.error == 0.0 and approximation_error(t2) == 0.0


def test_stepwise_non_default_params_exact():
    t = fit("leaky_relu", 1, params={"negative_slope": 0.2})
    assert t.params == {"negative_slope": 0.2} and t.values == (0.2, 1.0)
    assert approximation_error(t) == 0.0


@pytest.mark.parametrize("name", ["gelu", "silu", "sigmoid", "tanh", "softplus"])
def test_error_falls_two_to_four_times_per_bit(name):
    tabs = load_shipped(name)
    errs = [tabs[b].error for b in (1, 2, 3, 4)]
    ratios = [errs[i] / errs[i + 1] for i in range(3)]
    # docs/method.md §8: "roughly 2-4x"; asymptotically 4x (error ~ 1/K^2), softplus 1->2 bits is 5.4x
    assert all(2.0 <= r <= 6.0 for r in ratios), ratios


def test_error_field_is_approximation_error_and_dp_cost():
    t = fit("gelu", 3, grid=GRID, refine=False)
    assert t.error == pytest.approx(approximation_error(t), rel=1e-12)
    # the DP cost (prefix integrals) equals the exact L of the DP borders
    assert t.error == pytest.approx(_dp_cost("gelu", 3, (-10.0, 10.0), False), rel=1e-9)
    r = fit("gelu", 3, grid=GRID)
    assert r.error <= t.error


def test_mirrored_table_layout():
    t = fit("sigmoid", 3, grid=GRID)
    assert t.symmetric
    K = 8
    assert t.num_intervals == 2 * K - 1 == 2 ** (3 + 1) - 1
    assert len(t.values) == K and sorted(set(t.codes)) == list(range(K))
    b = np.asarray(t.borders)
    np.testing.assert_array_equal(b, -b[::-1])
    assert list(t.codes) == list(range(K - 1, 0, -1)) + list(range(K))
    # the interval holding 0 is (-s_1, s_1], code 0, and values are the means there
    mid = np.searchsorted(b, 0.0)
    assert t.codes[mid] == 0 and b[mid - 1] < 0 < b[mid]
    # full-domain error; mirrored beats a plain fit with the same bits (twice the intervals)
    plain = fit("sigmoid", 3, grid=GRID, symmetric=False)
    assert not plain.symmetric and plain.num_intervals == K
    assert t.error < plain.error
    assert t.error == pytest.approx(approximation_error(t), rel=1e-12)


def test_mirrored_on_asymmetric_domain_uses_folded_weight():
    t = fit("tanh", 2, domain=(-3.0, 8.0), grid=GRID, refine=False)
    assert t.symmetric
    # the folded DP cost is the full-domain error on [-3, 8]
    assert t.error == pytest.approx(_dp_cost("tanh", 2, (-3.0, 8.0), True), rel=1e-9)
    assert fit("tanh", 2, domain=(0.5, 8.0), grid=GRID).symmetric is False


def test_fit_many_equals_fit_and_reports_progress():
    calls = []
    many = fit_many("silu", [1, 3], grid=GRID, progress=lambda d, n: calls.append((d, n)))
    assert sorted(many) == [1, 3]
    # (0, total) first, so that a progress bar has its real total from the start; then
    # one call per step (prefix integrals, each DP piece, each refinement), total unchanged
    assert calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == list(range(len(calls)))
    assert {n for _, n in calls} == {calls[0][1]}
    for b in (1, 3):
        single = fit("silu", b, grid=GRID)
        np.testing.assert_allclose(many[b].borders, single.borders, rtol=0, atol=1e-12)
        assert many[b].error == pytest.approx(single.error, rel=1e-12)


def test_table_metadata_and_provenance():
    t = fit("elu", 2, params={"alpha": 0.5}, grid=GRID)
    assert isinstance(t, Table)
    assert t.name == "elu" and t.params == {"alpha": 0.5} and t.domain == (-10.0, 10.0)
    p = t.provenance
    assert p["grid"] == GRID and p["domain"] == [-10.0, 10.0] and p["weight"] == "uniform"
    assert p["solver_version"]
    assert p["command"] == "fewbit.solver.fit('elu', bits=2, grid=2000, params={'alpha': 0.5})"
    assert fit("swish", 1, grid=GRID).name == "silu"


def test_weights_change_the_fit():
    u = fit("gelu", 2, grid=GRID)
    n = fit("gelu", 2, grid=GRID, weight="normal:1.0")
    assert n.weight == "normal:1.0"
    # each table is optimal for its own weight; the reported error is always uniform
    obj = Objective(registry.get("gelu"), {}, weights.normal(1.0), (-10.0, 10.0))
    assert obj.loss(n.borders) < obj.loss(u.borders) * (1 - 1e-3)
    assert n.error > u.error
    assert n.error == pytest.approx(approximation_error(n), rel=1e-12)
    # a flat histogram over the domain is the uniform weight
    h = fit("gelu", 2, grid=GRID, weight=weights.histogram([-10, 0, 10], [0.05, 0.05]))
    assert h.weight == "histogram"
    np.testing.assert_allclose(h.borders, u.borders, atol=1e-7)


def test_approximation_error_arguments():
    t = load_shipped("gelu")[2]
    assert approximation_error(t) == pytest.approx(t.error, rel=1e-12)
    assert approximation_error(t, domain=(-5.0, 5.0)) < t.error
    assert approximation_error(t, "gelu_tanh") == pytest.approx(t.error, rel=0.05)
    with pytest.raises(TypeError, match="table must be"):
        approximation_error("gelu")


def test_fine_histogram_weight_approaches_normal_and_refines_off_bin_edges():
    edges = np.linspace(-10, 10, 2001)
    mid = 0.5 * (edges[1:] + edges[:-1])
    h = fit("gelu", 2, grid=GRID, weight=weights.histogram(edges, np.exp(-0.5 * mid**2)))
    n = fit("gelu", 2, grid=GRID, weight="normal:1.0")
    np.testing.assert_allclose(h.borders, n.borders, atol=1e-4)
    # refinement moved the outer borders off the DP grid / bin edges
    assert np.min(np.abs(np.asarray(h.borders)[[0, 2]][:, None] - edges[None, :])) > 1e-6


def test_narrow_normal_weight_is_resolved():
    # sigma much smaller than the default integration cells: levels must still be the weighted means
    t = fit("silu", 1, grid=GRID, weight="normal:0.02")
    obj = Objective(registry.get("silu"), {}, weights.normal(0.02), (-10.0, 10.0))
    from scipy import integrate

    s = t.borders[0]
    w = lambda x: np.exp(-0.5 * (x / 0.02) ** 2)  # noqa: E731
    g = registry.get("silu").df
    for lo, hi, y in [(-0.3, s, t.values[0]), (s, 0.3, t.values[1])]:
        num = integrate.quad(lambda x: float(g(x)) * w(x), lo, hi, epsabs=1e-14)[0]
        den = integrate.quad(w, lo, hi, epsabs=1e-14)[0]
        assert y == pytest.approx(num / den, rel=1e-8)
    assert abs(s) < 0.1 and obj.loss(t.borders) > 0


def test_fit_many_provenance_names_every_bit_width_and_objective_is_the_weighted_loss():
    many = fit_many("gelu", [1, 2, 3], grid=GRID, weight="normal:2.0")
    # one command for the whole file (it used to say bits=1 for a 1-3-bit file)
    for t in many.values():
        assert t.provenance["command"] == "fewbit.solver.fit_many('gelu', [1, 2, 3], weight='normal:2.0', grid=2000)"
    sf = registry.get("gelu")
    obj = Objective(sf, sf.params(), weights.parse("normal:2.0"), (-10.0, 10.0))
    objectives = [many[b].objective for b in (1, 2, 3)]
    for b in (1, 2, 3):
        assert many[b].objective == pytest.approx(obj.loss(np.asarray(many[b].borders), np.asarray(many[b].values)),
                                                  rel=1e-9)
    assert objectives == sorted(objectives, reverse=True)  # the minimised quantity falls with bits
    for b, t in fit_many("sigmoid", [1, 2], grid=GRID).items():  # uniform, mirrored
        assert t.objective == pytest.approx(t.error, rel=1e-9)
    assert fit_many("relu", [1, 2])[2].objective == 0.0


def test_error_on_a_huge_domain_is_cheap_and_right():
    # [-1e6, 1e6] used to need ~3e7 quadrature cells (5 GB, minutes); the cells now grow
    # with the domain beyond 20000 of them. GELU' is 0 / 1 to rounding beyond |x| = 20, so
    # the error is that on [-20, 20] plus the two constant tails.
    import time

    t = load_shipped("gelu")[2]
    start = time.perf_counter()
    huge = approximation_error(t, domain=(-1e6, 1e6))
    assert time.perf_counter() - start < 10
    tails = (0.0 - t.values[t.codes[0]]) ** 2 * (1e6 - 20) + (1.0 - t.values[t.codes[-1]]) ** 2 * (1e6 - 20)
    assert huge == pytest.approx(approximation_error(t, domain=(-20.0, 20.0)) + tails, rel=1e-9)


@pytest.mark.parametrize("threshold", [-5.0, 0.0])
def test_softplus_levels_are_means_of_its_derivative_across_its_jump(threshold):
    """torch's softplus is ``x`` where ``beta * x > threshold``: it jumps there by
    ``threshold - log1p(exp(threshold))`` (-0.69 at threshold 0), while its derivative has
    no delta. Each level of a uniform-weight fit is the mean of ``f'`` over its cell, so
    the integrals must come from a primitive of ``f'``, not from ``f``. Before, the jump
    entered the cell to its right: at threshold -5 the level where ``f' = 1`` was 0.666
    (gradient 0.33 off in relative norm)."""
    from scipy import integrate

    params = {"beta": 1.0, "threshold": threshold}
    t = fit("softplus", 2, grid=GRID, params=params)
    g = registry.get("softplus").df
    edges = [t.domain[0], *t.borders, t.domain[1]]
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        jump = [threshold] if lo < threshold < hi else None
        mean = integrate.quad(lambda x: float(g(x, **params)), lo, hi, points=jump, limit=200)[0] / (hi - lo)
        assert t.values[t.codes[k]] == pytest.approx(mean, rel=1e-6, abs=1e-9)


def test_a_narrow_normal_weight_has_its_mass_and_a_fine_enough_grid_fits_it_best():
    """gelu at 2 bits under normal:1e-3 on [-10, 10]: cells of 10 sigma (grid=2000) gave an
    objective of 2.31e-7 against 7.48e-8 from cells of 4 sigma; the coarse grid warns."""
    with pytest.warns(RuntimeWarning, match=r"narrower than the grid's cells .*grid >= 5000"):
        coarse = fit("gelu", 2, weight="normal:1e-3", grid=2000)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine = fit("gelu", 2, weight="normal:1e-3", grid=5000)
    assert fine.objective < 0.5 * coarse.objective
    assert fine.objective == pytest.approx(7.479e-8, rel=1e-3)
    with pytest.warns(RuntimeWarning, match=r"grid >= 20000"):  # 16 pieces need cells of sigma
        fit("gelu", 4, weight="normal:1e-3", grid=8000)  # 3.6x the best objective there
    with pytest.warns(RuntimeWarning, match="a domain of about"):
        fit("gelu", 1, weight="normal:1e-5", grid=300)  # its mass is found (was "no mass on the domain")
    for domain in [(3, 10), (-10, -3)]:  # a tail: erf's difference rounded to 0 there
        assert fit("gelu", 1, weight="normal:0.33", domain=domain, grid=300).objective > 0


def test_a_histogram_weighted_fit_records_a_command_that_runs_again():
    """The provenance said ``weight='histogram'``, which raises: the command now carries
    the bins and gives the same table."""
    import fewbit  # noqa: F401 - the command names fewbit.solver

    x = np.random.default_rng(0).normal(size=10000)
    d, e = np.histogram(x, bins=20, density=True)
    t = fit("gelu", 2, weight=weights.histogram(e, d), grid=500)
    again = eval(t.provenance["command"])  # noqa: S307 - our own provenance
    assert again.borders == t.borders and again.values == t.values


def test_more_bits_are_never_worse_on_a_coarse_grid():
    """On a grid too coarse for 16 pieces the DP's borders are a poor start, and the
    refinement is local: ``fit_many("gelu", [3, 4], grid=17)`` gave 4 bits 1.54e-2 against
    3 bits' 1.19e-2. The narrower table's pieces, split, are a start no worse."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables = fit_many("gelu", [1, 2, 3, 4], grid=17)
    errors = [tables[b].objective for b in (1, 2, 3, 4)]
    assert errors == sorted(errors, reverse=True), errors
    assert tables[4].error < 0.5 * tables[3].error  # 3.82e-3 against 1.19e-2
