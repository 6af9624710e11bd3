#!/usr/bin/env python
"""Summarise training CSVs: a markdown table and loss curves with seed bands.

Reads ``DIR/<task>_<variant>_seed<N>.csv`` as written by ``train_lm.py`` / ``train_cnn.py``
and writes, per task:

- ``OUT/summary.md``: one table per task with, per variant, the number of seeds, the final
  validation loss (mean ± sample std over seeds), the final accuracy, and the peak bytes
  saved for backward (and the ratio vanilla / variant). Step times are not printed: the
  runs were timed one after the other with saved-byte counting on, so their ratio says
  more about the machine's load at the time than about the variants (the main job and
  ``scripts/bench_activations.py`` time variants interleaved);
- ``OUT/<task>_val_loss.png`` and ``OUT/<task>_train_loss.png``: mean curve per variant with
  a band from the min to the max over seeds (as in Novikov et al., ICML 2023, fig. 4-5).

Example::

    python scripts/summarize_runs.py results --out results
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable

from _cli import out_dir, split_tag

_NAME = re.compile(r"^(?P<task>[A-Za-z0-9]+)_(?P<variant>.+)_seed(?P<seed>\d+)\.csv$")
_ORDER = ("vanilla", "fewbit1", "fewbit2", "fewbit3", "fewbit4", "actnn2", "fewbit3+quant4",
          "fewbit3+quant2", "gact2", "gact4", "division", "adacc")


def _rank(variant: str) -> tuple:
    name, tag = split_tag(variant)
    return (_ORDER.index(name), tag) if name in _ORDER else (len(_ORDER), variant)


def load_runs(directory: Path) -> dict[str, dict[str, dict[int, list[dict]]]]:
    """``{task: {variant: {seed: rows}}}`` with numeric values.

    Raises:
        ValueError: if a matching CSV lacks the expected columns or has no rows.
    """
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(Path(directory).glob("*.csv")):
        m = _NAME.match(path.name)
        if not m:
            continue
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        need = {"step", "train_loss", "val_loss", "step_time_s", "peak_saved_bytes"}
        if not rows or not need <= set(rows[0]):
            raise ValueError(f"{path}: expected columns {sorted(need)} and at least one row")
        parsed = []
        for i, r in enumerate(rows, start=2):
            if None in r:  # csv's key for cells past the header
                raise ValueError(f"{path}: line {i} has {len(r[None])} more cells than the header")
            try:
                parsed.append({k: (float(v) if v not in ("", None) else math.nan) for k, v in r.items()})
            except ValueError:
                bad = next(k for k, v in r.items() if v not in ("", None) and not _is_number(v))
                raise ValueError(f"{path}: line {i}, column {bad!r}: not a number: {r[bad]!r}") from None
        runs[m["task"]][m["variant"]][int(m["seed"])] = parsed
    return runs


def _is_number(v: str) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: dict) -> dict[str, list[dict]]:
    """Per task, one dict per variant with the summary numbers."""
    out = {}
    for task, variants in sorted(runs.items()):
        rows = []
        for variant in sorted(variants, key=_rank):
            seeds = variants[variant]
            finals = [r[-1] for r in seeds.values()]
            vl = _mean_std([f["val_loss"] for f in finals])
            acc = _mean_std([f.get("accuracy", math.nan) for f in finals])
            peak = max(max(r["peak_saved_bytes"] for r in rows_) for rows_ in seeds.values())
            # the first interval includes warm-up (allocations, lazy imports, kernel compiles)
            times = [statistics.fmean(r["step_time_s"] for r in (rows_[1:] or rows_)) for rows_ in seeds.values()]
            row = {"variant": variant, "seeds": len(seeds), "val_loss": vl, "accuracy": acc,
                   "peak_saved_bytes": peak, "step_time_s": statistics.fmean(times)}
            rows.append(row)
        by_name = {row["variant"]: row for row in rows}
        for row in rows:
            # vanilla of the same group size or noise draw (train_*.py tags it too), else untagged
            base = by_name.get("vanilla" + split_tag(row["variant"])[1]) or by_name.get("vanilla")
            row["saved_ratio"] = base["peak_saved_bytes"] / row["peak_saved_bytes"] if base and row["peak_saved_bytes"] else math.nan
            row["time_ratio"] = row["step_time_s"] / base["step_time_s"] if base else math.nan
        out[task] = rows
    return out


def to_markdown(summary: dict[str, list[dict]]) -> str:
    lines = []
    for task, rows in summary.items():
        lines += [f"### {task}", "",
                  "| variant | seeds | final val loss | final accuracy | peak saved MiB | saved ratio |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            vl, vs = r["val_loss"]
            am, as_ = r["accuracy"]
            acc = "-" if math.isnan(am) else f"{am:.4f} ± {as_:.4f}"
            lines.append(
                f"| {r['variant']} | {r['seeds']} | {vl:.4f} ± {vs:.4f} | {acc} | "
                f"{r['peak_saved_bytes'] / 2**20:.2f} | {r['saved_ratio']:.2f}x |")
        lines.append("")
    lines.append("val loss / accuracy: last evaluation, mean ± sample std over seeds; saved ratio: "
                 "vanilla / variant peak bytes saved for backward in one step (exact count).")
    return "\n".join(lines) + "\n"


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def plot(runs: dict, out: Path) -> list[Path]:
    """Write ``<task>_val_loss.png`` and ``<task>_train_loss.png``; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, variants in sorted(runs.items()):
        for metric in ("val_loss", "train_loss"):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for variant in sorted(variants, key=_rank):
                seeds = list(variants[variant].values())
                n = min(len(r) for r in seeds)
                steps = [seeds[0][i]["step"] for i in range(n)]
                vals = [[r[i][metric] for r in seeds] for i in range(n)]
                mean = [statistics.fmean(v) for v in vals]
                line, = ax.plot(steps, mean, label=f"{variant} ({_seeds(len(seeds))})", lw=1.5)
                if len(seeds) > 1:
                    ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                                    color=line.get_color(), alpha=0.2, lw=0)
            ax.set_xlabel("step")
            ax.set_ylabel(metric.replace("_", " ") + (" (nats/byte)" if task == "lm" else ""))
            ax.set_title(f"{task}: {metric.replace('_', ' ')} (mean, band = min..max over seeds)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out / f"{task}_{metric}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Summarise training CSVs into a markdown table and plots.")
    p.add_argument("directory", type=Path, help="directory with <task>_<variant>_seed<N>.csv files")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: the input directory)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if not args.directory.is_dir():
        p.error(f"directory {args.directory} does not exist")
    try:
        runs = load_runs(args.directory)
    except ValueError as exc:
        p.error(str(exc))
    if not runs:
        p.error(f"no <task>_<variant>_seed<N>.csv files in {args.directory}")
    out = args.out or args.directory
    out_dir(p, out)
    md = to_markdown(summarize(runs))
    tmp = out / ".summary.md.tmp"
    tmp.write_text(md)
    os.replace(tmp, out / "summary.md")
    print(md)
    if not args.no_plots:
        for path in plot(runs, out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
