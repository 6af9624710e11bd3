"""The runtime activation list: exact stepwise tables reproduce torch's gradients."""

import pytest
import torch

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
        idx = torch.searchsorted(torch.tensor(table.borders, dtype=torch.float64), x.detach().double(), right=False)
        q = torch.tensor(table.values, dtype=torch.float64)[torch.tensor(table.codes)[idx]]
        torch.testing.assert_close(q.to(dtype), g, atol=0, rtol=1e-2 if name == "hardsigmoid" else 0)


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
