"""Group-quantizer Triton kernels against the torch reference, run by tests/quant/test_triton.py
in a subprocess with TRITON_INTERPRET=1 (CPU tensors; large blocks: the interpreter is slow
per program). Not collected by the main suite (no ``test_`` prefix)."""

import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the caller
    pytest.skip("needs TRITON_INTERPRET=1 (run through tests/quant/test_triton.py)", allow_module_level=True)

from interp_strict import strict_scalar_index  # noqa: E402

strict_scalar_index()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fewbit.quant as fq  # noqa: E402
from fewbit.quant import _reference as ref  # noqa: E402
from fewbit.quant import _triton as T  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _adversarial import adversarial_groups, bound_violations  # noqa: E402

SEED = 123456789012345


def _same(u, v):
    return torch.equal(u.nan_to_num(9.0), v.nan_to_num(9.0)) and torch.equal(u.isnan(), v.isnan())


def test_bit_exact_vs_reference():
    torch.manual_seed(0)
    bad = []
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for bits in (1, 2, 4, 8):
            for G, n in ((256, 1000), (12, 333), (7, 64), (1, 9)):
                for sd in (torch.bfloat16, torch.float32):
                    for st in (False, True):
                        x = (torch.randn(n) * 3 + 1).to(dt)
                        if G == 7:
                            x[5] = float("nan")
                            x[20] = float("inf")
                        a = T.quantize(x, bits, G, SEED, st, sd, block_w=1024, block_elems=1 << 14)
                        b = ref.quantize_reference(x, bits, G, SEED if st else None, sd)
                        if not (torch.equal(a[0], b[0]) and _same(a[1], b[1]) and _same(a[2], b[2])):
                            bad.append(("quantize", dt, bits, G, sd, st))
                        da = T.dequantize(*b, bits, G, n, dt, block_w=1024)
                        db = ref.dequantize_reference(*b, bits, G, n, dt)
                        if not _same(da, db):
                            bad.append(("dequantize", dt, bits, G, sd, st))
                        # stochastic rounding into the half dtypes (the decode seed)
                        da = T.dequantize(*b, bits, G, n, dt, SEED + 1, st, block_w=1024)
                        db = ref.dequantize_reference(*b, bits, G, n, dt, SEED + 1 if st else None)
                        if not _same(da, db):
                            bad.append(("dequantize rounded", dt, bits, G, sd, st))
    assert bad == []


def test_stochastic_round_bit_exact_vs_reference():
    """The rounding kernel (fewbit::stochastic_round_triton, _round_half in every decode
    kernel) on signed zeros, NaN, infinities, values past each dtype's largest, float32
    subnormals, float16 subnormals and the binade edges."""
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 3.38e38, -3.3961e38,
                            1e-40, -1e-42, 65500.0, -65519.0, 65530.0, 6e-8, -3e-8, 1e-30, 2.0 ** -14,
                            2.0 ** -14 * (1 - 2.0 ** -20), 1.0 - 2.0 ** -24, -2.0 ** 15])
    g = torch.Generator().manual_seed(3)
    y = torch.cat([special, torch.randn(3000, generator=g) * 3, torch.randn(500, generator=g) * 1e-5,
                   torch.randn(500, generator=g) * 6e4])
    for dt in (torch.bfloat16, torch.float16):
        for seed in (0, SEED, 2**63 - 2):
            a = T.stochastic_round(y, dt, seed, block=1024)
            b = ref.stochastic_round_reference(y, dt, seed).to(dt)
            assert _same(a.float(), b.float()) and torch.equal(a.signbit(), b.signbit()), (dt, seed)


def test_multi_program_tail_empty_and_long_groups():
    x = torch.randn(5000)
    a = T.quantize(x, 4, 256, SEED, True, torch.bfloat16, block_w=64, block_elems=1024)
    b = ref.quantize_reference(x, 4, 256, SEED, torch.bfloat16)
    assert torch.equal(a[0], b[0])
    # groups longer than a stats tile: several loop iterations per group
    a = T.quantize(x, 2, 3000, SEED, True, torch.float32, block_w=256, block_elems=1024)
    b = ref.quantize_reference(x, 2, 3000, SEED, torch.float32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    e = T.quantize(torch.empty(0), 2, 256, 0, False, torch.bfloat16)
    assert e[0].numel() == 0 and e[1].numel() == 0


@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_bound_and_bit_exact_on_adversarial_groups(stats_dtype):
    """(x - m) * s <= 2**b - 1 with the stored stats (float32 arithmetic), and the same stats
    and codes as the reference, on groups built to make the rounded division overshoot."""
    for bits in (1, 2, 4, 8):
        x = adversarial_groups(bits, stats_dtype, group_size=64)
        a = T.quantize(x, bits, 64, SEED, True, stats_dtype, block_w=2048, block_elems=1 << 14)
        b = ref.quantize_reference(x, bits, 64, SEED, stats_dtype)
        assert bound_violations(x, a[1], a[2], bits, 64) == 0
        assert torch.equal(a[0], b[0]) and _same(a[1], b[1]) and _same(a[2], b[2]), bits


@triton.jit
def _uniform_kernel(out_ptr, base, seed0, seed1, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    e = base + i.to(tl.int64)
    tl.store(out_ptr + i, T._uniform(e, seed0.to(tl.uint32), seed1.to(tl.uint32)))


def test_uniform_noise_definition_large_indices():
    """The kernels' hash is the reference's, also past 2**32 elements (the high index word)."""
    for base in (0, 2**31 - 8, 2**32 - 8, 3 * 2**32 + 5, 2**40):
        for seed in (0, SEED, 2**64 - 1):
            out = torch.empty(64, dtype=torch.float32)
            _uniform_kernel[(1,)](out, base, T._as_int32(seed), T._as_int32(seed >> 32), BLOCK=64)
            assert torch.equal(out, ref.uniform_noise(64, seed, start=base)), (base, seed)
    # indices 2**32 apart draw different numbers
    assert not torch.equal(ref.uniform_noise(64, SEED), ref.uniform_noise(64, SEED, start=2**32))


def test_same_codes_as_cpu_kernel_from_one_generator_state():
    """The seed derivation of the public API does not depend on the device: the CPU (numba)
    path and the Triton kernels give the same codes for the same generator state."""
    x = torch.randn(3000) * 2
    for bits in (1, 4):
        a = fq.quantize(x, bits, generator=torch.Generator().manual_seed(5))
        seed = fq._draw_seed(torch.Generator().manual_seed(5))
        b = T.quantize(x, bits, 256, seed, True, torch.bfloat16, block_w=1024, block_elems=1 << 14)
        assert torch.equal(a.packed, b[0]) and torch.equal(a.mins, b[1]) and torch.equal(a.scales, b[2])


def test_stochastic_round_of_a_strided_input():
    """The launcher passed ``y`` as it came: a strided view was read as contiguous (every
    other element of the wrong ones; review h74)."""
    base = torch.randn(2 * 1000, dtype=torch.float32) * 3
    y = base[::2]
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(T.stochastic_round(y, dtype, 7), ref.stochastic_round_reference(y.contiguous(), dtype, 7))


def test_float16_stats_are_refused_by_the_op():
    """``fewbit::group_quantize`` with float16 stats: the Triton kernel took them as float32
    (the minimum rounded to nearest, not down: codes clamped), the CPU kernel raised a bare
    KeyError (review h74). A TypeError naming stats_dtype, on every backend."""
    with pytest.raises(TypeError, match="stats_dtype must be float32 or bfloat16, got torch.float16"):
        torch.ops.fewbit.group_quantize(torch.randn(64), 4, 16, 0, True, torch.float16)
