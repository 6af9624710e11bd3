"""The reference packer defines the stream layout of docs/method.md §6."""

import functools

import pytest
import torch

from fewbit.packing import pack_reference, packed_nbytes, unpack_reference


def test_layout_by_hand():
    # element j occupies stream bits [j*b, (j+1)*b), bit k is bit k%8 of byte k//8
    assert pack_reference(torch.tensor([1, 2, 3]), 2).tolist() == [1 | (2 << 2) | (3 << 4)]
    assert pack_reference(torch.tensor([5, 6, 7]), 3).tolist() == [5 | (6 << 3) | ((7 & 3) << 6), 7 >> 2]
    assert pack_reference(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b1101, 1]
    assert pack_reference(torch.tensor([200, 7]), 8).tolist() == [200, 7]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 1023])
def test_round_trip(bits, numel):
    codes = torch.randint(0, 1 << bits, (numel,))
    packed = pack_reference(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, bits) == (numel * bits + 7) // 8
    assert torch.equal(unpack_reference(packed, bits, numel), codes)


def test_errors():
    with pytest.raises(ValueError, match="bits must be an integer in 1..8, got 9"):
        pack_reference(torch.zeros(3, dtype=torch.long), 9)
    with pytest.raises(ValueError, match=r"codes must be in \[0, 4\)"):
        pack_reference(torch.tensor([4]), 2)
    with pytest.raises(TypeError, match="integer"):
        pack_reference(torch.zeros(3), 2)
    with pytest.raises(ValueError, match="needed"):
        unpack_reference(torch.zeros(1, dtype=torch.uint8), 4, 3)


# --------------------------------------------------------------------------- every packer
# Every implementation of the stream in fewbit, bit for bit against the reference above:
# the numba packer (few-bit ops and group quantizer share it), the Triton packer (both
# Triton families share it; run under TRITON_INTERPRET=1 in a subprocess, as the Triton
# tests do) and the compressor's 1-bit bool packer.

NUMELS = [1, 5, 8, 13, 1023, 4099]  # odd lengths, partial last groups, several Triton programs


def _codes(bits, numel):
    return torch.randint(0, 1 << bits, (numel,), generator=torch.Generator().manual_seed(97 * bits + numel))


@functools.lru_cache(maxsize=None)  # compile the wrappers once
def _numba_impl():
    pytest.importorskip("numba")
    from numba import njit

    from fewbit.ops._cpu_kernels import pack_codes, unpack_codes

    @njit
    def pack(cb, out, bits):
        pack_codes(cb, out, bits)

    @njit
    def unpack(ps, cb, bits):
        unpack_codes(ps, cb, bits)

    def run(codes, bits):
        packed = torch.full((packed_nbytes(codes.numel(), bits),), 0xAA, dtype=torch.uint8)  # no zero-fill assumed
        pack(codes.to(torch.uint8).numpy(), packed.numpy(), bits)
        back = torch.empty(codes.numel(), dtype=torch.uint8)
        unpack(packed.numpy(), back.numpy(), bits)
        return packed, back

    return run


_TRITON_CHILD = r"""
import sys, torch, triton, triton.language as tl
from fewbit.ops._triton import _groups, _load_unpack, _pack_store

@triton.jit
def pack_k(c_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    grp, idx = _groups(BLOCK)
    _pack_store(tl.load(c_ptr + idx, mask=idx < n, other=0), grp, out_ptr, n, BITS)

@triton.jit
def unpack_k(p_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    grp, idx = _groups(BLOCK)
    tl.store(out_ptr + idx, _load_unpack(p_ptr, grp, n, BITS), mask=idx < n)

cases = torch.load(sys.argv[1])
out = {}
for (bits, n), codes in cases.items():
    packed = torch.full(((n * bits + 7) // 8,), 0xAA, dtype=torch.uint8)
    grid = (triton.cdiv(triton.cdiv(n, 8), 64),)
    pack_k[grid](codes.to(torch.int32), packed, n, BITS=bits, BLOCK=64)
    back = torch.empty(n, dtype=torch.int32)
    unpack_k[grid](packed, back, n, BITS=bits, BLOCK=64)
    out[(bits, n)] = (packed, back)
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def triton_streams(tmp_path_factory):
    """The Triton packer's streams and unpacked codes of every case, computed in one
    subprocess under the interpreter."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("triton_pack")
    torch.save({(b, n): _codes(b, n) for b in range(1, 9) for n in NUMELS}, d / "in.pt")
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHILD, str(d / "in.pt"), str(d / "out.pt")],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(d / "out.pt")


def _bool_impl():
    from fewbit.quant.compressor import _pack_bool, _unpack_bool

    def run(codes, bits):
        packed = _pack_bool(codes.bool())
        return packed, _unpack_bool(packed, codes.numel())

    return run


_CASES = [(impl, b, n) for impl, widths in (("numba", range(1, 9)), ("triton", range(1, 9)), ("bool", (1,)))
          for b in widths for n in NUMELS]


@pytest.mark.parametrize("impl,bits,numel", _CASES, ids=[f"{i}-b{b}-n{n}" for i, b, n in _CASES])
def test_every_packer_matches_reference(impl, bits, numel, request):
    codes = _codes(bits, numel)
    if impl == "triton":
        packed, back = request.getfixturevalue("triton_streams")[(bits, numel)]
    else:
        packed, back = (_numba_impl() if impl == "numba" else _bool_impl())(codes, bits)
    assert torch.equal(packed, pack_reference(codes, bits))  # bit-exact, padding bits 0
    assert torch.equal(back.to(torch.int64), unpack_reference(pack_reference(codes, bits), bits, numel))
