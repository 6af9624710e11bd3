"""Decoding into float16/bfloat16 keeps E[x_hat] = x (docs/compression.md §1).

Every decoder computes ``m + q / s`` (DIVISION: ``up + m + q / s``) in float32. Rounding that
to the nearest half-precision value was off by up to half an ulp in expectation wherever the
codes' step is below an ulp (8-bit codes): over 4000 draws of a bfloat16 ``16 x 16`` randn at
8 bits, the mean decode was 10 standard errors off (mean z**2 106). The decoders now round
stochastically with a seed of their own (``fewbit.quant._reference.stochastic_round_reference``,
``decode_seed``). Bit-exactness of the CPU kernels against that definition is checked here;
the Triton kernels' in tests/quant/triton_interp_cases.py and triton_interp_compressors.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fewbit.quant as fq
from fewbit.quant import _reference as ref
from fewbit.quant.compressors import get_compressor

HALF = (torch.bfloat16, torch.float16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN's payload and sign aside."""
    nan = a.isnan()
    return (torch.equal(nan, b.isnan()) and torch.equal(a[~nan].float(), b[~nan].float())
            and torch.equal(a[~nan].signbit(), b[~nan].signbit()))


def _seeds(n: int) -> list[int]:
    """``n`` random 62-bit seeds, as fewbit draws them (consecutive seeds would give the
    elements permutations of one another's noise: the hash's first round reads
    ``index ^ seed``)."""
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _neighbours(y: torch.Tensor, dtype: torch.dtype):
    """The largest value of ``dtype`` <= ``y`` and the smallest >= ``y`` (finite ``y``), float64,
    from torch's own cast and ``nextafter`` in ``dtype``."""
    near = y.to(dtype)
    below = torch.nextafter(near, torch.full_like(near, -math.inf))
    above = torch.nextafter(near, torch.full_like(near, math.inf))
    y64, n64 = y.double(), near.double()
    down = torch.where(n64 > y64, below.double(), n64)
    up = torch.where(n64 < y64, above.double(), n64)
    return down, up


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_round_takes_a_neighbour_with_the_right_probability(dtype):
    """Every draw is one of the two values of ``dtype`` around ``y``; over 4000 seeds the
    mean is ``y`` within 3 standard errors, element by element (binade edges, float16
    subnormals, bfloat16 values in float32's subnormal range included)."""
    grid = ref.HALF_GRIDS[dtype]
    tiny = 2.0 ** (grid[1] - 3)  # inside the subnormal range of dtype
    y = torch.tensor([1.0 + 2.0 ** -12, -3.0 - 2.0 ** -9, 1.0 - 2.0 ** -20, 2.0 ** grid[1] * 0.75,
                      tiny * 1.3, -tiny * 0.7, 1234.567, 0.1, 1e-3, -7.77], dtype=torch.float32)
    down, up = _neighbours(y, dtype)
    n = 4000
    draws = torch.stack([ref.stochastic_round_reference(y, dtype, seed).double() for seed in _seeds(n)])
    assert bool(((draws == down) | (draws == up)).all())
    assert torch.equal(draws.float().to(dtype).double(), draws)
    exact = up == down
    assert bool((draws[:, exact] == y[exact].double()).all())
    p = ((y.double() - down) / (up - down))[~exact]
    z = (draws.mean(0)[~exact] - y.double()[~exact]) / ((up - down)[~exact] * (p * (1 - p) / n).sqrt())
    assert float(z.abs().max()) < 3.0, z


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_round_special_values(dtype):
    _, _, largest = ref.HALF_GRIDS[dtype]
    y = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 65519.0])
    for seed in (0, 7, 2**62 + 3):
        z = ref.stochastic_round_reference(y, dtype, seed)
        assert z[0] == 0 and not z[0].signbit() and z[1] == 0 and z[1].signbit()
        assert z[2].isnan() and z[3] == math.inf and z[4] == -math.inf
        assert z[5] == largest and z[6] == -largest  # finite stays finite
        assert torch.isfinite(z[7])
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        ref.stochastic_round_reference(y, torch.float32, 0)


def _specials() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, math.nan, math.inf, -math.inf, 3.38e38, -3.3961e38, 1e-40, -1e-42, 65500.0,
                            -65519.0, 6e-8, -3e-8, 1e-30, 2.0 ** -14, 1.0 - 2.0 ** -24])
    return torch.cat([special, torch.randn(40000, generator=g) * 3, torch.randn(3000, generator=g) * 1e-5,
                      torch.randn(3000, generator=g) * 6e4])


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_decode_kernels_round_as_the_definition(dtype):
    """The numba decode kernels (group dequantize, affine decode, DIVISION decode) against
    the reference, rounding included: an affine decode with infinite scales decodes to its
    mins exactly before rounding, so every special value goes through the rounding."""
    y = _specials()
    n = y.numel()
    packed = torch.zeros(-(-n // 8), dtype=torch.uint8)
    inf = torch.full_like(y, math.inf)
    for seed in (0, 99, 2**62 + 12345):
        a = torch.ops.fewbit.affine_decode(packed, y, inf, 1, 1, False, 0, n, dtype, seed=seed, stochastic=True)
        b = ref.affine_decode_reference(packed, y, inf, 1, 1, False, 0, n, dtype, seed)
        assert a.dtype == dtype and _same(a, b), seed
        a = torch.ops.fewbit.group_dequantize(packed, y, inf, 1, 1, n, dtype, seed, True)
        assert _same(a, ref.dequantize_reference(packed, y, inf, 1, 1, n, dtype, seed)), seed
    x = (torch.randn(3, 37, 24) * 2).to(dtype)
    for name, shape in (("division", (3, 37, 24)), ("division", (2, 3, 13, 11)), ("channelwise", (3, 37, 24)),
                        ("softmax", (3, 37, 24))):
        x = torch.randn(shape).to(dtype)
        if name == "softmax":
            x = torch.softmax(x.float(), -1).to(dtype)
        comp = get_compressor(name, bits=8)
        a = comp.compress(x, generator=torch.Generator().manual_seed(4)).decompress()
        b = comp.compress_reference(x, generator=torch.Generator().manual_seed(4)).decompress()
        assert a.dtype == dtype and _same(a, b), name


def test_nearest_codes_decode_to_nearest():
    """Nearest codes (``stochastic=False``) carry no decode seed: the decode rounds to nearest."""
    x = torch.randn(1000).to(torch.bfloat16)
    qt = fq.quantize(x, 8, stochastic=False)
    assert qt.decode_seed is None
    assert torch.equal(qt.dequantize(), ref.dequantize_reference(qt.packed, qt.mins, qt.scales, 8, 256, 1000,
                                                                 torch.float32).to(torch.bfloat16))


CASES = [("group", 8), ("group", 4), ("division", 8), ("channelwise", 8), ("softmax", 8)]


def _compressed(name: str, bits: int, x: torch.Tensor):
    """One compression of ``x``; ``(handle, float32 decode, set_seed)``: the decode of the
    same codes in float32 (the value the half-precision decode rounds), and a function that
    gives the handle another decode seed."""
    gen = torch.Generator().manual_seed(1)
    n = x.numel()
    if name == "group":
        qt = fq.quantize(x, bits, group_size=256, generator=gen)
        y = ref.dequantize_reference(qt.packed, qt.mins, qt.scales, bits, 256, n, torch.float32)
        box = [qt]

        def set_seed(seed):
            box[0] = dataclasses.replace(box[0], decode_seed=seed)
        return box, y, set_seed
    comp = get_compressor(name, bits=bits, block=4) if name == "division" else get_compressor(name, bits=bits)
    c = comp.compress(x, generator=gen)
    if name == "division":
        q = c.hfc
        y = ref.division_decode_reference(q.packed, c.lfc, q.mins, q.scales, *c.block, bits, c.view[1], c.view[2],
                                          torch.float32)
    else:
        q = c.codes
        mins = q.mins if name == "softmax" else torch.zeros_like(q.scales)  # channelwise stores no mins
        y = ref.affine_decode_reference(q.packed, mins, q.scales, q.bits, q.rowlen, q.per_col, q.offset, n,
                                        torch.float32)

    def set_seed(seed):
        q.decode_seed = seed
    return [c], y, set_seed


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name,bits", CASES)
def test_half_decode_is_unbiased_given_the_codes(name, bits, dtype):
    """For fixed codes, 2000 decodes with fresh decode seeds average to the float32 decode
    ``y`` (whose mean over the codes is ``x``, tests/quant/test_gradient_statistics.py):
    each draw is one of the two values of ``dtype`` around ``y``, and
    ``z = (mean - y) / (ulp * sqrt(p (1 - p) / N))``, ``p`` the exact probability of the
    upper one, has mean ``z**2`` below ``1 + 4 * sqrt(2 / n)`` over the ``n`` elements with
    ``N * min(p, 1 - p) >= 10`` (Poisson tails left out). Rounding to nearest would give a
    mean ``z**2`` of 378-1319 on these cases (``rn(y) - y`` in the same units)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 16, 16, generator=g)
    if name == "softmax":
        x = torch.softmax(x * 2, -1)
    x = x.to(dtype)
    box, y, set_seed = _compressed(name, bits, x)
    y = y.reshape(-1)
    down, up = _neighbours(y, dtype)
    draws = 2000
    acc = torch.zeros(y.numel(), dtype=torch.float64)
    for seed in _seeds(draws):
        set_seed(seed)
        d = box[0].decompress().reshape(-1).double()
        assert bool(((d == down) | (d == up)).all())
        acc += d
    p = ((y.double() - down) / (up - down)).nan_to_num(0.0)
    kept = draws * torch.minimum(p, 1 - p) >= 10
    assert int(kept.sum()) >= y.numel() // 4
    z = (acc / draws - y.double())[kept] / ((up - down) * (p * (1 - p) / draws).sqrt())[kept]
    n = int(kept.sum())
    assert float((z * z).mean()) < 1 + 4 * math.sqrt(2 / n), (float((z * z).mean()), n)


def test_layer_gradient_through_a_bfloat16_save_is_unbiased():
    """A whole layer: ``y = h * w`` with ``h`` bfloat16 and ``w`` float32 (a LayerScale on a
    bfloat16 activation); its float32 weight gradient reads the 8-bit copy of ``h`` that
    :func:`fewbit.quant.compress_activations` saved. The mean of 1500 draws is the exact
    gradient within 3 sigma along every coordinate (Bonferroni over 64: |z| < 4). Rounding the
    decode to nearest gave |z| up to 10.9 (mean z**2 22); now 2.5 (0.99)."""
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(64, 64, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(64, generator=g)
    grad_out = torch.randn(64, 64, generator=g)

    def weight_grad(compressor):
        wl = w.clone().requires_grad_()
        hl = h.clone().requires_grad_() * 1  # an activation, not a leaf (leaves are kept)
        if compressor is None:
            y = hl * wl
        else:
            with compressor:
                y = hl * wl
        (y * grad_out).sum().backward()
        return wl.grad.double()

    exact = weight_grad(None)
    draws = torch.stack([weight_grad(fq.compress_activations(8, min_numel=1, generator=torch.Generator().manual_seed(i)))
                         for i in range(1500)])
    assert not torch.equal(draws[0], draws[1])  # compressed, with fresh noise
    z = (draws.mean(0) - exact) / (draws.std(0) / math.sqrt(draws.shape[0]))
    assert float(z.abs().max()) < 4.0, z.abs().max()
