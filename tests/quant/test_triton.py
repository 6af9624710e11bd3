"""Triton kernels of the group quantizer: on CPU under TRITON_INTERPRET=1, and on CUDA if present."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _adversarial import adversarial_groups, bound_violations  # noqa: E402


def _interpreter_broken_reason():
    """Why this triton's interpreter cannot run any kernel here, or None.

    The interpreters of triton 3.0 and 3.1 return garbage with numpy >= 2 (even for a
    vector add: checked with torch 2.13 and numpy 2.4.6; they work with numpy 1.26, where
    these kernels pass). This is a triton defect that does not affect compiled kernels.
    """
    import numpy
    import triton

    tv = tuple(int(p) for p in triton.__version__.split(".")[:2])
    nv = int(numpy.__version__.split(".")[0])
    if tv < (3, 2) and nv >= 2:
        return f"the interpreter of triton {triton.__version__} does not work with numpy {numpy.__version__} (needs numpy < 2)"
    return None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_bit_exact_vs_reference_interpreted():
    """tests/quant/triton_interp_cases.py in a subprocess (the interpreter setting must not
    leak into the rest of the suite)."""
    reason = _interpreter_broken_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_interp_cases.py")]
    r = subprocess.run(cmd, cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")


@pytest.mark.cuda
def test_cuda_op_bit_exact_vs_reference():
    _cuda()
    import fewbit.quant as fq

    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = (torch.randn(100_003, device="cuda") * 3).to(dt)
        for bits in (1, 2, 4, 8):
            for st in (False, True):
                g1 = torch.Generator().manual_seed(1)
                g2 = torch.Generator().manual_seed(1)
                a = fq.quantize(x, bits, stochastic=st, generator=g1)
                b = fq.quantize_reference(x, bits, stochastic=st, generator=g2)
                torch.testing.assert_close(a.packed, b.packed, atol=0, rtol=0)
                torch.testing.assert_close(a.mins, b.mins, atol=0, rtol=0)
                torch.testing.assert_close(a.dequantize(), fq.dequantize_reference(b), atol=0, rtol=0)


@pytest.mark.cuda
def test_cuda_and_cpu_same_codes_for_same_generator_state():
    """One seed derivation for every device: the same CPU generator state gives bit-identical
    codes and stats on CPU (numba) and CUDA (Triton); CUDA generators are refused."""
    _cuda()
    import fewbit.quant as fq

    x = torch.randn(100_003) * 3
    for bits in (1, 2, 4, 8):
        for stats_dtype in (torch.bfloat16, torch.float32):
            a = fq.quantize(x, bits, stats_dtype=stats_dtype, generator=torch.Generator().manual_seed(9))
            b = fq.quantize(x.cuda(), bits, stats_dtype=stats_dtype, generator=torch.Generator().manual_seed(9))
            assert torch.equal(a.packed, b.packed.cpu()), (bits, stats_dtype)
            assert torch.equal(a.mins, b.mins.cpu()) and torch.equal(a.scales, b.scales.cpu())
            assert torch.equal(a.dequantize(), b.dequantize().cpu())
    with pytest.raises(ValueError, match="generator"):
        fq.quantize(x.cuda(), 2, generator=torch.Generator(device="cuda"))
    with pytest.raises(ValueError, match="generator"):
        fq.ActivationCompressor(2, generator=torch.Generator(device="cuda"))


@pytest.mark.cuda
def test_cuda_bound_on_adversarial_groups():
    _cuda()
    import fewbit.quant as fq

    for stats_dtype in (torch.float32, torch.bfloat16):
        for bits in (1, 2, 4, 8):
            x = adversarial_groups(bits, stats_dtype, group_size=64)
            a = fq.quantize(x.cuda(), bits, group_size=64, stats_dtype=stats_dtype, stochastic=False)
            b = fq.quantize_reference(x, bits, group_size=64, stats_dtype=stats_dtype, stochastic=False)
            assert bound_violations(x, a.mins.cpu(), a.scales.cpu(), bits, 64) == 0
            assert torch.equal(a.packed.cpu(), b.packed)
