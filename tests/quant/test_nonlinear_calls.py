"""Calls whose backward is not linear in what they save (fewbit.quant.nonlinear).

Inside a compressor's block, stepwise activations go to fewbit's exact 1-bit versions and
the other such calls keep what they save exact; everything else is quantized as before.
Each test here failed before the rule (the saved tensors were quantized: gradients off).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fewbit
from fewbit.quant import ActivationCompressor
from fewbit.quant.nonlinear import KEEP, STEPWISE


def _data(shape=(64, 256), seed=0, positive=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 2
    if positive:
        x = x.abs() + 0.1
    else:  # exact zeros and the stepwise functions' corners, where torch's conventions show
        x.view(-1)[:12] = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 6.0, 3.0, -3.0, 0.1, 0.2, -0.2])
    return x, torch.randn(shape, generator=gen)


def _run(call, x0, g, comp=None):
    x = x0.clone().requires_grad_()
    if comp is None:
        y = call(x * 1)  # x * 1: a non-leaf, saved like a layer's activation (and in-place-able)
    else:
        with comp:
            y = call(x * 1)
    y.backward(g)
    return y.detach(), x.grad


def _same_as_torch(call, x0, g):
    """Run ``call`` without and with a 2-bit compressor: output and input gradient bit for
    bit the same, nothing quantized. Returns the compressor."""
    y_ref, g_ref = _run(call, x0, g)
    comp = ActivationCompressor(2, min_numel=0)
    y, grad = _run(call, x0, g, comp)
    assert torch.equal(y, y_ref)
    assert torch.equal(grad, g_ref)
    assert comp.stats.compressed == 0
    return comp


STEPWISE_CALLS = {
    "F.relu": lambda x: F.relu(x),
    "torch.relu": torch.relu,
    "Tensor.relu": lambda x: x.relu(),
    "F.relu inplace": lambda x: F.relu(x, inplace=True),
    "Tensor.relu_": lambda x: x.relu_(),
    "torch.relu_": torch.relu_,
    "nn.ReLU": nn.ReLU(),
    "F.leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "F.leaky_relu_": lambda x: F.leaky_relu_(x, negative_slope=0.2),
    "F.relu6": F.relu6,
    "F.hardtanh": lambda x: F.hardtanh(x, -0.5, max_val=0.5),
    "F.hardtanh_": lambda x: F.hardtanh_(x),
    "F.threshold": lambda x: F.threshold(x, 0.1, -2.0),
    "F.hardshrink": F.hardshrink,
    "Tensor.hardshrink": lambda x: x.hardshrink(0.2),
    "F.softshrink": lambda x: F.softshrink(x, 0.2),
    "F.hardsigmoid": F.hardsigmoid,
}


@pytest.mark.parametrize("name", list(STEPWISE_CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stepwise_calls_are_exact_from_one_bit(name, dtype):
    """Output and input gradient bit for bit torch's; what is kept is a 1-bit code (no
    float tensor quantized). Before: the result (or input) was quantized at 2 bits, and
    its rounding to 0 dropped gradients."""
    call = STEPWISE_CALLS[name]
    x0, g = _data()
    x0, g = x0.to(dtype), g.to(dtype)
    comp = _same_as_torch(call, x0, g)
    assert comp.stats.skipped.get("dtype", 0) == 1  # the packed 1-bit codes


def test_stepwise_calls_below_min_numel_stay_torch_calls():
    """A tensor the compressor would keep exact anyway (fewer than ``min_numel`` elements)
    needs no 1-bit code: torch's own ReLU runs, with no extra autograd function."""
    x = torch.randn(8, 8, requires_grad=True)
    with ActivationCompressor(2) as comp:  # min_numel 4096
        y = F.relu(x * 1)
    assert type(y.grad_fn).__name__ == "ReluBackward0"
    assert comp.stats.skipped == {"small": 1}


#: Stepwise calls with parameters torch takes and fewbit.functional refuses (non-finite,
#: negative lambd, a degenerate range): torch's own call runs, and what it saves is kept.
TORCH_ONLY_STEPWISE_CALLS = {
    "F.threshold value -inf": lambda x: F.threshold(x, 0.1, float("-inf")),
    "F.threshold nan": lambda x: F.threshold(x, float("nan"), 0.0),
    "F.leaky_relu slope inf": lambda x: F.leaky_relu(x, float("inf")),
    "F.hardshrink lambd -1": lambda x: F.hardshrink(x, -1.0),
    "F.hardtanh empty range": lambda x: F.hardtanh(x, 0.5, 0.5),
}


@pytest.mark.parametrize("name", list(TORCH_ONLY_STEPWISE_CALLS))
def test_stepwise_calls_fewbit_refuses_keep_what_torch_saves(name):
    """Output and input gradient bit for bit torch's (NaN where torch's are), nothing
    quantized. Before: torch's call ran and its saved input was quantized at 2 bits, so its
    mask (``x > threshold``) was taken on rounded values."""
    call = TORCH_ONLY_STEPWISE_CALLS[name]
    x0, g = _data()
    y_ref, g_ref = _run(call, x0, g)
    comp = ActivationCompressor(2, min_numel=0)
    y, grad = _run(call, x0, g, comp)
    assert torch.equal(y.nan_to_num(), y_ref.nan_to_num()) and torch.equal(y.isnan(), y_ref.isnan())
    assert torch.equal(grad.nan_to_num(), g_ref.nan_to_num()) and torch.equal(grad.isnan(), g_ref.isnan())
    assert comp.stats.compressed == 0


KEEP_CALLS = {
    "F.gelu": (F.gelu, False),
    "nn.GELU tanh": (nn.GELU(approximate="tanh"), False),
    "F.silu": (F.silu, False),
    "F.softplus": (F.softplus, False),
    "F.elu": (F.elu, False),
    "x ** 3": (lambda x: x ** 3, False),
    "torch.pow 1.5": (lambda x: torch.pow(x, 1.5), True),
    "Tensor.abs": (lambda x: x.abs(), False),
    "torch.log": (torch.log, True),
    "torch.clamp": (lambda x: torch.clamp(x, -0.5, 0.5), False),
    "Tensor.clamp_": (lambda x: x.clamp_(min=0.3), False),
    "torch.amax": (lambda x: torch.amax(x, dim=-1), False),
    "divide": (lambda x: x / x.detach().flip(0).requires_grad_(), True),
    "torch.logsumexp": (lambda x: torch.logsumexp(x, -1), False),
    "Tensor.std": (lambda x: x.std(-1), False),
    "F.normalize": (lambda x: F.normalize(x, dim=-1), False),
    "torch.erf": (torch.erf, False),
    "F.l1_loss": (lambda x: F.l1_loss(x, torch.zeros_like(x), reduction="none"), False),
    # found by a hostile review (2-bit groups, mean z^2 of the input gradient 7-215):
    "torch.logaddexp": (lambda x: torch.logaddexp(x, x.detach().flip(0).requires_grad_()), False),
    "torch.special.ndtr": (torch.special.ndtr, False),
    "torch.special.i0e": (torch.special.i0e, False),
    "torch.remainder": (lambda x: torch.remainder(x.detach().flip(0), x), True),
    "torch.copysign": (lambda x: torch.copysign(x, x.detach().flip(0).requires_grad_()), False),
    "torch.special.entr": (torch.special.entr, True),
    "torch.fmod": (lambda x: torch.fmod(x.detach().flip(0), x), True),
    # a hostile review: a mask x == result, empty on rounded copies (gradient 0, or 0/0 = NaN)
    "Tensor.median": (lambda x: x.median(), False),
    "torch.nanmedian": (torch.nanmedian, False),
    "scatter_reduce amax": (lambda x: torch.zeros(8, x.shape[1]).scatter_reduce(
        0, torch.arange(x.shape[0])[:, None].expand_as(x) % 8, x, "amax", include_self=False), False),
    "Tensor.index_reduce amin": (lambda x: torch.zeros(8, x.shape[1]).index_reduce(
        0, torch.arange(x.shape[0]) % 8, x, "amin", include_self=False), False),
    "torch.segment_reduce max": (lambda x: torch.segment_reduce(
        x, "max", lengths=torch.full((8,), x.shape[0] // 8), axis=0), False),
    "scatter_reduce prod": (lambda x: torch.ones(8, x.shape[1]).scatter_reduce(
        0, torch.arange(x.shape[0])[:, None].expand_as(x) % 8, x, "prod"), True),
}


@pytest.mark.parametrize("name", list(KEEP_CALLS))
def test_nonlinear_calls_keep_what_they_save_exact(name):
    """The input gradient is bit for bit torch's: nothing these calls save is quantized
    (reason ``nonlinear``). Before: their saved input/result was quantized at 2 bits."""
    call, positive = KEEP_CALLS[name]
    x0, _ = _data(positive=positive)
    ref_out = call(x0.clone().requires_grad_() * 1)
    g = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(5))
    comp = _same_as_torch(call, x0, g)
    assert comp.stats.skipped["nonlinear"] >= 1


def test_linear_powers_are_still_compressed():
    """``x ** 2``'s backward ``2 x g`` is linear in x: quantized, as any Linear's input."""
    x0, g = _data()
    comp = ActivationCompressor(2, min_numel=0)
    _run(lambda x: x ** 2, x0, g, comp)
    _run(lambda x: torch.pow(x, 1), x0, g, comp)
    assert "nonlinear" not in comp.stats.skipped
    assert comp.stats.compressed == 2


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_linear_scatter_reductions_are_still_compressed(reduce):
    """scatter_reduce / index_reduce / segment_reduce with "sum" or "mean": backward is
    linear in what they save, so the compressor quantizes it as before."""
    x0, _ = _data()
    index = torch.arange(x0.shape[0]) % 8
    calls = [
        lambda x: torch.zeros(8, x.shape[1]).scatter_reduce(0, index[:, None].expand_as(x), x, reduce),
        lambda x: torch.segment_reduce(x, reduce, lengths=torch.full((8,), x.shape[0] // 8), axis=0),
    ]
    if reduce == "mean":
        calls.append(lambda x: torch.zeros(8, x.shape[1]).index_reduce(0, index, x, reduce))
    for call in calls:
        comp = ActivationCompressor(2, min_numel=0)
        ref = call(x0.clone().requires_grad_() * 1)
        _run(call, x0, torch.randn(ref.shape), comp)
        assert "nonlinear" not in comp.stats.skipped, comp.stats.skipped


def test_a_tensor_kept_exact_is_not_quantized_again():
    """``abs`` keeps x exact; the Linear that then saves the same x reuses it instead of
    adding a 2-bit copy (no new bytes), and its weight gradient is exact."""
    x0, _ = _data()
    lin = nn.Linear(256, 256)
    comp = ActivationCompressor(2, min_numel=0)

    def call(x):
        return x.abs() + lin(x)

    g = torch.randn(64, 256)
    x = x0.clone().requires_grad_()
    with comp:
        out = call(x * 1)
    assert comp.stats.skipped["nonlinear"] == 1
    assert comp.stats.deduplicated == 1 and comp.stats.compressed == 0
    out.backward(g)
    w_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    call(x * 1).backward(g)
    assert torch.equal(w_grad, lin.weight.grad)


class _FusedSiLUProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused, self.down = nn.Linear(64, 512), nn.Linear(256, 64)

    def forward(self, x):
        gate, up = self.fused(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def test_a_view_of_a_storage_kept_exact_is_not_quantized():
    """A fused projection split in two: ``F.silu`` keeps its half ``gate`` exact, which holds
    the whole output's storage; the product then saves the other half ``up``, a view of the
    same storage. A quantized copy of ``up`` would only add bytes (before: 2-bit codes and
    stats of ``up`` on top); it reuses the kept storage."""
    torch.manual_seed(0)
    model, x = _FusedSiLUProduct(), torch.randn(128, 64)
    comp = ActivationCompressor(2, min_numel=0)
    with comp:
        rep = fewbit.memory.saved_tensor_report(model, x)
    assert comp.stats.skipped["nonlinear"] == 1  # gate
    # silu(gate), the product (down's input) and the output (the report's loss squares it)
    assert comp.stats.compressed == 3, comp.stats
    assert comp.stats.deduplicated == 1  # up
    q = fewbit.quant.compressors.GroupQuantizer(2)
    quantized = [round(q.bytes_per_element(torch.empty(shape)) * shape[0] * shape[1])
                 for shape in ((128, 256), (128, 256), (128, 64))]
    assert rep.saved_bytes == x.nbytes + 128 * 512 * 4 + sum(quantized), rep.saved_bytes


def test_tensors_outside_those_calls_are_quantized():
    """The rule is about the call: a Linear's input saved before a gelu of the same tensor
    was quantized already and stays so; the gelu's copy is exact (it adds bytes, never a
    bias); the Linear after the gelu gets its input quantized."""
    x0, g = _data(shape=(64, 64))
    x = x0.clone().requires_grad_()
    l1, l2 = nn.Linear(64, 64), nn.Linear(64, 64)
    comp = ActivationCompressor(2, min_numel=0)
    with comp:
        h = x * 1
        a = l1(h)  # saves h: quantized
        out = l2(F.gelu(h)) + a  # gelu keeps h exact; l2 saves gelu(h): quantized
    out.backward(g)
    assert comp.stats.compressed == 2
    assert comp.stats.skipped["nonlinear"] == 1
    assert comp.stats.deduplicated == 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def _mlp_grads(act, comp, x, t, model):
    model.zero_grad()
    if comp is None:
        loss = F.mse_loss(model[1](act(model[0](x))), t)
    else:
        with comp:
            loss = F.mse_loss(model[1](act(model[0](x))), t)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("act", [F.relu, lambda x: F.leaky_relu(x, 0.1), F.gelu], ids=["relu", "leaky_relu", "gelu"])
def test_mlp_gradient_with_functional_activation_is_unbiased(act):
    """Linear(64, 256) -> act -> Linear(256, 64) in a ``compress_activations(2)`` block: the
    mean of 200 draws of the whole gradient, projected on 5 random directions, within 3
    standard errors of the exact gradient's projection. Before: the mean was off by 12 %
    (relu), 9 % (leaky_relu), 4 % (gelu) of the gradient's norm, 8x, 4x and 1.3x the
    standard error of the mean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    x, t = torch.randn(512, 64), torch.randn(512, 64)
    exact = _mlp_grads(act, None, x, t, model)
    comp = ActivationCompressor(2, generator=torch.Generator().manual_seed(1))
    draws = torch.stack([_mlp_grads(act, comp, x, t, model) for _ in range(200)])
    assert comp.stats.compressed >= 200  # the second Linear's input was quantized
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        u = torch.randn(exact.numel(), generator=gen)
        proj = draws @ u
        assert abs(float(proj.mean() - exact @ u)) <= 3 * float(proj.std()) / math.sqrt(len(proj))
    # and the norm of the mean's error is that of noise, not of a bias
    mean_err = (draws.mean(0) - exact).norm()
    noise = (draws.std(0) / math.sqrt(len(draws))).norm()
    assert mean_err < 1.2 * noise, (float(mean_err), float(noise))


def test_converted_module_calling_functional_relu():
    """``fewbit.convert_`` cannot replace ``F.relu`` called inside a forward. Inside a module
    whose saved tensors it compresses (here one of kind ``attention``), the compressor's mode
    routes the call to the exact 1-bit ReLU; outside such modules nothing is compressed."""

    class GatedAttention(nn.Module):  # kind "attention" (the name ends with Attention)
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 8)

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    torch.manual_seed(0)
    net = nn.Sequential(GatedAttention())
    fewbit.convert_(net, fewbit.Config(saved_bits=2))
    x = torch.randn(64, 64)  # 64 x 256 hidden elements: above Config's min_numel (4096)
    out = net(x)
    comp = fewbit.convert.compressor_of(net)
    assert comp.stats.compressed == 1  # b's input
    assert comp.stats.skipped.get("dtype") == 1  # relu's 1-bit codes, not its result
    grad = torch.autograd.grad(out.sum(), net[0].a.weight)[0]
    inner = net[0]
    exact = torch.autograd.grad(inner.b(F.relu(inner.a(x))).sum(), inner.a.weight)[0]  # not compressed
    # a's weight gradient goes through relu's mask and b's (exact) weight only: exact
    assert torch.equal(grad, exact)


def test_tables_cover_the_callable_forms():
    assert STEPWISE[F.relu] == ("relu", False) and STEPWISE[torch.Tensor.relu_] == ("relu", True)
    assert STEPWISE[F.leaky_relu_] == ("leaky_relu", True)
    for f in (F.gelu, F.silu, torch.Tensor.__pow__, torch.Tensor.div, torch.Tensor.__rdiv__, torch.abs,
              torch.Tensor.clamp_, torch.linalg.vector_norm, F.binary_cross_entropy_with_logits):
        assert f in KEEP, f
    for f in (torch.Tensor.mul, F.linear, torch.exp, torch.matmul, F.softmax, torch.tanh):
        assert f not in KEEP and f not in STEPWISE, f
