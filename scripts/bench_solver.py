#!/usr/bin/env python
"""Benchmark the offline solver (docs/method.md §4-5) and print the error table.

Prints the machine and versions, then:
1. the exact DP (numba, warm, JIT excluded) for ``--n`` cells and ``--k`` pieces, and the
   plain numpy reference on ``--numpy-n`` cells, with the per-inner-step ratio;
2. the time to regenerate every shipped table (``scripts/build_tables.py`` in-process,
   written to a temporary directory; ``--skip-tables`` to skip);
3. the error (docs/method.md §3: w = 1 on the domain) of ``--functions`` at ``--bits``.

The machine is shared with other jobs: timings are noisy; each is the min of ``--repeat``.

Usage:
    python scripts/bench_solver.py [--n 10000] [--k 16] [--numpy-n 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _training import positive_int

ROOT = Path(__file__).resolve().parents[1]


def _versions() -> str:
    import numba
    import scipy
    import torch

    import fewbit

    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001 - only for the report
        tv = "not installed"
    return (
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{platform.platform()}\n"
        f"python {platform.python_version()}, numpy {np.__version__}, scipy {scipy.__version__}, "
        f"numba {numba.__version__} (threads {numba.get_num_threads()}, layer "
        f"{numba.config.THREADING_LAYER}), torch {torch.__version__}, triton {tv}, fewbit {fewbit.__version__}"
    )


def _prefix(n: int):
    from fewbit.solver import registry, weights
    from fewbit.solver.objective import Objective

    sf = registry.get("gelu")
    obj = Objective(sf, sf.params(), weights.uniform(), (-10.0, 10.0))
    return obj.prefix(np.linspace(-10.0, 10.0, n + 1))


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=positive_int, default=10_000, help="DP grid cells for the numba timing")
    p.add_argument("--k", type=positive_int, default=16, help="pieces K")
    p.add_argument("--numpy-n", type=positive_int, default=1000, help="grid cells for the numpy reference timing")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per timing (min is reported)")
    p.add_argument("--functions", nargs="+", default=["gelu", "silu", "sigmoid", "tanh", "selu", "softplus"])
    p.add_argument("--bits", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--skip-tables", action="store_true", help="do not time the regeneration of all tables")
    args = p.parse_args(argv)
    if args.k > min(args.n, args.numpy_n):
        p.error(f"--k must be at most --n and --numpy-n ({min(args.n, args.numpy_n)}), got {args.k}")
    # checked before any timing: found after seconds of it, a traceback had ended the run (h70)
    if bad := [b for b in args.bits if not 1 <= b <= 8]:
        p.error(f"--bits must be in 1..8, got {', '.join(map(str, bad))}")
    from fewbit.activations import get_activation

    for name in args.functions:  # a name fit_many takes: registry names, aliases, Hugging Face formulas
        try:
            get_activation(name)
        except ValueError as exc:
            p.error(f"--functions: {exc}")

    from fewbit.solver import fit_many
    from fewbit.solver.dp import dp_numba, dp_numpy

    print(_versions())
    print("note: shared, noisy machine; times are the min of", args.repeat, "runs")

    # 1. DP
    W, FW, F2 = _prefix(args.n)
    t0 = time.perf_counter()
    Ws, FWs, F2s = _prefix(64)
    dp_numba(Ws, FWs, F2s, 4)
    print(f"\nDP numba first call (compile or load from cache): {time.perf_counter() - t0:.2f} s")
    t_nb, (c_nb, _) = _best(lambda: dp_numba(W, FW, F2, args.k), args.repeat)
    steps_nb = args.n * args.n / 2 * args.k
    print(f"DP numba  n={args.n:6d} K={args.k}: {t_nb * 1e3:9.1f} ms  ({steps_nb / t_nb / 1e9:.2f} G inner steps/s), cost {c_nb:.6g}")
    Wn, FWn, F2n = _prefix(args.numpy_n)
    t_np, (c_np, _) = _best(lambda: dp_numpy(Wn, FWn, F2n, args.k), 1)
    t_nb2, (c_nb2, _) = _best(lambda: dp_numba(Wn, FWn, F2n, args.k), args.repeat)
    steps_np = args.numpy_n * args.numpy_n / 2 * args.k
    print(f"DP numpy  n={args.numpy_n:6d} K={args.k}: {t_np * 1e3:9.1f} ms  ({steps_np / t_np / 1e9:.3f} G inner steps/s)")
    print(f"DP numba  n={args.numpy_n:6d} K={args.k}: {t_nb2 * 1e3:9.1f} ms  -> numba/numpy speed-up {t_np / t_nb2:.0f}x "
          f"(costs equal: {abs(c_np - c_nb2) <= 1e-12 * abs(c_np)})")

    # 2. all tables
    if not args.skip_tables:
        spec = importlib.util.spec_from_file_location("build_tables", ROOT / "scripts" / "build_tables.py")
        bt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bt)
        with tempfile.TemporaryDirectory() as tmp:
            import contextlib
            import io

            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                rc = bt.main(["--out", tmp])
            print(f"\nregenerate every table (build_tables.py, {len(list(Path(tmp).glob('*.json')))} files): "
                  f"{time.perf_counter() - t:.1f} s (rc {rc})")

    # 3. error table
    print(f"\nerror (docs/method.md §3, w = 1 on [-10, 10], not normalised), bits {args.bits}:")
    print(f"{'function':12s}" + "".join(f"{f'b={b}':>12s}" for b in args.bits) + f"{'ratio/bit':>24s}")
    for name in args.functions:
        tabs = fit_many(name, args.bits)
        errs = [tabs[b].error for b in args.bits]
        ratios = " ".join(f"{errs[i] / errs[i + 1]:.2f}" for i in range(len(errs) - 1) if errs[i + 1] > 0)
        print(f"{name:12s}" + "".join(f"{e:12.4g}" for e in errs) + f"{ratios:>24s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
