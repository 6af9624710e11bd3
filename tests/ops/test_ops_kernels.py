"""fewbit::encode / fewbit::decode_mul kernels against the pure-torch references (atol=0)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fewbit.ops as ops
from fewbit.activations import ACTIVATIONS, exact_table
from fewbit.packing import packed_nbytes, unpack_reference
from fewbit.table import Table

from ops_testutils import DTYPES, SIZES, bits_equal, hard_inputs, random_table


def _dtype_id(dt):
    return str(dt).replace("torch.", "")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_encode_bit_exact_every_bits(device, bits, dtype):
    table = random_table(bits, seed=bits)
    for n in SIZES:
        x = hard_inputs(table, dtype, n, seed=n).to(device)
        got = ops.encode(x, table)
        ref = ops.encode_reference(x, table.borders, table.codes, bits)
        assert got.dtype == torch.uint8 and got.shape == (packed_nbytes(n, bits),)
        assert torch.equal(got.cpu(), ref.cpu()), f"n={n}"


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_encode_mirrored_code_map(device, bits, dtype):
    # 2**(bits+1) - 1 intervals share 2**bits codes (parity trick); 8 bits uses the
    # branch-free binary search path on CPU (510 borders).
    table = random_table(bits, mirrored=True, seed=10 + bits)
    x = hard_inputs(table, dtype, 4097, seed=bits).to(device)
    ref = ops.encode_reference(x, table.borders, table.codes, bits)
    assert torch.equal(ops.encode(x, table).cpu(), ref.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_encode_non_contiguous_and_shapes(device, dtype):
    table = random_table(3, seed=3)
    base = hard_inputs(table, dtype, 9 * 13 * 2, seed=1).reshape(9, 13, 2).to(device)
    for view in [base.transpose(0, 1), base[:, ::2, 1], base[..., 0].t(), base[3, 4, 1]]:
        assert not view.is_contiguous() or view.dim() == 0
        ref = ops.encode_reference(view.contiguous(), table.borders, table.codes, 3)
        assert torch.equal(ops.encode(view, table).cpu(), ref.cpu())


def test_border_rounding_is_exact():
    # Borders between two float32 neighbours: compare in float32 against borders rounded
    # down must equal the float64 searchsorted, also for values just above/below.
    b64 = torch.tensor([0.1, 1 / 3, -2.7, 1e-40, 3.4e38 * 1.5, -3.4e38 * 1.5], dtype=torch.float64)
    b64 = torch.sort(b64).values
    b32 = ops.round_down_to_float32(b64)
    assert b32.dtype == torch.float32
    assert bool((b32.double() <= b64).all())
    up = torch.nextafter(b32, torch.full_like(b32, float("inf")))
    assert bool((up.double() > b64).all())
    table = Table("custom", 3, borders=b64.tolist(), codes=range(7), values=[0.0] * 8)
    x = torch.cat([b32, up, torch.nextafter(b32, torch.full_like(b32, float("-inf"))),
                   torch.tensor([float("nan"), float("inf"), float("-inf")])])
    x = x[torch.isfinite(x) | x.isnan() | x.isinf()]
    assert torch.equal(ops.encode(x, table), ops.encode_reference(x, b64, table.codes, 3))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_decode_mul_bit_exact(device, bits, dtype):
    table = random_table(bits, seed=bits)
    values = ops.table_tensors(table, device, dtype)[2]
    for n in SIZES:
        g = torch.randn(n, dtype=torch.float64).to(dtype)
        if n > 8:
            g[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=dtype)
        packed = torch.randint(0, 256, (packed_nbytes(n, bits),), dtype=torch.uint8)
        g, packed = g.to(device), packed.to(device)
        got = ops.decode_mul(g, packed, table)
        ref = ops.decode_mul_reference(g.cpu(), packed.cpu(), table.values, bits)
        assert got.dtype == dtype and got.shape == g.shape
        assert bits_equal(got.cpu(), ref), f"n={n}"


def test_decode_mul_rounding_definition():
    # fp16/bf16: one float32 multiply then one rounding to nearest even.
    table = Table("custom", 1, borders=[0.0], codes=[0, 1], values=[1 / 3, 0.7])
    g = torch.randn(4099, dtype=torch.float64)
    packed = ops.encode(g.float(), table)
    code = unpack_reference(packed, 1, g.numel())
    for dtype in (torch.float16, torch.bfloat16):
        gd = g.to(dtype)
        expect = (gd.float() * torch.tensor([1 / 3, 0.7], dtype=torch.float64).float()[code]).to(dtype)
        assert bits_equal(ops.decode_mul(gd, packed, table), expect)
    expect64 = g * torch.tensor([1 / 3, 0.7], dtype=torch.float64)[code]
    assert bits_equal(ops.decode_mul(g, packed, table), expect64)


def test_decode_mul_shape_and_non_contiguous_grad():
    table = random_table(4, seed=4)
    x = torch.randn(6, 10)
    packed = ops.encode(x, table)
    g = torch.randn(10, 6).t()
    got = ops.decode_mul(g, packed, table)
    assert got.shape == (6, 10) and got.is_contiguous()
    assert bits_equal(got, ops.decode_mul_reference(g, packed, table.values, 4))
    scalar = ops.decode_mul(torch.tensor(2.0), ops.encode(torch.tensor(0.5), table), table)
    assert scalar.shape == ()


@pytest.mark.parametrize("name", sorted(n for n, a in ACTIVATIONS.items() if a.stepwise))
def test_exact_tables_give_torch_gradient(name):
    # Stepwise derivatives: the 1-bit table is exact, so the few-bit backward equals
    # torch's own backward bit for bit, borders included.
    table = exact_table(name)
    pts = torch.tensor([0.0, -0.0, 6.0, -3.0, 3.0, 1.0, -1.0, 0.5, -0.5, 0.01, -0.01])
    x = torch.cat([pts, torch.randn(1000) * 4]).requires_grad_()
    y = ACTIVATIONS[name].torch_fn(x, **ACTIVATIONS[name].defaults)
    g = torch.randn_like(x)
    (expect,) = torch.autograd.grad(y, x, g)
    got = ops.decode_mul(g, ops.encode(x.detach(), table), table)
    assert torch.equal(got, expect)  # values equal; torch masks to +0.0 where we give g * 0.0


def test_meta_and_reference_backends():
    table = random_table(3, seed=5)
    b, c, v = ops.table_tensors(table, "cpu", torch.float32)
    xm = torch.empty(5, 7, device="meta")
    assert torch.ops.fewbit.encode(xm, b.to("meta"), c.to("meta"), 3).shape == (packed_nbytes(35, 3),)
    # The default (reference) kernel used for devices without their own backend.
    from fewbit.ops import _ops

    x = hard_inputs(table, torch.bfloat16, 1023)
    assert torch.equal(_ops._encode_reference_path(x, b, c, 3),
                       ops.encode_reference(x, table.borders, table.codes, 3))


def test_errors():
    table = random_table(2)
    with pytest.raises(TypeError, match="input"):
        ops.encode(torch.arange(4), table)
    with pytest.raises(TypeError, match="table"):
        ops.encode(torch.randn(4), {"bits": 2})
    with pytest.raises(TypeError, match="grad_output"):
        ops.decode_mul(torch.arange(4), torch.zeros(1, dtype=torch.uint8), table)
    with pytest.raises(ValueError, match="packed holds 1 bytes, 2 needed"):
        ops.decode_mul(torch.randn(8), torch.zeros(1, dtype=torch.uint8), table)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        torch.ops.fewbit.encode(torch.randn(3), torch.zeros(1), torch.zeros(2, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="float64 for float64 input"):
        torch.ops.fewbit.encode(torch.randn(3, dtype=torch.float64), torch.zeros(1),
                                torch.zeros(2, dtype=torch.int32), 1)


def test_raw_ops_autograd_on_cpu():
    """The CPU kernels are on the dispatcher's CPU key and the encode ops skip the autograd
    kernel there (fewbit.ops._ops): codes of an input that requires grad still come back
    as plain uint8 / int64 tensors, and a backward through the raw decode_mul still raises
    (its differentiable form is fewbit.ops._pointwise.DecodeMul)."""
    table = random_table(3, seed=7)
    b, c, v = ops.table_tensors(table, "cpu", torch.float32)
    x = torch.randn(64, requires_grad=True)
    packed = torch.ops.fewbit.encode(x, b, c, 3)
    assert packed.dtype == torch.uint8 and not packed.requires_grad and packed.grad_fn is None
    assert torch.equal(packed, torch.ops.fewbit.encode(x.detach(), b, c, 3))
    outs = torch.ops.fewbit.encode_nonfinite(x, b, c, 3, 7, 8)
    assert not any(o.requires_grad for o in outs) and torch.equal(outs[0], packed)
    g = torch.randn(64, requires_grad=True)
    out = torch.ops.fewbit.decode_mul(g, packed, v, 3)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 9), (0, 4), "noncontig"])
def test_opcheck(shape, device):
    table = random_table(3, seed=7)
    b, c, v = ops.table_tensors(table, device, torch.float32)
    x = torch.randn(7, 9, device=device).t() if shape == "noncontig" else torch.randn(shape, device=device)
    torch.library.opcheck(torch.ops.fewbit.encode.default, (x, b, c, 3))
    packed = ops.encode(x, table)
    g = torch.randn(9, 7, device=device).t() if shape == "noncontig" else torch.randn(shape, device=device)
    torch.library.opcheck(torch.ops.fewbit.decode_mul.default, (g, packed, v, 3))


@pytest.mark.skipif(os.environ.get("FEWBIT_TEST_LARGE") != "1",
                    reason="allocates ~5 GiB; set FEWBIT_TEST_LARGE=1 to check int64 indexing at numel >= 2**31")
def test_large_numel_int64_indexing(device):
    n = 2**31 + 13
    table = random_table(3, seed=9)
    x = torch.empty(n, dtype=torch.bfloat16, device=device)
    x[: 2**20].normal_()
    x[2**20:].fill_(0.25)
    x[-4096:].normal_()
    packed = ops.encode(x, table)
    assert packed.numel() == packed_nbytes(n, 3)
    start = (n - 4096) // 8 * 8  # group-aligned: byte offset start * 3 / 8
    tail = ops.encode_reference(x[start:].cpu(), table.borders, table.codes, 3)
    assert torch.equal(packed[start * 3 // 8:].cpu(), tail)
    g = torch.ones(n, dtype=torch.bfloat16, device=device)
    out = ops.decode_mul(g, packed, table)
    ref = ops.decode_mul_reference(g[start:].cpu(), tail, table.values, 3)
    assert bits_equal(out[start:].cpu(), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_single_interval_and_unrolled_paddings(dtype):
    # 0 borders (one interval), and border counts that exercise every padding of the
    # unrolled CPU path (1, 3, 7, 15) and the pass-per-border path (16, 31).
    t0 = Table("custom", 2, borders=[], codes=[2], values=[0.0, 1.0, 2.0, 3.0])
    x = hard_inputs(random_table(1), dtype, 1027)
    assert torch.equal(ops.encode(x, t0), ops.encode_reference(x, [], [2], 2))
    for nb in (2, 5, 11, 16, 31):
        g = torch.Generator().manual_seed(nb)
        borders = torch.sort(torch.randn(nb, generator=g, dtype=torch.float64)).values.tolist()
        codes = torch.randint(0, 32, (nb + 1,), generator=g).tolist()
        t = Table("custom", 5, borders=borders, codes=codes, values=[0.0] * 32)
        x = hard_inputs(t, dtype, 4101, seed=nb)
        assert torch.equal(ops.encode(x, t), ops.encode_reference(x, borders, codes, 5)), nb


def test_numba_threads_follow_torch():
    """Calls that run on numba's pool set its threads to torch's (serial calls, at most
    ``_cpu.SERIAL_MAX`` elements, do not touch the pool)."""
    numba = pytest.importorskip("numba")
    from fewbit.ops import _cpu

    n = 4 * (_cpu.SERIAL_MAX + 1)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ops.encode(torch.randn(n), random_table(2))
        assert numba.get_num_threads() == 1
        torch.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        ops.decode_mul(torch.randn(n), torch.zeros(n // 4, dtype=torch.uint8), random_table(2))
        assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(old)
