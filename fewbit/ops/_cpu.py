"""CPU backend (numba) of ``fewbit::encode`` and ``fewbit::decode_mul``.

Loaded on the first CPU call, never at ``import fewbit``. The kernels live in
:mod:`fewbit.ops._cpu_kernels` (a plain module, so numba's ``cache=True`` stores the
compiled code next to it, or in numba's user-wide cache directory when the package is
read-only). They take the table as runtime arrays (an unrolled compare-sum for up to 15
borders, one vectorised pass per border beyond) and branch inside on the bit width, so
only a handful of functions ever compile (about a minute in all, once; the cache makes
later processes start in well under a second). Generating source per table shape
(docs/kernels.md) was measured too: equally fast, but ~60 compiles of ~3 s each.

Threads: numba's pool follows ``torch.get_num_threads()`` (capped by
``NUMBA_NUM_THREADS``) on every call; the OpenMP layer is preferred (faster than
workqueue when alternating with torch).
"""

from __future__ import annotations

import os

import torch

try:  # numba is a dependency of fewbit, imported only here, lazily.
    import numba
    import numpy as np
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise NotImplementedError(
        "fewbit's CPU kernels need numba (pip install 'numba>=0.59'); "
        f"importing it failed: {exc}"
    ) from exc

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

from fewbit._checks import packed_nbytes  # noqa: E402
from fewbit.ops import _cpu_kernels  # noqa: E402

__all__ = ["encode_cpu", "decode_mul_cpu"]


def _set_threads() -> None:
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


def encode_cpu(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, *, count_nonfinite: bool = False
) -> tuple[torch.Tensor, int]:
    """Packed codes; same contract as ``fewbit::encode`` with ``borders`` already in the
    compare dtype (float64 for float64 ``x``, else float32 rounded down).

    float16 is upcast to float32 with torch first (exact; numba has no float16);
    bfloat16 is read as its int16 bit pattern and widened in the kernel.

    Returns:
        ``(packed, count)``: ``count`` is the number of NaN and +-inf elements of ``x``
        if ``count_nonfinite``, else 0.
    """
    n = x.numel()
    out = torch.empty((packed_nbytes(n, bits),), dtype=torch.uint8)
    if n == 0:
        return out, 0
    x = x.detach().reshape(-1).contiguous()
    if x.dtype == torch.bfloat16:
        xa = x.view(torch.int16).numpy()
    elif x.dtype == torch.float16:
        xa = x.to(torch.float32).numpy()
    else:
        xa = x.numpy()
    b = borders.detach().contiguous().numpy()
    c = codes.detach().to(torch.int64).contiguous().numpy()
    _set_threads()
    count = _cpu_kernels.encode(xa, b, c, out.numpy(), bits, count_nonfinite)
    return out, int(count)


def decode_mul_cpu(
    grad: torch.Tensor, packed: torch.Tensor, values: torch.Tensor, bits: int, select_zero: bool = False
) -> torch.Tensor:
    """``grad * values[code]`` (+0 where the level is 0 with ``select_zero``); same
    contract and rounding as ``fewbit::decode_mul`` without a non-finite record.

    float16 grads are upcast to float32 with torch, multiplied, and rounded back with
    torch (one round-to-nearest-even); bfloat16 is handled in the kernel.
    """
    n = grad.numel()
    dtype = grad.dtype
    out = torch.empty(grad.shape, dtype=dtype)
    if n == 0:
        return out
    g = grad.detach().reshape(-1).contiguous()
    p = packed.detach().reshape(-1).contiguous().numpy()
    v = values.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).contiguous().numpy()
    if dtype == torch.bfloat16:
        ga = g.view(torch.int16).numpy().view(np.uint16)
        oa = out.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    elif dtype == torch.float16:
        ga = g.to(torch.float32).numpy()
        tmp = torch.empty(n, dtype=torch.float32)
        oa = tmp.numpy()
    else:
        ga, oa = g.numpy(), out.numpy().reshape(-1)
    _set_threads()
    _cpu_kernels.decode_mul(ga, p, v, oa, bits, select_zero)
    if dtype == torch.float16:
        out.copy_(tmp.view(grad.shape))
    return out
