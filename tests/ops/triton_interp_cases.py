"""Triton kernel cases; run by test_ops_triton.py in a subprocess with TRITON_INTERPRET=1
(the variable must be set before triton is imported), on CPU tensors. Not collected by
the main suite (the file name does not start with test_)."""

from __future__ import annotations

import os

import pytest
import torch

import fewbit.ops as ops
from fewbit.packing import packed_nbytes

from ops_testutils import DTYPES, bits_equal, hard_inputs, random_table

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
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
