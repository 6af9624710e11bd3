#!/usr/bin/env python
"""Training-step time and memory of a model with fewbit modules, eager and compiled.

The model is a stack of pre-norm MLP blocks, ``x + W2 act(W1 LayerNorm(x))`` (``--width``
features, ``--expand`` times wider inside, ``--layers`` blocks), on ``--tokens`` rows of
random data: the part of a transformer where the activation's saved input is largest.
Four variants run in one process on the same weights and inputs:

- ``vanilla``: torch's activation (``nn.GELU`` / ``nn.SiLU``), eager;
- ``fewbit``: the same model after ``fewbit.convert_(model, fewbit.Config(activation_bits=B))``, eager;
- ``compile(vanilla)``, ``compile(fewbit)``: ``torch.compile(model, fullgraph=True)`` of
  each (a graph break raises, so a row printed means none).

For each: the median time of a training step (forward, mean-square loss, backward; CUDA
events on a GPU, wall time on the CPU; median of ``--repeat`` steps after ``--warmup``),
its ratio to ``vanilla`` eager and, for a compiled variant, to the same model eager; the
bytes saved for backward (every storage once, parameters excluded) and, on CUDA, the peak
memory of the step above the memory held before it, with their ratios to ``vanilla``.
The first compiled step's time (compilation) is printed apart. ``--json PATH`` writes it all.

Example (an H100-sized case):
    python scripts/bench_model.py --device cuda --dtype bfloat16 --width 2048 --layers 8 \\
        --tokens 16384
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch
from _cli import new_file
from _training import positive_int, saved_bytes, thread_count
from torch import nn

import fewbit
import fewbit.ops
from fewbit._checks import check_device

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


class Block(nn.Module):
    def __init__(self, width: int, expand: int, act: type[nn.Module]):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, expand * width)
        self.act = act()
        self.down = nn.Linear(expand * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def _model(args, device, dtype) -> nn.Module:
    torch.manual_seed(0)
    act = ACTIVATIONS[args.activation]
    return nn.Sequential(*[Block(args.width, args.expand, act) for _ in range(args.layers)]).to(device, dtype)


def _timer(device):
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return timed


def measure(label: str, model: nn.Module, runner, x: torch.Tensor, args, device) -> dict:
    timed = _timer(device)

    def step():
        model.zero_grad(set_to_none=True)
        out = runner(x)
        out.float().pow(2).mean().backward()

    first = timed(step)  # compilation for a compiled runner
    for _ in range(max(args.warmup - 1, 0)):
        step()
    times = [timed(step) for _ in range(args.repeat)]
    peak = None
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - held
    return {"variant": label, "first_step_s": first, "step_ms": statistics.median(times) * 1e3,
            "step_ms_min": min(times) * 1e3, "peak_bytes": peak}


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        fewbit.ops.load_cpu_kernels()  # time the numba kernels, not the reference that stands in while they load
    x = torch.randn(args.tokens, args.width, device=device, dtype=dtype)
    vanilla = _model(args, device, dtype)
    converted = copy.deepcopy(vanilla)
    fewbit.convert_(converted, fewbit.Config(activation_bits=args.bits))
    variants = [("vanilla", vanilla, vanilla), ("fewbit", converted, converted)]
    if not args.no_compile:
        variants += [(f"compile({name})", m, torch.compile(m, fullgraph=True)) for name, m, _ in variants[:2]]
    meta = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "dtype": args.dtype, "activation": args.activation, "bits": args.bits, "width": args.width,
            "expand": args.expand, "layers": args.layers, "tokens": args.tokens, "repeat": args.repeat}
    print("# " + ", ".join(f"{k} {v}" for k, v in meta.items()))
    print("# step: forward + mean-square loss + backward; median of the timed steps; ratio: to vanilla eager; "
          "vs eager: a compiled variant's time over the same model's eager time (< 1: faster)")
    rows = []
    for label, model, runner in variants:
        row = measure(label, model, runner, x, args, device)
        xs = x.detach().requires_grad_()
        row["saved_bytes"] = saved_bytes(lambda: runner(xs), exclude=model)  # a compiled graph's own
        rows.append(row)
    ref = rows[0]
    eager = {r["variant"]: r for r in rows}
    print(f"{'variant':<18} {'step ms':>9} {'ratio':>6} {'vs eager':>8} {'first s':>8} {'saved MiB':>10} "
          f"{'ratio':>6} {'peak MiB':>9} {'ratio':>6}")
    for r in rows:
        r["ratio"] = r["step_ms"] / ref["step_ms"]
        own = r["variant"].removeprefix("compile(").removesuffix(")")
        r["ratio_to_eager"] = r["step_ms"] / eager[own]["step_ms"] if r["variant"] != own else None
        r["saved_ratio"] = r["saved_bytes"] / ref["saved_bytes"]
        r["peak_ratio"] = r["peak_bytes"] / ref["peak_bytes"] if r["peak_bytes"] and ref["peak_bytes"] else None
        vs = f"{r['ratio_to_eager']:>8.3f}" if r["ratio_to_eager"] is not None else f"{'-':>8}"
        peak = (f"{r['peak_bytes'] / 2**20:>9.1f} {r['peak_ratio']:>6.3f}" if r["peak_ratio"] is not None
                else f"{'-':>9} {'-':>6}")
        print(f"{r['variant']:<18} {r['step_ms']:>9.3f} {r['ratio']:>6.3f} {vs} {r['first_step_s']:>8.2f} "
              f"{r['saved_bytes'] / 2**20:>10.1f} {r['saved_ratio']:>6.3f} {peak}", flush=True)
    return {"meta": meta, "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--activation", default="gelu", choices=sorted(ACTIVATIONS))
    ap.add_argument("--bits", type=int, default=3, choices=[1, 2, 3, 4], help="bits per element of the activations")
    ap.add_argument("--width", type=positive_int, default=1024)
    ap.add_argument("--expand", type=positive_int, default=4)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--tokens", type=positive_int, default=8192, help="rows of the input")
    ap.add_argument("--warmup", type=positive_int, default=3, help="untimed steps, the first (compiling) one included")
    ap.add_argument("--repeat", type=positive_int, default=20, help="timed steps")
    ap.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-compile", action="store_true", help="eager variants only")
    ap.add_argument("--json", metavar="PATH", type=new_file,
                    help="also write the results as JSON to PATH (a new file)")
    args = ap.parse_args(argv)
    try:
        check_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    result = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
