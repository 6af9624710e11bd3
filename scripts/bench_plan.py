#!/usr/bin/env python
"""Benchmark of the memory-budget planner (fewbit.plan, docs/compression.md §4).

GPT-2 built from ``transformers.GPT2Config`` (random weights, nothing downloaded; default the
small CPU model of the tests). In one process: the unplanned ("vanilla") training step, then
for budgets of 1/2 and 1/4 of the vanilla peak (static memory + bytes saved for backward):

- ``planned``: ``fewbit.plan`` at that budget, applied with ``fewbit.convert_``;
- ``checkpoint``: full per-block checkpointing (every block under
  ``torch.utils.checkpoint``, nothing saved inside it) with the same fused loss.

For each: median step time (forward + backward) and measured peak (CPU: static + the bytes
saved for backward, ``fewbit.memory``; CUDA: ``torch.cuda.max_memory_allocated``), printed as
ratios to vanilla, the predicted peak, and whether the measured peak is within the budget
(full checkpointing keeps one block's recomputed tensors during backward, which the CPU
counter does not see; its predicted peak includes them). Also the MILP solve time.

Example:
    python scripts/bench_plan.py                      # 2 layers, width 64, batch 8, seq 32
    python scripts/bench_plan.py --layers 12 --hidden 768 --seq-len 256 --batch 1 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _training import check_device, positive_int

from fewbit._optimizers import OPTIMIZER_STATES


def _model(args):
    import transformers

    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 32),
                                  vocab_size=args.vocab, n_positions=max(args.seq_len, 32))
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(args.device).train()


def _step_time(model, batch, device, steps):
    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak(model, batch, static, device):
    from fewbit.memory import saved_tensor_report

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rep = saved_tensor_report(model, batch)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)) + static - 2 * sum(
            p.numel() * p.element_size() for p in model.parameters())  # + optimizer state, not allocated here
    return static + rep.saved_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--hidden", type=positive_int, default=64)
    ap.add_argument("--vocab", type=positive_int, default=100)
    ap.add_argument("--seq-len", type=positive_int, default=32)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZER_STATES))
    ap.add_argument("--steps", type=positive_int, default=5, help="timed steps per variant (median)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    check_device(ap, args.device)
    device = torch.device(args.device)

    import fewbit
    from fewbit import planner

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    prof = planner.profile(_model(args), batch, optimizer=args.optimizer, repeats=args.steps)
    static = prof.static_bytes
    vanilla = _model(args)
    t_van = _step_time(vanilla, batch, device, args.steps)
    peak_van = _peak(vanilla, batch, static, device)
    del vanilla
    print(f"GPT-2 {args.layers} layers, width {args.hidden}, vocab {args.vocab}, batch {args.batch}, "
          f"seq {args.seq_len}, {args.optimizer}, {device}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"vanilla: step {t_van * 1e3:.1f} ms, peak {peak_van / 2**20:.2f} MiB (static {static / 2**20:.2f} MiB)")
    print(f"{'budget':>8} {'variant':<11} {'step ms':>9} {'x vanilla':>10} {'peak MiB':>9} {'x vanilla':>10} "
          f"{'predicted':>10} {'in budget':>10}")
    checkpoint_all = [["recompute"] * len(bp.groups) for bp in prof.blocks]
    for frac in (0.5, 0.25):
        budget = int(frac * peak_van)
        t0 = time.perf_counter()
        try:
            p = planner.plan_from_profile(prof, budget)
        except ValueError as e:
            print(f"{frac:>8.2f} planned: {e}")
            continue
        solve = time.perf_counter() - t0
        ck = planner._make_plan(prof, checkpoint_all, budget)
        for name, plan_ in (("planned", p), ("checkpoint", ck)):
            model = _model(args)
            fewbit.convert_(model, plan_)
            t = _step_time(model, batch, device, args.steps)
            peak = _peak(model, batch, static, device)
            fits = "yes" if plan_.predicted_peak_bytes <= budget and peak <= budget else "no"
            print(f"{frac:>8.2f} {name:<11} {t * 1e3:>9.1f} {t / t_van:>10.2f} {peak / 2**20:>9.2f} "
                  f"{peak / peak_van:>10.2f} {plan_.predicted_peak_bytes / 2**20:>10.2f} {fits:>10}")
        print(f"         (MILP solve {solve * 1e3:.0f} ms; plan: "
              + ", ".join(f"{c.name}={c.option}" for c in p.blocks[0].groups) + ")")


if __name__ == "__main__":
    main()
