"""Pure-torch references for the few-bit kernels (docs/method.md §2 and §6).

These functions *define* what every backend computes; the kernels are tested against
them bit for bit (``atol=0, rtol=0``). They favour clarity over speed.

Rounding of the backward multiply (all backends, bit-exact to :func:`decode_mul_reference`):

============================  =========================================================
``grad_output.dtype``         ``grad_input``
============================  =========================================================
``float64``                   ``grad * values_f64[code]`` (one float64 multiply)
``float32``                   ``grad * values_f32[code]`` (one float32 multiply)
``float16`` / ``bfloat16``    ``(grad.float() * values_f32[code]).to(dtype)``
                              (float32 multiply, one round-to-nearest-even to ``dtype``)
============================  =========================================================

where ``values_f32`` / ``values_f64`` are the table's values rounded to nearest float32 /
float64. There is no addition, so FMA contraction cannot change the result.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fewbit._checks import check_float_tensor
from fewbit.packing import pack_reference, packed_nbytes, unpack_reference

__all__ = [
    "encode_reference",
    "decode_mul_reference",
    "compute_dtype",
    "round_down_to_float32",
]

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which every fewbit kernel (few-bit ops and group quantizer) compares,
    multiplies and divides for inputs of ``dtype``.

    ``float64`` stays ``float64``; ``float32``, ``float16`` and ``bfloat16`` use ``float32``
    (the upcast of fp16/bf16 to fp32 is exact).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def round_down_to_float32(borders: torch.Tensor) -> torch.Tensor:
    """Round float64 borders DOWN to float32: the largest float32 ``b32 <= b``.

    For any float32 ``x`` (hence any fp16/bf16 value upcast exactly),
    ``not (x <= b32)`` equals ``b < x`` exactly, and NaN compares as greater than every
    border, so comparing in float32 against these borders gives the same interval index as
    ``torch.searchsorted(borders_f64, x.double(), right=False)``.

    Args:
        borders: ``(k,)`` float64 (or float32, returned as a float32 copy).

    Returns:
        ``(k,)`` float32 on the same device.
    """
    b64 = borders.to(torch.float64)
    b32 = b64.to(torch.float32)
    above = b32.to(torch.float64) > b64
    down = torch.nextafter(b32, torch.full_like(b32, float("-inf")))
    return torch.where(above, down, b32).contiguous()


def _as_borders_codes(borders, codes, device) -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.as_tensor(borders, dtype=torch.float64, device=device).reshape(-1)
    c = torch.as_tensor(codes, device=device).reshape(-1).to(torch.int64)
    if c.numel() != b.numel() + 1:
        raise ValueError(f"codes must have len(borders) + 1 = {b.numel() + 1} entries, got {c.numel()}")
    return b, c


def encode_reference(
    input: torch.Tensor,
    borders: torch.Tensor | Sequence[float],
    codes: torch.Tensor | Sequence[int],
    bits: int,
) -> torch.Tensor:
    """Reference encoder: interval index -> code -> packed b-bit stream.

    ``i(x) = torch.searchsorted(borders_f64, x.double(), right=False)`` (the number of
    borders strictly less than ``x``; NaN lands in the last interval),
    ``code(x) = codes[i(x)]``, packed with :func:`fewbit.packing.pack_reference`
    (docs/method.md §2, §6; Novikov et al., "Few-bit Backward", ICML 2023, sec. 3).

    Args:
        input: any shape, floating dtype; flattened in C order.
        borders: ``(m - 1,)`` strictly increasing borders (compared in float64).
        codes: ``(m,)`` integer codes in ``[0, 2**bits)``.
        bits: bits per element, 1..8.

    Returns:
        ``(ceil(numel * bits / 8),)`` uint8 on ``input.device``.
    """
    check_float_tensor(input, "input")
    b, c = _as_borders_codes(borders, codes, input.device)
    x = input.detach().reshape(-1).to(torch.float64)
    idx = torch.searchsorted(b, x, right=False)
    return pack_reference(c[idx], bits)


def decode_mul_reference(
    grad_output: torch.Tensor,
    packed: torch.Tensor,
    values: torch.Tensor | Sequence[float],
    bits: int,
    *,
    select_zero: bool = False,
    nonfinite: torch.Tensor | None = None,
    patch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference backward: unpack codes and return ``grad_output * values[code]``.

    Rounding is defined in this module's docstring: float64 grads multiply by float64
    values; every other dtype multiplies in float32 by float32 values and rounds once to
    its own dtype. With ``select_zero``, codes whose level is 0 give +0 whatever
    ``grad_output`` is (torch's select for stepwise functions); with a ``nonfinite``
    record and its ``patch`` the recorded elements get torch's gradient
    (:func:`fewbit.ops._nonfinite.patch_reference`; all NaN past the record's capacity).

    Args:
        grad_output: any shape, floating dtype; element ``j`` (C order) uses code ``j``.
        packed: ``(nbytes,)`` uint8 stream, ``nbytes >= ceil(numel * bits / 8)``.
        values: ``(2**bits,)`` derivative levels (any float dtype; rounded to nearest
            float32/float64 as above).
        bits: bits per element, 1..8.
        select_zero: give +0 where the level is 0 (a select, not ``grad * 0.0``).
        nonfinite: ``(1 + C,)`` int64 record of the non-finite inputs, or ``None``.
        patch: ``(24,)`` patch rows for ``nonfinite`` (required with it).

    Returns:
        Contiguous tensor of ``grad_output``'s shape and dtype.
    """
    check_float_tensor(grad_output, "grad_output")
    cdt = compute_dtype(grad_output.dtype)
    if isinstance(values, torch.Tensor):
        v = values.to(device=grad_output.device, dtype=cdt)
    else:
        v = torch.as_tensor(values, dtype=torch.float64, device=grad_output.device).to(cdt)
    if v.numel() != (1 << bits):
        raise ValueError(f"values must have 2**bits = {1 << bits} entries, got {v.numel()}")
    n = grad_output.numel()
    need = packed_nbytes(n, bits)
    if packed.numel() < need:
        raise ValueError(f"packed holds {packed.numel()} bytes, {need} needed for {n} codes of {bits} bits")
    code = unpack_reference(packed.reshape(-1), bits, n)
    g = grad_output.reshape(-1).to(cdt)
    level = v[code]
    prod = g * level
    if select_zero:
        prod = torch.where(level == 0, torch.zeros_like(prod), prod)
    out = prod.to(grad_output.dtype).reshape(grad_output.shape).contiguous()
    if nonfinite is not None:
        from fewbit.ops._nonfinite import patch_reference

        if patch is None:
            raise ValueError("patch is required with a nonfinite record")
        out = patch_reference(out, grad_output, nonfinite, patch)
    return out
