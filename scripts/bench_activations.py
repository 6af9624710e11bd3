#!/usr/bin/env python
"""Benchmark few-bit activations against torch (forward, backward, forward+backward).

For every activation x dtype x size x bits this times ``fewbit.ops.pointwise`` (and the
``fewbit`` module, e.g. ``fewbit.GELU``, when fewbit.modules provides it) and the torch
function / module, in the same run (warm-up first, median of ``--repeat`` runs), and
prints ratios fewbit / torch (< 1 is faster), the saved-for-backward bytes ratio, and on
CUDA the forward's GB/s next to a plain copy's. Machine, versions, threads and the
transparent-huge-pages setting are printed first: CPU timings on a shared VM are noisy.

Example:
    python scripts/bench_activations.py --activations gelu --dtypes float32 \\
        --sizes 24 --bits 3 --mode full --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            sysfs = fh.read().strip()
    except OSError:
        sysfs = "n/a"
    return f"sysfs {sysfs}; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"


def _versions() -> str:
    out = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("numba", "triton"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            out.append(f"{mod} -")
    return ", ".join(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, repeat: int, setup=None) -> float:
    """Median wall time (s) of ``fn(state)`` over ``repeat`` runs after 2 warm-ups;
    ``setup()`` (untimed) makes the state of each run."""
    times = []
    for i in range(repeat + 2):
        state = setup() if setup else None
        _sync(device)
        t0 = time.perf_counter()
        fn(state)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        del state
    return statistics.median(times)


def _time_once(mode: str, fn, x0: torch.Tensor, g: torch.Tensor, device: torch.device) -> float:
    """Seconds of one forward, backward, or forward+backward of ``fn`` on a fresh leaf."""
    x = x0.detach().requires_grad_()
    y = fn(x) if mode == "backward" else None
    _sync(device)
    t0 = time.perf_counter()
    if mode == "forward":
        y = fn(x)
    elif mode == "backward":
        y.backward(g)
    else:
        fn(x).backward(g)
    _sync(device)
    dt = time.perf_counter() - t0
    del x, y
    return dt


def _saved_bytes(make_y, x) -> int:
    """Bytes of distinct storages saved for backward while computing ``make_y(x)``."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = make_y(x)
    del y
    return sum(seen.values())


def _table(name: str, bits: int):
    from fewbit.activations import get_activation, exact_table
    from fewbit.table import load_shipped

    act = get_activation(name)
    if act.stepwise:
        return exact_table(name)
    shipped = load_shipped(act.name) or {}
    if bits not in shipped:
        raise SystemExit(f"error: no shipped table for {name} at {bits} bits (have {sorted(shipped)})")
    return shipped[bits]


def _candidates(name: str, bits: int, table):
    """[(label, callable x -> y, is_fewbit)] for the torch baseline and fewbit."""
    import torch.nn as nn

    import fewbit.ops as ops
    from fewbit.activations import get_activation

    act = get_activation(name)
    params = dict(act.defaults)
    cands = [(f"torch.{name}", lambda x: act.torch_fn(x, **params), False)]
    if act.module and hasattr(nn, act.module):
        try:
            tm = getattr(nn, act.module)()
            cands.append((f"nn.{act.module}", tm, False))
        except TypeError:
            pass
    cands.append(("fewbit.ops.pointwise", lambda x: ops.pointwise(x, table, act.name, params), True))
    try:
        import fewbit.modules as fm

        if act.module and hasattr(fm, act.module) and name != "gelu_tanh":
            mod = getattr(fm, act.module)(bits=bits)
            cands.append((f"fewbit.{act.module}", mod, True))
    except Exception as exc:  # noqa: BLE001 - optional layer; report and go on
        print(f"# fewbit.modules unavailable for {name}: {exc}", file=sys.stderr)
    return cands


def run(args) -> None:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# machine: {_machine()}")
    print(f"# versions: {_versions()}")
    print(f"# device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"# torch threads: {torch.get_num_threads()}; THP: {_thp()}")
    print(f"# timings: median of {args.repeat} round-robin runs after 2 warm-ups; ratios are fewbit / torch baseline "
          "of the same run (< 1: fewbit faster). Shared VMs are noisy.")
    modes = ["forward", "backward", "full"] if args.mode == "all" else [args.mode]
    header = f"{'activation':<10} {'dtype':<9} {'n':>6} {'bits':>4} {'candidate':<22} " + " ".join(
        f"{m + ' ms':>12} {'ratio':>6}" for m in modes
    ) + f" {'saved B':>12} {'ratio':>7}"
    if device.type == "cuda":
        header += f" {'fwd GB/s':>9} {'copy GB/s':>9}"
    print(header)
    for name in args.activations:
        for bits in args.bits:
            table = _table(name, bits)
            for dt_name in args.dtypes:
                dtype = getattr(torch, dt_name)
                for p in args.sizes:
                    n = 1 << p
                    x0 = torch.randn(n, device=device, dtype=torch.float32).to(dtype)
                    g = torch.randn_like(x0)
                    copy_t = _median_time(lambda s: s.copy_(x0), device, args.repeat,
                                          setup=lambda: torch.empty_like(x0))
                    cands = _candidates(name, bits, table)
                    # Round-robin: every repeat times each candidate once, so that load
                    # changes on a shared machine hit all candidates alike.
                    times = {(label, m): [] for label, _, _ in cands for m in modes + ["fwd_gbs"]}
                    for rep in range(args.repeat + 2):
                        for label, fn, is_fewbit in cands:
                            for m in modes:
                                times[(label, m)].append(_time_once(m, fn, x0, g, device))
                    base = {}
                    for label, fn, is_fewbit in cands:
                        row = f"{name:<10} {dt_name:<9} {'2^' + str(p):>6} {bits:>4} {label:<22} "
                        cells = []
                        for m in modes:
                            t = statistics.median(times[(label, m)][2:])
                            if not is_fewbit and m not in base:
                                base[m] = t
                            cells.append(f"{t * 1e3:>12.2f} {t / base[m]:>6.2f}")
                        saved = _saved_bytes(fn, x0.detach().requires_grad_())
                        if not is_fewbit and "saved" not in base:
                            base["saved"] = saved
                        row += " ".join(cells) + f" {saved:>12d} {saved / max(base['saved'], 1):>7.3f}"
                        if device.type == "cuda":
                            fwd_t = _median_time(lambda x: fn(x), device, args.repeat,
                                                 setup=lambda: x0.detach().requires_grad_())
                            moved = 2 * n * x0.element_size() + (n * bits + 7) // 8 * is_fewbit
                            row += f" {moved / fwd_t / 1e9:>9.1f} {2 * n * x0.element_size() / copy_t / 1e9:>9.1f}"
                        print(row, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--activations", nargs="+", default=["gelu"], help="registry names (default: gelu)")
    ap.add_argument("--dtypes", nargs="+", default=["float32"],
                    choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[20, 22, 24, 26],
                    help="log2 of the number of elements (default: 20 22 24 26)")
    ap.add_argument("--bits", nargs="+", type=int, default=[3], help="bits per element (default: 3)")
    ap.add_argument("--mode", default="full", choices=["forward", "backward", "full", "all"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch (and numba) threads; 0: torch's default")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median)")
    args = ap.parse_args(argv)
    try:
        from fewbit.activations import get_activation

        for name in args.activations:
            get_activation(name)
        for b in args.bits:
            if not 1 <= b <= 8:
                raise ValueError(f"bits must be in 1..8, got {b}")
        for p in args.sizes:
            if not 0 <= p <= 34:
                raise ValueError(f"sizes are log2 element counts in 0..34, got {p}")
        if args.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {args.repeat}")
        dev = torch.device(args.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but CUDA is not available")
        run(args)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
