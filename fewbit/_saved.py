"""Saved tensors that a saved-tensor hook keeps as they are, checked for in-place changes.

torch checks, when backward unpacks a saved tensor, that nobody changed it in place since it
was saved ("one of the variables needed for gradient computation has been modified by an
inplace operation"), but only for tensors saved *without* hooks: under
``torch.autograd.graph.saved_tensors_hooks`` it returns whatever the unpack hook gives. A
pack hook that hands the tensor back as it is (too small to compress, a parameter, an
integer tensor, a policy's "keep", a plan's keep group) would therefore let backward read
values changed after the forward: a silently wrong gradient where torch raises. Every fewbit
hook that keeps a tensor returns :func:`keep` and unpacks with :func:`unpack`, which checks
the version as torch does.

A compressed copy needs no such check: it holds the values as they were when saved, so the
gradient is the one of the forward that ran (and holding the tensor to read its version
later would hold its memory).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Kept", "keep", "unpack"]


class Kept:
    """A saved tensor held as it is (a detached alias: same storage and version counter,
    nothing copied) with its version counter's value when it was saved.

    The alias, not the tensor itself: an op that saves its own output (exp, SDPA's out)
    would otherwise hold it through output -> grad_fn -> saved output, a reference cycle in
    C++ that Python's gc cannot see, and every graph dropped without backward leaked it."""

    __slots__ = ("tensor", "version", "__weakref__")  # weakly referenced: ActivationCompressor._kept

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version

    @property
    def nbytes(self) -> int:
        """Bytes of the storage it holds (shared with the caller's tensor)."""
        return self.tensor.untyped_storage().nbytes()

    def unpack(self) -> torch.Tensor:
        """The tensor, after checking that it was not changed in place since it was saved.

        Raises:
            RuntimeError: torch's own error for a saved tensor changed in place.
        """
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
                f"expected version {self.version} instead. (fewbit kept this saved tensor as it "
                "is, and, as torch does without fewbit, refuses to compute a gradient from values "
                "changed after the forward; change a copy instead, e.g. x = x.clone() before the "
                "in-place op.)"
            )
        return t


def keep(t: torch.Tensor) -> Kept:
    """A pack hook's result for ``t`` kept as it is (see :class:`Kept`)."""
    return Kept(t)


def unpack(packed: Any) -> Any:
    """An unpack hook for :func:`keep`'s results; anything else is returned as it is."""
    return packed.unpack() if type(packed) is Kept else packed


def under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s (a
    non-reentrant checkpoint's forward or recomputation; looked through a
    :class:`fewbit.memory.SavedTensorRecorder`'s hooks, which wrap the ones under them).

    Inside, what is saved is the checkpoint's: it drops it and recomputes it in backward.
    fewbit then neither compresses (it would only add a copy and noise) nor reroutes calls
    (:class:`fewbit.quant.mode.CompressionMode`), so the forward and its recomputation save
    alike, whatever converted modules enclose the checkpoint.
    """
    return checkpoint_hooks() is not None


def under_users_checkpoint(ours: tuple | None = None) -> bool:
    """Whether this runs under a ``torch.utils.checkpoint`` other than the one whose hooks
    are ``ours`` (``fewbit.plan``'s own recomputation; None: any), or inside a backward
    outside it (a reentrant checkpoint's recomputation). The checkpoint drops what the
    forward saves, or backward uses the recomputed tensors at once: compressing them would
    only add a copy and noise (under a user's gradient checkpointing, a converted GPT-2
    block held 994 KiB against checkpointing's 512; a planned LLaMA 2912 KiB against 852),
    so fewbit's hooks stand aside there."""
    top = checkpoint_hooks()
    if top is not None:
        return ours is None or top[0] is not ours[0]
    return ours is None and torch._C._current_graph_task_id() != -1


def checkpoint_hooks() -> tuple | None:
    """The innermost saved-tensor hooks if they are ``torch.utils.checkpoint``'s (looked
    through a :class:`fewbit.memory.SavedTensorRecorder`'s), else None: which checkpoint
    runs (``fewbit.plan`` tells its own recomputation from a user's checkpoint by them)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    while top is not None and hasattr(top[0], "inner"):
        top = top[0].inner
    return top if top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint" else None

