#!/usr/bin/env python
"""Train a small GPT-2-style byte-level LM from scratch on the Python standard library sources.

Variants (``--variants``):

- ``vanilla``: torch/transformers as is;
- ``fewbit1`` .. ``fewbit4``: activations replaced by fewbit b-bit backward
  (``fewbit.convert_``; Novikov et al., "Few-bit Backward", ICML 2023);
- ``actnn2``: the paper's ActNN baseline: only the activation functions' saved inputs are
  group-quantized to 2 bits (``fewbit.compress_activations`` inside each activation);
- ``fewbit3+quant4``: fewbit 3-bit activations and every other saved tensor quantized to
  4 bits (docs/method.md §7).

Each (variant, seed) writes ``OUT/lm_<variant>_seed<seed>.csv`` with columns
``step, train_loss, val_loss, accuracy, step_time_s, peak_saved_bytes`` (loss in nats per
byte; accuracy = next-byte top-1 on the validation windows; step_time_s = mean wall time of
a training step since the previous row; peak_saved_bytes = the largest number of bytes
saved for backward by one step, counted exactly by ``fewbit.memory.SavedTensorRecorder``).

Example::

    python scripts/train_lm.py --variants vanilla fewbit3 --seeds 0 1 --steps 200 --out results
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _data  # noqa: E402

VARIANTS = ("vanilla", "fewbit1", "fewbit2", "fewbit3", "fewbit4", "actnn2", "fewbit3+quant4")
CSV_FIELDS = ("step", "train_loss", "val_loss", "accuracy", "step_time_s", "peak_saved_bytes")


# ---------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------

class QuantizedSavedActivation(nn.Module):
    """Run an activation module with its saved tensors group-quantized (ActNN baseline).

    Only tensors saved inside ``inner`` go through ``fewbit.compress_activations(bits)``.
    """

    def __init__(self, inner: nn.Module, bits: int = 2, group_size: int = 256) -> None:
        super().__init__()
        self.inner, self.bits, self.group_size = inner, bits, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import fewbit
        from fewbit.memory import resume_recording

        with fewbit.compress_activations(self.bits, group_size=self.group_size, min_numel=0):
            with resume_recording():
                return self.inner(x)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}"


def _replace_activations(model: nn.Module, make: Callable[[nn.Module], nn.Module]) -> int:
    from fewbit.memory import is_activation_module

    targets = [(name, m) for name, m in model.named_modules() if name and is_activation_module(m)]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(m))
    return len(targets)


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    return variant


def apply_variant(model: nn.Module, variant: str) -> Callable[[], contextlib.AbstractContextManager]:
    """Convert ``model`` in place for ``variant``; return a factory of the per-step context.

    ``fewbitB``: ``fewbit.convert_(model, Config(activation_bits=B))``; ``fewbit3+quant4``:
    ``Config(activation_bits=3, saved_bits=4)`` (linear/conv/norm/attention saved tensors
    group-quantized); ``actnn2``: activation modules wrapped in
    :class:`QuantizedSavedActivation` (2 bits). The returned context (entered around each
    forward) is currently a no-op for every variant.

    Raises:
        ValueError: for an unknown variant.
        RuntimeError: if a fewbit variant finds no activation to convert.
    """
    check_variant(variant)
    null = contextlib.nullcontext
    if variant == "vanilla":
        return null
    if variant == "actnn2":
        n = _replace_activations(model, lambda m: QuantizedSavedActivation(m, bits=2))
        if n == 0:
            raise RuntimeError("actnn2: the model has no activation module")
        return null
    import fewbit

    bits = int(variant[len("fewbit")])
    saved_bits = 4 if variant.endswith("+quant4") else None
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=bits, saved_bits=saved_bits))
    if not summary.replaced:
        raise RuntimeError(f"{variant}: fewbit.convert_ replaced no activation")
    return null


# ---------------------------------------------------------------------------------------
# Model and loop
# ---------------------------------------------------------------------------------------

def build_lm(n_layer: int, n_embd: int, n_head: int, seq_len: int) -> nn.Module:
    """GPT-2 (transformers) with a 256-byte vocabulary, exact GELU, no dropout, random init."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(
        vocab_size=_data.VOCAB_SIZE, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def train_loop(
    model: nn.Module,
    step_ctx: Callable[[], contextlib.AbstractContextManager],
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    forward_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    evaluate: Callable[[nn.Module], tuple[float, float]],
    *,
    steps: int,
    lr: float,
    warmup: int,
    eval_every: int,
    weight_decay: float = 0.01,
    progress: str | None = None,
) -> list[dict]:
    """AdamW training with exact saved-bytes counting; returns the CSV rows."""
    from fewbit.memory import SavedTensorRecorder

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rows: list[dict] = []
    losses, times, peak = [], [], 0
    rec = SavedTensorRecorder(model)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress, leave=True, dynamic_ncols=True)
    for step in range(1, steps + 1):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, steps, lr, warmup)
        x, y = next_batch()
        t0 = time.perf_counter()
        rec.reset()
        with step_ctx(), rec:
            loss = forward_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        peak = max(peak, rec.saved_bytes)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"training diverged at step {step} (loss {losses[-1]})")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % eval_every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                val_loss, acc = evaluate(model)
            rows.append({
                "step": step,
                "train_loss": f"{sum(losses) / len(losses):.6f}",
                "val_loss": f"{val_loss:.6f}",
                "accuracy": f"{acc:.6f}",
                "step_time_s": f"{sum(times) / len(times):.6f}",
                "peak_saved_bytes": peak,
            })
            losses, times, peak = [], [], 0
    if bar is not None:
        bar.close()
    return rows


def run_lm(
    variant: str,
    seed: int,
    *,
    data: _data.TextData | None = None,
    steps: int = 200,
    batch_size: int = 8,
    seq_len: int = 128,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    lr: float = 3e-3,
    warmup: int = 20,
    eval_every: int = 25,
    val_batches: int = 8,
    device: str = "cpu",
    progress: bool = False,
) -> list[dict]:
    """Train one (variant, seed) and return the CSV rows."""
    check_variant(variant)
    data = data or _data.load_text()
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = build_lm(n_layer, n_embd, n_head, seq_len).to(dev)
    step_ctx = apply_variant(model, variant)
    batcher = _data.TextBatcher(data, seq_len, batch_size, seed)
    val = [(a.to(dev), b.to(dev)) for a, b in batcher.val_batches(val_batches)]

    def next_batch():
        a, b = batcher.train_batch()
        return a.to(dev), b.to(dev)

    def forward_loss(m, x, y):
        logits = m(input_ids=x).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def evaluate(m):
        tot, correct, n = 0.0, 0, 0
        for x, y in val:
            logits = m(input_ids=x).logits.float()
            tot += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += y.numel()
        return tot / n, correct / n

    return train_loop(model, step_ctx, next_batch, forward_loss, evaluate, steps=steps, lr=lr,
                      warmup=warmup, eval_every=eval_every,
                      progress=f"lm {variant} seed {seed}" if progress else None)


def _positive(kind):
    def parse(s):
        v = kind(s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return parse


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT",
                   help=f"variants to train, of: {' '.join(VARIANTS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=_positive(int), default=200)
    p.add_argument("--batch-size", type=_positive(int), default=8)
    p.add_argument("--lr", type=_positive(float), default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=_positive(int), default=25)
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for the CSVs")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar per run")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    p = build_parser()
    p.add_argument("--seq-len", type=_positive(int), default=128)
    p.add_argument("--layers", type=_positive(int), default=2)
    p.add_argument("--width", type=_positive(int), default=128)
    p.add_argument("--heads", type=_positive(int), default=4)
    p.add_argument("--val-batches", type=_positive(int), default=8)
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f"--width must be a multiple of --heads, got {args.width} and {args.heads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.batch_size, args.seq_len, args.layers = 6, 4, 32, 1
        args.width, args.heads, args.eval_every, args.val_batches, args.warmup = 32, 2, 3, 2, 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")
    data = _data.load_text(max_train_bytes=200_000 if args.quick else 4_000_000,
                           max_val_bytes=50_000 if args.quick else 400_000)
    print(f"corpus: {len(data.train):,} train bytes ({data.train_files} files), "
          f"{len(data.val):,} val bytes ({data.val_files} files)", flush=True)
    for variant in args.variants:
        for seed in args.seeds:
            rows = run_lm(variant, seed, data=data, steps=args.steps, batch_size=args.batch_size,
                          seq_len=args.seq_len, n_layer=args.layers, n_embd=args.width,
                          n_head=args.heads, lr=args.lr, warmup=args.warmup,
                          eval_every=args.eval_every, val_batches=args.val_batches,
                          device=args.device, progress=args.progress)
            path = args.out / f"lm_{variant}_seed{seed}.csv"
            write_csv(path, rows)
            last = rows[-1]
            print(f"{variant:>15} seed {seed}: val_loss {float(last['val_loss']):.4f} "
                  f"acc {float(last['accuracy']):.4f} step {float(last['step_time_s']) * 1e3:.1f} ms "
                  f"saved {int(last['peak_saved_bytes']) / 2**20:.2f} MiB -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
