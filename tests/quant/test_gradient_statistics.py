"""Compressed gradients are unbiased, per layer kind (docs/compression.md §1).

For each layer kind, the gradient of ``loss = sum(layer(h) * G)`` (``h`` a non-leaf copy of
the input, ``G`` fixed) with respect to the input and to every parameter is drawn ``DRAWS``
times inside an :class:`~fewbit.quant.ActivationCompressor` whose explicit generator gives
every draw fresh noise. The mean of the draws must match the exact (uncompressed) gradient
within 3 sigma of the Monte-Carlo noise, along two fixed directions per gradient tensor: the
exact gradient's own (a shrunk or inflated gradient) and one random unit vector.
``z = (mean(d . g_i) - d . g) / (std(d . g_i) / sqrt(N))``, ``|z| < 3``. Seeds are fixed,
so the outcome is deterministic. ``test_detects_bias_of_fused_attention_with_exact_lse``
shows that the check has power: torch's SDPA with dequantized q, k and its exact logsumexp
(the failure of docs/compression.md §1) fails it.

Backward is linear in the saved tensor for Linear, Conv1d/2d (the weight gradient; the input
gradient does not read it): unbiased exactly. Embedding (indices), dropout masks and
fewbit's activation codes are stored losslessly: their gradients equal the exact ones bit
for bit where nothing else is compressed. Backward is nonlinear in what is saved for the
norms (``x_hat`` times a mean over ``x_hat``), eager attention (softmax backward reads
``P`` twice) and fewbit's SDPA (softmax recomputed from ``q, k``): the bias is second order
in the quantization step. Measured with ``python tests/quant/test_gradient_statistics.py
--bias`` (2048 draws, 4 bits then 2 bits, largest |bias| along the exact gradient's
direction as a fraction of one draw's noise along it): BIAS_TABLE_PLACEHOLDER

Per-draw relative noise ``mean_i |g_i - g| / |g|`` (input / weights), printed by ``python
tests/quant/test_gradient_statistics.py``:

NOISE_TABLE_PLACEHOLDER
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fewbit import modules as fm
from fewbit.quant import ActivationCompressor, compress_custom_saves
from fewbit.quant.attention import _Bypass

DRAWS = 32
#: Two-sided probability of the 3-sigma level: each test below is a family of checks that an
#: unbiased estimator fails with probability at most ALPHA (Bonferroni).
ALPHA = 0.0027
Z_MAX = 3.0
#: Largest fraction of a tensor's elements beyond their own 3-sigma level (0.27 % expected;
#: measured at most 1.6 %, elements next to a group's min or max have skewed noise).
MAX_OVER_3 = 0.02
#: Nonlinear backward: |bias along g| / |g| <= SECOND_ORDER * (per-draw relative noise)**2
#: (+ 3 standard errors). Measured ratio at most 1.05 (5 seeds, every kind, 2 and 4 bits).
SECOND_ORDER = 2.0


class _Attention(nn.Module):
    """Causal self-attention: fused qkv projection, eager or SDPA core, output projection."""

    def __init__(self, fused: bool, dim=32, heads=2, dropout=0.0):
        super().__init__()
        self.fused, self.heads, self.dropout = fused, heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        if self.fused:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        else:
            s = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = F.dropout(torch.softmax(s, dim=-1), self.dropout) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, d))


class _SDPAArguments(nn.Module):
    """SDPA with every argument: grouped-query heads (4 query, 2 key/value), a learned
    additive mask (its gradient too), a custom scale, dropout."""

    def __init__(self, dim=32, t=32):
        super().__init__()
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mask = nn.Parameter(0.5 * torch.randn(1, 4, t, t))

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.kv(x).split(d // 2, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=0.1, scale=0.2,
                                           enable_gqa=True)
        return a.transpose(1, 2).reshape(b, t, d)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.ids = torch.randint(0, 100, (16, 64), generator=torch.Generator().manual_seed(5))

    def forward(self, x):  # the embedding's input is integer ids; add saves nothing
        return self.emb(self.ids) + x


def _rms_norm():
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("torch.nn.RMSNorm needs torch >= 2.4")
    return nn.RMSNorm(64)


# name -> (module factory, input shape)
KINDS = {
    "linear": (lambda: nn.Linear(64, 48), (32, 64)),
    "conv1d": (lambda: nn.Conv1d(8, 12, 3, padding=1), (4, 8, 64)),
    "conv2d": (lambda: nn.Conv2d(3, 8, 3, padding=1), (4, 3, 16, 16)),
    "layer_norm": (lambda: nn.LayerNorm(64), (32, 64)),
    "rms_norm": (_rms_norm, (32, 64)),
    "batch_norm": (lambda: nn.BatchNorm2d(8), (4, 8, 8, 8)),
    "group_norm": (lambda: nn.GroupNorm(4, 8), (4, 8, 8, 8)),
    "eager_attention": (lambda: _Attention(fused=False), (4, 32, 32)),
    "sdpa": (lambda: _Attention(fused=True), (4, 32, 32)),
    "sdpa_dropout": (lambda: _Attention(fused=True, dropout=0.2), (4, 32, 32)),
    "sdpa_mask_scale_gqa": (_SDPAArguments, (4, 32, 32)),
    "eager_attention_dropout": (lambda: _Attention(fused=False, dropout=0.2), (4, 32, 32)),
    "embedding": (_Embed, (16, 64, 32)),
    "dropout": (lambda: nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.3), nn.Linear(64, 48)), (32, 64)),
    "fewbit_gelu": (lambda: nn.Sequential(nn.Linear(64, 64), fm.GELU(bits=3), nn.Linear(64, 48)), (32, 64)),
}
#: Kinds whose gradients are exact under compression (nothing lossy is saved).
EXACT = ("embedding",)
#: Kinds whose backward is linear in every compressed tensor: exactly unbiased.
LINEAR = ("linear", "conv1d", "conv2d", "dropout", "fewbit_gelu")
#: Nonlinear kinds -> the gradients in which the compressed tensor appears more than once.
_ATTN = ("input", "qkv.weight", "qkv.bias")
NONLINEAR_IN = {
    "layer_norm": ("input",), "rms_norm": ("input",), "batch_norm": ("input",), "group_norm": ("input",),
    "eager_attention": _ATTN, "sdpa": _ATTN, "sdpa_dropout": _ATTN, "eager_attention_dropout": _ATTN,
    "sdpa_mask_scale_gqa": ("input", "q.weight", "q.bias", "kv.weight", "kv.bias", "mask"),
}


def _setup(kind, seed=0):
    factory, shape = KINDS[kind]
    torch.manual_seed(seed)
    module = factory().train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=g).requires_grad_()
    with torch.no_grad():
        grad_out = torch.randn_like(module(x * 1))
    return module, x, grad_out


def _gradients(module, x, grad_out, comp=None, seed=3):
    """``{"input": dL/dx, name: dL/dparam}`` flattened, for one draw (exact if comp is None)."""
    params = [(n, p) for n, p in module.named_parameters()]
    torch.manual_seed(seed)  # the same dropout masks in every draw and in the exact run
    if comp is None:
        out = module(x * 1)
    else:
        with comp:
            out = module(x * 1)
    grads = torch.autograd.grad(out, [x] + [p for _, p in params], grad_out)
    return {name: g.flatten() for name, g in zip(["input"] + [n for n, _ in params], grads)}


def draw(kind, bits, draws=DRAWS, seed=0):
    """``(exact, samples)``: exact gradients and ``{name: (draws, numel)}`` compressed ones."""
    module, x, grad_out = _setup(kind, seed)
    exact = _gradients(module, x, grad_out)
    comp = ActivationCompressor(bits, min_numel=0, generator=torch.Generator().manual_seed(1000 * bits + seed))
    rows = [_gradients(module, x, grad_out, comp) for _ in range(draws)]
    return exact, {name: torch.stack([r[name] for r in rows]) for name in exact}


def t_level(draws, tests=1):
    """The |t| that a mean of ``draws`` draws exceeds with probability ``ALPHA / tests`` when
    unbiased (Student t, ``draws - 1`` degrees of freedom; Bonferroni over ``tests``)."""
    from scipy import stats

    return float(stats.t.ppf(1 - ALPHA / (2 * tests), draws - 1))


def check(exact, samples, seed=0):
    """Per gradient tensor: ``z`` (per-element t statistics of the mean, elements with
    noise), ``quiet_exact`` (elements without noise beyond float rounding -- e.g. the key
    bias's gradient, zero for any consistent softmax -- are exact to that rounding),
    ``z_random`` / ``z_exact`` (t of the mean along a fixed random unit vector / the exact
    gradient's direction), ``bias`` (the mean's error along the exact direction relative to
    |g|) and ``bias_se`` (its standard error)."""
    out = {}
    g = torch.Generator().manual_seed(seed + 7)
    for name, e in exact.items():
        s, e = samples[name].double(), e.double()
        n = len(s)
        se = s.std(dim=0) / math.sqrt(n)
        err = s.mean(dim=0) - e
        scale = float(s.abs().max()) or 1.0
        quiet = se <= 1e-6 * scale
        res = {"z": err[~quiet].abs() / se[~quiet], "quiet_exact": bool((err[quiet].abs() <= 1e-5 * scale).all())}
        for label, d in (("random", torch.randn(e.shape, generator=g, dtype=torch.float64)), ("exact", e)):
            res[f"z_{label}"] = None
            if d.norm() == 0:
                continue
            u = d / d.norm()
            p = s @ u
            psd = p.std().item() / math.sqrt(n)
            err_u = p.mean().item() - (e @ u).item()
            if psd > 0:
                res[f"z_{label}"] = err_u / psd
            if label == "exact":
                res["bias"], res["bias_se"] = err_u / e.norm().item(), psd / e.norm().item()
        out[name] = res
    return out


def failures(exact, samples, second_order=()):
    """The checks, as a list of what fails (empty: the mean matches the exact gradient).

    The t tests along fixed directions form one family at the 3-sigma level (Bonferroni): the
    random direction for every gradient tensor, the exact gradient's direction for those not
    in ``second_order``. Per element (tensors not in ``second_order``): at most
    ``MAX_OVER_3`` of the elements beyond their own 3-sigma level (0.27 % expected), none
    beyond the 3-sigma level of the family of all elements; elements without noise exact. For
    ``second_order`` tensors the bias along the exact direction must be at most
    ``SECOND_ORDER`` times the squared per-draw relative noise (plus 3 standard errors):
    second order in the quantization step (per element it shows where an element's own
    first-order noise vanishes, so they are not checked per element).
    """
    bad = []
    res = check(exact, samples)
    n = len(next(iter(samples.values())))
    tests = [(name, f"z_{d}") for name, r in res.items() for d in ("random", "exact")
             if r[f"z_{d}"] is not None and not (d == "exact" and name in second_order)]
    t_dir = t_level(n, max(len(tests), 1))
    for name, key in tests:
        if not abs(res[name][key]) < t_dir:
            bad.append(f"{name}: |{key}| = {abs(res[name][key]):.2f} >= {t_dir:.2f}")
    elements = sum(r["z"].numel() for name, r in res.items() if name not in second_order)
    t_one, t_all = t_level(n), t_level(n, max(elements, 1))
    for name, r in res.items():
        if not r["quiet_exact"] and name not in second_order:
            bad.append(f"{name}: an element without noise is not exact")
        if name in second_order:
            bound = SECOND_ORDER * _noise_of(name, exact, samples) ** 2 + Z_MAX * r["bias_se"]
            if not abs(r["bias"]) <= bound:
                bad.append(f"{name}: bias along g {r['bias']:.2e} beyond second order {bound:.2e}")
        elif r["z"].numel():
            over = (r["z"] > t_one).double().mean().item()
            if not (over <= MAX_OVER_3 and r["z"].max().item() < t_all):
                bad.append(f"{name}: {over:.2%} of elements beyond {t_one:.2f}, max {r['z'].max():.1f} (< {t_all:.1f})")
    return bad


def relative_noise(exact, samples):
    """Mean over draws of ``|g_i - g| / |g|`` for the input and for all weights together."""
    names = [n for n in exact if n != "input"]
    res = {}
    for label, keys in (("input", ["input"]), ("weights", names)):
        e = torch.cat([exact[k] for k in keys])
        s = torch.cat([samples[k] for k in keys], dim=1)
        res[label] = ((s - e).norm(dim=1) / e.norm()).mean().item() if e.norm() > 0 else 0.0
    return res


def _noise_of(name, exact, samples):
    e = exact[name]
    return ((samples[name] - e).norm(dim=1) / e.norm()).mean().item() if e.norm() > 0 else 0.0


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_mean_of_compressed_gradients_is_exact(kind, bits):
    exact, samples = draw(kind, bits)
    if kind in EXACT:
        assert all(torch.equal(samples[n], exact[n].expand_as(samples[n])) for n in exact)
        return
    # fresh noise in every draw: no two draws alike
    flat = torch.cat([samples[n] for n in exact], dim=1)
    assert not torch.equal(flat[0], flat[1])
    bad = failures(exact, samples, second_order=NONLINEAR_IN.get(kind, ()))
    assert not bad, (kind, bits, bad)


def test_lossless_kinds_are_exact():
    """Dropout masks and fewbit codes are stored losslessly: when only they go through the
    compressor (floats that need grad are kept), gradients equal the exact ones bit for bit."""

    for kind in ("dropout", "fewbit_gelu", "sdpa_dropout", "eager_attention_dropout"):
        module, x, grad_out = _setup(kind)
        exact = _gradients(module, x, grad_out)
        comp = ActivationCompressor(2, min_numel=0, generator=torch.Generator().manual_seed(0))

        def pack(t):
            return t if t.is_floating_point() and t.requires_grad else comp._pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, comp._unpack):
            got = _gradients(module, x, grad_out)
        for n in exact:
            assert torch.equal(got[n], exact[n]), (kind, n)
        assert comp.stats.packed_bool + comp.stats.skipped.get("dtype", 0) > 0, kind


class _LayerNormFromSaved(torch.autograd.Function):
    """LayerNorm whose backward recomputes mean and rstd from the saved (dequantized) input,
    the design fewbit uses for attention, applied to a norm."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.layer_norm(x, x.shape[-1:], weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            return torch.autograd.grad(F.layer_norm(x, x.shape[-1:], weight), (x, weight), grad)


def test_checks_catch_a_biased_design():
    """The checks have power. Recomputing a norm's statistics from the dequantized input
    (as fewbit does for attention) shrinks the gradient: x_hat has the variance of x plus the
    quantization noise, so its rstd is too small (LayerNorm, 2 bits: -23 % along g). Keeping
    the exact mean and rstd, as torch's norms do, leaves a bias of -1 % (test above)."""
    module = nn.LayerNorm(64)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad_out = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))

    def grads(comp=None):
        # a custom Function's saves are kept exact unless declared compressible
        with comp if comp is not None else torch.enable_grad(), compress_custom_saves():
            out = _LayerNormFromSaved.apply(x * 1, module.weight)
        gx, gw = torch.autograd.grad(out, (x, module.weight), grad_out)
        return {"input": gx.flatten(), "weight": gw.flatten()}

    exact = grads()
    comp = ActivationCompressor(2, min_numel=0, generator=torch.Generator().manual_seed(0))
    rows = [grads(comp) for _ in range(DRAWS)]
    samples = {n: torch.stack([r[n] for r in rows]) for n in exact}
    assert any(b.startswith("input") for b in failures(exact, samples))
    assert check(exact, samples)["input"]["bias"] < -0.1
    # a replayed noise pattern is caught too: identical draws that differ from the exact value
    rows = [grads(ActivationCompressor(2, min_numel=0, generator=torch.Generator().manual_seed(0)))
            for _ in range(4)]
    assert any(b.startswith("input") for b in failures(exact, {n: torch.stack([r[n] for r in rows]) for n in exact}))


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Per-kind gradient noise and bias under compression.")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--draws", type=int, default=DRAWS)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = p.parse_args(argv)
    print(f"per-draw relative noise (input / weights) and, for the worst gradient tensor, the bias "
          f"along the exact gradient relative to |g| (+- its standard error); {args.draws} draws")
    for kind in args.kinds:
        cells = []
        for b in args.bits:
            exact, samples = draw(kind, b, draws=args.draws)
            n = relative_noise(exact, samples)
            res = check(exact, samples)
            worst = max((r for r in res.values() if "bias" in r), key=lambda r: abs(r["bias"]), default=None)
            bias = f"{worst['bias']:+.1e} +- {worst['bias_se']:.0e}" if worst else "exact"
            cells.append(f"{b} bits: {n['input']:7.3g} / {n['weights']:7.3g}  bias {bias}")
        print(f"{kind:>24}  " + "   ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
