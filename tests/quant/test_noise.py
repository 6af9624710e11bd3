"""Noise of stochastic rounding in saved-tensor compression (docs/compression.md §1).

Every compression must draw new noise (no two steps, layers or compressor instances replay a
pattern), and a run must be reproducible under ``fewbit.manual_seed`` (and, in a fresh
process, ``torch.manual_seed``), without drawing from torch's generators. The ActNN-style test
(Chen et al., ActNN, ICML 2021, repository test ``tests/test_conv_layer.py``: the mean of
many compressed gradients of one conv layer against the exact gradient) checks that the
compressed gradient is unbiased when a fresh compressor is made every step.

``python tests/quant/test_noise.py`` prints the figures of the ActNN-style test.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import fewbit
from fewbit.quant import ActivationCompressor


def _mlp_grads(model, x, make_comp):
    model.zero_grad(set_to_none=True)
    with make_comp():
        loss = model(x).square().mean()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return model, torch.randn(128, 64)


def test_fresh_compressors_in_successive_steps_draw_new_noise():
    model, x = _mlp()
    g1 = _mlp_grads(model, x, lambda: fewbit.compress_activations(2))
    g2 = _mlp_grads(model, x, lambda: fewbit.compress_activations(2))
    assert not torch.equal(g1, g2)
    # the same for ActivationCompressor made directly, and for one instance used twice
    g3 = _mlp_grads(model, x, lambda: ActivationCompressor(2))
    assert not torch.equal(g2, g3)
    comp = ActivationCompressor(2)
    assert not torch.equal(_mlp_grads(model, x, lambda: comp), _mlp_grads(model, x, lambda: comp))


def test_layers_and_instances_do_not_share_a_pattern():
    """Two equal tensors saved by two layers, or by two fresh compressors, get other codes."""
    x = torch.randn(64, 256, requires_grad=True)
    a, b = x * 1.0, x * 1.0  # equal activations, distinct storage (no deduplication)
    comp = ActivationCompressor(2)
    ha, hb = comp._pack(a), comp._pack(b)
    assert not torch.equal(ha.qt.packed, hb.qt.packed)
    hc = ActivationCompressor(2)._pack(a)
    hd = ActivationCompressor(2)._pack(a)
    assert not torch.equal(hc.qt.packed, hd.qt.packed)
    # same stats: only the noise differs
    assert torch.equal(ha.qt.mins, hb.qt.mins) and torch.equal(hc.qt.scales, hd.qt.scales)


def test_reproducible_under_manual_seed():
    model, x = _mlp()
    comp = ActivationCompressor(2)  # a long-lived instance (as fewbit.convert_ keeps one)
    runs = []
    for make in (lambda: fewbit.compress_activations(2), lambda: comp):
        for _ in range(2):
            fewbit.manual_seed(1234)  # re-seeding in the same process reproduces the run
            first = _mlp_grads(model, x, make)
            second = _mlp_grads(model, x, make)
            runs.append((first, second))
    for first, second in runs:
        assert torch.equal(first, runs[0][0]) and torch.equal(second, runs[0][1])
        assert not torch.equal(first, second)
    torch.manual_seed(4321)
    assert not torch.equal(_mlp_grads(model, x, lambda: comp), runs[0][0])


def test_torch_rng_untouched_by_compression():
    """The seeds come from fewbit's own stream (generator=None) or the generator given;
    torch's default CPU generator is never drawn from: CPU dropout masks and data order are
    those of an uncompressed run. Before, each compressed tensor took one draw from it."""
    model, x = _mlp()
    torch.manual_seed(7)
    expected = torch.rand(4)
    for make in (lambda: ActivationCompressor(2, generator=torch.Generator().manual_seed(3)),
                 lambda: ActivationCompressor(2)):
        torch.manual_seed(7)
        comp = make()
        _mlp_grads(model, x, lambda: comp)
        assert comp.stats.compressed == 2  # inputs of the second Linear and of square() (GELU's is kept exact)
        assert torch.equal(torch.rand(4), expected)


def actnn_conv_gradients(steps: int, bits: int = 2, stochastic: bool = True):
    """ActNN's conv-layer test on CPU: ``steps`` weight gradients, each with a fresh
    compressor around the conv only (its saved input quantized), and the exact gradient.

    Conv2d(32, 4, 3, stride 2, groups 2) on uniform [0, 1) input (8, 32, 16, 16) (ActNN's
    test: 100 input channels and larger inputs, on a GPU); loss: cross-entropy of the
    ReLU'd, spatially averaged output (as ActNN's test).

    Returns:
        ``(exact, grads)``: ``(D,)`` and ``(steps, D)`` float64, D = 576.
    """
    torch.manual_seed(0)
    layer = nn.Conv2d(32, 4, 3, stride=2, groups=2)
    x0 = torch.rand(8, 32, 16, 16, requires_grad=True)
    y = torch.randint(0, 4, (8,))

    def grad(comp):
        layer.zero_grad(set_to_none=True)
        x = x0 * 1.0  # an activation: leaves that require grad are kept exact
        if comp is None:
            pred = layer(x)
        else:
            with comp:
                pred = layer(x)
        F.cross_entropy(F.relu(pred).flatten(2).mean(2), y).backward()
        return layer.weight.grad.detach().double().reshape(-1).clone()

    exact = grad(None)
    grads = torch.stack([
        grad(fewbit.compress_activations(bits, min_numel=0, stochastic=stochastic)) for _ in range(steps)
    ])
    return exact, grads


def unbiasedness_statistic(exact: torch.Tensor, grads: torch.Tensor):
    """``(R, sigma_R)``: ``R = |mean - exact|**2 / (tr(C) / N)`` with ``C`` the sample
    covariance of the N gradients. For an unbiased estimator E[R] = 1; for Gaussian
    noise Var(|mean - exact|**2) = 2 tr(Sigma**2) / N**2, so the standard deviation of R is
    ``sigma_R = sqrt(2 tr(C**2)) / tr(C)`` (computed from the N x N Gram matrix; the sample
    estimate of tr(Sigma**2) is biased up, which makes the bound conservative). A bias b
    adds N |b|**2 / tr(C) to R. Infinite if the N gradients are all equal."""
    n = grads.shape[0]
    centered = grads - grads.mean(0)
    gram = centered @ centered.T / (n - 1)
    tr_c = gram.trace()
    tr_c2 = (gram * gram).sum()
    err2 = (grads.mean(0) - exact).pow(2).sum()
    if tr_c == 0:
        return math.inf, 0.0
    return (err2 / (tr_c / n)).item(), (math.sqrt(2 * tr_c2) / tr_c).item()


def test_actnn_conv_layer_gradient_unbiased():
    """Fresh compressor per step (2 bits): the mean of N compressed conv-weight gradients is
    within 3 sigma of the exact one, its error shrinks as 1/sqrt(N), and nearest rounding's
    bias is far larger. Before the fix every fresh compressor replayed one noise pattern:
    all N gradients were equal (R infinite) and the mean kept one draw's error."""
    n = 160
    exact, grads = actnn_conv_gradients(n)
    assert len({g.numpy().tobytes() for g in grads}) == n  # every step draws new noise
    r, sigma_r = unbiasedness_statistic(exact, grads)
    assert r < 1 + 3 * sigma_r, (r, sigma_r)
    # the same along two fixed directions (1-D t-tests, 3 sigma): the exact gradient's
    # direction and a random direction independent of the noise
    v_rand = torch.randn(exact.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for v in (exact, v_rand):
        proj = grads @ (v / v.norm())
        se = proj.std() / math.sqrt(n)
        assert (proj.mean() - exact @ (v / v.norm())).abs() < 3 * se
    # 1/sqrt(N): 4x the steps halves the error of the mean (loose: ~25 % sampling noise)
    err_n = (grads.mean(0) - exact).norm()
    err_quarter = (grads[: n // 4].mean(0) - exact).norm()
    assert 1.4 < err_quarter / err_n < 2.8, (err_quarter / err_n).item()
    # nearest rounding is biased: its error is many times the stochastic mean's
    _, nearest = actnn_conv_gradients(1, stochastic=False)
    assert (nearest[0] - exact).norm() > 4 * err_n


def main() -> None:  # pragma: no cover - prints the figures quoted in the report
    n = 200
    exact, grads = actnn_conv_gradients(n)
    _, nearest = actnn_conv_gradients(1, stochastic=False)
    r, sigma_r = unbiasedness_statistic(exact, grads)
    print(f"|exact grad| = {exact.norm():.4f}")
    print(f"stochastic, fresh compressor per step: distinct gradients {len({g.numpy().tobytes() for g in grads})}"
          f"/{n}, |mean of {n} - exact| = {(grads.mean(0) - exact).norm():.4f}, "
          f"|one step - exact| = {(grads[0] - exact).norm():.4f}, |std| = {grads.std(0).norm():.4f}, "
          f"R = {r:.3f} (3-sigma bound {1 + 3 * sigma_r:.3f})")
    print(f"nearest rounding: |grad - exact| = {(nearest[0] - exact).norm():.4f}")


if __name__ == "__main__":
    main()
