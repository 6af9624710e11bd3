"""Argument checks shared by every public entry point (one home for each rule).

Each check raises ``ValueError`` (a bad value) or ``TypeError`` (a wrong kind of object)
whose message names the argument, the allowed range and the value given, and returns the
value normalised (a plain ``int``, a ``torch.dtype``). Nothing here imports numba, triton
or the rest of fewbit, so any module may import it; torch is imported on first use of
:data:`FLOAT_DTYPES` or :func:`check_float_tensor`, so that the torch-free modules
(:mod:`fewbit.table`, the command line's ``--help`` and ``list``) stay torch-free.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_DTYPES",
    "TABLE_BITS",
    "check_bits",
    "check_device",
    "check_float_tensor",
    "check_group_size",
    "check_noise_norm",
    "check_optimizer",
    "check_positive_int",
    "is_int",
    "packed_nbytes",
]

#: Floating-point dtypes the kernels accept (inputs, gradients, compressed tensors):
#: ``(torch.float16, torch.bfloat16, torch.float32, torch.float64)``, built by
#: :func:`__getattr__` on first use (PEP 562), so importing this module does not import torch.
FLOAT_DTYPES: tuple[torch.dtype, ...]


def _float_dtypes() -> tuple[torch.dtype, ...]:
    import torch

    return (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def __getattr__(name: str) -> Any:
    if name == "FLOAT_DTYPES":
        return _float_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Bit widths of a few-bit table (2**bits levels, codes packed ``bits`` per element).
TABLE_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)


def is_int(value: Any) -> bool:
    """True for a Python or NumPy integer, False for ``bool`` (which Python counts as int)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bits(bits: Any, name: str = "bits", allowed: Iterable[int] = TABLE_BITS) -> int:
    """``bits`` as a plain ``int`` if it is an integer in ``allowed``.

    Args:
        bits: the value given.
        name: the argument's name in the message (``"bits"``, ``"saved_bits"``, ...).
        allowed: the admitted widths; a contiguous range is written ``lo..hi``.

    Raises:
        ValueError: ``bits`` is not an integer (``bool`` included) or not in ``allowed``.
    """
    if type(bits) is int and bits in allowed:  # the common case, cheap (kernels call this per call)
        return bits
    allowed = tuple(allowed)
    contiguous = list(allowed) == list(range(allowed[0], allowed[-1] + 1))
    what = f"an integer in {allowed[0]}..{allowed[-1]}" if contiguous else f"one of {allowed}"
    if not is_int(bits) or int(bits) not in allowed:
        raise ValueError(f"{name} must be {what}, got {bits!r}")
    return int(bits)


def check_positive_int(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a plain ``int`` if it is an integer ``>= minimum`` (and ``<= maximum``,
    where given); else ``ValueError``."""
    if maximum is not None:
        if not is_int(value) or not minimum <= int(value) <= maximum:
            raise ValueError(f"{name} must be an integer in {minimum}..{maximum}, got {value!r}")
        return int(value)
    if not is_int(value) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


#: The largest quantizer group: the kernels take sizes as 32-bit integers
#: (``group_size=2**63`` was accepted, then failed inside the first step).
MAX_GROUP_SIZE = 2**31 - 1


def check_group_size(value: Any) -> int:
    """``value`` as a plain ``int`` if it is an integer in ``1..MAX_GROUP_SIZE``; else
    ``ValueError`` naming ``group_size``."""
    return check_positive_int(value, "group_size", maximum=MAX_GROUP_SIZE)


def check_average_bits(value: Any, context: str = "") -> float:
    """``value`` as a ``float`` if it is a real number (Python's or NumPy's, not ``bool``) in
    [1, 32], GACT's budget of bits per element; else ``ValueError`` (``context`` ends the
    message's requirement, e.g. " with saved_bits='auto'")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 <= value <= 32:
        raise ValueError(f"average_bits must be a number in [1, 32]{context}, got {value!r}")
    return float(value)


def check_bool(value: Any, name: str) -> bool:
    """``value`` as a plain ``bool`` if it is ``True`` or ``False`` (numpy's too); else
    ``ValueError`` (``stochastic="no"`` or ``1`` read as True were taken silently)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_optimizer(value: Any) -> tuple:
    """``value`` as a tuple of optimizers: ``()`` for None, ``(value,)`` for one
    ``torch.optim.Optimizer``, the optimizers of a list or tuple of them (a ``SparseAdam`` for
    the embedding beside an ``AdamW``; GACT's ``adapt``); else ``TypeError``."""
    import torch

    if value is None:
        return ()
    if isinstance(value, torch.optim.Optimizer):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.optim.Optimizer) for v in value):
        return tuple(value)
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, a list of them or None, got {type(value).__name__}")


def check_noise_norm(value: Any) -> str:
    """``value`` if it is one of GACT's noise norms, ``"relative"`` or ``"absolute"``
    (:class:`fewbit.quant.gact.GACTPolicy`); else ``ValueError``."""
    if value not in ("relative", "absolute"):
        raise ValueError(f"noise_norm must be 'relative' or 'absolute', got {value!r}")
    return value


def check_float_tensor(tensor: Any, name: str = "input") -> torch.Tensor:
    """``tensor`` if it is a dense (strided) ``torch.Tensor`` of a dtype in :data:`FLOAT_DTYPES`.

    Raises:
        TypeError: not a tensor, not of a floating-point dtype in :data:`FLOAT_DTYPES`, or
            sparse (another layout than ``torch.strided``).
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    float_dtypes = _float_dtypes()  # no globals(): torch.compile traces this
    if tensor.dtype not in float_dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in float_dtypes)
        raise TypeError(f"{name} must be a floating-point tensor ({names}), got dtype {tensor.dtype}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    return tensor


#: The largest float64 magnitude the compressors take: float32's largest finite value, as
#: for float32 input. Their statistics are float32 or bfloat16, which larger values overflow
#: (the group decoded as NaN). Magnitudes below float32's smallest steps are no concern: a
#: group of them (1e-300) decodes within 3e-39 of its values, float32's own resolution.
FLOAT64_MAX = 3.4028234663852886e38


def float64_out_of_range(x: "torch.Tensor") -> float | None:
    """For a float64 ``x`` with a finite magnitude past :data:`FLOAT64_MAX`, its largest
    finite magnitude; else None (also for other dtypes, which the statistics hold). Reads
    ``x`` once (a device sync on CUDA), only for float64."""
    import torch

    if x.dtype != torch.float64 or x.numel() == 0:
        return None
    a = x.detach().abs()
    top = float(a.masked_fill(a == float("inf"), 0.0).nan_to_num(0.0).amax())
    return top if top > FLOAT64_MAX else None


def check_float64_range(x: "torch.Tensor", name: str = "x") -> None:
    """Raise ``ValueError`` if ``x`` is float64 with finite values the compressors'
    statistics cannot hold (past :data:`FLOAT64_MAX`)."""
    v = float64_out_of_range(x)
    if v is not None:
        raise ValueError(
            f"{name}: float64 values must be of a magnitude at most float32's largest, 3.4e38, to be "
            f"compressed (the statistics are float32/bfloat16), got {v:.3g}; keep such a tensor exact"
        )


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` codes of ``bits`` bits in the packed stream: ``ceil(numel * bits / 8)``.

    The layout itself (little-endian bit stream, element ``i`` at bit ``i * bits``) is defined
    in :mod:`fewbit.packing`.

    Raises:
        ValueError: ``bits`` not in 1..8 or ``numel`` negative.
    """
    check_bits(bits)
    # a SymInt is a size in a fake kernel under torch.compile (>= 0 by construction)
    if not (type(numel) is int and numel >= 0):
        import torch  # not reached for a plain int: fewbit.table stays torch-free

        if not isinstance(numel, torch.SymInt):
            if not is_int(numel) or numel < 0:
                raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
            numel = int(numel)
    return (numel * bits + 7) // 8


def check_device(device: str, name: str = "--device") -> torch.device:
    """The device a command or script trains on: ``cpu``, or ``cuda[:N]`` that is here.

    Other device types (meta, mps, xla, ...) have no training step to measure. Shared by
    ``fewbit memory``/``fewbit plan`` and the scripts under ``scripts/``.

    Raises:
        ValueError: naming ``name``, the allowed devices and the value given.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device} given but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev
