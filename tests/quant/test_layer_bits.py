"""``Config(layer_bits=...)``: other bits for the tensors saved by some layer kinds
(:class:`fewbit.quant.policies.LayerBitsPolicy`; ActNN's per-layer settings)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fewbit
from fewbit import Config
from fewbit.convert import compressor_of
from fewbit.memory import SavedTensorRecorder
from fewbit.quant import compressors as C
from fewbit.quant.policies import FixedPolicy, LayerBitsPolicy, SavedTensorInfo, WarmupPolicy

transformers = pytest.importorskip("transformers")


def _llama(layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _saved(config):
    model = _llama()
    fewbit.convert_(model, config)
    x = torch.randint(0, 128, (4, 64))
    with SavedTensorRecorder(model) as rec:
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return rec.saved_bytes, model


@pytest.mark.parametrize("given, message", [
    ({"block": 4, "mlp": 4}, r"layer_bits keys must be layer kinds that layers compresses.*'mlp'"),
    ({"block": 3}, r"layer_bits\['block'\] must be one of \(1, 2, 4, 8\)"),
    ({"block": True}, r"layer_bits\['block'\] must be"),
    ("block", "layer_bits must be a mapping from layer kinds to bits"),
    ([("block",)], "layer_bits must be a mapping from layer kinds to bits"),
])
def test_bad_layer_bits(given, message):
    with pytest.raises(ValueError, match=message):
        Config(saved_bits=2, layer_bits=given)


@pytest.mark.parametrize("other", [{}, {"saved_bits": "auto", "average_bits": 2}, {"compressor": "division"},
                                   {"compressor": "adacc"}])
def test_layer_bits_needs_integer_bits_and_the_group_quantizer(other):
    kwargs = {"saved_bits": 2, **other} if other else {}
    with pytest.raises(ValueError, match="layer_bits is only used with saved_bits 1, 2, 4 or 8 and compressor='group'"):
        Config(layer_bits={"block": 4}, **kwargs)


def test_layer_bits_kind_must_be_compressed():
    with pytest.raises(ValueError, match=r"layers compresses, \('linear',\), got 'block'"):
        Config(saved_bits=2, layers=("linear",), layer_bits={"block": 4})


def test_layer_bits_stored_sorted_and_replace_keeps_it():
    c = Config(saved_bits=2, layer_bits={"norm": 8, "block": 4})
    assert c.layer_bits == (("block", 4), ("norm", 8))
    assert hash(c) == hash(dataclasses.replace(c))
    assert dataclasses.replace(c, group_size=64).layer_bits == c.layer_bits


def test_policy_picks_the_kinds_compressor():
    two, four = C.get_compressor("group", bits=2), C.get_compressor("group", bits=4)
    policy = LayerBitsPolicy(FixedPolicy(two), {"block": four})
    x = torch.randn(64, 64)
    assert policy.choose(x, SavedTensorInfo(0, (64, 64), torch.float32, "layers.0", "block")) is four
    for kind in ("linear", "attention", None):
        assert policy.choose(x, SavedTensorInfo(0, (64, 64), torch.float32, "layers.0.x", kind)) is two
    assert policy.default is two and not policy.decides_qk
    # counted only where the kind's bits hold: a norm's input or a softmax result gets 8 bits
    # from the compressor whatever the policy chose (a review: {"norm": 1} changed nothing
    # and was counted, so fewbit memory did not warn)
    for role in ("norm_input", "result"):
        policy.choose(x, SavedTensorInfo(0, (64, 64), torch.float32, "layers.0", "block", role))
    assert policy.chosen == {"block": 1}
    with pytest.raises(TypeError, match="policy must be"):
        LayerBitsPolicy(two, {"block": four})
    with pytest.raises(TypeError, match=r"by_kind\['block'\] must be"):
        LayerBitsPolicy(FixedPolicy(two), {"block": 4})


def test_block_saves_at_their_own_bits_on_a_llama():
    """A LLaMA's gated MLP product is saved by the ``block`` kind: at 4 bits inside 2-bit
    saves the bytes lie between uniform 2 and uniform 4 bits; the gradients are finite."""
    two, _ = _saved(Config(saved_bits=2))
    mixed, model = _saved(Config(saved_bits=2, layer_bits={"block": 4}))
    four, _ = _saved(Config(saved_bits=4))
    assert two < mixed < four
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    policy = compressor_of(model).policy
    assert isinstance(policy, LayerBitsPolicy) and policy.by_kind["block"].bits == 4
    assert policy.policy.default.bits == 2


def test_warmup_keeps_the_more_bits():
    model = _llama()
    summary = fewbit.convert_(model, Config(saved_bits=2, warmup_steps=5, warmup_bits=4,
                                            layer_bits={"block": 8, "linear": 1}))
    policy = compressor_of(model).policy
    assert isinstance(policy, WarmupPolicy)
    assert {k: c.bits for k, c in policy.warm.by_kind.items()} == {"block": 8, "linear": 4}
    assert {k: c.bits for k, c in policy.policy.by_kind.items()} == {"block": 8, "linear": 1}
    assert "block: 8 bits" in str(summary)


def test_empty_layer_bits_is_none_and_a_kind_twice_is_refused():
    assert Config(saved_bits=2, layer_bits={}).layer_bits is None
    assert Config(saved_bits=2, layer_bits={}) == Config(saved_bits=2)
    with pytest.raises(ValueError, match="layer_bits names kind 'block' twice"):
        Config(saved_bits=2, layer_bits=(("block", 4), ("block", 8)))


@pytest.mark.parametrize("warmup", [0, 3])
def test_a_kind_that_gets_no_tensor_warns_once(warmup):
    """GPT-2's blocks save nothing of their own (their submodules do): layer_bits={"block": 4}
    changed nothing and said nothing. The first forward that compresses something now
    warns once (not an evaluation forward before it); a LLaMA's blocks save the gated-MLP
    product and do not warn."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=64))
    extra = {"warmup_steps": warmup} if warmup else {}
    for model, expected in ((gpt2, 1), (_llama(), 0)):
        fewbit.convert_(model, Config(saved_bits=2, layer_bits={"block": 4}, **extra))
        ids = torch.randint(0, 100, (2, 32))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(input_ids=ids)
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
        ours = [w for w in caught if "layer_bits for 'block' changed nothing" in str(w.message)]
        assert len(ours) == expected, [str(w.message) for w in caught]
