"""Triton kernels of the group quantizer, on CPU under TRITON_INTERPRET=1 (and on CUDA if present)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import torch
    from fewbit.quant import _triton as T, _reference as ref

    torch.manual_seed(0)
    bad = []
    seed = 123456789012345
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for bits in (1, 2, 4, 8):
            for G, n in ((256, 1000), (12, 333), (7, 64), (1, 9)):
                for sd in (torch.bfloat16, torch.float32):
                    for st in (False, True):
                        x = (torch.randn(n) * 3 + 1).to(dt)
                        if G == 7:
                            x[5] = float("nan")
                            x[20] = float("inf")
                        a = T.quantize(x, bits, G, seed, st, sd, block_w=1024, block_elems=1 << 14)
                        b = ref.quantize_reference(x, bits, G, seed if st else None, sd)
                        same = lambda u, v: torch.equal(u.nan_to_num(9.0), v.nan_to_num(9.0)) and torch.equal(u.isnan(), v.isnan())
                        if not (torch.equal(a[0], b[0]) and same(a[1], b[1]) and same(a[2], b[2])):
                            bad.append(("quantize", dt, bits, G, sd, st))
                        da = T.dequantize(*b, bits, G, n, dt, block_w=1024)
                        db = ref.dequantize_reference(*b, bits, G, n, dt)
                        if not same(da, db):
                            bad.append(("dequantize", dt, bits, G, sd, st))
    # empty input, a multi-program launch (small blocks) and a tail
    x = torch.randn(5000)
    a = T.quantize(x, 4, 256, seed, True, torch.bfloat16, block_w=64, block_elems=1024)
    b = ref.quantize_reference(x, 4, 256, seed, torch.bfloat16)
    if not torch.equal(a[0], b[0]):
        bad.append("multi-program")
    e = T.quantize(torch.empty(0), 2, 256, 0, False, torch.bfloat16)
    if e[0].numel() or e[1].numel():
        bad.append("empty")
    print("BAD", bad)
    """
)


def test_triton_kernels_bit_exact_vs_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BAD []" in r.stdout, r.stdout[-3000:]


@pytest.mark.cuda
def test_cuda_op_bit_exact_vs_reference():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
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
