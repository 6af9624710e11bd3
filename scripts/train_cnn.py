#!/usr/bin/env python
"""Train a small CNN (GELU, SiLU and ReLU activations) on scikit-learn's digits.

The variants and the training loop are those of ``train_lm.py`` (``scripts/_training.py``:
vanilla, fewbit1..4, actnn2, fewbit3+quant4, fewbit3+quant2, gact2, gact4, division, adacc).
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
import _training  # noqa: E402


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


# Keyword arguments spelled out (alike in train_cnn.py and train_lm.py, deliberately): each
# script's defaults; the options they share are forwarded by _training.loop_options.
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
    group_size: int = 256,
    noise_draw: int = 0,
) -> list[dict]:
    """Train one (variant, seed); return the CSV rows (``group_size``: the group
    quantizer's, see ``_training.apply_variant``)."""
    _training.check_variant(variant)
    dev = torch.device(device)
    xtr, ytr, xva, yva = _data.load_digits()
    if n_train is not None:
        xtr, ytr = xtr[:n_train], ytr[:n_train]
    xtr, ytr, xva, yva = xtr.to(dev), ytr.to(dev), xva.to(dev), yva.to(dev)
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

    task = _training.Task(next_batch, forward_loss, evaluate)
    return _training.train_variant("cnn", variant, seed, lambda: build_cnn(width), task, device=device,
                                   progress=progress, group_size=group_size, noise_draw=noise_draw, steps=steps, lr=lr, warmup=warmup,
                                   eval_every=eval_every)


def main(argv: Iterable[str] | None = None) -> int:
    p = _training.build_parser(__doc__)
    p.set_defaults(steps=150, batch_size=64, eval_every=15, n_train=None)
    p.add_argument("--width", type=int, default=32, help="channels of the first conv")
    args = p.parse_args(argv)
    if args.width < 1:
        p.error(f"--width must be >= 1, got {args.width}")
    _training.setup(p, args, quick=dict(steps=6, batch_size=16, width=4, eval_every=3, warmup=2, n_train=256))
    return _training.run_all(args, "cnn", lambda variant, seed: run_cnn(
        variant, seed, width=args.width, n_train=args.n_train, **_training.loop_options(args)), mib_digits=3)


if __name__ == "__main__":
    sys.exit(main())
