"""The compressors' Triton kernels (fewbit.quant._triton: affine codes/decode, block means)
against the pure-torch definitions, through the compressors themselves; run by
tests/quant/test_compressor_family.py in a subprocess with TRITON_INTERPRET=1 (CPU tensors,
small sizes, large blocks). Not collected by the main suite (no ``test_`` prefix)."""

import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the caller
    pytest.skip("needs TRITON_INTERPRET=1 (run through tests/quant/test_compressor_family.py)",
                allow_module_level=True)

from fewbit.quant import _reference as ref  # noqa: E402
from fewbit.quant import _triton as T  # noqa: E402
from fewbit.quant.compressors import _REFERENCE, _Kernels, get_compressor  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_compressor_family import NEW, same, sample  # noqa: E402

def _codes(*a):
    return T.affine_codes(*a, block_w=4096)


def _decode(*a, **kw):
    return T.affine_decode(*a, **kw, block_w=4096)


def _division_compress(x, bh, bw, bits, seed, row_stats):  # the steps of fewbit::division_compress on CUDA
    return ref.division_compress_reference(x, bh, bw, bits, seed, row_stats,
                                           block_mean=lambda x, bh, bw: T.block_mean(x, bh, bw, block=4096),
                                           affine_codes=lambda *a: _codes(*a, True))


def _round_to(y, dtype, seed):  # the steps of fewbit::division_decode's rounding on CUDA
    return ref.round_to_dtype(y, dtype, seed, stochastic_round=lambda y, dtype, seed: T.stochastic_round(
        y.reshape(-1), dtype, seed, block=4096).view(y.shape))


def _division_decode(*a, seed, stochastic):
    return ref.division_decode_reference(*a, seed if stochastic else None, affine_decode=_decode, round_to=_round_to)


TRITON = _Kernels(_codes, _decode, _division_compress, _division_decode, T.pair_stats)


def test_pair_stats_bit_exact_vs_reference():
    """fewbit::pair_stats's Triton kernel (the group quantizer's stats kernel on groups of 2):
    equal ranges, a range at the top of float32, reversed pairs, non-finite values, zeros."""
    lo = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 10
    hi = lo + torch.rand(300, generator=torch.Generator().manual_seed(2)) * 5
    hi[:5] = lo[:5]  # empty range
    lo[5], hi[5] = -3e38, 3e38
    lo[6], hi[6] = 2.0, 1.0
    lo[7], hi[8], lo[9] = float("nan"), float("inf"), float("-inf")
    lo[10], hi[10] = 0.0, 1e-40
    pairs = torch.stack([lo, hi], dim=1).reshape(-1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = pairs.to(dtype)
        if dtype == torch.bfloat16:  # the interpreter's bfloat16 -> float32 cast flushes subnormals (GPUs shift bits)
            x[21] = 1.0
        for stats_dtype in (torch.float32, torch.bfloat16):
            for bits in (1, 3, 7, 8):
                a = T.pair_stats(x, bits, stats_dtype)
                b = _REFERENCE.pair_stats(x, bits, stats_dtype)
                assert a[0].dtype == b[0].dtype == stats_dtype
                assert same(a[0], b[0]) and same(a[1], b[1]), (dtype, stats_dtype, bits)


@pytest.mark.parametrize("name", [n for n in NEW if n != "outlier"])  # outlier: the group quantizer's kernels
def test_bit_exact_vs_reference(name):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape, strided in (((2, 3, 13, 11), False), ((2, 37, 24), False), ((4, 8, 16, 16), False),
                               ((2, 37, 24), True), ((2, 3, 13, 11), True)):
            comp = get_compressor(name, bits=2 if name != "channelwise" else 4)
            # strided: every other element of the last dim, a view whose flat reshape is a
            # view too (the affine codes kernel read it as contiguous: ChannelWise decoded
            # 4.7 off where the reference is 0.024)
            x = sample(name, (*shape[:-1], 2 * shape[-1]), dtype)[..., ::2] if strided else sample(name, shape, dtype)
            if name == "division":
                x.view(-1)[5] = float("nan") if shape == (2, 37, 24) else x.view(-1)[5]
            a = comp._compress(x, torch.Generator().manual_seed(9), TRITON)
            b = comp._compress(x, torch.Generator().manual_seed(9), _REFERENCE)
            qa = getattr(a, "hfc", None) or a.codes
            qb = getattr(b, "hfc", None) or b.codes
            assert torch.equal(qa.packed, qb.packed), (name, dtype, shape, strided)
            if hasattr(a, "lfc"):
                assert same(a.lfc, b.lfc), (name, dtype, shape, strided)
            assert same(a.decompress(), b.decompress()), (name, dtype, shape, strided)
