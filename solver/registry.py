"""Analytic float64 activations and derivatives for the offline solver.

Every name of :data:`fewbit.activations.ACTIVATIONS` (and its aliases) has here a
numpy/scipy.special ``f(x, **params)`` and ``df(x, **params)`` in float64, the points
where ``f'`` is not smooth (``kinks``), and the torch function it mirrors. The default
parameters and the ``even`` flag (docs/method.md §2, the "parity" trick of Novikov et al.,
"Few-bit Backward", ICML 2023) come from :mod:`fewbit.activations`, so runtime and solver
agree on names and defaults.

At points where ``f'`` jumps (kinks), ``df`` returns what torch's backward returns
there (e.g. ``relu'(0) = 0``, ``leaky_relu'(0) = negative_slope``, ``selu'(0) =
scale * alpha``), so that a table fitted here and torch's gradient agree everywhere.

A user function is given as ``"package.module:callable"``: a torch elementwise function
that is loaded with :mod:`importlib`; ``f`` is evaluated with torch in float64 and ``f'``
with torch autograd. Its kinks are not known in advance: the jumps of its ``f'`` on a fit's
interval are found numerically (:func:`find_jumps`) and then treated as a registry
function's kinks are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
from scipy import special

from fewbit import activations as _acts
from fewbit.activations import callable_params, forward_callable, import_callable, merge_params

__all__ = ["SolverFunction", "get", "names", "find_jumps"]

_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_GELU_TANH_C = 0.044715
_QUICK_GELU_A = 1.702


@dataclass(frozen=True)
class SolverFunction:
    """An activation ``f`` with its float64 derivative, as the solver sees it.

    Args:
        name: registry name (``"gelu"``) or the user spec ``"module:callable"``.
        f_impl: ``f_impl(x, params) -> ndarray``, float64 ``f`` for an ndarray ``x``.
        df_impl: ``df_impl(x, params) -> ndarray``, float64 ``f'`` (torch's value at kinks).
        kinks_impl: ``kinks_impl(params) -> tuple`` of points where ``f'`` is not smooth.
        defaults: default parameters (torch names).
        even: whether ``f'`` is even (fit on ``[0, B]`` and mirror).
        torch_fn: the torch function ``torch_fn(input, **params)``.
        stepwise: True when ``f'`` is piecewise constant with an exact 1-bit table
            (:func:`fewbit.activations.exact_table`); no fitting is done for these.
        user: True for a ``"module:callable"`` user function.
        primitive_impl: ``primitive_impl(x, params)``, a continuous antiderivative of
            ``df``, where it is not ``f`` itself (``None``): torch's ``f`` may jump where
            its ``f'`` has no delta (softplus at its ``threshold``), and the solver's
            integrals of ``f'`` are differences of the primitive.
        integral_impl: ``integral_impl(lo, hi, params)``, ``int_lo^hi f'`` per cell (no
            kink inside a cell) computed without a difference of primitive values: used
            where those differences lose their digits (primitive values huge next to their
            changes: softplus' ``~log(2) / beta`` for a tiny ``beta``); ``None``:
            Gauss-Legendre quadrature of ``f'`` there.
        kink_finder: ``kink_finder(params, a, b)``, the kinks of ``f'`` inside ``(a, b)``
            found numerically (user functions: :func:`find_jumps`); ``None``: ``kinks_impl``.
    """

    name: str
    f_impl: Callable[[np.ndarray, Mapping[str, float]], np.ndarray]
    df_impl: Callable[[np.ndarray, Mapping[str, float]], np.ndarray]
    kinks_impl: Callable[[Mapping[str, float]], tuple] = lambda p: ()
    defaults: Mapping[str, float] = field(default_factory=dict)
    even: bool = False
    torch_fn: Callable[..., Any] | None = None
    stepwise: bool = False
    user: bool = False
    primitive_impl: Callable[[np.ndarray, Mapping[str, float]], np.ndarray] | None = None
    integral_impl: Callable[[np.ndarray, np.ndarray, Mapping[str, float]], np.ndarray] | None = None
    kink_finder: Callable[[Mapping[str, float], float, float], tuple] | None = None

    def params(self, params: Mapping[str, float] | None = None) -> dict[str, float]:
        """The full parameter dict: ``params`` merged over the defaults.

        Raises:
            ValueError: for a key the function does not take, or a non-finite value.
        """
        return merge_params(self.name, self.defaults, params)

    def f(self, x, **params) -> np.ndarray:
        """``f(x)`` in float64; ``x`` array-like, any shape; ``params`` over the defaults."""
        return self.f_impl(np.asarray(x, dtype=np.float64), self.params(params))

    def df(self, x, **params) -> np.ndarray:
        """``f'(x)`` in float64 (torch's backward value at kinks); same shape as ``x``."""
        return self.df_impl(np.asarray(x, dtype=np.float64), self.params(params))

    def kinks(self, **params) -> tuple[float, ...]:
        """Points where ``f'`` is not smooth (jumps or kinks), sorted: the analytic ones
        (empty for a user function, whose jumps depend on the interval: :meth:`kinks_on`)."""
        return tuple(sorted(float(k) for k in self.kinks_impl(self.params(params))))

    def kinks_on(self, params: Mapping[str, float], a: float, b: float) -> tuple[float, ...]:
        """Points inside ``(a, b)`` where ``f'`` is not smooth, sorted: the analytic kinks,
        or for a user function the jumps of its ``f'`` there (:func:`find_jumps`).

        Args:
            params: the full parameter dict (defaults filled in).
            a, b: the interval, ``a < b``.
        """
        if self.kink_finder is not None:
            ks = self.kink_finder(params, float(a), float(b))
        else:
            ks = self.kinks_impl(params)
        return tuple(sorted({float(k) for k in ks if a < k < b}))


# --- analytic functions -------------------------------------------------------------------

def _sigmoid(x):
    return special.expit(x)


def _softplus1(x):
    # log(1 + exp(x)) without overflow
    return np.logaddexp(0.0, x)


def _gelu_f(x, p):
    return x * special.ndtr(x)


def _gelu_df(x, p):
    return special.ndtr(x) + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh_f(x, p):
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + _GELU_TANH_C * x**3)))


def _gelu_tanh_df(x, p):
    t = np.tanh(_SQRT_2_PI * (x + _GELU_TANH_C * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)


def _silu_f(x, p):
    return x * _sigmoid(x)


def _silu_df(x, p):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _quick_gelu_f(x, p):
    return x * _sigmoid(_QUICK_GELU_A * x)


def _quick_gelu_df(x, p):
    s = _sigmoid(_QUICK_GELU_A * x)
    return s + _QUICK_GELU_A * x * s * (1.0 - s)


def _selu_f(x, p):
    return _SELU_SCALE * np.where(x > 0, x, _SELU_ALPHA * np.expm1(np.minimum(x, 0.0)))


def _selu_df(x, p):
    # torch: x <= 0 -> scale * alpha * exp(x)
    return np.where(x > 0, _SELU_SCALE, _SELU_SCALE * _SELU_ALPHA * np.exp(np.minimum(x, 0.0)))


def _elu_f(x, p):
    a = p["alpha"]
    return np.where(x > 0, x, a * np.expm1(np.minimum(x, 0.0)))


def _elu_df(x, p):
    a = p["alpha"]
    return np.where(x > 0, 1.0, a * np.exp(np.minimum(x, 0.0)))


def _celu_f(x, p):
    a = p["alpha"]
    return np.where(x > 0, x, a * np.expm1(np.minimum(x, 0.0) / a))


def _celu_df(x, p):
    a = p["alpha"]
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0) / a))


def _mish_f(x, p):
    return x * np.tanh(_softplus1(x))


def _mish_df(x, p):
    t = np.tanh(_softplus1(x))
    return t + x * (1.0 - t * t) * _sigmoid(x)


def _softplus_f(x, p):
    beta, thr = p["beta"], p["threshold"]
    bx = beta * x
    return np.where(bx > thr, x, _softplus1(np.minimum(bx, thr)) / beta)


def _softplus_df(x, p):
    # torch: beta * x > threshold -> 1, else sigmoid(beta * x)
    beta, thr = p["beta"], p["threshold"]
    bx = beta * x
    return np.where(bx > thr, 1.0, _sigmoid(bx))


def _softplus_primitive(x, p):
    # torch's softplus switches to ``x`` where beta * x > threshold, which jumps by
    # (threshold - log1p(exp(threshold))) / beta there (-2e-9 at the default 20, -0.69 at
    # threshold 0); its derivative has no delta, so the primitive of f' is shifted there
    # to stay continuous. Its differences cancel where its values are huge next to their
    # changes (a tiny |beta|, a hugely negative threshold): _softplus_integral there.
    beta, thr = p["beta"], p["threshold"]
    bx = beta * x
    return np.where(bx > thr, x + (_softplus1(thr) - thr) / beta, _softplus1(np.minimum(bx, thr)) / beta)


def _log_expm1(d):
    # log(expm1(d)) for d >= 1e-5 (no overflow for a large d: d + log1p(-e^-d))
    big = d > 1.0
    return np.where(big, d + np.log1p(-np.exp(-np.maximum(d, 1.0))), np.log(np.expm1(np.where(big, 1.0, d))))


def _softplus_integral(lo, hi, p):
    # int_lo^hi f' per cell (no cell straddles the threshold kink), where differences of
    # _softplus_primitive lose their digits: its values are ~log(2) / beta for a tiny |beta|
    # (every digit gone at beta = 1e-16, all levels 0 at 1e-300) and x + 1e300 on the linear
    # branch of threshold -1e300. Each cell's integral is taken alone: hi - lo on the linear
    # branch; on the other, with m <= M the ends of beta * x,
    #   softplus(M) - softplus(m) = log1p(sigmoid(m) * expm1(M - m))  (>= 0),
    # in logarithms, free of overflow and underflow: L = log_sigmoid(m) + log_expm1(M - m),
    # M - m = |beta| (hi - lo); the integral is log1p(e^L) / |beta|, or e^(L - log|beta|)
    # where e^L is below rounding of 1 (no subnormal quotient for a tiny beta).
    beta, thr = p["beta"], p["threshold"]
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    ab = abs(beta)
    width = hi - lo
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        linear = beta * (0.5 * (lo + hi)) > thr
        m = np.minimum(beta * lo, beta * hi)
        log_sig = -np.logaddexp(0.0, -m)
        d = ab * width
        small = d < 1e-5
        # log(expm1(d)) - log|beta|, d tiny: log(hi - lo) + log1p(d/2 + ...) (exact for a subnormal d)
        le_tiny = np.log(np.where(width > 0, width, 1.0)) + np.log1p(d * (0.5 + d * (1.0 / 6.0 + d / 24.0)))
        log_ab = math.log(ab)
        L = log_sig + np.where(small, le_tiny + log_ab, _log_expm1(d))
        D = np.logaddexp(0.0, L)
        sig = np.where(L < -40.0, np.exp(np.where(small, log_sig + le_tiny, L - log_ab)), D / ab)
    return np.where(linear, width, np.where(width > 0, sig, 0.0))


def _softplus_kinks(p):
    return (p["threshold"] / p["beta"],) if p["beta"] != 0 else ()


def _sigmoid_df(x, p):
    s = _sigmoid(x)
    return s * (1.0 - s)


def _tanh_df(x, p):
    t = np.tanh(x)
    return 1.0 - t * t


def _logsigmoid_f(x, p):
    return -_softplus1(-x)


def _logsigmoid_df(x, p):
    return _sigmoid(-x)


def _softsign_f(x, p):
    return x / (1.0 + np.abs(x))


def _softsign_df(x, p):
    return 1.0 / (1.0 + np.abs(x)) ** 2


def _tanhshrink_f(x, p):
    return x - np.tanh(x)


def _tanhshrink_df(x, p):
    t = np.tanh(x)
    return t * t


def _hardswish_f(x, p):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def _hardswish_df(x, p):
    # torch's backward: x <= -3 -> 0; x < 3 -> x / 3 + 0.5; else 1
    return np.where(x <= -3.0, 0.0, np.where(x < 3.0, x / 3.0 + 0.5, 1.0))


# stepwise (torch's backward semantics at the jumps)

def _relu_f(x, p):
    return np.maximum(x, 0.0)


def _relu_df(x, p):
    return np.where(x > 0, 1.0, 0.0)


def _leaky_relu_f(x, p):
    return np.where(x > 0, x, p["negative_slope"] * x)


def _leaky_relu_df(x, p):
    return np.where(x > 0, 1.0, p["negative_slope"])


def _hardtanh_f(x, p):
    return np.clip(x, p["min_val"], p["max_val"])


def _hardtanh_df(x, p):
    return np.where((x > p["min_val"]) & (x < p["max_val"]), 1.0, 0.0)


def _relu6_f(x, p):
    return np.clip(x, 0.0, 6.0)


def _relu6_df(x, p):
    return np.where((x > 0.0) & (x < 6.0), 1.0, 0.0)


def _threshold_f(x, p):
    return np.where(x > p["threshold"], x, p["value"])


def _threshold_df(x, p):
    return np.where(x > p["threshold"], 1.0, 0.0)


def _hardshrink_f(x, p):
    lam = p["lambd"]
    return np.where((x >= -lam) & (x <= lam), 0.0, x)


def _shrink_df(x, p):
    lam = p["lambd"]
    return np.where((x >= -lam) & (x <= lam), 0.0, 1.0)


def _softshrink_f(x, p):
    lam = p["lambd"]
    return np.where(x > lam, x - lam, np.where(x < -lam, x + lam, 0.0))


def _hardsigmoid_f(x, p):
    return np.clip(x / 6.0 + 0.5, 0.0, 1.0)


def _hardsigmoid_df(x, p):
    # torch's backward multiplies by the float32 constant 1.0f / 6.0f in every dtype
    return np.where((x > -3.0) & (x < 3.0), _acts.HARDSIGMOID_SLOPE, 0.0)


def _tanh_f(x, p):
    return np.tanh(x)


def _sigmoid_f(x, p):
    return _sigmoid(x)


def _const(*points):
    return lambda p: points


# name -> (f, df, kinks)
_ANALYTIC: dict[str, tuple] = {
    "gelu": (_gelu_f, _gelu_df, _const()),
    "gelu_tanh": (_gelu_tanh_f, _gelu_tanh_df, _const()),
    "silu": (_silu_f, _silu_df, _const()),
    "selu": (_selu_f, _selu_df, _const(0.0)),
    "elu": (_elu_f, _elu_df, _const(0.0)),
    "celu": (_celu_f, _celu_df, _const(0.0)),
    "mish": (_mish_f, _mish_df, _const()),
    "softplus": (_softplus_f, _softplus_df, _softplus_kinks),
    "sigmoid": (_sigmoid_f, _sigmoid_df, _const()),
    "tanh": (_tanh_f, _tanh_df, _const()),
    "logsigmoid": (_logsigmoid_f, _logsigmoid_df, _const()),
    "softsign": (_softsign_f, _softsign_df, _const(0.0)),
    "tanhshrink": (_tanhshrink_f, _tanhshrink_df, _const()),
    "hardswish": (_hardswish_f, _hardswish_df, _const(-3.0, 3.0)),
    "quick_gelu": (_quick_gelu_f, _quick_gelu_df, _const()),
    "relu": (_relu_f, _relu_df, _const(0.0)),
    "leaky_relu": (_leaky_relu_f, _leaky_relu_df, _const(0.0)),
    "relu6": (_relu6_f, _relu6_df, _const(0.0, 6.0)),
    "hardtanh": (_hardtanh_f, _hardtanh_df, lambda p: (p["min_val"], p["max_val"])),
    "threshold": (_threshold_f, _threshold_df, lambda p: (p["threshold"],)),
    "hardshrink": (_hardshrink_f, _shrink_df, lambda p: (-p["lambd"], p["lambd"])),
    "softshrink": (_softshrink_f, _shrink_df, lambda p: (-p["lambd"], p["lambd"])),
    "hardsigmoid": (_hardsigmoid_f, _hardsigmoid_df, _const(-3.0, 3.0)),
}

#: name -> continuous primitive of ``df`` where ``f`` is not one (:class:`SolverFunction`)
_PRIMITIVE: dict[str, Callable] = {"softplus": _softplus_primitive}
#: name -> ``int_lo^hi df`` per cell, where differences of the primitive cancel (:class:`SolverFunction`)
_INTEGRAL: dict[str, Callable] = {"softplus": _softplus_integral}

_CACHE: dict[str, SolverFunction] = {}


def names() -> list[str]:
    """Registry names (sorted), without aliases."""
    return sorted(_acts.ACTIVATIONS)


def _from_registry(name: str) -> SolverFunction:
    # a Hugging Face formula name stands for the entry whose tables it shares
    act = _acts.table_activation(name)
    f, df, kinks = _ANALYTIC[act.name]
    return SolverFunction(
        name=act.name,
        f_impl=f,
        df_impl=df,
        kinks_impl=kinks,
        defaults=dict(act.defaults),
        even=act.even,
        torch_fn=act.torch_fn,
        stepwise=act.stepwise,
        primitive_impl=_PRIMITIVE.get(act.name),
        integral_impl=_INTEGRAL.get(act.name),
    )


# --- jumps of a user function's derivative ------------------------------------------------

#: Cells of the scan of ``f'`` for jumps (per piece of the interval, see :func:`find_jumps`).
JUMP_SCAN_CELLS = 1 << 17
#: On a wider interval, ``[-JUMP_SCAN_CORE, JUMP_SCAN_CORE]`` gets a scan of its own, so that
#: the region where activations bend is scanned as finely as on the default domain.
JUMP_SCAN_CORE = 32.0
#: A scan cell is a candidate when its change of ``f'`` exceeds this many times its
#: neighbours' (on the calmer side) ...
_JUMP_RATIO = 4.0
#: ... and this fraction of ``max |f'|`` on the interval; a jump is confirmed when, between
#: two adjacent float64 numbers, ``f'`` still changes by this much and by a quarter of the
#: candidate cell's change. (A smooth steep ``f'`` changes by about ``f'' * ulp`` there.)
_JUMP_FLOOR = 1e-9
#: Rounds of :func:`find_jumps` over what is left of a cell once a jump in it is found.
_JUMP_ROUNDS = 4


def _float_key(x: np.ndarray) -> np.ndarray:
    """int64 keys of float64 numbers in the same order (adjacent floats: adjacent keys)."""
    b = np.ascontiguousarray(x, dtype=np.float64).view(np.int64)
    return b ^ ((b >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))


def _key_float(k: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_float_key`."""
    k = np.ascontiguousarray(k, dtype=np.int64)
    return (k ^ ((k >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))).view(np.float64)


def _scan_points(a: float, b: float, cells: int) -> np.ndarray:
    c = JUMP_SCAN_CORE
    if b - a <= 4.0 * c or b <= -c or a >= c:
        return np.linspace(a, b, cells + 1)
    lo, hi = max(a, -c), min(b, c)
    parts = [np.linspace(lo, hi, cells + 1)]
    if a < lo:
        parts.insert(0, np.linspace(a, lo, cells + 1)[:-1])
    if hi < b:
        parts.append(np.linspace(hi, b, cells + 1)[1:])
    return np.concatenate(parts)


def find_jumps(df: Callable[[np.ndarray], np.ndarray], a: float, b: float, *,
               cells: int = JUMP_SCAN_CELLS) -> tuple[float, ...]:
    """Jump discontinuities of ``df`` (``f'``) inside ``(a, b)``, located to float64 precision.

    ``df`` is sampled on ``cells`` uniform cells (and as many on ``[-32, 32]`` when
    ``(a, b)`` is much wider); a cell whose change of ``df`` is far larger than its
    neighbours' on one side is a candidate. Each candidate is bisected on ``df`` itself down
    to two adjacent float64 numbers ``lo < hi`` (keeping the half that changes more); it is
    a jump when ``df`` still changes there by a quarter of the cell's change (and by
    ``1e-9 * max |df|``): a smooth steep ``df`` changes by ``f'' * ulp`` there, and is no
    jump. Jumps closer together than a scan cell whose changes cancel are not seen.

    Args:
        df: ``df(x)`` float64 for a float64 array ``x`` (any length); non-finite values are
            ignored (they are reported where ``f'`` is integrated).
        a, b: the interval, ``a < b``, finite.
        cells: scan cells.

    Returns:
        The jumps, sorted: each is ``lo``, the last float64 number at which ``df`` has its
        value from the left (a table border there gives ``x <= lo`` the left piece, as at
        runtime), strictly inside ``(a, b)``.
    """
    x = _scan_points(float(a), float(b), int(cells))
    g = np.asarray(df(x), dtype=np.float64)
    finite = np.isfinite(g)
    if not finite.any():
        return ()
    floor = _JUMP_FLOOR * float(np.max(np.abs(g[finite])))
    if not floor > 0:
        return ()
    d = np.abs(np.diff(g))
    ok = np.isfinite(d)
    dp = np.r_[np.inf, np.inf, np.where(ok, d, np.inf), np.inf, np.inf]
    left = np.maximum(dp[1:-3], dp[:-4])
    right = np.maximum(dp[3:-1], dp[4:])
    ref = np.minimum(left, right)  # the change of f' a cell would have without a jump
    i = np.flatnonzero(ok & (d > floor) & (d > _JUMP_RATIO * ref))
    lo, hi, glo, ghi, rf = x[i], x[i + 1], g[i], g[i + 1], ref[i]
    found: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for _ in range(_JUMP_ROUNDS):
        if lo.size == 0:
            break
        need = np.maximum(floor, 0.25 * np.abs(ghi - glo))
        klo, khi = _float_key(lo), _float_key(hi)
        blo, bhi, gl, gh = klo.copy(), khi.copy(), glo.copy(), ghi.copy()
        while True:
            act = np.flatnonzero(bhi > blo + 1)
            if act.size == 0:
                break
            kl, kh = blo[act], bhi[act]
            km = (kl >> 1) + (kh >> 1) + (kl & kh & 1)  # floor((kl + kh) / 2) without overflow
            gm = np.asarray(df(_key_float(km)), dtype=np.float64)
            to_left = np.abs(gm - gl[act]) >= np.abs(gh[act] - gm)
            nl, nr = act[to_left], act[~to_left]
            bhi[nl], gh[nl] = km[to_left], gm[to_left]
            blo[nr], gl[nr] = km[~to_left], gm[~to_left]
        jump = np.abs(gh - gl)
        real = np.isfinite(jump) & (jump >= need)
        found.append(_key_float(blo[real]))
        sizes.append(jump[real])
        # what is left of a cell beside its jump may hold another
        xl, xh = _key_float(blo[real]), _key_float(bhi[real])
        sides = [(lo[real], xl, glo[real], gl[real]), (xh, hi[real], gh[real], ghi[real])]
        nxt = [np.concatenate(v) for v in zip(*sides)]
        r2 = np.r_[rf[real], rf[real]]
        ch = np.abs(nxt[3] - nxt[2])
        more = (nxt[1] > nxt[0]) & np.isfinite(ch) & (ch > floor) & (ch > _JUMP_RATIO * r2)
        lo, hi, glo, ghi, rf = nxt[0][more], nxt[1][more], nxt[2][more], nxt[3][more], r2[more]
    if not found:
        return ()
    ks, js = np.concatenate(found), np.concatenate(sizes)
    inside = (ks > a) & (ks < b)
    ks, js = ks[inside], js[inside]
    order = np.argsort(ks, kind="stable")
    ks, js = ks[order], js[order]
    # a transition over a few float64 numbers (a sigmoid of slope 1e16) is one jump: of
    # points within 64 ulps of each other, the largest jump stands for them all
    out: list[float] = []
    best = -1.0
    for k, j in zip(ks.tolist(), js.tolist()):
        if out and k - out[-1] <= 64.0 * np.spacing(abs(k)) + 64.0 * np.spacing(0.0):
            if j > best:
                out[-1], best = k, j
            continue
        out.append(k)
        best = j
    return tuple(out)


def _jump_finder(df_impl: Callable[[np.ndarray, Mapping[str, float]], np.ndarray]):
    """``kink_finder`` of a user function: :func:`find_jumps` of its ``f'``, once per
    (params, interval)."""
    cache: dict[tuple, tuple] = {}

    def finder(params: Mapping[str, float], a: float, b: float) -> tuple[float, ...]:
        key = (tuple(sorted(params.items())), float(a), float(b))
        if key not in cache:
            cache[key] = find_jumps(lambda x: df_impl(x, params), a, b)
        return cache[key]

    return finder


def _load_user(spec: str) -> SolverFunction:
    fn = import_callable(spec)
    defaults = callable_params(fn)  # fn(input, a=1.5): parameter a, default 1.5
    forward = forward_callable(fn)  # its int arguments as ints

    import torch

    def call(x: np.ndarray, p: Mapping[str, float]):
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64).reshape(-1))
        x0 = xt.clone()
        try:
            y = forward(xt, **p)
        except Exception as exc:
            raise ValueError(f"fn: {spec!r} failed on a float64 tensor ({type(exc).__name__}: {exc})") from None
        if not torch.equal(xt.nan_to_num(), x0.nan_to_num()):
            raise ValueError(f"fn: {spec!r} modified its input in place; give the out-of-place function "
                             "(fewbit's in-place forms write the result themselves)")
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"fn: {spec!r} must return a torch.Tensor, got {type(y).__name__}")
        if not y.is_floating_point():
            raise ValueError(f"fn: {spec!r} must return a floating-point tensor, got dtype {y.dtype}")
        if tuple(y.shape) != tuple(xt.shape):
            raise ValueError(
                f"fn: {spec!r} must be elementwise; input shape {tuple(xt.shape)} gave output shape {tuple(y.shape)}"
            )
        return y

    def f_impl(x, p):
        with torch.no_grad():
            y = call(x, p)
        return y.detach().to(torch.float64).numpy().reshape(np.shape(x))

    def df_impl(x, p):
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64).reshape(-1)).clone().requires_grad_(True)
        with torch.enable_grad():
            try:
                y = forward(xt, **p)
            except Exception as exc:
                raise ValueError(f"fn: {spec!r} failed on a float64 tensor ({type(exc).__name__}: {exc})") from None
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(xt.shape):
                raise ValueError(f"fn: {spec!r} must be elementwise and return a tensor of the input's shape")
            if not y.requires_grad:  # a table of zeros would stand for "no gradient" silently
                raise ValueError(f"fn: {spec!r} returns a tensor that does not depend on its input through "
                                 "autograd (detach(), .numpy() or integer ops?): torch gives it no gradient to fit")
            (g,) = torch.autograd.grad(y, xt, torch.ones_like(y), allow_unused=True)
        if g is None:
            return np.zeros(np.shape(x))
        return g.detach().to(torch.float64).numpy().reshape(np.shape(x))

    # Probe: the function must keep shape and act elementwise: a permutation commutes, and a
    # part of the input gives that part of the output (x * x.mean() commutes with every
    # permutation; its table fitted to an error of ~0 and its backward was silently wrong)
    probe = np.linspace(-3.0, 3.0, 13)
    y = f_impl(probe, defaults)
    perm = np.random.default_rng(0).permutation(probe.size)
    # (two parts: the first holds the probe's min and largest |x|, the middle neither, so a
    # reduction by min, max or abs().max() also shows)
    for what, got, want in (("permuting the input", f_impl(probe[perm], defaults), y[perm]),
                            ("a part of the input", f_impl(probe[:5], defaults), y[:5]),
                            ("a part of the input", f_impl(probe[4:9], defaults), y[4:9])):
        both = np.isfinite(want) & np.isfinite(got)
        if not np.allclose(want[both], got[both], rtol=1e-12, atol=1e-12):
            raise ValueError(f"fn: {spec!r} is not elementwise ({what} changes the values)")
    return SolverFunction(
        name=spec,
        f_impl=f_impl,
        df_impl=df_impl,
        defaults=defaults,
        even=False,
        torch_fn=fn,
        stepwise=False,
        user=True,
        kink_finder=_jump_finder(df_impl),
    )


def get(name_or_spec: str) -> SolverFunction:
    """The solver function for a registry name, an alias, or ``"package.module:callable"``.

    A Hugging Face formula name (``"gelu_new"``, ``"gelu_fast"``, ...) gives the function
    whose tables it shares (``gelu_tanh``): a formula has no tables of its own.

    Args:
        name_or_spec: ``"gelu"``, ``"swish"`` (alias), or a user spec such as
            ``"mypkg.acts:my_gelu"`` naming a torch elementwise function.

    Returns:
        SolverFunction: with float64 ``f``, ``df`` and ``kinks``.

    Raises:
        TypeError: if ``name_or_spec`` is not a string.
        ValueError: for an unknown name; for a user spec whose module does not import,
            attribute is missing or not callable, or whose output changes shape.
    """
    if not isinstance(name_or_spec, str):
        raise TypeError(f"fn must be a str (name or 'module:callable'), got {type(name_or_spec).__name__}")
    if ":" in name_or_spec:
        # a user function is looked up again each time: a module re-imported since (an edited
        # function) must not be fitted through the callable of its first import
        cached = _CACHE.get(name_or_spec)
        if cached is not None and cached.torch_fn is import_callable(name_or_spec):
            return cached
        sf = _load_user(name_or_spec)
    elif name_or_spec in _CACHE:
        return _CACHE[name_or_spec]
    else:
        sf = _from_registry(name_or_spec)
    _CACHE[name_or_spec] = sf
    return sf


def is_even(sf: SolverFunction, params: Mapping[str, float], extent: float) -> bool:
    """Whether ``f'`` is even: the registry flag, or (user functions) a numerical check on ``[-extent, extent]``."""
    if not sf.user:
        return sf.even
    x = np.linspace(0.0, extent, 2001)
    a, b = sf.df_impl(x, params), sf.df_impl(-x, params)
    scale = max(1.0, float(np.max(np.abs(a))))
    return bool(np.all(np.isfinite(a)) and np.max(np.abs(a - b)) <= 1e-9 * scale)
