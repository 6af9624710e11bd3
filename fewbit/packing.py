"""Reference packer for b-bit codes (docs/method.md §6), in pure torch.

Codes are one little-endian bit stream: element ``j`` occupies stream bits
``[j*b, (j+1)*b)``, and stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``. The stream
is a ``uint8`` tensor of ``ceil(numel * b / 8)`` bytes. Every backend writes and reads
exactly this layout; these functions are the definition the kernels are tested against.
They favour clarity over speed (about 16 bytes of temporaries per stream bit).
"""

from __future__ import annotations

import torch

from fewbit._checks import check_bits as _check_bits, packed_nbytes

__all__ = ["packed_nbytes", "pack_reference", "unpack_reference"]


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into the b-bit little-endian stream.

    Args:
        codes: any shape, integer dtype, values in ``[0, 2**bits)`` (flattened in C order).
        bits: bits per code, 1..8.

    Returns:
        ``(ceil(numel * bits / 8),)`` uint8 tensor on ``codes.device``.

    Raises:
        ValueError: for bits outside 1..8 or codes out of range.
        TypeError: for a non-integer ``codes`` dtype.
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    flat = codes.reshape(-1).to(torch.int64)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if n and (int(flat.min()) < 0 or int(flat.max()) >= (1 << bits)):
        raise ValueError(f"codes must be in [0, {1 << bits}) for bits={bits}")
    shifts = torch.arange(bits, device=flat.device)
    stream = ((flat[:, None] >> shifts) & 1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=flat.device)
    padded[: stream.numel()] = stream
    weights = torch.arange(8, device=flat.device)
    return (padded.reshape(-1, 8) << weights).sum(dim=1).to(torch.uint8)


def unpack_reference(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Unpack ``numel`` codes of ``bits`` bits from a stream made by :func:`pack_reference`.

    Args:
        packed: ``(nbytes,)`` uint8, ``nbytes >= ceil(numel * bits / 8)``.
        bits: bits per code, 1..8.
        numel: number of codes to read.

    Returns:
        ``(numel,)`` int64 codes.

    Raises:
        ValueError: if the stream is too short or the arguments are out of range.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"packed holds {packed.numel()} bytes, {need} needed for {numel} codes of {bits} bits")
    weights = torch.arange(8, device=packed.device)
    stream = ((packed.reshape(-1).to(torch.int64)[:, None] >> weights) & 1).reshape(-1)
    stream = stream[: numel * bits].reshape(numel, bits)
    shifts = torch.arange(bits, device=packed.device)
    return (stream << shifts).sum(dim=1)
