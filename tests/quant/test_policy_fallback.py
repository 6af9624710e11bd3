"""Tensors a policy's compressor cannot take: a per-tensor fallback, never an error mid-forward.

DIVISION, Adacc's outlier and channel-wise compressors need 2 or more dims; the compressors
take float16/bfloat16/float32/float64 only. Before the fallback a 1-D saved tensor under
``Config(compressor="division")`` raised ``ValueError`` inside the user's forward, and a
float8 tensor ``TypeError``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fewbit
from fewbit.quant.compressor import ActivationCompressor
from fewbit.quant.compressors import Compressor, GroupQuantizer, Keep, get_compressor
from fewbit.quant.policies import FixedPolicy, Policy, fallback_compressor


class _Scale(nn.Module):
    """``y = x * w`` with ``x`` 1-D: saves the 1-D ``x`` for ``w``'s gradient."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w


def _saved_1d_grad(compressor: ActivationCompressor, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    w = w.detach().clone().requires_grad_()
    h = x.clone().requires_grad_() * 1.0  # differentiable, not a leaf: taken by the compressor
    with compressor:
        y = h * w
    y.backward(g)
    return w.grad


def test_fallback_compressor_choice():
    assert fallback_compressor(get_compressor("division", bits=2)) == GroupQuantizer(2)
    assert fallback_compressor(get_compressor("outlier", bits=4)) == GroupQuantizer(4)
    assert fallback_compressor(get_compressor("channelwise", bits=8), group_size=64) == GroupQuantizer(8, group_size=64)
    assert isinstance(fallback_compressor(GroupQuantizer(4)), Keep)
    assert isinstance(fallback_compressor(Keep()), Keep)
    policy = FixedPolicy(get_compressor("division"))
    assert policy.fallback == GroupQuantizer(2)
    with pytest.raises(TypeError, match="fallback"):
        FixedPolicy(get_compressor("division"), fallback="group")


@pytest.mark.parametrize("name", ["division", "outlier", "channelwise"])
def test_1d_tensor_falls_back_and_gradient_is_unbiased(name):
    """A 1-D saved tensor gets the group quantizer at the compressor's bits; the weight
    gradient stays unbiased (mean of 400 draws, projected on random directions, within
    3 sigma of the exact gradient's projection)."""
    gen = torch.Generator().manual_seed(0)
    n = 300
    x, w, g = (torch.randn(n, generator=gen) for _ in range(3))
    exact = g * x
    comp = ActivationCompressor(compressor=get_compressor(name, bits=2 if name != "channelwise" else 4),
                                min_numel=0, generator=torch.Generator().manual_seed(1))
    draws = torch.stack([_saved_1d_grad(comp, x, w, g) for _ in range(400)])
    assert comp.stats.compressed == 400
    rec = comp.records[0]
    assert rec.compressor == "group" and rec.bits == (2 if name != "channelwise" else 4)
    assert not torch.equal(draws[0], exact)  # it was quantized
    for _ in range(5):  # random projections of the mean gradient, 3 sigma each
        u = torch.randn(n, generator=gen)
        proj = draws @ u
        assert abs(float(proj.mean() - exact @ u)) <= 3 * float(proj.std()) / math.sqrt(len(proj))


def test_config_division_on_unbatched_input():
    """``nn.LayerNorm`` on an unbatched (1-D) input saves a 1-D tensor: DIVISION cannot pool
    it, the group quantizer at 2 bits takes it; batched inputs of the Linear layers get
    DIVISION (the LayerNorm's the group quantizer by rows, Compressor.within). The model
    still trains (the loss falls)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    summary = fewbit.convert_(model, fewbit.Config(saved_bits=2, compressor="division", min_numel=0))
    comp = summary.compressor
    model(torch.randn(8, 16)).square().mean().backward()
    assert {r.kind: r.compressor for r in comp.records.values()} == {"linear": "division", "norm": "group"}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, target = torch.randn(16), torch.randn(4)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    one_d = [r for r in comp.records.values() if len(r.shape) == 1]
    # the LayerNorm's input at 8 bits (RESULT_BITS: a per-sample norm's input), the rest at 2
    assert one_d and all(r.compressor == "group" and r.bits == (8 if r.kind == "norm" else 2) for r in one_d)
    assert losses[-1] < 0.1 * losses[0]


class _SaveFloat8(torch.autograd.Function):
    """``y = x.float() * w``, saving ``x`` (float8) for ``w``'s gradient."""

    @staticmethod
    def forward(ctx, x8, w):
        ctx.save_for_backward(x8)
        return x8.float() * w

    @staticmethod
    def backward(ctx, g):
        (x8,) = ctx.saved_tensors
        return None, (g * x8.float()).sum(0)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtypes")
def test_float8_saved_tensor_is_kept_exact():
    x8 = torch.randn(32, 16).to(torch.float8_e4m3fn)
    w = torch.randn(16, requires_grad=True)
    comp = ActivationCompressor(bits=2, min_numel=0)
    with comp:
        y = _SaveFloat8.apply(x8, w)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(w.grad, x8.float().sum(0), rtol=0, atol=0)
    assert comp.stats.skipped.get("dtype") == 1 and comp.stats.compressed == 0


class _WrongPolicy(Policy):
    """Hands every tensor to DIVISION, supported or not."""

    def __init__(self) -> None:
        self.division = get_compressor("division")

    @property
    def default(self) -> Compressor:
        return self.division

    def choose(self, x, info):
        return self.division


def test_policy_choosing_an_unsupported_compressor_keeps_the_tensor():
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(50, generator=gen) for _ in range(3))
    comp = ActivationCompressor(policy=_WrongPolicy(), min_numel=0)
    grad = _saved_1d_grad(comp, x, w, g)
    torch.testing.assert_close(grad, g * x, rtol=0, atol=0)  # kept exact
    assert comp.records[0].compressor == "keep"
