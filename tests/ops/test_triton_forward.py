"""The fused forward (y and codes in one pass; fewbit.ops._triton.forward_encode_triton)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_fused_forward_under_interpreter():
    """tests/ops/triton_forward_cases.py under TRITON_INTERPRET=1, in a subprocess (the
    interpreter setting must not leak into the rest of the suite)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "triton_forward_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2]


def _fused_model(inplace: bool):
    import torch

    from fewbit.functional import load_table
    from fewbit.ops import _triton  # noqa: F401  (registers fewbit::forward_encode_triton{,_})
    from fewbit.ops import table_tensors

    table = load_table("gelu", 3)
    # copies: table_tensors' tensors are shared by every call of the process, and tracing
    # with buffers that alias them changed them (later GELU gradients in the suite were wrong)
    borders, codes, _ = (t.clone() for t in table_tensors(table, "cpu", torch.float32))

    class Model(torch.nn.Module):
        """Linear -> fused GELU forward (y and codes in one launch) -> Linear."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
            self.register_buffer("borders", borders)
            self.register_buffer("codes", codes)

        def forward(self, x):
            h = self.fc1(x)
            if inplace:
                packed, record = torch.ops.fewbit.forward_encode_triton_(h, self.borders, self.codes, 3, 7, 1024,
                                                                         "gelu", [])
            else:
                h, packed, record = torch.ops.fewbit.forward_encode_triton(h, self.borders, self.codes, 3, 7, 1024,
                                                                           "gelu", [])
            return self.fc2(h), packed, record

    return Model()


@needs_triton
@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
def test_fused_forward_traces_with_fullgraph(inplace):
    """torch.compile(fullgraph=True) of a model that calls the fused triton_op traces without
    a graph break into the Triton launch itself (triton_op + wrap_triton): the graph holds
    the kernel, not an opaque call. CPU tensors stand in for CUDA (tracing does not launch;
    running the compiled kernel needs a GPU)."""
    import torch
    from test_ops_triton import _forward_graph

    model = _fused_model(inplace)
    with torch.no_grad():
        code = _forward_graph(model, torch.randn(4, 16))
    assert code.count("higher_order.triton_kernel_wrapper_functional(") == 1, code
    assert "'FN': 0" in code and "'CLASSES': 7" in code and "'BITS': 3" in code, code  # the fused kernel's launch
    assert "fewbit.forward_encode_triton" not in code, code


def _cuda_cases(fn):
    """(dtype, x, fused y, torch's y, packed, reference codes) on a GPU, for each dtype."""
    import torch

    import fewbit.ops as ops
    from fewbit.activations import get_activation
    from fewbit.functional import load_table
    from fewbit.ops import _triton

    table = load_table(fn, 3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        b, c, _ = ops.table_tensors(table, "cuda", dtype)
        x = (torch.randn(1 << 20, device="cuda", dtype=torch.float64) * 4).to(dtype)
        x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -30.0])
        y, packed, _ = _triton.forward_encode_triton(x, b, c, 3, 0, 0, fn, {})
        yield dtype, x, y, get_activation(fn).torch_fn(x), packed, ops.encode_reference(
            x.cpu(), table.borders, table.codes, 3)


@pytest.mark.cuda
@pytest.mark.parametrize("fn", ["gelu_tanh", "silu"])
def test_cuda_y_bitwise_torch_and_codes_bitwise_reference(fn):
    """On a GPU, for the functions whose fused forward the eager path uses (``FUSED_EAGER``):
    y equals torch's own CUDA kernel bit for bit (same formula, same CUDA math functions,
    nvcc's contraction and no flush-to-zero) for float32, float16, bfloat16 and float64, and
    the codes equal the reference's (passed on an H100, torch 2.11 + CUDA 13.0, triton 3.6)."""
    import torch
    from ops_testutils import bits_equal

    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    from fewbit.ops import _triton

    assert fn in _triton.FUSED_EAGER
    for dtype, x, y, expect, packed, codes in _cuda_cases(fn):
        assert bits_equal(y, expect), dtype
        assert torch.equal(packed.cpu(), codes), dtype


def test_gelu_not_fused_in_eager_forward():
    """gelu's fused y is not torch's bit for bit on a GPU (Triton's libdevice erf against the
    erff torch was built with; on an H100 y differed at 11 % of 2**24 float32 points in
    [-6, 6], e.g. by 3.6 % at x = -4.79): the eager forward
    takes torch's gelu and the encoder (fewbit.ops._pointwise._triton_forward)."""
    pytest.importorskip("triton")
    from fewbit.ops import _triton

    assert "gelu" not in _triton.FUSED_EAGER
    assert _triton.FUSED_EAGER <= _triton.FUSED_FORWARD


@pytest.mark.cuda
def test_cuda_fused_gelu_within_one_erf_ulp():
    """gelu's fused kernel (not used by the eager forward) on a GPU: the codes are the
    reference's, and y is torch's up to what one last-bit difference of erf makes,
    ``|x| / 2 * ulp(1)/2`` (the cancellation of ``1 + erf`` for x < -3), plus one unit in the
    last place of y's dtype for the final rounding."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    for dtype, x, y, expect, packed, codes in _cuda_cases("gelu"):
        assert torch.equal(packed.cpu(), codes), dtype
        finite = x.isfinite()
        assert torch.equal(y[~finite].isnan(), expect[~finite].isnan()), dtype
        assert torch.equal(y[~finite].nan_to_num(), expect[~finite].nan_to_num()), dtype
        erf_ulp = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
        xf, yf, ef = (t[finite].double() for t in (x, y, expect))
        ulp_out = torch.finfo(dtype).eps * ef.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((yf - ef).abs() <= xf.abs() / 2 * erf_ulp + ulp_out).all(), dtype
