#!/usr/bin/env python
"""Where the host time of an eager fewbit activation call goes: a cProfile of many calls.

Runs ``--calls`` eager forward (or forward+backward) calls of ``fewbit.GELU(bits=B)`` /
``fewbit.SiLU(bits=B)`` on ``--numel`` elements, where the kernels take almost no time, so
that what the profile shows is Python, dispatch and launch overhead, and prints the
functions with the most time of their own (``--top``), then the CPU time per call of the
same loop without the profiler beside torch's own module. On a GPU the launches are not
synchronised inside the loop (as in training), only after it.

Example (the host time issue 9 measured on an H100: 206-543 µs per forward call there):
    python scripts/profile_host.py --device cuda --activation gelu --mode full --calls 300

Without a GPU, ``--stub-triton`` measures fewbit's own share of that path: CPU tensors go
through the eager Triton branch (the CUDA backend's launch code and kernel objects) with
Triton's launch replaced by a no-op, so the kernels neither compile nor run and their
outputs are left unwritten (timing only; Triton's own launch cost is not included).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch
from _training import positive_int, thread_count

import fewbit
import fewbit.ops
from fewbit._checks import check_device

MODULES = {"gelu": ("GELU", torch.nn.GELU), "silu": ("SiLU", torch.nn.SiLU)}


def _loop(module, x, g, mode: str, calls: int) -> None:
    for _ in range(calls):
        y = module(x)
        if mode == "full":
            y.backward(g)


def _per_call_us(module, x, g, mode: str, calls: int, device: torch.device) -> float:
    """CPU time of this thread per call, µs (median of 5 loops)."""
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        _loop(module, x, g, mode, calls)
        times.append((time.thread_time() - t0) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sorted(times)[2]


def _stub_triton() -> None:
    """Route this process's CPU calls through fewbit's eager Triton branch with Triton's
    launch a no-op (``--stub-triton``): what remains is fewbit's and torch's host time."""
    from triton.runtime.jit import JITFunction

    from fewbit.ops import _pointwise, _triton

    if not isinstance(_triton._decode_mul_kernel, JITFunction):
        raise SystemExit("error: --stub-triton needs the compiled-mode kernels: unset TRITON_INTERPRET")
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    make = _pointwise._Plan.__init__

    def triton_plan(self, table, fn, full, dtype, device, backend, torch_fn=None):
        make(self, table, fn, full, dtype, device, "triton", torch_fn)

    _pointwise._Plan.__init__ = triton_plan


def run(args) -> str:
    device = torch.device(args.device)
    if args.stub_triton:
        _stub_triton()
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu" and not args.stub_triton:
        fewbit.ops.load_cpu_kernels()
    name, torch_cls = MODULES[args.activation]
    ours = getattr(fewbit, name)(bits=args.bits)
    theirs = torch_cls()
    x = torch.randn(args.numel, device=device, dtype=getattr(torch, args.dtype), requires_grad=True)
    g = torch.ones_like(x)
    for module in (ours, theirs):  # warm-up: tables, kernels compiled and loaded
        _loop(module, x, g, args.mode, 20)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof = cProfile.Profile()
    prof.enable()
    _loop(ours, x, g, args.mode, args.calls)
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    where = f"{args.device}, Triton branch with the launch stubbed" if args.stub_triton else args.device
    lines = [f"# fewbit.{name}(bits={args.bits}) on {args.numel} {args.dtype} elements, {where}, "
             f"mode {args.mode}, {args.calls} calls, torch {torch.__version__}", out.getvalue().rstrip()]
    ours_us = _per_call_us(ours, x, g, args.mode, args.calls, device)
    theirs_us = _per_call_us(theirs, x, g, args.mode, args.calls, device)
    lines.append(f"# CPU time per call without the profiler: fewbit.{name} {ours_us:.1f} µs, "
                 f"nn.{name} {theirs_us:.1f} µs ({ours_us - theirs_us:+.1f} µs)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--activation", default="gelu", choices=sorted(MODULES))
    ap.add_argument("--bits", type=int, default=3, choices=[1, 2, 3, 4], help="bits per element")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--numel", type=positive_int, default=1024, help="elements of the input")
    ap.add_argument("--mode", default="full", choices=["forward", "full"], help="forward, or forward+backward")
    ap.add_argument("--calls", type=positive_int, default=300, help="calls profiled (and per timing loop)")
    ap.add_argument("--top", type=positive_int, default=25, help="functions printed")
    ap.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--stub-triton", action="store_true",
                    help="CPU only: time fewbit's CUDA eager path with Triton's launch a no-op (no GPU needed)")
    args = ap.parse_args(argv)
    try:
        check_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    if args.stub_triton and torch.device(args.device).type != "cpu":
        ap.error(f"--stub-triton runs on CPU tensors: use --device cpu, got --device {args.device}")
    if args.stub_triton:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            ap.error(f"--stub-triton needs triton: {e}")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
