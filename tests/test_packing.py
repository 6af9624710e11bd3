"""The reference packer defines the stream layout of docs/method.md §6."""

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
