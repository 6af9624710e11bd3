"""The compressor family of fewbit.quant.compressors (docs/compression.md §3-4): DIVISION,
Adacc's outlier-separated and channel-wise compressors, the softmax grid.

Per compressor: the numba kernels equal the pure-torch definition bit for bit (codes, stats,
reconstruction), the Triton kernels too (under TRITON_INTERPRET=1, in a subprocess), the
mean of many decompressions is the input (3 sigma, fixed seeds), noise is fresh per call
and reproducible from a generator state, a layer's gradient through
``ActivationCompressor(compressor=...)`` is unbiased (tests/quant/test_gradient_statistics.py's
checks), the bytes are those stated, and a non-finite input never gives a finite wrong value.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fewbit
from fewbit.quant import ActivationCompressor
from fewbit.quant.compressors import (
    ChannelWise, Division, OutlierSeparated, Softmax, division_view, get_compressor, outlier_channels,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_gradient_statistics import DRAWS, _gradients, failures, t_level  # noqa: E402

NEW = ("division", "outlier", "channelwise", "softmax")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def sample(name, shape, dtype=torch.float32, seed=0):
    """A tensor ``name`` is meant for: probabilities for softmax, planted outlier channels
    (3 and 17 where there are more than 17, 40x larger) for the outlier compressor, a smooth
    map plus noise otherwise."""
    x = torch.randn(shape, generator=gen(seed), dtype=torch.float64)
    if name == "softmax":
        x = x.softmax(-1)
    elif name == "outlier":
        x[..., 3] *= 40
        if shape[-1] > 17:
            x[..., 17] *= 40
    elif name == "division":
        x = x + 4 * torch.linspace(-1, 1, shape[-1], dtype=torch.float64)
    return x.to(dtype)


def same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


SHAPES = [(4, 8, 16, 16), (3, 5, 13, 11), (2, 37, 24), (45, 24)]


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_kernels_equal_the_reference_bit_for_bit(name, dtype):
    comp = get_compressor(name)
    for shape in SHAPES:
        x = sample(name, shape, dtype)
        a = comp.compress(x, generator=gen(7))
        b = comp.compress_reference(x, generator=gen(7))
        for attr in ("lfc", "exact", "index"):
            if hasattr(a, attr):
                assert torch.equal(getattr(a, attr), getattr(b, attr)), (shape, attr)
        qa = getattr(a, "hfc", getattr(a, "codes", None)) or a.rest
        qb = getattr(b, "hfc", getattr(b, "codes", None)) or b.rest
        assert torch.equal(qa.packed, qb.packed), shape
        assert (qa.mins is None and qb.mins is None) or same(qa.mins, qb.mins), shape  # channelwise: 0, not held
        assert same(qa.scales, qb.scales), shape
        ya, yb = a.decompress(), b.decompress()
        assert ya.dtype == dtype and ya.shape == x.shape and same(ya, yb), shape
        assert a.nbytes == b.nbytes


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(2, 3, 100, 97), (3, 1000, 37), (7, 5000), (1, 2, 12, 20001), (11, 20001)],
                         ids=str)
def test_division_kernels_bit_exact_across_chunks(shape, bits):
    """The CPU kernels work in chunks of AFFINE_CHUNK elements that start mid-row and
    mid-block (rows of 97 and 37 elements, a row-block across a chunk boundary; rows of
    20001, longer than a chunk, whose pieces each chunk upsamples alone): codes, stats,
    block means and the decompression equal the reference's bit for bit."""
    comp = get_compressor("division", bits=bits)
    x = torch.randn(shape, generator=gen(3))
    x.view(-1)[12345] = 40.0  # an outlier, so the residual's range is set by one element
    a = comp.compress(x, generator=gen(9))
    b = comp.compress_reference(x, generator=gen(9))
    assert torch.equal(a.lfc, b.lfc)
    assert torch.equal(a.hfc.packed, b.hfc.packed)
    assert same(a.hfc.mins, b.hfc.mins) and same(a.hfc.scales, b.hfc.scales)
    assert same(a.decompress(), b.decompress())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["nan", "inf", "negzero", "overflow", "constant"])
def test_division_conv_map_ranges_equal_the_reference_at_the_edges(case, dtype):
    """Conv maps take the residual's range from the columns' min and max beside the block
    sums (8-row blocks in one loop, a partial block of 3 rows row by row): block means,
    codes and stats equal the reference's bit for bit where a value is NaN or infinite, a
    block is all -0.0, a block's sum overflows, or a block is constant."""
    g = gen(5)
    x = torch.randn(2, 3, 19, 24, generator=g, dtype=torch.float64).to(dtype)  # 19 = 2 * 8 + 3 rows
    if case == "nan":
        x[1, 2, 9, 5] = float("nan")
    elif case == "inf":
        x[0, 1, 17, 3] = -float("inf")
    elif case == "negzero":
        x[0, 0, :8, :8] = -0.0
        x[1, 1, 16:, 8:] = -0.0
    elif case == "overflow":
        x[0, 2, :8, :8] = torch.finfo(dtype).max / 2
    else:
        x[:, :, :16] = 1.5
    comp = Division()
    if case == "overflow" and dtype == torch.float64:  # past the float32 stats: refused, not NaN
        for compress in (comp.compress, comp.compress_reference):
            with pytest.raises(ValueError, match="float64 values must be of a magnitude at most float32's largest"):
                compress(x, generator=gen(9))
        return
    a = comp.compress(x, generator=gen(9))
    b = comp.compress_reference(x, generator=gen(9))
    assert torch.equal(a.lfc.view(-1).view(torch.int32 if dtype == torch.float32 else torch.int64),
                       b.lfc.view(-1).view(torch.int32 if dtype == torch.float32 else torch.int64))
    assert torch.equal(a.hfc.packed, b.hfc.packed)
    assert same(a.hfc.mins, b.hfc.mins) and same(a.hfc.scales, b.hfc.scales)
    assert same(a.decompress(), b.decompress())


def grid_step(name, c, shape):
    """Per element, the spacing of the grid its value is rounded on (0: kept exactly)."""
    if name == "division":
        return torch.full(shape, 1 / c.hfc.scales.item())
    if name in ("softmax", "channelwise"):
        return (1 / c.codes.scales.double()).expand(shape[-1] if name == "channelwise" else 1).expand(shape)
    step = (1 / c.rest.scales.double())[:, None].expand(-1, shape[-1]).clone()
    step[:, c.index.long()] = 0
    return step.reshape(shape)


def assert_unbiased(x, draws, step):
    """Stochastic rounding on a grid of spacing ``step``: a draw has variance <= step**2 / 4
    per element, so ``z = (mean - x) sqrt(N) / (step / 2)`` has ``E[z**2] <= 1`` and (mean of
    N Bernoullis, near normal) ``|z| < 6`` for every element; along x's direction and a
    random one the mean is within 3 standard errors (t-tests of test_gradient_statistics);
    elements on no grid (step 0) are exact."""
    x, draws, step = x.double().flatten(), draws.double(), step.double().flatten()
    n = draws.shape[0]
    err = draws.mean(0) - x
    exact = step == 0
    assert torch.equal(draws[:, exact], x[exact].expand(n, -1))
    z = err[~exact] * math.sqrt(n) / (step[~exact] / 2)
    assert z.abs().max() < 6, z.abs().max()
    assert (z**2).mean() < 1.1, (z**2).mean()
    level = t_level(n, 2)
    for d in (x, torch.randn(x.shape, generator=gen(1), dtype=torch.float64)):
        p = draws @ (d / d.norm())
        t = (p.mean() - x @ (d / d.norm())) / (p.std() / math.sqrt(n))
        assert abs(t) < level, (t, level)


@pytest.mark.parametrize("name", NEW)
def test_mean_of_decompressions_is_the_input(name):
    comp = get_compressor(name, bits=2 if name != "channelwise" else 4)
    x = sample(name, (4, 8, 16, 24))
    g = gen(11)
    handles = [comp.compress(x, generator=g) for _ in range(128)]
    draws = torch.stack([h.decompress().flatten() for h in handles])
    assert_unbiased(x, draws, grid_step(name, handles[0], x.shape))
    assert draws.std(dim=0).mean() > 0  # stochastic: the draws differ


def test_unbiasedness_check_has_power():
    """Replayed noise (the same generator state every call) is biased and caught."""
    x = sample("division", (4, 8, 16, 24))
    c = Division(bits=2).compress(x, generator=gen(3))
    draws = torch.stack([Division(bits=2).compress(x, generator=gen(3)).decompress().flatten() for _ in range(64)])
    with pytest.raises(AssertionError):
        assert_unbiased(x, draws, grid_step("division", c, x.shape))


@pytest.mark.parametrize("name", NEW)
def test_fresh_noise_and_reproducible_codes(name):
    comp = get_compressor(name)
    x = sample(name, (4, 8, 16, 24))
    fewbit.manual_seed(0)
    a = comp.compress(x).decompress()
    b = comp.compress(x).decompress()
    assert not torch.equal(a, b)  # no generator: fresh noise per call
    fewbit.manual_seed(0)
    assert torch.equal(comp.compress(x).decompress(), a)  # fewbit.manual_seed replays it
    assert torch.equal(comp.compress(x, generator=gen(5)).decompress(),
                       comp.compress(x, generator=gen(5)).decompress())


def _layer_cases():
    conv = (lambda: nn.Conv2d(3, 8, 3, padding=1), (4, 3, 16, 16), ())
    linear = (lambda: nn.Linear(64, 48), (32, 64), ())
    return {
        "division-conv2d": (Division(bits=2), *conv),
        "division-linear": (Division(bits=2), *linear),
        "outlier-linear": (OutlierSeparated(), *linear),
        "channelwise-linear": (ChannelWise(bits=4), *linear),
        "channelwise-conv2d": (ChannelWise(bits=4), *conv),
        # sigmoid saves its output (in [0, 1]), the Linear reads the same tensor; sigmoid's
        # backward y (1 - y) is nonlinear in it: the input gradient's bias is second order
        "softmax-sigmoid-linear": (Softmax(bits=4), lambda: nn.Sequential(nn.Sigmoid(), nn.Linear(64, 48)),
                                   (32, 64), ("input",)),
    }


@pytest.mark.parametrize("case", list(_layer_cases()))
def test_layer_gradient_is_unbiased(case):
    comp, factory, shape, second_order = _layer_cases()[case]
    torch.manual_seed(0)
    module = factory()
    x = torch.randn(shape, generator=gen(1)).requires_grad_()
    with torch.no_grad():
        grad_out = torch.randn_like(module(x))
    exact = _gradients(module, x, grad_out)
    act = ActivationCompressor(compressor=comp, min_numel=0, generator=gen(100))
    rows = [_gradients(module, x, grad_out, act) for _ in range(DRAWS)]
    assert act.stats.compressed >= DRAWS
    samples = {n: torch.stack([r[n] for r in rows]) for n in exact}
    flat = torch.cat([samples[n] for n in exact], dim=1)
    assert not torch.equal(flat[0], flat[1])
    bad = failures(exact, samples, second_order=second_order)
    assert not bad, (case, bad)


# --- bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("block,bits", [(8, 2), (4, 4), (2, 1)])
def test_division_bytes_per_element(block, bits):
    """(4 / B**2 + Q / 8) bytes per float32 element when the sizes divide, plus the two
    per-tensor stats; 1-D pooling of sequences: 4 / B + Q / 8 plus two bfloat16 stats per
    token."""
    comp = Division(block, bits)
    x = torch.randn(2, 4, 8 * block, 4 * block)
    c = comp.compress(x, generator=gen(0))
    n = x.numel()
    assert c.nbytes == n * (4 / block**2 + bits / 8) + 8 == comp.bytes_per_element(x) * n
    assert c.lfc.shape == (2 * 4, 8, 4, 1) and c.lfc.dtype == torch.float32
    seq = torch.randn(3, 16 * block, 24)
    c = comp.compress(seq, generator=gen(0))
    tokens = 3 * 16 * block
    assert c.nbytes == seq.numel() * (4 / block + bits / 8) + 4 * tokens == comp.bytes_per_element(seq) * seq.numel()
    assert c.hfc.mins.shape == (tokens,) and c.hfc.mins.dtype == torch.bfloat16
    half = x.to(torch.bfloat16)  # means kept in the input dtype
    assert comp.compress(half, generator=gen(0)).nbytes == n * (2 / block**2 + bits / 8) + 8


@pytest.mark.parametrize("name", ("group",) + NEW)
def test_strided_views_compress_as_their_contiguous_copy(name):
    """``ActivationCompressor`` hands non-overlapping strided views to the compressors (half
    of a fused projection split with ``chunk``, a strided slice, a transposed map): the same
    codes and reconstruction, bit for bit, as for a contiguous copy."""
    comp = get_compressor(name)
    base = sample(name, (6, 40, 96), seed=3)
    views = [base.chunk(2, -1)[1], base[:, ::2], base.transpose(1, 2)]
    for v in views:
        if not comp.supports(v):
            continue
        a = comp.compress(v, generator=gen(5))
        b = comp.compress(v.contiguous(), generator=gen(5))
        assert a.nbytes == b.nbytes
        ya = a.decompress()
        assert ya.shape == v.shape and same(ya, b.decompress()), (v.shape, v.stride())


def test_division_views_and_partial_blocks():
    assert division_view((2, 3, 10, 12), 8) == ((6, 10, 12, 1), (8, 8))
    assert division_view((2, 3, 4, 10, 12), 8) == ((24, 10, 12, 1), (8, 8))
    assert division_view((2, 30, 5), 8) == ((2, 30, 1, 5), (8, 1))
    assert division_view((30, 5), 8) == ((1, 30, 1, 5), (8, 1))
    # a partial last block is averaged over the elements present
    x = torch.arange(2 * 10 * 12, dtype=torch.float32).reshape(1, 2, 10, 12)
    c = Division(8, 8).compress(x, generator=gen(0))
    assert c.lfc.shape == (2, 2, 2, 1)
    assert torch.allclose(c.lfc[0, 1, 1, 0], x[0, 0, 8:, 8:].mean())
    assert torch.allclose(c.lfc[1, 0, 1, 0], x[0, 1, :8, 8:].mean())
    # a block past a dim is that dim: the reference padded to whole blocks (a block of 65536 on
    # 720 elements asked for 103 GB) and the kernels gave the same codes (review h68)
    assert division_view((2, 3, 4, 30), 65536) == ((6, 4, 30, 1), (4, 30))
    assert division_view((2, 7, 5), 1000) == ((2, 7, 1, 5), (7, 1))
    x = torch.randn(2, 3, 4, 30, generator=gen(1))
    for kernels in (Division(65536).compress, Division(65536).compress_reference):
        big, same = kernels(x, generator=gen(2)), Division(30).compress(x, generator=gen(2))
        assert torch.equal(big.decompress(), same.decompress())


def test_division_reaches_its_rate_on_a_cnn():
    """DIVISION (B = 8, Q = 2) on the conv maps of a small CNN: 12.8x less than float32
    (DIVISION Thm. 2), up to the 8 bytes of stats per tensor."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 4, 3, padding=1))
    act = ActivationCompressor(compressor=Division(8, 2), min_numel=0)
    x = torch.randn(8, 3, 32, 32, requires_grad=True)
    with act:
        cnn(x).square().mean().backward()
    assert act.stats.compressed == 3  # x and the two ReLU outputs (each also a conv input: saved once)
    assert 12.7 < act.stats.ratio <= 12.8, act.stats.ratio


def test_outlier_keeps_the_planted_channels_exactly():
    x = sample("outlier", (6, 20, 32))
    comp = OutlierSeparated()
    assert outlier_channels(x, 3.0).tolist() == [3, 17]
    c = comp.compress(x, generator=gen(0))
    assert c.index.dtype == torch.int32 and c.index.tolist() == [3, 17]
    y = c.decompress()
    assert torch.equal(y[..., [3, 17]], x[..., [3, 17]])
    rows = 6 * 20
    # 4 bits per element, bf16 min and scale per row, the exact columns and their indices
    assert c.nbytes == x.numel() // 2 + 4 * rows + 2 * (rows * 4 + 4)
    assert comp.bytes_per_element(x) * x.numel() == x.numel() // 2 + 4 * rows
    # separation pays: the rest's noise is that of the Gaussian channels, not of the outliers
    plain = get_compressor("group", bits=4, group_size=32).compress(x, generator=gen(0)).decompress()
    keep = torch.ones(32, dtype=torch.bool)
    keep[[3, 17]] = False
    assert (y - x)[..., keep].abs().mean() < 0.2 * (plain - x)[..., keep].abs().mean()
    # no outlier in Gaussian data of many channels; none possible in few channels
    assert outlier_channels(torch.randn(64, 8), 3.0).numel() == 0


@pytest.mark.parametrize("shape", [(5, 1), (1, 1), (3, 4, 1)])
def test_outlier_one_channel_has_no_outlier_and_no_warning(shape):
    """One channel has no spread: no outlier, and no torch warning (std of one value)."""
    import warnings

    x = torch.randn(shape, generator=gen(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert outlier_channels(x, 3.0).numel() == 0
        c = OutlierSeparated().compress(x, generator=gen(0))
    assert c.index.numel() == 0 and c.decompress().shape == x.shape


def test_channelwise_is_symmetric_per_channel():
    x = sample("channelwise", (16, 24)) * torch.logspace(-3, 3, 24)
    comp = ChannelWise(bits=4)
    c = comp.compress(x, generator=gen(0))
    y = c.decompress()
    a = x.abs().amax(0)
    assert (y.abs() <= a * (1 + 1e-6)).all()  # never beyond a channel's own range
    assert ((y - x).abs() <= a / 7 * (1 + 1e-6)).all()  # one step, 2 * a / (2**4 - 2)
    assert torch.equal(comp.compress(torch.zeros(4, 24), generator=gen(0)).decompress(), torch.zeros(4, 24))
    assert c.nbytes == x.numel() // 2 + 24 * 4 == comp.bytes_per_element(x) * x.numel()


def test_softmax_grid_and_fallback():
    comp = Softmax(bits=4)
    p = sample("softmax", (8, 40))
    c = comp.compress(p, generator=gen(0))
    assert c.fixed_grid
    y = c.decompress()
    assert torch.equal(y * 15, (y * 15).round()) and (y >= 0).all() and (y <= 1).all()
    one_hot = torch.eye(8)
    assert torch.equal(comp.compress(one_hot, generator=gen(0)).decompress(), one_hot)  # 0 and 1 exact
    # outside [0, 1]: the tensor's own range, still unbiased (never clipped)
    x = p * 3 - 0.5
    c = comp.compress(x, generator=gen(0))
    assert not c.fixed_grid
    g = gen(1)
    draws = torch.stack([comp.compress(x, generator=g).decompress().flatten() for _ in range(256)])
    assert_unbiased(x, draws, grid_step("softmax", c, x.shape))
    assert c.nbytes == x.numel() // 2 + 8 == comp.bytes_per_element(x) * x.numel()


# --- non-finite input -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_decompresses_to_nan(bad):
    x = sample("division", (2, 3, 16, 16))
    x[1, 2, 5, 7] = bad
    assert Division().compress(x, generator=gen(0)).decompress().isnan().all()
    assert Softmax().compress(x.softmax(-1).nan_to_num(bad), generator=gen(0)).decompress().isnan().all()
    # channel-wise: the channel (dim -1) holding it; outlier: the row holding it
    y = ChannelWise().compress(x, generator=gen(0)).decompress()
    assert y[..., 7].isnan().all() and not y[..., :7].isnan().any() and not y[..., 8:].isnan().any()
    y = OutlierSeparated().compress(x, generator=gen(0)).decompress()
    assert y[1, 2, 5].isnan().all() and y.isnan().sum() == 16
    # DIVISION of a sequence (B, T, C), blocks of 8 tokens, stats per token: the tokens of
    # the block whose mean the value reaches
    seq = sample("division", (2, 32, 24))
    seq[1, 19, 5] = bad
    y = Division().compress(seq, generator=gen(0)).decompress()
    assert y[1, 16:24].isnan().all() and y.isnan().sum() == 8 * 24


def test_division_sequence_stats_are_per_token():
    """Tokens of a sequence differ in scale: each token's residual gets its own step, so
    tokens 1000x smaller than others keep an error within their own range (with one step
    for the tensor, as DIVISION does for conv maps, they were rounded on the large tokens'
    grid)."""
    x = torch.randn(2, 64, 48, generator=gen(4))
    x.view(2, 4, 16, 48)[:, :, 8:] *= 1000  # blocks of 8 tokens: small, large, small, ...
    c = Division(8, 2).compress(x, generator=gen(5))
    assert c.hfc.mins.shape == (2 * 64,) and c.hfc.mins.dtype == torch.bfloat16
    err = (c.decompress() - x).abs()
    r = x - c.lfc.repeat_interleave(8, dim=1).reshape(x.shape)  # each token's residual
    step = (r.amax(-1) - r.amin(-1)) / 3  # 2 bits: 3 steps over the token's range
    assert (err.amax(-1) <= step * 1.02).all()  # bfloat16 stats: m a little lower, s rounded down
    small = x.view(2, 4, 16, 48)[:, :, :8]
    assert err.view(2, 4, 16, 48)[:, :, :8].amax() < 2 * small.abs().amax()
    assert err.view(2, 4, 16, 48)[:, :, :8].amax() < (r.amax() - r.amin()) / 3 / 100


# --- arguments ----------------------------------------------------------------------------


def test_bad_options_and_unsupported_tensors_are_clear_errors():
    with pytest.raises(ValueError, match="block must be an integer in 1..2147483647, got 0"):
        Division(block=0)
    with pytest.raises(ValueError, match="bits must be one of"):
        Division(bits=3)
    with pytest.raises(ValueError, match="bits must be one of .*got 1"):
        ChannelWise(bits=1)
    with pytest.raises(ValueError, match="z must be a finite number"):
        OutlierSeparated(z=float("nan"))
    for z in (0, -5.0):  # every channel at or under the mean an "outlier": more bytes than the tensor (h68)
        with pytest.raises(ValueError, match=f"z must be a finite number > 0 .*got {z}"):
            OutlierSeparated(z=z)
    with pytest.raises(ValueError, match="block must be an integer in 1..2147483647, got 9223372036854775808"):
        Division(block=2**63)  # had failed in compress, "Expected a value of type 'int'" (h68)
    with pytest.raises(TypeError, match="unexpected keyword"):
        get_compressor("division", group_size=4)
    for comp in (Division(), OutlierSeparated(), ChannelWise()):
        assert not comp.supports(torch.zeros(5)) and comp.supports(torch.zeros(5, 2))
        with pytest.raises(ValueError, match=f"the '{comp.name}' compressor needs at least 2 dims; got .*\\(5,\\)"):
            comp.compress(torch.zeros(5))
    with pytest.raises(TypeError, match="x must be a floating"):
        Softmax().compress(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        Division().compress(torch.zeros(5, 5), generator=0)


def test_empty_tensors():
    for name in NEW:
        x = torch.zeros(0, 8)
        y = get_compressor(name).compress(x, generator=gen(0)).decompress()
        assert y.shape == x.shape


# --- Triton kernels (interpreter) ------------------------------------------------------


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_equal_the_reference_interpreted():
    from test_triton import _interpreter_broken_reason

    reason = _interpreter_broken_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_interp_compressors.py")]
    r = subprocess.run(cmd, cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2]


@pytest.mark.cuda
def test_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    for name in NEW:
        comp = get_compressor(name)
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            x = sample(name, (4, 8, 16, 24), dtype)
            a = comp.compress(x, generator=gen(3)).decompress()
            b = comp.compress(x.cuda(), generator=gen(3)).decompress().cpu()
            assert same(a, b), (name, dtype)


def test_opcheck(device):
    """The compressors' torch.library ops: schema, fake kernels, dispatch."""
    x = torch.randn(2, 13, 11, 3, device=device)
    torch.library.opcheck(torch.ops.fewbit.block_mean.default, (x, 4, 3))
    lfc = torch.ops.fewbit.block_mean(x, 4, 3)
    torch.library.opcheck(torch.ops.fewbit.division_encode.default, (x, lfc, 4, 3, 2, 17))
    p, m, s = torch.ops.fewbit.division_encode(x, lfc, 4, 3, 2, 17)
    torch.library.opcheck(torch.ops.fewbit.division_decode.default, (p, lfc, m, s, 4, 3, 2, 13, 11, torch.float32))
    torch.library.opcheck(torch.ops.fewbit.division_encode.default, (x, lfc, 4, 3, 2, 17, True))
    p, m, s = torch.ops.fewbit.division_encode(x, lfc, 4, 3, 2, 17, True)
    assert m.shape == (2 * 13,) and m.dtype == torch.bfloat16
    for rows in (False, True):
        torch.library.opcheck(torch.ops.fewbit.division_compress.default, (x, 4, 3, 2, 17, rows))
        out = torch.ops.fewbit.division_compress(x, 4, 3, 2, 17, rows)
        ref_out = (lfc, *torch.ops.fewbit.division_encode(x, lfc, 4, 3, 2, 17, rows))
        assert all(same(a.float(), b.float()) for a, b in zip(out, ref_out))
    torch.library.opcheck(torch.ops.fewbit.division_decode.default, (p, lfc, m, s, 4, 3, 2, 13, 11, torch.float32))
    flat = x.reshape(-1)
    scales = torch.rand(3, device=device) + 0.5
    mins = torch.zeros(3, device=device)
    for per_col in (True, False):
        args = (flat, mins, scales, 4, 3 if per_col else flat.numel() // 3, per_col, 7, 5, True)
        torch.library.opcheck(torch.ops.fewbit.affine_codes.default, args)
        packed = torch.ops.fewbit.affine_codes(*args)
        torch.library.opcheck(torch.ops.fewbit.affine_decode.default,
                              (packed, mins, scales, 4, args[4], per_col, 7, flat.numel(), torch.float32))


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_affine_codes_op_equals_the_reference(dtype, stochastic):
    """``fewbit::affine_codes`` on the CPU (numba; the compressors use only its stochastic
    rounding) against ``affine_codes_reference`` bit for bit, stats per row and per column,
    with rows that cross the kernel's chunks."""
    from fewbit.quant import _reference as ref

    x = torch.randn(40000, generator=gen(4), dtype=dtype) * 3
    for rowlen, per_col in ((37, True), (37, False), (20000, False)):
        k = rowlen if per_col else -(-x.numel() // rowlen)  # stats per column, or per row (last one partial)
        mins = torch.randn(k, generator=gen(5), dtype=dtype) - 8
        scales = torch.rand(k, generator=gen(6), dtype=dtype) + 0.25
        a = torch.ops.fewbit.affine_codes(x, mins, scales, 4, rowlen, per_col, 7, 11, stochastic)
        b = ref.affine_codes_reference(x, mins, scales, 4, rowlen, per_col, 7, 11 if stochastic else None)
        assert torch.equal(a, b), (rowlen, per_col)


@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_stats_op_equals_the_reference(dtype, stats_dtype, device):
    """``fewbit::pair_stats`` (numba on CPU, the Triton stats kernel on CUDA; the stats of
    ChannelWise and Softmax, which took about thirty small torch ops a call) against
    ``group_stats_reference`` with group_size 2, on pairs in either order, equal, zero, NaN,
    infinite, tiny and huge."""
    from fewbit.quant import _reference as ref

    big = torch.finfo(dtype).max
    vals = [(0.0, 1.0), (1.0, 0.0), (-3.0, 2.5), (2.0, 2.0), (0.0, 0.0), (float("nan"), 1.0),
            (0.0, float("inf")), (-float("inf"), 0.0), (1e-30, 2e-30), (-big, big), (1e30, 1e30 + 1e24),
            (-1e-40, 1e-40)]
    pairs = torch.tensor([v for p in vals for v in p], dtype=dtype)
    for bits in (1, 3, 7, 8):
        m, s = torch.ops.fewbit.pair_stats(pairs.to(device), bits, stats_dtype)
        rm, rs, _ = ref.group_stats_reference(pairs, bits, 2, stats_dtype)
        assert same(m.cpu(), rm) and same(s.cpu(), rs), bits
    finite = torch.tensor([0.0, 1.0, -3.0, 2.5, 2.0, 2.0], dtype=dtype, device=device)  # opcheck: NaN != NaN
    torch.library.opcheck(torch.ops.fewbit.pair_stats.default, (finite, 2, stats_dtype))


def test_channelwise_holds_the_bytes_it_reports():
    """Its all-zero per-channel mins were held (4 bytes a channel) but not counted in
    ``nbytes``: (16, 1024) reported 20480 bytes and held 24576."""
    h = get_compressor("channelwise", bits=8).compress(torch.randn(16, 1024))
    codes = h.codes
    held = sum(getattr(codes, n).untyped_storage().nbytes() for n in type(codes).__slots__
               if isinstance(getattr(codes, n), torch.Tensor))
    assert held == h.nbytes == 16 * 1024 + 4 * 1024


def test_channelwise_codes_stay_in_the_symmetric_range():
    """The channel maximum's ``L + u`` rounds up to ``L + 1`` in float32 for ``u`` near 1:
    the clamp at ``2**bits - 1`` let code ``2L + 1`` through, which decodes past the channel
    maximum, to inf at a dtype's maximum (bfloat16, seed 50: review h55). Codes are
    clamped at ``2L`` on every backend (the interpreted Triton test compares them)."""
    from fewbit.quant.compressors import ChannelWise

    comp = ChannelWise(8)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((3, 13, 17), torch.finfo(dtype).max, dtype=dtype)
        for seed in range(40, 60):
            y = comp.compress(x, generator=torch.Generator().manual_seed(seed)).decompress()
            assert torch.isfinite(y).all(), (dtype, seed)
            assert torch.equal(y, x), (dtype, seed)  # the maximum itself decodes exactly
