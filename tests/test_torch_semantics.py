"""The gradient of a few-bit activation is torch's, or a clear error (public API only).

- NaN and +-inf inputs get torch's gradient, for every registry function, a user
  function, every dtype, with grad_output values 0, -0, +-inf, NaN and huge ones;
- stepwise (exact) tables: bit-identical to torch also for NaN/inf grad_output;
- ``inplace=True`` on a tensor torch refuses to modify raises before writing;
- double backward: exact for stepwise tables, a clear error for fitted ones; torch.func
  grad / vjp / vmap / jacrev.

Only public entry points are used, so these tests also run against older versions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fewbit
import fewbit.modules as fm
from fewbit import functional as FF
from fewbit.activations import ACTIVATIONS, canonical_params
from fewbit.table import Table

pytestmark = pytest.mark.usefixtures("fewbit_env")  # tests/conftest.py: an empty user cache per test

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NONFINITE = [math.nan, math.inf, -math.inf]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so +0 != -0), any NaN equal to any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    na, nb = a.isnan(), b.isnan()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(na, nb) and torch.equal(a[~na].view(ints), b[~nb].view(ints))


def _dtype_id(dt):
    return str(dt).replace("torch.", "")


def _special_grads(dtype):
    fi = torch.finfo(dtype)
    return [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.5, -2.25, fi.max / 2, -fi.max, fi.tiny]


def _inputs(dtype, n=2048, seed=0):
    """x with every non-finite class met by every special grad_output, away from the
    last 64 elements (torch's own scalar tail differs from its vector body at NaN)."""
    g_ = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g_, dtype=torch.float64) * 4).to(dtype)
    g = torch.randn(n, generator=g_, dtype=torch.float64).to(dtype)
    specials = _special_grads(dtype)
    pos = torch.randperm(n - 64, generator=g_)[: 3 * len(specials) + 30]
    k = 0
    for xv in NONFINITE:
        for gv in specials:
            x[pos[k]], g[pos[k]] = xv, gv
            k += 1
    for j in range(30):  # more non-finite inputs with ordinary grads
        x[pos[k]] = NONFINITE[j % 3]
        k += 1
    return x, g


def _torch_grad(fn, x, g, **params):
    xt = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(fn(xt, **params), xt, g)
    return gx


def _random_table(name, bits, params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = 1 << bits
    borders = torch.sort(torch.rand(m - 1, generator=gen, dtype=torch.float64) * 8 - 4).values.tolist()
    values = (torch.rand(m, generator=gen, dtype=torch.float64) * 1.2 - 0.1).tolist()
    return Table(name=name, bits=bits, borders=borders, codes=list(range(m)), values=values, params=params)


# (registry name, non-default params or None for the shipped/exact table)
VARIANTS = [(n, None) for n in sorted(ACTIVATIONS)] + [
    ("leaky_relu", {"negative_slope": 0.0}),  # torch multiplies by 0 here (NaN * 0 = NaN)
    ("leaky_relu", {"negative_slope": 0.2}),
    ("hardtanh", {"min_val": -0.5, "max_val": 2.0}),
    ("threshold", {"threshold": 0.3, "value": -1.0}),
    ("hardshrink", {"lambd": 0.0}),
    ("elu", {"alpha": 0.5}),
    ("softplus", {"beta": 2.0, "threshold": 5.0}),
    ("celu", {"alpha": 2.0}),
]


def _variant_id(v):
    name, params = v
    return name + ("" if not params else "-" + "-".join(f"{k}={p}" for k, p in params.items()))


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_nonfinite_inputs_get_torch_gradient(variant, dtype):
    name, params = variant
    act = ACTIVATIONS[name]
    full = canonical_params(act, params)
    x, g = _inputs(dtype)
    # no shipped table for non-default parameters of smooth functions: any table will do
    table = _random_table(name, 3, params) if params and not act.stepwise else None
    leaf = x.clone().requires_grad_(True)
    y = FF.activation(leaf, name, table=table, params=params)
    assert bits_equal(y.detach(), act.torch_fn(x, **full))
    (got,) = torch.autograd.grad(y, leaf, g)
    expect = _torch_grad(act.torch_fn, x, g, **full)
    bad = ~torch.isfinite(x)
    assert bits_equal(got[bad], expect[bad]), (x[bad][:12], g[bad][:12], got[bad][:12], expect[bad][:12])
    if act.stepwise and not (name == "hardsigmoid" and dtype == torch.float64):
        # exact tables: every element bit for bit (torch's hardsigmoid uses a float32 1/6
        # even for float64: a float32 rounding apart there, see test_functional)
        assert bits_equal(got, expect)


def my_softplus(input, beta=1.0):
    """A user activation, importable as ``test_torch_semantics:my_softplus``."""
    return F.softplus(input, beta)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_nonfinite_user_function(dtype):
    fn = f"{__name__}:my_softplus"
    table = _random_table(fn, 2, {"beta": 2.0})
    x, g = _inputs(dtype, seed=1)
    leaf = x.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(FF.activation(leaf, fn, table=table, params={"beta": 2.0}), leaf, g)
    expect = _torch_grad(my_softplus, x, g, beta=2.0)
    bad = ~torch.isfinite(x)
    assert bits_equal(got[bad], expect[bad])


def test_nan_input_is_not_hidden():
    # the reported case: GELU at NaN backpropagated 1.0026 where torch gives NaN
    x = torch.tensor([0.5, math.nan, -1.0, math.inf, -math.inf], requires_grad=True)
    FF.gelu(x).sum().backward()
    assert x.grad[[1, 3, 4]].isnan().all() and torch.isfinite(x.grad[[0, 2]]).all()
    xm = torch.full((3,), math.nan, requires_grad=True)
    fm.SiLU()(xm).sum().backward()  # modules go through the same path
    assert xm.grad.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", sorted(n for n, a in ACTIVATIONS.items() if a.stepwise))
def test_stepwise_bit_identical_with_nonfinite_grad_output(name, dtype):
    # README: exact tables give torch's gradient bit for bit. torch's backward is a
    # select (x <= 0 ? 0 : grad), so a NaN/inf grad_output where the level is 0 gives
    # +0 (grad * 0.0 would be NaN), and -1 gives +0 (not -0).
    act = ACTIVATIONS[name]
    pts = torch.tensor([0.0, -0.0, 6.0, -3.0, 3.0, 1.0, -1.0, 0.5, -0.5, 0.01, -7.0, 7.0])
    x = torch.cat([pts, torch.randn(1012) * 4]).to(dtype)
    specials = torch.tensor(_special_grads(dtype), dtype=torch.float64)
    g = specials[torch.arange(x.numel()) % specials.numel()].to(dtype)
    leaf = x.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(FF.activation(leaf, name), leaf, g)
    expect = _torch_grad(act.torch_fn, x, g, **act.defaults)
    if name == "hardsigmoid" and dtype == torch.float64:  # torch's level is float32(1/6)
        zero = expect == 0
        assert bits_equal(got[zero], expect[zero])
        torch.testing.assert_close(got, expect, rtol=2 * torch.finfo(torch.float32).eps, atol=0, equal_nan=True)
    else:
        assert bits_equal(got, expect)


def test_capacity_overflow_gives_nan_everywhere():
    # more non-finite inputs in one call than a fixed record holds (CUDA, torch.compile,
    # torch.func): the whole gradient of that call is NaN (a loud signal, never a silently
    # wrong gradient). On the CPU in eager mode every one is recorded: torch's gradient.
    cap = fewbit.ops.NONFINITE_CAPACITY
    x = torch.randn(4 * cap)
    x[: cap + 1] = math.nan
    leaf = x.clone().requires_grad_(True)
    FF.gelu(leaf).sum().backward()
    assert leaf.grad[: cap + 1].isnan().all() and torch.isfinite(leaf.grad[cap + 1:]).all()
    grad = torch.func.grad(lambda t: FF.gelu(t).sum())
    assert grad(x).isnan().all()
    x[cap] = 0.5  # exactly at capacity: exact
    g = grad(x)
    assert g[:cap].isnan().all() and torch.isfinite(g[cap:]).all()


# ----------------------------------------------------------------------------- inplace

INPLACE_FUNCTIONAL = [
    ("silu", {}), ("selu", {}), ("elu", {}), ("celu", {}), ("mish", {}), ("hardswish", {}),
    ("relu", {}), ("leaky_relu", {}), ("relu6", {}), ("hardtanh", {}), ("hardsigmoid", {}),
    ("threshold", {"threshold": 0.1, "value": 0.0}),
]
INPLACE_MODULES = [
    (fm.SiLU, {}), (fm.SELU, {}), (fm.ELU, {}), (fm.CELU, {}), (fm.Mish, {}), (fm.Hardswish, {}),
    (fm.ReLU, {}), (fm.LeakyReLU, {}), (fm.ReLU6, {}), (fm.Hardtanh, {}), (fm.Hardsigmoid, {}),
    (fm.Threshold, {"threshold": 0.1, "value": 0.0}),
]


def _calls(tensor):
    """Every in-place entry point of fewbit applied to ``tensor``."""
    for fname, kw in INPLACE_FUNCTIONAL:
        yield f"functional.{fname}", lambda t=tensor, f=fname, kw=kw: getattr(FF, f)(t, **kw, inplace=True)
    for cls, kw in INPLACE_MODULES:
        yield f"modules.{cls.__name__}", lambda t=tensor, c=cls, kw=kw: c(**kw, inplace=True)(t)
    yield "activation", lambda t=tensor: FF.activation(t, "gelu", inplace=True)
    yield "ops.pointwise", lambda t=tensor: fewbit.ops.pointwise(t, FF.load_table("relu"), "relu", inplace=True)


@pytest.mark.parametrize("how", ["leaf", "view", "unbind"])
def test_inplace_refused_before_writing(how):
    p = torch.nn.Parameter(torch.tensor([-1.5, -0.0, 0.25, 2.0, math.nan, -3.0]))
    before = p.detach().clone()
    if how == "leaf":
        target, match = p, "a leaf Variable that requires grad is being used in an in-place operation"
    elif how == "view":
        target, match = p[1:5], "a view of a leaf Variable that requires grad"
    else:
        target, match = (p * 1).unbind(0)[2], "view and is being modified inplace"
    with pytest.raises(RuntimeError, match=match):  # torch's own behaviour, for reference
        F.relu(target, inplace=True)
    for where, call in _calls(target):
        with pytest.raises(RuntimeError, match=match):
            call()
        assert bits_equal(p.detach(), before), f"{where} overwrote the tensor before raising"
        assert p.grad is None and p.grad_fn is None


def test_inplace_without_grad_still_writes():
    for fname, kw in INPLACE_FUNCTIONAL:
        p = torch.nn.Parameter(torch.randn(6))
        expect = getattr(F, fname)(p.detach().clone(), **kw)
        with torch.no_grad():
            out = getattr(FF, fname)(p, **kw, inplace=True)
        assert out is p and torch.equal(p.detach(), expect)


# ----------------------------------------------------------------------------- double backward


class _Net(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(12, 6, generator=g, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(3, 12, generator=g, dtype=torch.float64))
        self.act = act

    def forward(self, x):
        return self.act(x @ self.a.t()) @ self.b.t()


def _penalty_grads(act, x):
    net = _Net(act)
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(net(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return net.a.grad, net.b.grad


STEP_ACTS = [
    (lambda t: FF.relu(t), F.relu),
    (lambda t: FF.leaky_relu(t, 0.1), lambda t: F.leaky_relu(t, 0.1)),
    (lambda t: FF.hardtanh(t, -0.5, 0.5), lambda t: F.hardtanh(t, -0.5, 0.5)),
    (lambda t: FF.threshold(t, 0.1, -1.0), lambda t: F.threshold(t, 0.1, -1.0)),
    (lambda t: FF.softshrink(t, 0.3), lambda t: F.softshrink(t, 0.3)),
]


@pytest.mark.parametrize("pair", STEP_ACTS, ids=["relu", "leaky_relu", "hardtanh", "threshold", "softshrink"])
def test_gradient_penalty_exact_for_stepwise(pair):
    fewbit_act, torch_act = pair
    x = torch.randn(7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = _penalty_grads(fewbit_act, x)
    expect = _penalty_grads(torch_act, x)
    for a, b in zip(got, expect):  # the f'' term is 0 for both; the rest is the same maths
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_double_backward_fitted_table_raises_clear_error():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    net = _Net(lambda t: FF.gelu(t, bits=3))
    (gx,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)  # building it is fine
    first = torch.autograd.grad(_Net(lambda t: FF.gelu(t, bits=3))(x).sum(), x)[0]
    torch.testing.assert_close(gx.detach(), first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"double backward through gelu .*f''\(x\)"):
        gx.square().sum().backward()
    # grad_output constant (sum): only the f''(x) term links the gradient to the weights;
    # it was silently dropped, now it raises too
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(FF.gelu(x @ w.t()).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward through gelu"):
        torch.autograd.grad(gx.square().sum(), w)


def test_torch_func_grad_vjp():
    x = torch.randn(20, dtype=torch.float64)
    for fn in (lambda t: FF.gelu(t), lambda t: FF.relu(t), lambda t: fm.Hardtanh()(t)):
        leaf = x.clone().requires_grad_(True)
        (expect,) = torch.autograd.grad((fn(leaf) * torch.arange(20.0)).sum(), leaf)
        got = torch.func.grad(lambda t: (fn(t) * torch.arange(20.0)).sum())(x)
        assert torch.equal(got, expect)
        _, vjp = torch.func.vjp(fn, x)
        assert torch.equal(vjp(torch.arange(20.0, dtype=torch.float64))[0], expect)


def test_torch_func_gradient_penalty_stepwise_and_fitted():
    x = torch.randn(4, 6, dtype=torch.float64)
    a = torch.randn(5, 6, dtype=torch.float64)

    def penalty(w, act):
        gx = torch.func.grad(lambda t: act(t @ w.t()).sum())(x)
        return gx.square().sum()

    got = torch.func.grad(penalty)(a, lambda t: FF.leaky_relu(t, 0.2))
    expect = torch.func.grad(penalty)(a, lambda t: F.leaky_relu(t, 0.2))
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="double backward through gelu"):
        torch.func.grad(penalty)(a, lambda t: FF.gelu(t))


@pytest.mark.parametrize("name", ["gelu", "relu", "hardshrink"])
def test_vmap_per_sample_gradients(name):
    X = torch.randn(5, 3, 7)  # 21 elements per sample: streams end mid-byte
    X[2, 1, 4] = math.nan
    X[4, 0, 0] = -math.inf
    w = torch.randn(3, 7)

    def f(x):
        return (FF.activation(x, name) * w).sum()

    got = torch.func.vmap(torch.func.grad(f))(X)
    expect = torch.stack([torch.func.grad(f)(X[i]) for i in range(X.shape[0])])
    assert bits_equal(got, expect)
    jac = torch.func.jacrev(lambda t: FF.activation(t, name))(X[0])
    leaf = X[0].clone().requires_grad_(True)
    y = FF.activation(leaf, name).reshape(-1)
    rows = [torch.autograd.grad(y[i], leaf, retain_graph=True)[0] for i in range(y.numel())]
    assert bits_equal(jac.reshape(21, 3, 7), torch.stack(rows))


@pytest.mark.parametrize("name", ["gelu", "relu", "silu"])
def test_forward_over_reverse_hessian_is_torchs(name):
    """``torch.func.hessian`` (jacfwd of jacrev) and a jvp of a gradient through fewbit's
    activations: torch's values (forward mode runs torch's function). Before, they raised
    torch's "You must implement the jvp function" for every activation, exact ones too."""
    import fewbit.functional as FF
    from torch.func import grad, hessian, jvp

    torch.manual_seed(0)
    x = torch.randn(6, dtype=torch.float64)
    w = torch.randn(6, 6, dtype=torch.float64)
    ours, theirs = getattr(FF, name), getattr(torch.nn.functional, name)
    torch.testing.assert_close(hessian(lambda t: ours(w @ t).pow(2).sum())(x),
                               hessian(lambda t: theirs(w @ t).pow(2).sum())(x))
    v = torch.ones_like(x)
    torch.testing.assert_close(jvp(grad(lambda t: ours(w @ t).pow(2).sum()), (x,), (v,))[1],
                               jvp(grad(lambda t: theirs(w @ t).pow(2).sum()), (x,), (v,))[1])


def test_per_sample_gradients_of_a_model_with_compressed_saves():
    """``torch.func`` transforms refuse saved-tensor hooks, so compressed saves stand aside
    under them (what is saved stays exact): ``vmap(grad(...))`` per-sample gradients (DP-SGD)
    of a model converted with ``saved_bits`` are those of the model converted with the same
    activations and no saved-tensor compression (before: torch's ``RuntimeError``)."""
    from torch.func import functional_call, grad, vmap

    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    got = []
    for config in (fewbit.Config(activation_bits=3), fewbit.Config(activation_bits=3, saved_bits=2, min_numel=0)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 8))
        fewbit.convert_(model, config)
        params = {n: p.detach() for n, p in model.named_parameters()}
        f = lambda p, xi: functional_call(model, p, (xi.unsqueeze(0),)).pow(2).sum()  # noqa: E731
        got.append(vmap(grad(f), in_dims=(None, 0))(params, x))
    for n in got[0]:
        assert bits_equal(got[1][n], got[0][n]), n


def test_vmap_of_a_tensor_that_requires_grad_keeps_the_few_bit_backward():
    """``vmap(f)(x)`` then ``.backward()`` (ensembles over ``functional_call``): the batched
    tensor vmap passes in reports ``requires_grad=False``, so the call ran torch's function
    and saved the whole input, with torch's exact gradient instead of the table's (review
    h69). The tensor under the batching is asked now."""
    from fewbit.ops import decode_mul_reference, encode_reference
    from fewbit.resolve import resolve_fn, table_for

    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64) * 2
    table = table_for(resolve_fn("gelu"), 3, {}, x.dtype)
    expect = decode_mul_reference(torch.ones_like(x), encode_reference(x, table.borders, table.codes, 3),
                                  table.values, 3)
    leaf = x.clone().requires_grad_()
    torch.func.vmap(FF.gelu)(leaf).sum().backward()
    assert torch.equal(leaf.grad, expect)


@pytest.mark.parametrize("module", [lambda: fewbit.ELU(alpha=0.5), lambda: fewbit.LeakyReLU(0.2),
                                    lambda: fewbit.Softplus(beta=2.0), lambda: fewbit.Hardtanh(-2.0, 2.0),
                                    lambda: fewbit.CELU(alpha=1.5)])
def test_parametrised_modules_compile_with_dynamic_shapes(module):
    """``torch.compile(dynamic=True)`` makes float parameters symbolic: ``math.isfinite`` of
    one could not be traced (fullgraph: an error; otherwise a graph break, after which the
    table's ``bits`` was symbolic and the fake kernel refused it). Every module with a float
    parameter had failed; torch's own compile (review h69). The parameters are
    specialised now: forward and gradient equal eager's."""
    torch._dynamo.reset()
    m = module()
    x = torch.randn(4, 3, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    y = torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True)(leaf)
    y.sum().backward()
    ref = x.clone().requires_grad_()
    m(ref).sum().backward()
    assert bits_equal(y.detach(), m(x)) and bits_equal(leaf.grad, ref.grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_vmap_of_a_converted_activation_runs(fullgraph):
    """Asking the tensor under vmap's batching whether it requires grad cannot be traced:
    torch.compile of ``vmap(module)`` crashed (fullgraph: Unsupported; otherwise an
    AssertionError resuming inside vmap; review h73). Traced, the call runs torch's
    function, as before."""
    m = torch.nn.Sequential(torch.nn.GELU())
    fewbit.convert_(m, bits=3)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch._dynamo.reset()
    leaf = x.clone().requires_grad_()
    torch.compile(lambda t: torch.func.vmap(m)(t).sum(), backend="aot_eager", fullgraph=fullgraph)(leaf).backward()
    ref = x.clone().requires_grad_()
    F.gelu(ref).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad)
    torch._dynamo.reset()
