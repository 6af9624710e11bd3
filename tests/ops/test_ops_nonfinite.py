"""The non-finite record and patch (fewbit.ops._nonfinite) and the CPU kernels against
the pure-torch reference; torch's rules derived per function; compile, opcheck, vmap."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fewbit.functional
import fewbit.ops as ops
from fewbit.activations import exact_table, get_activation
from fewbit.ops import _nonfinite as nf
from fewbit.packing import packed_nbytes

from ops_testutils import DTYPES, bits_equal, hard_inputs, random_table


def _dtype_id(dt):
    return str(dt).replace("torch.", "")


def test_record_layout_by_hand():
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, 2.0, math.nan])
    rec = nf.nonfinite_record_reference(x, nf.NAN | nf.POSINF | nf.NEGINF, 6)
    assert rec.tolist() == [4, 1 << 2 | 0, 2 << 2 | 1, 3 << 2 | 2, 5 << 2 | 0, 0, 0]
    assert nf.nonfinite_record_reference(x, nf.NAN, 6).tolist() == [2, 4, 20, 0, 0, 0, 0]
    assert nf.nonfinite_record_reference(x, nf.NEGINF | nf.POSINF, 1).tolist() == [2, 9]
    assert nf.nonfinite_record_reference(x, 7, 0).tolist() == [4]  # counted past capacity
    assert nf.record_nbytes() == 8 * (1 + nf.CAPACITY) == 8200


def _with_nonfinite(table, dtype, n, seed):
    x = hard_inputs(table, dtype, n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = min(n, 25)
    pos = torch.randperm(n, generator=g)[:k]
    x[pos] = torch.tensor(nf._X_OF_CLASS * 9, dtype=torch.float64)[:k].to(dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("classes", [1, 2, 4, 5, 7])
def test_encode_nonfinite_cpu_matches_reference(dtype, classes):
    table = random_table(3, seed=2)
    b, c, _ = ops.table_tensors(table, "cpu", dtype)
    for n in [0, 1, 5, 7, 1023, 4100]:
        x = _with_nonfinite(table, dtype, n, seed=n)
        for cap in [0, 3, 40]:
            packed, rec = torch.ops.fewbit.encode_nonfinite(x, b, c, 3, classes, cap)
            assert torch.equal(packed, ops.encode_reference(x, table.borders, table.codes, 3))
            assert torch.equal(rec, nf.nonfinite_record_reference(x, classes, cap)), (n, cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("select_zero", [False, True])
def test_decode_with_record_matches_reference(dtype, select_zero):
    table = random_table(2, seed=3)
    table = type(table)(**{**table.__dict__, "values": (0.0, *table.values[1:])})
    cdt = ops.compute_dtype(dtype)
    values = ops.table_tensors(table, "cpu", dtype)[2]
    gen = torch.Generator().manual_seed(0)
    for n in [1, 9, 1023, 4100]:
        x = _with_nonfinite(table, dtype, n, seed=n)
        packed = ops.encode(x, table)
        g = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        g[::5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=dtype).repeat(n)[: g[::5].numel()]
        patch = torch.randn(24, generator=gen, dtype=torch.float64).to(cdt)
        patch[0::8] = torch.tensor([1.0, 0.0, 0.0], dtype=cdt)
        patch[7::8] = torch.tensor([1.0, 1.0, 0.0], dtype=cdt)
        patch[9] = math.nan
        for cap in [0, 5, 64]:
            rec = nf.nonfinite_record_reference(x, 7, cap)
            got = torch.ops.fewbit.decode_mul(g, packed, values, 2, rec, patch, select_zero)
            ref = ops.decode_mul_reference(g, packed, table.values, 2, select_zero=select_zero,
                                           nonfinite=rec, patch=patch)
            assert bits_equal(got, ref), (n, cap)
            count = int(rec[0])
            if count > cap:
                assert got.isnan().all()
            if select_zero and count <= cap:  # zero level: +0 whatever g is
                code = ops.encode_reference(x, table.borders, table.codes, 2)
                from fewbit.packing import unpack_reference

                zero = unpack_reference(code, 2, n) == 0
                zero &= torch.isfinite(x)
                assert bits_equal(got[zero], torch.zeros_like(got[zero]))


def test_patch_reference_rules():
    # one row per class: mode, d, o_nan, o_pinf, o_ninf, o_pzero, o_nzero, d2
    patch = torch.tensor([
        0.0, 2.0, 7.0, 8.0, 9.0, 10.0, 11.0, 1.0,   # NaN: g * 2, specials 7..11
        1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0,     # +inf: a select to 0
        0.0, 3.0, math.nan, math.nan, math.nan, 0.0, -0.0, 0.0,  # -inf: (g * 3) * 0
    ])
    x = torch.tensor([math.nan] * 7 + [math.inf, -math.inf, -math.inf, -math.inf])
    g = torch.tensor([1.5, math.nan, math.inf, -math.inf, 0.0, -0.0, 3e38, -2.0, -2.0, 2e38, -1.0])
    rec = nf.nonfinite_record_reference(x, 7, 16)
    out = nf.patch_reference(torch.zeros(11), g, rec, patch)
    expect = torch.tensor([3.0, 7.0, 8.0, 9.0, 10.0, 11.0, math.inf, 0.0, -0.0, math.nan, -0.0])
    assert bits_equal(out, expect)


def _rules(name, dtype=torch.float32, params=None, bits=3):
    act = get_activation(name)
    full = {**act.defaults, **(params or {})}
    table = exact_table(name, full) if act.stepwise else random_table(bits, seed=1)
    return nf.derive_grad_rules(act.torch_fn, full, table, dtype, "cpu")


def test_rules_derived_from_torch():
    r = _rules("relu")  # exact codes already right at NaN (level 1) and +-inf
    assert r.select_zero and r.classes == 0
    r = _rules("gelu")  # torch: NaN at NaN and +-inf for every grad_output
    assert not r.select_zero and r.classes == 7
    assert all(r.patch[8 * k] == 1.0 and math.isnan(r.patch[8 * k + 1]) for k in range(3))
    r = _rules("hardshrink")  # torch's vectorised kernel selects 0 at NaN; codes say grad
    assert r.select_zero and r.classes == nf.NAN and r.patch[:2] == (1.0, 0.0)
    r = _rules("leaky_relu", params={"negative_slope": 0.0})  # torch: grad * 0.0 (multiply)
    assert not r.select_zero
    r = _rules("leaky_relu", params={"negative_slope": 0.2})  # NaN: grad * 0.2, codes: grad
    assert r.classes == nf.NAN and r.patch[:2] == (0.0, float(torch.tensor(0.2).float()))
    r = _rules("selu")  # -inf: (g * scale * alpha) * exp(-inf): NaN where g * 1.758 overflows
    row = r.patch[16:24]
    assert row[0] == 0.0 and row[7] == 0.0 and 1.75 < row[1] < 1.76


def test_rules_for_other_user_functions():
    table = random_table(2, seed=0)
    # torch.sign: torch's gradient is 0 everywhere (a select, also for NaN grad_output)
    r = nf.derive_grad_rules(torch.sign, {}, table, torch.float32, "cpu")
    assert r.classes == 7 and r.patch == (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0) * 3
    # a function torch cannot differentiate: no rules, the table's gradient stays
    r = nf.derive_grad_rules(lambda t: t.detach().sigmoid(), {}, table, torch.float32, "cpu")
    assert r == nf.GradRules()
    # a function that fails on the 1-D probe: a warning, no rules (the forward still runs)

    def needs_2d(t):
        return torch.sigmoid(t) * t.shape[1]

    with pytest.warns(RuntimeWarning, match="could not evaluate torch's gradient of needs_2d"):
        r = nf.derive_grad_rules(needs_2d, {}, table, torch.float32, "cpu")
    assert r == nf.GradRules()


def _saved_during(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return saved, out


def test_record_saved_only_with_nonfinite_inputs_on_cpu():
    table = random_table(3, seed=0)
    table = type(table)(**{**table.__dict__, "name": "gelu"})
    x = torch.randn(1000, requires_grad=True)
    ops.pointwise(x, table, "gelu")  # derive the rules outside the hooks
    saved, _ = _saved_during(lambda: ops.pointwise(x, table, "gelu"))
    assert len(saved) == 2  # finite: codes and shared values only
    xn = x.detach().clone()
    xn[[3, 500]] = math.nan
    xn.requires_grad_(True)
    saved, y = _saved_during(lambda: ops.pointwise(xn, table, "gelu"))
    rec = [t for t in saved if t.dtype == torch.int64]
    assert len(saved) == 4 and len(rec) == 1 and rec[0].tolist() == [2, 3 << 2, 500 << 2]
    y.sum().backward()
    assert xn.grad[[3, 500]].isnan().all() and torch.isfinite(xn.grad).sum() == 998


def test_compiled_path_uses_fixed_capacity(device):
    # torch.compile cannot read the count on the host: a fixed-capacity record, same
    # gradients as eager up to it; past it all NaN, where eager on the CPU records every one
    table = type(random_table(3, seed=0))(**{**random_table(3, seed=0).__dict__, "name": "gelu"})

    def f(x):
        return ops.pointwise(x * 1.0, table, "gelu")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for nnan in [0, 3, nf.CAPACITY + 1]:
        x = torch.randn(3000, device=device)
        x[:nnan] = math.nan
        x[nnan: nnan + 2] = torch.tensor([math.inf, -math.inf], device=device)
        a = x.clone().requires_grad_(True)
        b = x.clone().requires_grad_(True)
        compiled(a).sum().backward()
        f(b).sum().backward()
        if nnan <= nf.CAPACITY:
            assert bits_equal(a.grad, b.grad), nnan
    assert a.grad.isnan().all()
    if torch.device(device).type == "cpu":
        assert b.grad[nnan + 2:].isfinite().all()  # GELU's gradient is NaN at NaN and inf only


def test_eager_cpu_records_every_nonfinite_input():
    """A masked sigmoid gate (``masked_fill(mask, -inf)``) with more than 1024 masked
    elements: the CPU eager record was capped at 1024 as on CUDA, and the whole gradient
    was NaN where torch's is finite (0 at -inf)."""
    x = torch.randn(4, 1000)
    x[:, :300] = -math.inf
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    fewbit.functional.sigmoid(a, bits=3).sum().backward()
    torch.sigmoid(b).sum().backward()
    assert torch.equal(a.grad[:, :300], b.grad[:, :300])  # torch's 0
    assert a.grad.isfinite().all()


def test_compile_cold_caches_no_graph_break():
    # First call of a setting inside torch.compile: the rules (torch autograd probes) and
    # the table/patch tensors are prepared once, eagerly, as a constant of the trace.
    from fewbit.ops import _pointwise

    table = random_table(3, seed=12345)
    table = type(table)(**{**table.__dict__, "name": "silu"})
    lin = torch.nn.Linear(6, 6)

    def f(x):
        return lin(ops.pointwise(lin(x), table, "silu")).sum()

    torch._dynamo.reset()
    assert not any(k[3] == table.borders for k in _pointwise._prepared)
    explained = torch._dynamo.explain(f)(torch.randn(2, 6))
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


@pytest.mark.parametrize("shape", [(3, 5), (0, 4), "noncontig"])
def test_opcheck_nonfinite_ops(shape, device):
    table = random_table(3, seed=7)
    b, c, v = ops.table_tensors(table, device, torch.float32)
    x = torch.randn(7, 9, device=device).t() if shape == "noncontig" else torch.randn(shape, device=device)
    if x.numel():
        x[0, 0] = math.nan
    torch.library.opcheck(torch.ops.fewbit.encode_nonfinite.default, (x, b, c, 3, 7, 8))
    packed, rec = torch.ops.fewbit.encode_nonfinite(x, b, c, 3, 7, 8)
    g = torch.randn(9, 7, device=device).t() if shape == "noncontig" else torch.randn(shape, device=device)
    patch = torch.randn(24, device=device)
    torch.library.opcheck(torch.ops.fewbit.decode_mul.default, (g, packed, v, 3, rec, patch, True))


def test_op_argument_errors():
    table = random_table(2)
    b, c, v = ops.table_tensors(table, "cpu", torch.float32)
    with pytest.raises(ValueError, match="classes must be a class mask in 0..7, got 8"):
        torch.ops.fewbit.encode_nonfinite(torch.randn(3), b, c, 2, 8, 4)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        torch.ops.fewbit.encode_nonfinite(torch.randn(3), b, c, 2, 1, -1)
    packed = ops.encode(torch.randn(3), table)
    with pytest.raises(ValueError, match="given together"):
        torch.ops.fewbit.decode_mul(torch.randn(3), packed, v, 2, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="patch must be floating with 24"):
        torch.ops.fewbit.decode_mul(torch.randn(3), packed, v, 2, torch.zeros(1, dtype=torch.int64), torch.zeros(3))


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_vmap_rules_match_per_sample_ops(bits):
    table = random_table(bits, seed=bits)
    b, c, v = ops.table_tensors(table, "cpu", torch.float32)
    X = _with_nonfinite(table, torch.float32, 5 * 13, seed=1).reshape(5, 13)  # 13 * bits % 8 != 0
    P = torch.vmap(lambda x: torch.ops.fewbit.encode(x, b, c, bits))(X)
    for i in range(5):
        assert torch.equal(P[i], ops.encode_reference(X[i], table.borders, table.codes, bits))
    Pn, R = torch.vmap(lambda x: torch.ops.fewbit.encode_nonfinite(x, b, c, bits, 7, 4))(X)
    for i in range(5):
        assert torch.equal(R[i], nf.nonfinite_record_reference(X[i], 7, 4)) and torch.equal(Pn[i], P[i])
    G = torch.randn(5, 13)
    patch = torch.randn(24)
    out = torch.vmap(lambda g, p: torch.ops.fewbit.decode_mul(g, p, v, bits, None, None, True))(G, P)
    outr = torch.vmap(lambda g, p, r: torch.ops.fewbit.decode_mul(g, p, v, bits, r, patch, False))(G, P, R)
    shared = torch.vmap(lambda g: torch.ops.fewbit.decode_mul(g, P[0], v, bits))(G)  # codes not batched
    for i in range(5):
        assert bits_equal(out[i], ops.decode_mul_reference(G[i], P[i], table.values, bits, select_zero=True))
        assert bits_equal(outr[i], ops.decode_mul_reference(G[i], P[i], table.values, bits,
                                                            nonfinite=R[i], patch=patch))
        assert bits_equal(shared[i], ops.decode_mul_reference(G[i], P[0], table.values, bits))
    assert packed_nbytes(13, bits) == P.shape[1]


def test_inplace_nan_inputs_record_from_input():
    # codes and the record come from x before the in-place write
    leaf = torch.tensor([0.5, math.nan, -2.0, math.inf] * 8, requires_grad=True)
    h = leaf * 1.0
    y = ops.pointwise(h, exact_table("hardshrink"), "hardshrink", inplace=True)
    assert y is h
    g = torch.tensor([math.nan, 1.0, -1.0, 2.0] * 8)
    y.backward(g)
    x2 = leaf.detach().clone().requires_grad_(True)
    F.hardshrink(x2).backward(g)
    assert bits_equal(leaf.grad, x2.grad)
