"""``torch.library`` ops of fewbit: one schema each, one kernel per backend.

``fewbit::encode(Tensor x, Tensor borders, Tensor codes, int bits) -> Tensor``
    Packed codes of ``x`` (docs/method.md §2, §6). ``borders`` are the comparison borders:
    float64 for float64 ``x``; for float32/float16/bfloat16 ``x`` either float32 borders
    already rounded DOWN (:func:`fewbit.ops.round_down_to_float32`) or float64 borders
    (then rounded down per call). Interval index = number of borders ``b`` with
    ``not (x <= b)``; this equals ``searchsorted(borders_f64, x.double())`` exactly.

``fewbit::encode_nonfinite(Tensor x, Tensor borders, Tensor codes, int bits, int classes,
int capacity) -> (Tensor, Tensor)``
    The packed codes and the record of the non-finite elements of ``x`` of the classes in
    the mask ``classes`` (``(1 + capacity,)`` int64, :mod:`fewbit.ops._nonfinite`),
    found in the same pass over ``x``.

``fewbit::decode_mul(Tensor grad, Tensor packed, Tensor values, int bits,
Tensor? nonfinite=None, Tensor? patch=None, bool select_zero=False) -> Tensor``
    ``grad * values[code]`` with the rounding of :mod:`fewbit.ops._reference`; +0 where
    the level is 0 with ``select_zero``; recorded non-finite inputs patched to torch's
    gradient (the whole result NaN past the record's capacity). It is linear in ``grad``;
    :class:`fewbit.ops._pointwise.DecodeMul` is its differentiable form (an autograd
    Function with ``setup_context``, so it also works under ``torch.func``).

Backends (bitsandbytes / torchao pattern): ``cpu`` (numba, :mod:`fewbit.ops._cpu`),
``cuda`` (Triton, :mod:`fewbit.ops._triton`), ``Meta`` through the fake kernels, and the
pure-torch reference for every other device. The CPU kernels run the reference while
numba loads in a background thread (:mod:`fewbit.ops._cpu_loader`: same codes and
gradients; if numba cannot be loaded, a ``RuntimeWarning`` says so once and the reference
stays; ``FEWBIT_CPU_KERNELS=sync`` raises :class:`NotImplementedError` naming what to
install instead). A missing Triton raises :class:`NotImplementedError`.
"""

from __future__ import annotations

import torch

from typing import Optional

from fewbit._checks import FLOAT_DTYPES, TABLE_BITS, packed_nbytes
from fewbit._library import cpu_kernel
from fewbit.ops import _cpu_loader
from fewbit.ops._nonfinite import nonfinite_record_reference, patch_reference
from fewbit.ops._reference import (
    compute_dtype,
    decode_mul_reference,
    round_down_to_float32,
)

__all__ = ["encode_op", "encode_nonfinite_op", "decode_mul_op"]

# Argument checks of the ops, run by every kernel and by the fake kernels. A failed check goes
# through torch._check_value (ValueError) / torch._check_type (TypeError), and so does a
# condition on sizes that is a SymBool in a fake kernel under torch.compile (torch._check
# records it instead of specialising; bitsandbytes ``_ops.py`` convention). A plain True
# costs one comparison: these run on every call, and torch._check_* costs microseconds.


def _check_encode(x, borders, codes, bits):
    if x.dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"input must be float16, bfloat16, float32 or float64, got {x.dtype}")
    _check_op_bits(bits)
    if borders.dim() != 1 or borders.dtype not in (torch.float32, torch.float64):
        torch._check_value(
            False, lambda: f"borders must be 1-D float32 or float64, got {tuple(borders.shape)} {borders.dtype}"
        )
    if x.dtype == torch.float64 and borders.dtype != torch.float64:
        torch._check_value(False, lambda: "borders must be float64 for float64 input (float32 borders are inexact)")
    ok = codes.dim() == 1 and codes.numel() == borders.numel() + 1
    if ok is not True:
        torch._check_value(ok, lambda: (
            f"codes must be 1-D with len(borders) + 1 = {borders.numel() + 1} entries, got {tuple(codes.shape)}"
        ))
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        torch._check_type(False, lambda: f"codes must be an integer tensor, got {codes.dtype}")


def _check_op_bits(bits):
    if bits not in TABLE_BITS:
        torch._check_value(False, lambda: f"bits must be in 1..8, got {bits}")


def _check_nonfinite_args(classes, capacity):
    if not 0 <= classes <= 7:
        torch._check_value(False, lambda: f"classes must be a class mask in 0..7, got {classes}")
    if capacity < 0:
        torch._check_value(False, lambda: f"capacity must be >= 0, got {capacity}")


def _check_decode(grad, packed, values, bits, nonfinite=None, patch=None):
    if grad.dtype not in FLOAT_DTYPES:
        torch._check_type(False, lambda: f"grad_output must be float16, bfloat16, float32 or float64, got {grad.dtype}")
    _check_op_bits(bits)
    if packed.dtype != torch.uint8:
        torch._check_type(False, lambda: f"packed must be uint8, got {packed.dtype}")
    need = packed_nbytes(grad.numel(), bits)
    ok = packed.numel() >= need
    if ok is not True:
        torch._check_value(ok, lambda: (
            f"packed holds {packed.numel()} bytes, {need} needed for {grad.numel()} codes of {bits} bits"
        ))
    ok = values.dim() == 1 and values.numel() == (1 << bits) and values.is_floating_point()
    if ok is not True:
        torch._check_value(ok, lambda: (
            f"values must be 1-D floating with 2**bits = {1 << bits} entries, got {tuple(values.shape)} {values.dtype}"
        ))
    if (nonfinite is None) != (patch is None):
        torch._check_value(False, lambda: "nonfinite and patch must be given together")
    if nonfinite is not None:
        ok = nonfinite.dtype == torch.int64 and nonfinite.dim() == 1 and nonfinite.numel() >= 1
        if ok is not True:
            torch._check_value(ok, lambda: (
                f"nonfinite must be a 1-D int64 record of >= 1 entries, got {tuple(nonfinite.shape)} {nonfinite.dtype}"
            ))
        ok = patch.is_floating_point() and patch.numel() == 24
        if ok is not True:
            torch._check_value(ok, lambda: f"patch must be floating with 24 entries, got {tuple(patch.shape)} {patch.dtype}")


def _cmp_borders(x: torch.Tensor, borders: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64 or borders.dtype == torch.float32:
        return borders
    return round_down_to_float32(borders)


def _encode_reference_path(x, borders, codes, bits):
    # Same comparisons as the kernels: exact in the compare dtype.
    from fewbit.packing import pack_reference

    b = _cmp_borders(x, borders)
    xc = x.detach().reshape(-1).to(b.dtype)
    idx = torch.searchsorted(b.to(xc.device), xc, right=False)
    return pack_reference(codes.to(torch.int64)[idx], bits)


@torch.library.custom_op("fewbit::encode", mutates_args=())
def encode_op(x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Default (reference) kernel of ``fewbit::encode``; CPU and CUDA register their own."""
    _check_encode(x, borders, codes, bits)
    return _encode_reference_path(x, borders, codes, bits)


@encode_op.register_fake
def _(x, borders, codes, bits):
    _check_encode(x, borders, codes, bits)
    return x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8)


@cpu_kernel("encode", integer_outputs=True)
def _encode_cpu(x, borders, codes, bits):
    _check_encode(x, borders, codes, bits)
    if not _cpu_loader.ready():  # numba still loading: the reference, same codes
        return _encode_reference_path(x, borders, codes, bits)
    from fewbit.ops import _cpu

    return _cpu.encode_cpu(x, _cmp_borders(x, borders), codes, bits)[0]


@encode_op.register_kernel("cuda")
def _encode_cuda(x, borders, codes, bits):
    _check_encode(x, borders, codes, bits)
    from fewbit.ops import _triton  # noqa: F401  (registers fewbit::*_triton)

    return torch.ops.fewbit.encode_triton(x, _cmp_borders(x, borders), codes, bits)


@torch.library.custom_op("fewbit::encode_nonfinite", mutates_args=())
def encode_nonfinite_op(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (reference) kernel of ``fewbit::encode_nonfinite``."""
    _check_encode(x, borders, codes, bits)
    _check_nonfinite_args(classes, capacity)
    return _encode_reference_path(x, borders, codes, bits), nonfinite_record_reference(x, classes, capacity)


@encode_nonfinite_op.register_fake
def _(x, borders, codes, bits, classes, capacity):
    _check_encode(x, borders, codes, bits)
    _check_nonfinite_args(classes, capacity)
    packed = x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8)
    return packed, x.new_empty((1 + capacity,), dtype=torch.int64)


@cpu_kernel("encode_nonfinite", integer_outputs=True)
def _encode_nonfinite_cpu(x, borders, codes, bits, classes, capacity):
    _check_encode(x, borders, codes, bits)
    _check_nonfinite_args(classes, capacity)
    if not _cpu_loader.ready():  # numba still loading: the reference
        return _encode_reference_path(x, borders, codes, bits), nonfinite_record_reference(x, classes, capacity)
    from fewbit.ops import _cpu

    packed, count = _cpu.encode_cpu(x, _cmp_borders(x, borders), codes, bits, count_nonfinite=classes != 0)
    if count == 0:  # the kernel counted every NaN and inf: nothing to list
        return packed, torch.zeros(1 + capacity, dtype=torch.int64)
    return packed, nonfinite_record_reference(x, classes, capacity)  # rare path: list them


@encode_nonfinite_op.register_kernel("cuda")
def _encode_nonfinite_cuda(x, borders, codes, bits, classes, capacity):
    _check_encode(x, borders, codes, bits)
    _check_nonfinite_args(classes, capacity)
    from fewbit.ops import _triton  # noqa: F401  (registers fewbit::*_triton)

    return torch.ops.fewbit.encode_nonfinite_triton(x, _cmp_borders(x, borders), codes, bits, classes, capacity)


@torch.library.custom_op("fewbit::decode_mul", mutates_args=())
def decode_mul_op(
    grad: torch.Tensor,
    packed: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    nonfinite: Optional[torch.Tensor] = None,
    patch: Optional[torch.Tensor] = None,
    select_zero: bool = False,
) -> torch.Tensor:
    """Default (reference) kernel of ``fewbit::decode_mul``; CPU and CUDA register their own."""
    _check_decode(grad, packed, values, bits, nonfinite, patch)
    return decode_mul_reference(grad, packed, values, bits, select_zero=select_zero, nonfinite=nonfinite, patch=patch)


@decode_mul_op.register_fake
def _(grad, packed, values, bits, nonfinite=None, patch=None, select_zero=False):
    _check_decode(grad, packed, values, bits, nonfinite, patch)
    return grad.new_empty(grad.shape)  # new_empty is contiguous


@cpu_kernel("decode_mul")
def _decode_mul_cpu(grad, packed, values, bits, nonfinite=None, patch=None, select_zero=False):
    _check_decode(grad, packed, values, bits, nonfinite, patch)
    if not _cpu_loader.ready():  # numba still loading: the reference, same gradient
        return decode_mul_reference(grad, packed, values, bits, select_zero=select_zero, nonfinite=nonfinite,
                                    patch=patch)
    from fewbit.ops import _cpu

    out = _cpu.decode_mul_cpu(grad, packed, values, bits, select_zero)
    if nonfinite is not None and int(nonfinite[0]) != 0:  # rare path, pure torch
        out = patch_reference(out, grad, nonfinite, patch)
    return out


@decode_mul_op.register_kernel("cuda")
def _decode_mul_cuda(grad, packed, values, bits, nonfinite=None, patch=None, select_zero=False):
    _check_decode(grad, packed, values, bits, nonfinite, patch)
    from fewbit.ops import _triton  # noqa: F401  (registers fewbit::*_triton)

    cdt = compute_dtype(grad.dtype)
    return torch.ops.fewbit.decode_mul_triton(
        grad, packed, values.to(cdt), bits, nonfinite, None if patch is None else patch.to(cdt), select_zero
    )


# --------------------------------------------------------------------------- compile
#: Device types whose kernels torch.compile traces into (their Triton launches) instead of
#: calling the op as an opaque custom op. Empty: the traced graph has not run on a GPU yet
#: (the H100 runs never reached it: fewbit stood aside under torch.compile there, see
#: fewbit.ops._pointwise._recording_program), while the opaque op calls the kernels that the
#: eager GPU tests checked. Tests set it to check the decomposition on CPU
#: (tests/ops/test_ops_triton.py); a GPU run of the compile tests can turn it on.
TRITON_DEVICE_TYPES: set[str] = set()


def trace_into_triton(op, kernel) -> None:
    """Let torch.compile see the Triton kernels behind the custom op ``op``.

    A ``custom_op`` is opaque to torch.compile. While AOTAutograd traces (under
    ``FunctionalTensorMode``), inputs on a device in :data:`TRITON_DEVICE_TYPES` are traced
    through ``kernel`` (the op's ``cuda`` kernel), which calls ``torch.library.triton_op``s
    that decompose into their ``wrap_triton`` launches, as ``triton_op`` itself does
    (torch/_library/triton.py); other devices keep the opaque op (numba cannot be traced),
    and so does ``torch.export`` (a serialisable graph, as for ``triton_op``).
    """
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def rule(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if args[0].device.type not in TRITON_DEVICE_TYPES or custom_triton_ops_decomposition_disabled():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return kernel(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, rule)


trace_into_triton(encode_op, _encode_cuda)
trace_into_triton(encode_nonfinite_op, _encode_nonfinite_cuda)
trace_into_triton(decode_mul_op, _decode_mul_cuda)


# --------------------------------------------------------------------------- vmap
# torch.func.vmap (e.g. per-sample gradients, vmap(grad(f)), jacrev): each sample has
# its own packed stream (and record), exactly what the op gives for that sample alone.
# Without a record the batch runs as one call (samples padded to whole bytes); with a
# record, one call per sample.


def _unsupported_batched(in_dims, names):
    for d, name in zip(in_dims, names):
        if d is not None:
            raise NotImplementedError(f"fewbit: vmap over {name} is not supported (tables are shared)")


def _batched(t, d, batch):
    """``t`` with its batch dimension first (expanded when it is not batched)."""
    return t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(batch, *t.shape)


@torch.library.register_vmap("fewbit::encode")
def _encode_vmap(info, in_dims, x, borders, codes, bits):
    _unsupported_batched(in_dims[1:3], ("borders", "codes"))
    xb = x.movedim(in_dims[0], 0).reshape(info.batch_size, -1)
    m = xb.shape[1]
    nbytes = packed_nbytes(m, bits)
    m8 = (m + 7) // 8 * 8
    if m8 != m:
        xb = torch.nn.functional.pad(xb, (0, m8 - m))
    out = torch.ops.fewbit.encode(xb, borders, codes, bits).reshape(info.batch_size, -1)[:, :nbytes]
    rem = (m * bits) % 8
    if rem:  # the stream of one sample ends mid-byte: its padding bits are 0
        out = torch.cat([out[:, :-1], out[:, -1:] & ((1 << rem) - 1)], dim=1)
    return out.contiguous(), 0


@torch.library.register_vmap("fewbit::encode_nonfinite")
def _encode_nonfinite_vmap(info, in_dims, x, borders, codes, bits, classes, capacity):
    _unsupported_batched(in_dims[1:3], ("borders", "codes"))
    xb = x.movedim(in_dims[0], 0)
    outs = [torch.ops.fewbit.encode_nonfinite(xb[i], borders, codes, bits, classes, capacity)
            for i in range(info.batch_size)]
    return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


@torch.library.register_vmap("fewbit::decode_mul")
def _decode_mul_vmap(info, in_dims, grad, packed, values, bits, nonfinite=None, patch=None, select_zero=False):
    in_dims = tuple(in_dims) + (None,) * (7 - len(in_dims))  # optional arguments left out
    _unsupported_batched((in_dims[2], in_dims[5]), ("values", "patch"))
    batch = info.batch_size
    g = _batched(grad, in_dims[0], batch)
    shape = g.shape[1:]
    g = g.reshape(batch, -1)
    p = _batched(packed, in_dims[1], batch)
    if nonfinite is not None:
        rec = _batched(nonfinite, in_dims[4], batch)
        out = torch.stack([
            torch.ops.fewbit.decode_mul(g[i], p[i], values, bits, rec[i], patch, select_zero) for i in range(batch)
        ])
        return out.reshape(batch, *shape), 0
    m = g.shape[1]
    m8 = (m + 7) // 8 * 8
    nbytes = packed_nbytes(m, bits)
    p = p[:, :nbytes]
    if m8 != m:  # pad every sample to whole bytes (codes 0 for padding, dropped after)
        g = torch.nn.functional.pad(g, (0, m8 - m))
        p = torch.nn.functional.pad(p, (0, m8 * bits // 8 - nbytes))
    out = torch.ops.fewbit.decode_mul(g.reshape(-1), p.reshape(-1), values, bits, None, None, select_zero)
    return out.reshape(batch, m8)[:, :m].reshape(batch, *shape), 0
