"""Shared helpers for tests/ops (imported by the test files, not collected)."""

from __future__ import annotations

import torch

from fewbit.table import Table

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [0, 1, 7, 1023, 4097]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that any NaN equals any NaN (torch's own fp32->bf16 cast
    gives 0x7FC0 or 0xFFFF for NaN depending on vectorisation, so payloads are not part
    of the contract)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    na, nb = a.isnan(), b.isnan()
    if not torch.equal(na, nb):
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~na].view(as_int), b[~nb].view(as_int))


def random_table(bits: int, *, mirrored: bool = False, seed: int = 0, scale: float = 3.0) -> Table:
    """A random valid table: identity codes over 2**bits intervals, or a mirrored
    (even-derivative) code map over 2**(bits+1) - 1 intervals (docs/method.md §2)."""
    g = torch.Generator().manual_seed(seed)
    n_codes = 1 << bits
    if mirrored:
        half = torch.sort(torch.rand(n_codes - 1, generator=g, dtype=torch.float64) * scale).values
        borders = torch.cat([-half.flip(0), half]).tolist()
        codes = list(range(n_codes - 1, 0, -1)) + list(range(n_codes))
    else:
        borders = torch.sort((torch.rand(n_codes - 1, generator=g, dtype=torch.float64) * 2 - 1) * scale).values.tolist()
        codes = list(range(n_codes))
    values = (torch.rand(n_codes, generator=g, dtype=torch.float64) * 2 - 0.5).tolist()
    return Table(name="custom", bits=bits, borders=borders, codes=codes, values=values)


def hard_inputs(table: Table, dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` values of ``dtype`` (1-D): random, plus (when room) every border rounded to
    ``dtype`` with its neighbours one ulp up and down, NaN, +-inf, +-0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    b = torch.tensor(table.borders, dtype=torch.float64).to(dtype)
    special = torch.cat([
        b,
        torch.nextafter(b, torch.full_like(b, float("inf"))),
        torch.nextafter(b, torch.full_like(b, float("-inf"))),
        torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0], dtype=dtype),
    ])
    k = min(n, special.numel())
    if k:
        perm = torch.randperm(n, generator=g)[:k]
        x[perm] = special[:k]
    return x
