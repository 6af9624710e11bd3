#!/usr/bin/env python
"""Benchmark few-bit activations against torch (forward, backward, forward+backward).

For every activation x dtype x size x bits this times ``fewbit.ops.pointwise`` (and the
``fewbit`` module, e.g. ``fewbit.GELU``, when fewbit.modules provides it) and the torch
function / module, eager and (unless ``--no-compile``) under ``torch.compile``, in the same
run (warm-up first, median of ``--repeat`` round-robin runs), and prints per mode
(forward, backward, forward+backward) the time, the ratio to torch eager and to
``torch.compile`` of torch's module (< 1 is faster), the effective GB/s (bytes each
candidate must move: input, output, gradients, packed codes) and its % of a same-size
copy's GB/s, and the saved-for-backward bytes ratio. Then the host time per call: the
time of a call on a one-element input (CPU: the kernels' work is ~0) or, on CUDA, of the
launches without a synchronize; on the CPU also a new process's first call (numba loading in
the background, and waited for). Machine, versions, threads, load and the
transparent-huge-pages setting are printed first: CPU timings on a shared VM are noisy.
``--json PATH`` writes all of it as one JSON document.

Examples:
    python scripts/bench_activations.py --activations gelu --dtypes float32 \\
        --sizes 24 --bits 3 --mode all --threads 2
    python scripts/bench_activations.py --device cuda --dtypes float32 bfloat16 float16 \\
        --sizes 16 18 20 22 24 26 28 --mode all --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from _cli import new_file
from _training import saved_bytes


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


def _bytes_moved(mode: str, n: int, esize: int, bits: int, is_fewbit: bool) -> int:
    """Bytes a candidate must read and write: forward x -> y (+ packed codes for fewbit),
    backward (grad, x) -> grad_x for torch, (grad, codes) -> grad_x for fewbit."""
    codes = (n * bits + 7) // 8
    fwd = 2 * n * esize + (codes if is_fewbit else 0)
    bwd = 2 * n * esize + (codes if is_fewbit else n * esize)
    return {"forward": fwd, "backward": bwd, "full": fwd + bwd}[mode]


def _host_us(fn, device: torch.device, mode: str, calls: int = 200, dtype=torch.float32) -> float:
    """Median µs of CPU time of this thread per call of ``fn`` on a one-element input,
    without synchronizing: the host's (Python, dispatch, launch) time, the kernels' own
    work being ~0. CPU time, not wall time, so that other processes on a shared machine
    do not count."""
    x0 = torch.randn(1, device=device, dtype=dtype)
    g = torch.ones_like(x0)
    per = []
    for rep in range(7):
        xs = [x0.detach().requires_grad_() for _ in range(calls)]
        t0 = time.thread_time()
        for x in xs:
            y = fn(x)
            if mode == "full":
                y.backward(g)
        per.append((time.thread_time() - t0) / calls * 1e6)
        del xs
    _sync(device)
    return statistics.median(per[2:])


def _compiled(fn):
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn)


# A new process: imports, then the module's construction (its table) and one forward+backward
# of fewbit.GELU(bits=3) on 1024 float32 elements, timed; FEWBIT_CPU_KERNELS set by the caller (fewbit.ops._cpu_loader).
_FIRST_CALL = r"""
import json, time, torch, fewbit
t0 = time.perf_counter()
x = torch.randn(1024, requires_grad=True)
fewbit.GELU(bits=3)(x).sum().backward()
t1 = time.perf_counter()
fewbit.ops.load_cpu_kernels()
print(json.dumps({"first_call_s": t1 - t0, "loaded_s": time.perf_counter() - t0}))
"""


def first_call(mode: str, runs: int = 3) -> dict:
    """Wall seconds of a new process's first fewbit.GELU forward+backward on the CPU (median
    of ``runs`` processes, after one that fills numba's disk cache if it is empty), with the
    CPU kernels loaded in ``mode`` (``background``: the call runs on the reference kernels
    while numba loads; ``sync``: it waits for numba), and until the kernels were loaded."""
    import subprocess

    env = {**os.environ, "FEWBIT_CPU_KERNELS": mode}
    out = []
    for _ in range(runs + 1):
        proc = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"first-call process failed: {proc.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = out[1:]
    return {k: statistics.median(o[k] for o in out) for k in out[0]}


def run(args) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        import fewbit.ops

        fewbit.ops.load_cpu_kernels()  # time the numba kernels, not the reference that stands in while they load
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta = {
        "machine": _machine(), "versions": _versions(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(), "thp": _thp(), "loadavg": load, "repeat": args.repeat,
        "compile": not args.no_compile, "layout": args.layout,
    }
    print(f"# machine: {meta['machine']}")
    print(f"# versions: {meta['versions']}")
    print(f"# device: {device}" + (f" ({meta['device_name']})" if meta["device_name"] else ""))
    print(f"# torch threads: {meta['threads']}; THP: {meta['thp']}; load average: {load}; layout: {args.layout}")
    print(f"# timings: median of {args.repeat} round-robin runs after 2 warm-ups; ratio: to torch eager, "
          "cratio: to torch.compile of torch's module (< 1: faster); GB/s of the bytes each candidate must "
          "move, %copy: of a same-size copy. Shared VMs are noisy.")
    modes = ["forward", "backward", "full"] if args.mode == "all" else [args.mode]
    header = f"{'activation':<10} {'dtype':<9} {'n':>5} {'bits':>4} {'candidate':<30} " + " ".join(
        f"{m[:4] + ' ms':>10} {'ratio':>6} {'cratio':>6} {'GB/s':>7} {'%copy':>6}" for m in modes
    ) + f" {'saved B':>12} {'ratio':>7}"
    print(header)
    rows, host = [], []
    for name in args.activations:
        for bits in args.bits:
            table = _table(name, bits)
            for dt_name in args.dtypes:
                dtype = getattr(torch, dt_name)
                cands = _candidates(name, bits, table)
                if not args.no_compile:
                    cands += [(f"compile({label})", _compiled(fn), is_fewbit) for label, fn, is_fewbit in cands
                              if not label.startswith("torch.")]
                for p in args.sizes:
                    n = 1 << p
                    x0 = _laid_out(torch.randn(n, device=device, dtype=torch.float32).to(dtype), args.layout)
                    g = torch.randn_like(x0)  # in x0's layout, as the next layer's gradient comes
                    copy_t = _median_time(lambda s: s.copy_(x0), device, args.repeat,
                                          setup=lambda: torch.empty_like(x0))
                    copy_gbs = 2 * n * x0.element_size() / copy_t / 1e9
                    # Round-robin: every repeat times each candidate once, so that load
                    # changes on a shared machine hit all candidates alike.
                    times = {(label, m): [] for label, _, _ in cands for m in modes}
                    for rep in range(args.repeat + 2):
                        for label, fn, is_fewbit in cands:
                            for m in modes:
                                times[(label, m)].append(_time_once(m, fn, x0, g, device))
                    med = {k: statistics.median(v[2:]) for k, v in times.items()}
                    eager_base = next(label for label, _, f in cands if not f and not label.startswith("compile"))
                    base_label = next((label for label, _, f in cands if not f and label.startswith("compile(nn.")),
                                      None)
                    for label, fn, is_fewbit in cands:
                        row = {"activation": name, "dtype": dt_name, "log2_n": p, "n": n, "bits": bits,
                               "candidate": label, "fewbit": is_fewbit, "compiled": label.startswith("compile"),
                               "copy_gbs": copy_gbs}
                        cells = []
                        for m in modes:
                            t = med[(label, m)]
                            ratio = t / med[(eager_base, m)]
                            cratio = t / med[(base_label, m)] if base_label else None
                            gbs = _bytes_moved(m, n, x0.element_size(), bits, is_fewbit) / t / 1e9
                            row[m] = {"ms": t * 1e3, "ratio_eager": ratio, "ratio_compile": cratio,
                                      "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs}
                            cr = f"{cratio:>6.2f}" if cratio is not None else f"{'-':>6}"
                            cells.append(f"{t * 1e3:>10.3f} {ratio:>6.2f} {cr} {gbs:>7.1f} {100 * gbs / copy_gbs:>6.0f}")
                        saved = saved_bytes(lambda: fn(x0.detach().requires_grad_()))
                        base_saved = saved_bytes(lambda: cands[0][1](x0.detach().requires_grad_()))
                        row["saved_bytes"], row["saved_ratio"] = saved, saved / max(base_saved, 1)
                        print(f"{name:<10} {dt_name:<9} {'2^' + str(p):>5} {bits:>4} {label:<30} " + " ".join(cells)
                              + f" {saved:>12d} {row['saved_ratio']:>7.3f}", flush=True)
                        rows.append(row)
                if not args.no_host:
                    for label, fn, is_fewbit in cands:
                        if label.startswith("compile"):
                            continue
                        h = {"activation": name, "dtype": dt_name, "bits": bits, "candidate": label,
                             "forward_us": _host_us(fn, device, "forward", dtype=dtype),
                             "full_us": _host_us(fn, device, "full", dtype=dtype)}
                        host.append(h)
                        print(f"# host per call, {name} {dt_name} {label}: forward {h['forward_us']:.1f} µs, "
                              f"forward+backward {h['full_us']:.1f} µs", flush=True)
    first = {}
    if not args.no_host and device.type == "cpu":
        for mode in ("background", "sync"):
            first[mode] = first_call(mode)
            print(f"# new process, FEWBIT_CPU_KERNELS={mode}: first fewbit.GELU forward+backward "
                  f"{first[mode]['first_call_s']:.3f} s, numba kernels loaded after {first[mode]['loaded_s']:.3f} s",
                  flush=True)
    return {"meta": meta, "results": rows, "host": host, "first_call": first}


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The ``n`` elements of ``x`` as a tensor of ``layout``: ``contiguous`` (1-D), a
    ``channels_last`` map ``(n / 4096, 64, 8, 8)`` (a CNN under channels_last / AMP), or
    ``transposed`` ``(1024, n / 1024)`` seen through ``.t()`` (a Conv1d-style ``(B, C, T)``
    transpose)."""
    n = x.numel()
    if layout == "channels_last":
        return x.reshape(n // 4096, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return x.reshape(n // 1024, 1024).t()
    return x


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
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidates")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time-per-call measurement")
    ap.add_argument("--json", metavar="PATH", type=new_file,
                    help="also write the results as JSON to PATH (a new file)")
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "channels_last", "transposed"],
                    help="memory layout of the input and gradient (channels_last: (n/4096, 64, 8, 8); "
                         "transposed: a (1024, n/1024) view through .t()) (default: contiguous)")
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
            if args.layout != "contiguous" and p < 12:
                raise ValueError(f"--layout {args.layout} needs sizes of at least 2^12 elements, got 2^{p}")
        if args.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {args.repeat}")
        from fewbit._checks import check_device

        check_device(args.device)
        result = run(args)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
