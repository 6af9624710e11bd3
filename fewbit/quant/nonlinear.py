"""Calls whose backward is not linear in what they save (docs/compression.md §1).

The compressor's pack hook sees a saved tensor and the op that *produced* it, never the op
that *saves* it. An unbiased quantizer keeps a gradient unbiased only where backward is
linear in the saved tensor (a Linear's weight gradient ``gᵀ x``). Where it is not, the
quantization variance becomes a bias:

- a step function of it: ReLU's backward ``g · [y > 0]`` from its saved result. A small
  positive ``y`` rounds to 0 with probability ``1 − y / step``, and its gradient is
  dropped: on ``Linear(64, 256) → F.relu → Linear(256, 64)`` under
  ``fewbit.compress_activations(2)``, the mean of 200 draws of the whole gradient was off by
  12 % of its norm, 8× its standard error (``leaky_relu``: 9 %);
- a smooth nonlinear function of it: GELU's ``g · Φ'(x)`` and SiLU's from their saved input
  (4 % on the same model), ``x ** 3``'s ``3 x² g`` (GPT-2's Python GELU), ``log``, ``abs``,
  ``clamp``, a division's ``g / d``, ``std``, norms, ``logsumexp``, most losses.

While a compressor is active, :class:`~fewbit.quant.mode.CompressionMode` looks each torch
function call up here:

- **stepwise activations** (:data:`STEPWISE`: ``relu``, ``leaky_relu``, ``relu6``,
  ``hardtanh``, ``threshold``, ``hardshrink``, ``softshrink``, ``hardsigmoid``, as functions,
  tensor methods or in place) go to :mod:`fewbit.functional`'s exact 1-bit versions: the
  same forward and gradient bit for bit, and 1 bit per element kept instead of the result;
- the **others** (:data:`KEEP`) run with the compressor keeping what they save exact
  (reason ``nonlinear`` in :class:`~fewbit.quant.CompressionStats`); a later save of the same
  tensor (the next Linear's input) reuses that exact tensor instead of adding a quantized
  copy. To save memory on GELU, SiLU and the other smooth activations, use their
  :mod:`fewbit` modules (``fewbit.convert_`` replaces them), which keep a few-bit code;
- **normalization functions** (``layer_norm``, ``rms_norm``, ``group_norm``,
  ``instance_norm``) tell the compressor their normalized size, as ``fewbit.convert_`` does
  for norm modules, so that a bare ``fewbit.compress_activations`` block also gets groups
  inside each normalized row (``Compressor.within``).

Calls that the pack hook would not compress anyway (grad disabled, no floating input that
requires grad, a stepwise activation of fewer than ``min_numel`` elements) go to torch
unchanged. Under ``torch.compile`` the mode stands aside (a compiled graph saves its own
tensors, which the compressor keeps exact).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
import torch.nn.functional as F

from fewbit import _norm_rows
from fewbit._activation_calls import CALLS, STEPWISE_NAMES, bind, plain_input, run

__all__ = ["STEPWISE", "KEEP", "NORMS", "reroute", "reroute_aten", "aten_kept"]

#: Marks "not handled here" (the caller runs ``func`` itself).
NOT_HANDLED = object()

# ------------------------------------------------------------------------- stepwise activations

#: torch callables of the stepwise activations -> (:mod:`fewbit.functional` name, in place)
#: (the stepwise part of :data:`fewbit._activation_calls.CALLS`).
STEPWISE: dict[Callable, tuple[str, bool]] = {f: v for f, v in CALLS.items() if v[0] in STEPWISE_NAMES}


# ------------------------------------------------------------------------------ kept exact

_KEEP_NAMES = (
    # smooth activations (fewbit has few-bit modules for them; functional calls keep x)
    "gelu", "silu", "mish", "softplus", "elu", "celu", "selu", "logsigmoid", "log_sigmoid",
    "hardswish", "tanhshrink", "softsign", "glu", "prelu", "rrelu", "softmin",
    # pointwise math
    "log", "log1p", "log2", "log10", "xlogy", "logit", "sin", "cos", "tan", "asin", "acos",
    "atan", "arcsin", "arccos", "arctan", "sinh", "cosh", "asinh", "acosh", "atanh", "arcsinh",
    "arccosh", "arctanh", "atan2", "arctan2", "hypot", "erf", "erfc", "erfinv", "lgamma",
    "digamma", "polygamma", "mvlgamma", "sinc", "abs", "absolute", "clamp", "clip", "clamp_min",
    "clamp_max", "maximum", "minimum", "fmax", "fmin", "max", "min", "amax", "amin", "aminmax",
    "div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__rdiv__", "__itruediv__",
    "__idiv__", "pow", "__pow__", "__rpow__", "__ipow__", "float_power",
    "logaddexp", "logaddexp2", "remainder", "__mod__", "__rmod__", "fmod", "copysign",
    # special functions (torch.special)
    "ndtr", "ndtri", "log_ndtr", "i0", "i0e", "i1", "i1e", "entr", "erfcx", "xlog1py", "gammaln",
    "multigammaln", "psi", "zeta",
    # linear algebra whose backward is not linear in what it saves
    "inverse", "inv", "inv_ex", "det", "logdet", "slogdet", "solve", "solve_ex", "cholesky",
    "cholesky_ex", "pinv", "matrix_exp", "matrix_power", "eigh", "eigvalsh", "svd", "svdvals", "qr",
    "solve_triangular", "triangular_solve", "cholesky_solve", "cholesky_inverse", "lstsq", "lu",
    "lu_factor", "lu_factor_ex", "lu_solve", "ldl_factor", "ldl_factor_ex", "ldl_solve",
    "householder_product", "ormqr", "geqrf", "tensorinv", "tensorsolve", "cond", "eig", "eigvals",
    # a division by a saved tensor
    "addcdiv",
    # recurrent layers with a relu inside one C++ call (nn.RNN / nn.RNNCell(nonlinearity="relu"):
    # relu's g [y > 0] from its saved result; 52 % of an RNN's gradient norm off at 2 bits)
    "rnn_relu", "rnn_relu_cell",
    # reductions
    "std", "std_mean", "norm", "vector_norm", "matrix_norm", "nuclear_norm", "renorm", "dist", "cdist",
    "pdist", "logsumexp", "logcumsumexp", "cumprod", "prod", "normalize", "cosine_similarity",
    "pairwise_distance",
    # a mask of the saved input equal to the saved result (``x == median``), or a division by
    # the saved input: on rounded copies the mask is empty (a zero gradient, or 0/0 = NaN for
    # scatter_reduce's amax/amin); their "sum" and "mean" reductions are linear (_linear_reduce)
    "median", "nanmedian", "scatter_reduce", "index_reduce", "segment_reduce",
    # a mask of the saved input's NaNs (a group holding a NaN decodes to NaN as a whole)
    "nansum", "nanmean", "nan_to_num",
    # losses
    "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "gaussian_nll_loss",
    "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "cosine_embedding_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss", "ctc_loss", "grid_sample",
)
_POW = frozenset({"pow", "__pow__", "__ipow__", "float_power"})


def _keep_entries() -> dict[Callable, str]:
    out: dict[Callable, str] = {}
    owners = (F, torch, torch.Tensor, torch.special, torch.linalg, torch._C._nn, torch._C._special,
              torch._C._linalg)
    for name in _KEEP_NAMES:
        for owner in owners:
            for n in (name, name + "_"):
                f = getattr(owner, n, None)
                if callable(f) and f not in STEPWISE:
                    out.setdefault(f, name)
    return out


#: torch callables whose saved tensors are kept exact -> their name.
KEEP: dict[Callable, str] = _keep_entries()


#: aten op names (``torch.ops.aten.NAME``) whose saved tensors are kept exact: those of
#: :data:`KEEP` and the stepwise activations (called as aten ops they are not rerouted), the
#: attention kernels (fewbit's SDPA is not put in their place) and the norms (not grouped
#: inside rows here).
_ATEN_KEEP = frozenset(_KEEP_NAMES) | frozenset(STEPWISE_NAMES) | frozenset({
    "scaled_dot_product_attention", "scaled_dot_product_flash_attention",
    "scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_efficient_attention",
    "scaled_dot_product_cudnn_attention", "scaled_dot_product_fused_attention_overrideable",
    "efficient_attention_forward", "flash_attention_forward",
    "layer_norm", "native_layer_norm", "rms_norm", "fused_rms_norm", "group_norm", "native_group_norm",
    "instance_norm", "batch_norm", "native_batch_norm", "native_batch_norm_legit",
    "native_batch_norm_legit_functional", "native_batch_norm_legit_no_training", "batch_norm_impl_index",
})
#: Prefixes of aten names of torch.linalg / torch.special functions (``linalg_vector_norm``).
_ATEN_PREFIXES = ("linalg_", "special_")
_aten_kept: dict = {}


def aten_kept(func: Any) -> bool:
    """Whether ``func`` is an aten op (``torch.ops.aten.gelu``, ``torch.ops.aten.gelu.default``;
    the mode sees direct calls of them) whose backward is not linear in what it saves
    (:data:`_ATEN_KEEP`, by its name without leading underscores, :data:`_ATEN_PREFIXES`
    or a trailing in-place underscore). Cached per op."""
    known = _aten_kept.get(func)
    if known is None:
        packet = getattr(func, "overloadpacket", func)
        qualified = getattr(packet, "_qualified_op_name", "")
        ns, _, name = qualified.partition("::")
        name = name.strip("_")
        for prefix in _ATEN_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):].strip("_")
        known = ns == "aten" and name in _ATEN_KEEP
        _aten_kept[func] = known
    return known


#: Reductions whose backward is linear in what they save for these ``reduce`` arguments
#: (name -> position of ``reduce``, the same in the torch function, the tensor method and the
#: aten op).
_REDUCE_ARG = {"scatter_reduce": 4, "index_reduce": 4, "segment_reduce": 1}


def _linear_reduce(name: str, args: tuple, kwargs: dict) -> bool:
    """``scatter_reduce`` / ``index_reduce`` / ``segment_reduce`` with ``reduce`` "sum" or
    "mean": backward scatters or averages ``g``, linear in what it saves."""
    at = _REDUCE_ARG.get(name)
    if at is None:
        return False
    reduce = args[at] if len(args) > at else kwargs.get("reduce")
    return reduce in ("sum", "mean")


def _linear_power(name: str, args: tuple, kwargs: dict) -> bool:
    """``x ** e`` with a number ``e`` in {0, 1, 2}: backward ``e x^(e-1) g`` is linear in x."""
    if name not in _POW:
        return False
    e = args[1] if len(args) > 1 else kwargs.get("exponent", kwargs.get("other"))
    return isinstance(e, numbers.Real) and not isinstance(e, bool) and e in (0, 1, 2)


# ------------------------------------------------------------------------------ norms

def _layer_norm_size(args, kwargs):
    ns = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    if isinstance(ns, numbers.Integral):
        ns = (ns,)
    try:
        ns = tuple(int(s) for s in ns)
    except TypeError:
        return None
    return _norm_rows.layer_norm(ns, tuple(args[0].shape))


def _group_norm_size(args, kwargs):
    groups = args[1] if len(args) > 1 else kwargs.get("num_groups")
    if not isinstance(groups, numbers.Integral):
        return None
    return _norm_rows.group_norm(int(groups), tuple(args[0].shape))


def _instance_norm_size(args, kwargs):
    # F.instance_norm / torch.instance_norm(input, ..., use_input_stats, ...): with running
    # statistics (use_input_stats=False) an affine map of the input, nothing to do
    use_input_stats = args[5] if len(args) > 5 else kwargs.get("use_input_stats", True)
    return _norm_rows.instance_norm(tuple(args[0].shape)) if use_input_stats is not False else None


def _batch_norm_size(args, kwargs):
    # F.batch_norm(input, running_mean, running_var, weight, bias, training, ...) and
    # torch.batch_norm / torch.native_batch_norm(input, weight, bias, running_mean,
    # running_var, training, ...): on batch statistics, one channel plane
    # (fewbit.convert.normalization_size says why)
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    return _norm_rows.batch_norm(tuple(args[0].shape)) if training is True else None


def _native_group_norm_size(args, kwargs):
    # torch.native_group_norm(input, weight, bias, N, C, HxW, group, eps)
    groups = args[6] if len(args) > 6 else kwargs.get("group")
    if not isinstance(groups, numbers.Integral):
        return None
    return _norm_rows.group_norm(int(groups), tuple(args[0].shape))


#: normalization functions -> ``(size, per_sample)``: ``size(args, kwargs)`` gives the
#: elements per normalized row of their input (contiguous in C order), as
#: :func:`fewbit.convert.normalization_size` does for modules; ``per_sample``: statistics of
#: each sample's own row (LayerNorm, RMSNorm, GroupNorm, InstanceNorm), whose input the
#: compressor takes at :data:`fewbit.quant.compressor.RESULT_BITS`
#: (:meth:`~fewbit.quant.ActivationCompressor._within_norm` says why). Both the
#: ``torch.nn.functional`` functions and the ``torch`` ones they call (``torch.layer_norm``,
#: ``torch.native_layer_norm``, ... called directly: before, their input was grouped across
#: rows, as any other tensor).
NORMS: dict[Callable, tuple[Callable, bool]] = {
    f: (size, per_sample) for f, size, per_sample in (
        (F.layer_norm, _layer_norm_size, True),
        (torch.layer_norm, _layer_norm_size, True),
        (torch.native_layer_norm, _layer_norm_size, True),
        (getattr(F, "rms_norm", None), _layer_norm_size, True),
        (getattr(torch, "rms_norm", None), _layer_norm_size, True),
        (F.group_norm, _group_norm_size, True),
        (torch.group_norm, _group_norm_size, True),
        (torch.native_group_norm, _native_group_norm_size, True),
        (F.instance_norm, _instance_norm_size, True),
        (torch.instance_norm, _instance_norm_size, True),
        (F.batch_norm, _batch_norm_size, False),
        (torch.batch_norm, _batch_norm_size, False),
        (torch.native_batch_norm, _batch_norm_size, False),
    ) if f is not None
}


# ------------------------------------------------------------------------------ dispatch

def _grad_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def _any_grad_float(args: tuple, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if _grad_float(a) or (isinstance(a, (list, tuple)) and any(_grad_float(b) for b in a)):
            return True
    return False


def reroute(comp, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func(*args, **kwargs)`` as the active compressor ``comp`` must (module
    docstring), or return :data:`NOT_HANDLED` for calls not listed here."""
    step = STEPWISE.get(func)
    if step is not None:
        bound = bind(func, args, kwargs)
        if bound is not None and plain_input(bound["input"], comp.min_numel):
            return run(step[0], bound, 1)
        if bound is not None and plain_input(bound["input"]):
            return NOT_HANDLED  # below min_numel: the compressor keeps it exact anyway
        # torch's own call (parameters fewbit.functional refuses, a tensor subclass): its
        # backward is a mask of what it saves, so that stays exact
        return comp._keeping(func, args, kwargs) if _any_grad_float(args, kwargs) else NOT_HANDLED
    name = KEEP.get(func)
    if name is not None:
        if _linear_power(name, args, kwargs) or _linear_reduce(name, args, kwargs) or not _any_grad_float(args, kwargs):
            return NOT_HANDLED
        return comp._keeping(func, args, kwargs)
    norm = NORMS.get(func)
    if norm is not None and args and _grad_float(args[0]):
        size_of, per_sample = norm
        return comp._within_norm(size_of(args, kwargs), per_sample, args[0], func, args, kwargs)
    return NOT_HANDLED


def reroute_aten(comp, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A direct call of an aten op (``torch.ops.aten.gelu(x)``): kept exact if
    :func:`aten_kept`, else :data:`NOT_HANDLED`."""
    if aten_kept(func) and _any_grad_float(args, kwargs):
        name = getattr(getattr(func, "overloadpacket", func), "_qualified_op_name", "").partition("::")[2].strip("_")
        if not _linear_reduce(name, args, kwargs):
            return comp._keeping(func, args, kwargs)
    return NOT_HANDLED
