#!/usr/bin/env python
"""Benchmark of the fused linear + cross-entropy (fewbit.linear_cross_entropy, docs/compression.md §5).

Measures, in one run:
1. for a language-model head (H features, V classes, N tokens): bytes saved for backward
   (every storage counted once, the weight and bias excluded), the peak of CUDA memory
   during forward + backward on a GPU, and the time of forward + backward, for torch's
   unfused ``F.cross_entropy(F.linear(...))`` (``fewbit.losses.linear_cross_entropy_reference``)
   and the fused loss in both modes (``recompute``: the default, ``grad_in_forward``),
   printed with their ratios to torch measured in the same run;
2. the MiB saved per example by a GPT-2 built from ``transformers.GPT2Config`` (random
   weights, nothing downloaded) for one training step at ``--gpt2-seq-len``: vanilla,
   fewbit (3-bit activations), fewbit+quant (plus the 4-bit group quantizer), each with the
   loss as Hugging Face computes it and with ``fewbit.losses.patch_causal_lm_``
   (``fewbit.memory.compare``).

Example:
    python scripts/bench_linear_cross_entropy.py --tokens 256 512 1024 2048 --gpt2-seq-len 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _training import check_device  # scripts/ is sys.path[0] when this script runs

from fewbit.losses import linear_cross_entropy, linear_cross_entropy_reference, patch_causal_lm_
from fewbit.memory import SavedTensorRecorder, compare

MIB = 2.0**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _machine(device: torch.device) -> str:
    """The machine and the versions (bench_quant's line), and the GPU's name on CUDA."""
    from bench_quant import _versions  # scripts/ is sys.path[0] when this script runs

    return _versions() + (f"\nGPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")


def _variants(chunk_size):
    return {
        "torch": lambda x, w, t: linear_cross_entropy_reference(x, w, t),
        "recompute": lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=chunk_size),
        "grad_in_forward": lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=chunk_size, grad_in_forward=True),
    }


def _step(fn, head, x, t, device) -> tuple[int, int | None]:
    """One forward + backward: (bytes saved for backward, CUDA peak bytes or None)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with SavedTensorRecorder(head) as rec:
        loss = fn(x, head.weight, t)
    loss.backward()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
    x.grad = head.weight.grad = None
    return rec.saved_bytes, peak


def _time(fn, head, x, t, device, repeats: int) -> float:
    """Median seconds of forward + backward over ``repeats`` runs after one warm-up."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(x, head.weight, t).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
        x.grad = head.weight.grad = None
    return statistics.median(times)


def bench_head(args, device: torch.device) -> None:
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    variants = _variants(args.chunk_size)
    print(f"\nhead: H {args.hidden}, V {args.vocab}, {args.dtype}, {device}, chunk_size "
          f"{args.chunk_size or 'default'}; saved = MiB kept for backward (weight excluded), time = "
          f"median fwd+bwd of {args.repeats}; ratio = torch / variant")
    cols = ["tokens", "variant", "saved MiB", "saved ratio", "peak MiB", "time ms", "time ratio"]
    print("  ".join(f"{c:>15}" for c in cols))
    for n in args.tokens:
        x = torch.randn(n, args.hidden, device=device, dtype=dtype, requires_grad=True)
        t = torch.randint(0, args.vocab, (n,), device=device)
        rows = {}
        for name, fn in variants.items():
            saved, peak = _step(fn, head, x, t, device)
            rows[name] = (saved, peak, _time(fn, head, x, t, device, args.repeats))
        base = rows["torch"]
        for name, (saved, peak, secs) in rows.items():
            cells = [n, name, f"{saved / MIB:.2f}", f"{base[0] / saved:.1f}x" if saved else "-",
                     "n/a" if peak is None else f"{peak / MIB:.1f}", f"{secs * 1e3:.1f}",
                     f"{base[2] / secs:.2f}x"]
            print("  ".join(f"{c!s:>15}" for c in cells))


def bench_gpt2(args) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    seq = args.gpt2_seq_len
    cfg = transformers.GPT2Config(n_layer=args.gpt2_layers, n_positions=max(1024, seq))
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    inputs = {"input_ids": ids, "labels": ids}
    print(f"\nGPT-2 (GPT2Config(), {cfg.n_layer} layers, random weights), 1 example x {seq} tokens, CPU: "
          f"MiB saved for backward (parameters excluded); fewbit: 3-bit activations, +quant: 4-bit "
          f"group quantizer (group 256); ratio = vanilla HF loss / variant")
    results = {}
    for loss_name, factory in (
        ("HF loss", lambda: transformers.GPT2LMHeadModel(cfg)),
        ("fused CE", lambda: patch_causal_lm_(transformers.GPT2LMHeadModel(cfg))),
    ):
        for variant, rep in compare(factory, inputs, bits=3, saved_bits=4, group_size=256).items():
            results[(variant, loss_name)] = rep
    base = results[("vanilla", "HF loss")]["saved_bytes"]
    print(f"{'variant':>14}  {'loss':>9}  {'saved MiB':>10}  {'ratio':>7}  {'loss value':>10}")
    for (variant, loss_name), rep in results.items():
        print(f"{variant:>14}  {loss_name:>9}  {rep['saved_bytes'] / MIB:10.1f}  "
              f"{base / rep['saved_bytes']:6.2f}x  {rep['loss']:10.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768, help="H, features of the head's input (GPT-2: 768)")
    ap.add_argument("--vocab", type=int, default=50257, help="V, classes (GPT-2: 50257)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048], help="N values")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: 2**24 // V)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (after one warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--gpt2-seq-len", type=int, default=256, help="tokens per example of the GPT-2 figure")
    ap.add_argument("--gpt2-layers", type=int, default=12, help="GPT-2 layers (12: GPT2Config's default)")
    ap.add_argument("--skip-head", action="store_true", help="skip the head benchmark")
    ap.add_argument("--skip-gpt2", action="store_true", help="skip the GPT-2 memory figure")
    args = ap.parse_args(argv)
    for name in ("hidden", "vocab", "repeats", "gpt2_seq_len", "gpt2_layers", *(("threads",) if args.threads else ())):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.tokens) < 1 or (args.chunk_size is not None and args.chunk_size < 1):
        ap.error("--tokens and --chunk-size must be >= 1")
    check_device(ap, args.device)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(_machine(device))
    if not args.skip_head:
        bench_head(args, device)
    if not args.skip_gpt2:
        bench_gpt2(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
