#!/usr/bin/env python
"""Benchmark of GACT's re-plan (``fewbit.convert.compressor_of(model).adapt``): its time and
its peak memory, as ratios to a training step's measured in the same run.

The model is the GPT-2 of ``scripts/train_lm.py`` (``transformers.GPT2Config``, 256-byte
vocabulary, built from the config, nothing downloaded) at ``--layers`` / ``--width``, trained
with AdamW on random bytes. Measured, in one run:

1. a vanilla training step (forward + backward + AdamW): time, and peak memory above what is
   held before it (parameters, optimizer state);
2. the same step of the model converted with ``fewbit.Config(saved_bits="auto",
   average_bits=B)`` on a call that does not re-plan;
3. a re-plan call of ``adapt(model, closure, optimizer)``: one forward + backward at the
   probe bits, then one per saved tensor (GACT Alg. 1), so its time is about ``L + 1``
   steps' forward + backward; its peak memory above what is held before it, and that peak
   beyond the converted step's in bytes per parameter (what the measurement itself holds:
   its probe gradient, and the previous call's, which a re-plan right after another keeps
   for the gradient-variance pair: every timed call is one, ``adapt_interval=1``).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` at the
start; on the CPU the maximum over the call of the bytes of the tensors created minus those
destroyed, from ``torch.profiler``'s memory timeline (``profile_memory=True``, what
``export_memory_timeline`` draws; tensors of the allocator only, not the process's resident
memory), over the second of two runs of the call (the CPU allocator reports no free of a
block allocated before profiling began); the profiler's own overhead makes the CPU times
of that pass meaningless, so times come from a separate pass without it.

Example:
    python scripts/bench_adapt.py --layers 4 --width 256 --batch-size 8 --seq-len 128
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from _training import positive_int
from bench_quant import _time, _versions
from train_lm import build_lm, lm_loss

import fewbit
from fewbit._checks import check_device
from fewbit.convert import compressor_of
from fewbit.memory import peak_allocated_bytes


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated during ``fn()`` above those allocated when it starts
    (:func:`fewbit.memory.peak_allocated_bytes`; see the module docstring)."""
    return peak_allocated_bytes(fn, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--average-bits", type=float, default=2.0, help="GACT's average bits per saved element")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs (the minimum is printed)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    try:
        device = check_device(args.device)
    except ValueError as exc:
        p.error(str(exc))
    if args.width % args.heads:
        p.error(f"--width must be a multiple of --heads, got {args.width} and {args.heads}")
    try:  # adapt_interval=1: every adapt call re-plans (what is timed), the steps call none
        config = fewbit.Config(saved_bits="auto", average_bits=args.average_bits, adapt_interval=1)
    except ValueError as exc:
        p.error(f"--average-bits: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(_versions())

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=gen).to(device)
    y = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=gen).to(device)

    def build():
        torch.manual_seed(0)
        model = build_lm(args.layers, args.width, args.heads, args.seq_len).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def stepper(model, opt):
        def step():
            opt.zero_grad(set_to_none=True)
            lm_loss(model, x, y).backward()
            opt.step()
        return step

    vanilla, vopt = build()
    n_params = sum(q.numel() for q in vanilla.parameters())
    v_step = stepper(vanilla, vopt)
    v_step()  # AdamW's state exists before anything is measured
    v_time = _time(v_step, args.repeats, device)
    v_peak = peak_bytes(v_step, device)
    del vanilla, vopt, v_step

    model, opt = build()
    fewbit.convert_(model, config)
    comp = compressor_of(model)
    step = stepper(model, opt)
    closure = lambda: lm_loss(model, x, y)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # GACT's variance alert: not what is measured here
        comp.adapt(model, closure, opt)  # call 1 re-plans
        step()
        g_time = _time(step, args.repeats, device)
        g_peak = peak_bytes(step, device)

        def replan():
            assert comp.adapt(model, closure, opt)

        opt.zero_grad(set_to_none=True)
        a_time = _time(replan, args.repeats, device)
        a_peak = peak_bytes(replan, device)
    tensors = len(comp.policy.sensitivity)

    mib = 2.0**20
    print(f"\n== GACT adapt cost: GPT-2 {args.layers} x {args.width}, batch {args.batch_size} x {args.seq_len}, "
          f"{n_params / 1e6:.2f} M parameters ({n_params * 4 / mib:.1f} MiB float32), {device}")
    print(f"{'':34s} {'time ms':>9s} {'x vanilla':>9s} {'peak MiB':>9s} {'x vanilla':>9s}")
    print(f"{'vanilla step':34s} {v_time * 1e3:9.1f} {1.0:9.2f} {v_peak / mib:9.1f} {1.0:9.2f}")
    print(f"{f'gact{args.average_bits:g} step (no re-plan)':34s} {g_time * 1e3:9.1f} {g_time / v_time:9.2f} "
          f"{g_peak / mib:9.1f} {g_peak / v_peak:9.2f}")
    print(f"{f're-plan ({tensors} tensors, {tensors + 1} passes)':34s} {a_time * 1e3:9.1f} {a_time / v_time:9.2f} "
          f"{a_peak / mib:9.1f} {a_peak / v_peak:9.2f}")
    print(f"re-plan time per pass: {a_time / (tensors + 1) / v_time:.2f} x a vanilla step; "
          f"re-plan peak beyond the converted step's: {(a_peak - g_peak) / n_params:.1f} bytes per parameter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
