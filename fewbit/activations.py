"""The runtime's list of supported pointwise activations.

Each entry names the torch function that fewbit mirrors (forward is always exactly that
function), its default parameters, whether its derivative is even (the "parity" trick
of Novikov et al., ICML 2023, docs/method.md §2), and, for stepwise derivatives, the exact
1-bit table. The offline solver (``fewbit.solver.registry``) adds analytic float64
``f`` and ``f'`` for the same names; both use the names defined here.

:data:`FORMULAS` holds the Hugging Face Python formulas (``gelu_new``, ``gelu_fast``, ...)
that compute one of these functions with other roundings: a formula has no tables of its
own; it names the registry entry whose tables it uses (``Formula.table``), so backward
shares that entry's shipped tables while forward computes the formula bit for bit
(:class:`fewbit.modules.FormulaActivation`). :func:`get_activation` knows formula names
too, so ``fewbit.functional.activation(x, "gelu_new")`` and ``fewbit plot gelu_new`` work.

This module needs only torch and the standard library.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import struct
import types
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from fewbit.table import _FLOAT32_OVERFLOW, Table

__all__ = [
    "Activation",
    "ACTIVATIONS",
    "ALIASES",
    "get_activation",
    "table_activation",
    "Formula",
    "FORMULAS",
    "get_formula",
    "canonical_params",
    "checked_params",
    "check_table_params",
    "merge_params",
    "non_default_params",
    "exact_table",
    "import_callable",
]


def _below(x: float) -> float:
    """The largest float64 strictly below ``x``: a border that puts ``x`` itself to the right."""
    return math.nextafter(float(x), -math.inf)


def _relu_exact(p):
    return [0.0], [0, 1], [0.0, 1.0]


def _leaky_relu_exact(p):
    return [0.0], [0, 1], [float(p["negative_slope"]), 1.0]


def _hardtanh_like_exact(lo: float, hi: float, slope: float):
    # torch: grad where lo < x < hi, else 0 (both ends excluded).
    return [float(lo), _below(hi)], [0, 1, 0], [0.0, float(slope)]


def _hardtanh_exact(p):
    if not p["min_val"] < p["max_val"]:
        raise ValueError(f"max_val must be greater than min_val, got min_val={p['min_val']}, max_val={p['max_val']}")
    return _hardtanh_like_exact(p["min_val"], p["max_val"], 1.0)


def _relu6_exact(p):
    return _hardtanh_like_exact(0.0, 6.0, 1.0)


#: The slope torch's hardsigmoid backward uses: the float32 constant ``1.0f / 6.0f`` in
#: every dtype, float64 included (``hardsigmoid_backward_kernel`` in ATen's
#: ``native/cpu/Activation.cpp`` and ``native/cuda/ActivationHardsigmoidKernel.cu``:
#: ``scalar_t one_sixth(1.0f / 6.0f)``, resp. ``opmath_t``), i.e. 0.1666666716337204,
#: not float64 1/6. With it the exact table gives torch's gradient bit for bit.
HARDSIGMOID_SLOPE: float = struct.unpack("<f", struct.pack("<f", 1.0 / 6.0))[0]


def _hardsigmoid_exact(p):
    return _hardtanh_like_exact(-3.0, 3.0, HARDSIGMOID_SLOPE)


def _threshold_exact(p):
    # torch: grad where x > threshold, else 0.
    return [float(p["threshold"])], [0, 1], [0.0, 1.0]


def _shrink_exact(p):
    # torch hardshrink/softshrink backward: 0 where -lambd <= x <= lambd, grad elsewhere.
    lambd = float(p["lambd"])
    if lambd < 0:
        raise ValueError(f"lambd must be >= 0, got {lambd}")
    if lambd == 0:
        return [_below(0.0), 0.0], [1, 0, 1], [0.0, 1.0]
    return [_below(-lambd), lambd], [1, 0, 1], [0.0, 1.0]


@dataclass(frozen=True)
class Activation:
    """One supported activation.

    Args:
        name: registry name (``"gelu"``).
        torch_fn: ``torch_fn(input, **params) -> Tensor``, the exact forward.
        defaults: default parameters, in torch's names (``{"alpha": 1.0}``).
        even: whether ``f'`` is an even function (fit on ``[0, B]`` and mirror).
        exact: for stepwise derivatives, ``params -> (borders, codes, values)`` of the
            exact 1-bit table; ``None`` for smooth functions, which need a fitted table.
        module: the torch.nn module it replaces (``"GELU"``), or ``None``.
        table: for a Hugging Face formula (:data:`FORMULAS`), the registry entry whose
            tables it uses (``"gelu_tanh"``); ``None`` for a registry entry (its own).
    """

    name: str
    torch_fn: Callable[..., torch.Tensor]
    defaults: Mapping[str, float] = field(default_factory=dict)
    even: bool = False
    exact: Callable[[Mapping[str, float]], tuple] | None = None
    module: str | None = None
    table: str | None = None

    @property
    def stepwise(self) -> bool:
        """True when an exact 1-bit table exists (derivative takes at most 2 values)."""
        return self.exact is not None

    @property
    def default_bits(self) -> int:
        """1 for stepwise derivatives (exact), 3 otherwise."""
        return 1 if self.stepwise else 3


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# torch_fn is called as ``torch_fn(input, **params)`` with the parameters in torch's names,
# so torch's own functions serve where their keyword names are the parameters'.
ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in [
        Activation("gelu", lambda x: F.gelu(x), module="GELU"),
        Activation("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), module="GELU"),
        Activation("silu", F.silu, module="SiLU"),
        Activation("selu", F.selu, module="SELU"),
        Activation("elu", F.elu, {"alpha": 1.0}, module="ELU"),
        Activation("celu", F.celu, {"alpha": 1.0}, module="CELU"),
        Activation("mish", F.mish, module="Mish"),
        Activation("softplus", F.softplus, {"beta": 1.0, "threshold": 20.0}, module="Softplus"),
        Activation("sigmoid", torch.sigmoid, even=True, module="Sigmoid"),
        Activation("tanh", torch.tanh, even=True, module="Tanh"),
        Activation("logsigmoid", F.logsigmoid, module="LogSigmoid"),
        Activation("softsign", F.softsign, even=True, module="Softsign"),
        Activation("tanhshrink", F.tanhshrink, even=True, module="Tanhshrink"),
        Activation("hardswish", F.hardswish, module="Hardswish"),
        Activation("quick_gelu", _quick_gelu, module=None),
        # Stepwise derivatives: exact 1-bit tables, no fitting (docs/method.md §2).
        Activation("relu", F.relu, exact=_relu_exact, module="ReLU"),
        Activation("leaky_relu", F.leaky_relu, {"negative_slope": 0.01}, exact=_leaky_relu_exact, module="LeakyReLU"),
        Activation("relu6", F.relu6, exact=_relu6_exact, module="ReLU6"),
        Activation("hardtanh", F.hardtanh, {"min_val": -1.0, "max_val": 1.0}, exact=_hardtanh_exact, module="Hardtanh"),
        Activation("threshold", F.threshold, {"threshold": 0.0, "value": 0.0}, exact=_threshold_exact,
                   module="Threshold"),
        Activation("hardshrink", F.hardshrink, {"lambd": 0.5}, exact=_shrink_exact, module="Hardshrink"),
        Activation("softshrink", F.softshrink, {"lambd": 0.5}, exact=_shrink_exact, module="Softshrink"),
        Activation("hardsigmoid", F.hardsigmoid, exact=_hardsigmoid_exact, module="Hardsigmoid"),
    ]
}

#: Other names accepted for registry entries. An alias is the same function with the same
#: tables; forward is the entry's torch function (``gelu_pytorch_tanh`` is Hugging Face's
#: name for ``F.gelu(approximate='tanh')``). Hugging Face's ``gelu_new`` is not an alias but
#: a formula (:data:`FORMULAS`): it computes the same function with other roundings.
ALIASES: dict[str, str] = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


# --------------------------------------------------------------------------- formulas
# The Hugging Face ``transformers.activations`` Python formulas, written exactly as there
# (same operations, same order, same Python constants; 4.40 to 5.x), so that computing
# them gives HF's output bit for bit in every dtype.

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)  # AccurateGELUActivation.precomputed_constant


def gelu_new(input: torch.Tensor) -> torch.Tensor:
    """HF ``NewGELUActivation`` (``ACT2FN["gelu_new"]``, GPT-2):
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``."""
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def gelu_python_tanh(input: torch.Tensor) -> torch.Tensor:
    """HF ``GELUTanh(use_gelu_tanh_python=True)`` (``ACT2FN["gelu_python_tanh"]``):
    ``x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``."""
    return input * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def gelu_accurate(input: torch.Tensor) -> torch.Tensor:
    """HF ``AccurateGELUActivation`` (``ACT2FN["gelu_accurate"]``, MEGA), with its default
    ``precomputed_constant = sqrt(2 / pi)``."""
    return 0.5 * input * (1 + torch.tanh(_SQRT_2_OVER_PI * (input + 0.044715 * torch.pow(input, 3))))


def gelu_fast(input: torch.Tensor) -> torch.Tensor:
    """HF ``FastGELUActivation`` (``ACT2FN["gelu_fast"]``):
    ``0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))``."""
    return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))


def bloom_gelu(input: torch.Tensor) -> torch.Tensor:
    """HF ``BloomGelu`` (``transformers.models.bloom``; ``bloom_gelu_forward``, which its
    ``GeLUFunction`` also computes in training): ``x * 0.5 * (1 + tanh(0.79788456 * x *
    (1 + 0.044715 * x * x)))``."""
    return input * 0.5 * (1.0 + torch.tanh(0.79788456 * input * (1 + 0.044715 * input * input)))


def gelu_python(input: torch.Tensor) -> torch.Tensor:
    """HF ``GELUActivation(use_gelu_python=True)`` (``ACT2FN["gelu_python"]``):
    ``x * 0.5 * (1 + erf(x / sqrt(2)))``."""
    return input * 0.5 * (1.0 + torch.erf(input / math.sqrt(2.0)))


@dataclass(frozen=True)
class Formula:
    """A floating-point formula of a registry function, computed bit for bit.

    Hugging Face ``transformers`` writes some activations as Python formulas, e.g.
    ``NewGELUActivation`` (GPT-2). Each is mathematically one of the registry's functions
    (or, for ``gelu_fast``, within 1.1e-12 of one in ``f'``), but rounds differently from
    torch's fused kernel (``F.gelu(x, approximate='tanh')`` and the ``gelu_new`` formula
    differ in about 1 % of float32 elements, by up to 5e-7). :class:`fewbit.modules.FormulaActivation` computes ``torch_fn`` in
    forward, so outputs stay bit-identical to the Hugging Face module, and uses the fitted
    tables of the registry entry ``table`` in backward: no table is fitted or shipped for a
    formula. The tables approximate ``f'`` of ``table`` with the error shipped with them
    (docs/method.md §3); ``derivative_gap`` adds at most its value to ``|f' - q|``.

    Args:
        name: the Hugging Face ``ACT2FN`` name (``"gelu_new"``).
        torch_fn: ``torch_fn(input) -> Tensor``, a module-level function of this module
            (so that ``spec`` imports it): the formula exactly as Hugging Face writes it.
        table: the registry name whose tables backward uses (``"gelu_tanh"``).
        derivative_gap: ``sup_x |f'_formula(x) - f'_table(x)|`` in exact arithmetic:
            0 for the same mathematical function; for ``gelu_fast`` (constant
            ``0.7978845608`` instead of ``sqrt(2/pi) = 0.79788456080286536``) 1.1e-12,
            reached near ``x = -0.61``; for ``bloom_gelu`` (``0.79788456``) 3.1e-10, near
            ``x = 0.61``.
        source: the Hugging Face class (and arguments) that computes it.
    """

    name: str
    torch_fn: Callable[[torch.Tensor], torch.Tensor]
    table: str
    derivative_gap: float
    source: str

    @property
    def spec(self) -> str:
        """``"fewbit.activations:<function>"``: the formula as a ``"module:callable"`` name."""
        return f"{__name__}:{self.torch_fn.__name__}"

    @property
    def activation(self) -> Activation:
        """The formula as an :class:`Activation` (what :func:`get_activation` returns for
        its name): forward ``torch_fn``, no parameters, the tables of ``table``."""
        return Activation(self.name, self.torch_fn, even=ACTIVATIONS[self.table].even, table=self.table)


#: Hugging Face formulas by their ``ACT2FN`` name; backward uses the tables of ``table``.
FORMULAS: dict[str, Formula] = {
    f.name: f
    for f in [
        Formula("gelu_new", gelu_new, "gelu_tanh", 0.0, "NewGELUActivation"),
        Formula("gelu_python_tanh", gelu_python_tanh, "gelu_tanh", 0.0, "GELUTanh(use_gelu_tanh_python=True)"),
        Formula("gelu_accurate", gelu_accurate, "gelu_tanh", 0.0, "AccurateGELUActivation"),
        Formula("gelu_fast", gelu_fast, "gelu_tanh", 1.1e-12, "FastGELUActivation"),
        Formula("gelu_python", gelu_python, "gelu", 0.0, "GELUActivation(use_gelu_python=True)"),
        Formula("bloom_gelu", bloom_gelu, "gelu_tanh", 3.1e-10, "BloomGelu (transformers.models.bloom)"),
    ]
}


def get_formula(name: str) -> Formula:
    """Look up a :data:`FORMULAS` entry by its Hugging Face ``ACT2FN`` name.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if isinstance(name, str) and name in FORMULAS:
        return FORMULAS[name]
    raise ValueError(f"unknown formula {name!r} (known: {', '.join(sorted(FORMULAS))})")


def import_callable(spec: str) -> Callable[..., torch.Tensor]:
    """Import a user function given as ``"package.module:callable"`` (``callable`` may be dotted).

    Raises:
        ValueError: naming ``fn``, if the spec is malformed, the module does not import, the
            attribute is missing, or the object is not callable.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"fn: a user function must be given as 'package.module:callable', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while importing the module
        raise ValueError(f"fn: cannot import module {module_name!r} of {spec!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"fn: module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"fn: {spec!r} is not callable (got {type(obj).__name__})")
    return obj


def _number_defaults(fn: Callable[..., torch.Tensor]) -> Mapping[str, int | float]:
    """``fn``'s arguments after the first whose defaults are numbers, with those defaults
    (read-only; read once per hashable callable: the forward of a function with an int
    argument asks at every call)."""
    try:
        return _number_defaults_cached(fn)
    except TypeError:  # an unhashable callable
        return _read_number_defaults(fn)


@functools.lru_cache(maxsize=256)
def _number_defaults_cached(fn: Callable[..., torch.Tensor]) -> Mapping[str, int | float]:
    return _read_number_defaults(fn)


def _read_number_defaults(fn: Callable[..., torch.Tensor]) -> Mapping[str, int | float]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    out = {}
    for p in list(signature.parameters.values())[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        d = p.default
        if isinstance(d, numbers.Real) and not isinstance(d, bool) and math.isfinite(float(d)):
            out[p.name] = d
    return types.MappingProxyType(out)


def callable_params(fn: Callable[..., torch.Tensor]) -> dict[str, float]:
    """The parameters of a user function ``fn(input, **params)``: its arguments after the
    first whose defaults are numbers (``def my_act(x, a=1.5)`` takes ``a``, default 1.5),
    as floats (what tables are keyed by). Arguments without a default, with a non-number
    default (``inplace=False``, ``approximate="none"``) and ``*args``/``**kwargs`` are not
    table parameters; ``{}`` for a callable without an inspectable signature."""
    return {k: float(v) for k, v in _number_defaults(fn).items()}


@functools.lru_cache(maxsize=256)
def _int_caller(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def call(input, **params):
        return fn(input, **call_params(fn, params))

    return call


def forward_callable(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """What a user function's forward is called as, ``forward_callable(fn)(input, **params)``
    with float ``params``: ``fn`` itself, or for a function with an int default a wrapper
    that passes integral values of those arguments as ints (:func:`call_params`; the same
    wrapper object every time, so caches keyed by the callable keep hitting)."""
    if not any(isinstance(v, numbers.Integral) for v in _number_defaults(fn).values()):
        return fn
    try:
        return _int_caller(fn)
    except TypeError:  # an unhashable callable: by identity (a new wrapper per call grew the plan caches)
        hit = _UNHASHABLE_CALLERS.get(id(fn))
        if hit is None or hit[0] is not fn:
            if len(_UNHASHABLE_CALLERS) >= 256:
                _UNHASHABLE_CALLERS.pop(next(iter(_UNHASHABLE_CALLERS)))
            hit = _UNHASHABLE_CALLERS[id(fn)] = (fn, _int_caller.__wrapped__(fn))
        return hit[1]


#: id -> (callable, wrapper) of unhashable user functions (the callable held: its id stays its own).
_UNHASHABLE_CALLERS: dict[int, tuple] = {}


def call_params(fn: Callable[..., torch.Tensor], params: Mapping[str, float]) -> dict[str, int | float]:
    """``params`` (floats, :func:`callable_params`' names) as ``fn`` takes them: an integral
    value of an argument whose default is an int passed as an int (``def f(x, terms=3)``
    with ``range(terms)`` fails on 3.0)."""
    defaults = _number_defaults(fn)
    return {k: int(v) if isinstance(defaults.get(k), numbers.Integral) and float(v).is_integer() else v
            for k, v in params.items()}


_FORMULA_ACTIVATIONS: dict[str, Activation] = {name: f.activation for name, f in FORMULAS.items()}


def get_activation(name: str) -> Activation:
    """Look up an activation by registry name, alias, or Hugging Face formula name.

    A formula (``"gelu_new"``, ``"gelu_fast"``, ...; :data:`FORMULAS`) comes back as an
    :class:`Activation` whose ``torch_fn`` is the formula and whose ``table`` names the
    registry entry whose tables it uses (:func:`table_activation`).

    Raises:
        ValueError: for an unknown name, suggesting close matches.
    """
    key = ALIASES.get(name, name)
    if key in ACTIVATIONS:
        return ACTIVATIONS[key]
    if key in _FORMULA_ACTIVATIONS:
        return _FORMULA_ACTIVATIONS[key]
    known = sorted(ACTIVATIONS) + sorted(ALIASES) + sorted(FORMULAS)
    # case apart ("GELU", "Gelu": the class names), which difflib had missed or ranked last
    lowered = {k.lower(): k for k in reversed(known)}
    text = str(name)
    close = [lowered[c] for c in difflib.get_close_matches(text.lower(), list(lowered), n=3)]
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if "." in text and ":" not in text:  # a user's function named with a dot for the colon
        hint += "; a function of your own is named 'package.module:function'"
    raise ValueError(
        f"unknown activation {name!r}{hint} (known: {', '.join(sorted(ACTIVATIONS))}; "
        f"Hugging Face formulas: {', '.join(sorted(FORMULAS))})"
    )


def table_activation(name: str) -> Activation:
    """The registry entry whose tables ``name`` uses: the entry itself (or an alias's),
    or for a Hugging Face formula the entry it computes (``"gelu_fast"`` -> ``gelu_tanh``).

    Raises:
        ValueError: for an unknown name, as :func:`get_activation`.
    """
    act = get_activation(name)
    return ACTIVATIONS[act.table] if act.table is not None else act


def _celu_rule(p: Mapping[str, float]) -> None:
    # f'(x) = exp(x / alpha) for x <= 0: bounded by 1 for alpha > 0, but growing without
    # bound as x -> -inf for alpha < 0, which no table of 2**bits levels approximates (the
    # gradient would be silently wrong); torch itself refuses alpha = 0.
    if not p["alpha"] > 0:
        raise ValueError(f"params: alpha of celu must be > 0 (for alpha < 0 its derivative exp(x / alpha) "
                         f"is unbounded; alpha = 0 divides by zero), got {p['alpha']}")


def _level_scale_rule(key: str, name: str) -> Callable[[Mapping[str, float]], None]:
    """A rule for a parameter that scales the derivative (elu's ``alpha``: f' reaches
    ``alpha``; leaky_relu's ``negative_slope``): a table's levels are float32, so a value
    past float32's range has no table. Checked here, naming the parameter, not later by
    the table's own check at the first forward."""
    def rule(p: Mapping[str, float]) -> None:
        if not abs(p[key]) < _FLOAT32_OVERFLOW:
            raise ValueError(f"params: {key} of {name} must be within float32's range (|{key}| < 3.4e38: "
                             f"fewbit's tables are float32), got {p[key]!r}")
    return rule


def _softplus_rule(p: Mapping[str, float]) -> None:
    # softplus(x) = log(1 + exp(beta * x)) / beta: beta = 0 divides by zero
    if p["beta"] == 0:
        raise ValueError(f"params: beta of softplus must be nonzero, got {p['beta']}")


#: Rules on a function's parameters beyond "a finite number" (:func:`merge_params`):
#: registry name -> ``rule(full_params)`` raising ``ValueError``. Where a value torch takes
#: is refused here, fewbit has no table that gives its gradient.
PARAM_RULES: dict[str, Callable[[Mapping[str, float]], None]] = {
    "celu": _celu_rule,
    "softplus": _softplus_rule,
}

#: Rules on what a table can hold, checked where a table is made or a module built for
#: one (:func:`checked_params`, :func:`check_table_params`), not on forward-only calls
#: (a functional call without grad runs torch's function, as torch takes it).
TABLE_RULES: dict[str, Callable[[Mapping[str, float]], None]] = {
    "elu": _level_scale_rule("alpha", "elu"),
    "leaky_relu": _level_scale_rule("negative_slope", "leaky_relu"),
}


def check_table_params(name: str, full: Mapping[str, float]) -> None:
    """:data:`TABLE_RULES` of the registry function ``name`` on its full parameters.

    Raises:
        ValueError: naming the parameter, for a value past what a table holds.
    """
    rule = TABLE_RULES.get(name)
    if rule is not None:
        rule(full)


def merge_params(name: str, defaults: Mapping[str, float], params: Mapping[str, float] | None) -> dict[str, float]:
    """``params`` merged over ``defaults`` (values as float), for the function ``name``.

    Raises:
        TypeError: ``params`` is not a mapping, (name, value) pairs or None.
        ValueError: for a parameter the function does not take, a non-numeric or
            non-finite value, or a value :data:`PARAM_RULES` refuses (``celu``: alpha > 0;
            ``softplus``: beta != 0).
    """
    try:  # a mapping, or (name, value) pairs as dict() takes them
        params = {} if params is None else dict(params)
    except (TypeError, ValueError):
        raise TypeError(f"params must be a mapping of parameter names to numbers (e.g. {{'alpha': 0.5}}) or "
                        f"None, got {type(params).__name__} {params!r}") from None
    unknown = set(params) - set(defaults)
    if unknown:
        takes = f"parameters {', '.join(sorted(defaults))}" if defaults else "no parameters"
        raise ValueError(f"params: {name} takes {takes}; got {', '.join(sorted(unknown))}")
    out = {}
    for k, default in defaults.items():
        given = params.get(k, default)
        # a number (or a one-element real tensor), as torch takes (its nn.ELU(alpha='1')
        # raises): not a string or a bool, which float() would turn into one
        if isinstance(given, torch.Tensor):
            number = given.numel() == 1 and given.dtype != torch.bool and not given.is_complex()
        else:
            number = isinstance(given, numbers.Real) and not isinstance(given, bool)
        if not number:
            raise ValueError(f"params: {k} of {name} must be a number, got {given!r}")
        v = float(given)
        if torch.compiler.is_compiling():
            # torch.compile(dynamic=True) makes it a SymFloat, which math.isfinite cannot
            # trace (every module with a float parameter failed, h69): float.hex reads its
            # value, which specialises it, as torch's own modules hold theirs as constants
            v = float.fromhex(v.hex())
        if not math.isfinite(v):
            raise ValueError(f"params: {k} of {name} must be finite, got {v}")
        out[k] = v
    rule = PARAM_RULES.get(name)
    if rule is not None:
        rule(out)
    return out


def canonical_params(act: Activation, params: Mapping[str, float] | None) -> dict[str, float]:
    """Full parameter dict of ``act`` (defaults filled in, values as float).

    Raises:
        ValueError: for a parameter the activation does not take, or a non-finite value.
    """
    return merge_params(act.name, act.defaults, params)


def checked_params(name: str, params: Mapping[str, float] | None) -> dict[str, float]:
    """The full parameters of activation ``name`` if fewbit takes them (a table exists for
    them): :func:`canonical_params`, :data:`TABLE_RULES` (``elu``'s alpha and
    ``leaky_relu``'s negative_slope within float32's range) and, for a stepwise function,
    its exact table's rules (``hardtanh``'s ``min_val < max_val``, the shrinks' ``lambd >= 0``).

    Raises:
        ValueError: naming the parameter, for a value fewbit refuses (or an unknown name).
    """
    act = get_activation(name)
    full = canonical_params(act, params)
    check_table_params(act.name, full)
    if act.exact is not None:
        act.exact(full)
    return full


def non_default_params(act: Activation, params: Mapping[str, float] | None) -> dict[str, float]:
    """The parameters that differ from the defaults (empty dict for the default set)."""
    full = canonical_params(act, params)
    return {k: v for k, v in full.items() if v != float(act.defaults[k])}


def exact_table(name: str, params: Mapping[str, float] | None = None) -> Table:
    """The exact 1-bit table of a stepwise activation (error 0).

    Raises:
        ValueError: if ``name`` has no stepwise derivative.
    """
    act = get_activation(name)
    if act.exact is None:
        raise ValueError(f"{act.name} has no stepwise derivative; its tables must be fitted")
    full = canonical_params(act, params)
    borders, codes, values = act.exact(full)
    return Table(
        name=act.name,
        bits=1,
        borders=borders,
        codes=codes,
        values=values,
        error=0.0,
        params=non_default_params(act, full),
        weight="exact",
        provenance={"solver": "exact (stepwise derivative)"},
    )
