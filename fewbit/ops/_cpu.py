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

__all__ = ["encode_cpu", "decode_mul_cpu", "encode_arrays", "decode_mul_arrays", "warm_up"]


#: Inputs of fewer elements run on the calling thread (the ``*_serial`` kernels): below
#: a few chunks a parallel launch costs more than it saves.
SERIAL_MAX = 4 * _cpu_kernels._CHUNK


_started = False


def _set_threads() -> None:
    global _started
    if not _started:  # this process's first parallel call of either family (few-bit ops, quantizers)
        _started = True
        warm_up()  # numba's OpenMP layer starts here, torch's thread count kept (cheap if the loader ran)
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


def _parallel(n: int) -> bool:
    """Whether an input of ``n`` elements runs on numba's pool (its threads then set to
    torch's, capped by ``NUMBA_NUM_THREADS``), else on the calling thread. Serial calls
    leave the pool alone (asking numba for its thread count costs microseconds a call)."""
    if n <= SERIAL_MAX:
        return False
    _set_threads()
    return numba.get_num_threads() > 1


def warm_up() -> None:
    """Load (or, with an empty cache, compile) every kernel's machine code for each dtype
    form the eager path passes (float32, float64, bfloat16 as int16/uint16): the serial
    kernels are called on a few elements, the parallel ones compiled for the same
    signatures without a launch, so that no parallel region starts from the loader's
    thread (numba's workqueue layer aborts on concurrent launches;
    :mod:`fewbit.ops._cpu_loader` runs this in a background thread)."""
    threads = torch.get_num_threads()
    try:
        _warm_up()
    finally:
        # numba's OpenMP layer, when it starts (on loading a parallel kernel), sets the
        # calling thread's OpenMP thread count, which is torch's: a process that had set
        # torch.set_num_threads(1) ran torch, and then numba, on every core after its first
        # parallel fewbit call
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _warm_up() -> None:
    n = 16
    bits = 2
    codes = np.arange(4, dtype=np.int64)
    out = np.empty(packed_nbytes(n, bits), np.uint8)
    for xa, ba, va, ga in (
        (np.zeros(n, np.float32), np.zeros(3, np.float32), np.ones(4, np.float32), np.zeros(n, np.float32)),
        (np.zeros(n, np.float64), np.zeros(3, np.float64), np.ones(4, np.float64), np.zeros(n, np.float64)),
        (np.zeros(n, np.int16), np.zeros(3, np.float32), np.ones(4, np.float32), np.zeros(n, np.uint16)),
    ):
        enc_args = (xa, ba, codes, out, bits, False)
        dec_args = (ga, out, va, np.empty_like(ga), bits, False)
        _cpu_kernels.encode_serial(*enc_args)
        _cpu_kernels.decode_mul_serial(*dec_args)
        _cpu_kernels.encode.compile(tuple(numba.typeof(a) for a in enc_args))
        _cpu_kernels.decode_mul.compile(tuple(numba.typeof(a) for a in dec_args))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and flattened; no copy when it is contiguous."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).contiguous()


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
    b = borders.detach().contiguous().numpy()
    c = codes.detach().to(torch.int64).contiguous().numpy()
    return encode_arrays(x, b, c, bits, count_nonfinite)


def encode_arrays(x: torch.Tensor, b: np.ndarray, c: np.ndarray, bits: int, count_nonfinite: bool) -> tuple[torch.Tensor, int]:
    """:func:`encode_cpu` with the table already as kernel arrays (the eager path's ``_Plan.kb``, ``kc``, ``kv``)."""
    n = x.numel()
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8)
    if n == 0:
        return out, 0
    if (x.dtype == torch.float32 or x.dtype == torch.float64) and x.is_contiguous():
        kernel = _cpu_kernels.encode if _parallel(n) else _cpu_kernels.encode_serial
        return out, int(kernel(x.detach().numpy().reshape(-1), b, c, out.numpy(), bits, count_nonfinite))
    x = _flat(x)
    if x.dtype == torch.bfloat16:
        xa = x.view(torch.int16).numpy()
    elif x.dtype == torch.float16:
        xa = x.to(torch.float32).numpy()
    else:
        xa = x.numpy()
    kernel = _cpu_kernels.encode if _parallel(n) else _cpu_kernels.encode_serial
    count = kernel(xa, b, c, out.numpy(), bits, count_nonfinite)
    return out, int(count)


def decode_mul_cpu(
    grad: torch.Tensor, packed: torch.Tensor, values: torch.Tensor, bits: int, select_zero: bool = False
) -> torch.Tensor:
    """``grad * values[code]`` (+0 where the level is 0 with ``select_zero``); same
    contract and rounding as ``fewbit::decode_mul`` without a non-finite record.

    float16 grads are upcast to float32 with torch, multiplied, and rounded back with
    torch (one round-to-nearest-even); bfloat16 is handled in the kernel.
    """
    v = values.detach().to(torch.float64 if grad.dtype == torch.float64 else torch.float32).contiguous().numpy()
    return decode_mul_arrays(grad, packed, v, bits, select_zero)


def decode_mul_arrays(
    grad: torch.Tensor, packed: torch.Tensor, v: np.ndarray, bits: int, select_zero: bool
) -> torch.Tensor:
    """:func:`decode_mul_cpu` with ``values`` already a kernel array in the compute dtype
    of ``grad`` (float64 for float64, else float32; the eager path's ``_Plan.kv``)."""
    n = grad.numel()
    dtype = grad.dtype
    if (dtype == torch.float32 or dtype == torch.float64) and grad.is_contiguous():
        # the common case, with as few calls as possible (microseconds at small sizes)
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        if n:
            kernel = _cpu_kernels.decode_mul if _parallel(n) else _cpu_kernels.decode_mul_serial
            kernel(grad.detach().numpy().reshape(-1), packed.detach().numpy().reshape(-1), v,
                   out.numpy().reshape(-1), bits, select_zero)
        return out
    out = torch.empty(grad.shape, dtype=dtype)
    if n == 0:
        return out
    g = _flat(grad)
    p = _flat(packed).numpy()
    if dtype == torch.bfloat16:
        ga = g.view(torch.int16).numpy().view(np.uint16)
        oa = out.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    elif dtype == torch.float16:
        ga = g.to(torch.float32).numpy()
        tmp = torch.empty(n, dtype=torch.float32)
        oa = tmp.numpy()
    else:
        ga, oa = g.numpy(), out.numpy().reshape(-1)
    kernel = _cpu_kernels.decode_mul if _parallel(n) else _cpu_kernels.decode_mul_serial
    kernel(ga, p, v, oa, bits, select_zero)
    if dtype == torch.float16:
        out.copy_(tmp.view(grad.shape))
    return out
