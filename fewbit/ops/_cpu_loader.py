"""Loading the numba CPU kernels of the few-bit activations without stalling a call.

A new process pays for numba before its first kernel call: ``import numba`` (about
0.25 s), then, on the first call, numba's CPU target (its registries, LLVM) and the
cached machine code (about 0.55 s), measured on the 2-core CI VM; with an empty cache
(first run after an install) the kernels compile, about a minute. So the first CPU call
starts a daemon thread that imports :mod:`fewbit.ops._cpu` and calls each kernel once on
a few elements, and the CPU calls run on the pure-torch reference kernels
(:func:`fewbit.ops.encode_reference` / :func:`fewbit.ops.decode_mul_reference`, the
definitions the numba kernels match bit for bit: same codes, same gradients) until the
thread is done. The reference kernels are slower on large inputs (several passes, int64
intermediates), so a process that must time or size the fast path from its first call
calls :func:`load_cpu_kernels`.

Environment: ``FEWBIT_CPU_KERNELS=sync`` loads on the first call, in the calling thread
(the behaviour before this module); ``=reference`` never loads these kernels (the
compressors' CPU kernels, :mod:`fewbit.quant._cpu`, are numba whatever the setting). A forked child
starts its own loader (the parent's thread does not exist there).
"""

from __future__ import annotations

import os
import threading
import warnings

__all__ = ["ready", "load_cpu_kernels", "MODES"]

MODES = ("background", "sync", "reference")

_ready = False  # read without the lock on every call: a bool flips once
_lock = threading.Lock()
_thread: threading.Thread | None = None
_error: BaseException | None = None
_warned = False


def _mode() -> str:
    mode = os.environ.get("FEWBIT_CPU_KERNELS", "background").strip().lower() or "background"
    if mode not in MODES:
        raise ValueError(f"FEWBIT_CPU_KERNELS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _load() -> None:
    global _ready, _error
    try:
        from fewbit.ops import _cpu

        _cpu.warm_up()
        _ready = True
    except BaseException as exc:  # noqa: BLE001  (reported to the caller of load_cpu_kernels)
        _error = exc


def ready() -> bool:
    """Whether the numba kernels are loaded; the first call starts loading them (see the
    module docstring). Cheap after that: one global read.

    Raises:
        ValueError: if ``FEWBIT_CPU_KERNELS`` is not one of :data:`MODES`.
        NotImplementedError: in ``sync`` mode, if numba cannot be imported.
    """
    if _ready:
        return True
    global _thread, _warned
    with _lock:
        if _error is not None and not _warned:  # a background load failed: say so once
            _warned = True
            warnings.warn(f"fewbit: the numba CPU kernels could not be loaded ({_error}); CPU calls use the "
                          "pure-torch reference kernels (same results, slower)", RuntimeWarning, stacklevel=3)
        if _ready or _thread is not None or _error is not None:
            return _ready
        mode = _mode()
        if mode == "reference":
            return False
        if mode == "sync":
            _load()
            if _error is not None:
                raise _error
            return _ready
        _thread = threading.Thread(target=_load, name="fewbit-numba-loader", daemon=True)
        _thread.start()
    return False


def load_cpu_kernels(timeout: float | None = None) -> bool:
    """Load fewbit's numba CPU kernels now and wait for them (at most ``timeout`` seconds).

    Until they are loaded, CPU calls of the few-bit activations run on the pure-torch
    reference kernels (same codes and gradients, slower on large inputs); benchmarks and
    anyone who wants the fast path from the first call call this once after import.

    Args:
        timeout: seconds to wait, ``None`` for as long as it takes (a minute the first
            time after an install, when numba compiles the kernels into its disk cache).

    Returns:
        True once loaded; False if ``timeout`` passed first, or in ``reference`` mode.

    Raises:
        NotImplementedError: if numba cannot be imported (the error names it).
        ValueError: if ``FEWBIT_CPU_KERNELS`` is not one of :data:`MODES`.
    """
    if ready():
        return True
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    if _error is not None:
        raise _error
    return _ready


def _after_fork_in_child() -> None:
    global _thread, _lock
    _lock = threading.Lock()
    if not _ready:  # the loader thread was not copied into the child: start afresh
        _thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
