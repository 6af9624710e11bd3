#!/usr/bin/env python
"""Gradient noise of compressed attention: eager, torch's fused SDPA, and fewbit's SDPA.

One causal self-attention layer: ``x (B, T, D) -> q, k, v = x Wq, x Wk, x Wv`` (``H`` heads
of ``D / H``), attention, ``loss = sum(out * G)`` for a fixed random ``G``. Only the tensors
that the attention core saves go through the saved-tensor compressor (the projections'
inputs stay exact), so the figures isolate the attention's own noise. For every design and
bit width, ``--draws`` backward passes with fresh quantization noise are compared with the
exact gradient: the printed numbers are the mean over draws of ``|g - g_exact| / |g_exact|``
for the stacked ``(Wq, Wk, Wv)`` gradient and for the input gradient.

Designs (``--designs``):

- ``eager``: ``softmax(q kᵀ · scale + causal) v`` with matmul/softmax (saves q, k, P, v at
  ``b`` bits);
- ``sdpa``: torch's ``F.scaled_dot_product_attention`` with every saved float that needs
  grad at ``b`` bits (q, k, v, out; the logsumexp stays exact) -- the failure of
  docs/compression.md §1;
- ``sdpa_qk8``: the same with q and k at 8 bits and v, out at ``b`` bits;
- ``recompute``: :func:`fewbit.quant.attention.scaled_dot_product_attention` with q, k, v
  all at ``b`` bits (backward recomputes SDPA from them);
- ``fewbit``: what fewbit does, ``F.scaled_dot_product_attention`` inside ``with
  ActivationCompressor(b):`` (rerouted to the recompute; q, k at 8 bits, or kept exact
  when ``b = 8``; v at ``b`` bits).

Example::

    python scripts/bench_attention_noise.py --bits 1 2 4 8 --draws 32
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

import torch
import torch.nn.functional as F

DESIGNS = ("eager", "sdpa", "sdpa_qk8", "recompute", "fewbit")


def _eager(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make_problem(batch=4, heads=4, seq=128, head_dim=32, seed=0, gain=1.0):
    """``x, (Wq, Wk, Wv), G``; q, k, v entries have standard deviation ``gain``."""
    g = torch.Generator().manual_seed(seed)
    d = heads * head_dim
    x = torch.randn(batch, seq, d, generator=g)
    ws = [torch.randn(d, d, generator=g) * (gain / math.sqrt(d)) for _ in range(3)]
    grad_out = torch.randn(batch, seq, d, generator=g)
    return x, ws, grad_out, heads


def gradients(design, problem, comp=None, comp8=None):
    """``(stacked W grads, input grad)`` for one draw (exact if ``comp`` is None)."""
    from fewbit.quant.attention import _Bypass, scaled_dot_product_attention

    x, ws, grad_out, heads = problem
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in ws]
    b, t, d = x.shape
    q, k, v = ((x @ w).view(b, t, heads, d // heads).transpose(1, 2).contiguous() for w in ws)
    qk = {q.data_ptr(), k.data_ptr()}

    def pack(tensor):
        if comp is None:
            return tensor
        use = comp8 if comp8 is not None and tensor.data_ptr() in qk else comp
        return (use._pack(tensor),)

    def unpack(packed):
        return type(comp)._unpack(packed[0]) if isinstance(packed, tuple) else packed

    if design == "fewbit":
        with comp if comp is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _Bypass():
            if design == "eager":
                out = _eager(q, k, v)
            elif design in ("sdpa", "sdpa_qk8"):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif design == "recompute":
                out = scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    out = out.transpose(1, 2).reshape(b, t, d)
    out.backward(grad_out)
    return torch.cat([w.grad.reshape(-1) for w in ws]), x.grad.reshape(-1)


def relative_errors(design, bits, draws, problem, seed=0):
    """Mean over ``draws`` of the relative error of the W gradient and of the input gradient."""
    from fewbit.quant import ActivationCompressor

    exact_w, exact_x = gradients(design, problem)
    gen = torch.Generator().manual_seed(seed)
    comp = ActivationCompressor(bits, generator=gen)
    comp8 = ActivationCompressor(8, generator=gen) if design.endswith("_qk8") else None
    ew, ex = [], []
    for _ in range(draws):
        gw, gx = gradients(design, problem, comp, comp8)
        ew.append(((gw - exact_w).norm() / exact_w.norm()).item())
        ex.append(((gx - exact_x).norm() / exact_x.norm()).item())
    return sum(ew) / draws, sum(ex) / draws


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8], choices=(1, 2, 4, 8))
    p.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS)
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gain", type=float, default=1.0, help="std of the q, k, v entries")
    args = p.parse_args(argv)
    if args.draws < 1:
        p.error(f"--draws must be >= 1, got {args.draws}")
    problem = make_problem(seed=args.seed, gain=args.gain)
    print("relative error per draw, W (Wq, Wk, Wv) / input x; mean over", args.draws, "draws")
    print(f"{'design':>10} " + " ".join(f"{f'{b} bit':>19}" for b in args.bits))
    for design in args.designs:
        cells = []
        for b in args.bits:
            ew, ex = relative_errors(design, b, args.draws, problem, seed=args.seed)
            cells.append(f"{ew:9.3g} /{ex:9.3g}")
        print(f"{design:>10} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
