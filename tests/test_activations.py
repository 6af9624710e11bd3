"""The runtime activation list: exact stepwise tables reproduce torch's gradients bit for bit."""

import pytest
import torch

import fewbit.functional as FF
from fewbit.activations import ACTIVATIONS, canonical_params, exact_table, get_activation, non_default_params

STEPWISE = [n for n, a in ACTIVATIONS.items() if a.stepwise]

PARAMS = {
    "leaky_relu": [{}, {"negative_slope": 0.2}],
    "hardtanh": [{}, {"min_val": -2.0, "max_val": 0.5}],
    "threshold": [{}, {"threshold": 0.5, "value": 2.0}],
    "hardshrink": [{}, {"lambd": 0.25}, {"lambd": 0.0}],
    "softshrink": [{}, {"lambd": 1.5}],
}


def _grid(dtype):
    # every kink of every stepwise function, its float neighbours, and a random spread
    base = torch.tensor([0.0, 6.0, -3.0, 3.0, -1.0, 1.0, -2.0, 0.5, -0.5, 0.25, -0.25, 1.5, -1.5], dtype=dtype)
    near = torch.cat([base, torch.nextafter(base, base + 1), torch.nextafter(base, base - 1)])
    special = torch.tensor([float("inf"), -float("inf")], dtype=dtype)
    return torch.cat([near, special, torch.randn(1000, dtype=torch.float64).mul(4).to(dtype)])


@pytest.mark.parametrize("name", STEPWISE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_exact_tables_match_torch_gradient(name, dtype):
    act = ACTIVATIONS[name]
    for params in PARAMS.get(name, [{}]):
        full = canonical_params(act, params)
        table = exact_table(name, params)
        assert table.error == 0.0 and table.bits == 1
        x = _grid(dtype).requires_grad_()
        (g,) = torch.autograd.grad(act.torch_fn(x, **full).sum(), x)
        q = torch.from_numpy(table.evaluate(x.detach().double()))
        torch.testing.assert_close(q.to(dtype), g, atol=0, rtol=0)


def test_lookup_and_params():
    assert get_activation("swish").name == "silu"
    with pytest.raises(ValueError, match="did you mean 'gelu'"):
        get_activation("gelo")
    elu = get_activation("elu")
    assert canonical_params(elu, None) == {"alpha": 1.0}
    assert non_default_params(elu, {"alpha": 1}) == {}
    assert non_default_params(elu, {"alpha": 0.5}) == {"alpha": 0.5}
    with pytest.raises(ValueError, match="elu takes parameters alpha; got beta"):
        canonical_params(elu, {"beta": 1.0})
    with pytest.raises(ValueError, match="finite"):
        canonical_params(elu, {"alpha": float("nan")})
    with pytest.raises(ValueError, match="no stepwise derivative"):
        exact_table("gelu")
    with pytest.raises(ValueError, match="max_val must be greater"):
        exact_table("hardtanh", {"min_val": 1.0, "max_val": 1.0})


def test_unknown_names_get_case_blind_suggestions():
    """``fewbit error GELU`` had no suggestion and ``Gelu`` not ``gelu`` (difflib matches
    case); a user's function named with a dot for the colon was only "unknown" (review
    h70)."""
    for name, best in (("GELU", "gelu"), ("Gelu", "gelu"), ("SiLU", "silu")):
        with pytest.raises(ValueError, match=f"did you mean '{best}'"):
            get_activation(name)
    with pytest.raises(ValueError, match="a function of your own is named 'package.module:function'"):
        get_activation("mypkg.acts.my_act")


# ----------------------------------------------------------------------------- gradients bit for bit

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# (function, params, its borders): non-default parameters that no float format holds
# exactly (0.3, 0.1, -0.7) as well as exact ones, so every rounding of a border is hit.
STEPWISE_CASES = [
    ("relu", {}, [0.0]),
    ("leaky_relu", {}, [0.0]),
    ("leaky_relu", {"negative_slope": 0.3}, [0.0]),
    ("relu6", {}, [0.0, 6.0]),
    ("hardtanh", {}, [-1.0, 1.0]),
    ("hardtanh", {"min_val": -0.7, "max_val": 0.3}, [-0.7, 0.3]),
    ("threshold", {"threshold": 0.1, "value": -2.0}, [0.1]),
    ("threshold", {"threshold": -1.5, "value": 0.5}, [-1.5]),
    ("hardshrink", {}, [-0.5, 0.5]),
    ("hardshrink", {"lambd": 0.3}, [-0.3, 0.3]),
    ("hardshrink", {"lambd": 0.0}, [0.0]),
    ("softshrink", {}, [-0.5, 0.5]),
    ("softshrink", {"lambd": 0.1}, [-0.1, 0.1]),
    ("hardsigmoid", {}, [-3.0, 3.0]),
]


def _border_points(borders, dtype):
    """Each border rounded to every float format, then to ``dtype``, with both of its
    ``dtype`` neighbours; signed zeros, infinities, the extremes and subnormals."""
    pts = []
    for b in list(borders) + [0.0]:
        for fmt in DTYPES:
            v = torch.tensor(b, dtype=torch.float64).to(fmt).to(dtype)
            pts += [v, torch.nextafter(v, v + 1), torch.nextafter(v, v - 1)]
    fi = torch.finfo(dtype)
    extra = [-0.0, float("inf"), -float("inf"), fi.max, -fi.max, fi.tiny, -fi.tiny, fi.smallest_normal / 2]
    return torch.cat([torch.stack(pts).reshape(-1), torch.tensor(extra, dtype=torch.float64).to(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,params,borders", STEPWISE_CASES,
                         ids=[f"{n}{p or ''}" for n, p, _ in STEPWISE_CASES])
def test_stepwise_gradient_is_torch_gradient_bit_for_bit(name, params, borders, dtype):
    """fewbit's gradient (codes from the exact table, torch's multiply rounding) equals
    torch's own backward in every dtype, at and next to every border and on random points."""
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=gen, dtype=torch.float64) * 4
    x = torch.cat([_border_points(borders, dtype), rand.to(dtype)])
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
    act = ACTIVATIONS[name]
    full = canonical_params(act, params)
    x_ours = x.clone().requires_grad_(True)
    x_torch = x.clone().requires_grad_(True)
    getattr(FF, name)(x_ours, **params).backward(g)
    act.torch_fn(x_torch, **full).backward(g)
    assert torch.equal(x_ours.grad, x_torch.grad), (
        f"{int((x_ours.grad != x_torch.grad).sum())} of {x.numel()} gradients differ"
    )


# ----------------------------------------------------------------------------- formulas


def test_formulas_share_a_registry_table():
    from fewbit.activations import FORMULAS, get_formula, import_callable
    from fewbit.table import load_shipped

    assert sorted(FORMULAS) == ["bloom_gelu", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python",
                                "gelu_python_tanh"]
    for name, f in FORMULAS.items():
        assert get_formula(name) is f and f.name == name
        assert import_callable(f.spec) is f.torch_fn  # what fewbit.ops imports
        act = ACTIVATIONS[f.table]  # a registry entry with shipped fitted tables, no copy
        assert not act.stepwise and sorted(load_shipped(f.table)) == [1, 2, 3, 4]
        assert load_shipped(name) is None
    with pytest.raises(ValueError, match="unknown formula 'gelu_newer'.*gelu_new"):
        get_formula("gelu_newer")


@pytest.mark.parametrize("name", ["bloom_gelu", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python",
                                  "gelu_python_tanh"])
def test_formula_derivative_within_the_documented_gap_of_its_table_function(name):
    """f' of the formula (float64 autograd) vs f' of the table's function: equal up to float64
    rounding, plus ``derivative_gap`` (gelu_fast's constant 0.7978845608 != sqrt(2/pi))."""
    from fewbit.activations import FORMULAS

    f = FORMULAS[name]
    x = torch.linspace(-12, 12, 200001, dtype=torch.float64, requires_grad=True)
    (d_formula,) = torch.autograd.grad(f.torch_fn(x).sum(), x)
    (d_table,) = torch.autograd.grad(ACTIVATIONS[f.table].torch_fn(x).sum(), x)
    gap = float((d_formula - d_table).abs().max())
    assert gap <= f.derivative_gap + 1e-14
    if f.derivative_gap:
        assert gap >= 0.9 * f.derivative_gap  # the documented figure is the real one
