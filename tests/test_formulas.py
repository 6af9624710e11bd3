"""fewbit.modules.FormulaActivation: Hugging Face activation formulas computed bit for bit,
backward from the table of the registry function they compute (no transformers needed)."""

import copy
import pickle

import pytest
import torch

import fewbit
import fewbit.functional as FF
from fewbit import modules as fm
from fewbit.activations import ACTIVATIONS, FORMULAS, get_activation, table_activation
from fewbit.ops import decode_mul_reference, encode_reference


pytestmark = pytest.mark.usefixtures("fewbit_env")  # tests/conftest.py: an empty user cache per test


def _bits(t: torch.Tensor) -> list:
    """The bit patterns (so -0.0 != 0.0 and NaN == the same NaN)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints).tolist()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_forward_is_the_formula_and_backward_the_shared_table(name, dtype, bits):
    f = FORMULAS[name]
    m = fm.FormulaActivation(name, bits=bits)
    x = (torch.randn(3, 1001, dtype=torch.float64) * 4).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-30])
    assert _bits(m(x)) == _bits(f.torch_fn(x))  # no autograd
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    assert _bits(y.detach()) == _bits(f.torch_fn(x))  # the few-bit autograd path
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    y.backward(g)
    t = FF.load_table(f.table, bits)
    want = decode_mul_reference(g, encode_reference(x, t.borders, t.codes, bits), t.values, bits)
    # Non-finite inputs get torch's own gradient of the formula (docs/method.md §1), the
    # finite ones the shared table's level.
    xt = x.clone().requires_grad_(True)
    f.torch_fn(xt).backward(g)
    want = torch.where(torch.isfinite(x), want, xt.grad)
    assert _bits(xg.grad) == _bits(want)


def test_no_grad_loads_no_table(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a table was loaded")

    monkeypatch.setattr(FF, "load_table", boom)
    m = fm.FormulaActivation("gelu_new")
    x = torch.randn(10)
    assert torch.equal(m(x), FORMULAS["gelu_new"].torch_fn(x))
    with torch.no_grad():
        m(x.requires_grad_(True))


def test_module_contract():
    m = fm.FormulaActivation("gelu_fast", bits=2)
    assert repr(m) == "FormulaActivation('gelu_fast', bits=2)"
    assert m.state_dict() == {} and list(m.parameters()) == []
    x = torch.randn(4, 7)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(clone) is fm.FormulaActivation and clone.bits == 2 and clone.name == "gelu_fast"
        assert torch.equal(clone(x), m(x))
    with pytest.raises(ValueError, match="unknown formula 'gelu_tanh'"):
        fm.FormulaActivation("gelu_tanh")
    with pytest.raises(ValueError, match="bits"):
        fm.FormulaActivation("gelu_new", bits=0)
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.arange(4))
    # saved for backward: packed codes only, ceil(numel * bits / 8) bytes plus the table values
    saved = []
    x = torch.randn(1000, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        m(x)
    assert sum(t.numel() * t.element_size() for t in saved) == 250 + 4 * 4


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_reachable_by_name(name):
    """A formula name works wherever a function name does: get_activation, load_table,
    functional.activation, FewBitActivation (forward the formula bit for bit, backward
    the shared table), and it is exported like the other modules."""
    f = FORMULAS[name]
    act = get_activation(name)
    assert act.name == name and act.torch_fn is f.torch_fn and act.table == f.table and not act.stepwise
    assert table_activation(name) is ACTIVATIONS[f.table]
    assert FF.load_table(name, 2) == FF.load_table(f.table, 2)
    x = (torch.randn(257, dtype=torch.float64) * 4).float()
    x[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for call in (lambda t: FF.activation(t, name, bits=2), fm.FewBitActivation(name, bits=2)):
        xg = x.clone().requires_grad_(True)
        y = call(xg)
        assert _bits(y.detach()) == _bits(f.torch_fn(x))
        g = torch.randn_like(x)
        y.backward(g)
        xm = x.clone().requires_grad_(True)
        fm.FormulaActivation(name, bits=2)(xm).backward(g)
        assert _bits(xg.grad) == _bits(xm.grad)
    assert _bits(FF.activation(x, name)) == _bits(f.torch_fn(x))  # no grad: no table
    assert fewbit.FormulaActivation is fm.FormulaActivation and "FormulaActivation" in fewbit.__all__


def test_gelu_new_is_the_formula_not_torchs_kernel():
    """``gelu_new`` used to be an alias of gelu_tanh, computed by torch's kernel, which
    differs from Hugging Face's NewGELUActivation in about 1 % of float32 elements."""
    x = torch.randn(100_000)
    y = FF.activation(x, "gelu_new")
    assert _bits(y) == _bits(FORMULAS["gelu_new"].torch_fn(x))
    assert _bits(y) != _bits(torch.nn.functional.gelu(x, approximate="tanh"))
    assert get_activation("gelu_pytorch_tanh") is ACTIVATIONS["gelu_tanh"]  # HF's name for torch's kernel
