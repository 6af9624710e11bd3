"""Tests of fewbit.modules: torch.nn signatures plus keyword-only bits, forward equal to
torch.nn, backward equal to the few-bit reference, repr, state_dict, pickle, deepcopy."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fewbit
from fewbit import functional as FF
from fewbit import modules as fm
from helpers import reference_grad, toy_table

# (fewbit module, torch module, ctor kwargs, table name, table params)
CASES = [
    (fm.GELU, nn.GELU, {}, "gelu", {}),
    (fm.GELU, nn.GELU, {"approximate": "tanh"}, "gelu_tanh", {}),
    (fm.SiLU, nn.SiLU, {}, "silu", {}),
    (fm.SELU, nn.SELU, {}, "selu", {}),
    (fm.ELU, nn.ELU, {}, "elu", {}),
    (fm.CELU, nn.CELU, {}, "celu", {}),
    (fm.Mish, nn.Mish, {}, "mish", {}),
    (fm.Softplus, nn.Softplus, {}, "softplus", {}),
    (fm.Sigmoid, nn.Sigmoid, {}, "sigmoid", {}),
    (fm.Tanh, nn.Tanh, {}, "tanh", {}),
    (fm.LogSigmoid, nn.LogSigmoid, {}, "logsigmoid", {}),
    (fm.Softsign, nn.Softsign, {}, "softsign", {}),
    (fm.Tanhshrink, nn.Tanhshrink, {}, "tanhshrink", {}),
    (fm.Hardswish, nn.Hardswish, {}, "hardswish", {}),
    (fm.ReLU, nn.ReLU, {}, "relu", {}),
    (fm.LeakyReLU, nn.LeakyReLU, {"negative_slope": 0.25}, "leaky_relu", {"negative_slope": 0.25}),
    (fm.ReLU6, nn.ReLU6, {}, "relu6", {}),
    (fm.Hardtanh, nn.Hardtanh, {"min_val": -2.0, "max_val": 0.5}, "hardtanh", {"min_val": -2.0, "max_val": 0.5}),
    (fm.Threshold, nn.Threshold, {"threshold": 0.5, "value": 2.0}, "threshold", {"threshold": 0.5, "value": 2.0}),
    (fm.Hardshrink, nn.Hardshrink, {"lambd": 0.25}, "hardshrink", {"lambd": 0.25}),
    (fm.Softshrink, nn.Softshrink, {}, "softshrink", {}),
    (fm.Hardsigmoid, nn.Hardsigmoid, {}, "hardsigmoid", {}),
]


pytestmark = pytest.mark.usefixtures("fewbit_env")  # tests/conftest.py: an empty user cache per test


def _id(c):
    return c[0].__name__ + "".join(f"-{k}={v}" for k, v in c[2].items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_module_matches_torch_and_reference(case):
    cls, torch_cls, kwargs, tname, tparams = case
    ours, theirs = cls(**kwargs), torch_cls(**kwargs)
    assert isinstance(ours, torch_cls)
    x = (torch.randn(4, 33) * 3).requires_grad_(True)
    y = ours(x)
    torch.testing.assert_close(y, theirs(x.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    table = FF.load_table(tname, ours.bits, tparams)
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), table), atol=0, rtol=0)
    if table.weight == "exact":  # stepwise: equal to torch's own gradient
        x2 = x.detach().clone().requires_grad_(True)
        theirs(x2).backward(g)
        torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_signature_repr_state_dict_copy_pickle(case):
    cls, torch_cls, kwargs, _, _ = case
    ours_sig = inspect.signature(cls.__init__).parameters
    theirs_sig = inspect.signature(torch_cls.__init__).parameters
    bits = ours_sig["bits"]
    assert bits.kind is inspect.Parameter.KEYWORD_ONLY
    ours_pos = [(p.name, p.default) for p in ours_sig.values() if p.name != "bits"]
    theirs_pos = [(p.name, p.default) for p in theirs_sig.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("min_value", "max_value")]
    assert ours_pos == theirs_pos
    m = cls(**kwargs, bits=2)
    r = repr(m)
    assert "bits=2" in r
    t_repr = torch_cls(**kwargs).extra_repr()
    if t_repr:
        assert m.extra_repr() == f"{t_repr}, bits=2"
    assert list(m.parameters()) == [] and m.state_dict() == {}
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(clone) is cls and clone.bits == 2 and repr(clone) == r
    with pytest.raises(ValueError, match="bits must be"):
        cls(**kwargs, bits=0)


def test_inplace_module():
    x = torch.randn(10, requires_grad=True)
    h = x * 2
    out = fm.ReLU(inplace=True)(h)
    assert out.data_ptr() == h.data_ptr()
    out.sum().backward()
    torch.testing.assert_close(x.grad, (x.detach() > 0).float() * 2, atol=0, rtol=0)
    assert repr(fm.ReLU(inplace=True)) == "ReLU(inplace=True, bits=1)"


def test_quick_gelu_and_validation():
    m = fm.QuickGELU(bits=4)
    x = torch.randn(50, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, x.detach() * torch.sigmoid(1.702 * x.detach()), atol=0, rtol=0)
    assert repr(m) == "QuickGELU(bits=4)"
    with pytest.raises(ValueError, match="approximate"):
        fm.GELU("erf")
    with pytest.raises(ValueError, match="max_val"):
        fm.Hardtanh(1.0, -1.0)


def test_fewbit_activation_generic(tmp_path):
    t = toy_table("tanh", 2)
    path = tmp_path / "t.json"
    fewbit.table.write_tables(path, [t])
    m = fm.FewBitActivation("tanh", table=path)
    assert m.bits == 2 and "bits=2" in repr(m) and m.state_dict() == {}
    x = torch.randn(3, 7, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, torch.tanh(x.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), t), atol=0, rtol=0)
    m2 = copy.deepcopy(m)
    assert m2.table == t
    m3 = fm.FewBitActivation("elu", bits=3, params={"alpha": 1.0})
    assert "'elu', alpha=1, bits=3" in repr(m3)
    with pytest.raises(ValueError, match="is for 'tanh'"):
        fm.FewBitActivation("sigmoid", table=t)


def test_fewbit_activation_table_file_of_any_suffix(tmp_path):
    """A ``str`` table is a JSON file whatever its suffix, as in functional.activation (it
    used to be looked up as a function name unless it ended in .json)."""
    t = toy_table("tanh", 2)
    path = tmp_path / "tanh-table"
    fewbit.table.write_tables(path, [t])
    m = fm.FewBitActivation("tanh", table=str(path))
    assert m.table == t and m.bits == 2
    x = torch.randn(5, requires_grad=True)
    m(x).backward(torch.ones(5))
    torch.testing.assert_close(x.grad, reference_grad(torch.ones(5), x.detach(), t), atol=0, rtol=0)


def test_lazy_public_names():
    for name in fewbit._MODULE_CLASSES:
        assert getattr(fewbit, name) is getattr(fm, name)
    assert set(fm.__all__) == set(fewbit._MODULE_CLASSES) <= set(fewbit.__all__)  # FormulaActivation too
    assert fewbit.load_table is FF.load_table


#: Parameters torch's module takes and fewbit refuses (before: constructed, then CELU(-1)
#: trained with a gradient 15x off in relative norm; the others raised in the first forward,
#: softplus with an unrelated message).
BAD_PARAMS = [
    (fm.CELU, {"alpha": -1.0}, "alpha of celu must be > 0"),
    (fm.CELU, {"alpha": 0.0}, "alpha of celu must be > 0"),
    (fm.Softplus, {"beta": 0.0}, "beta of softplus must be nonzero"),
    (fm.ELU, {"alpha": float("inf")}, "alpha of elu must be finite"),
    (fm.LeakyReLU, {"negative_slope": float("nan")}, "negative_slope of leaky_relu must be finite"),
    (fm.Threshold, {"threshold": 0.0, "value": float("-inf")}, "value of threshold must be finite"),
    (fm.Hardshrink, {"lambd": -1.0}, "lambd must be >= 0"),
    (fm.Softshrink, {"lambd": float("nan")}, "lambd of softshrink must be finite"),
    # a derivative past float32's range: constructed before, then the first forward raised
    # "values must be finite in float32 ... values[0]", naming no parameter
    (fm.LeakyReLU, {"negative_slope": 1e39}, r"negative_slope of leaky_relu must be within float32's range.*1e\+39"),
    (fm.ELU, {"alpha": -1e39}, r"alpha of elu must be within float32's range.*-1e\+39"),
]


@pytest.mark.parametrize("cls, params, match", BAD_PARAMS, ids=lambda v: getattr(v, "__name__", None))
def test_parameters_fewbit_refuses_raise_at_construction(cls, params, match):
    with pytest.raises(ValueError, match=match):
        cls(**params)


def test_convert_keeps_modules_with_refused_parameters_as_torch():
    """convert_ leaves them torch's (reason in the summary); the model trains as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.CELU(alpha=-1.0), nn.Threshold(0.1, float("-inf")), nn.ELU())
    ref = copy.deepcopy(model)
    summary = fewbit.convert_(model)
    assert type(model[1]) is nn.CELU and type(model[2]) is nn.Threshold and type(model[3]) is fm.ELU
    assert "alpha of celu must be > 0" in summary.unsupported["1"]
    assert "value of threshold must be finite" in summary.unsupported["2"]
    x = torch.randn(8, 4)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("fn, params, match", [
    # the value given, not float32's rounding of it (before: "got -0.10000000149011612")
    (FF.hardshrink, {"lambd": -0.1}, r"lambd must be >= 0, got -0\.1$"),
    # a border torch compares in float32 that rounds to inf there: the parameter and the
    # value given (before: "lambd of softshrink must be finite, got inf")
    (FF.softshrink, {"lambd": 1e39}, r"lambd of softshrink must be within float32's range for a float32 input.*1e\+39"),
])
def test_functional_stepwise_errors_name_the_value_given(fn, params, match):
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        fn(x, **params)


def test_values_torch_takes_without_a_table_are_taken():
    """A range rule of fewbit's tables is not one of the function: a forward-only functional
    call runs torch's function (``leaky_relu(x, 1e39)`` in float64), and a border is judged
    as torch compares with it (``lambd=-1e-46`` is float32's -0.0; review h58)."""
    x = torch.tensor([-2.0, 0.5], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(FF.leaky_relu(x, 1e39), F.leaky_relu(x, 1e39), rtol=0, atol=0)
        torch.testing.assert_close(FF.elu(x, 1e39), F.elu(x, 1e39), rtol=0, atol=0)
    with pytest.raises(ValueError, match="negative_slope of leaky_relu must be within float32's range"):
        FF.leaky_relu(x.clone().requires_grad_(), 1e39)  # a table is needed: refused, named
    xf = torch.tensor([-2.0, 0.0, 0.5], requires_grad=True)
    y = FF.hardshrink(xf, -1e-46)
    y.backward(torch.ones_like(y))
    xr = xf.detach().clone().requires_grad_()
    F.hardshrink(xr, -1e-46).backward(torch.ones_like(y))
    assert torch.equal(y, F.hardshrink(xf.detach(), -1e-46)) and torch.equal(xf.grad, xr.grad)


def test_a_border_past_float32_is_taken_for_float64_inputs():
    """torch compares float64 inputs with lambd in float64: fewbit's exact table too."""
    x = torch.tensor([-2e39, 0.5, 3e39], dtype=torch.float64, requires_grad=True)
    y = FF.softshrink(x, 1e39)
    y.backward(torch.ones_like(y))
    xr = x.detach().clone().requires_grad_()
    F.softshrink(xr, 1e39).backward(torch.ones_like(y))
    assert torch.equal(x.grad, xr.grad)


@pytest.mark.parametrize("name", ["GELU", "SiLU", "ELU"])
def test_modules_on_the_meta_device_run_without_warnings(name):
    """Meta tensors (shape-only model building, e.g. before loading weights) have no values to
    probe torch's gradient rules with: the CPU's are used, without a warning (before: a
    RuntimeWarning 'could not evaluate torch's gradient ... unsupported scalarType')."""
    import warnings

    act = getattr(fewbit, name)(bits=3)
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = act(x)
        y.sum().backward()
    assert y.device.type == "meta" and y.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("make", [
    lambda: fewbit.ELU(alpha="1"), lambda: fewbit.ELU(alpha=True), lambda: fewbit.Softplus(beta="2"),
    lambda: fewbit.LeakyReLU("0.1"), lambda: fewbit.Hardtanh("-1", "1"),
    lambda: fewbit.functional.elu(torch.randn(3), alpha="1"),
    lambda: fewbit.FewBitActivation("elu", params={"alpha": "0.5"}),
])
def test_parameters_given_as_strings_or_bools_are_refused(make):
    """``fewbit.ELU(alpha='1')`` was accepted (float('1')) and kept the string, where
    torch's nn.ELU(alpha='1') raises."""
    with pytest.raises(ValueError, match="must be a number"):
        make()
