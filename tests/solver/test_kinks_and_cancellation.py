"""Two fits that used to be silently wrong, against pure references.

A. A user function (``"module:callable"``) had no kinks: the quadrature and the refinement
   integrated across a jump of its ``f'``. A user hinge ``where(x > 0.1, x, 0.1 x)`` got its
   border at 0.09958 with a reported error of 1.75e-32 (dense sampling: 3.40e-4), so
   ``x`` in (0.0996, 0.1] had gradient 1.0 instead of 0.1 at runtime; a user copy of
   hardswish at 3 bits got borders +-2.999 and an error below the registry's optimum. The
   jumps of a user ``f'`` are now found numerically (``registry.find_jumps``) and treated
   as a registry function's kinks.
B. The cell integrals of ``f'`` were differences of a primitive that is huge next to its
   changes: ``~log(2) / beta`` for softplus with a tiny ``beta``, ``x + 1e300`` on its
   linear branch for ``threshold=-1e300``: every level was 0 (torch's gradient: 0.5 / 1).

References: dense float64 sampling of ``f'`` for errors and levels, scipy's adaptive
quadrature for cell integrals, torch autograd for runtime gradients.
"""

import math
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from fewbit.solver import fit, registry, weights
from fewbit.solver.objective import Objective

USER = "fewbit_test_kink_acts"

# dense sampling for reference errors: midpoints of cells at most this long
STEP = 1e-5


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{USER}.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        def hinge(x):  # leaky_relu(x - 0.1, 0.1): f' jumps from 0.1 to 1 at x = 0.1
            return torch.where(x > 0.1, x - 0.1, 0.1 * (x - 0.1))

        def my_hardswish(x):  # jumps of f' at -3 and 3 (clamp's own backward at the ends)
            return x * torch.clamp(x + 3, 0, 6) / 6

        def steep(x):  # smooth: f' = sigmoid(1e6 x), a transition 1e-6 wide, no jump
            return F.softplus(x, beta=1e6, threshold=1e300)

        def rise_jump(x):  # a jump of 0.5 at x = 0.2537 (off the grid) on the flank of a smooth rise at 0
            return torch.tanh(8 * x) / 8 + torch.where(x > 0.2537, 0.5 * x, 0 * x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(USER, None)
    yield USER
    sys.modules.pop(USER, None)
    for k in [k for k in registry._CACHE if k.startswith(USER)]:
        registry._CACHE.pop(k)


def _dense_error(sf, table, params=None, jumps=()):
    """Error ``int (f' - q)^2`` on [-10, 10] by dense sampling of ``f'`` (float64): the
    midpoint rule on cells of at most ``STEP``, in the pieces between the table's borders
    and the ``jumps`` of ``f'`` (known to the test), so that no sample cell holds a jump."""
    pts = np.unique(np.r_[-10.0, [b for b in (*table.borders, *jumps) if -10.0 < b < 10.0], 10.0])
    total = 0.0
    for lo, hi in zip(pts[:-1], pts[1:]):
        n = max(16, math.ceil((hi - lo) / STEP))
        x = lo + (hi - lo) * (np.arange(n) + 0.5) / n
        r = sf.df(x, **(params or {})) - table.evaluate(x)
        total += math.fsum(r * r) * (hi - lo) / n
    return total


def _prev(x):
    return float(np.nextafter(x, -np.inf))


# --- A: kinks of user functions ---------------------------------------------------------------

def test_user_hinge_border_is_the_kink_and_error_is_the_dense_one(user_module):
    t = fit(f"{user_module}:hinge", 1, grid=4096)
    sf = registry.get(f"{user_module}:hinge")
    # torch's x > 0.1: 0.1 itself has the left value, so the border is exactly 0.1
    assert list(t.borders) == [0.1]
    # as leaky_relu's exact table with its kink moved to 0.1
    np.testing.assert_allclose([t.values[c] for c in t.codes], [0.1, 1.0], rtol=0, atol=1e-12)
    dense = _dense_error(sf, t, jumps=(0.1,))
    assert dense < 1e-20  # before: 3.4e-4 (x in (0.0996, 0.1] got 1.0)
    assert t.error == pytest.approx(dense, abs=1e-20)


def test_user_hardswish_fit_is_the_registry_one(user_module):
    spec = f"{user_module}:my_hardswish"
    t_user = fit(spec, 3, grid=4096)
    t_reg = fit("hardswish", 3, grid=4096)
    b = np.asarray(t_user.borders)
    # the kinks to float64 precision: the last float64 numbers where the user's f' has its
    # value from the left (f'(-3) = -0.5 is already the value from the right; x + 3 rounds
    # to 6 for the float above 3): -3 - 4.4e-16 and 3 + 4.4e-16
    assert abs(b[0] + 3.0) <= 1e-15 and abs(b[-1] - 3.0) <= 1e-15
    np.testing.assert_allclose(b, t_reg.borders, rtol=0, atol=1e-9)  # before: +-2.999
    np.testing.assert_allclose(t_user.values, t_reg.values, rtol=0, atol=1e-9)
    # before: 5.5503e-2, below the registry's optimum 5.5556e-2 (dense 5.5983e-2)
    assert t_user.error == pytest.approx(t_reg.error, rel=1e-9)
    assert t_user.error == pytest.approx(_dense_error(registry.get(spec), t_user, jumps=(-3.0, 3.0)), rel=1e-9)


def test_user_jump_on_the_flank_of_a_smooth_rise(user_module):
    spec = f"{user_module}:rise_jump"
    sf = registry.get(spec)
    t = fit(spec, 2, grid=2000)
    assert 0.2537 in t.borders
    assert t.error == pytest.approx(_dense_error(sf, t, jumps=(0.2537,)), rel=1e-8)
    assert sf.kinks_on(sf.params(), -10.0, 10.0) == (0.2537,)


def test_user_hinge_runtime_gradient_is_torchs(user_module, fewbit_env):
    import importlib

    import fewbit.functional as FF

    fn = importlib.import_module(user_module).hinge
    x = torch.cat([torch.linspace(-1.0, 1.0, 4001, dtype=torch.float64),
                   torch.tensor([0.0996, 0.0999, 0.1, _prev(0.1), math.nextafter(0.1, 1.0)], dtype=torch.float64)])
    x1 = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FF.TableFittedWarning)
        FF.activation(x1, fn, bits=1).sum().backward()
    x2 = x.clone().requires_grad_()
    fn(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-12)


def test_find_jumps_locates_jumps_and_ignores_steep_smooth_derivatives():
    from fewbit.solver.registry import find_jumps

    gelu = registry.get("gelu")
    for smooth in (gelu.df, lambda x: np.tanh(1e3 * x), lambda x: np.tanh(1e6 * x),
                   lambda x: np.sin(50.0 * x), lambda x: np.cos(x) * (1 + 1e-13 * np.sin(1e7 * x))):
        assert find_jumps(smooth, -10.0, 10.0) == ()
    assert find_jumps(lambda x: np.where(x > 0.1, 1.0, 0.1), -10.0, 10.0) == (0.1,)
    # >=: the jump point has the right value, the border is the float below it
    assert find_jumps(lambda x: np.where(x >= 0.7, 1.0, 0.0) + x, -10.0, 10.0) == (_prev(0.7),)
    # two jumps 1e-5 apart (inside one scan cell), a jump on a wide domain
    assert find_jumps(lambda x: (x > 0.3) * 1.0 + (x > 0.30001) * 1.0, -10.0, 10.0) == (0.3, 0.30001)
    assert find_jumps(lambda x: np.where(x > 0.1, 1.0, 0.1), -1e6, 1e6) == (0.1,)
    # a transition over a few float64 numbers is a jump, reported once
    from scipy.special import expit

    (k,) = find_jumps(lambda x: expit(1e16 * (x - 1.0)), -10.0, 10.0)
    assert abs(k - 1.0) <= 4e-16


def test_smooth_user_function_has_no_kinks(user_module):
    sf = registry.get(f"{user_module}:steep")
    assert sf.kinks_on(sf.params(), -10.0, 10.0) == ()


# --- B: cancellation in the cell integrals --------------------------------------------------------

@pytest.mark.parametrize("params,level", [
    ({"beta": 1e-300}, 0.5),
    ({"beta": -1e-300}, 0.5),
    ({"beta": 1e-16}, 0.5),
    ({"beta": 1e-14}, 0.5),
    ({"threshold": -1e300}, 1.0),
    ({"beta": 1e-300, "threshold": -1e300}, 1.0),
])
def test_softplus_extreme_parameters_fit_their_derivative(params, level):
    t = fit("softplus", 2, grid=1000, params=params)
    np.testing.assert_allclose(t.values, level, rtol=0, atol=1e-12)  # before: all 0
    assert t.error == pytest.approx(_dense_error(registry.get("softplus"), t, params), abs=1e-20)


@pytest.mark.parametrize("stable_only", [False, True], ids=["registry", "integral_impl"])
@pytest.mark.parametrize("params", [
    {"beta": 1e-300}, {"beta": -1e-300}, {"beta": 1e-16}, {"beta": 1e-8}, {"beta": 1e-3}, {"beta": 0.5},
    {}, {"beta": -3.0}, {"beta": 40.0}, {"beta": 2.0, "threshold": 5.0}, {"beta": -1.0, "threshold": 3.0},
    {"beta": 1e3}, {"threshold": -1e300}, {"beta": 1e-300, "threshold": -1e300},
], ids=str)
def test_softplus_cell_integrals_match_quadrature(params, stable_only):
    """``int f'`` per cell against scipy's adaptive quadrature of ``f'``: the registry's
    (differences of the primitive, its stable cell integral where they cancel) and the
    stable cell integral on every cell."""
    import dataclasses

    from scipy import integrate

    sf = registry.get("softplus")
    if stable_only:
        sf = dataclasses.replace(sf, primitive_impl=None)
    full = sf.params(params)
    obj = Objective(sf, full, weights.uniform(), (-10.0, 10.0))
    edges = obj.grid(64)
    _, FW, _ = obj.cell_integrals(edges)
    ref = [integrate.quad(lambda x: float(sf.df(x, **full)), lo, hi, epsabs=0, epsrel=1e-13, limit=200)[0]
           for lo, hi in zip(edges[:-1], edges[1:])]
    np.testing.assert_allclose(FW, ref, rtol=1e-11, atol=1e-15)


def test_a_cancelling_primitive_falls_back_to_quadrature():
    # f = x + 1e300: f(b) - f(a) is 0 for every cell, int f' = b - a
    sf = registry.SolverFunction(name="shifted", f_impl=lambda x, p: x + 1e300, df_impl=lambda x, p: np.ones_like(x))
    obj = Objective(sf, {}, weights.uniform(), (-10.0, 10.0))
    edges = obj.grid(100)
    W, FW, F2 = obj.cell_integrals(edges)
    np.testing.assert_allclose(FW, np.diff(edges), rtol=1e-13)


def test_softplus_tiny_beta_runtime_gradient_is_torchs(fewbit_env):
    import fewbit.functional as FF

    x = torch.linspace(-5.0, 5.0, 11, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FF.TableFittedWarning)
        FF.softplus(x, beta=1e-300, bits=2).sum().backward()
    xt = x.detach().clone().requires_grad_()
    torch.nn.functional.softplus(xt, beta=1e-300).sum().backward()
    torch.testing.assert_close(x.grad, xt.grad)  # before: 0 where torch gives 0.5
