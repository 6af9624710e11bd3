"""numba's kernels load in a background thread (fewbit.ops._cpu_loader); the reference
kernels stand in meanwhile with the same codes and gradients. Each mode in a new process
(the test session itself runs with FEWBIT_CPU_KERNELS=sync, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

_CHILD = r"""
import json, sys, torch
import fewbit
from fewbit.ops import _cpu_loader

def run():
    out = {}
    for name, dtype in (("GELU", torch.float32), ("SiLU", torch.bfloat16), ("GELU", torch.float64)):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(5000, generator=g) * 3).to(dtype)
        x[::97] = float("nan")
        x[1::101] = float("inf")
        x.requires_grad_()
        m = getattr(fewbit, name)(bits=3)
        y = m(x)
        gy = torch.randn(y.shape, generator=g).to(dtype)
        packed = y.grad_fn.saved_tensors[0].clone()  # the codes saved for backward
        y.backward(gy)
        out[f"{name}-{dtype}"] = (y.detach(), x.grad.clone(), packed)
    return out

def bits(t):  # bit patterns: NaN compares equal to itself
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])

first = run()
state = {"ready_after_first": _cpu_loader.ready(), "numba_before_wait": "numba" in sys.modules}
loaded = fewbit.ops.load_cpu_kernels()
second = run()
state["loaded"] = loaded
state["ready"] = _cpu_loader.ready()
state["equal"] = all(
    all(torch.equal(bits(a), bits(b)) for a, b in zip(first[k], second[k])) for k in first
)
print(json.dumps(state))
"""


def _child(mode: str) -> dict:
    env = {**os.environ, "FEWBIT_CPU_KERNELS": mode, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_background_load_same_results_before_and_after():
    """The first calls return before numba is loaded (the reference kernels ran them);
    after load_cpu_kernels() the numba kernels give the same outputs, gradients and
    packed codes (NaN and inf inputs included), float32, bfloat16 and float64."""
    state = _child("background")
    assert state["ready_after_first"] is False
    assert state["loaded"] is True and state["ready"] is True
    assert state["equal"] is True


def test_reference_mode_never_imports_numba():
    state = _child("reference")
    assert state["numba_before_wait"] is False
    assert state["loaded"] is False and state["ready"] is False
    assert state["equal"] is True


def test_sync_mode_loads_on_the_first_call():
    state = _child("sync")
    assert state["ready_after_first"] is True
    assert state["equal"] is True


def test_bad_mode_is_a_clear_error():
    code = ("import torch, fewbit\n"
            "try:\n    fewbit.GELU(bits=3)(torch.randn(4, requires_grad=True))\n"
            "except ValueError as e:\n    print('ValueError:', e)\n")
    env = {**os.environ, "FEWBIT_CPU_KERNELS": "fast"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ValueError: FEWBIT_CPU_KERNELS must be one of background, sync, reference, got 'fast'" in proc.stdout


def test_reference_path_is_the_numba_path_in_process(monkeypatch):
    """In this process (numba loaded): the eager path with the loader reporting "not
    ready" gives what the numba kernels give, bit for bit, for every table width."""
    import fewbit
    from fewbit.ops import _cpu_loader

    torch.manual_seed(0)
    for bits in (1, 2, 3, 4):
        x = torch.randn(3001) * 4
        x[5] = float("nan")
        gy = torch.randn(3001)
        outs = []
        for ready in (True, False):
            monkeypatch.setattr(_cpu_loader, "ready", lambda r=ready: r)
            xi = x.clone().requires_grad_()
            y = fewbit.GELU(bits=bits)(xi)
            y.backward(gy)
            outs.append((y.detach(), xi.grad))
        for a, b in zip(outs[0], outs[1]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), bits  # NaN included


_THREADS_CHILD = r"""
import torch, fewbit
from torch import nn
torch.set_num_threads(1)
m = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
fewbit.convert_(m, fewbit.Config(saved_bits=4, min_numel=0, activation_bits=ACTIVATION_BITS))
x = torch.randn(512, 512)
for _ in range(2):
    m(x).sum().backward()
fewbit.ops.load_cpu_kernels()
m(x).sum().backward()  # parallel numba kernels (activation and group quantizer)
print(torch.get_num_threads())
"""


@pytest.mark.parametrize("mode, activation_bits", [("background", 3), ("sync", 3), ("sync", None)])
def test_loading_numba_keeps_torchs_thread_count(mode, activation_bits):
    """numba's OpenMP layer, when it starts, set the calling thread's OpenMP thread count:
    after torch.set_num_threads(1) the first parallel fewbit call put torch (and numba,
    which follows torch) on every core (sync mode, the group quantizer alone, and every
    process before the loader)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores to tell 1 thread from all of them")
    env = {**os.environ, "FEWBIT_CPU_KERNELS": mode}
    env.pop("OMP_NUM_THREADS", None)
    code = f"ACTIVATION_BITS = {activation_bits}\n" + _THREADS_CHILD
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "1"
