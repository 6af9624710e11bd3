"""Values made once while ``torch.compile`` traces fewbit's code, read back by that code.

A cache miss cannot be traced (a lock, file reads, a fit). fewbit computes such values in a
function that Dynamo runs eagerly while tracing (marked as
``torch.compiler.assume_constant_result`` marks a function, ``_dynamo_marked_constant``,
without importing ``torch._dynamo`` at ``import fewbit``); the function stores the value
with :func:`hold` and returns its name, a string constant. The traced code reads
``getattr(HOLDER, name)``: Dynamo reads a plain object's attribute when it traces it, while
a dict read earlier in the same trace is a snapshot guarded on its keys of then (a table
loaded later in that trace was missing from it, and the guard failed in the frame that
made it).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

__all__ = ["HOLDER", "hold", "constant", "host_side"]


class _Holder:
    """One attribute per held value."""


HOLDER = _Holder()
_names: dict[tuple, str] = {}
_lock = threading.Lock()


def constant(fn: Callable) -> Callable:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing
    ``torch._dynamo`` (seconds) at ``import fewbit``: Dynamo runs it eagerly while tracing
    and uses its result as a constant. Returns ``fn``."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def host_side(fn: Callable) -> Callable:
    """Run ``fn`` with torch's dispatch modes set aside: a one-time preparation (a table's
    tensors, the probes of torch's gradient rules, a fit) computes real values for the
    caches, whatever mode the call that needed them runs under. Under ``FakeTensorMode``
    or ``make_fx`` the probes had become fake (a cold first call failed on a
    data-dependent shape; a table cached then would have been fake for every later call),
    and a ``FlopCounterMode`` or a user's logging mode would have seen them as the user's
    operations. Returns the wrapped ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._len_torch_dispatch_stack():
            return fn(*args, **kwargs)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return fn(*args, **kwargs)

    return wrapper


def hold(key: tuple, value: Any) -> str:
    """Store ``value`` on :data:`HOLDER` under a name kept for ``key`` (hashable) and return
    the name; the same key keeps its name, and its latest value."""
    with _lock:
        name = _names.setdefault(key, f"v{len(_names)}")
        setattr(HOLDER, name, value)
    return name
