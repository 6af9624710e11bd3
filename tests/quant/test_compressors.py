"""The Compressor interface (fewbit.quant.compressors) and its use by ActivationCompressor."""

import pytest
import torch

from fewbit.quant import ActivationCompressor, quantize
from fewbit.quant.compressors import COMPRESSORS, Compressed, Compressor, GroupQuantizer, Keep, get_compressor


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("shape", [(4096,), (8, 33, 17)])
def test_every_compressor_round_trips_shape_dtype_and_counts_its_bytes(name, shape):
    comp = get_compressor(name)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if not comp.supports(x):  # a tensor a compressor does not support is refused, never mangled
        with pytest.raises(ValueError, match=name):
            comp.compress(x, generator=torch.Generator().manual_seed(1))
        return
    c = comp.compress(x, generator=torch.Generator().manual_seed(1))
    assert isinstance(c, Compressed)
    y = c.decompress()
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    # data-dependent part: the outlier compressor's exact channels (none in Gaussian data
    # of this shape is the usual case; counted either way)
    extra = c.exact.numel() * c.exact.element_size() + c.index.numel() * 4 if name == "outlier" else 0
    assert c.nbytes == pytest.approx(comp.bytes_per_element(x) * x.numel() + extra)


def test_group_quantizer_is_quantize():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    g = GroupQuantizer(2, group_size=64)
    a = g.compress(x, generator=torch.Generator().manual_seed(3))
    b = quantize(x, 2, group_size=64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.packed, b.packed) and torch.equal(a.mins, b.mins) and torch.equal(a.scales, b.scales)
    assert torch.equal(a.decompress(), b.dequantize())


def test_keep_is_exact_and_counted_as_kept():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64, requires_grad=True)
    comp = ActivationCompressor(compressor=Keep(), min_numel=1)
    with comp:
        y = torch.tanh(lin(x)).sum()
    y.backward()
    g = x.grad.clone()
    x.grad = None
    torch.tanh(lin(x)).sum().backward()
    assert torch.equal(g, x.grad)
    assert comp.stats.compressed == 0 and comp.stats.skipped.get("kept", 0) >= 1


def test_activation_compressor_uses_the_compressor_given():
    class Half(Compressor):
        name = "half"

        def compress(self, x, *, generator=None):
            return _HalfHandle(x.half(), x.dtype)

        def bytes_per_element(self, x):
            return 2.0

    class _HalfHandle:
        def __init__(self, h, dtype):
            self.h, self.dtype = h, dtype

        @property
        def nbytes(self):
            return self.h.numel() * 2

        def decompress(self):
            return self.h.to(self.dtype)

    x = torch.randn(256, 64, requires_grad=True)
    comp = ActivationCompressor(compressor=Half(), min_numel=1)
    with comp:
        (x.exp()).sum().backward()
    assert torch.equal(x.grad, x.detach().exp().half().float())  # exp saves its result
    assert comp.stats.compressed == 1 and comp.stats.bytes_after == x.numel() * 2


def test_bad_compressor_and_name_are_clear_errors():
    with pytest.raises(TypeError, match="compressor must be"):
        ActivationCompressor(compressor="group")
    with pytest.raises(ValueError, match="compressor must be one of .*group.*got 'nope'"):
        get_compressor("nope")
    with pytest.raises(ValueError, match="bits"):
        get_compressor("group", bits=3)


def test_keep_checks_its_input_as_the_other_compressors():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        Keep().compress(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        Keep().compress([1.0, 2.0])
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        Keep().compress(torch.zeros(3), generator=0)


def test_numpy_integer_settings_hash_like_ints():
    """Equal compressors hash alike (a dict of compressors, the policies' caches): numpy
    integers gave GroupQuantizer another repr, hence another hash, while comparing equal."""
    np = pytest.importorskip("numpy")
    a, b = GroupQuantizer(np.int64(4), group_size=np.int64(64)), GroupQuantizer(4, group_size=64)
    assert a == b and hash(a) == hash(b)
    assert type(a.bits) is int and type(a.group_size) is int


@pytest.mark.parametrize("name", ["group", "division", "outlier", "channelwise", "softmax", "keep"])
def test_an_empty_last_dim_round_trips(name):
    """The outlier compressor raised torch's reshape error on a (5, 0) tensor."""
    from fewbit.quant.compressors import get_compressor

    for shape in ((5, 0), (0, 4), (2, 0, 3)):
        x = torch.empty(shape)
        c = get_compressor(name)
        if c.supports(x):
            y = c.compress(x).decompress()
            assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("name", ["group", "division", "outlier", "channelwise"])
@pytest.mark.parametrize("shape", [(20, 30), (4, 16, 30), (2, 3, 8, 8)])
def test_float16_near_its_largest_value_decodes_finite(name, shape):
    """DIVISION decoded finite float16 input near +-65504 as +-inf (845 of 18000 values over
    30 draws): a block mean near the top plus one residual step past it. Every compressor,
    with its kernels and its reference, stays in the finite range."""
    comp = get_compressor(name)
    gen = torch.Generator().manual_seed(0)
    for sign in (1.0, -1.0):
        x = (sign * (60000 + 5500 * torch.rand(shape, generator=gen))).half()
        assert x.isfinite().all()
        for seed in range(20):
            for compress in (comp.compress, getattr(comp, "compress_reference", comp.compress)):
                y = compress(x, generator=torch.Generator().manual_seed(seed)).decompress()
                assert y.isfinite().all(), (sign, seed)


@pytest.mark.parametrize("name", ["group", "division", "outlier", "channelwise", "softmax"])
def test_float64_beyond_the_statistics_range_is_refused_and_kept_exact(name):
    """float64 values past float32's largest decoded as NaN everywhere, silently. A
    compressor refuses them with a ValueError; ActivationCompressor keeps such a tensor exact
    (reason ``range``): the gradient is torch's. Tiny values are taken: a group of them
    decodes within float32's resolution (3e-39) of its values, and one tiny value among
    ordinary ones (a float64 softmax's tail) changes nothing."""
    comp = get_compressor(name)
    gen = torch.Generator().manual_seed(0)
    for scale in (1e300, 1e39, 1e-300, 1e35):
        x = torch.randn(20, 30, dtype=torch.float64, generator=gen) * scale
        if name == "softmax":
            x = x.abs()
        if scale < 1e38:  # inside the range: compressed
            y = comp.compress(x, generator=torch.Generator().manual_seed(1)).decompress()
            assert y.isfinite().all()
            if scale < 1:
                assert ((y - x).abs() <= 3e-39).all()
            continue
        with pytest.raises(ValueError, match=r"x: float64 values must be of a magnitude at most float32's largest"):
            comp.compress(x, generator=torch.Generator().manual_seed(1))
    x = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    x[3, 5] = 1e-50
    assert quantize(x, 8).dequantize().sub(x).abs().max() < 0.05
    lin = torch.nn.Linear(30, 5).double()
    h0 = torch.randn(20, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 1e300
    grads = []
    for comp_ctx in (ActivationCompressor(bits=4, min_numel=0), None):
        lin.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_()
        if comp_ctx is None:
            out = lin(h * 1.0)
        else:
            with comp_ctx:
                out = lin(h * 1.0)
            assert comp_ctx.stats.skipped.get("range") == 1 and comp_ctx.stats.compressed == 0
        (out * 1e-300).sum().backward()
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and grads[0].isfinite().all()


def test_softmax_stats_are_float32_whatever_the_default_dtype():
    """With ``torch.set_default_dtype(torch.float64)`` the fixed [0, 1] statistics were
    float64: 2064 bytes stored against the 2056 its bytes per element state."""
    comp = get_compressor("softmax", bits=4)
    x = torch.rand(4, 512).softmax(-1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        c = comp.compress(x)
    finally:
        torch.set_default_dtype(default)
    assert c.nbytes == comp.bytes_per_element(x) * x.numel()


def test_outlier_z_takes_numpy_numbers():
    """``OutlierSeparated(z=np.float32(3.0))`` was refused with "z must be a finite number,
    got np.float32(3.0)"."""
    np = pytest.importorskip("numpy")
    assert get_compressor("outlier", z=np.float32(2.5), bits=4).z == 2.5
    with pytest.raises(ValueError, match="z must be a finite number"):
        get_compressor("outlier", z=np.float32("nan"), bits=4)
