"""Bounded memo dicts of per-setting state (tables, resolved calls, kernel tensors).

A setting is a function, its parameters, bits, dtype and device. A parameter that changes
at every call (an annealed ``negative_slope``) made a new setting per call, and every
cache kept each one for good (20 000 calls: 20 000 entries and 310 MiB more). The caches
stay plain dicts (``torch.compile`` reads some), filled through :func:`remember`, which
drops the oldest entries past :data:`LIMIT`; a dropped setting is resolved again at its
next call.
"""

from __future__ import annotations

import numbers

#: Entries each cache keeps.
LIMIT = 1024


def remember(cache: dict, key, value):
    """``cache[key] = value``, the oldest entries dropped past :data:`LIMIT`; returns
    ``value``. Safe without a lock: a concurrent change that disturbs the eviction leaves it
    to the next insertion."""
    cache[key] = value
    limit = LIMIT
    try:
        while len(cache) > limit:
            del cache[next(iter(cache))]
    except (RuntimeError, KeyError, StopIteration):
        pass
    return value


def call_key(params) -> tuple:
    """A parameters mapping as a dict key that tells apart what ``==`` does not: ``-0.0``
    from ``0.0`` (torch's ``leaky_relu(x, -0.0)`` differs in the sign of its zeros), NumPy's
    floats too, and ``True`` from ``1`` and ``1.0`` (refused as ``alpha``)."""
    return tuple((k, type(v).__name__, float(v).hex() if _is_float(v) else v) for k, v in params.items())


def _is_float(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral)
