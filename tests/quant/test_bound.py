"""The range bound of the group quantizer: 0 <= (x - m) * s <= 2**b - 1, as computed.

docs/method.md §7: ``m`` and ``s`` are stored rounded *down* so that the clamp never cuts a
value (stochastic rounding stays unbiased). The scale ``(2**b - 1) / r`` is a division
rounded to nearest, which can land above the quotient; these tests check the bound with the
stored stats and the kernels' arithmetic (float32, subtraction and product rounded
separately; float64 for float64 input) on adversarial groups, for every backend on this
machine (the Triton kernels under the interpreter: tests/quant/test_triton.py).
"""

import functools
import os
import sys

import pytest
import torch

import fewbit.quant as fq
from fewbit.quant import _reference as ref

sys.path.insert(0, os.path.dirname(__file__))
from _adversarial import adversarial_groups, bound_violations  # noqa: E402

BITS = [1, 2, 4, 8]
STATS = [torch.float32, torch.bfloat16]
G = 64


@functools.lru_cache(maxsize=None)
def _data(bits, stats_dtype):
    return adversarial_groups(bits, stats_dtype, group_size=G)


@pytest.mark.parametrize("stats_dtype", STATS)
@pytest.mark.parametrize("bits", BITS)
def test_bound_holds_reference_and_cpu_kernel(bits, stats_dtype):
    x = _data(bits, stats_dtype)
    n_groups = x.numel() // G
    a = fq.quantize(x, bits, group_size=G, stochastic=False, stats_dtype=stats_dtype)
    b = fq.quantize_reference(x, bits, group_size=G, stochastic=False, stats_dtype=stats_dtype)
    finite = torch.isfinite(b.scales)
    # only groups whose range overflows the stats dtype (bf16 max < float32 max) are NaN
    assert finite.sum() >= n_groups - n_groups // 6
    for qt in (a, b):
        assert bound_violations(x, qt.mins, qt.scales, bits, G) == 0
        assert (qt.mins[finite].float() <= x.view(-1, G)[finite].amin(1)).all()
    torch.testing.assert_close(a.packed, b.packed, atol=0, rtol=0)
    assert torch.equal(a.scales.nan_to_num(-1.0), b.scales.nan_to_num(-1.0))
    # the step-down keeps s as large as it may be: the next larger stats value exceeds the
    # exact quotient (products exact in float64)
    m = b.mins[finite].float()
    s = b.scales[finite]
    up = torch.nextafter(s, torch.full_like(s, float("inf"))).double()
    r = (x.view(-1, G)[finite].amax(1) - m).double()  # the float32 range, as computed
    tight = (r > 0) & (s.float() < torch.finfo(stats_dtype).max)
    assert (r[tight] * up[tight] > (1 << bits) - 1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_bound_holds_other_input_dtypes(dtype):
    for bits in (2, 8):
        for stats_dtype in STATS:
            x = _data(bits, stats_dtype).to(dtype)
            for quant in (fq.quantize, fq.quantize_reference):
                qt = quant(x, bits, group_size=G, stochastic=False, stats_dtype=stats_dtype)
                assert bound_violations(x, qt.mins, qt.scales, bits, G) == 0


def test_division_overshoot_is_corrected():
    """The case of the issue: float32 stats, 4 bits, ordinary data: many groups had
    (hi - m) * s = 15.000001 before the fix."""
    x = torch.randn(1024 * 256, generator=torch.Generator().manual_seed(0)) * 3
    for quant in (fq.quantize, fq.quantize_reference):
        qt = quant(x, 4, stochastic=False, stats_dtype=torch.float32)
        assert bound_violations(x, qt.mins, qt.scales, 4, 256) == 0
    # and the correction is needed: the rounded quotient alone overshoots in some groups
    g = x.view(-1, 256)
    m = ref.floor_to_dtype(g.amin(1), torch.float32)
    r = g.amax(1) - m
    assert ((r * (torch.full_like(r, 15.0) / r)) > 15).sum() > 10
