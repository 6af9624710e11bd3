"""Registry: analytic float64 f, f' against torch (forward and autograd) in float64."""

import sys
import textwrap

import numpy as np
import pytest
import torch

from fewbit import activations
from fewbit.solver import fit, registry

ALL = sorted(activations.ACTIVATIONS)

# (name, non-default params) to exercise parameter handling as well as the defaults
CASES = [(n, {}) for n in ALL] + [
    ("elu", {"alpha": 0.5}),
    ("celu", {"alpha": 2.0}),
    ("softplus", {"beta": 2.0, "threshold": 5.0}),  # kink at x = 2.5 inside the domain
    ("leaky_relu", {"negative_slope": 0.2}),
    ("hardtanh", {"min_val": -2.0, "max_val": 3.0}),
    ("threshold", {"threshold": 1.5, "value": -2.0}),
    ("hardshrink", {"lambd": 1.0}),
    ("softshrink", {"lambd": 0.25}),
]


def _torch_f_df(sf, x, params):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = sf.torch_fn(xt, **sf.params(params))
    (g,) = torch.autograd.grad(y, xt, torch.ones_like(y))
    return y.detach().numpy(), g.numpy()


def _grid_without_kinks(sf, params):
    x = np.linspace(-30, 30, 6001) + 1e-3  # shifted so that no point is a kink; beyond softplus threshold
    kinks = np.asarray(sf.kinks(**params))
    if kinks.size:
        x = x[np.abs(x[:, None] - kinks[None, :]).min(axis=1) > 1e-6]
    return x


def test_names_cover_activations_and_aliases():
    assert registry.names() == ALL
    for alias, target in activations.ALIASES.items():
        assert registry.get(alias).name == target
    for formula in activations.FORMULAS.values():  # the function whose tables it shares
        assert registry.get(formula.name).name == formula.table
    for name in ALL:
        sf = registry.get(name)
        act = activations.get_activation(name)
        assert sf.defaults == dict(act.defaults)
        assert sf.even == act.even
        assert sf.stepwise == act.stepwise
        assert sf.torch_fn is act.torch_fn


@pytest.mark.parametrize("name,params", CASES, ids=lambda v: str(v))
def test_f_and_df_match_torch_float64(name, params):
    sf = registry.get(name)
    x = _grid_without_kinks(sf, params)
    y_t, g_t = _torch_f_df(sf, x, params)
    np.testing.assert_allclose(sf.f(x, **params), y_t, rtol=1e-10, atol=1e-12)
    # torch's hardsigmoid backward uses float32(1/6) even in float64; we keep 1/6 exactly,
    # as fewbit.activations.exact_table does.
    rtol = 1e-7 if name == "hardsigmoid" else 1e-10
    np.testing.assert_allclose(sf.df(x, **params), g_t, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("name,params", [c for c in CASES if registry.get(c[0]).kinks(**c[1])], ids=lambda v: str(v))
def test_df_at_kinks_is_torch_backward_value(name, params):
    sf = registry.get(name)
    k = np.asarray(sf.kinks(**params))
    _, g_t = _torch_f_df(sf, k, params)
    rtol = 1e-7 if name == "hardsigmoid" else 1e-10  # float32(1/6) in torch, see above
    np.testing.assert_allclose(sf.df(k, **params), g_t, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("name", [n for n in ALL if activations.ACTIVATIONS[n].even])
def test_even_flag_means_even_derivative(name):
    sf = registry.get(name)
    x = np.linspace(0, 10, 1001)
    np.testing.assert_allclose(sf.df(x), sf.df(-x), rtol=1e-13, atol=1e-15)


def test_unknown_name_and_params():
    with pytest.raises(ValueError, match="unknown activation"):
        registry.get("gleu")
    with pytest.raises(TypeError, match="fn must be a str"):
        registry.get(3)
    with pytest.raises(ValueError, match="takes parameters alpha; got beta"):
        registry.get("elu").params({"beta": 1.0})
    with pytest.raises(ValueError, match="must be finite"):
        registry.get("elu").params({"alpha": float("nan")})


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "fewbit_test_user_acts.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        def my_gelu(x):
            return F.gelu(x)

        def sqrt_pos(x):
            return torch.where(x > 0, x.clamp(min=0).sqrt() + torch.sqrt(x), x)

        def reducer(x):
            return x.sum()

        def running(x):
            return torch.cumsum(x, 0)

        def scaled_by_mean(x):  # commutes with every permutation, yet not elementwise
            return x * x.mean()

        def scaled_by_min(x):  # the first part of the probe holds its min
            return x * x.min()

        def over_max_abs(x):
            return torch.tanh(x) / x.abs().max()

        def in_place(x):
            return x.mul_(2)

        def integer(x):
            return (x > 0).long()

        def detached(x):
            return x.detach() * 2

        def tanh_cubed(x):  # f' = 3 tanh(x)**2 / cosh(x)**2 is even
            return torch.tanh(x) ** 3

        def clamped(x):  # f' is 1.1 on (-2, 2) and 0.1 outside: even, three pieces
            return x.clamp(-2, 2) + 0.1 * x

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fewbit_test_user_acts"
    sys.modules.pop("fewbit_test_user_acts", None)
    for k in [k for k in registry._CACHE if k.startswith("fewbit_test_user_acts")]:
        registry._CACHE.pop(k)


def test_user_function_derivative_by_autograd(user_module):
    sf = registry.get(f"{user_module}:my_gelu")
    x = np.linspace(-10, 10, 1001)
    np.testing.assert_allclose(sf.df(x), registry.get("gelu").df(x), rtol=1e-10, atol=1e-12)
    t_user = fit(f"{user_module}:my_gelu", 2, grid=1000)
    t_reg = fit("gelu", 2, grid=1000)
    assert t_user.name == f"{user_module}:my_gelu"
    np.testing.assert_allclose(t_user.borders, t_reg.borders, atol=1e-6)
    assert t_user.error == pytest.approx(t_reg.error, rel=1e-8)


@pytest.mark.parametrize(
    "attr,match",
    [
        ("nonexistent_module_xyz:f", "cannot import module"),
        ("{m}:missing", "has no attribute"),
        ("{m}:NOT_CALLABLE", "is not callable"),
        ("{m}:reducer", "must be elementwise"),
        ("{m}:running", "not elementwise"),
        ("{m}:scaled_by_mean", r"not elementwise \(a part of the input changes the values\)"),
        ("{m}:scaled_by_min", r"not elementwise \(a part of the input changes the values\)"),
        ("{m}:over_max_abs", r"not elementwise \(a part of the input changes the values\)"),
        ("{m}", "package.module:callable"),
    ],
)
def test_user_function_errors(user_module, attr, match):
    spec = attr.format(m=user_module)
    with pytest.raises(ValueError, match=match):
        if ":" in spec:
            registry.get(spec)
        else:
            registry.get(spec + ":")


@pytest.mark.parametrize("attr,match", [
    ("in_place", "modified its input in place"),  # before: "is not elementwise"
    ("integer", "must return a floating-point tensor"),  # before: fitted, all levels 0
    ("detached", "does not depend on its input through autograd"),  # before: fitted, all levels 0
])
def test_user_functions_that_have_no_gradient_to_fit(user_module, attr, match):
    with pytest.raises(ValueError, match=match):
        fit(f"{user_module}:{attr}", 2, grid=200)


def test_user_function_nonfinite_derivative(user_module):
    with pytest.raises(ValueError, match="not finite"):
        fit(f"{user_module}:sqrt_pos", 1, grid=200)


def test_a_user_function_with_an_even_derivative_is_mirrored_by_default(user_module):
    """``symmetric=None`` mirrors a table when f' is even: for a user function, which has no
    registry flag, it never did (``tanh(x)**3`` at 3 bits: 4.73e-2 against 1.52e-2 mirrored;
    ``clamp(x, -2, 2) + 0.1 x`` at 1 bit: 2.667 where the mirrored table is exact)."""
    for attr, bits in (("tanh_cubed", 3), ("clamped", 1)):
        default = fit(f"{user_module}:{attr}", bits, grid=1000)
        mirrored = fit(f"{user_module}:{attr}", bits, grid=1000, symmetric=True)
        assert default.symmetric and default.error == pytest.approx(mirrored.error, rel=1e-9)
    assert fit(f"{user_module}:clamped", 1, grid=1000).error < 1e-9
    assert not fit(f"{user_module}:my_gelu", 2, grid=1000).symmetric  # gelu' is not even
