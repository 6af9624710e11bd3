#!/usr/bin/env python
"""Train a small byte-level LM from scratch on the Python standard library sources: GPT-2
(``--arch gpt2``, default), LLaMA-style (``--arch llama``: gated SiLU MLP, RMSNorm) or
Phi-3-style (``--arch phi3``: the same with fused q/k/v and gate/up projections).

Variants (``--variants``; defined, with the training loop, in ``scripts/_training.py``):

- ``vanilla``: torch/transformers as is;
- ``fewbit1`` .. ``fewbit4``: activations replaced by fewbit b-bit backward
  (``fewbit.convert_``; Novikov et al., "Few-bit Backward", ICML 2023);
- ``actnn2``: the paper's ActNN baseline: only the activation functions' saved inputs are
  group-quantized to 2 bits (``fewbit.compress_activations`` inside each activation);
- ``fewbit3+quant4``, ``fewbit3+quant2``: fewbit 3-bit activations and every other saved
  tensor quantized to 4 (2) bits (docs/method.md §7);
- ``gact2``, ``gact4``, ``division``, ``adacc``: the adaptive compressors
  (docs/compression.md §2-§4).

Each (variant, seed) writes ``OUT/lm_<variant>_seed<seed>.csv`` with columns
``step, train_loss, val_loss, accuracy, step_time_s, peak_saved_bytes`` (loss in nats per
byte; accuracy = next-byte top-1 on the validation windows; step_time_s = mean wall time of
a training step since the previous row; peak_saved_bytes = the largest number of bytes
saved for backward by one step, counted exactly by ``fewbit.memory.SavedTensorRecorder``).

Example::

    python scripts/train_lm.py --variants vanilla fewbit3 --seeds 0 1 --steps 200 --out results
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
# VARIANTS, apply_variant and write_csv are also used as train_lm.<name> (tests, main_job.py,
# notebooks/memory.ipynb).
from _training import VARIANTS, apply_variant, check_variant, positive_int, write_csv  # noqa: E402,F401


#: ``--arch`` choices of :func:`build_lm`.
ARCHS = ("gpt2", "llama", "phi3")


def build_lm(n_layer: int, n_embd: int, n_head: int, seq_len: int, attention: str = "sdpa",
             arch: str = "gpt2") -> nn.Module:
    """A transformers causal LM with a 256-byte vocabulary, no dropout, random init.

    ``arch``: ``"gpt2"`` (exact GELU MLP, LayerNorm) or ``"llama"`` (gated SiLU MLP,
    ``act(gate(x)) * up(x)`` with ``intermediate_size`` = 8/3 of the width rounded up to a
    multiple of 8, RMSNorm, rotary positions) or ``"phi3"`` (LLaMA's layout with fused
    ``qkv_proj`` and ``gate_up_proj`` projections, split with ``chunk``/slicing: the factor
    ``up`` is a strided view of the fused output). ``attention``: transformers' attention
    implementation, ``"sdpa"`` (fused) or ``"eager"`` (explicit softmax, whose probabilities
    are saved for backward).
    """
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Phi3Config,
                              Phi3ForCausalLM)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if arch in ("llama", "phi3"):
        config, model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Phi3Config, Phi3ForCausalLM)
        cfg = config(
            vocab_size=_data.VOCAB_SIZE, max_position_embeddings=seq_len, hidden_size=n_embd,
            intermediate_size=-(-8 * n_embd // 3 // 8) * 8, num_hidden_layers=n_layer, num_attention_heads=n_head,
            num_key_value_heads=n_head, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )
        cfg._attn_implementation = attention
        return model(cfg)
    if arch != "gpt2":
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cfg = GPT2Config(
        vocab_size=_data.VOCAB_SIZE, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    cfg._attn_implementation = attention
    return GPT2LMHeadModel(cfg)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte) of ``x: (batch, seq_len)`` against ``y``."""
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# Keyword arguments spelled out (alike in train_cnn.py and train_lm.py, deliberately): each
# script's defaults; the options they share are forwarded by _training.loop_options.
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
    attention: str = "sdpa",
    arch: str = "gpt2",
    group_size: int = 256,
    noise_draw: int = 0,
) -> list[dict]:
    """Train one (variant, seed) and return the CSV rows (``group_size``: the group
    quantizer's, see ``_training.apply_variant``)."""
    check_variant(variant)
    data = data or _data.load_text()
    dev = torch.device(device)
    batcher = _data.TextBatcher(data, seq_len, batch_size, seed)
    val = [(a.to(dev), b.to(dev)) for a, b in batcher.val_batches(val_batches)]

    def next_batch():
        a, b = batcher.train_batch()
        return a.to(dev), b.to(dev)

    def evaluate(m):
        tot, correct, n = 0.0, 0, 0
        for x, y in val:
            logits = m(input_ids=x).logits.float()
            tot += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += y.numel()
        return tot / n, correct / n

    task = _training.Task(next_batch, lm_loss, evaluate)
    return _training.train_variant("lm", variant, seed,
                                   lambda: build_lm(n_layer, n_embd, n_head, seq_len, attention, arch), task,
                                   device=device, progress=progress, group_size=group_size, noise_draw=noise_draw, steps=steps, lr=lr,
                                   warmup=warmup, eval_every=eval_every)


def main(argv: Iterable[str] | None = None) -> int:
    p = _training.build_parser(__doc__)
    # this script's own options (argparse declarations, alike in shape to other scripts')
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--val-batches", type=positive_int, default=8)
    p.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                   help="transformers' attention implementation (eager saves the softmax probabilities)")
    p.add_argument("--arch", choices=ARCHS, default="gpt2",
                   help="gpt2 (GELU MLP, LayerNorm), llama (gated SiLU MLP, RMSNorm, rotary positions) or "
                        "phi3 (llama with fused qkv and gate/up projections)")
    args = p.parse_args(argv)
    def check(args):  # the sizes after --quick's
        if args.width % args.heads:
            p.error(f"--width must be a multiple of --heads, got {args.width} and {args.heads}")
        if args.arch != "gpt2" and (args.width // args.heads) % 2:
            p.error(f"--width / --heads (the head size) must be even with --arch {args.arch} (rotary positions "
                    f"rotate pairs of channels), got {args.width} / {args.heads} = {args.width // args.heads}")

    _training.setup(p, args, quick=dict(steps=6, batch_size=4, seq_len=32, layers=1, width=32, heads=2,
                                        eval_every=3, val_batches=2, warmup=2), check=check)
    data = _data.load_text(max_train_bytes=200_000 if args.quick else 4_000_000,
                           max_val_bytes=50_000 if args.quick else 400_000)
    print(f"corpus: {len(data.train):,} train bytes ({data.train_files} files), "
          f"{len(data.val):,} val bytes ({data.val_files} files)", flush=True)
    if not 2 <= args.seq_len <= len(data.val) - 2:
        p.error(f"--seq-len must be in 2..{len(data.val) - 2} (the validation text), got {args.seq_len}")
    return _training.run_all(args, "lm", lambda variant, seed: run_lm(
        variant, seed, data=data, seq_len=args.seq_len, n_layer=args.layers, n_embd=args.width,
        n_head=args.heads, val_batches=args.val_batches, attention=args.attention, arch=args.arch,
        **_training.loop_options(args)))


if __name__ == "__main__":
    sys.exit(main())
