"""Triton kernel cases; run by test_ops_triton.py in a subprocess with TRITON_INTERPRET=1
(the variable must be set before triton is imported), on CPU tensors. Not collected by
the main suite (the file name does not start with test_)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import fewbit.ops as ops
from fewbit.packing import packed_nbytes

from ops_testutils import DTYPES, bits_equal, hard_inputs, random_table

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from interp_strict import strict_scalar_index  # noqa: E402

strict_scalar_index()
from fewbit.ops import _triton  # noqa: E402

SIZES = [0, 1, 7, 1023, 4097]


@pytest.mark.parametrize("mirrored", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_decode_bit_exact(bits, dtype, mirrored):
    table = random_table(bits, seed=bits, mirrored=mirrored)
    b, c, v = ops.table_tensors(table, "cpu", dtype)
    for n in SIZES:
        x = hard_inputs(table, dtype, n, seed=n)
        ref = ops.encode_reference(x, table.borders, table.codes, bits)
        got = _triton.encode_triton(x, b, c, bits)
        assert got.shape == (packed_nbytes(n, bits),)
        assert torch.equal(got, ref), f"encode n={n}"
        g = torch.randn(n, dtype=torch.float64).to(dtype)
        if n > 8:
            g[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
        got_g = _triton.decode_mul_triton(g, ref, v, bits)
        assert bits_equal(got_g, ops.decode_mul_reference(g, ref, table.values, bits)), f"decode n={n}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_larger_size_default_block(dtype):
    table = random_table(3, seed=4)
    b, c, v = ops.table_tensors(table, "cpu", dtype)
    x = hard_inputs(table, dtype, 2**14 + 3, seed=5)
    ref = ops.encode_reference(x, table.borders, table.codes, 3)
    assert torch.equal(_triton.encode_triton(x, b, c, 3), ref)
    g = torch.randn(2**14 + 3).to(dtype)
    assert bits_equal(_triton.decode_mul_triton(g, ref, v, 3),
                      ops.decode_mul_reference(g, ref, table.values, 3))


@pytest.mark.parametrize("bits", [3, 8])
def test_small_blocks_many_programs(bits):
    # Tails and program boundaries: 16 groups (128 elements) per program.
    table = random_table(bits, seed=1)
    b, c, v = ops.table_tensors(table, "cpu", torch.float32)
    x = hard_inputs(table, torch.float32, 1021, seed=3)
    ref = ops.encode_reference(x, table.borders, table.codes, bits)
    assert torch.equal(_triton.encode_triton(x, b, c, bits, block=16), ref)
    g = torch.randn(1021)
    assert bits_equal(_triton.decode_mul_triton(g, ref, v, bits, block=16),
                      ops.decode_mul_reference(g, ref, table.values, bits))


def test_float64_borders_rounded_for_float32_input():
    # The op also accepts float64 borders for float32 input (rounded down per call).
    table = random_table(4, seed=2)
    x = hard_inputs(table, torch.bfloat16, 999)
    b64 = torch.tensor(table.borders, dtype=torch.float64)
    got = _triton.encode_triton(x, ops.round_down_to_float32(b64), torch.tensor(table.codes), 4)
    assert torch.equal(got, ops.encode_reference(x, table.borders, table.codes, 4))


def test_single_interval_table():
    from fewbit.table import Table

    t = Table("custom", 2, borders=[], codes=[3], values=[0.0, 1.0, 2.0, 3.0])
    b, c, v = ops.table_tensors(t, "cpu", torch.float32)
    x = torch.randn(1001)
    x[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    assert torch.equal(_triton.encode_triton(x, b, c, 2), ops.encode_reference(x, [], [3], 2))


# --------------------------------------------------------------------------- non-finite inputs
from fewbit.ops import _nonfinite as nf  # noqa: E402


def _with_nonfinite(table, dtype, n, seed, k=25):
    x = hard_inputs(table, dtype, n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = min(n, k)
    pos = torch.randperm(n, generator=g)[:k]
    x[pos] = torch.tensor(nf._X_OF_CLASS * k, dtype=torch.float64)[:k].to(dtype)
    return x


@pytest.mark.parametrize("block", [64, None])  # 64 groups: several programs append
@pytest.mark.parametrize("classes", [1, 6, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_nonfinite_record(dtype, classes, block):
    table = random_table(3, seed=5)
    b, c, _ = ops.table_tensors(table, "cpu", dtype)
    for n in [0, 7, 1023, 4097]:
        x = _with_nonfinite(table, dtype, n, seed=n)
        full = nf.nonfinite_record_reference(x, classes, n)
        for cap in [0, 4, 64]:
            packed, rec = _triton.encode_nonfinite_triton(x, b, c, 3, classes, cap, block=block)
            assert torch.equal(packed, ops.encode_reference(x, table.borders, table.codes, 3))
            count = int(full[0])
            assert int(rec[0]) == count and rec.shape == (1 + cap,)
            k = min(count, cap)
            got = rec[1 : 1 + k]
            if count <= cap:  # the same entries, in an order of the programs' atomics
                assert torch.equal(got.sort().values, full[1 : 1 + count])
            else:  # distinct entries of the full set
                assert got.unique().numel() == k and bool(torch.isin(got, full[1:]).all())
            assert not rec[1 + k:].any()


@pytest.mark.parametrize("select_zero", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_with_record_and_select(dtype, select_zero):
    table = random_table(2, seed=6)
    table = type(table)(**{**table.__dict__, "values": (0.0, *table.values[1:])})
    b, c, v = ops.table_tensors(table, "cpu", dtype)
    cdt = ops.compute_dtype(dtype)
    gen = torch.Generator().manual_seed(1)
    for n in [9, 1023, 4097]:
        x = _with_nonfinite(table, dtype, n, seed=n)
        packed, _ = _triton.encode_nonfinite_triton(x, b, c, 2, 7, 64, block=64)
        g = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        g[::4] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=dtype).repeat(n)[: g[::4].numel()]
        patch = torch.randn(24, generator=gen, dtype=torch.float64).to(cdt)
        patch[0::8] = torch.tensor([1.0, 0.0, 0.0], dtype=cdt)
        patch[7::8] = torch.tensor([1.0, 1.0, 0.0], dtype=cdt)
        for cap in [0, 5, 64]:
            rec = nf.nonfinite_record_reference(x, 7, cap)
            got = _triton.decode_mul_triton(g, packed, v, 2, nonfinite=rec, patch=patch,
                                            select_zero=select_zero, block=32)
            ref = ops.decode_mul_reference(g, packed, table.values, 2, select_zero=select_zero,
                                           nonfinite=rec, patch=patch)
            assert bits_equal(got, ref), (n, cap)


def _pipeline_cases():
    from fewbit.activations import ACTIVATIONS

    every = [(n, {}, dt) for n in sorted(ACTIVATIONS) for dt in (torch.float32, torch.bfloat16)]
    extra = [(n, p, dt) for n, p in [("selu", {}), ("hardshrink", {}), ("leaky_relu", {"negative_slope": 0.2})]
             for dt in (torch.float64, torch.float16)]
    return every + extra


@pytest.mark.parametrize("name,params,dtype", _pipeline_cases(), ids=str)
def test_cuda_pipeline_gives_torch_gradient(name, params, dtype):
    # The CUDA path (Triton encode with a fixed-capacity record, Triton decode with the
    # patch and the select) on CPU tensors, with the rules torch's CPU kernels give.
    from fewbit.activations import exact_table, get_activation
    from fewbit.functional import load_table

    act = get_activation(name)
    full = {**act.defaults, **params}
    table = exact_table(name, full) if act.stepwise else load_table(name, 3)
    rules = nf.derive_grad_rules(act.torch_fn, full, table, dtype, "cpu")
    b, c, v = ops.table_tensors(table, "cpu", dtype)
    x = _with_nonfinite(table, dtype, 2048, seed=2, k=60)
    x[-64:] = 0.5  # torch's own scalar tail differs from its vector body at NaN
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2048, generator=gen, dtype=torch.float64).to(dtype)
    g[::3] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 3.0], dtype=dtype).repeat(2048)[: g[::3].numel()]
    if rules.classes:
        packed, rec = _triton.encode_nonfinite_triton(x, b, c, table.bits, rules.classes, nf.CAPACITY, block=64)
        patch = torch.tensor(rules.patch, dtype=torch.float64).to(v.dtype)
    else:  # nothing to record (the codes are already torch's gradient there)
        packed, rec, patch = _triton.encode_triton(x, b, c, table.bits, block=64), None, None
    got = _triton.decode_mul_triton(g, packed, v, table.bits, nonfinite=rec, patch=patch,
                                    select_zero=rules.select_zero, block=64)
    xl = x.clone().requires_grad_(True)
    (expect,) = torch.autograd.grad(act.torch_fn(xl, **full), xl, g)
    bad = ~torch.isfinite(x)
    assert bits_equal(got[bad], expect[bad])
    if act.stepwise:
        assert bits_equal(got, expect)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_inputs_and_grads(dtype):
    # A border at 0 and inputs/grads one subnormal away (the interpreter's bfloat16 cast
    # flushed subnormals: codes and products must not depend on it).
    from fewbit.activations import exact_table

    table = exact_table("leaky_relu", {"negative_slope": 0.2})
    b, c, v = ops.table_tensors(table, "cpu", dtype)
    tiny = torch.nextafter(torch.zeros(1, dtype=dtype), torch.ones(1, dtype=dtype))
    x = torch.cat([tiny, -tiny, tiny * 5, -tiny * 3, torch.zeros(1, dtype=dtype), torch.randn(1020).to(dtype)])
    ref = ops.encode_reference(x, table.borders, table.codes, 1)
    assert torch.equal(_triton.encode_triton(x, b, c, 1), ref)
    g = x.flip(0).contiguous()
    assert bits_equal(_triton.decode_mul_triton(g, ref, v, 1), ops.decode_mul_reference(g, ref, table.values, 1))


@pytest.mark.parametrize("bits", [3, 8])
def test_the_byte_count_of_a_large_tensor_does_not_wrap(bits):
    """The packers' in-kernel byte count ``n * BITS`` was int32 for n < 2**31: from n =
    2**31 / BITS (2**28 elements at 8 bits) it wrapped negative, every store and load was
    masked off, and the codes were never written (the decoder read 0s: a gradient of
    ``grad * values[0]`` everywhere; review h74). One program of a small buffer, told that
    n is that large: all its elements are valid, so it must write and read them."""
    block = 4  # 4 groups of 8: 32 elements in program 0
    x = torch.linspace(-3, 3, block * 8)
    borders = torch.linspace(-2.5, 2.5, (1 << bits) - 1)
    codes = torch.arange(1 << bits, dtype=torch.int32)
    ref = _triton.encode_triton(x, borders, codes, bits, block=block)  # the true n = 32
    n = -(-(2**31) // bits)
    out = torch.full_like(ref, 0xAA)
    _triton._forward_encode_kernel[(1,)](x, x, borders, codes, out, codes, n, 0, FN=-1, NB=borders.numel(),
                                         BITS=bits, BLOCK=block, IS_F64=False, OUT_BF16=False, CLASSES=0,
                                         INTERPRET=True)
    assert torch.equal(out, ref)
    values = torch.arange(1 << bits, dtype=torch.float32)
    got = torch.empty(block * 8)
    _triton._decode_mul_kernel[(1,)](torch.ones(block * 8), ref, values, got, ref, values, n, 0, BITS=bits,
                                     BLOCK=block, IS_F64=False, OUT_BF16=False, HAS_REC=False, SELECT_ZERO=False,
                                     PB=1 << bits, N_PB=0)
    assert torch.equal(got, ops.decode_mul_reference(torch.ones(block * 8), ref, values, bits))
