"""Elements per normalized row: how many consecutive elements (C order) of a norm's input
share one mean/variance. One home for the rule, used for norm modules
(:func:`fewbit.convert.normalization_size`) and norm functions
(:data:`fewbit.quant.nonlinear.NORMS`). Each returns ``None`` where the shape does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: A training BatchNorm's channel planes smaller than this are grouped channel-major
#: (:class:`Channels`): per-plane groups of fewer elements would cost more in statistics
#: (bfloat16 min and scale: 4 bytes a group, 0.125 bytes per element at 32) than the
#: transposed copy saves.
MIN_PLANE = 32


#: A training BatchNorm's channels of fewer elements than this (``N * prod(spatial)``, the
#: :class:`Channels` case) keep its input at the norm inputs' 8 bits, inside the channel:
#: its backward is quadratic in the input, ``x_hat_i * mean_j(g_j x_hat_j)``, so a rounding
#: error's variance ``v`` comes back as a bias ``g_i v / n`` (2 bits, n = 4: 2.1 % of the
#: previous layer's weight gradient, z = 11.6 over 2000 draws; n = 32: z = 3.3). Above it the
#: 2-bit bias goes on as about c / n of that gradient (c = 1 for an MLP, 1-26 for conv nets:
#: 0.5-1.2 % at n = 256; docs/compression.md §1).
MIN_CHANNEL = 256


@dataclass(frozen=True)
class Channels:
    """The statistics are per channel (dim 1) of ``(N, C, *spatial)``, over ``size =
    N * prod(spatial)`` elements that are not contiguous: compress the ``(C, N, *spatial)``
    copy, whose channel runs are (:meth:`fewbit.quant.ActivationCompressor._compress`)."""

    size: int


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


def batch_norm(shape: tuple[int, ...]) -> int | Channels | None:
    """BatchNorm on batch statistics of ``(N, C, *spatial)``: one channel plane,
    ``prod(spatial)``, where it has at least :data:`MIN_PLANE` elements and the channel at
    least :data:`MIN_CHANNEL`; else (``(N, C)`` inputs, small planes, small channels) the
    channel's elements, channel-major (:class:`Channels`)."""
    if len(shape) < 2:
        return None
    plane = math.prod(shape[2:])
    size = shape[0] * plane
    if plane >= MIN_PLANE and size >= MIN_CHANNEL:
        return plane
    # small planes, and channels of fewer than MIN_CHANNEL elements (which the compressor
    # keeps at 8 bits: a batch of 1 or 2 with 6 x 6 planes was biased too, h59)
    return Channels(size) if size > 0 else None
