"""Triton kernels (CUDA backend) for the few-bit encode and decode-multiply ops.

Imported lazily by the ``cuda`` kernels of ``fewbit::encode`` / ``fewbit::decode_mul``
(never at ``import fewbit``). Each program handles ``BLOCK`` groups of 8 elements; a
group's 8 codes are summed into one 64-bit word at bit offsets ``k * BITS`` (disjoint
fields, so the sum is an OR) and its low ``BITS`` bytes are stored: the little-endian
stream of docs/method.md §6. All offsets are int64, so tensors of 2**31 elements or more
index correctly. The kernels also run on CPU tensors under ``TRITON_INTERPRET=1``
(tests use that; use a large ``block`` there, the interpreter is slow per program).

Bit-exactness with the CPU kernels: comparisons are exact (no arithmetic on x); the
backward is one multiply (no FMA possible) followed by a round-to-nearest-even cast.
"""

# No ``from __future__ import annotations``: the interpreter of triton 3.0/3.1 recognises
# ``tl.constexpr`` parameters only from evaluated annotations, not from strings.
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise NotImplementedError(
        "fewbit's CUDA kernels need Triton (pip install 'triton>=3.0'); "
        f"importing it failed: {exc}"
    ) from exc

__all__ = ["encode_triton", "decode_mul_triton", "default_block"]


@triton.jit
def _encode_kernel(
    x_ptr,
    borders_ptr,
    codes_ptr,
    out_ptr,
    n,
    NB: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_F64: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    grp = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    k = tl.arange(0, 8)
    idx = grp[:, None] * 8 + k[None, :].to(tl.int64)
    valid = idx < n
    x = tl.load(x_ptr + idx, mask=valid, other=0.0)
    if IS_F64:
        xc = x.to(tl.float64)
    else:
        xc = x.to(tl.float32)  # exact for fp16 / bf16 / fp32
    prev = tl.load(codes_ptr).to(tl.int32)
    code = tl.zeros([BLOCK, 8], dtype=tl.int32) + prev
    for j in range(NB):
        b = tl.load(borders_ptr + j)
        nxt = tl.load(codes_ptr + j + 1).to(tl.int32)
        # not (x <= b): NaN counts as above every border (last interval, as searchsorted)
        code += tl.where(xc <= b, 0, nxt - prev)
        prev = nxt
    code = tl.where(valid, code, 0)
    shifts = (k * BITS).to(tl.uint64)
    word = tl.sum(code.to(tl.uint64) << shifts[None, :], axis=1)
    t = tl.arange(0, 8)
    byte = ((word[:, None] >> (t * 8).to(tl.uint64)[None, :]) & 0xFF).to(tl.uint8)
    bidx = grp[:, None] * BITS + t[None, :].to(tl.int64)
    nbytes = (n * BITS + 7) // 8
    tl.store(out_ptr + bidx, byte, mask=(t[None, :] < BITS) & (bidx < nbytes))


@triton.jit
def _decode_mul_kernel(
    g_ptr,
    packed_ptr,
    values_ptr,
    out_ptr,
    n,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    grp = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    t = tl.arange(0, 8)
    bidx = grp[:, None] * BITS + t[None, :].to(tl.int64)
    nbytes = (n * BITS + 7) // 8
    byte = tl.load(packed_ptr + bidx, mask=(t[None, :] < BITS) & (bidx < nbytes), other=0)
    word = tl.sum(byte.to(tl.uint64) << (t * 8).to(tl.uint64)[None, :], axis=1)
    mask = (1 << BITS) - 1
    code = ((word[:, None] >> (t * BITS).to(tl.uint64)[None, :]) & mask).to(tl.int32)
    idx = grp[:, None] * 8 + t[None, :].to(tl.int64)
    valid = idx < n
    v = tl.load(values_ptr + code, mask=valid, other=0.0)
    g = tl.load(g_ptr + idx, mask=valid, other=0.0)
    if IS_F64:
        prod = g.to(tl.float64) * v
    else:
        prod = g.to(tl.float32) * v
    if OUT_BF16:
        # Round to nearest even by hand (the interpreter's cast truncates); NaN -> 0x7FC0.
        u = prod.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        res = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        res = prod.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, res, mask=valid)


def default_block() -> int:
    """Groups of 8 elements per program: 256 on a GPU, 4096 under the interpreter."""
    return 4096 if os.environ.get("TRITON_INTERPRET") == "1" else 256


def encode_triton(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, *, block: int | None = None
) -> torch.Tensor:
    """Launch the encoder. ``borders`` in compare dtype (float64 for float64 ``x``, else
    float32 rounded down); returns ``(ceil(numel * bits / 8),)`` uint8 on ``x.device``."""
    n = x.numel()
    out = torch.empty(((n * bits + 7) // 8,), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    block = block or default_block()
    x = x.detach().reshape(-1).contiguous()
    b = borders.detach().to(x.device).contiguous()
    nb = b.numel()
    if nb == 0:  # one interval: pass a dummy (never read) instead of a null pointer
        b = torch.full((1,), float("inf"), dtype=b.dtype, device=x.device)
    c = codes.detach().to(device=x.device, dtype=torch.int32).contiguous()
    grid = (triton.cdiv(triton.cdiv(n, 8), block),)
    _encode_kernel[grid](
        x, b, c, out, n,
        NB=nb, BITS=bits, BLOCK=block, IS_F64=x.dtype == torch.float64,
    )
    return out


def decode_mul_triton(
    grad: torch.Tensor, packed: torch.Tensor, values: torch.Tensor, bits: int, *, block: int | None = None
) -> torch.Tensor:
    """Launch the decode-multiply; ``values`` already in compute dtype (float64 for float64
    grads, else float32). Returns a contiguous tensor of ``grad``'s shape and dtype."""
    n = grad.numel()
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if n == 0:
        return out
    block = block or default_block()
    g = grad.detach().reshape(-1).contiguous()
    p = packed.detach().reshape(-1).contiguous()
    v = values.detach().to(grad.device).contiguous()
    grid = (triton.cdiv(triton.cdiv(n, 8), block),)
    _decode_mul_kernel[grid](
        g, p, v, out, n, BITS=bits, BLOCK=block,
        IS_F64=grad.dtype == torch.float64, OUT_BF16=grad.dtype == torch.bfloat16,
    )
    return out
