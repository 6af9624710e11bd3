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
