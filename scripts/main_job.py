#!/usr/bin/env python
"""The whole fewbit path on a built-in default, in about 10 minutes on a 2-core CPU.

1. Load the shipped few-bit tables (fit any that are missing with the solver) and print
   the approximation error of docs/method.md §3 for bits 1..4.
2. Plot f' and its 1..4-bit approximations (GELU, SiLU).
3. Train a small GPT-2-style byte-level LM on the Python standard library sources,
   vanilla and with 3-bit fewbit activations (same seed, same batches).
4. Count what one training step saves for backward (vanilla, fewbit, fewbit+quant), time
   one training step of each trained variant (interleaved, after a warm-up:
   :func:`time_steps`) and print both beside the final losses.
5. Write CSVs, ``main_job.md`` and PNG plots into ``--out`` (default ``./results``).

Example::

    python scripts/main_job.py            # ~14 CPU-minutes: ~10 minutes on 2 idle cores
    python scripts/main_job.py --quick    # seconds (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _data  # noqa: E402
import _training  # noqa: E402
import summarize_runs  # noqa: E402
import train_lm  # noqa: E402

#: Activations of the error table (stepwise ReLU is exact at 1 bit).
TABLE_NAMES = ("gelu", "gelu_tanh", "silu", "mish", "elu", "selu", "softplus", "tanh", "sigmoid", "relu")
BITS = (1, 2, 3, 4)


def load_tables(names: Iterable[str] = TABLE_NAMES, *, grid: int | None = None) -> dict[str, dict]:
    """``{name: {"tables": {bits: Table}, "source": "shipped"|"fitted"}}``.

    Shipped tables come from ``fewbit.tables``; a missing one is fitted with
    ``fewbit.solver.fit_many`` (numba) and marked ``"fitted"``.
    """
    from fewbit.activations import exact_table, get_activation
    from fewbit.table import load_shipped

    out = {}
    for name in names:
        tables = load_shipped(name)
        source = "shipped"
        if get_activation(name).stepwise:
            # Stepwise derivative: the exact 1-bit table (error 0) serves every bit width.
            tables, source = {b: exact_table(name) for b in BITS}, "exact"
        if tables is None or not set(BITS) <= set(tables):
            from fewbit import solver

            kwargs = {"grid": grid} if grid else {}
            tables = solver.fit_many(name, BITS, **kwargs)
            source = "fitted"
        out[name] = {"tables": {b: tables[b] for b in BITS}, "source": source}
    return out


def error_table(tables: dict[str, dict]) -> str:
    """Markdown table of the docs/method.md §3 errors (4 significant digits) and ratios per bit."""
    head = "| activation | " + " | ".join(f"{b} bit" for b in BITS) + " | source |"
    lines = [head, "|" + "---|" * (len(BITS) + 2)]
    for name, rec in tables.items():
        errs = [rec["tables"][b].error for b in BITS]
        cells = ["-" if e is None else f"{e:.4g}" for e in errs]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rec['source']} |")
    return "\n".join(lines)


def plot_approximations(tables: dict[str, dict], path: Path, names=("gelu", "silu")) -> Path:
    """f'(x) and the piecewise-constant q(x) for bits 1..4 (Novikov et al., fig. 2 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fewbit.activations import get_activation

    names = [n for n in names if n in tables]
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), squeeze=False)
    x = torch.linspace(-6, 6, 4001, dtype=torch.float64)
    for ax, name in zip(axes[0], names):
        act = get_activation(name)
        xg = x.clone().requires_grad_(True)
        (d,) = torch.autograd.grad(act.torch_fn(xg, **act.defaults).sum(), xg)
        ax.plot(x, d, color="k", lw=2, label="f'(x)")
        for b in BITS:
            t = tables[name]["tables"][b]
            idx = torch.searchsorted(torch.tensor(t.borders, dtype=torch.float64), x, right=False)
            q = torch.tensor(t.values, dtype=torch.float64)[torch.tensor(t.codes)[idx]]
            ax.step(x, q, where="post", lw=1.1, label=f"{b} bit (err {t.error:.3g})")
        ax.set_title(f"{name}: derivative and its few-bit approximations")
        ax.set_xlabel("x")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_steps(
    variants: Iterable[str],
    sizes: dict,
    data,
    *,
    device: str = "cpu",
    seed: int = 0,
    warmup: int = 3,
    rounds: int = 20,
    lr: float = 3e-3,
) -> dict[str, list[float]]:
    """Wall time of one training step per variant, measured interleaved after a warm-up.

    One model per variant (same seed, same batch, AdamW as in training) is warmed up for
    ``warmup`` steps (allocations, lazy imports, numba compiles), then the variants take
    turns, one step each, for ``rounds`` rounds; the order is reversed every other round
    (ABBA) so that a drift in machine load hits every variant alike. Nothing else runs
    in between (no saved-tensor counting, no evaluation).

    Returns:
        ``{variant: [seconds per step, one per round]}``.
    """
    variants = list(variants)
    dev = torch.device(device)
    x, y = _data.TextBatcher(data, sizes["seq_len"], sizes["batch_size"], seed).train_batch()
    x, y = x.to(dev), y.to(dev)
    runs = {}
    for variant in variants:
        torch.manual_seed(seed)
        model = train_lm.build_lm(sizes["n_layer"], sizes["n_embd"], sizes["n_head"], sizes["seq_len"]).to(dev)
        train_lm.apply_variant(model, variant)  # looked up on train_lm (tests/test_first_use.py spies on it)
        model.train()
        runs[variant] = (model, torch.optim.AdamW(model.parameters(), lr=lr))

    def step(variant: str) -> float:
        model, opt = runs[variant]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss = train_lm.lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    if dev.type == "cpu":  # time the numba kernels, not the reference standing in while they load
        from fewbit.ops import load_cpu_kernels

        load_cpu_kernels()
    for variant in variants:
        for _ in range(warmup):
            step(variant)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in (variants if r % 2 == 0 else variants[::-1]):
            times[variant].append(step(variant))
    return times


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    p.add_argument("--steps", type=int, default=600, help="training steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device: cuda when one is present, else cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for tests")
    p.add_argument("--force", action="store_true", help="overwrite the files of an earlier run in --out")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    _training.check_device(p, args.device)
    # the files this run writes: an earlier run's (or the user's own notes under those
    # names) were replaced without a word (review h70)
    names = ["approximations.png", f"lm_vanilla_seed{args.seed}.csv", f"lm_fewbit3_seed{args.seed}.csv",
             "memory.json", "lm_val_loss.png", "lm_train_loss.png", "main_job.md"]
    there = [n for n in names if (args.out / n).exists()]
    if there and not args.force:
        p.error(f"--out {args.out} already holds {', '.join(there)}; pass --force to overwrite, or choose "
                "another --out")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"cannot create --out {args.out}: {exc.strerror or exc}")
    t_start = time.perf_counter()
    print(f"fewbit main job: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {args.device}, output in {args.out}/", flush=True)

    # 1-2. tables ---------------------------------------------------------------------
    tables = load_tables(grid=1000 if args.quick else None)
    md_errors = error_table(tables)
    print("\n## Approximation error of f' (docs/method.md §3, uniform weight on [-10, 10])\n")
    print(md_errors, flush=True)
    approx_png = plot_approximations(tables, args.out / "approximations.png")

    # 3. training ---------------------------------------------------------------------
    if args.quick:
        sizes = dict(steps=min(args.steps, 6), batch_size=4, seq_len=32, n_layer=1, n_embd=32, n_head=2,
                     eval_every=3, val_batches=2, warmup=2)
        data = _data.load_text(max_train_bytes=200_000, max_val_bytes=50_000)
    else:
        sizes = dict(steps=args.steps, batch_size=8, seq_len=128, n_layer=2, n_embd=128, n_head=4,
                     eval_every=50, val_batches=8, warmup=30)
        data = _data.load_text()
    print(f"\n## Training a {sizes['n_layer']}-layer GPT-2 (width {sizes['n_embd']}, byte-level) on "
          f"{len(data.train):,} bytes of stdlib sources, {sizes['steps']} steps\n", flush=True)
    results = {}
    for variant in ("vanilla", "fewbit3"):
        rows = train_lm.run_lm(variant, args.seed, data=data, device=args.device, progress=True, **sizes)
        _training.write_csv(args.out / f"lm_{variant}_seed{args.seed}.csv", rows)
        results[variant] = rows

    # step time: interleaved and warmed up (the training loop above also counts saved bytes
    # and runs its variants one after the other, so its timings are not comparable)
    warm, rounds = (1, 2) if args.quick else (3, 20)
    times = time_steps(("vanilla", "fewbit3"), sizes, data, device=args.device, seed=args.seed,
                       warmup=warm, rounds=rounds)
    step_ms = {v: 1e3 * statistics.median(ts) for v, ts in times.items()}

    # 4. memory -------------------------------------------------------------------------
    from fewbit.memory import compare

    ids = torch.randint(0, 256, (sizes["batch_size"], sizes["seq_len"]), generator=torch.Generator().manual_seed(0))
    mem = compare(lambda: train_lm.build_lm(sizes["n_layer"], sizes["n_embd"], sizes["n_head"],
                                            sizes["seq_len"]).to(args.device),
                  {"input_ids": ids.to(args.device), "labels": ids.to(args.device)}, bits=3, saved_bits=4)
    (args.out / "memory.json").write_text(json.dumps(mem, indent=1))

    mib = 2.0**20
    lines = ["| variant | final val loss | val accuracy | saved for backward MiB | activations MiB | step ms |",
             "|---|---|---|---|---|---|"]
    for variant, key in (("vanilla", "vanilla"), ("fewbit3", "fewbit")):
        last = results[variant][-1]
        lines.append(f"| {variant} | {float(last['val_loss']):.4f} | {float(last['accuracy']):.4f} | "
                     f"{mem[key]['saved_bytes'] / mib:.2f} | {mem[key]['activation_bytes'] / mib:.3f} | "
                     f"{step_ms[variant]:.0f} |")
    q = mem["fewbit+quant"]
    lines.append(f"| fewbit3+quant4 (memory only) | - | - | {q['saved_bytes'] / mib:.2f} | "
                 f"{q['activation_bytes'] / mib:.3f} | - |")
    md_train = "\n".join(lines)
    v, f = mem["vanilla"], mem["fewbit"]
    summary_line = (f"Saved for backward per step: vanilla {v['saved_bytes'] / mib:.2f} MiB, fewbit 3-bit "
                    f"{f['saved_bytes'] / mib:.2f} MiB ({v['saved_bytes'] / f['saved_bytes']:.2f}x less; "
                    f"activations {v['activation_bytes'] / max(1, f['activation_bytes']):.1f}x less), "
                    f"fewbit 3-bit + 4-bit quantizer {q['saved_bytes'] / mib:.2f} MiB "
                    f"({v['saved_bytes'] / q['saved_bytes']:.2f}x less).")
    time_line = (f"Step time: fewbit3 {step_ms['fewbit3'] / step_ms['vanilla']:.2f}x vanilla's (median of "
                 f"{rounds} steps each, interleaved, after {warm} warm-up steps; wall time on this machine).")
    print("\n## Results (loss in nats per byte)\n")
    print(md_train)
    print("\n" + summary_line + "\n" + time_line, flush=True)

    # 5. plots and summary --------------------------------------------------------------
    runs = {"lm": {var: {args.seed: [{k: float(val) for k, val in r.items()} for r in rows]}
                   for var, rows in results.items()}}
    pngs = summarize_runs.plot(runs, args.out)
    report = ("# fewbit main job\n\n## Approximation error\n\n" + md_errors + "\n\n## Training\n\n" + md_train
              + "\n\n" + summary_line + "\n" + time_line + "\n")
    tmp = args.out / ".main_job.md.tmp"
    tmp.write_text(report)
    os.replace(tmp, args.out / "main_job.md")
    print(f"\nwrote {approx_png}, " + ", ".join(str(p_) for p_ in pngs)
          + f", {args.out / 'memory.json'}, {args.out / 'main_job.md'}")
    print(f"total time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
