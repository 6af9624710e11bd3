"""Group quantizer (docs/method.md §7): backends against the pure-torch reference, statistics."""

import math

import pytest
import torch

import fewbit.quant as fq
from fewbit.quant import _reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = [1, 2, 4, 8]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN == NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5)) \
        and torch.equal(a.isnan(), b.isnan())


def _both(x, bits, seed=1, **kw):
    a = fq.quantize(x, bits, generator=torch.Generator().manual_seed(seed), **kw)
    b = fq.quantize_reference(x, bits, generator=torch.Generator().manual_seed(seed), **kw)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("stats_dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernel_bit_exact_vs_reference(dtype, bits, stochastic, stats_dtype):
    x = (torch.randn(3 * 256 + 37) * 3 + 1).to(dtype)
    for group_size in (256, 12, 7):
        a, b = _both(x, bits, group_size=group_size, stochastic=stochastic, stats_dtype=stats_dtype)
        torch.testing.assert_close(a.packed, b.packed, atol=0, rtol=0)
        assert _same(a.mins, b.mins) and _same(a.scales, b.scales)
        assert _same(a.dequantize(), fq.dequantize_reference(b))


@pytest.mark.parametrize("shape", [(0,), (1,), (1023,), (3, 5, 7), (2, 0, 3), (257,), (8,)])
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_odd_shapes(shape, bits):
    for dtype in DTYPES:
        x = torch.randn(shape).to(dtype)
        qt = fq.quantize(x, bits)
        y = qt.dequantize()
        assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
        n = x.numel()
        assert qt.packed.numel() == math.ceil(n * bits / 8)
        assert qt.mins.numel() == math.ceil(n / 256)
        if n:
            # every element within one grid step of the value
            step = 1 / qt.scales.float()
            gidx = torch.arange(n) // 256
            err = (y.double() - x.double()).abs().reshape(-1)
            tol = step[gidx].double() * 1.001 + 2 * x.double().abs().reshape(-1) * torch.finfo(dtype).eps
            assert (err <= tol).all()


def test_nbytes_formula():
    x = torch.randn(10_000)
    for bits in BITS:
        for stats_dtype, item in ((torch.bfloat16, 2), (torch.float32, 4)):
            for g in (256, 100, 1):
                qt = fq.quantize(x, bits, group_size=g, stats_dtype=stats_dtype)
                assert qt.nbytes == math.ceil(10_000 * bits / 8) + 2 * math.ceil(10_000 / g) * item


def test_non_contiguous_input():
    base = torch.randn(64, 96)
    x = base.t()[:, ::2]
    assert not x.is_contiguous()
    a = fq.quantize(x, 4, stochastic=False)
    b = fq.quantize(x.contiguous(), 4, stochastic=False)
    torch.testing.assert_close(a.packed, b.packed, atol=0, rtol=0)
    assert a.dequantize().shape == x.shape


def test_exact_on_grid_and_constant_groups():
    # values already on the grid of a group: m = 0, s = 15 / 15 = 1, x in {0..15}
    x = torch.randint(0, 16, (4096,)).float()
    x[::256] = 0.0
    x[1::256] = 15.0
    for stochastic in (False, True):
        y = fq.quantize(x, 4, stochastic=stochastic).dequantize()
        torch.testing.assert_close(y, x, atol=0, rtol=0)
    # constant groups (max == min): exact, no NaN, for every bits
    c = torch.full((1000,), -3.25)
    c[512:] = 7.0
    for bits in BITS:
        y = fq.quantize(c, bits).dequantize()
        assert not y.isnan().any()
        torch.testing.assert_close(y, c, atol=0, rtol=0)


def test_non_finite_groups_do_not_spread():
    x = torch.randn(1024)
    x[3] = float("nan")
    x[300] = float("inf")
    x[600] = -float("inf")
    qt = fq.quantize(x, 4)
    y = qt.dequantize()
    assert y[:768].isnan().all()  # groups 0, 1, 2 hold a non-finite value
    assert not y[768:].isnan().any()
    assert ((y[768:] - x[768:]).abs() <= 1 / qt.scales[3].float() + 1e-6).all()
    # matches the reference bit for bit
    b = fq.quantize_reference(x, 4, stochastic=False)
    a = fq.quantize(x, 4, stochastic=False)
    torch.testing.assert_close(a.packed, b.packed, atol=0, rtol=0)


def test_stats_rounded_down_cover_range():
    x = torch.randn(256 * 64) * 10
    qt = fq.quantize(x, 4, stochastic=False)
    g = x.view(64, 256)
    m = qt.mins.double()
    s = qt.scales.double()
    assert (m <= g.amin(1).double()).all()
    assert ((g.amax(1).double() - m) * s <= 15 + 1e-9).all()


def test_generator_reproducible_and_seed_dependent():
    x = torch.randn(5000)
    a = fq.quantize(x, 2, generator=torch.Generator().manual_seed(7))
    b = fq.quantize(x, 2, generator=torch.Generator().manual_seed(7))
    c = fq.quantize(x, 2, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.packed, b.packed)
    assert not torch.equal(a.packed, c.packed)


def test_uniform_noise_is_uniform():
    u = ref.uniform_noise(1 << 16, 12345)
    assert u.min() >= 0 and u.max() < 1
    # 16 bins, chi-square with 15 dof: the 1e-4 upper quantile is about 47
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 47, chi2
    # consecutive pairs uncorrelated
    r = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(r) < 4 / math.sqrt(u.numel())


def test_uniform_noise_cpu_kernel_matches_definition_past_2_32():
    """The numba hash is the reference's, also for flat indices >= 2**32 (high index word);
    the Triton one is checked in tests/quant/triton_interp_cases.py."""
    import numpy as np

    from fewbit.quant import _numba

    for base in (0, 2**31 - 4, 2**32 - 4, 3 * 2**32 + 5, 2**40):
        for seed in (0, 123456789012345, 2**64 - 1):
            s0, s1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
            got = torch.tensor([float(_numba._uniform(base + i, s0, s1)) for i in range(8)])
            assert torch.equal(got, ref.uniform_noise(8, seed, start=base)), (base, seed)
    assert not torch.equal(ref.uniform_noise(64, 5), ref.uniform_noise(64, 5, start=2**32))


def test_noise_fill_of_the_codes_loops_matches_definition_across_2_32():
    """``_noise`` (the codes loops' noise, 32-bit lanes up to the next multiple of 2**32 and
    the 64-bit index past it) is the reference's, also for pieces that cross 2**32."""
    import numpy as np

    from fewbit.quant import _numba

    for start in (0, 2**32 - 37, 2**32, 5 * 2**32 - 1, 2**40 + 3):
        for seed in (0, 123456789012345, 2**64 - 1):
            s0, s1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
            out = np.empty(100, np.float32)
            _numba._noise(start, out, s0, s1)
            assert torch.equal(torch.from_numpy(out), ref.uniform_noise(100, seed, start=start)), (start, seed)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unbiased_and_variance(bits):
    """Mean of N stochastic dequantizations converges to x at rate 1/sqrt(N).

    Per element, x_hat = m + q / s with q = floor(t) + Bernoulli(frac(t)): variance
    p (1 - p) / s**2 <= 1 / (4 s**2). The mean over N draws has standard deviation
    sigma / sqrt(N); its normalised error z = (mean - x) sqrt(N) / sigma_bound is bounded
    in magnitude by 6 for every element with overwhelming probability (a 6-sigma bound
    over 4096 elements: the mean of 400 Bernoullis is near normal), and the mean of z**2 is
    <= 1 (the bound is an upper bound of the variance). The RMS error after N/4 draws is
    twice that after N draws (the 1/sqrt(N) rate).
    """
    torch.manual_seed(0)
    x = torch.randn(4096)
    n = 400
    gen = torch.Generator().manual_seed(3)
    acc = torch.zeros(4096, dtype=torch.float64)
    acc2 = torch.zeros(4096, dtype=torch.float64)
    for i in range(n):
        qt = fq.quantize(x, bits, generator=gen)
        y = qt.dequantize().double()
        acc += y
        acc2 += y * y
        if i + 1 == n // 4:
            err_quarter = (acc / (n // 4) - x.double()).pow(2).mean().sqrt()
    s = qt.scales.double()[torch.arange(4096) // 256]
    mean = acc / n
    var = acc2 / n - mean ** 2
    bound = 1 / (4 * s ** 2)
    z = (mean - x.double()) * math.sqrt(n) / bound.sqrt()
    assert z.abs().max() < 6, z.abs().max()
    assert (z ** 2).mean() < 1.1
    # empirical per-element variance within the bound (sampling slack 1.3 for n = 400)
    assert (var <= bound * 1.3 + 1e-12).all()
    # and the global error of the mean shrinks as 1/sqrt(N): compare N/4 draws
    err_n = (mean - x.double()).pow(2).mean().sqrt()
    assert err_n < (bound.mean().sqrt() / math.sqrt(n)) * 1.2
    # 4x the draws halves the RMS error (each RMS over 4096 elements: ~2 % sampling noise)
    assert 1.7 < err_quarter / err_n < 2.3, (err_quarter / err_n).item()


def _sqnr(x, y):
    x = x.double()
    return 20 * torch.log10(x.norm() / (x - y.double()).norm()).item()


# Floors for N(0, 1) data, G = 256: range R ~ 5.5-6 sigma, step D = R / (2**b - 1), noise
# D**2 / 12 (nearest) or up to D**2 / 6 (stochastic, 3 dB worse); about 6 dB per bit.
# 1 bit is below 0 dB: every value goes to the min or the max of its group.
@pytest.mark.parametrize("bits,floors", [(1, (-8.0, -10.0)), (2, (4.0, 1.0)), (4, (18.0, 15.0)), (8, (42.5, 39.5))])
def test_sqnr_floor(bits, floors):
    x = torch.randn(1 << 16)
    for stochastic, floor_db in zip((False, True), floors):
        y = fq.quantize(x, bits, stochastic=stochastic).dequantize()
        assert _sqnr(x, y) > floor_db


def test_errors():
    x = torch.randn(10)
    for bad in (0, 3, 16, 4.0, True):
        with pytest.raises(ValueError, match="bits"):
            fq.quantize(x, bad)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="group_size"):
            fq.quantize(x, 4, group_size=bad)
    with pytest.raises(TypeError, match="floating"):
        fq.quantize(torch.arange(10), 4)
    with pytest.raises(TypeError, match="floating"):
        fq.quantize(torch.ones(3, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match="Tensor"):
        fq.quantize([1.0, 2.0], 4)
    with pytest.raises(TypeError, match="dense"):  # before: torch's "reshape is not implemented"
        fq.quantize(torch.randn(8, 8).to_sparse(), 4)
    with pytest.raises(ValueError, match="stats_dtype"):
        fq.quantize(x, 4, stats_dtype=torch.float16)
    with pytest.raises(TypeError, match="generator"):
        fq.quantize(x, 4, generator=3)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fq.dequantize(x)


def test_requires_grad_input_and_input_untouched():
    x = torch.randn(1000, requires_grad=True)
    before = x.detach().clone()
    y = fq.quantize(x, 4).dequantize()
    assert not y.requires_grad
    assert torch.equal(x.detach(), before)


def test_opcheck(device):
    for args in [
        (torch.randn(3, 5, device=device).reshape(-1), 4, 256, 11, True, torch.bfloat16),
        (torch.randn(1000, device=device), 2, 7, 5, False, torch.float32),
        (torch.randn(0, device=device), 8, 256, 0, False, torch.bfloat16),
    ]:
        torch.library.opcheck(torch.ops.fewbit.group_quantize.default, args)
        p, m, s = torch.ops.fewbit.group_quantize(*args)
        torch.library.opcheck(
            torch.ops.fewbit.group_dequantize.default, (p, m, s, args[1], args[2], args[0].numel(), torch.float32)
        )


def test_lean_import():
    import subprocess
    import sys

    code = (
        "import sys, fewbit, fewbit.quant as q, torch; q.quantize_reference(torch.randn(10), 4);"
        "print('numba' in sys.modules, 'triton' in sys.modules, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


@pytest.mark.parametrize("stats_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1e-300, 1e300])
def test_float64_stats_past_the_stats_range_equal_the_reference(stats_dtype, scale):
    """A float64 group whose scale ``levels / range`` (range 1e-300) or whose minimum (all
    values about 1e300) is past the stats dtype's largest value: the stored stat is that
    largest value, as the reference's floor. Before, the CPU kernel stored an infinite
    scale, and its codes differed from the reference's. The public entry points refuse
    values past float32's largest now (their statistics cannot hold them); the kernels
    still agree."""
    from fewbit.quant import _reference as ref

    x = torch.rand(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scale + scale
    if scale > 1:
        for quant in (fq.quantize, fq.quantize_reference):
            with pytest.raises(ValueError, match="float64 values must be of a magnitude at most float32's largest"):
                quant(x, 2, stats_dtype=stats_dtype)
    seed = 12345
    a = fq.QuantizedTensor(*torch.ops.fewbit.group_quantize(x, 2, 256, seed, True, stats_dtype), x.shape, x.dtype, 2, 256)
    b = fq.QuantizedTensor(*ref.group_quantize_reference(x, 2, 256, seed, True, stats_dtype), x.shape, x.dtype, 2, 256)
    assert torch.equal(a.packed, b.packed)
    for u, v in ((a.mins, b.mins), (a.scales, b.scales)):
        assert torch.equal(u.isnan(), v.isnan()) and torch.equal(u.nan_to_num(), v.nan_to_num())
    if scale < 1:  # the scale is the stats dtype's largest value; for 1e300 both give NaN (scale 0)
        assert torch.equal(a.scales.float(), torch.full((4,), torch.finfo(stats_dtype).max))


def test_float16_near_its_largest_finite_values_decodes_finite():
    """x near -65504: the bfloat16 min, rounded down, is -65536 (-inf in float16); x at
    65504: m + 15 / s went past it. Both decoded to +-inf. The decoded values are clamped
    to float16's finite range, within one step of the input."""
    from fewbit.quant.compressors import get_compressor

    for x in (torch.tensor([-65400.0, 0.0, 1.0, 2.0]), torch.tensor([65504.0, 0.0, 1.0, 2.0]),
              torch.tensor([-65504.0, 65504.0, 3.0, -7.0])):
        x = x.half()
        for decode in (lambda t: fq.quantize(t, 4, stochastic=False).dequantize(),
                       lambda t: fq.dequantize_reference(fq.quantize_reference(t, 4, stochastic=False)),
                       lambda t: get_compressor("group").compress(t).decompress(),
                       lambda t: get_compressor("outlier").compress(t.reshape(1, 4)).decompress().reshape(4)):
            y = decode(x)
            assert y.dtype == torch.float16 and y.isfinite().all(), (x, y)
            assert (y.float() - x.float()).abs().max() <= 65504 * 2 / 15, (x, y)
    nan_group = torch.tensor([float("nan"), 1.0, 2.0, 3.0], dtype=torch.float16)
    assert fq.quantize(nan_group, 4).dequantize().isnan().all()  # a non-finite group stays NaN


@pytest.mark.parametrize("field", ["packed", "mins", "scales", "numel"])
def test_dequantize_refuses_buffers_too_small_for_its_shape(field):
    """A QuantizedTensor built by hand with a shape larger than its buffers: the CPU kernel
    decoded it anyway, reading past the buffers (two calls gave different values)."""
    q = fq.quantize(torch.randn(100), 4, group_size=16)
    parts = dict(packed=q.packed, mins=q.mins, scales=q.scales, shape=q.shape)
    if field == "numel":
        parts["shape"] = torch.Size([2_000_000])
    else:
        parts[field] = parts[field][: parts[field].numel() // 2]
    bad = fq.QuantizedTensor(parts["packed"], parts["mins"], parts["scales"], parts["shape"], torch.float32, 4, 16)
    with pytest.raises(ValueError, match="needed"):
        fq.dequantize(bad)


@pytest.mark.parametrize("value", [1, 0, "no", None, 0.5])
def test_stochastic_must_be_a_bool_at_every_entry_point(value):
    """``quantize(stochastic=1)``, ``compress_activations(stochastic="no")`` and
    ``GroupQuantizer(stochastic=...)`` took any value as its truth value ("no" meant
    stochastic); ``Config`` refused them. One check now, naming the argument."""
    import numpy as np

    import fewbit
    from fewbit.quant.compressors import GroupQuantizer

    x = torch.randn(100)
    for call in (lambda: fq.quantize(x, 2, stochastic=value), lambda: fq.compress_activations(2, stochastic=value),
                 lambda: GroupQuantizer(2, stochastic=value), lambda: fewbit.Config(saved_bits=2, stochastic=value)):
        with pytest.raises(ValueError, match=r"stochastic must be True or False, got"):
            call()
    assert fq.quantize(x, 2, stochastic=np.bool_(False)).decode_seed is None


def test_reference_memory_follows_the_tensor_not_the_group_size():
    """A group wider than the tensor is the tensor: ``quantize_reference`` padded every group
    to ``group_size`` with infinities (1.7 GiB for 1000 elements and ``group_size=2**27``;
    killed for 2**31). Same codes and statistics as the CPU kernel."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        q_ref = fq.quantize_reference(x, 4, group_size=2**26)
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    assert allocated < 2**20, allocated
    q = fq.quantize(x, 4, group_size=2**26, generator=torch.Generator().manual_seed(1))
    q_ref = fq.quantize_reference(x, 4, group_size=2**26, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q.packed, q_ref.packed) and torch.equal(q.mins, q_ref.mins)
    assert torch.equal(q.scales, q_ref.scales)
