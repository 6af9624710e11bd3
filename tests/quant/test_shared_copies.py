"""A tensor saved by two calls shares one compressed copy only when no gradient can take
that copy's rounding error twice (ActivationCompressor._may_share).

In ``y = x * lin(x)`` the Linear saves ``x`` and the product saves it again beside
``lin(x)``: the Linear's weight gradient is ``Q(x)^T (g * Q(x))``. With one copy both
factors carry the same noise and the mean is off by ``sum g Var(Q(x))`` on the diagonal
(0.38 of the gradient's norm at 2 bits, 400 draws); with independent copies it is exact in
the mean. Parallel uses of one tensor (the q, k, v projections of one input) still share."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import fewbit
from fewbit.quant.compressor import ActivationCompressor


def _weight_grads(model_fn, lin, x0, g, draws):
    out = []
    for _ in range(draws):
        lin.zero_grad()
        x = x0.clone().requires_grad_() * 1.0  # a non-leaf, as inside a model
        model_fn(x).backward(g)
        out.append(lin.weight.grad.clone())
    return torch.stack(out)


def test_self_gated_linear_weight_gradient_is_unbiased():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16, bias=False).double()
    x0 = torch.randn(64, 16, dtype=torch.float64)
    g = torch.ones(64, 16, dtype=torch.float64)
    exact = _weight_grads(lambda x: x * lin(x), lin, x0, g, 1)[0]
    comp = ActivationCompressor(bits=2, group_size=64, min_numel=1)

    def compressed(x):
        with comp:
            return x * lin(x)

    fewbit.manual_seed(0)
    draws = 400
    gs = _weight_grads(compressed, lin, x0, g, draws)
    se = (gs - exact).pow(2).sum((1, 2)).mean().sqrt() / draws**0.5
    bias = (gs.mean(0) - exact).norm()
    assert bias < 3 * se, (float(bias / exact.norm()), float(se / exact.norm()))  # was 0.38 against 0.023
    assert comp.stats.deduplicated == 0


def test_a_chain_through_a_converted_block_gets_two_copies():
    """The same product inside a model's repeated blocks, through ``fewbit.convert_``."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            return x * self.lin(x)

    model = nn.Sequential(nn.Linear(32, 32), *[Gate() for _ in range(2)])
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=1))
    model(torch.randn(64, 32)).sum().backward()
    comp = summary.compressor
    # in each block x is saved by the Linear and by the product: two copies each
    assert comp.stats.deduplicated == 0
    assert sum(r.shape == (64, 32) for r in comp.records.values()) >= 4


def test_parallel_uses_of_one_tensor_share_one_copy():
    """q, k and v projections of one input (their other arguments are parameters) share the
    input's copy, as before."""
    torch.manual_seed(0)
    q, k, v = (nn.Linear(64, 48) for _ in range(3))
    comp = ActivationCompressor(bits=2, min_numel=1)
    x = torch.randn(32, 64, requires_grad=True) * 1.0
    with comp:
        out = q(x) * k(x) + v(x)
    out.sum().backward()
    assert comp.stats.deduplicated == 2
    assert sum(r.shape == (32, 64) for r in comp.records.values()) == 1  # one copy of x


def test_a_custom_function_save_gets_its_own_copy():
    """A save the mode does not see the call of (a custom autograd.Function) is not shared:
    its other inputs are unknown."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * y, grad * x

    lin = nn.Linear(32, 32)
    comp = ActivationCompressor(bits=2, min_numel=1)
    x = torch.randn(64, 32, requires_grad=True) * 1.0
    with comp:
        out = Scale.apply(x, lin(x))
    out.sum().backward()
    assert comp.stats.deduplicated == 0


def _mean_z2(grad_fn, draws):
    """Mean over elements of z^2 = ((mean of draws - exact) / standard error)^2: about 1
    for an unbiased estimator."""
    exact = grad_fn(False)
    fewbit.manual_seed(0)
    gs = torch.stack([grad_fn(True) for _ in range(draws)])
    z = (gs.mean(0) - exact) / (gs.std(0) / draws**0.5)
    return float(z.pow(2).mean())


def test_a_composite_call_saving_a_tensor_twice_gets_two_copies():
    """``F.rms_norm`` is one call for the mode but saves ``x`` for ``pow`` and for ``x *
    rsqrt(...)``: the second save shared the first's copy and the input gradient took the
    rounding error twice (mean z^2 2753, 300 draws); now two copies."""
    torch.manual_seed(0)
    h = torch.randn(1024, 4)
    lin = nn.Linear(4, 4)
    norm = nn.RMSNorm(4, eps=1e-6)
    g = torch.rand(1024, 4) + 1.0

    def grad(compress):
        lin.bias.grad = None
        comp = ActivationCompressor(bits=2, min_numel=1, group_size=4)
        if compress:
            with comp:
                y = norm(lin(h))
        else:
            y = norm(lin(h))
        (y * g).sum().backward()
        return lin.bias.grad.clone()

    assert _mean_z2(grad, 300) < 4


def test_one_tensor_passed_twice_to_one_call_gets_two_copies():
    """``F.bilinear(x, x, W)``: the weight gradient ``Q(x)^T g Q(x)`` needs two independent
    copies (mean z^2 30 with one)."""
    torch.manual_seed(0)
    h = torch.randn(24, 12)
    lin = nn.Linear(12, 12)
    w = nn.Parameter(torch.randn(1, 12, 12) / 12**0.5)
    g = torch.randn(24) + 3.0

    def grad(compress):
        w.grad = None
        comp = ActivationCompressor(bits=2, min_numel=1, group_size=12)
        if compress:
            with comp:
                x = lin(h)
                out = F.bilinear(x, x, w)
        else:
            x = lin(h)
            out = F.bilinear(x, x, w)
        (out.squeeze(-1) * g).sum().backward()
        return w.grad.reshape(-1).clone()

    assert _mean_z2(grad, 250) < 3
