"""State that a forward interrupted by a ``BaseException`` leaves behind.

fewbit enters its modes and compressors in a module's forward pre-hook and leaves them in
an always-called forward hook. torch runs those hooks when the forward raises an
``Exception``, not a ``KeyboardInterrupt`` (Ctrl-C in a notebook) or another
``BaseException``: what the pre-hook entered stayed entered in that thread for good, and
every later forward, of any model, never-converted ones included, ran under it (its
functional activations few-bit, its saved tensors quantized: a plain model's weight
gradient 0.43 off at 2 bits).

The pre-hooks keep the frame of the module call that entered (``Module._call_impl``); a
frame that has stopped executing marks what it entered as left over, and the next fewbit
hook, pack hook or activation call that sees it leaves it (:func:`finished`). Until then
the frame, and through it the interrupted call's locals and its callers', stay alive (a
frame's id alone would not do: a new call of ``_call_impl`` soon takes the same id, and a
leftover would look like a running forward). A ``with fewbit.compress_activations()``
block that encloses the interrupted forward leaves its own hooks and mode wherever they
sit; torch's contexts (``saved_tensors_hooks``, ``save_on_cpu``, its checkpoint) pop
whatever is on top of torch's stacks when they exit: those are not repaired here.
"""

from __future__ import annotations

import sys
import types
import weakref

import torch

__all__ = ["caller_frame", "finished", "leave_mode", "remove_function_mode", "remove_saved_tensors_hooks",
           "sweep_modes"]

#: Left-over modes that torch had stashed when they were left (their own
#: ``__torch_function__`` was running): taken off the stack by the next :func:`sweep_modes`
#: in their thread (weak: a mode goes with its last reference).
_STASHED: weakref.WeakSet = weakref.WeakSet()


def caller_frame() -> types.FrameType:
    """The frame of the module call running the forward pre-hook that calls this."""
    return sys._getframe(2)


def finished(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` has stopped executing (its call returned or raised). A frame on
    the call stack cannot be cleared (``RuntimeError``, Python's data model); clearing a
    finished one also frees its locals."""
    if frame is None:
        return False
    try:
        frame.clear()
    except RuntimeError:
        return False
    return True


def remove_function_mode(mode: torch.overrides.TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's torch-function-mode stack wherever it sits, the
    modes above it put back in order; False if it is not there (e.g. stashed by torch while
    its own ``__torch_function__`` runs)."""
    from torch.overrides import _get_current_function_mode_stack

    if not any(m is mode for m in _get_current_function_mode_stack()):
        return False
    above = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    return True


def leave_mode(mode: torch.overrides.TorchFunctionMode) -> None:
    """Leave a left-over function mode of this thread (fewbit's ActivationMode and
    CompressionMode): it passes calls through from now on (``mode.left_over``, which its
    ``__torch_function__`` reads), and it is taken off the stack now, or at the next
    :func:`sweep_modes` if torch has it stashed."""
    mode.left_over = True
    if not remove_function_mode(mode):
        _STASHED.add(mode)


def sweep_modes() -> None:
    """Take the left-over modes torch had stashed (:func:`leave_mode`) off this thread's
    stack."""
    if not _STASHED:
        return
    for mode in list(_STASHED):
        if remove_function_mode(mode):
            _STASHED.discard(mode)


def remove_saved_tensors_hooks(pack_hook, unpack_hook) -> bool:
    """Take the innermost ``(pack_hook, unpack_hook)`` pair off this thread's stack of
    saved-tensor hooks wherever it sits, the pairs above it put back in order (a context
    entered since, a ``fewbit.memory`` recorder's, keeps its place); False if it is not
    there."""
    above = []
    found = False
    while True:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if top[0] == pack_hook and top[1] == unpack_hook:  # ==: a bound method is made anew at each access
            found = True
            break
        above.append(top)
    for pack, unpack in reversed(above):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return found
