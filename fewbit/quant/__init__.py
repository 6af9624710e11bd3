"""fewbit.quant: ActNN-style group quantizer for the tensors other layers save for backward.

Maths (docs/method.md §7; Chen et al., "ActNN", ICML 2021, eq. 2-3; Liu et al., "GACT", ICML
2022): flatten ``x``, split it into groups of ``group_size`` elements (the last group may
be short), keep per group the min ``m`` and the scale ``s = (2**b - 1) / (max - m)`` in
``stats_dtype``, and the codes

    q = clamp(floor((x - m) * s + u), 0, 2**b - 1),   u ~ Uniform[0, 1)  (or u = 1/2)

packed as one little-endian b-bit stream (docs/method.md §6). ``x_hat = m + q / s``.
``q`` is computed from the *stored* ``m`` and ``s``; both are rounded *down* to
``stats_dtype`` (``s`` one more step if the rounded division overshoots) so that
``0 <= (x - m) * s <= 2**b - 1`` holds as computed (float32 arithmetic, or float64 for
float64 input) and the clamp never cuts a value: stochastic rounding is then unbiased, ``E[x_hat] = x``, with per-element variance
``<= 1 / (4 s**2)``. See :mod:`fewbit.quant._reference` for the exact steps, the
``max == min`` guard and non-finite groups (NaN/inf in a group: that group dequantizes to
NaN, other groups are unaffected).

Random numbers: ``u`` is a counter-based hash of the flat element index and one 64-bit
seed (:func:`fewbit.quant._reference.uniform_noise`, the one definition that the numba and
Triton kernels implement). The seed is one draw per call from a *CPU* generator (``generator``,
or fewbit's own noise stream, seeded from torch's seed: :func:`manual_seed`), whatever the device of ``x``: the draw needs no device
synchronisation, and the same generator state gives the same codes on CPU and CUDA (a CUDA
generator and a CPU generator seeded alike draw different numbers, so CUDA generators are
refused). Every backend computes the same noise, so the stochastic path is bit-identical
to :func:`quantize_reference` for the same generator state, no noise tensor is
materialised, and a run is reproducible under ``torch.manual_seed`` (in one process,
under :func:`manual_seed`) while torch's own random streams are left as they are.

Backends (``fewbit::group_quantize`` / ``fewbit::group_dequantize`` torch.library ops):
numba on CPU, Triton on CUDA, both imported lazily (``import fewbit`` imports neither).
On CPU numba was measured against a vectorised-torch formulation of the same maths (2**20
float32, 4 bits, 1 thread, loaded 2-core VM): 0.7 ms vs 9.4 ms nearest, 1.9 ms vs 118 ms
stochastic (the int64 hash is slow in torch); the group min/max are computed in the kernel.

Saved-tensor compression: :class:`ActivationCompressor` / :func:`compress_activations`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import numbers
import threading
from dataclasses import dataclass

import torch

from fewbit._checks import check_bits, check_bool, check_float64_range, check_float_tensor, check_group_size
from fewbit.quant import _reference as _ref
from fewbit.quant._reference import SUPPORTED_BITS
from fewbit.quant.compressor import (ActivationCompressor, CompressionStats, compress_activations,
                                     compress_custom_saves)

__all__ = [
    # quantizer
    "QuantizedTensor", "quantize", "dequantize",
    # noise seeds
    "manual_seed", "get_rng_state", "set_rng_state",
    # pure-torch definition
    "quantize_reference", "dequantize_reference",
    # saved-tensor compression
    "ActivationCompressor", "CompressionStats", "compress_activations", "compress_custom_saves",
]

SUPPORTED_STATS_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A group-quantized tensor (docs/method.md §7).

    Attributes:
        packed: ``(ceil(numel * bits / 8),)`` uint8, codes in the docs/method.md §6 stream layout.
        mins: ``(ceil(numel / group_size),)`` per-group min ``m`` in ``stats_dtype``.
        scales: same shape, per-group scale ``s`` (NaN for a non-finite group).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (and of :meth:`dequantize`).
        bits: bits per element (1, 2, 4 or 8).
        group_size: elements per group.
        decode_seed: the 64-bit seed of the stochastic rounding into float16/bfloat16 at
            :meth:`dequantize` (:func:`fewbit.quant._reference.stochastic_round_reference`),
            so that ``E[x_hat] = x`` holds in the half dtype too; None for nearest codes
            (rounded to nearest). Ignored for float32/float64.
    """

    packed: torch.Tensor
    mins: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    decode_seed: int | None = None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stats_dtype(self) -> torch.dtype:
        return self.mins.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: ``ceil(numel * bits / 8) + 2 * ceil(numel / group_size) * itemsize(stats)``."""
        return (
            self.packed.numel() * self.packed.element_size()
            + self.mins.numel() * self.mins.element_size()
            + self.scales.numel() * self.scales.element_size()
        )

    def dequantize(self) -> torch.Tensor:
        """``x_hat = m + q / s``: a contiguous tensor of ``shape`` and ``dtype`` (see :func:`dequantize`)."""
        return dequantize(self)

    #: The :class:`fewbit.quant.compressors.Compressed` interface (same as :meth:`dequantize`).
    decompress = dequantize

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"group_size={self.group_size}, stats_dtype={self.stats_dtype}, device={self.device}, "
            f"nbytes={self.nbytes})"
        )


def _validate(x, bits, group_size, stats_dtype, generator, stochastic=True) -> None:
    check_float_tensor(x, "x")
    _validate_options(bits, group_size, stats_dtype, generator, stochastic)
    check_float64_range(x, "x")


def _validate_options(bits, group_size, stats_dtype, generator, stochastic=True) -> None:
    """The checks :func:`quantize` and :class:`ActivationCompressor` share (ValueError /
    TypeError naming the argument, the allowed values and the value given)."""
    check_bits(bits, allowed=SUPPORTED_BITS)
    check_group_size(group_size)
    check_bool(stochastic, "stochastic")
    if stats_dtype not in SUPPORTED_STATS_DTYPES:
        raise ValueError(
            f"stats_dtype must be torch.bfloat16 or torch.float32 (float16 cannot hold the "
            f"range of activations), got {stats_dtype!r}"
        )
    _validate_generator(generator)


def _validate_generator(generator) -> None:
    """``generator`` must be None or a CPU torch.Generator (see :func:`_draw_seed`)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            "generator must be a CPU torch.Generator (the noise seed is drawn on the CPU for "
            f"tensors on every device, so codes do not depend on the device), got one on {generator.device}"
        )


#: Added (times the rank) to the drawn seed on ranks > 0 of an initialised process group:
#: the 64-bit golden-ratio constant, so that ranks' seed sequences do not overlap.
_RANK_STEP = 0x9E3779B97F4A7C15


def _distributed():
    """``torch.distributed`` while a process group is initialised, else None."""
    dist = getattr(torch, "distributed", None)
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _distributed()
    return 0 if dist is None else dist.get_rank()


def _world() -> int:
    """The default process group's size, 1 outside one (GACT's re-plans agree across it)."""
    dist = _distributed()
    return 1 if dist is None else dist.get_world_size()


#: Keys the hash that seeds fewbit's noise streams, so that no stream is torch's own (a
#: stream equal to the global one would correlate the rounding noise with dropout).
_NOISE_SALT = b"fewbit noise stream v1"

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class _NoiseStream:
    """fewbit's own noise seeds (see :func:`manual_seed`): one counter-based stream per
    torch seed (``torch.initial_seed()``), ``seed_i = splitmix64(base + i * golden)``, which
    goes on where it left off whenever torch's seed comes back to that value.

    A stream's ``base`` is made at its seed's first draw from the seed and torch's
    generator states at that moment (CPU, and CUDA where initialised; hashed, read, never
    advanced), so a fresh process reproduces a run, a run resumed from a saved torch RNG
    state draws other noise than its first steps (when the run's own draws moved torch's
    state), and a side computation seeded alike at every step (``fork_rng`` +
    ``manual_seed``) never makes the main stream start over. Compression therefore leaves
    every other random number of a run (dropout masks, data shuffling) as it is without
    compression. A stream is two ints; at most :attr:`MAX_STREAMS` are kept (least
    recently used dropped).

    :meth:`replay` is per thread: a checkpointed block's recomputation draws its forward's
    seeds without touching what other threads draw."""

    MAX_STREAMS = 1 << 16

    def __init__(self):
        self.lock = threading.Lock()
        self.streams: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # seed -> [base, count]
        self.local = threading.local()  # .replay: (torch seed, [base or None, count]) or None

    @staticmethod
    def _base(torch_seed: int) -> int:
        h = hashlib.blake2b(torch_seed.to_bytes(8, "little", signed=False), digest_size=8, key=_NOISE_SALT)
        h.update(torch.get_rng_state().numpy().tobytes())
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_available() and cuda.is_initialized():
            for state in cuda.get_rng_state_all():
                h.update(state.numpy().tobytes())
        return int.from_bytes(h.digest(), "little")

    @staticmethod
    def _next(entry: list) -> int:
        value = _splitmix64((entry[0] + entry[1] * 0x9E3779B97F4A7C15) & _MASK64) & ((1 << 63) - 1)
        entry[1] += 1
        return value

    def draw(self) -> int:
        """The next 63-bit noise seed of the stream of torch's current seed."""
        torch_seed = torch.initial_seed() & _MASK64
        replay = getattr(self.local, "replay", None)
        if replay is not None and replay[0] == torch_seed:
            entry = replay[1]
            if entry[0] is None:
                entry[0] = self._base(torch_seed)
            return self._next(entry)
        with self.lock:
            return self._next(self._stream(torch_seed))

    def _stream(self, torch_seed: int) -> list:
        """The ``[base, count]`` of ``torch_seed``'s stream, made now if it is not yet (the
        least recently used dropped past :attr:`MAX_STREAMS`); the caller holds the lock."""
        entry = self.streams.get(torch_seed)
        if entry is None:
            entry = self.streams[torch_seed] = [self._base(torch_seed), 0]
            while len(self.streams) > self.MAX_STREAMS:
                self.streams.popitem(last=False)
        else:
            self.streams.move_to_end(torch_seed)
        return entry

    def reset(self) -> None:
        with self.lock:
            self.streams.clear()

    def advance(self, n: int) -> None:
        """Skip ``n`` draws of the stream of torch's current seed (made now if it is not yet):
        ``scripts/train_lm.py --noise-draw`` trains with other compression noise and the same
        initialisation, data order and dropout masks."""
        with self.lock:
            entry = self._stream(torch.initial_seed() & _MASK64)
            entry[1] = (entry[1] + n) & _MASK64

    def snapshot(self) -> list[list[int]]:
        """Every stream as ``[torch seed, base, count]``, least recently used first."""
        with self.lock:
            return [[seed, entry[0], entry[1]] for seed, entry in self.streams.items()]

    def restore(self, streams: list[list[int]]) -> None:
        """Replace every stream by ``streams`` (:meth:`snapshot`'s form, checked)."""
        with self.lock:
            self.streams = collections.OrderedDict((seed, [base, count]) for seed, base, count in streams)
            while len(self.streams) > self.MAX_STREAMS:
                self.streams.popitem(last=False)

    def get_state(self) -> tuple[int, int | None, int]:
        """``(torch seed, base or None, count)``: where the stream is now, without creating
        it (a checkpointed block's forward records it, :meth:`replay` takes it back)."""
        torch_seed = torch.initial_seed() & _MASK64
        replay = getattr(self.local, "replay", None)
        if replay is not None and replay[0] == torch_seed:
            return torch_seed, replay[1][0], replay[1][1]
        with self.lock:
            entry = self.streams.get(torch_seed)
            return (torch_seed, None, 0) if entry is None else (torch_seed, entry[0], entry[1])

    @contextlib.contextmanager
    def replay(self, state: tuple[int, int | None, int]):
        """In this thread, draw from the stream as it was at :meth:`get_state` (a stream not
        made yet is made at its first draw, from torch's state then, as in the forward);
        afterwards, go on as before. ``torch.utils.checkpoint`` replays torch's generators
        the same way: the recomputed tensors get the forward's noise."""
        torch_seed, base, count = state
        outer = getattr(self.local, "replay", None)
        self.local.replay = (torch_seed, [base, count])
        try:
            yield
        finally:
            self.local.replay = outer


_noise_stream = _NoiseStream()


def manual_seed(seed: int) -> torch.Generator:
    """Seed torch and fewbit's noise stream: ``torch.manual_seed(seed)``, then restart the
    stream that compression draws its noise seeds from.

    Compression with ``generator=None`` takes its noise seeds (one 64-bit draw per
    compressed tensor) from CPU generators of fewbit's own, never from torch's, so a
    converted model draws the same dropout masks and the same data order as the vanilla
    model under the same seed. There is one stream per torch seed, created at its first
    draw from the seed and torch's generator state then, and it goes on where it left off
    whenever torch's seed comes back to that value: a fresh process reproduces a run, but
    re-seeding torch with a value already used in the process gives fresh noise, not a
    replay (a re-seed cannot be seen from outside, and a side computation seeded alike at
    every step must not make the training noise start over). Call this function instead
    of ``torch.manual_seed`` to replay a run within a process: it drops every stream.

    Args:
        seed: an int accepted by ``torch.manual_seed`` (-2**63 ... 2**64 - 1).

    Returns:
        torch's default CPU generator, as ``torch.manual_seed`` does.

    Raises:
        TypeError: ``seed`` not an int (bools too).
        ValueError: ``seed`` out of torch's range.

    Example:
        >>> fewbit.manual_seed(0); loss1 = train_step(model)
        >>> fewbit.manual_seed(0); loss2 = train_step(model)  # the same noise: loss2 == loss1
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (torch.manual_seed's range), got {seed}")
    generator = torch.manual_seed(int(seed))
    _noise_stream.reset()
    return generator


#: :func:`get_rng_state`'s format version.
_RNG_STATE_VERSION = 1


def get_rng_state() -> dict:
    """The state of fewbit's noise streams (:func:`manual_seed`), to save beside torch's
    RNG state for an exact resumption.

    A run resumed from a checkpoint with ``torch.set_rng_state`` alone draws new rounding
    noise, not the noise the uninterrupted run would have drawn; with this state restored
    too (:func:`set_rng_state`), it draws the same noise, so its losses are the
    uninterrupted run's bit for bit (on the same machine and thread count).

    Returns:
        ``{"version": 1, "streams": [[torch_seed, base, count], ...]}``: plain ints (each
        in ``[0, 2**64)``), least recently used stream first; it pickles, saves with
        ``torch.save`` and loads with ``torch.load(weights_only=True)``, and is valid
        JSON. At most 65 536 streams, 3 ints each.

    Example:
        >>> torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
        ...             "torch_rng": torch.get_rng_state(), "fewbit_rng": fewbit.get_rng_state()}, path)
        >>> ckpt = torch.load(path)  # later, in a fresh process
        >>> torch.set_rng_state(ckpt["torch_rng"]); fewbit.set_rng_state(ckpt["fewbit_rng"])
    """
    return {"version": _RNG_STATE_VERSION, "streams": _noise_stream.snapshot()}


def set_rng_state(state: dict) -> None:
    """Restore fewbit's noise streams from :func:`get_rng_state` (every stream made since
    is dropped). Restore torch's own state (``torch.set_rng_state``) as well: the stream
    drawn from is chosen by ``torch.initial_seed()``.

    Args:
        state: a dict as returned by :func:`get_rng_state` (also after a JSON or
            ``torch.save`` round trip: lists or tuples of ints).

    Raises:
        TypeError: ``state`` is not a dict of that form.
        ValueError: its ``version`` is not 1, or a stream is not three ints in
            ``[0, 2**64)``. Nothing is changed when an error is raised.
    """
    if not isinstance(state, dict) or set(state) != {"version", "streams"}:
        raise TypeError("state must be the dict fewbit.get_rng_state() returns, with keys 'version' and "
                        f"'streams'; got {type(state).__name__}"
                        + (f" with keys {sorted(map(str, state))}" if isinstance(state, dict) else ""))
    if state["version"] != _RNG_STATE_VERSION:
        raise ValueError(f"state['version'] must be {_RNG_STATE_VERSION}, got {state['version']!r}")
    streams = state["streams"]
    if not isinstance(streams, (list, tuple)):
        raise TypeError(f"state['streams'] must be a list, got {type(streams).__name__}")
    checked = []
    for i, stream in enumerate(streams):
        if (not isinstance(stream, (list, tuple)) or len(stream) != 3
                or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < 2**64
                       for v in stream)):
            raise ValueError(f"state['streams'][{i}] must be three ints [torch_seed, base, count] in "
                             f"[0, 2**64), got {stream!r}")
        checked.append([int(v) for v in stream])
    if len({seed for seed, _, _ in checked}) != len(checked):
        raise ValueError("state['streams'] lists a torch seed twice")
    _noise_stream.restore(checked)


def _draw_seed(generator: torch.Generator | None) -> int:
    """The 64-bit noise seed of one quantization: one draw from ``generator`` (a CPU
    generator), or from fewbit's own noise stream if None (:func:`manual_seed`; torch's
    generators are never advanced). The draw never depends on the device of the tensor
    being quantized.

    Under ``torch.distributed`` (an initialised process group) rank ``r`` adds
    ``r * _RANK_STEP`` (mod 2**63) to the draw: ranks seeded alike (the common
    ``set_seed(seed)`` on every rank) would otherwise round with the same noise pattern,
    and their errors would not average out in the gradient all-reduce."""
    if generator is None:
        seed = _noise_stream.draw()
    else:
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator).item())
    rank = _rank()
    return (seed + rank * _RANK_STEP) % (2**63 - 1) if rank else seed


def quantize(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    stats_dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Group-quantize ``x`` to ``bits`` bits per element (docs/method.md §7, ActNN eq. 2-3).

    Args:
        x: any shape (read flattened in C order; non-contiguous inputs are copied),
            float16, bfloat16, float32 or float64, on CPU or CUDA. Not modified.
        bits: bits per element, one of 1, 2, 4, 8.
        group_size: elements per group sharing one ``(m, s)`` pair (default 256: 0.125 bits
            per element of bf16 stats overhead).
        stochastic: stochastic rounding (unbiased, ``u ~ U[0, 1)``) if True, nearest
            rounding (``u = 1/2``) if False.
        stats_dtype: dtype of the stored ``m`` and ``s``: torch.bfloat16 or torch.float32.
        generator: a CPU ``torch.Generator``, source of the 64-bit noise seed (one draw per
            call when ``stochastic``, whatever the device of ``x``); if None, fewbit's own
            noise stream, seeded from torch's seed (:func:`manual_seed`), which leaves
            torch's random streams untouched.

    Returns:
        A :class:`QuantizedTensor` holding ``ceil(numel * bits / 8)`` bytes of codes plus
        ``2 * ceil(numel / group_size)`` stats.

    Raises:
        TypeError: ``x`` not a floating tensor, ``generator`` not a torch.Generator.
        ValueError: ``bits`` not in {1, 2, 4, 8}, ``group_size < 1``, ``stochastic`` not
            True or False, unsupported ``stats_dtype``, ``generator`` not on the CPU, or ``x`` float64 with finite
            magnitudes past float32's largest (:data:`fewbit._checks.FLOAT64_MAX`), which
            float32/bfloat16 statistics cannot hold.
    """
    return _quantize(x, bits, group_size, stochastic, stats_dtype, generator, torch.ops.fewbit.group_quantize)


def _quantize(x, bits, group_size, stochastic, stats_dtype, generator, kernel) -> QuantizedTensor:
    """:func:`quantize` with the op given: ``kernel(flat, bits, group_size, seed, stochastic,
    stats_dtype) -> (packed, mins, scales)`` (``fewbit::group_quantize`` or the reference)."""
    _validate(x, bits, group_size, stats_dtype, generator, stochastic)
    seed = _draw_seed(generator) if stochastic else 0
    flat = x.detach().reshape(-1).contiguous()
    packed, mins, scales = kernel(flat, bits, group_size, seed, bool(stochastic), stats_dtype)
    return QuantizedTensor(packed, mins, scales, x.shape, x.dtype, bits, group_size,
                           _ref.decode_seed(seed) if stochastic else None)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """``x_hat = m + q / s``: a contiguous tensor of ``qt.shape``, ``qt.dtype``, ``qt.device``.

    Computed in float32 (float64 for float64). Into float16/bfloat16 the result is rounded
    stochastically with ``qt.decode_seed`` (stochastic codes), so that ``E[x_hat] = x``
    holds in the half dtype as in float32 (to nearest, the mean would be off by up to half
    an ulp where the codes' step is below an ulp); the same ``qt`` decodes to the same
    tensor every time. Nearest codes are rounded to nearest. A float16 result is clamped
    to float16's finite range.

    Raises:
        TypeError: ``qt`` is not a :class:`QuantizedTensor`.
    """
    return _dequantize(qt, torch.ops.fewbit.group_dequantize)


def _dequantize(qt: QuantizedTensor, kernel) -> torch.Tensor:
    """:func:`dequantize` with the op given (``fewbit::group_dequantize`` or the reference)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a fewbit.quant.QuantizedTensor, got {type(qt).__name__}")
    seed = qt.decode_seed
    out = _ref.clamp_float16_(kernel(qt.packed, qt.mins, qt.scales, qt.bits, qt.group_size, qt.numel, qt.dtype,
                                     0 if seed is None else seed, seed is not None))
    return out.reshape(qt.shape)


# quantize_reference repeats the signature of quantize on purpose: it is called exactly as
# quantize is (tests, benchmarks), with the pure-torch kernel.
def quantize_reference(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    stats_dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Pure-torch definition of :func:`quantize` (same arguments, same result bit for bit)."""
    return _quantize(x, bits, group_size, stochastic, stats_dtype, generator, _ref.group_quantize_reference)


def dequantize_reference(qt: QuantizedTensor) -> torch.Tensor:
    """Pure-torch definition of :func:`dequantize`."""
    return _dequantize(qt, _dequantize_reference_kernel)


def _dequantize_reference_kernel(packed, mins, scales, bits, group_size, numel, dtype, seed, stochastic):
    return _ref.dequantize_reference(packed, mins, scales, bits, group_size, numel, dtype,
                                     seed if stochastic else None)


# Register the torch.library ops (no numba/triton import happens here).
from fewbit.quant import _ops as _ops  # noqa: E402,F401
