#!/usr/bin/env python
"""Benchmark of the group quantizer (fewbit.quant, docs/method.md §7), the other compressors and of saved-tensor compression.

Measures, in one run:
1. quantize / dequantize throughput (GB/s of the float input) against ``x.clone()`` on the
   same tensor, per bits, and (optionally) against the pure-torch reference;
   then, per compressor of ``fewbit.quant.compressors`` (``--compressors``, default options),
   compress, decompress and compress + decompress throughput, GB/s of input (one
   ``(n / 4096, 64, 64)`` conv-like map per size: DIVISION pools 8 x 8 blocks of it);
2. bytes saved for backward by an MLP and a small GPT-2 (transformers.GPT2Config, built
   from the config, nothing downloaded) with and without ``fewbit.compress_activations``:
   the ratio over the compressed tensors and over all saved bytes (parameters excluded,
   every storage counted once);
3. the time of a training step (forward + backward + AdamW) with compression, as a ratio
   to the same step without.

Example:
    python scripts/bench_quant.py --sizes 1048576 16777216 --bits 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
from _training import positive_int
from torch import nn

import fewbit
import fewbit.quant as fq
from fewbit._checks import check_device
from fewbit.quant.compressor import _Handle, _is_parameter
from fewbit._saved import Kept


def _versions() -> str:
    parts = [
        f"python {platform.python_version()}", f"torch {torch.__version__}",
        f"fewbit {fewbit.__version__}",
    ]
    for mod in ("numba", "triton", "transformers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            parts.append(f"{mod} -")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    nthreads = "-"
    if "numba" in sys.modules:
        nthreads = sys.modules["numba"].get_num_threads()
    return (f"machine: {cpu}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, "
            f"numba threads {nthreads}, "
            f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}\n" + ", ".join(parts))


def _time(fn, repeats: int, device: torch.device) -> float:
    """Min wall time in seconds over ``repeats`` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def bench_throughput(args, device):
    print("\n== quantize / dequantize throughput (GB/s of input, min of "
          f"{args.repeats}; ratio = time / time of x.clone()) ==")
    print(f"{'numel':>10} {'dtype':>9} {'bits':>4} {'clone GB/s':>10} {'quant GB/s':>10} {'x clone':>8} "
          f"{'nearest':>8} {'dequant GB/s':>12} {'x clone':>8}")
    dtype = getattr(torch, args.dtype)
    for n in args.sizes:
        x = torch.randn(n, device=device).to(dtype)
        gb = n * x.element_size() / 1e9
        t_clone = _time(lambda: x.clone(), args.repeats, device)
        for bits in args.bits:
            t_q = _time(lambda: fq.quantize(x, bits, group_size=args.group_size), args.repeats, device)
            t_qn = _time(lambda: fq.quantize(x, bits, group_size=args.group_size, stochastic=False),
                         args.repeats, device)
            qt = fq.quantize(x, bits, group_size=args.group_size)
            t_d = _time(lambda: qt.dequantize(), args.repeats, device)
            print(f"{n:>10} {args.dtype:>9} {bits:>4} {gb / t_clone:>10.2f} {gb / t_q:>10.2f} "
                  f"{t_q / t_clone:>8.2f} {t_qn / t_clone:>8.2f} {gb / t_d:>12.2f} {t_d / t_clone:>8.2f}")
        if args.reference and n <= args.reference_max:
            t_r = _time(lambda: fq.quantize_reference(x, 4, group_size=args.group_size), 1, device)
            t_k = _time(lambda: fq.quantize(x, 4, group_size=args.group_size), args.repeats, device)
            print(f"{n:>10} {args.dtype:>9}    4  reference quantize {t_r * 1e3:.1f} ms, kernel "
                  f"{t_k * 1e3:.2f} ms: kernel is {t_r / t_k:.1f}x faster")


def bench_compressors(args, device):
    from fewbit.quant.compressors import get_compressor

    print(f"\n== compressors: GB/s of input, min of {args.repeats}; both = input / (compress + decompress) ==")
    print("(each compressor at its default bits: group 4, DIVISION Q = 2, outlier 4, channelwise 8, softmax 4)")
    print(f"{'numel':>10} {'compressor':>12} {'bits':>4} {'bytes/el':>8} {'clone':>7} {'compress':>9} {'decompress':>10} "
          f"{'both':>7}")
    dtype = getattr(torch, args.dtype)
    for n in args.sizes:
        gb = n * dtype.itemsize / 1e9
        shape = (max(n // 4096, 1), 64, 64) if n >= 4096 else (1, 1, n)
        x = torch.randn(shape, device=device).to(dtype)
        t_clone = _time(lambda: x.clone(), args.repeats, device)
        for name in args.compressors:
            comp = get_compressor(name) if name != "group" else get_compressor(name, bits=4)
            xs = x.view(shape[0], 1, 64, 64) if name == "division" and n >= 4096 else x
            xs = xs.sigmoid() if name == "softmax" else xs
            t_c = _time(lambda: comp.compress(xs), args.repeats, device)
            c = comp.compress(xs)
            t_d = _time(lambda: c.decompress(), args.repeats, device)
            print(f"{n:>10} {name:>12} {comp.bits:>4} {c.nbytes / n:>8.4f} {gb / t_clone:>7.2f} {gb / t_c:>9.2f} "
                  f"{gb / t_d:>10.2f} {gb / (t_c + t_d):>7.2f}", flush=True)


class _Counter:
    """Pack hook wrapper: bytes actually kept for backward, parameters excluded, each storage
    (plain tensor) or packed handle counted once."""

    def __init__(self, inner=None):
        self.inner = inner
        self.seen = set()
        self.nbytes = 0

    def pack(self, t):
        p = self.inner._pack(t) if self.inner is not None else t
        held = p.tensor if isinstance(p, Kept) else p  # kept as it is (fewbit._saved)
        if isinstance(p, _Handle):
            key, nb = ("h", id(p)), p.nbytes
        elif _is_parameter(held):
            return p
        else:
            key, nb = ("s", held.untyped_storage().data_ptr()), held.untyped_storage().nbytes()
        if key not in self.seen:
            self.seen.add(key)
            self.nbytes += nb
        return p

    def unpack(self, p):
        return self.inner._unpack(p) if self.inner is not None else p


def _mlp(args, device):
    d = args.mlp_dim
    layers = []
    for _ in range(args.mlp_layers):
        layers += [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    model = nn.Sequential(*layers)
    x = torch.randn(args.mlp_batch, d, device=device)
    return model, lambda m: m(x).square().mean()


def _gpt2(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=args.gpt2_layers, n_embd=args.gpt2_embd, n_head=args.gpt2_heads,
        n_positions=args.seq, vocab_size=args.vocab,
    )
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def bench_models(args, device):
    print(f"\n== saved bytes and training-step time, compress_activations({args.model_bits}, "
          f"group_size={args.group_size}) ==")
    builders = {"mlp": _mlp, "gpt2": _gpt2}
    for name in args.models:
        torch.manual_seed(0)
        model, loss_fn = builders[name](args, device)
        model.train().to(device)
        # saved bytes without / with compression (one forward each, graph then freed)
        base = _Counter()
        with torch.autograd.graph.saved_tensors_hooks(base.pack, base.unpack):
            loss = loss_fn(model)
        loss.backward()
        comp = fewbit.compress_activations(args.model_bits, group_size=args.group_size)
        cnt = _Counter(comp)
        with torch.autograd.graph.saved_tensors_hooks(cnt.pack, cnt.unpack):
            loss = loss_fn(model)
        loss.backward()
        st = comp.stats
        ideal = 32 / (args.model_bits + 2 * 16 / args.group_size)
        print(f"[{name}] params {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M; "
              f"tensors compressed {st.compressed}, bool packed {st.packed_bool}, dedup hits "
              f"{st.deduplicated}, skipped {st.skipped}")
        print(f"[{name}] compressed tensors: {st.bytes_before / 2**20:.2f} MiB -> {st.bytes_after / 2**20:.2f} MiB, "
              f"ratio {st.ratio:.2f}x (float32 ideal 32/({args.model_bits}+32/{args.group_size}) = {ideal:.2f}x)")
        print(f"[{name}] all saved bytes (params excluded, storages once): {base.nbytes / 2**20:.2f} MiB -> "
              f"{cnt.nbytes / 2**20:.2f} MiB, ratio {base.nbytes / cnt.nbytes:.2f}x")
        # training step time
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(comp_=None):
            opt.zero_grad(set_to_none=True)
            if comp_ is None:
                loss = loss_fn(model)
            else:
                with comp_:
                    loss = loss_fn(model)
            loss.backward()
            opt.step()

        comp2 = fewbit.compress_activations(args.model_bits, group_size=args.group_size)
        ts = {"plain": [], "comp": []}
        step(), step(comp2)
        for _ in range(args.step_repeats):  # interleaved: the machine load drifts
            ts["plain"].append(_time(lambda: step(), 1, device))
            ts["comp"].append(_time(lambda: step(comp2), 1, device))
        tp, tc = min(ts["plain"]), min(ts["comp"])
        print(f"[{name}] training step: plain {tp * 1e3:.1f} ms, compressed {tc * 1e3:.1f} ms, "
              f"overhead ratio {tc / tp:.2f}x (min of {args.step_repeats}, interleaved)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=positive_int, nargs="+", default=[1 << 20, 1 << 24], help="numel of the test tensors")
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--group-size", type=positive_int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--reference", action="store_true", help="also time the pure-torch reference (slow)")
    ap.add_argument("--reference-max", type=positive_int, default=1 << 22, help="largest size timed with --reference")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads and numba.set_num_threads (1 is steadier on a loaded machine)")
    ap.add_argument("--compressors", nargs="*", default=["group", "division", "outlier", "channelwise", "softmax"],
                    help="compressors (fewbit.quant.compressors names, default options; group at 4 bits) timed "
                         "after the quantizer table; none: skip")
    ap.add_argument("--models", nargs="*", default=["mlp", "gpt2"], choices=["mlp", "gpt2"])
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--model-bits", type=positive_int, default=4)
    ap.add_argument("--mlp-dim", type=positive_int, default=256)
    ap.add_argument("--mlp-layers", type=positive_int, default=2)
    ap.add_argument("--mlp-batch", type=positive_int, default=512)
    ap.add_argument("--gpt2-layers", type=positive_int, default=2)
    ap.add_argument("--gpt2-embd", type=positive_int, default=128)
    ap.add_argument("--gpt2-heads", type=positive_int, default=4)
    ap.add_argument("--vocab", type=positive_int, default=2048)
    ap.add_argument("--seq", type=positive_int, default=128)
    ap.add_argument("--batch", type=positive_int, default=4)
    ap.add_argument("--step-repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)
    try:
        device = check_device(args.device)
        for b in args.bits + [args.model_bits]:
            if b not in fq.SUPPORTED_BITS:
                raise ValueError(f"bits must be in {fq.SUPPORTED_BITS}, got {b}")
        if args.group_size < 1 or any(n < 0 for n in args.sizes):
            raise ValueError("--group-size must be >= 1 and --sizes >= 0")
        from fewbit.quant.compressors import COMPRESSORS

        unknown = [c for c in args.compressors if c not in COMPRESSORS]
        if unknown:  # found after the throughput table, a traceback had ended the run (h70)
            raise ValueError(f"--compressors must be among {', '.join(sorted(COMPRESSORS))}; got "
                             f"{', '.join(map(repr, unknown))}")
    except (ValueError, RuntimeError) as e:
        print(f"bench_quant.py: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    print(_versions())
    print("note: timings on a shared, loaded machine are noisy; compare ratios within this run")
    if not args.skip_throughput:
        bench_throughput(args, device)
        if args.compressors:
            bench_compressors(args, device)
    if args.models:
        bench_models(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
