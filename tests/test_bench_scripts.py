"""scripts/bench_activations.py at a small size: runs, and its --json has the documented keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_activations_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/bench_activations.py", "--activations", "gelu", "--dtypes", "float32",
           "--sizes", "8", "--mode", "all", "--threads", "1", "--repeat", "1", "--no-compile", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"machine", "versions", "device", "threads", "thp", "loadavg", "compile"} <= set(doc["meta"])
    labels = {r["candidate"] for r in doc["results"]}
    assert {"torch.gelu", "nn.GELU", "fewbit.ops.pointwise", "fewbit.GELU"} <= labels
    for r in doc["results"]:
        assert r["log2_n"] == 8 and r["dtype"] == "float32"
        for mode in ("forward", "backward", "full"):
            cell = r[mode]
            assert {"ms", "ratio_eager", "ratio_compile", "gbs", "pct_copy"} == set(cell)
            assert cell["ms"] > 0 and cell["gbs"] > 0 and cell["ratio_compile"] is None  # --no-compile
        assert r["saved_bytes"] > 0
    fewbit = next(r for r in doc["results"] if r["candidate"] == "fewbit.GELU")
    # 2^8 elements: 96 bytes of 3-bit codes + the 32-byte shared values table, against 1 KiB
    # (at 2^3 the shared table alone outweighs the input)
    assert fewbit["saved_ratio"] < 0.2
    host = {h["candidate"]: h for h in doc["host"]}
    assert set(host) == {"torch.gelu", "nn.GELU", "fewbit.ops.pointwise", "fewbit.GELU"}
    assert all(h["forward_us"] > 0 and h["full_us"] > 0 for h in host.values())


@pytest.mark.parametrize("script", ["scripts/bench_activations.py", "scripts/bench_model.py"])
def test_bench_json_must_be_a_new_file(tmp_path, script):
    """``--json`` in a missing directory, empty (wrote nothing), or an existing file (was
    overwritten without a word after the whole run): refused before the run, in one line."""
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    for path in (str(tmp_path / "no" / "x.json"), "", str(kept)):
        proc = subprocess.run([sys.executable, script, "--json", path], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, (path, proc.stderr[-500:])
        last = proc.stderr.strip().splitlines()[-1]
        assert "Traceback" not in proc.stderr and "--json" in last, (path, proc.stderr)
    assert kept.read_text() == "{}"


def test_scripts_refuse_bad_arguments_in_one_line():
    """Each once ended in a traceback (or ran on with nan: train_lm.py --lr inf)."""
    cases = [
        (["scripts/train_lm.py", "--lr", "nan"], "--lr"),
        (["scripts/train_lm.py", "--lr", "inf", "--steps", "1"], "--lr"),
        (["scripts/train_cnn.py", "--warmup", "-1"], "--warmup"),
        # review h47: a segfault, a negative seed summarize_runs.py ignored, tracebacks after
        # the corpus was read, an --out file found after the whole run
        (["scripts/train_lm.py", "--threads", "100000"], "--threads"),
        (["scripts/train_cnn.py", "--seeds", "-1"], "--seeds"),
        (["scripts/train_lm.py", "--seq-len", "1"], "--seq-len"),
        (["scripts/train_lm.py", "--arch", "llama", "--width", "6", "--heads", "2"], "--heads"),
        (["scripts/train_cnn.py", "--out", "README.md"], "--out"),
        (["scripts/main_job.py", "--device", "foo"], "--device"),
        (["scripts/bench_plan.py", "--layers", "0"], "--layers"),
        (["scripts/bench_plan.py", "--optimizer", "lion"], "--optimizer"),
        (["scripts/bench_quant.py", "--sizes", "0"], "--sizes"),
        (["scripts/bench_solver.py", "--k", "1000000"], "--k"),
        # a RuntimeError traceback or torch's long device message before fewbit._checks.check_device
        (["scripts/bench_linear_cross_entropy.py", "--device", "CPU"], "--device"),
        (["scripts/bench_quant.py", "--device", "CPU"], "--device"),
        (["scripts/bench_activations.py", "--device", "CPU"], "--device"),
        (["scripts/bench_adapt.py", "--device", "CPU"], "--device"),
        (["scripts/bench_adapt.py", "--average-bits", "0.5"], "--average-bits"),
        (["scripts/bench_adapt.py", "--width", "10", "--heads", "4"], "--width"),
        (["scripts/bench_model.py", "--device", "CPU"], "--device"),
        (["scripts/bench_model.py", "--layers", "0"], "--layers"),
        (["scripts/bench_model.py", "--threads", "-1"], "--threads"),
        (["scripts/bench_model.py", "--threads", "100000"], "--threads"),  # torch segfaulted
        (["scripts/bench_model.py", "--json", "/nonexistent/dir/out.json"], "--json"),  # after the whole run
        (["scripts/profile_host.py", "--calls", "0"], "--calls"),
        (["scripts/profile_host.py", "--device", "CPU"], "--device"),
        # review h70: tracebacks after seconds of timing, or after the fits
        (["scripts/bench_quant.py", "--compressors", "foo", "--skip-throughput"], "--compressors"),
        (["scripts/bench_solver.py", "--functions", "gleu"], "--functions"),
        (["scripts/bench_solver.py", "--bits", "9"], "--bits"),
        (["scripts/build_tables.py", "--only", "gelu", "--out", "README.md"], "--out"),
    ]
    for args, needle in cases:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (args, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr and needle in proc.stderr.strip().splitlines()[-1], (args, proc.stderr)


def test_bench_adapt_runs_and_its_cpu_peak_is_the_bytes_held(monkeypatch):
    """scripts/bench_adapt.py at a tiny size prints its three rows with positive times and
    peaks; its CPU peak (torch.profiler's memory timeline) of a function with known
    allocations is what was held at most (4 + 8, then 8 + 4 + 16 MiB of float32), frees of
    tensors made before the call included."""
    import torch

    cmd = [sys.executable, "scripts/bench_adapt.py", "--layers", "1", "--width", "32", "--heads", "2",
           "--seq-len", "16", "--batch-size", "2", "--repeats", "1", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in proc.stdout.splitlines()
            if line.startswith(("vanilla step", "gact2 step", "re-plan ("))}
    assert len(rows) == 3 and all(float(v[0]) > 0 and float(v[2]) > 0 for v in rows.values()), proc.stdout
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from bench_adapt import peak_bytes

    def allocate():
        a = torch.empty(1 << 20)
        b = torch.empty(1 << 21)
        del a
        c = torch.empty(1 << 20)
        d = b.double()
        del b, c, d

    assert peak_bytes(allocate, torch.device("cpu")) == 28 << 20
    # a temporary freed inside a composite op (F.cross_entropy's 32 MiB log-softmax) counts:
    # a sum of the ops' self memory had put its free at the op's start (0 bytes)
    logits, target = torch.randn(4096, 2048), torch.randint(0, 2048, (4096,))
    assert peak_bytes(lambda: torch.nn.functional.cross_entropy(logits, target), torch.device("cpu")) >= 32 << 20
    # a tensor made before the call and replaced by it: the free is seen (the call runs twice),
    # so the peak above the start is 0, as CUDA's max_memory_allocated - start (16 MiB before)
    buffers = [torch.empty(1 << 22)]

    def replace():
        buffers[0] = None
        buffers[0] = torch.empty(1 << 22)

    assert peak_bytes(replace, torch.device("cpu")) == 0
