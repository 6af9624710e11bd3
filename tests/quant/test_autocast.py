"""Saved-tensor compression under CPU autocast (bfloat16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fewbit
from fewbit.quant.compressor import ActivationCompressor


def test_attention_backward_with_mixed_dtypes_under_autocast():
    """LLaMA under autocast hands SDPA fp32 q and k (rotary step) and a bf16 v; autocast
    casts them inside SDPA. fewbit's SDPA recomputes in backward, outside autocast: it
    raised "Expected query, key, and value to have the same dtype". Its gradients now
    equal the ones without compression up to the 8/4-bit noise."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    k = torch.randn(2, 4, 64, 32, requires_grad=True)
    v = torch.randn(2, 4, 64, 32, requires_grad=True)

    def run(comp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if comp is None:
                out = F.scaled_dot_product_attention(q * 1, k * 1, (v * 1).bfloat16(), is_causal=True)
            else:
                with comp:
                    out = F.scaled_dot_product_attention(q * 1, k * 1, (v * 1).bfloat16(), is_causal=True)
        assert out.dtype == torch.bfloat16
        return torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))

    ref = run(None)
    got = run(ActivationCompressor(bits=4, min_numel=1))
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype == torch.float32
        assert (g - r).norm() < 0.2 * r.norm()


def test_hf_llama_trains_under_autocast_with_saved_bits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    fewbit.convert_(model, fewbit.Config(saved_bits=4, min_numel=1))
    ids = torch.randint(0, 100, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_autocast_weight_copies_are_kept_exact():
    """Autocast's bf16 copies of the weights are casts of parameters: kept exact like the
    parameters themselves (at 2 bits they were quantized: weight-gradient error 0.85)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    x = torch.randn(64, 512)
    comp = ActivationCompressor(bits=2)
    with torch.autocast("cpu", dtype=torch.bfloat16), comp:
        model(x).float().sum().backward()
    assert comp.stats.compressed == 1  # the second Linear's input only
    assert comp.stats.skipped_bytes["parameter"] == 512 * 512 * 2  # the second weight's bf16 copy


class _TransposedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x):
        return x @ self.weight.t()  # autocast casts the view: ToCopy <- T <- AccumulateGrad


def test_autocast_copies_of_parameter_views_are_kept_exact():
    """Autocast's bf16 copy of a view of a parameter (``x @ W.t()``, cross-attention's
    in-projection weights, split into q/k/v and cast) is a copy of a parameter: kept exact.
    They were quantized at 2 bits (the chain ToCopy <- T <- AccumulateGrad was not followed):
    the bias gradient of the Linear before, which needs only that copy, was 0.56 off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), _TransposedWeight())
    x = torch.randn(64, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.autograd.grad(model(x).float().sum(), model[0].bias)[0]
        comp = ActivationCompressor(bits=2)
        with comp:
            got = torch.autograd.grad(model(x).float().sum(), model[0].bias)[0]
    assert torch.equal(got, ref)  # x @ W^T's input gradient needs only the exact weight copy
    assert comp.stats.skipped_bytes["parameter"] == 256 * 256 * 2  # the bf16 copy of W.t()

    mha = nn.MultiheadAttention(96, 4, batch_first=True)
    q, kv = torch.randn(3, 40, 96, requires_grad=True), torch.randn(3, 56, 96, requires_grad=True)
    comp = ActivationCompressor(bits=2, min_numel=0)
    with torch.autocast("cpu", dtype=torch.bfloat16), comp:
        mha(q * 1, kv * 1, kv * 1, need_weights=False)[0].float().sum().backward()
    assert not [r for r in comp.records.values() if tuple(r.shape) in ((96, 96), (192, 96), (96, 192))]
    assert comp.stats.skipped_bytes["parameter"] == 4 * 96 * 96 * 2  # q, k, v and output projections


def test_a_batch_sized_copy_of_a_parameter_is_compressed():
    """Learned queries expanded over the batch and reshaped (Perceiver, attention pooling):
    the Linear's input is a per-sample copy, larger than the parameter, and is compressed
    like an activation; only copies no larger than their parameter count as parameters."""

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Parameter(torch.randn(64, 128))
            self.proj = nn.Linear(128, 128)

        def forward(self, x):
            q = self.query.expand(x.shape[0], -1, -1)  # a view (shares the parameter's memory)
            return self.proj(q.reshape(-1, 128)) + x.reshape(-1, 128)  # reshape: a (B*64, 128) copy

    model = Pool()
    comp = ActivationCompressor(bits=2)
    with comp:
        model(torch.randn(32, 64, 128)).sum().backward()
    assert comp.stats.compressed == 1 and comp.stats.bytes_before == 32 * 64 * 128 * 4
    assert comp.stats.skipped_bytes["parameter"] == 128 * 128 * 4  # proj's weight only


def test_an_expanded_view_of_a_parameter_is_a_parameter():
    """``W.t().expand(B, ...)`` fed to bmm is a view sharing W's memory: counted as the
    parameter it is (the size rule for copies had stopped the check before ``t._base``)."""
    weight = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(16, 32, 64, requires_grad=True)
    comp = ActivationCompressor(bits=2, min_numel=0)
    with comp:
        torch.bmm(x * 1, weight.t().expand(16, 64, 64)).sum().backward()
    assert comp.stats.skipped.get("parameter") == 1, comp.stats.skipped
