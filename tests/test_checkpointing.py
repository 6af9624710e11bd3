"""A converted model under the user's own gradient checkpointing (Hugging Face's
``gradient_checkpointing_enable``, ``torch.utils.checkpoint``)."""

from __future__ import annotations

import copy

import pytest
import torch

import fewbit
from fewbit.memory import saved_tensor_report

transformers = pytest.importorskip("transformers")


def _gpt2(n_layer):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=500, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _per_block_bytes(config, use_reentrant):
    ids = torch.randint(0, 500, (2, 128), generator=torch.Generator().manual_seed(1))
    sizes = []
    for n_layer in (2, 4):
        model = _gpt2(n_layer)
        if config is not None:
            fewbit.convert_(model, config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.train()
        sizes.append(saved_tensor_report(model, {"input_ids": ids, "labels": ids}).saved_bytes)
    return (sizes[1] - sizes[0]) / 2


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_hold_no_more_than_checkpointing_alone(use_reentrant):
    """The checkpoint drops what a block saves: the compressor must not take those tensors
    first (its hooks were the innermost: 994 KiB a block against checkpointing's 512)."""
    vanilla = _per_block_bytes(None, use_reentrant)
    converted = _per_block_bytes(fewbit.Config(saved_bits=4), use_reentrant)
    assert converted <= vanilla, (converted, vanilla)


def test_reentrant_checkpoint_input_is_kept_exact():
    """A reentrant checkpoint saves the block input through a custom Function and backward
    recomputes the whole block from it (norms, softmax, GELU): it is kept exact, and the
    recomputation is not compressed, so without few-bit activations the gradient is the
    checkpointed vanilla model's (a 2-bit block input biased it by 2.2 standard errors)."""
    ref = _gpt2(2)
    model = copy.deepcopy(ref)
    # the blocks only: the LM head's compressed input would add noise to every gradient
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, layers=("block",)))
    ids = torch.randint(0, 500, (2, 128), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.transformer.h.parameters()]))
    assert summary.compressor.stats.skipped.get("checkpoint", 0) == 2  # one input per block
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_a_checkpoint_inside_a_converted_module():
    """A user's checkpoint of the attention's forward inside a converted GPT-2 block: the
    forward ran under the block's mode (fewbit's SDPA) and the recomputation did not, and
    torch's checkpoint refused the different saves; inside a checkpoint the mode now hands
    every call to torch, in both."""
    import functools

    from torch.utils.checkpoint import checkpoint

    model = _gpt2(1)
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=4))
    attn = model.transformer.h[0].attn
    attn.forward = functools.partial(checkpoint, attn.forward, use_reentrant=False)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_functional_activations_inside_a_checkpoint_of_a_converted_model(act):
    """``F.gelu`` / ``F.relu`` called inside a non-reentrant checkpoint of a model converted
    with ``activation_bits``: the forward ran them as fewbit's (codes saved) and the
    recomputation, outside the model's activation mode, as torch's, and torch's checkpoint
    refused the different saves. Inside a checkpoint they are torch's in both: the
    checkpointed block's gradient is the unconverted model's."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def inner(self, x):
            return x + self.fc2(getattr(F, act)(self.fc1(x)))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    plain = copy.deepcopy(model)
    fewbit.convert_(model, bits=3)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
