"""Compressors of saved tensors: one interface, chosen per tensor (docs/compression.md).

A :class:`Compressor` turns one floating tensor into a :class:`Compressed` handle that
holds fewer bytes and gives back a tensor of the same shape, dtype and device. Every
compressor here is *unbiased* (``E[decompress(compress(x))] = x``, stochastic rounding)
and draws *fresh noise* on every call (one 64-bit seed from ``generator``, or from
torch's default CPU generator, so a run is reproducible under ``torch.manual_seed``);
docs/compression.md §1 says why both matter.

:class:`fewbit.quant.ActivationCompressor` applies one to every saved tensor it takes
(``compressor=``); :func:`get_compressor` builds one from its name, as ``fewbit.Config``
and the ``fewbit memory`` command do.

Compressors:
    ``"group"`` :class:`GroupQuantizer` -- ActNN's group-wise quantizer (docs/method.md §7).
    ``"keep"`` :class:`Keep` -- the tensor as it is (a choice of the per-tensor policies).
"""

from __future__ import annotations

import abc
from typing import ClassVar, Protocol, runtime_checkable

import torch

__all__ = ["Compressed", "Compressor", "GroupQuantizer", "Keep", "COMPRESSORS", "get_compressor"]


@runtime_checkable
class Compressed(Protocol):
    """What a :class:`Compressor` keeps for one tensor.

    Attributes:
        nbytes: bytes held (codes, statistics, exact parts), the figure counted in
            :class:`fewbit.quant.CompressionStats` and ``fewbit.memory``.
    """

    @property
    def nbytes(self) -> int: ...

    def decompress(self) -> torch.Tensor:
        """A contiguous tensor of the compressed tensor's shape, dtype and device."""
        ...


class Compressor(abc.ABC):
    """Interface of a saved-tensor compressor (subclass it to add one).

    Subclasses set :attr:`name`, implement :meth:`compress` and :meth:`bytes_per_element`,
    and may narrow :meth:`supports`. They must be unbiased and draw fresh noise per call
    (docs/compression.md §1); the tests of ``tests/quant/test_compressors.py`` check
    both for every entry of :data:`COMPRESSORS`.
    """

    #: Registry name (:data:`COMPRESSORS`).
    name: ClassVar[str] = ""

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Compressed:
        """Compress ``x`` (any shape, float16/bfloat16/float32/float64; not modified).

        Args:
            x: the tensor to compress.
            generator: a CPU ``torch.Generator`` for the noise seed; torch's default CPU
                generator if None.
        """

    @abc.abstractmethod
    def bytes_per_element(self, x: torch.Tensor) -> float:
        """Bytes :meth:`compress` keeps per element of ``x`` (its shape and dtype; the
        value is not read), statistics included: the figure planners use."""

    def supports(self, x: torch.Tensor) -> bool:
        """Whether :meth:`compress` applies to ``x`` (shape/dtype); True by default."""
        return True

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in vars(self).items()))))


class GroupQuantizer(Compressor):
    """ActNN's group-wise quantizer (docs/method.md §7; :func:`fewbit.quant.quantize`).

    Args:
        bits: bits per element, one of 1, 2, 4, 8.
        group_size: elements per group sharing one (min, scale) pair.
        stochastic: stochastic (unbiased) rounding if True, nearest if False.
        stats_dtype: torch.bfloat16 or torch.float32 for the per-group stats.

    Bytes per element: ``bits / 8 + 2 * itemsize(stats_dtype) / group_size`` (one
    short group rounds up).

    Raises:
        ValueError / TypeError: as :func:`fewbit.quant.quantize`, at construction.
    """

    name = "group"

    def __init__(self, bits: int = 4, *, group_size: int = 256, stochastic: bool = True,
                 stats_dtype: torch.dtype = torch.bfloat16) -> None:
        from fewbit.quant import _validate_options

        _validate_options(bits, group_size, stats_dtype, None)
        self.bits = bits
        self.group_size = group_size
        self.stochastic = bool(stochastic)
        self.stats_dtype = stats_dtype

    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None):
        from fewbit.quant import quantize

        return quantize(x, self.bits, group_size=self.group_size, stochastic=self.stochastic,
                        stats_dtype=self.stats_dtype, generator=generator)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        n = max(x.numel(), 1)
        groups = -(-n // self.group_size)
        stats = 2 * groups * torch.empty((), dtype=self.stats_dtype).element_size()
        return (-(-n * self.bits // 8) + stats) / n


class _Kept:
    """A tensor kept as it is (the :class:`Keep` compressor's handle)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def decompress(self) -> torch.Tensor:
        return self.tensor


class Keep(Compressor):
    """No compression: the tensor is kept exactly (bytes per element = its itemsize).

    :class:`fewbit.quant.ActivationCompressor` hands such tensors straight back to
    autograd (counted as skipped for reason ``"kept"``), so they cost no copy.
    """

    name = "keep"

    def compress(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> _Kept:
        return _Kept(x)

    def bytes_per_element(self, x: torch.Tensor) -> float:
        return float(x.element_size())


#: name -> Compressor class, for :func:`get_compressor` (``Config``, the ``memory`` CLI).
COMPRESSORS: dict[str, type[Compressor]] = {"group": GroupQuantizer, "keep": Keep}


def get_compressor(name: str, **options) -> Compressor:
    """The compressor registered as ``name`` (:data:`COMPRESSORS`), built with ``options``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the names), or an
            option is out of range (raised by the compressor).
        TypeError: an option the compressor does not take.
    """
    cls = COMPRESSORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"compressor must be one of {', '.join(sorted(COMPRESSORS))}; got {name!r}")
    return cls(**options)
