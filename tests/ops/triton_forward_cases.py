"""Fused forward (``fewbit.ops._triton.forward_encode_triton``) under TRITON_INTERPRET=1 on
CPU tensors; run by tests/ops/test_triton_forward.py in a subprocess (the variable must be
set before triton is imported). Not collected by the main suite (no ``test_`` prefix)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fewbit.ops as ops
from fewbit.ops import _nonfinite as nf
from fewbit.packing import packed_nbytes

from ops_testutils import DTYPES, bits_equal, hard_inputs, random_table

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from interp_strict import strict_scalar_index  # noqa: E402

strict_scalar_index()
from fewbit.ops import _triton  # noqa: E402

TORCH_FN = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
FNS = sorted(_triton.FUSED_FORWARD)
LOW = [torch.float32, torch.float16, torch.bfloat16]  # computed in float32


def _cuda_formula(x: torch.Tensor, fn: str) -> torch.Tensor:
    """torch's CUDA formula for ``fn`` (ActivationGeluKernel.cu, ActivationSiluKernel.cu) in
    float32 for float16/bfloat16/float32, every operation rounded to float32, with correctly
    rounded erf/tanh/exp (float64, rounded) and nvcc's one contraction (gelu_tanh's
    ``x + kKappa * x_cube``) as a single rounding; the result rounded to ``x.dtype``."""
    f, d = torch.float32, torch.float64
    xc = x.to(f)
    if fn == "gelu":
        alpha = torch.tensor(0.70710678118654752440, dtype=d).to(f)
        y = (xc * 0.5) * (1 + torch.erf((xc * alpha).to(d)).to(f))
    elif fn == "gelu_tanh":
        beta = torch.tensor(1.41421356237309504880 * 1.12837916709551257390 * 0.5, dtype=d).to(f)
        kappa = torch.tensor(0.044715, dtype=d).to(f)
        x_cube = xc * xc * xc
        inner = beta * (kappa.to(d) * x_cube.to(d) + xc.to(d)).to(f)  # fma: exact product, one rounding
        y = (0.5 * xc) * (1 + torch.tanh(inner.to(d)).to(f))
    else:
        y = xc / (1 + torch.exp((-xc).to(d)).to(f))
    return y.to(x.dtype)


def _inputs(dtype, n, seed=0):
    """Random values over the range where the functions bend, plus the values that test the
    edges: +-0, +-inf, NaN, subnormals, the largest finite, and the saturated tails."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    fi = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), fi.tiny, -fi.tiny,
                            fi.tiny / 4, -fi.tiny / 4, fi.max, -fi.max, 30.0, -30.0, 90.0, -90.0, 1e-30, -1e-30],
                           dtype=torch.float64).to(dtype)
    k = min(n, special.numel())
    x[torch.randperm(n, generator=g)[:k]] = special[:k]
    return x


def _table(bits, dtype, mirrored=False, seed=1):
    table = random_table(bits, seed=seed, mirrored=mirrored)
    return (table, *ops.table_tensors(table, "cpu", dtype))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("fn", FNS)
def test_y_bit_exact_to_the_cuda_formula(fn, dtype):
    """float32/float16/bfloat16: y equals torch's CUDA formula evaluated in float32 with
    correctly rounded erf/tanh/exp, bit for bit (what the interpreter evaluates; on a GPU
    the functions are CUDA's own, as in torch's kernel)."""
    table, b, c, _ = _table(3, dtype)
    x = _inputs(dtype, 8191)
    y, packed, rec = _triton.forward_encode_triton(x, b, c, 3, 0, 0, fn, {})
    assert rec is None and y.dtype == dtype and y.shape == x.shape
    assert bits_equal(y, _cuda_formula(x, fn))
    assert torch.equal(packed, ops.encode_reference(x, table.borders, table.codes, 3))


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype at ``|t|`` (float64 tensor)."""
    a = t.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", FNS)
def test_y_close_to_torch_cpu(fn, dtype):
    """Against torch's own CPU function, which has other erf/tanh/exp (vectorised
    approximations): ``|y - y_torch| <= ulp(y_torch) + 0.5 |x| * 4 eps`` (eps of the compute
    dtype, float32 or float64), i.e. 1 ulp of the result plus 4 ulp of the function value
    near 1, which ``1 + erf``/``1 + tanh`` carry into y where they cancel (x << 0); silu
    stays within 2 ulp. Same NaN and infinity positions, signed zeros included where y is 0."""
    _, b, c, _ = _table(3, dtype)
    x = _inputs(dtype, 8191, seed=1)
    y = _triton.forward_encode_triton(x, b, c, 3, 0, 0, fn, {})[0]
    expect = TORCH_FN[fn](x)
    # torch's vectorised CPU GELU turns +inf into NaN and the largest finite x into +inf on
    # some CPUs (AVX-512 builds; it multiplies in another order); its scalar path gives +inf
    # at +inf, and the CUDA formula, like the kernel, x itself near the top of the range
    # (test_y_bit_exact_to_the_cuda_formula covers those): +-inf against the scalar path,
    # the top of the range (|x| >= max / 4) left out here
    inf = torch.isinf(x)
    if bool(inf.any()):
        expect[inf] = torch.cat([TORCH_FN[fn](v.reshape(1)) for v in x[inf]])
    top = torch.isfinite(x) & (x.abs() >= torch.finfo(x.dtype).max / 4)
    # and where y is subnormal in float32 (|x| < 2 * tiny): some builds flush it to zero
    sub = (x != 0) & (x.abs() < 2 * torch.finfo(torch.float32).tiny)
    keep = ~(top | sub)
    x, y, expect = x[keep], y[keep], expect[keep]
    assert torch.equal(y.isnan(), expect.isnan()) and torch.equal(y.isinf(), expect.isinf())
    fin = torch.isfinite(expect)
    assert torch.equal(y[~fin & ~expect.isnan()], expect[~fin & ~expect.isnan()])
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    err = (y[fin].double() - expect[fin].double()).abs()
    xa = x[fin].double().abs().clamp(max=1e6)
    if fn == "silu":
        bound = 2 * _ulp(expect[fin])
    else:
        bound = _ulp(expect[fin]) + 0.5 * xa * 4 * eps
    bad = err > bound
    assert not bad.any(), (x[fin][bad][:5], y[fin][bad][:5], expect[fin][bad][:5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_codes_bit_exact_every_width(bits, dtype):
    """The packed codes equal the reference's for every width 1..8, identity and mirrored
    code maps, sizes that are not multiples of 8 or of the block, several programs."""
    cases = [(False, n) for n in (0, 1, 7, 4097)] + [(True, 1023)]  # mirrored: 2**(b+1) - 1 intervals
    for mirrored, n in cases:
        table, b, c, _ = _table(bits, dtype, mirrored=mirrored, seed=bits)
        x = hard_inputs(table, dtype, n, seed=n)
        blk = 64 if n == 4097 and bits <= 4 else None  # several programs (64 groups each)
        y, packed, _ = _triton.forward_encode_triton(x, b, c, bits, 0, 0, FNS[bits % len(FNS)], {}, block=blk)
        assert packed.shape == (packed_nbytes(n, bits),) and y.shape == (n,)
        assert torch.equal(packed, ops.encode_reference(x, table.borders, table.codes, bits)), (mirrored, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", FNS)
def test_inplace_and_out(fn, dtype):
    """``out=x`` writes y into x, with the codes of the x read before; ``out=`` another
    tensor fills it; both equal the out-of-place result. Non-contiguous x: a copy is read."""
    table, b, c, _ = _table(4, dtype)
    x = _inputs(dtype, 3 * 1001, seed=2).reshape(3, 1001)
    y, packed, _ = _triton.forward_encode_triton(x, b, c, 4, 0, 0, fn, {}, block=32)
    ref = ops.encode_reference(x, table.borders, table.codes, 4)
    assert torch.equal(packed, ref) and y.shape == x.shape
    xi = x.clone()
    yi, packed_i, _ = _triton.forward_encode_triton(xi, b, c, 4, 0, 0, fn, {}, out=xi, block=32)
    assert yi is xi and bits_equal(xi, y) and torch.equal(packed_i, ref)
    o = torch.empty_like(x)
    yo = _triton.forward_encode_triton(x, b, c, 4, 0, 0, fn, {}, out=o)[0]
    assert yo is o and bits_equal(o, y)
    xt = x.t()  # non-contiguous input
    yt, packed_t, _ = _triton.forward_encode_triton(xt, b, c, 4, 0, 0, fn, {})
    assert bits_equal(yt, y.t()) and torch.equal(packed_t, ops.encode_reference(xt, table.borders, table.codes, 4))


def _with_nonfinite(table, dtype, n, seed, k=25):
    x = hard_inputs(table, dtype, n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = min(n, k)
    x[torch.randperm(n, generator=g)[:k]] = torch.tensor(nf._X_OF_CLASS * k, dtype=torch.float64)[:k].to(dtype)
    return x


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("classes", [1, 6, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_record_as_encode_nonfinite(dtype, classes, inplace):
    """The record has the count and the entries of encode_nonfinite_triton's (entries in the
    order of the programs' atomics: compared as sets), past capacity too; in place as well."""
    table, b, c, _ = _table(3, dtype, seed=5)
    for n in (0, 7, 4097):
        x = _with_nonfinite(table, dtype, n, seed=n)
        for cap in (0, 4, 64):
            p0, r0 = _triton.encode_nonfinite_triton(x, b, c, 3, classes, cap, block=64)
            xi = x.clone()
            y, p1, r1 = _triton.forward_encode_triton(xi, b, c, 3, classes, cap, "gelu", {},
                                                      out=xi if inplace else None, block=64)
            assert torch.equal(p1, p0) and r1.shape == (1 + cap,) and int(r1[0]) == int(r0[0])
            k = min(int(r0[0]), cap)
            assert torch.equal(r1[1:1 + k].sort().values, r0[1:1 + k].sort().values) or int(r0[0]) > cap
            if int(r0[0]) > cap:  # distinct entries of the full set
                full = nf.nonfinite_record_reference(x, classes, n)
                assert r1[1:1 + k].unique().numel() == k and bool(torch.isin(r1[1:1 + k], full[1:]).all())
            assert not r1[1 + k:].any()
            if dtype in LOW:
                assert bits_equal(y, _cuda_formula(x, "gelu"))


def test_arguments_checked():
    _, b, c, _ = _table(2, torch.float32)
    x = torch.randn(100)
    with pytest.raises(ValueError, match="fn must be one of"):
        _triton.forward_encode_triton(x, b, c, 2, 0, 0, "elu", {})
    with pytest.raises(ValueError, match="no parameters"):
        _triton.forward_encode_triton(x, b, c, 2, 0, 0, "gelu", {"approximate": 1.0})
    for out in (torch.empty(99), torch.empty(100, dtype=torch.float64), torch.empty(200)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            _triton.forward_encode_triton(x, b, c, 2, 0, 0, "gelu", {}, out=out)


@pytest.mark.parametrize("classes", [0, 7])
def test_triton_ops(classes):
    """``fewbit::forward_encode_triton`` (functional) and ``fewbit::forward_encode_triton_``
    (writes y into x) give the launcher's results; the record is ``(0,)`` for classes 0."""
    table, b, c, _ = _table(3, torch.bfloat16)
    x = _with_nonfinite(table, torch.bfloat16, 4099, seed=3)
    y0, p0, r0 = _triton.forward_encode_triton(x, b, c, 3, classes, 64, "silu", {})
    y, p, r = torch.ops.fewbit.forward_encode_triton(x, b, c, 3, classes, 64, "silu", [])
    assert bits_equal(y, y0) and torch.equal(p, p0)
    assert r.shape == ((0,) if classes == 0 else (65,))
    if classes:
        assert torch.equal(r.sort().values, r0.sort().values)
    xi = x.clone()
    p2, r2 = torch.ops.fewbit.forward_encode_triton_(xi, b, c, 3, classes, 64, "silu", [])
    assert bits_equal(xi, y0) and torch.equal(p2, p0) and r2.shape == r.shape
    with pytest.raises(ValueError, match="no parameters"):
        torch.ops.fewbit.forward_encode_triton(x, b, c, 3, classes, 64, "silu", [1.0])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fn", ["gelu", "silu"])
def test_eager_node_codes_dense_layouts_in_memory_order(monkeypatch, fn, inplace):
    """The Triton branch of the eager node on a channels_last input (its memory-order
    coding, fewbit.ops._pointwise._memory_order): the fused forward writes y in the input's
    layout, and the gradient equals that of the contiguous copy, in the input's layout."""
    import fewbit.ops._pointwise as pw
    from fewbit.functional import load_table

    monkeypatch.setattr(pw, "_plan", lambda table, name, full, dtype, device, torch_fn=None: pw._Plan(
        table, name, full, dtype, device, "triton", torch_fn))
    table = load_table(fn, 3)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 4, 6, generator=gen).contiguous(memory_format=torch.channels_last)
    g = torch.empty_like(base).copy_(torch.randn(base.shape, generator=gen))
    grads = []
    for x0 in (base, base.contiguous()):
        leaf = x0.clone(memory_format=torch.preserve_format).requires_grad_()
        x = leaf * 1.0 if inplace else leaf
        y = pw.pointwise(x, table, fn, inplace=inplace)
        assert y.stride() == getattr(F, fn)(leaf.detach()).stride()
        (gx,) = torch.autograd.grad(y, leaf, g)
        grads.append(gx)
    assert grads[0].stride() == base.stride() and torch.equal(grads[0], grads[1])
