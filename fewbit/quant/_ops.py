"""torch.library ops of the group quantizer: schemas, fake kernels and one kernel per device.

``fewbit::group_quantize(x, bits, group_size, seed, stochastic, stats_dtype)
-> (packed, mins, scales)`` and ``fewbit::group_dequantize(packed, mins, scales, bits,
group_size, numel, dtype, seed=0, stochastic=False) -> x_hat`` take a flat contiguous input;
the decode ops round a float16/bfloat16 result stochastically with the decode seed ``seed``
when ``stochastic`` (:func:`fewbit.quant._reference.stochastic_round_reference`), to
nearest otherwise. Backends, one rule for
both op families (docs/kernels.md):

- ``cpu``: numba (:mod:`fewbit.quant._cpu`); float16/bfloat16 read through a float32 copy;
- ``cuda``: Triton (:mod:`fewbit.quant._triton`, ``torch.library.triton_op``s) for
  float16/bfloat16/float32, the torch reference for float64 (Triton has no ``frexp`` for
  the float64 stats rounding);
- ``Meta`` and fake tensors: the fake kernels;
- any other device: the pure-torch reference (:mod:`fewbit.quant._reference`).

User arguments are validated by the public functions of :mod:`fewbit.quant`; the ops check
theirs through ``torch._check_*``, also in the fake kernels (as :mod:`fewbit.ops._ops`).
Importing this module does not import numba or triton.
"""

from __future__ import annotations

import functools

import torch

from fewbit._checks import FLOAT_DTYPES, packed_nbytes
from fewbit._library import cpu_kernel
from fewbit.ops._ops import trace_into_triton
from fewbit.quant import _reference as ref

__all__ = ["group_quantize", "group_dequantize", "affine_codes", "affine_decode", "pair_stats", "block_mean",
           "division_encode", "division_compress", "division_decode"]

def _check_args(bits: int, group_size: int, dtype: torch.dtype, stats_dtype: torch.dtype | None = None) -> None:
    # as fewbit.ops._ops: a failed check raises through torch._check_value / torch._check_type
    if stats_dtype is not None and stats_dtype not in (torch.float32, torch.bfloat16):
        # float16 stats had been taken as float32 by the Triton kernel (m rounded to nearest,
        # not down: codes clamped) and were a bare KeyError on the CPU (h74)
        torch._check_type(False, lambda: f"stats_dtype must be float32 or bfloat16, got {stats_dtype}")
    if bits not in ref.SUPPORTED_BITS:
        torch._check_value(False, lambda: f"bits must be one of {ref.SUPPORTED_BITS}, got {bits}")
    if group_size < 1:
        torch._check_value(False, lambda: f"group_size must be >= 1, got {group_size}")
    if dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"dtype must be a floating-point dtype, got {dtype}")


def _check_dequantize_args(packed, mins, scales, bits, group_size, numel, dtype) -> None:
    """:func:`_check_args`, and buffers large enough for ``numel`` elements: the kernels
    read ``packed`` and the stats without bounds checks (a malformed
    :class:`fewbit.quant.QuantizedTensor` read past them)."""
    _check_args(bits, group_size, dtype)
    if numel < 0:
        torch._check_value(False, lambda: f"numel must be >= 0, got {numel}")
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        torch._check_value(False, lambda: f"packed holds {packed.numel()} bytes, {need} needed for {numel} "
                                          f"elements at {bits} bits")
    groups = -(-numel // group_size)
    for name, t in (("mins", mins), ("scales", scales)):
        if t.numel() < groups:
            torch._check_value(False, lambda: f"{name} holds {t.numel()} values, {groups} needed for {numel} "
                                              f"elements in groups of {group_size}")


@torch.library.custom_op("fewbit::group_quantize", mutates_args=())
def group_quantize(
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool,
    stats_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default kernel (devices without their own backend): the pure-torch reference."""
    _check_args(bits, group_size, x.dtype, stats_dtype)
    return ref.group_quantize_reference(x, bits, group_size, seed, stochastic, stats_dtype)


@group_quantize.register_fake
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype, stats_dtype)
    n = x.numel()
    g = (n + group_size - 1) // group_size
    return (
        x.new_empty((packed_nbytes(n, bits),), dtype=torch.uint8),
        x.new_empty((g,), dtype=stats_dtype),
        x.new_empty((g,), dtype=stats_dtype),
    )


@cpu_kernel("group_quantize")
def _(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype, stats_dtype)
    from fewbit.quant import _cpu

    return _cpu.quantize_cpu(x, bits, group_size, seed, stochastic, stats_dtype)


@group_quantize.register_kernel("cuda")
def _group_quantize_cuda(x, bits, group_size, seed, stochastic, stats_dtype):
    _check_args(bits, group_size, x.dtype, stats_dtype)
    if x.dtype == torch.float64 or x.numel() == 0:
        return ref.group_quantize_reference(x, bits, group_size, seed, stochastic, stats_dtype)
    from fewbit.quant import _triton  # noqa: F401  (registers fewbit::group_*_triton)

    return torch.ops.fewbit.group_quantize_triton(x, bits, group_size, seed, stochastic, stats_dtype)


@torch.library.custom_op("fewbit::group_dequantize", mutates_args=())
def group_dequantize(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
    numel: int, dtype: torch.dtype, seed: int = 0, stochastic: bool = False,
) -> torch.Tensor:
    """Default kernel (devices without their own backend): the pure-torch reference."""
    _check_dequantize_args(packed, mins, scales, bits, group_size, numel, dtype)
    return ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype,
                                    seed if stochastic else None)


@group_dequantize.register_fake
def _(packed, mins, scales, bits, group_size, numel, dtype, seed=0, stochastic=False):
    _check_dequantize_args(packed, mins, scales, bits, group_size, numel, dtype)
    return packed.new_empty((numel,), dtype=dtype)


@cpu_kernel("group_dequantize")
def _(packed, mins, scales, bits, group_size, numel, dtype, seed=0, stochastic=False):
    _check_dequantize_args(packed, mins, scales, bits, group_size, numel, dtype)
    from fewbit.quant import _cpu

    return _cpu.dequantize_cpu(packed, mins, scales, bits, group_size, numel, dtype, seed, stochastic)


@group_dequantize.register_kernel("cuda")
def _group_dequantize_cuda(packed, mins, scales, bits, group_size, numel, dtype, seed=0, stochastic=False):
    _check_dequantize_args(packed, mins, scales, bits, group_size, numel, dtype)
    if dtype == torch.float64 or numel == 0:
        return ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype)
    from fewbit.quant import _triton  # noqa: F401  (registers fewbit::group_*_triton)

    return torch.ops.fewbit.group_dequantize_triton(packed, mins, scales, bits, group_size, numel, dtype,
                                                    seed, stochastic)


trace_into_triton(group_quantize, _group_quantize_cuda)
trace_into_triton(group_dequantize, _group_dequantize_cuda)


# --- the compressors of fewbit.quant.compressors (docs/compression.md §3-4) ---------------
# ``fewbit::affine_codes(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic)
# -> packed``: codes from given stats, one pair per row of ``rowlen`` elements or per column
# (:func:`fewbit.quant._reference.affine_codes_reference`); ``fewbit::affine_decode`` its
# inverse; ``fewbit::block_mean(x, bh, bw)``: DIVISION's block means of ``x`` (A, H, W, I).
# Same backends as above.


def _check_affine(bits: int, rowlen: int, dtype: torch.dtype) -> None:
    if not 1 <= bits <= 8:
        torch._check_value(False, lambda: f"bits must be in 1..8, got {bits}")
    if rowlen < 1:
        torch._check_value(False, lambda: f"rowlen must be >= 1, got {rowlen}")
    if dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"dtype must be a floating-point dtype, got {dtype}")


def _triton_ok(dtype: torch.dtype, numel: int) -> bool:
    return dtype != torch.float64 and numel > 0


@torch.library.custom_op("fewbit::affine_codes", mutates_args=())
def affine_codes(
    x: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int, per_col: bool,
    offset: int, seed: int, stochastic: bool,
) -> torch.Tensor:
    """Default kernel: the pure-torch reference."""
    _check_affine(bits, rowlen, x.dtype)
    return ref.affine_codes_reference(x, mins, scales, bits, rowlen, per_col, offset, seed if stochastic else None)


@affine_codes.register_fake
def _(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic):
    _check_affine(bits, rowlen, x.dtype)
    return x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8)


@cpu_kernel("affine_codes", integer_outputs=True)
def _(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic):
    _check_affine(bits, rowlen, x.dtype)
    from fewbit.quant import _cpu

    return _cpu.affine_codes_cpu(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic)


@affine_codes.register_kernel("cuda")
def _affine_codes_cuda(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic):
    _check_affine(bits, rowlen, x.dtype)
    if not _triton_ok(x.dtype, x.numel()):
        return ref.affine_codes_reference(x, mins, scales, bits, rowlen, per_col, offset,
                                          seed if stochastic else None)
    from fewbit.quant import _triton  # noqa: F401  (registers fewbit::*_triton)

    return torch.ops.fewbit.affine_codes_triton(x, mins, scales, bits, rowlen, per_col, offset, seed, stochastic)


# ``fewbit::pair_stats(pairs, bits, stats_dtype) -> (mins, scales)``: the group quantizer's
# stats rule (docs/method.md §7 steps 2-3) for each pair ``(pairs[2i], pairs[2i+1])``, as
# :func:`fewbit.quant._reference.group_stats_reference` with group_size 2: the per-tensor
# or per-channel stats of the affine compressors. The reference is about thirty small torch
# ops (0.3 ms a call on the CI VM, on CUDA as many kernel launches); the CPU kernel is numba,
# the CUDA kernel the group quantizer's Triton stats kernel on groups of 2.


def _check_pairs(pairs: torch.Tensor, bits: int, stats_dtype: torch.dtype) -> None:
    if not 1 <= bits <= 8:
        torch._check_value(False, lambda: f"bits must be in 1..8, got {bits}")
    if pairs.dim() != 1 or pairs.numel() % 2:
        torch._check_value(False, lambda: f"pairs must be 1-D of even length, got shape {tuple(pairs.shape)}")
    if stats_dtype not in (torch.float32, torch.bfloat16):
        torch._check_type(False, lambda: f"stats_dtype must be float32 or bfloat16, got {stats_dtype}")


@torch.library.custom_op("fewbit::pair_stats", mutates_args=())
def pair_stats(pairs: torch.Tensor, bits: int, stats_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default kernel: the pure-torch reference."""
    _check_pairs(pairs, bits, stats_dtype)
    m, s, _ = ref.group_stats_reference(pairs, bits, 2, stats_dtype)
    return m, s


@pair_stats.register_fake
def _(pairs, bits, stats_dtype):
    _check_pairs(pairs, bits, stats_dtype)
    n = pairs.numel() // 2
    return pairs.new_empty((n,), dtype=stats_dtype), pairs.new_empty((n,), dtype=stats_dtype)


@cpu_kernel("pair_stats")
def _(pairs, bits, stats_dtype):
    _check_pairs(pairs, bits, stats_dtype)
    from fewbit.quant import _cpu

    return _cpu.pair_stats_cpu(pairs, bits, stats_dtype)


@pair_stats.register_kernel("cuda")
def _pair_stats_cuda(pairs, bits, stats_dtype):
    _check_pairs(pairs, bits, stats_dtype)
    if not _triton_ok(pairs.dtype, pairs.numel()):
        m, s, _ = ref.group_stats_reference(pairs, bits, 2, stats_dtype)
        return m, s
    from fewbit.quant import _triton  # noqa: F401

    return torch.ops.fewbit.pair_stats_triton(pairs.contiguous(), bits, stats_dtype)


@torch.library.custom_op("fewbit::affine_decode", mutates_args=())
def affine_decode(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, rowlen: int, per_col: bool,
    offset: int, numel: int, dtype: torch.dtype, seed: int = 0, stochastic: bool = False,
) -> torch.Tensor:
    """Default kernel: the pure-torch reference."""
    _check_affine(bits, rowlen, dtype)
    return ref.affine_decode_reference(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype,
                                       seed if stochastic else None)


@affine_decode.register_fake
def _(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed=0, stochastic=False):
    _check_affine(bits, rowlen, dtype)
    return packed.new_empty((numel,), dtype=dtype)


@cpu_kernel("affine_decode")
def _(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed=0, stochastic=False):
    _check_affine(bits, rowlen, dtype)
    from fewbit.quant import _cpu

    return _cpu.affine_decode_cpu(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed,
                                  stochastic)


@affine_decode.register_kernel("cuda")
def _affine_decode_cuda(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype, seed=0,
                        stochastic=False):
    _check_affine(bits, rowlen, dtype)
    if not _triton_ok(dtype, numel):
        return ref.affine_decode_reference(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype)
    from fewbit.quant import _triton  # noqa: F401

    return torch.ops.fewbit.affine_decode_triton(packed, mins, scales, bits, rowlen, per_col, offset, numel, dtype,
                                                 seed, stochastic)


def _check_block(x: torch.Tensor, bh: int, bw: int) -> None:
    if x.dim() != 4:
        torch._check_value(False, lambda: f"x must be 4-D (A, H, W, I), got shape {tuple(x.shape)}")
    if bh < 1 or bw < 1:
        torch._check_value(False, lambda: f"block sizes must be >= 1, got ({bh}, {bw})")
    if x.dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"x must be floating-point, got {x.dtype}")


@torch.library.custom_op("fewbit::block_mean", mutates_args=())
def block_mean(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """Default kernel: the pure-torch reference."""
    _check_block(x, bh, bw)
    return ref.block_mean_reference(x, bh, bw)


@block_mean.register_fake
def _(x, bh, bw):
    _check_block(x, bh, bw)
    a, h, w, i = x.shape
    return x.new_empty((a, (h + bh - 1) // bh, (w + bw - 1) // bw, i), dtype=ref.compute_dtype(x.dtype))


@cpu_kernel("block_mean")
def _(x, bh, bw):
    _check_block(x, bh, bw)
    from fewbit.quant import _cpu

    return _cpu.block_mean_cpu(x, bh, bw)


@block_mean.register_kernel("cuda")
def _block_mean_cuda(x, bh, bw):
    _check_block(x, bh, bw)
    if not _triton_ok(x.dtype, x.numel()):
        return ref.block_mean_reference(x, bh, bw)
    from fewbit.quant import _triton  # noqa: F401

    return torch.ops.fewbit.block_mean_triton(x, bh, bw)


trace_into_triton(affine_codes, _affine_codes_cuda)
trace_into_triton(affine_decode, _affine_decode_cuda)
trace_into_triton(block_mean, _block_mean_cuda)


# ``fewbit::division_encode(x, lfc, bh, bw, bits, seed, row_stats) -> (packed, mins, scales)`` and
# ``fewbit::division_decode(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=0,
# stochastic=False) -> x_hat`` (rounded to a half dtype stochastically with the decode seed):
# DIVISION's residual (:func:`fewbit.quant._reference.division_encode_reference`); on CPU
# fused in numba, on CUDA the reference's steps with the Triton codes kernels.


@torch.library.custom_op("fewbit::division_encode", mutates_args=())
def division_encode(
    x: torch.Tensor, lfc: torch.Tensor, bh: int, bw: int, bits: int, seed: int, row_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default kernel: the pure-torch reference."""
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    return ref.division_encode_reference(x, lfc, bh, bw, bits, seed, row_stats)


@division_encode.register_fake
def _(x, lfc, bh, bw, bits, seed, row_stats=False):
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    rows, stats_dtype = ref.division_stats_layout(x.shape, row_stats)
    return (x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8),
            x.new_empty((rows,), dtype=stats_dtype), x.new_empty((rows,), dtype=stats_dtype))


@cpu_kernel("division_encode")
def _(x, lfc, bh, bw, bits, seed, row_stats=False):
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    from fewbit.quant import _cpu

    return _cpu.division_encode_cpu(x, lfc, bh, bw, bits, seed, row_stats)


@division_encode.register_kernel("cuda")
def _division_encode_cuda(x, lfc, bh, bw, bits, seed, row_stats=False):
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)

    def codes(h, m, s, bits, rowlen, per_col, offset, seed):
        return affine_codes(h, m, s, bits, rowlen, per_col, offset, seed, True)

    return ref.division_encode_reference(x, lfc, bh, bw, bits, seed, row_stats, affine_codes=codes)


# ``fewbit::division_compress(x, bh, bw, bits, seed, row_stats) -> (lfc, packed, mins, scales)``:
# the block means rounded to x's dtype, then ``division_encode`` of the residual
# (:func:`fewbit.quant._reference.division_compress_reference`); on CPU the means and the
# residual's min/max share one pass over x (float32/float64), on CUDA the two ops above.


@torch.library.custom_op("fewbit::division_compress", mutates_args=())
def division_compress(
    x: torch.Tensor, bh: int, bw: int, bits: int, seed: int, row_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default kernel: the pure-torch reference."""
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    return ref.division_compress_reference(x, bh, bw, bits, seed, row_stats)


@division_compress.register_fake
def _(x, bh, bw, bits, seed, row_stats=False):
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    a, h, w, i = x.shape
    rows, stats_dtype = ref.division_stats_layout(x.shape, row_stats)
    return (x.new_empty((a, (h + bh - 1) // bh, (w + bw - 1) // bw, i)),
            x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8),
            x.new_empty((rows,), dtype=stats_dtype), x.new_empty((rows,), dtype=stats_dtype))


@cpu_kernel("division_compress")
def _(x, bh, bw, bits, seed, row_stats=False):
    _check_block(x, bh, bw)
    _check_affine(bits, 1, x.dtype)
    from fewbit.quant import _cpu

    return _cpu.division_compress_cpu(x, bh, bw, bits, seed, row_stats)


@division_compress.register_kernel("cuda")
def _division_compress_cuda(x, bh, bw, bits, seed, row_stats=False):
    lfc = block_mean(x, bh, bw).to(x.dtype)
    return (lfc, *division_encode(x, lfc, bh, bw, bits, seed, row_stats))


@torch.library.custom_op("fewbit::division_decode", mutates_args=())
def division_decode(
    packed: torch.Tensor, lfc: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bh: int, bw: int,
    bits: int, h: int, w: int, dtype: torch.dtype, seed: int = 0, stochastic: bool = False,
) -> torch.Tensor:
    """Default kernel: the pure-torch reference."""
    _check_affine(bits, 1, dtype)
    return ref.division_decode_reference(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype,
                                         seed if stochastic else None)


@division_decode.register_fake
def _(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=0, stochastic=False):
    _check_affine(bits, 1, dtype)
    return lfc.new_empty((lfc.shape[0], h, w, lfc.shape[3]), dtype=dtype)


@cpu_kernel("division_decode")
def _(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=0, stochastic=False):
    _check_affine(bits, 1, dtype)
    from fewbit.quant import _cpu

    return _cpu.division_decode_cpu(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed, stochastic)


def _stochastic_round_cuda(y: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """:func:`fewbit.quant._reference.stochastic_round_reference` on CUDA: the Triton kernel."""
    from fewbit.quant import _triton  # noqa: F401

    return torch.ops.fewbit.stochastic_round_triton(y.reshape(-1), dtype, seed).view(y.shape)


@division_decode.register_kernel("cuda")
def _division_decode_cuda(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype, seed=0, stochastic=False):
    _check_affine(bits, 1, dtype)
    return ref.division_decode_reference(packed, lfc, mins, scales, bh, bw, bits, h, w, dtype,
                                         seed if stochastic else None, affine_decode=affine_decode,
                                         round_to=functools.partial(ref.round_to_dtype,
                                                                    stochastic_round=_stochastic_round_cuda))
