#!/usr/bin/env python
"""Train a small CNN (GELU, SiLU and ReLU activations) on scikit-learn's digits.

The variants are those of ``train_lm.py`` (vanilla, fewbit1..4, actnn2, fewbit3+quant4).
The digits images (1797 8x8 greyscale, shipped with scikit-learn, nothing downloaded) are
upsampled to 16x16 so the conv layers have some spatial extent; split: fixed permutation,
20 % validation.

Each (variant, seed) writes ``OUT/cnn_<variant>_seed<seed>.csv`` with columns
``step, train_loss, val_loss, accuracy, step_time_s, peak_saved_bytes``
(accuracy: top-1 on the validation split).

Example::

    python scripts/train_cnn.py --variants vanilla fewbit3 --seeds 0 1 2 --out results
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _data  # noqa: E402
from train_lm import VARIANTS, apply_variant, build_parser, check_variant, train_loop, write_csv  # noqa: E402


def build_cnn(width: int = 32, image: int = 16) -> nn.Module:
    """conv(1->w) GELU conv(w->2w) SiLU pool conv(2w->2w) ReLU pool -> linear GELU -> 10."""
    w = width
    return nn.Sequential(
        nn.Upsample(size=(image, image), mode="bilinear", align_corners=False),
        nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.GELU(),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.SiLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * w * (image // 4) ** 2, 4 * w), nn.GELU(),
        nn.Linear(4 * w, 10),
    )


def run_cnn(
    variant: str,
    seed: int,
    *,
    steps: int = 150,
    batch_size: int = 64,
    width: int = 32,
    lr: float = 3e-3,
    warmup: int = 20,
    eval_every: int = 15,
    device: str = "cpu",
    progress: bool = False,
    n_train: int | None = None,
) -> list[dict]:
    """Train one (variant, seed); return the CSV rows."""
    check_variant(variant)
    dev = torch.device(device)
    xtr, ytr, xva, yva = _data.load_digits()
    if n_train is not None:
        xtr, ytr = xtr[:n_train], ytr[:n_train]
    xtr, ytr, xva, yva = xtr.to(dev), ytr.to(dev), xva.to(dev), yva.to(dev)
    torch.manual_seed(seed)
    model = build_cnn(width).to(dev)
    step_ctx = apply_variant(model, variant)
    gen = torch.Generator().manual_seed(seed)

    def next_batch():
        idx = torch.randint(0, len(ytr), (batch_size,), generator=gen).to(dev)
        return xtr[idx], ytr[idx]

    def forward_loss(m, x, y):
        return nn.functional.cross_entropy(m(x), y)

    def evaluate(m):
        logits = m(xva)
        loss = float(nn.functional.cross_entropy(logits, yva))
        return loss, float((logits.argmax(-1) == yva).float().mean())

    return train_loop(model, step_ctx, next_batch, forward_loss, evaluate, steps=steps, lr=lr,
                      warmup=warmup, eval_every=eval_every,
                      progress=f"cnn {variant} seed {seed}" if progress else None)


def main(argv: Iterable[str] | None = None) -> int:
    p = build_parser(__doc__)
    p.set_defaults(steps=150, batch_size=64, eval_every=15)
    p.add_argument("--width", type=int, default=32, help="channels of the first conv")
    args = p.parse_args(argv)
    if args.width < 1:
        p.error(f"--width must be >= 1, got {args.width}")
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train = None
    if args.quick:
        args.steps, args.batch_size, args.width, args.eval_every, args.warmup = 6, 16, 4, 3, 2
        n_train = 256
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")
    for variant in args.variants:
        for seed in args.seeds:
            rows = run_cnn(variant, seed, steps=args.steps, batch_size=args.batch_size, width=args.width,
                           lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
                           device=args.device, progress=args.progress, n_train=n_train)
            path = args.out / f"cnn_{variant}_seed{seed}.csv"
            write_csv(path, rows)
            last = rows[-1]
            print(f"{variant:>15} seed {seed}: val_loss {float(last['val_loss']):.4f} "
                  f"acc {float(last['accuracy']):.4f} step {float(last['step_time_s']) * 1e3:.1f} ms "
                  f"saved {int(last['peak_saved_bytes']) / 2**20:.3f} MiB -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
