"""fewbit.ops.pointwise: exact forward, saved bytes, gradients, inplace, autocast, compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fewbit.ops as ops
from fewbit.activations import exact_table, get_activation
from fewbit.packing import packed_nbytes
from fewbit.table import Table

from ops_testutils import bits_equal, random_table

# (dtype, atol, rtol) of the few-bit gradient against the float64 definition
# grad * q(x): one rounding of the product in the compute dtype, one cast to dtype.
GRAD_TOL = [
    (torch.float32, 1e-6, 1e-6),
    (torch.float64, 1e-12, 1e-12),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 1e-2, 8e-3),
]


def _table_for(name, bits=3, seed=0, params=None):
    t = random_table(bits, seed=seed, mirrored=get_activation(name).even)
    return Table(name=name, bits=bits, borders=t.borders, codes=t.codes, values=t.values,
                 params=params or {})


def _q64(x, table):
    """float64 derivative approximation q(x) (docs/method.md §2) via searchsorted."""
    b = torch.tensor(table.borders, dtype=torch.float64)
    idx = torch.searchsorted(b, x.detach().double().reshape(-1), right=False)
    code = torch.tensor(table.codes)[idx]
    return torch.tensor(table.values, dtype=torch.float64)[code].reshape(x.shape)


@pytest.mark.parametrize("name,params", [("gelu", None), ("silu", None), ("tanh", None),
                                         ("elu", {"alpha": 0.5}), ("softplus", None)])
@pytest.mark.parametrize("dtype,atol,rtol", GRAD_TOL, ids=lambda v: str(v).replace("torch.", ""))
def test_forward_exact_and_gradient(device, name, params, dtype, atol, rtol):
    table = _table_for(name, params=params)
    act = get_activation(name)
    full = {**act.defaults, **(params or {})}
    x = (torch.randn(37, 29, dtype=torch.float64) * 3).to(dtype).to(device).requires_grad_()
    y = ops.pointwise(x, table, name, params)
    assert y.dtype == dtype and bits_equal(y.detach(), act.torch_fn(x.detach(), **full))
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    # bit-exact against the reference kernels
    packed = ops.encode_reference(x.detach().cpu(), table.borders, table.codes, 3)
    assert bits_equal(gx.cpu(), ops.decode_mul_reference(g.cpu(), packed, table.values, 3))
    # and close to the float64 definition grad * q(x)
    expect = (g.double().cpu() * _q64(x.cpu(), table))
    torch.testing.assert_close(gx.double().cpu(), expect, atol=atol, rtol=rtol)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_saved_bytes_only_codes(bits, dtype):
    table = _table_for("gelu", bits=bits)
    values = ops.table_tensors(table, "cpu", dtype)[2]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(1001, 7, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ops.pointwise(x, table, "gelu")
    codes = [t for t in saved if t.dtype == torch.uint8]
    shared = [t for t in saved if t.data_ptr() == values.data_ptr()]
    assert len(codes) == 1 and codes[0].numel() == math.ceil(x.numel() * bits / 8)
    assert len(shared) == 1 and len(saved) == 2  # nothing of the input's size
    y.sum().backward()
    assert x.grad is not None


def test_no_grad_saves_nothing_and_matches_torch():
    table = _table_for("gelu")
    saved = []
    x = torch.randn(100)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.pointwise(x, table, "gelu")
    assert saved == [] and torch.equal(y, F.gelu(x))


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (5, 0, 2)])
def test_scalar_and_empty(shape):
    table = _table_for("silu")
    x = torch.randn(shape, requires_grad=True)
    y = ops.pointwise(x, table, "silu")
    assert y.shape == x.shape and torch.equal(y, F.silu(x))
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert bits_equal(x.grad, _q64(x, table).float())


def test_non_contiguous_input():
    table = _table_for("gelu")
    base = torch.randn(8, 6, requires_grad=True)
    x = base.t()[::2]
    y = ops.pointwise(x, table, "gelu")
    assert torch.equal(y, F.gelu(x))
    y.backward(torch.ones_like(y))
    expect = torch.zeros(8, 6)
    expect.t()[::2] = _q64(x, table).float()
    assert torch.equal(base.grad, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channels_last", "channels_last_3d", "transposed"])
def test_dense_layouts_are_read_in_place_and_keep_their_layout(layout, dtype):
    """A dense input that is not contiguous (channels_last, a transposed tensor) is coded in
    its memory order: the gradient equals that of its contiguous copy bit for bit
    (NaN/inf patched at their own positions), and comes back in the input's layout with
    torch's strides, also for the in-place form and a graph of the backward."""
    table = _table_for("gelu")
    gen = torch.Generator().manual_seed(0)
    if layout == "channels_last":
        base = torch.randn(3, 5, 4, 6, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    elif layout == "channels_last_3d":
        base = torch.randn(2, 5, 3, 4, 6, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last_3d)
    else:
        base = torch.randn(7, 5, 9, generator=gen).to(dtype).transpose(0, 2)
    assert not base.is_contiguous()
    base[torch.unravel_index(torch.tensor([3, 17, 40]), base.shape)] = torch.tensor(
        [float("nan"), float("inf"), -float("inf")], dtype=dtype)
    g = torch.randn(base.shape, generator=gen).to(dtype)
    g = torch.empty_like(base).copy_(g)  # the gradient in the input's layout, as the next layer gives it
    for inplace in (False, True):
        for create_graph in (False, True):
            grads = []
            for x0 in (base, base.contiguous()):
                leaf = x0.detach().clone(memory_format=torch.preserve_format).requires_grad_()
                x = leaf * 1.0 if inplace else leaf
                y = ops.pointwise(x, table, "gelu", inplace=inplace)
                assert torch.equal(y.nan_to_num(7.0), F.gelu(leaf.detach()).nan_to_num(7.0))
                assert y.stride() == F.gelu(leaf.detach()).stride()
                if inplace:  # torch's in-place checks leave no node in the graph of a non-view
                    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["MulBackward0"]
                (gx,) = torch.autograd.grad(y, leaf, g, create_graph=create_graph)
                grads.append(gx)
            want_strides = torch.ops.aten.gelu_backward(g, base).stride()
            assert grads[0].stride() == want_strides, (layout, inplace, create_graph)
            assert torch.equal(grads[0].float().nan_to_num(7.0), grads[1].float().nan_to_num(7.0))


def test_dense_layouts_on_the_reference_backend(monkeypatch):
    """The backend of devices other than CPU and CUDA codes in logical order: its backward
    must not permute (a channels_last input got a gradient off by 2.16 at 8 bits)."""
    import fewbit.ops._pointwise as pw

    monkeypatch.setattr(pw, "_plan", lambda table, fn, full, dtype, device, torch_fn=None: pw._Plan(
        table, fn, full, dtype, device, "reference", torch_fn))
    table = _table_for("gelu")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 4, 5, generator=gen)
    g = torch.randn(base.shape, generator=gen)
    grads = []
    for x0 in (base.contiguous(memory_format=torch.channels_last), base):
        x = x0.clone(memory_format=torch.preserve_format).requires_grad_()
        ops.pointwise(x, table, "gelu").backward(g)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_inplace_like_torch():
    table = exact_table("relu")
    leaf = torch.randn(50, requires_grad=True)
    x = leaf * 1.0
    version = x._version
    y = ops.pointwise(x, table, "relu", inplace=True)
    assert y is x and x._version > version
    assert torch.equal(y, F.relu(leaf.detach()))
    y.backward(torch.arange(50.0))
    assert torch.equal(leaf.grad, torch.where(leaf > 0, torch.arange(50.0), 0.0))
    # like torch's inplace activations, a leaf that requires grad is refused
    with pytest.raises(RuntimeError, match="leaf"):
        ops.pointwise(torch.randn(3, requires_grad=True), table, "relu", inplace=True)
    # no grad: plain inplace
    z = torch.randn(10)
    z0 = z.clone()
    assert ops.pointwise(z, _table_for("gelu"), "gelu", inplace=True) is z
    assert torch.equal(z, F.gelu(z0))


def test_inplace_codes_from_input_not_output():
    table = _table_for("gelu", bits=4)
    leaf = torch.randn(300, requires_grad=True)
    x = leaf * 1.0
    y = ops.pointwise(x, table, "gelu", inplace=True)
    y.backward(torch.ones(300))
    assert torch.equal(leaf.grad, _q64(leaf, table).float())


def test_autocast_cpu_bf16():
    table = _table_for("gelu")
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        y = ops.pointwise(h, table, "gelu")
        assert y.dtype == h.dtype == torch.bfloat16
        assert torch.equal(y, F.gelu(h))
        loss = y.float().sum()
    loss.backward()
    g_h = _q64(h, table).to(torch.bfloat16)  # grad of sum is 1: bf16(1 * q) exactly
    expect = (g_h.float() @ lin.weight.to(torch.bfloat16).float())
    torch.testing.assert_close(x.grad, expect, atol=2e-2, rtol=2e-2)


def test_module_string_fn():
    table = _table_for("gelu")
    x = torch.randn(20, requires_grad=True)
    y = ops.pointwise(x, table, "torch.nn.functional:gelu", {"approximate": "tanh"})
    assert torch.equal(y, F.gelu(x.detach(), approximate="tanh"))
    y.sum().backward()
    assert torch.equal(x.grad, _q64(x, table).float())


def test_errors():
    table = _table_for("gelu")
    with pytest.raises(TypeError, match="input must be"):
        ops.pointwise(torch.arange(3), table, "gelu")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.pointwise(torch.randn(3), table, "gleu")
    with pytest.raises(ValueError, match="cannot import module"):
        ops.pointwise(torch.randn(3), table, "no_such_module_xyz:f")
    with pytest.raises(ValueError, match="table is for 'gelu', not for fn 'silu'"):
        ops.pointwise(torch.randn(3), table, "silu")
    with pytest.raises(ValueError, match="params"):
        ops.pointwise(torch.randn(3), _table_for("elu"), "elu", {"alpha": 2.0})
    with pytest.raises(TypeError, match="Table"):
        ops.pointwise(torch.randn(3), object(), "gelu")


class _MLP(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(ops.pointwise(self.a(x), self.table, "gelu"))


def test_compile_no_graph_breaks(device):
    model = _MLP(_table_for("gelu")).to(device)
    x = torch.randn(3, 8, device=device)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).sum().backward()
    g = model.a.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    assert torch.equal(g, model.a.weight.grad)


@pytest.mark.slow
def test_compile_inductor_fullgraph(device):
    # Inductor (C++ codegen on CPU; on CUDA it traces into the Triton ops) with the custom
    # ops inside one graph.
    torch._dynamo.reset()
    model = _MLP(_table_for("gelu")).to(device)
    x = torch.randn(3, 8, device=device)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    g = model.a.weight.grad.clone()
    model.zero_grad()
    ref = model(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, model.a.weight.grad)


def test_compile_saves_the_codes_not_the_input(device):
    """Under torch.compile (inductor, fullgraph) what the graph saves for backward is the
    packed codes, as in eager mode, and the gradient is eager's (on an H100 with torch 2.11
    the compiled graph saved the float32 input, 2**26 elements: 256 MiB against 24 MiB eager,
    with torch's gradient: test_compile_is_not_taken_for_export)."""
    torch._dynamo.reset()
    table = _table_for("gelu")

    def f(x):
        return ops.pointwise(x * 2.0, table, "gelu")

    x = torch.randn(1 << 14, device=device, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    compiled = torch.compile(f, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = compiled(x)
    y.backward(torch.ones_like(y))
    g = x.grad.clone()
    x.grad = None
    f(x).backward(torch.ones_like(y))
    assert torch.equal(g, x.grad)
    codes = packed_nbytes(x.numel(), 3)
    # the codes, the table's values and patch, and the compiled path's fixed-capacity
    # non-finite record ((1 + 1024) int64: 8200 bytes); x would be 65536 bytes more
    assert codes <= sum(saved.values()) <= codes + 8200 + 1024, saved


def test_compile_is_not_taken_for_export(monkeypatch):
    """torch 2.11's Dynamo evaluates ``torch.compiler.is_exporting()`` as True while
    torch.compile traces (torch 2.13 reads the flag): fewbit took every compiled call for
    torch.export and ran torch's function, no codes saved, torch's gradient (an H100 run:
    compiled gradients off eager's everywhere, the compiled model's peak memory vanilla's).
    Simulated here by an ``is_exporting`` that returns True while Dynamo traces (and False
    outside, where torch.compile itself asks it)."""
    torch._dynamo.reset()
    table = _table_for("gelu")

    def f(x):
        return ops.pointwise(x * 2.0, table, "gelu")

    x = torch.randn(4096, requires_grad=True)
    saved = []
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch._dynamo.is_compiling())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = compiled(x)
    y.sum().backward()
    g = x.grad.clone()
    monkeypatch.undo()
    x.grad = None
    f(x).sum().backward()
    assert torch.equal(g, x.grad)  # the few-bit gradient, not torch's
    assert any(t.dtype == torch.uint8 for t in saved) and not any(t.numel() == x.numel() for t in saved)
    torch._dynamo.reset()


def test_a_torch_without_the_export_flag(monkeypatch):
    """torch 2.4 and 2.5 have neither ``torch.compiler._is_exporting_flag`` nor
    ``torch.compiler.is_exporting``: every call that needs a gradient raised AttributeError;
    there export is not told apart and the call compresses."""
    monkeypatch.delattr(torch.compiler, "_is_exporting_flag", raising=False)
    monkeypatch.delattr(torch.compiler, "is_exporting", raising=False)
    x = torch.randn(100, requires_grad=True)
    y = ops.pointwise(x, _table_for("gelu"), "gelu")
    assert torch.equal(y, F.gelu(x))
    y.sum().backward()
    assert x.grad is not None
