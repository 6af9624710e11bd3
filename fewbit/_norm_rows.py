"""Elements per normalized row: how many consecutive elements (C order) of a norm's input
share one mean/variance. One home for the rule, used for norm modules
(:func:`fewbit.convert.normalization_size`) and norm functions
(:data:`fewbit.quant.nonlinear.NORMS`). Each returns ``None`` where the shape does not fit.
"""

from __future__ import annotations

import math


def layer_norm(normalized_shape: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """LayerNorm / RMSNorm over the trailing ``normalized_shape`` of ``shape``."""
    ns = tuple(normalized_shape)
    return math.prod(ns) if ns and tuple(shape[-len(ns):]) == ns else None


def group_norm(num_groups: int, shape: tuple[int, ...]) -> int | None:
    """GroupNorm of ``(N, C, *spatial)``: ``prod(shape[1:]) // num_groups``."""
    if len(shape) < 2 or num_groups <= 0:
        return None
    rest = math.prod(shape[1:])
    return rest // num_groups if rest % num_groups == 0 else None


def instance_norm(shape: tuple[int, ...]) -> int | None:
    """InstanceNorm of ``(N, C, *spatial)``: one channel plane, ``prod(spatial)``."""
    return math.prod(shape[2:]) if len(shape) >= 3 else None
