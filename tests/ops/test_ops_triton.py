"""Triton kernels under TRITON_INTERPRET=1 (CPU), in a subprocess so the interpreter
setting does not leak into the rest of the suite."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           str(HERE / "triton_interp_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2]


def test_lean_import():
    code = ("import sys, fewbit, fewbit.ops, torch; "
            "bad = [m for m in ('numba', 'triton', 'scipy') if m in sys.modules]; "
            "assert not bad, bad; assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
