#!/usr/bin/env python
"""Regenerate every shipped few-bit table (tables/*.json) deterministically.

One JSON file per registry function at default parameters (file name from
:func:`fewbit.table.table_filename`): bits 1-4 fitted on [-10, 10] with uniform weight
by :func:`fewbit.solver.fit_many`; stepwise functions (ReLU family) get their exact
1-bit table only. Files are written atomically (:func:`fewbit.table.write_tables`).

Usage:
    python scripts/build_tables.py            # rewrite tables/*.json
    python scripts/build_tables.py --check    # compare with a fresh fit; exit 1 on difference
    python scripts/build_tables.py --only gelu silu
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES_DIR = ROOT / "tables"
COMMAND = "python scripts/build_tables.py"
BITS = (1, 2, 3, 4)
DOMAIN = (-10.0, 10.0)
WEIGHT = "uniform"

# Tolerances of --check: a fresh fit on another CPU may differ in the last bits
# (vectorised sums); anything beyond these is a real difference.
BORDER_ATOL = 1e-6
VALUE_ATOL = 1e-8
ERROR_RTOL = 1e-6


def build(name: str, grid: int | None = None):
    """Fresh tables of ``name`` at default params: ``{bits: Table}`` with this script's provenance."""
    from fewbit.solver import fit_many, registry

    sf = registry.get(name)
    bits = (1,) if sf.stepwise else BITS
    tables = fit_many(name, bits, domain=DOMAIN, weight=WEIGHT, grid=grid)
    out = {}
    for b, t in tables.items():
        prov = dict(t.provenance)
        prov["command"] = COMMAND
        out[b] = dataclasses.replace(t, provenance=prov)
    return out


def compare(old: dict, new: dict) -> list[str]:
    """Differences between two ``{bits: Table}`` beyond the tolerances above (empty if equal)."""
    diffs = []
    if sorted(old) != sorted(new):
        return [f"bit widths {sorted(old)} != {sorted(new)}"]
    for b in sorted(new):
        o, n = old[b], new[b]
        for attr in ("name", "params", "domain", "weight", "symmetric", "codes"):
            if getattr(o, attr) != getattr(n, attr):
                diffs.append(f"bits={b}: {attr} {getattr(o, attr)!r} != {getattr(n, attr)!r}")
        if len(o.borders) != len(n.borders):
            diffs.append(f"bits={b}: {len(o.borders)} borders != {len(n.borders)}")
            continue
        db = max((abs(x - y) for x, y in zip(o.borders, n.borders)), default=0.0)
        dv = max(abs(x - y) for x, y in zip(o.values, n.values))
        if db > BORDER_ATOL:
            diffs.append(f"bits={b}: borders differ by {db:.3g} > {BORDER_ATOL}")
        if dv > VALUE_ATOL:
            diffs.append(f"bits={b}: values differ by {dv:.3g} > {VALUE_ATOL}")
        eo, en = o.error, n.error
        if (eo is None) != (en is None) or (
            eo is not None and not math.isclose(eo, en, rel_tol=ERROR_RTOL, abs_tol=1e-15)
        ):
            diffs.append(f"bits={b}: error {eo!r} != {en!r}")
    return diffs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare shipped files with a fresh fit; exit 1 on difference")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these registry names")
    parser.add_argument("--out", type=Path, default=TABLES_DIR, help=f"output directory (default {TABLES_DIR})")
    parser.add_argument("--grid", type=int, default=None, help="DP grid cells (default: the solver's)")
    args = parser.parse_args(argv)
    # checked before the fits: a missing or file --out had been a traceback after them (h70)
    if not args.check:
        if args.out.exists() and not args.out.is_dir():
            parser.error(f"--out {args.out} is a file, not a directory")
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--out {args.out}: {exc.strerror or exc}")

    from fewbit.solver import registry
    from fewbit.table import TableFormatError, read_tables, table_filename, write_tables

    names = args.only or registry.names()
    t0 = time.perf_counter()
    failed = []
    for name in names:
        t = time.perf_counter()
        try:
            new = build(name, args.grid)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        path = args.out / table_filename(registry.get(name).name)
        if args.check:
            try:
                old = read_tables(path)
            except TableFormatError as exc:
                failed.append(name)
                print(f"{name:12s} DIFFERS: {exc}")
                continue
            diffs = compare(old, new)
            if diffs:
                failed.append(name)
                print(f"{name:12s} DIFFERS: " + "; ".join(diffs))
            else:
                print(f"{name:12s} ok     ({time.perf_counter() - t:.2f} s)")
        else:
            write_tables(path, new.values())
            errs = ", ".join(f"{b}:{tb.error:.4g}" for b, tb in sorted(new.items()))
            print(f"{name:12s} {path.name:20s} errors {errs}  ({time.perf_counter() - t:.2f} s)")
    print(f"total {time.perf_counter() - t0:.1f} s for {len(names)} functions")
    if failed:
        print(f"{len(failed)} table file(s) differ from a fresh fit: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
