"""Tests of fewbit.functional: forward bitwise equal to torch, backward equal to the
reference ``grad * values[Table.code(x)]`` (float64 searchsorted), exact gradients for
stepwise functions, table resolution (exact / shipped / cache / fit) and validation.
"""

from __future__ import annotations

import gc
import inspect
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import fewbit
from fewbit import functional as FF
from fewbit.activations import ACTIVATIONS, canonical_params, get_activation
from fewbit.table import Table, TableFormatError, read_tables, table_filename, write_tables
from helpers import reference_grad, toy_table

# ----------------------------------------------------------------------------- fixtures

SMOOTH = sorted(n for n, a in ACTIVATIONS.items() if not a.stepwise)
STEPWISE = sorted(n for n, a in ACTIVATIONS.items() if a.stepwise)


pytestmark = pytest.mark.usefixtures("fewbit_env")  # tests/conftest.py: an empty user cache per test


def _quick_gelu_torch(x):
    return x * torch.sigmoid(1.702 * x)


def _scaled_swish(x, a=1.5, inplace=False):
    return x * torch.sigmoid(a * x)


def _tanh_series(x, terms=2, scale=1.0):
    """An int argument used as one (``range``): a float 2.0 fails."""
    y = torch.zeros_like(x)
    for k in range(terms):
        y = y + torch.tanh(x * scale / (k + 1))
    return y


# (fewbit function name, torch reference, kwargs, table name, table params)
CASES = [
    ("gelu", F.gelu, {}, "gelu", {}),
    ("gelu", lambda x: F.gelu(x, approximate="tanh"), {"approximate": "tanh"}, "gelu_tanh", {}),
    ("silu", F.silu, {}, "silu", {}),
    ("selu", F.selu, {}, "selu", {}),
    ("elu", F.elu, {}, "elu", {}),
    ("celu", F.celu, {}, "celu", {}),
    ("mish", F.mish, {}, "mish", {}),
    ("softplus", F.softplus, {}, "softplus", {}),
    ("sigmoid", torch.sigmoid, {}, "sigmoid", {}),
    ("tanh", torch.tanh, {}, "tanh", {}),
    ("logsigmoid", F.logsigmoid, {}, "logsigmoid", {}),
    ("softsign", F.softsign, {}, "softsign", {}),
    ("tanhshrink", F.tanhshrink, {}, "tanhshrink", {}),
    ("hardswish", F.hardswish, {}, "hardswish", {}),
    ("quick_gelu", _quick_gelu_torch, {}, "quick_gelu", {}),
]
STEP_CASES = [
    ("relu", F.relu, {}, "relu", {}),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.2), {"negative_slope": 0.2}, "leaky_relu", {"negative_slope": 0.2}),
    ("leaky_relu", F.leaky_relu, {}, "leaky_relu", {}),
    ("relu6", F.relu6, {}, "relu6", {}),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 2.0), {"min_val": -0.5, "max_val": 2.0}, "hardtanh",
     {"min_val": -0.5, "max_val": 2.0}),
    ("threshold", lambda x: F.threshold(x, 0.3, -1.0), {"threshold": 0.3, "value": -1.0}, "threshold",
     {"threshold": 0.3, "value": -1.0}),
    ("hardshrink", lambda x: F.hardshrink(x, 0.3), {"lambd": 0.3}, "hardshrink", {"lambd": 0.3}),
    ("softshrink", F.softshrink, {}, "softshrink", {}),
    ("hardsigmoid", F.hardsigmoid, {}, "hardsigmoid", {}),
]
# Points on every stepwise border: the interval convention must match torch's backward.
SPECIAL = [0.0, -0.0, 0.3, -0.3, 0.5, -0.5, 2.0, -1.0, 1.0, 3.0, -3.0, 6.0, 1e-30, -1e-30]


def _input(dtype, n=(5, 37), special=False):
    x = torch.randn(*n, dtype=torch.float64) * 4
    if special:
        flat = x.reshape(-1)
        flat[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return x.to(dtype)


def _case_id(c):
    return c[3] + ("" if not c[2] else "-" + "-".join(f"{k}={v}" for k, v in c[2].items()))


# ----------------------------------------------------------------------------- forward/backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + STEP_CASES, ids=_case_id)
def test_forward_bitwise_and_backward_matches_reference(case, dtype):
    fname, torch_fn, kwargs, tname, tparams = case
    x = _input(dtype, special=True).requires_grad_(True)
    y = getattr(FF, fname)(x, **kwargs, bits=2 if tname in SMOOTH else 1)
    torch.testing.assert_close(y.detach(), torch_fn(x.detach()), atol=0, rtol=0)
    assert y.dtype == dtype and y.shape == x.shape
    g = torch.randn_like(y)
    y.backward(g)
    act = get_activation(tname)
    full = canonical_params(act, tparams)
    if act.stepwise:
        # border parameters are rounded as torch rounds them for this dtype
        full = FF._stepwise_params_for(tname, full, dtype)
    table = FF.load_table(tname, 2 if tname in SMOOTH else 1, full)
    assert table.name == tname
    assert dict(table.params) == {k: v for k, v in full.items() if v != act.defaults[k]}
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), table), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", STEP_CASES, ids=_case_id)
def test_stepwise_gradient_equals_torch_autograd(case, dtype):
    fname, torch_fn, kwargs, tname, _ = case
    x = _input(dtype, n=(7, 33), special=True)
    if dtype in (torch.float16, torch.bfloat16):  # values next to the rounded parameters
        p = torch.tensor([v for v in kwargs.values()] + [0.3, 0.7, 0.1], dtype=dtype)
        near = torch.cat([p, torch.nextafter(p, p + 1), torch.nextafter(p, p - 1)])
        near = torch.cat([near, -near])
        x.reshape(-1)[len(SPECIAL): len(SPECIAL) + near.numel()] = near
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    getattr(FF, fname)(x1, **kwargs).backward(g)
    torch_fn(x2).backward(g)
    # exact at 1 bit: bitwise equal to torch's own backward (Hardsigmoid's level is the
    # float32 1.0f/6.0f torch multiplies by in every dtype, float64 included).
    torch.testing.assert_close(x1.grad, x2.grad, atol=0, rtol=0)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_stepwise_ignores_extra_bits(bits):
    t = FF.load_table("relu", bits)
    assert t.bits == 1 and t.error == 0.0 and t.weight == "exact"


def test_smooth_gradient_close_to_exact():
    x = torch.linspace(-4, 4, 4001, dtype=torch.float64, requires_grad=True)
    FF.gelu(x, bits=4).sum().backward()
    exact = torch.autograd.grad(F.gelu(x).sum(), x)[0]
    # the shipped 4-bit table: 16 levels, each within ~0.06 of GELU' on [-4, 4]
    assert (x.grad - exact).abs().max() < 0.1
    assert torch.nn.functional.cosine_similarity(x.grad, exact, dim=0) > 0.99


def test_odd_shapes_and_views():
    for shape in [(0,), (1,), (1023,), (3, 0, 2)]:
        x = torch.randn(shape, requires_grad=True)
        y = FF.silu(x)
        torch.testing.assert_close(y, F.silu(x.detach()), atol=0, rtol=0)
        y.sum().backward()
        assert x.grad.shape == x.shape
    base = torch.randn(8, 10, requires_grad=True)
    view = base.t()[::2]  # non-contiguous
    y = FF.gelu(view, bits=3)
    torch.testing.assert_close(y, F.gelu(view.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    expected = torch.zeros(10, 8)
    expected[::2] = reference_grad(g, view.detach(), FF.load_table("gelu", 3))
    torch.testing.assert_close(base.grad, expected.t(), atol=0, rtol=0)


@pytest.mark.parametrize("fname,torch_fn,kwargs", [
    ("relu", F.relu, {}),
    ("silu", F.silu, {}),
    ("leaky_relu", lambda x, inplace: F.leaky_relu(x, 0.1, inplace), {"negative_slope": 0.1}),
    ("hardtanh", F.hardtanh, {}),
])
def test_inplace(fname, torch_fn, kwargs):
    x = torch.randn(6, 9, requires_grad=True)
    h = x * 1.5
    ptr = h.data_ptr()
    out = getattr(FF, fname)(h, **kwargs, inplace=True)
    assert out.data_ptr() == ptr
    ref_in = (x.detach() * 1.5)
    torch.testing.assert_close(out.detach(), torch_fn(ref_in.clone(), inplace=False), atol=0, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    table = FF.load_table(ACTIVATIONS["leaky_relu" if fname == "leaky_relu" else fname].name,
                          3, {"negative_slope": 0.1} if fname == "leaky_relu" else None)
    torch.testing.assert_close(x.grad, reference_grad(g, ref_in, table) * 1.5, atol=1e-6, rtol=1e-6)


def test_no_grad_path_calls_torch_and_loads_no_table():
    x = torch.randn(100)
    with torch.no_grad():
        y = FF.gelu(torch.randn(10, requires_grad=True), bits=8)  # no 8-bit table exists anywhere
    assert FF._TABLES == {}
    torch.testing.assert_close(FF.elu(x, 0.3, bits=5), F.elu(x, 0.3), atol=0, rtol=0)
    assert FF._TABLES == {}
    assert y.requires_grad is False


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, 9, -1, 2.5, True, "3"])
def test_bits_validation(bad):
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"bits must be"):
        FF.gelu(x, bits=bad)
    with pytest.raises(ValueError, match=r"bits must be"):
        FF.relu(x, bits=bad)
    with pytest.raises(ValueError, match=r"bits must be"):
        FF.load_table("gelu", bad)


def test_bits_message_names_value():
    with pytest.raises(ValueError, match=r"bits must be an integer in 1\.\.8, got 9"):
        FF.silu(torch.randn(3), bits=9)


def test_non_tensor_input():
    x = [1.0, 2.0]
    for f in (FF.gelu, FF.relu, lambda x: FF.activation(x, "gelu")):
        with pytest.raises(TypeError, match="input"):
            f(x)


@pytest.mark.parametrize("x", [torch.arange(-2, 3), torch.ones(3, dtype=torch.bool)])
def test_integer_and_bool_input_is_torchs(x):
    """As in the modules a converted model replaced: torch's result, or torch's error."""
    for ours, theirs in ((FF.relu, torch.relu), (FF.gelu, F.gelu), (FF.silu, F.silu)):
        try:
            expect = theirs(x)
        except Exception as exc:  # torch's own error (gelu of an integer tensor)
            with pytest.raises(type(exc)):
                ours(x)
        else:
            assert torch.equal(ours(x), expect)
    with pytest.raises(TypeError, match="input"):  # a user function has no torch twin
        FF.activation(x, "gelu")
    with pytest.raises(ValueError, match="bits"):  # checked as a float call (review h50)
        FF.relu(x, bits=99)


def test_invalid_approximate():
    with pytest.raises(ValueError, match="approximate"):
        FF.gelu(torch.randn(3), approximate="erf")


def test_unknown_activation_and_param():
    with pytest.raises(ValueError, match="unknown activation"):
        FF.load_table("gleu", 3)
    with pytest.raises(ValueError, match="takes parameters"):
        FF.load_table("elu", 3, {"beta": 1.0})
    with pytest.raises(ValueError, match="min_val"):
        FF.hardtanh(torch.randn(3, requires_grad=True), 1.0, -1.0)


def test_signatures_mirror_torch():
    """Every function has torch's parameters (names, defaults, order) plus keyword-only bits."""
    builtin = {  # torch builtins without an inspectable signature, from torch's docs
        "gelu": ["input", ("approximate", "none")],
        "softplus": ["input", ("beta", 1.0), ("threshold", 20.0)],
        "logsigmoid": ["input"],
        "hardshrink": ["input", ("lambd", 0.5)],
        "softshrink": ["input", ("lambd", 0.5)],
    }
    names = [n for n in ACTIVATIONS if n != "gelu_tanh"]
    for name in names:
        ours = inspect.signature(getattr(FF, name))
        params = list(ours.parameters.values())
        assert params[-1].name == "bits" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[-1].default == get_activation(name).default_bits
        got = [(p.name, p.default) if p.default is not inspect.Parameter.empty else p.name for p in params[:-1]]
        if name == "quick_gelu":
            assert got == ["input"]
            continue
        if name in builtin:
            assert got == builtin[name], name
            continue
        torch_fn = getattr(F, name)
        theirs = [(p.name, p.default) if p.default is not inspect.Parameter.empty else p.name
                  for p in inspect.signature(torch_fn).parameters.values()]
        assert got == theirs, name


# ----------------------------------------------------------------------------- table resolution


def test_smooth_tables_come_from_fewbit_tables():
    from fewbit.table import load_shipped

    for name in SMOOTH:
        for bits in (1, 2, 3, 4):
            t = FF.load_table(name, bits)
            assert t == load_shipped(name)[bits], (name, bits)
            assert t.name == name and t.params == {} and t.bits == bits


def test_load_table_is_cached_in_memory():
    t1 = FF.load_table("silu", 3)
    t2 = FF.load_table("swish", 3)  # alias
    assert t1 is t2 and t1.name == "silu" and t1.bits == 3


def test_load_table_from_path_and_table(tmp_path):
    path = tmp_path / "mine.json"
    write_tables(path, [toy_table("tanh", 1), toy_table("tanh", 2)])
    t = FF.load_table(path, 2)
    assert t.bits == 2 and t.name == "tanh"
    assert FF.load_table(str(path), 1).bits == 1
    with pytest.raises(TableFormatError, match="mine.json.*no 5-bit"):
        FF.load_table(path, 5)
    with pytest.raises(ValueError, match="pass bits"):
        FF.load_table(path)
    assert FF.load_table(t) is t
    with pytest.raises(ValueError, match="does not match"):
        FF.load_table(t, 3)


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    write_tables(path, [toy_table("gelu", 2)])
    doc = json.loads(path.read_text())
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(TableFormatError, match="bad.json"):
        FF.load_table(path, 2)
    path.write_text("{not json")
    with pytest.raises(TableFormatError, match="bad.json"):
        FF.load_table(path, 2)
    # a table file whose per-bits record does not match its key
    write_tables(path, [toy_table("gelu", 2)])
    doc = json.loads(path.read_text())
    doc["tables"]["3"] = doc["tables"].pop("2")
    path.write_text(json.dumps(doc))
    with pytest.raises(TableFormatError, match="bad.json"):
        FF.load_table(path, 3)


def test_cache_never_reuses_table_for_other_params(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    # a file named for alpha=0.5 but holding a table fitted for the default alpha
    wrong = toy_table("elu", 3)
    path = tmp_path / "tables" / table_filename("elu", {"alpha": 0.5})
    path.parent.mkdir(parents=True)
    write_tables(path, [wrong])
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    # not used: set aside, kept, and the table fitted for alpha=0.5
    with pytest.warns(FF.TableFittedWarning, match=r"fitted for params \{\}, not \{'alpha': 0.5\}"):
        refit = FF.load_table("elu", 3, {"alpha": 0.5})
    assert dict(refit.params) == {"alpha": 0.5} and refit.values != wrong.values
    assert read_tables(path.with_name(path.name + ".corrupt"))[3] == wrong
    # the right one is used
    write_tables(path, [toy_table("elu", 3, {"alpha": 0.5})])
    FF.clear_table_cache()
    t = FF.load_table("elu", 3, {"alpha": 0.5})
    assert dict(t.params) == {"alpha": 0.5}
    x = torch.randn(50, requires_grad=True)
    y = FF.elu(x, 0.5, bits=3)
    torch.testing.assert_close(y, F.elu(x.detach(), 0.5), atol=0, rtol=0)
    g = torch.randn(50)
    y.backward(g)
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), t), atol=0, rtol=0)


def test_activation_refuses_mismatched_table():
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(ValueError, match="fitted for params"):
        FF.activation(x, "elu", table=toy_table("elu", 3), params={"alpha": 0.5})
    with pytest.raises(ValueError, match="is for 'tanh'"):
        FF.activation(x, "sigmoid", table=toy_table("tanh", 3))


def test_activation_table_argument_errors_name_table(tmp_path):
    """``table=`` is read as a file whatever its suffix; anything else is a TypeError
    naming ``table`` (not ``fn``)."""
    x = torch.randn(5, requires_grad=True)
    path = tmp_path / "gelu_table"  # no .json suffix
    write_tables(path, [toy_table("gelu", 2)])
    y = FF.activation(x, "gelu", table=str(path), bits=2)
    assert y.shape == x.shape
    with pytest.raises(TableFormatError, match="gelu_table.*no 3-bit"):
        FF.activation(x, "gelu", table=str(path), bits=3)
    with pytest.raises(TableFormatError, match="missing_file.*cannot read"):
        FF.activation(x, "gelu", table=str(tmp_path / "missing_file"), bits=2)
    with pytest.raises(TypeError, match="table must be .* got int"):
        FF.activation(x, "gelu", table=5, bits=2)


def test_activation_generic_with_user_function(tmp_path):
    """A user's activation ("module:callable") with its own JSON table works like ours."""
    base = toy_table("sigmoid", 3)
    mine = Table(name="torch:sigmoid", bits=3, borders=base.borders, codes=base.codes, values=base.values)
    path = tmp_path / "my_sigmoid.json"
    write_tables(path, [mine])
    x = torch.randn(4, 25, requires_grad=True)
    y = FF.activation(x, "torch:sigmoid", table=path, bits=3)
    torch.testing.assert_close(y, torch.sigmoid(x.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), mine), atol=0, rtol=0)
    # registry name through the generic entry point
    x.grad = None
    FF.activation(x, "silu", bits=2).backward(g)
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), FF.load_table("silu", 2)), atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot import module"):
        FF.activation(x, "no_such_module_xyz:f", table=mine)


def test_solver_missing_gives_install_hint(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "fewbit.solver", None)
    with pytest.raises(ImportError, match=r'pip install "fewbit\[solver\]"'):
        FF.load_table("elu", 3, {"alpha": 0.25})
    assert not (tmp_path / "tables" / table_filename("elu", {"alpha": 0.25})).exists()


def test_fit_through_solver_into_cache(tmp_path, monkeypatch):
    """Non-default parameters of a smooth function: fitted once by the solver, cached
    atomically in FEWBIT_CACHE_DIR, and read back from the cache afterwards."""
    solver = pytest.importorskip("fewbit.solver")
    if not hasattr(solver, "fit"):
        pytest.skip("fewbit.solver.fit is not written yet")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 400)
    with pytest.warns(FF.TableFittedWarning, match="elu"):
        t = FF.load_table("elu", 2, {"alpha": 0.5})
    assert t.name == "elu" and t.bits == 2 and dict(t.params) == {"alpha": 0.5}
    path = tmp_path / "tables" / table_filename("elu", {"alpha": 0.5})
    assert path.exists()
    FF.clear_table_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t2 = FF.load_table("elu", 2, {"alpha": 0.5})
    assert t2.values == t.values and t2.borders == t.borders
    # a second bit width is merged into the same cache file
    with pytest.warns(FF.TableFittedWarning):
        FF.load_table("elu", 1, {"alpha": 0.5})
    from fewbit.table import read_tables

    assert sorted(read_tables(path)) == [1, 2]
    # gradient of the fitted table is a sensible approximation of ELU'(alpha=0.5)
    x = torch.linspace(-5, 5, 1001, dtype=torch.float64, requires_grad=True)
    FF.elu(x, 0.5, bits=2).sum().backward()
    exact = torch.autograd.grad(F.elu(x, 0.5).sum(), x)[0]
    assert torch.nn.functional.cosine_similarity(x.grad, exact, dim=0) > 0.95


@pytest.mark.parametrize("fname,torch_fn,tname", [("gelu", F.gelu, "gelu"), ("relu", F.relu, "relu"),
                                                  ("sigmoid", torch.sigmoid, "sigmoid")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_every_device(device, fname, torch_fn, tname, dtype):
    x = (torch.randn(3, 1000, device=device) * 3).to(dtype).requires_grad_(True)
    y = getattr(FF, fname)(x)
    assert y.device == x.device
    torch.testing.assert_close(y, torch_fn(x.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    table = FF.load_table(tname)
    expected = reference_grad(g.cpu(), x.detach().cpu(), table)
    torch.testing.assert_close(x.grad.cpu(), expected, atol=0, rtol=0)


def test_fit_with_unwritable_cache_still_returns_table(tmp_path, monkeypatch):
    solver = pytest.importorskip("fewbit.solver")
    if not hasattr(solver, "fit"):
        pytest.skip("fewbit.solver.fit is not written yet")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(blocker))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    with pytest.warns(FF.TableFittedWarning, match="not cached"):
        t = FF.load_table("celu", 1, {"alpha": 2.0})
    assert dict(t.params) == {"alpha": 2.0}
    assert blocker.read_text().startswith("a file")  # nothing the user had is overwritten


def test_corrupt_cache_file_is_set_aside_and_refitted(tmp_path, monkeypatch):
    """An unreadable cache file is never silently used nor deleted: it is moved to
    ``<file>.corrupt``, the table is refitted, and the warning names both files."""
    solver = pytest.importorskip("fewbit.solver")
    if not hasattr(solver, "fit"):
        pytest.skip("fewbit.solver.fit is not written yet")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    path = tmp_path / "tables" / table_filename("elu", {"alpha": 0.5})
    path.parent.mkdir(parents=True)
    path.write_text("{truncated")
    FF.clear_table_cache()
    with pytest.warns(FF.TableFittedWarning, match=r"moved to .*\.corrupt"):
        t = FF.load_table("elu", 2, {"alpha": 0.5})
    assert dict(t.params) == {"alpha": 0.5} and t.bits == 2
    assert (tmp_path / "tables" / (path.name + ".corrupt")).read_text() == "{truncated"
    FF.clear_table_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # now cached: no refit
        assert FF.load_table("elu", 2, {"alpha": 0.5}).values == t.values


def test_solver_dependency_missing_inside_fit(tmp_path, monkeypatch):
    solver = pytest.importorskip("fewbit.solver")
    if not hasattr(solver, "fit"):
        pytest.skip("fewbit.solver.fit is not written yet")

    def fit(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")

    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(solver, "fit", fit)
    with pytest.raises(ImportError, match=r'pip install "fewbit\[solver\]"'):
        FF.load_table("softplus", 3, {"beta": 2.0})


def test_user_function_fitted_lazily(tmp_path, monkeypatch):
    """A user's "module:callable" with no table: fitted by the solver, cached, and then
    applied like a registry function."""
    solver = pytest.importorskip("fewbit.solver")
    if not hasattr(solver, "fit"):
        pytest.skip("fewbit.solver.fit is not written yet")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    x = torch.randn(200, requires_grad=True)
    with pytest.warns(FF.TableFittedWarning, match="torch.special:expit"):
        y = FF.activation(x, "torch.special:expit", bits=2)
    torch.testing.assert_close(y, torch.special.expit(x.detach()), atol=0, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    table = FF.load_table("torch.special:expit", 2)
    assert table.name == "torch.special:expit" and table.bits == 2
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), table), atol=0, rtol=0)
    from fewbit.resolve import _cache_path, resolve_fn

    cached = _cache_path(resolve_fn("torch.special:expit"), {})  # named with the derivative's fingerprint
    assert cached.parent == tmp_path / "tables" and cached.exists()
    assert cached.name.startswith("torch.special--expit#") and cached.name.endswith(".json")
    # a module-level callable is accepted as is (it is importable under its own name)
    x.grad = None
    with pytest.warns(FF.TableFittedWarning, match="_quick_gelu_torch"):
        y = FF.activation(x, _quick_gelu_torch, bits=1)
    torch.testing.assert_close(y, _quick_gelu_torch(x.detach()), atol=0, rtol=0)
    y.backward(g)
    table = FF.load_table(_quick_gelu_torch, 1)
    assert table.name == f"{__name__}:_quick_gelu_torch"
    torch.testing.assert_close(x.grad, reference_grad(g, x.detach(), table), atol=0, rtol=0)
    with pytest.raises(TypeError, match="not importable"):
        FF.activation(x, lambda t: t * 2)


def test_user_function_with_parameters(tmp_path, monkeypatch):
    """``fn(input, a=1.5)``: ``a`` is a parameter (documented as ``fn(input, **params)``);
    the solver called ``fn(x)`` only and refused every parameter, at the first forward of a
    module built with one. Tables are keyed by the non-default parameters, the backward is
    the derivative at the given value, and an unknown parameter is refused at construction."""
    pytest.importorskip("fewbit.solver")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    x = torch.linspace(-4, 4, 801, dtype=torch.float64).float().requires_grad_()
    grads = {}
    for a in (1.5, 4.0):
        x.grad = None
        with pytest.warns(FF.TableFittedWarning, match="_scaled_swish"):
            y = FF.activation(x, _scaled_swish, bits=3, params={"a": a})
        torch.testing.assert_close(y, _scaled_swish(x.detach(), a=a), atol=0, rtol=0)
        y.backward(torch.ones_like(y))
        table = FF.load_table(_scaled_swish, 3, {"a": a})
        assert table.params == ({} if a == 1.5 else {"a": 4.0})
        torch.testing.assert_close(x.grad, reference_grad(torch.ones_like(y), x.detach(), table), atol=0, rtol=0)
        grads[a] = x.grad.clone()
    exact = {}
    for a in (1.5, 4.0):
        xe = x.detach().double().requires_grad_()
        _scaled_swish(xe, a=a).sum().backward()
        exact[a] = xe.grad.float()
    # each backward approximates its own derivative, not the other's
    assert (grads[4.0] - exact[4.0]).abs().mean() < 0.5 * (grads[4.0] - exact[1.5]).abs().mean()
    assert (grads[1.5] - exact[1.5]).abs().mean() < 0.5 * (grads[1.5] - exact[4.0]).abs().mean()
    spec = f"{__name__}:_scaled_swish"
    assert fewbit.FewBitActivation(spec, params={"a": 4.0}, bits=3)(x).shape == x.shape
    with pytest.raises(ValueError, match="takes parameters a; got b"):
        fewbit.FewBitActivation(spec, params={"b": 1.0})


def test_user_function_with_an_int_argument(tmp_path, monkeypatch):
    """``fn(x, terms=2)`` with ``range(terms)``: every number default became a float
    parameter passed back as ``terms=2.0`` (TypeError in the fit and in the forward); an
    integral value of an int argument goes to ``fn`` as an int."""
    pytest.importorskip("fewbit.solver")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    x = torch.randn(300, requires_grad=True)
    for params in ({}, {"terms": 3}):
        with pytest.warns(FF.TableFittedWarning, match="_tanh_series"):
            y = FF.activation(x, _tanh_series, bits=2, params=params)
        torch.testing.assert_close(y, _tanh_series(x.detach(), **params), atol=0, rtol=0)
        y.sum().backward()
    assert fewbit.FewBitActivation(f"{__name__}:_tanh_series", params={"terms": 3}, bits=2)(x).shape == x.shape


class _UnhashableSeries:
    """A callable user activation that cannot be hashed (``__eq__`` without ``__hash__``)."""

    def __eq__(self, other):
        return isinstance(other, _UnhashableSeries)

    def __call__(self, x, terms=2):
        return _tanh_series(x, terms)


_unhashable_series = _UnhashableSeries()


def test_an_unhashable_user_function_with_an_int_argument_reuses_its_plan(tmp_path, monkeypatch):
    """Its int-restoring wrapper was made anew at every call, and the pointwise plan cache,
    keyed by the callable, grew by one plan a call."""
    pytest.importorskip("fewbit.solver")
    from fewbit.ops import _pointwise

    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    x = torch.randn(64, requires_grad=True)
    with pytest.warns(FF.TableFittedWarning):
        FF.activation(x, f"{__name__}:_unhashable_series", bits=2)

    def plans():
        return sum(len(entry[1]) for entry in _pointwise._plans.values())

    before = plans()
    for _ in range(50):
        FF.activation(x, f"{__name__}:_unhashable_series", bits=2).sum().backward()
    assert plans() == before


def test_repeated_gradient_calls_are_checked_like_the_first():
    """Gradient calls of a setting already resolved skip the resolution (fewbit.resolve.CALLS),
    not the checks: bad bits, another dtype or an integer input still raise, and
    clear_table_cache forgets the settings."""
    from fewbit.resolve import CALLS

    x = torch.randn(8, requires_grad=True)
    y0 = FF.gelu(x, bits=3)
    y1 = FF.gelu(x, bits=3)
    assert torch.equal(y0, y1) and any(k[0] == "gelu" and k[2] == 3 for k in CALLS)
    for bad in (3.0, True, 9):
        with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
            FF.gelu(x, bits=bad)
    with pytest.raises(NotImplementedError):  # torch's error for an integer tensor
        FF.gelu(torch.arange(8), bits=3)
    with pytest.raises(ValueError, match="approximate"):
        FF.gelu(x, approximate="fast", bits=3)
    g = torch.randn(8)
    (a,) = torch.autograd.grad(FF.gelu(x, bits=3), x, g)
    (b,) = torch.autograd.grad(FF.gelu(x.double(), bits=3), x, g.double())  # another dtype
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    fewbit.functional.clear_table_cache()
    assert not CALLS
    (c,) = torch.autograd.grad(FF.gelu(x, bits=3), x, g)
    assert torch.equal(a, c)


def test_sparse_input_is_torch_call():
    """A sparse tensor goes to torch's function: its result, gradient and errors. Before,
    fewbit failed on it with torch's "reshape is not implemented for sparse tensors"."""
    x = torch.randn(8, 8).to_sparse().requires_grad_()
    y = FF.relu(x)
    assert y.layout == torch.sparse_coo and torch.equal(y.to_dense(), F.relu(x).to_dense())
    torch.sparse.sum(y).backward()
    assert torch.equal(x.grad.to_dense(), (x.detach().to_dense() > 0).float())
    with pytest.raises(NotImplementedError):  # torch has no sparse GELU
        FF.gelu(x)


def test_tensor_parameters_do_not_grow_the_call_cache():
    """A tensor parameter hashes by identity, so each call made a new entry of the
    resolved-call cache (50 calls: 50 entries, each holding a plan). Now such calls are
    resolved every time; the gradient is that of the same float parameter."""
    from fewbit.functional import _CALLS

    x = torch.randn(100, generator=torch.Generator().manual_seed(0)).requires_grad_()
    FF.leaky_relu(x, negative_slope=0.25).sum().backward()
    want = x.grad.clone()
    before = len(_CALLS)
    for _ in range(50):
        x.grad = None
        FF.leaky_relu(x, negative_slope=torch.tensor(0.25)).sum().backward()
    assert len(_CALLS) == before
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("params", [[0.5], "alpha=0.5", 0.5, 0, False])
def test_params_that_are_not_a_mapping_name_the_argument(params):
    """``params=[0.5]`` raised 'cannot convert dictionary update sequence element #0 to a sequence'."""
    with pytest.raises(TypeError, match=r"^params must be a mapping of parameter names to numbers"):
        FF.activation(torch.randn(3, requires_grad=True), "elu", params=params)
    # (name, value) pairs, as dict() takes them, are a mapping's items
    y = FF.activation(torch.randn(3), "elu", params=[("alpha", 0.5)])
    assert y.shape == (3,)


def test_a_parameter_changed_at_every_call_does_not_grow_the_caches(monkeypatch):
    """An annealed ``negative_slope`` made a new setting per call, and the call, table,
    table-tensor, rules and patch caches kept every one (20 000 calls: 20 000 entries each
    and 310 MiB more); they keep the newest ``fewbit._caches.LIMIT``."""
    from fewbit import _caches
    from fewbit.ops import _pointwise
    from fewbit.resolve import _TABLES, CALLS

    monkeypatch.setattr(_caches, "LIMIT", 8)
    FF.clear_table_cache()

    def sizes():
        return {k: len(v) for k, v in vars(_pointwise).items()
                if k.startswith("_") and not k.startswith("__") and isinstance(v, (dict, list, set))}

    before = sizes()  # what earlier tests left: a cache this loop does not add to keeps it
    x = torch.randn(64, requires_grad=True)
    for i in range(40):
        slope = 0.01 + i * 1e-3
        y = FF.leaky_relu(x, slope)
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.where(x > 0, 1.0, slope), rtol=0, atol=0)
        x.grad = None
    assert len(CALLS) <= 8 and len(_TABLES) <= 8
    del y
    gc.collect()
    # every cache of the module, the patches of torch's non-finite rules too (they hold NaN:
    # keyed by the NaN tuples, each setting had added a row and a tensor of its own)
    caches = sizes()
    assert {"_table_cache", "_prepared", "_patch_cache", "_plans"} <= set(caches)
    # _plans holds an entry per table alive (a weak reference): those of the call and table
    # caches here, beside what earlier tests' objects keep alive
    plans = caches.pop("_plans")
    assert plans <= before["_plans"] + 8, (before, plans)
    assert all(n <= max(8, before.get(k, 0)) for k, n in caches.items()), (before, caches)


def test_parameters_equal_but_not_the_same_are_settings_of_their_own():
    """The call cache compared parameters with ``==``: after ``leaky_relu(x, 0.0)``,
    ``leaky_relu(x, -0.0)`` gave ``+0.0`` where torch gives ``-0.0``, and after
    ``elu(x, 1.0)`` ``elu(x, True)`` was taken, where alone it is refused."""
    FF.clear_table_cache()
    x = torch.tensor([-2.0, -0.5, 1.0], requires_grad=True)
    FF.leaky_relu(x, 0.0)
    got, expect = FF.leaky_relu(x, -0.0), F.leaky_relu(x, -0.0)
    assert torch.equal(got.signbit(), expect.signbit())
    FF.elu(x, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        FF.elu(x, True)
    np = pytest.importorskip("numpy")
    y = torch.tensor([-2.0, 1.0], requires_grad=True)
    FF.leaky_relu(y, np.float32(0.0))  # NumPy floats alike
    assert FF.leaky_relu(y, np.float32(-0.0)).signbit().tolist() == F.leaky_relu(y, -0.0).signbit().tolist()
    x2 = torch.tensor([2.0, -1.0], requires_grad=True)
    FF.leaky_relu(x2, np.float64(0.0))
    assert torch.equal(FF.leaky_relu(x2, np.float64(-0.0)).signbit(), F.leaky_relu(x2, -0.0).signbit())


def test_an_activation_module_on_an_integer_tensor_is_torchs():
    """A converted model applying its activation module to integer offsets raised
    ``TypeError`` (the functional call inside it already went to torch)."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = torch.nn.Linear(4, 4), torch.nn.ReLU()

        def forward(self, x, idx):
            return self.act(self.lin(x)).sum(-1) + self.act(idx - 2)

    model = Model()
    x, idx = torch.randn(3, 4, requires_grad=True), torch.tensor([0, 3, 5])
    expect = model(x, idx)
    fewbit.convert_(model)
    assert torch.equal(model(x, idx), expect)
    assert torch.equal(FF.relu(idx), torch.relu(idx))


def test_an_eager_call_does_not_recompile_a_compiled_model():
    """torch.compile guarded on the contents of the call cache: an eager call of the same
    setting (an evaluation, another model) made the compiled model compile again."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    fewbit.convert_(model, bits=3)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        compiled(x).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    fewbit.GELU(bits=3)(torch.randn(3, requires_grad=True)).sum().backward()
    compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_a_dual_tensor_of_forward_ad_gets_torchs_tangent():
    """``torch.autograd.forward_ad``: a dual tensor whose primal requires grad raised
    ``NotImplementedError`` (the few-bit node has no forward-mode rule); ``nn.GELU`` gives
    the tangent ``f'(x) t``, and so does torch's function, which takes it now."""
    import torch.autograd.forward_ad as fwAD

    p = torch.randn(5, requires_grad=True)
    t = torch.randn(5)
    with fwAD.dual_level():
        expect = fwAD.unpack_dual(torch.nn.GELU()(fwAD.make_dual(p, t))).tangent
        got = fwAD.unpack_dual(fewbit.GELU(bits=3)(fwAD.make_dual(p, t))).tangent
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


def test_a_user_function_whose_derivative_passes_float32_names_its_parameters(tmp_path, monkeypatch):
    """``FF.activation(x, F.elu, params={"alpha": 1e39})`` failed with the table's own
    "values must be finite in float32 ... values[3]", naming no parameter (review h59)."""
    pytest.importorskip("fewbit.solver")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    FF.clear_table_cache()
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(ValueError, match=r"torch.nn.functional:elu\(alpha=1e\+39\): its derivative reaches past float32"):
        FF.activation(x, F.elu, params={"alpha": 1e39})
