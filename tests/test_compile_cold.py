"""``torch.compile(..., fullgraph=True)`` of models with fewbit modules whose tables and
kernel tensors are not loaded yet (a new process: the first call is the compiled one).

A cache miss (lock, file reads) inside the traced code broke the graph, so
``fullgraph=True`` raised; with several settings in one graph, a cache read early in the
trace also missed a setting prepared later. Each case runs in a new process, so the
caches are truly cold."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CASE = textwrap.dedent("""
    import sys, torch, fewbit
    torch.manual_seed(0)
    backend = sys.argv[1]
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), fewbit.GELU(), torch.nn.Linear(16, 16), fewbit.SiLU(),
                                fewbit.ReLU(), fewbit.GELU(bits=2), fewbit.Mish(), fewbit.GELU(approximate="tanh"))
    x = torch.randn(4, 16)
    x[0, 0] = float("nan")  # a non-finite input: the record path of the traced ops
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y = compiled(x)  # the first call of every setting in this process is the traced one
    y.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    ref.sum().backward()
    assert torch.equal(y, ref) or torch.allclose(y, ref, equal_nan=True), (y, ref)
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, equal_nan=True)
    print("ok")
""")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fullgraph_compile_with_cold_caches(backend, tmp_path):
    env = dict(os.environ, FEWBIT_CACHE_DIR=str(tmp_path / "cache"), FEWBIT_CPU_KERNELS="sync")
    r = subprocess.run([sys.executable, "-c", CASE, backend], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
