"""Adversarial inputs for the group quantizer's range bound (docs/method.md §7).

Shared by tests/quant/test_bound.py and the interpreted Triton check (plain module, no
pytest import, so the Triton subprocess can import it by path).
"""

from __future__ import annotations

import torch

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # smallest normal, 2**-126
F32_SUB = 2.0 ** -149  # smallest subnormal


def _next_up(v: torch.Tensor, k: int) -> torch.Tensor:
    for _ in range(k):
        v = torch.nextafter(v, torch.full_like(v, float("inf")))
    return v


def adversarial_groups(bits: int, stats_dtype: torch.dtype, group_size: int = 64, n_groups: int = 1024,
                       seed: int = 0) -> torch.Tensor:
    """``(n_groups * group_size,)`` float32: groups built to break ``(x - m) * s <= 2**b - 1``.

    One group type per group (cycling):

    0. division overshoot: min 0 (so ``m = 0``) and max ``r`` chosen so that the exact
       ``(2**b - 1) / r`` lies just *below* a value of ``stats_dtype`` (``r`` = the float32
       quotient ``(2**b - 1) / v`` moved up by 0-3 ulps, ``v`` random on the stats grid):
       a division rounded to nearest lands on ``v``.
    1. the same with a random positive min (``m`` rounded down, ``r = hi - m`` rounded).
    2. wide ranges near the float32 max (``[-1.6e38, 1.6e38]``, ``[3e38, max]``).
    3. tiny ranges: a few ulps around 1, around 1e30, around -1e-30.
    4. subnormals: values in ``[0, 2**-126)``, ``{0, 2**-149}``, ``[-2**-130, 2**-130]``.
    5. ordinary data, N(0, 10**e) with e in [-3, 3].
    Every group holds its min and max exactly once, the rest uniform in between.
    """
    g = torch.Generator().manual_seed(seed)
    levels = float((1 << bits) - 1)
    G = group_size
    out = torch.empty(n_groups, G, dtype=torch.float32)
    u = torch.rand(n_groups, G, generator=g)

    def fill(i: int, lo: float, hi: float) -> None:
        lo_t = torch.tensor(lo, dtype=torch.float32)
        hi_t = torch.tensor(hi, dtype=torch.float32)
        row = (lo_t + (hi_t - lo_t) * u[i]) if torch.isfinite(hi_t - lo_t) else (lo_t * (1 - u[i]) + hi_t * u[i])
        row = torch.minimum(torch.maximum(row, lo_t), hi_t)
        row[0], row[-1] = lo_t, hi_t
        out[i] = row

    for i in range(n_groups):
        kind = i % 6
        r01 = torch.rand((), generator=g).item()
        k = int(torch.randint(0, 4, (), generator=g))
        if kind in (0, 1):
            v = torch.tensor(10.0 ** (8 * r01 - 4)).to(stats_dtype).to(torch.float32)  # on the stats grid
            r = _next_up(torch.tensor(levels, dtype=torch.float32) / v, k)
            if kind == 0:
                fill(i, 0.0, r.item())
            else:
                lo = float(2.0 ** int(torch.randint(-4, 8, (), generator=g)))
                fill(i, lo, (torch.tensor(lo, dtype=torch.float32) + r).item())
        elif kind == 2:
            choice = [(-1.6e38, 1.6e38), (3e38, F32_MAX), (-F32_MAX, -3e38), (0.0, F32_MAX)][k]
            fill(i, *choice)
        elif kind == 3:
            base = [1.0, 1e30, -1e-30, 3.0][k]
            b = torch.tensor(base, dtype=torch.float32)
            fill(i, b.item(), _next_up(b, 1 + k).item())
        elif kind == 4:
            choice = [(0.0, F32_TINY * 0.99), (0.0, F32_SUB), (-(2.0 ** -130), 2.0 ** -130), (F32_SUB, 8 * F32_SUB)][k]
            fill(i, *choice)
            if k == 1:
                out[i] = torch.where(u[i] < 0.5, 0.0, F32_SUB)
                out[i, 0], out[i, -1] = 0.0, F32_SUB
        else:
            out[i] = torch.randn(G, generator=g) * 10.0 ** (6 * r01 - 3)
    return out.reshape(-1)


def bound_violations(x: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int,
                     group_size: int) -> int:
    """Elements of finite groups with ``(x - m) * s`` outside ``[0, 2**b - 1]``, computed as
    the kernels compute it: the stored ``m`` and ``s`` in the compute dtype (float64 for
    float64 ``x``, else float32), the subtraction and the product rounded separately."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.reshape(-1).to(cdt)
    gidx = torch.arange(xc.numel()) // group_size
    m = mins.to(cdt)[gidx]
    s = scales.to(cdt)[gidx]
    t = (xc - m) * s
    finite = torch.isfinite(s)
    bad = finite & ((t < 0) | (t > (1 << bits) - 1) | torch.isnan(t))
    return int(bad.sum())
