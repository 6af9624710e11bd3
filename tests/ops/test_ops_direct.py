"""The eager path of fewbit.ops.pointwise: kernels called directly (no torch.library
dispatcher), the table's kernel-ready form made once per setting, and the Triton branch
(fused forward when _triton offers one), checked on CPU with a stand-in module."""

from __future__ import annotations

import gc
import math
import types

import pytest
import torch

import fewbit.ops as ops
from fewbit.ops import _cpu, _pointwise
from fewbit.resolve import resolve_fn, table_for


def _gelu_table(bits=3, dtype=torch.float32):
    f = resolve_fn("gelu")
    return table_for(f, bits, f.full_params({}), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1000, 3 * _cpu.SERIAL_MAX + 13])  # serial and parallel kernels
def test_eager_calls_kernels_directly(monkeypatch, dtype, n):
    table = _gelu_table(dtype=dtype)
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[5] = math.nan
    g = torch.randn_like(x)
    b, c, v = ops.table_tensors(table, "cpu", dtype)

    def boom(*a, **k):
        raise AssertionError("the eager path went through the torch.library op")

    monkeypatch.setattr(_cpu, "encode_cpu", boom)  # what the registered cpu kernels call
    monkeypatch.setattr(_cpu, "decode_mul_cpu", boom)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    xr = x.clone().requires_grad_()
    y = ops.pointwise(xr, table, "gelu")
    y.backward(g)
    assert torch.equal(y, torch.nn.functional.gelu(x)) or torch.allclose(y, torch.nn.functional.gelu(x),
                                                                          equal_nan=True, rtol=0, atol=0)
    want = ops.decode_mul_reference(g, ops.encode_reference(x, b, c, 3), v, 3)
    want[5] = math.nan  # torch's gradient at a NaN input (fewbit.ops._nonfinite)
    assert torch.equal(xr.grad.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(xr.grad[ok], want[ok])


def test_plan_made_once_per_setting_and_dropped_with_the_table():
    table = _gelu_table(bits=2)
    table = type(table)(**{**table.__dict__})  # a private copy, not the resolver's
    x = torch.randn(64, requires_grad=True)
    ops.pointwise(x, table, "gelu")
    f = resolve_fn("gelu")
    plan = _pointwise._plan(table, "gelu", f.full_params({}), torch.float32, x.device, f.callable)
    ops.pointwise(x, table, "gelu").sum().backward()
    assert _pointwise._plan(table, "gelu", f.full_params({}), torch.float32, x.device, f.callable) is plan
    assert plan.kc.dtype.name == "int64" and plan.kb.dtype.name == "float32" and plan.kv.dtype.name == "float32"
    key = id(table)
    assert key in _pointwise._plans
    del table, plan
    gc.collect()
    assert key not in _pointwise._plans


def _fake_triton(calls):
    """A stand-in for fewbit.ops._triton on CPU tensors: the reference kernels, with
    the names and signatures of the contract (forward_encode_triton for FUSED_EAGER)."""

    def encode_triton(x, borders, codes, bits, *, traceable=True):
        assert not traceable  # the eager node launches the kernels themselves (no HOP)
        calls.append("encode")
        return ops.encode_reference(x, borders, codes, bits)

    def encode_nonfinite_triton(x, borders, codes, bits, classes, capacity, *, traceable=True):
        assert not traceable
        calls.append("encode_nonfinite")
        return ops.encode_reference(x, borders, codes, bits), ops.nonfinite_record_reference(x, classes, capacity)

    def forward_encode_triton(x, borders, codes, bits, classes, capacity, fn, params, out, *, traceable=True):
        assert not traceable
        if out is not None and not out.is_contiguous():  # the real launcher's contract
            raise ValueError("out must be a contiguous tensor")
        calls.append(("fused", fn, params, out is x))
        assert codes.dtype == torch.int32
        packed = ops.encode_reference(x, borders, codes, bits)
        record = ops.nonfinite_record_reference(x, classes, capacity) if classes else None
        y = torch.nn.functional.gelu(x, approximate=dict(params).get("approximate", "none"))
        return (x.copy_(y) if out is not None else y), packed, record

    def decode_mul_triton(grad, packed, values, bits, *, nonfinite=None, patch=None, select_zero=False,
                          traceable=True):
        assert not traceable
        calls.append("decode")
        return torch.ops.fewbit.decode_mul(grad, packed, values, bits, nonfinite, patch, select_zero)

    return types.SimpleNamespace(FUSED_EAGER=frozenset({"gelu"}), encode_triton=encode_triton,
                                 encode_nonfinite_triton=encode_nonfinite_triton,
                                 forward_encode_triton=forward_encode_triton, decode_mul_triton=decode_mul_triton)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fn", ["gelu", "silu"])
def test_triton_branch_fused_when_offered(monkeypatch, fn, inplace):
    calls = []
    monkeypatch.setattr(_pointwise, "_triton", lambda: _fake_triton(calls))
    f = resolve_fn(fn)
    full = f.full_params({})
    table = table_for(f, 3, full, torch.float32)
    plan = _pointwise._Plan(table, f.op_name, full, torch.float32, torch.device("cpu"), "triton")
    x = torch.randn(100)
    x[3] = math.inf
    a = x.clone().requires_grad_()
    src = a.clone() if inplace else a
    y = _pointwise._direct(src, plan, inplace)
    y.backward(torch.ones_like(y))
    b = x.clone().requires_grad_()
    want_y = ops.pointwise(b, table, f.op_name)
    want_y.backward(torch.ones_like(want_y))
    # bit for bit; torch's vectorised CPU GELU gives NaN at +inf on some CPUs (scalar: inf)
    torch.testing.assert_close(y.detach(), want_y.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)  # NaN at the inf input
    if fn == "gelu":
        assert calls[0] == ("fused", "gelu", tuple(full.items()), inplace)
    else:
        assert calls[0] == "encode_nonfinite"  # silu's rules record +inf; no fused kernel offered
    assert calls[-1] == "decode"


@pytest.mark.parametrize("fn", ["gelu", "relu"])
def test_eager_node_has_one_edge_and_double_backward_still_raises(fn):
    """The anchor of a fitted table is not an input of the eager node: its only edge is the
    input's (a backward runs no anchor node), and a graph of the backward still reaches the
    input through it, so differentiating a fitted table's gradient raises."""
    f = resolve_fn(fn)
    table = table_for(f, 3 if fn == "gelu" else 1, f.full_params({}), torch.float64)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    h = torch.randn(4, 5, dtype=torch.float64) @ w.t()
    y = ops.pointwise(h, table, fn)
    edges = [e for e, _ in y.grad_fn.next_functions if e is not None]
    assert edges == [h.grad_fn]
    (gh,) = torch.autograd.grad(y.sum(), h, create_graph=True)
    if fn == "gelu":
        with pytest.raises(RuntimeError, match="double backward through gelu"):
            torch.autograd.grad(gh.square().sum(), w)
    else:
        assert not gh.requires_grad  # relu: f'' = 0, the exact gradient has no graph to w


@pytest.mark.parametrize("fn", ["gelu", "silu"])
def test_eager_triton_launches_skip_torchs_wrapper(monkeypatch, fn):
    """The eager node launches its Triton kernels itself. Through ``torch.library.wrap_triton``
    (on in eager code outside a ``triton_op``) each launch went through torch's
    ``triton_kernel_wrapper_mutation`` operator: about 110 of an eager GELU forward's 160 µs
    of host time with the launch itself stubbed out (CI VM), and one entry in torch's
    kernel side table per launch, never freed (host memory growing every training step).
    Checked with Triton's launch stubbed (no GPU here): CPU tensors through the Triton
    backend's real (compiled-mode) kernel objects."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from fewbit.ops import _triton

    if not isinstance(_triton._decode_mul_kernel, JITFunction):
        pytest.skip("the kernels are interpreted (TRITON_INTERPRET=1): torch passes those through")
    launched = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **k: launched.append(self.fn.__name__))
    f = resolve_fn(fn)
    full = f.full_params({})
    table = table_for(f, 3, full, torch.float32)
    plan = _pointwise._Plan(table, f.op_name, full, torch.float32, torch.device("cpu"), "triton")
    before = (len(kernel_side_table.constant_args), len(kernel_side_table.id_to_kernel))
    for _ in range(3):
        x = torch.randn(100, requires_grad=True)
        y = _pointwise._direct(x, plan, False)  # the stubbed kernels write nothing: values unchecked
        y.backward(torch.ones_like(y))
    assert launched == ["_forward_encode_kernel", "_decode_mul_kernel"] * 3
    assert (len(kernel_side_table.constant_args), len(kernel_side_table.id_to_kernel)) == before


def test_inplace_fused_forward_on_a_view_with_gaps(monkeypatch):
    """The fused kernel writes y only into a contiguous tensor: an in-place call on a view
    with gaps (``h[:, ::2]``) gets y written back after the codes (it raised ValueError)."""
    calls = []
    monkeypatch.setattr(_pointwise, "_triton", lambda: _fake_triton(calls))
    f = resolve_fn("gelu")
    full = f.full_params({})
    table = table_for(f, 3, full, torch.float32)
    plan = _pointwise._Plan(table, f.op_name, full, torch.float32, torch.device("cpu"), "triton")
    h = torch.randn(16, 12)
    a = h.clone().requires_grad_()
    src = a.clone()[:, ::2]
    y = _pointwise._direct(src, plan, True)
    assert y is src
    y.backward(torch.ones_like(y))
    b = h.clone().requires_grad_()
    want = ops.pointwise(b.clone()[:, ::2], table, "gelu")
    want.backward(torch.ones_like(want))
    assert torch.equal(y.detach(), want.detach()) and torch.equal(a.grad, b.grad)
    assert calls[0] == ("fused", "gelu", tuple(full.items()), False)


def test_make_fx_records_the_ops():
    """Under a dispatch mode (make_fx, FakeTensorMode, a user's mode) the eager node, which
    hands the tensors' memory to the kernels, is not taken: the ``torch.ops`` path is. A
    make_fx graph had recorded no encode (the codes came from the trace's own call), and
    fake tensors reached the kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import fewbit

    m = fewbit.GELU(bits=3)

    def f(x):
        return torch.autograd.grad(m(x).sum(), x)[0]

    x = torch.randn(64, requires_grad=True)
    want = f(x)
    gm = make_fx(f)(x)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("fewbit.encode") for t in targets), targets
    assert "fewbit.decode_mul.default" in targets
    assert torch.equal(gm(x), want)
    other = torch.randn(64, requires_grad=True)
    assert torch.equal(gm(other), f(other))


def test_fake_tensors_take_the_ops_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fewbit

    m = fewbit.GELU(bits=3)
    m(torch.randn(8, requires_grad=True)).sum().backward()  # the setting prepared eagerly
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(16, 8, requires_grad=True)
        y = m(x)
        (g,) = torch.autograd.grad(y.sum(), x)
    assert y.shape == g.shape == (16, 8)


_COLD_UNDER_MODES = r"""
import json, sys, torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
import fewbit
from fewbit.ops import _pointwise

out = {}
gelu = fewbit.GELU(bits=3)
with FakeTensorMode(allow_non_fake_inputs=True):  # the first call of this process
    x = torch.randn(16, 8, requires_grad=True)
    (g,) = torch.autograd.grad(gelu(x).sum(), x)
out["fake_shape"] = list(g.shape)
out["cached_fake"] = any(isinstance(t, FakeTensor) for v in _pointwise._table_cache.values() for t in v)

silu = fewbit.SiLU(bits=2)
def f(x):
    return torch.autograd.grad(silu(x).sum(), x)[0]
gm = make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)(torch.randn(64, requires_grad=True))
out["targets"] = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
x = torch.randn(64, requires_grad=True)
out["replay_equal"] = bool(torch.equal(gm(x), f(x)))

class Count(TorchDispatchMode):  # a user's logging mode
    def __init__(self):
        super().__init__()
        self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))

elu = fewbit.ELU(bits=3)
counts = []
for _ in range(2):
    with Count() as c:
        elu(torch.randn(32, 32, requires_grad=True)).sum().backward()
    counts.append(c.n)
out["ops_seen"] = counts
print(json.dumps(out))
"""


def test_first_call_under_a_dispatch_mode_prepares_real_tensors():
    """A setting's first call under ``FakeTensorMode``, ``make_fx(tracing_mode="fake")``
    or a user's logging mode (a fresh process: nothing prepared) prepares the setting with
    real tensors, outside the mode. Its gradient-rule probes had run as fake tensors (the
    first call failed on a data-dependent shape), and a table cached then would have been
    fake for the process; a logging mode counted the probes as the user's operations."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, FEWBIT_CPU_KERNELS="sync")
    proc = subprocess.run([sys.executable, "-c", _COLD_UNDER_MODES], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fake_shape"] == [16, 8]
    assert out["cached_fake"] is False
    assert any(t.startswith("fewbit.encode") for t in out["targets"]), out["targets"]
    assert "fewbit.decode_mul.default" in out["targets"]
    assert out["replay_equal"] is True
    assert out["ops_seen"][0] == out["ops_seen"][1]
