"""Real data present on every machine, with deterministic splits; nothing is downloaded.

- Text: the Python standard library's own sources (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, tests and site-packages excluded) plus the pydoc topic
  texts (``pydoc_data.topics``). Files are sorted by relative path; a file goes to
  validation when ``crc32(relative path) % 10 == 0``, else to training. Tokens are bytes
  (vocabulary 256), so no tokenizer has to be trained or fetched.
- Images: scikit-learn's ``digits`` (1797 8x8 images, shipped with the package), split
  by a fixed permutation (seed 0): 20 % validation.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TextData", "load_text", "TextBatcher", "load_digits"]

VOCAB_SIZE = 256


@dataclass
class TextData:
    """Byte tokens of the training and validation text (uint8 tensors) and their sources."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int


def _stdlib_texts() -> list[tuple[str, bytes]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        parts = set(rel.parts)
        if parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            continue
        try:
            out.append((rel.as_posix(), p.read_bytes()))
        except OSError:
            continue
    try:
        from pydoc_data import topics

        for name in sorted(topics.topics):
            out.append((f"pydoc_data/topics/{name}", topics.topics[name].encode("utf-8")))
    except ImportError:  # pragma: no cover - pydoc_data is part of CPython
        pass
    return out


def load_text(max_train_bytes: int = 4_000_000, max_val_bytes: int = 400_000) -> TextData:
    """Load the stdlib text corpus as byte tokens.

    Args:
        max_train_bytes: cap on training bytes (files are taken in sorted order until the
            cap; the last one is cut).
        max_val_bytes: cap on validation bytes.

    Returns:
        :class:`TextData` with ``train`` and ``val`` as 1-D uint8 tensors.

    Raises:
        RuntimeError: if the corpus is smaller than a few KiB (a broken Python install).
    """
    train, val = bytearray(), bytearray()
    n_train = n_val = 0
    for rel, data in _stdlib_texts():
        is_val = zlib.crc32(rel.encode()) % 10 == 0
        buf, cap = (val, max_val_bytes) if is_val else (train, max_train_bytes)
        if len(buf) >= cap:
            continue
        buf.extend(data[: cap - len(buf)])
        buf.extend(b"\n")
        if is_val:
            n_val += 1
        else:
            n_train += 1
    if len(train) < 4096 or len(val) < 1024:
        raise RuntimeError("the Python standard library sources are missing; cannot build the corpus")
    t = torch.frombuffer(bytearray(train), dtype=torch.uint8).clone()
    v = torch.frombuffer(bytearray(val), dtype=torch.uint8).clone()
    return TextData(train=t, val=v, train_files=n_train, val_files=n_val)


class TextBatcher:
    """Random training windows and fixed validation windows of ``seq_len + 1`` bytes.

    Args:
        data: the corpus.
        seq_len: tokens per example.
        batch_size: examples per batch.
        seed: seed of the training-window sampler (validation windows are fixed).
    """

    def __init__(self, data: TextData, seq_len: int, batch_size: int, seed: int) -> None:
        if seq_len < 2 or seq_len + 1 >= len(data.val):
            raise ValueError(f"seq_len must be in 2..{len(data.val) - 2}, got {seq_len}")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def _windows(self, src: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = src[idx].long()
        return w[:, :-1], w[:, 1:]

    def train_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch_size, seq_len)`` int64."""
        hi = len(self.data.train) - self.seq_len - 1
        starts = torch.randint(0, hi, (self.batch_size,), generator=self.gen)
        return self._windows(self.data.train, starts)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` fixed, evenly spaced validation batches (the same for every run)."""
        hi = len(self.data.val) - self.seq_len - 1
        n = n_batches * self.batch_size
        starts = torch.linspace(0, hi, n).long()
        return [self._windows(self.data.val, starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n_batches)]


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn digits as ``(x_train, y_train, x_val, y_val)``.

    ``x``: ``(n, 1, 8, 8)`` float32 scaled to [0, 1]; ``y``: ``(n,)`` int64 in 0..9. The split
    is a fixed permutation (seed 0), 20 % validation.
    """
    from sklearn.datasets import load_digits as _load

    d = _load()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = len(y) // 5
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]
