"""Triton kernels (CUDA backend) for the few-bit encode and decode-multiply ops.

Imported lazily by the ``cuda`` kernels of ``fewbit::encode`` / ``fewbit::decode_mul``
(never at ``import fewbit``). Each program handles ``BLOCK`` groups of 8 elements; a
group's 8 codes are summed into one 64-bit word at bit offsets ``k * BITS`` (disjoint
fields, so the sum is an OR) and its low ``BITS`` bytes are stored: the little-endian
stream of docs/method.md §6. All offsets are int64, so tensors of 2**31 elements or more
index correctly. The kernels also run on CPU tensors under ``TRITON_INTERPRET=1``
(tests use that; use a large ``block`` there, the interpreter is slow per program).

Bit-exactness with the CPU kernels: comparisons are exact (no arithmetic on x); the
backward is one multiply (no FMA possible) followed by a round-to-nearest-even cast.

Non-finite inputs (fewbit.ops._nonfinite): the encoder appends them to a fixed-capacity
record with one atomic add per program that found any (``_record_nonfinite``, callable
from any kernel that has ``x`` loaded); the decoder's programs read the record's count
and patch the listed elements of their own range after their main store. Neither syncs
with the host.
"""

# No ``from __future__ import annotations``: the interpreter of triton 3.0/3.1 recognises
# ``tl.constexpr`` parameters only from evaluated annotations, not from strings.
import contextlib
from typing import Optional

import torch
from torch.library import triton_op
from torch.library import wrap_triton as _torch_wrap_triton

from fewbit._checks import packed_nbytes

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise NotImplementedError(
        "fewbit's CUDA kernels need Triton (pip install 'triton>=3.0'); "
        f"importing it failed: {exc}"
    ) from exc

try:  # triton >= 3.1 dispatches libdevice to the backend; 3.0 has only the CUDA module
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the triton version
    from triton.language.extra.cuda import libdevice

__all__ = [
    "encode_triton", "encode_nonfinite_triton", "decode_mul_triton", "forward_encode_triton", "FUSED_FORWARD",
    "FUSED_EAGER",
    "default_block",
]


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` (torch.compile sees the launch), or ``kernel``
    itself when it is the interpreter's (``TRITON_INTERPRET=1``), which torch 2.11 refuses
    with a RuntimeError and later versions pass through unchanged."""
    if _InterpretedFunction is not None and isinstance(kernel, _InterpretedFunction):
        return kernel
    return _torch_wrap_triton(kernel)


def on_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device the current one for a launch, or a null
    context when it already is (or ``t`` is not on a CUDA device). Triton launches on the
    current device and its current stream: a tensor on ``cuda:1`` with ``cuda:0`` current
    (a model spread over GPUs in one process) had its kernel run on device 0 against device
    1's memory (h74; read from Triton's launcher, not run: no two-GPU machine here)."""
    if t.device.type != "cuda" or t.device.index is None or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _launcher(kernel, traceable: bool):
    """What launches ``kernel``: :func:`wrap_triton` of it where a trace may be recording
    (the ``triton_op`` bodies: torch turns the wrapper off for their eager calls itself),
    the kernel itself for the eager node's calls (``traceable=False``, real tensors only).
    Outside a ``triton_op`` torch's wrapper is on in eager code too, and each launch
    through it goes through the ``triton_kernel_wrapper_mutation`` operator (about 110 of
    the 160 µs of host time of an eager GELU forward on the CI VM, Triton's launch stubbed
    out) and adds an entry to torch's kernel side table that is never freed (host memory
    growing with every step). The eager node passes only plain tensors, with no dispatch
    mode active (``fewbit.ops._pointwise._plain``)."""
    return wrap_triton(kernel) if traceable else kernel


try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - depends on the triton version
    _InterpretedFunction = None


@triton.jit
def _widen(v, IS_F64: tl.constexpr):
    """``v`` in the compute dtype (float64 for float64, else float32), exactly. bfloat16
    is widened by its bits: the interpreter's bfloat16 cast flushes subnormals."""
    if IS_F64:
        w = v.to(tl.float64)
    elif v.dtype == tl.bfloat16:
        w = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        w = v.to(tl.float32)
    return w


@triton.jit
def _groups(BLOCK: tl.constexpr):
    """This program's ``BLOCK`` groups of 8 elements: the group indices ``(BLOCK,)`` and the
    flat element indices ``(BLOCK, 8)``, int64 (tensors of 2**31 elements or more)."""
    grp = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return grp, grp[:, None] * 8 + tl.arange(0, 8)[None, :].to(tl.int64)


@triton.jit
def _pack_store(code, grp, out_ptr, n, BITS: tl.constexpr):
    """Store the codes ``(BLOCK, 8)`` (0 past ``n``) of the groups ``grp`` in the stream of
    docs/method.md §6 (:func:`fewbit.packing.pack_reference`): the 8 codes of a group
    summed into one 64-bit word at bit offsets ``k * BITS`` (disjoint fields: the sum is
    an OR), and its low ``BITS`` bytes stored. Shared by every Triton encoder in fewbit."""
    k = tl.arange(0, 8)
    word = tl.sum(code.to(tl.uint64) << (k * BITS).to(tl.uint64)[None, :], axis=1)
    byte = ((word[:, None] >> (k * 8).to(tl.uint64)[None, :]) & 0xFF).to(tl.uint8)
    bidx = grp[:, None] * BITS + k[None, :].to(tl.int64)
    nbytes = (tl.cast(n, tl.int64) * BITS + 7) // 8  # int64: n * BITS passes 2**31 from n = 2**28 (8 bits)
    tl.store(out_ptr + bidx, byte, mask=(k[None, :] < BITS) & (bidx < nbytes))


@triton.jit
def _load_unpack(packed_ptr, grp, n, BITS: tl.constexpr):
    """The codes ``(BLOCK, 8)`` int32 of the groups ``grp``: the inverse of :func:`_pack_store`
    (:func:`fewbit.packing.unpack_reference`); bytes past the stream read as 0."""
    k = tl.arange(0, 8)
    bidx = grp[:, None] * BITS + k[None, :].to(tl.int64)
    nbytes = (tl.cast(n, tl.int64) * BITS + 7) // 8  # int64: n * BITS passes 2**31 from n = 2**28 (8 bits)
    byte = tl.load(packed_ptr + bidx, mask=(k[None, :] < BITS) & (bidx < nbytes), other=0)
    word = tl.sum(byte.to(tl.uint64) << (k * 8).to(tl.uint64)[None, :], axis=1)
    return ((word[:, None] >> (k * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _record_nonfinite(xc, idx, valid, rec_ptr, cap, CLASSES: tl.constexpr, NUMEL: tl.constexpr):
    """Append the non-finite elements of a tile to the record (fewbit.ops._nonfinite).

    ``xc``/``idx``/``valid``: a tile of inputs (any float dtype), their flat int64
    indices and the in-range mask, ``NUMEL`` elements in all. Elements whose class is in
    the mask ``CLASSES`` are compacted (exclusive prefix sum) behind one atomic add on
    ``rec_ptr[0]`` per program that found any; entries ``index << 2 | class`` go to
    ``rec_ptr[1 + pos]`` for ``pos < cap``, the count goes on past ``cap``. Kept separate
    so that any kernel that has ``x`` loaded (a fused forward) can call it.
    """
    isn = xc != xc
    pinf = xc == float("inf")
    ninf = xc == float("-inf")
    bit = tl.where(isn, 1, tl.where(pinf, 2, tl.where(ninf, 4, 0)))
    keep = (valid & ((bit & CLASSES) != 0)).to(tl.int32)
    flat = tl.reshape(keep, [NUMEL])
    cnt = tl.sum(flat, axis=0)
    if cnt > 0:
        base = tl.atomic_add(rec_ptr, cnt.to(tl.int64))
        pos = base + (tl.cumsum(flat, axis=0) - flat).to(tl.int64)
        cls = tl.where(isn, 0, tl.where(pinf, 1, 2)).to(tl.int64)
        ent = (tl.reshape(idx, [NUMEL]) << 2) | tl.reshape(cls, [NUMEL])
        tl.store(rec_ptr + 1 + pos, ent, mask=(flat != 0) & (pos < cap))


@triton.jit
def _interval_codes(xc, borders_ptr, codes_ptr, NB: tl.constexpr):
    """The code of each element of ``xc`` (compare dtype, exact): ``codes[i]`` with ``i`` the
    number of borders ``b`` with ``not (x <= b)`` (docs/method.md §2; NaN counts as above
    every border: the last interval, as ``searchsorted``)."""
    prev = tl.load(codes_ptr).to(tl.int32)
    code = tl.zeros(xc.shape, dtype=tl.int32) + prev
    for j in range(NB):
        b = tl.load(borders_ptr + j)
        nxt = tl.load(codes_ptr + j + 1).to(tl.int32)
        code += tl.where(xc <= b, 0, nxt - prev)
        prev = nxt
    return code


@triton.jit
def _store_rounded(out_ptr, offs, prod, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        # Round to nearest even by hand (the interpreter's cast truncates); NaN -> 0x7FC0.
        u = prod.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        res = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        res = prod.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, res, mask=mask)


@triton.jit
def _patch_nonfinite(
    g_ptr, out_ptr, rec_ptr, patch_ptr, cnt, lo, hi,
    IS_F64: tl.constexpr, OUT_BF16: tl.constexpr, PB: tl.constexpr, N_PB: tl.constexpr,
):
    """Give the recorded elements in ``[lo, hi)`` torch's gradient (the patch rows of
    fewbit.ops._nonfinite), ``PB`` record entries at a time, ``N_PB`` times (enough for the
    record's capacity; entries past ``cnt`` are masked). The trip count is a constexpr: the
    interpreters of triton <= 3.6 fail on a loop bound read at run time with numpy >= 2.4
    (``int()`` of a 1-element array)."""
    for it in range(N_PB):
        j = it * PB + tl.arange(0, PB).to(tl.int64)
        m = j < cnt
        e = tl.load(rec_ptr + 1 + j, mask=m, other=0)
        i = e >> 2
        own = m & (i >= lo) & (i < hi)
        row = patch_ptr + (e & 3) * 8
        g = _widen(tl.load(g_ptr + i, mask=own, other=0.0), IS_F64)
        if IS_F64:
            neg = g.to(tl.int64, bitcast=True) < 0
        else:
            neg = g.to(tl.int32, bitcast=True) < 0
        mode = tl.load(row, mask=own, other=0.0)
        d = tl.load(row + 1, mask=own, other=0.0)
        d2 = tl.load(row + 7, mask=own, other=1.0)
        r = tl.where(mode != 0, d, (g * d) * d2)
        r = tl.where(g == 0, tl.where(neg, tl.load(row + 6, mask=own, other=0.0),
                                      tl.load(row + 5, mask=own, other=0.0)), r)
        r = tl.where(g == float("-inf"), tl.load(row + 4, mask=own, other=0.0), r)
        r = tl.where(g == float("inf"), tl.load(row + 3, mask=own, other=0.0), r)
        r = tl.where(g != g, tl.load(row + 2, mask=own, other=0.0), r)
        _store_rounded(out_ptr, i, r, own, OUT_BF16)


@triton.jit
def _decode_mul_kernel(
    g_ptr,
    packed_ptr,
    values_ptr,
    out_ptr,
    rec_ptr,
    patch_ptr,
    n,
    cap,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
    HAS_REC: tl.constexpr,
    SELECT_ZERO: tl.constexpr,
    PB: tl.constexpr,
    N_PB: tl.constexpr,
):
    grp, idx = _groups(BLOCK)
    code = _load_unpack(packed_ptr, grp, n, BITS)
    valid = idx < n
    v = tl.load(values_ptr + code, mask=valid, other=0.0)
    prod = _widen(tl.load(g_ptr + idx, mask=valid, other=0.0), IS_F64) * v
    if SELECT_ZERO:
        prod = tl.where(v == 0, 0.0, prod)
    if HAS_REC:
        cnt = tl.load(rec_ptr)  # normally 0: one scalar load per program
        prod = tl.where(cnt > cap, float("nan"), prod)  # past capacity: all NaN
    _store_rounded(out_ptr, idx, prod, valid, OUT_BF16)
    if HAS_REC:
        if (cnt > 0) & (cnt <= cap):
            tl.debug_barrier()  # the patch overwrites elements this program just stored
            lo = tl.program_id(0).to(tl.int64) * BLOCK * 8
            _patch_nonfinite(g_ptr, out_ptr, rec_ptr, patch_ptr, cnt, lo, tl.minimum(lo + BLOCK * 8, n),
                             IS_F64, OUT_BF16, PB, N_PB)


# --------------------------------------------------------------------------- fused forward
# y = f(x) and the codes of x in one pass (reads x once). y is evaluated with torch's CUDA
# formulas (aten/src/ATen/native/cuda/ActivationGeluKernel.cu, ActivationSiluKernel.cu): in
# float32 for float16/bfloat16/float32 input (torch's opmath type), rounded to the input dtype
# once; in float64 for float64. On a GPU the functions are CUDA's own (libdevice __nv_erff,
# __nv_tanhf, __nv_expf: what nvcc links for erff/tanhf/expf), the division is IEEE-rounded,
# the multiply-add of gelu_tanh's x + kKappa * x_cube is an explicit fma, and the launch
# options are nvcc's defaults (:func:`_nvcc_like_options`: contraction on, as it also
# applies inside the inlined libdevice code; no flush-to-zero). The interpreter has no
# libdevice: there erf, exp and tanh are evaluated in float64 and rounded (correctly rounded
# float32 functions) and nothing is contracted, so y can differ from a GPU's in the last bit.

#: Registry names (:mod:`fewbit.activations`) whose forward :func:`forward_encode_triton` computes.
FUSED_FORWARD: frozenset[str] = frozenset({"gelu", "gelu_tanh", "silu"})
#: Those of :data:`FUSED_FORWARD` whose fused ``y`` the eager forward uses: the ones whose ``y``
#: equalled torch's CUDA kernel bit for bit on a GPU (an H100, torch 2.11 + CUDA 13.0, triton
#: 3.6: float32, float16, bfloat16, float64). gelu is not among them: Triton's libdevice
#: ``erf`` and the ``erff`` torch was built with differ in the last bit for some inputs, and
#: ``1 + erf(x / sqrt(2))`` cancels as x falls, so y differed by more than the erf's unit
#: (e.g. x = -4.79: -4.1360e-06 against torch's -3.9934e-06, 3.6 %); its eager forward is
#: torch's ``gelu`` and then the encoder.
FUSED_EAGER: frozenset[str] = frozenset({"gelu_tanh", "silu"})
_FN_ID = {"gelu": 0, "gelu_tanh": 1, "silu": 2}

# torch's constants, as doubles; rounded to the compute dtype in the kernel as torch's
# ``constexpr opmath_t`` rounds them
_GELU_ALPHA = tl.constexpr(0.70710678118654752440)  # kAlpha = M_SQRT1_2
_GELU_BETA = tl.constexpr(1.41421356237309504880 * 1.12837916709551257390 * 0.5)  # kBeta = M_SQRT2 * M_2_SQRTPI * 0.5
_GELU_KAPPA = tl.constexpr(0.044715)  # kKappa


@triton.jit
def _fma(a, b, c, IS_F64: tl.constexpr, INTERPRET: tl.constexpr):
    """``a * b + c`` rounded once (the interpreters of older tritons round twice in
    ``tl.fma``: for float32 the exact product and the sum are formed in float64)."""
    if INTERPRET and not IS_F64:
        r = (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        r = tl.fma(a, b, c)
    return r


@triton.jit
def _exp(v, IS_F64: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        if IS_F64:
            r = tl.exp(v)
        else:
            r = tl.exp(v.to(tl.float64)).to(tl.float32)
    else:
        r = libdevice.exp(v)  # __nv_expf / __nv_exp (tl.exp is ex2.approx-based for float32)
    return r


@triton.jit
def _erf(v, IS_F64: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        if IS_F64:
            r = tl.math.erf(v)
        else:
            r = tl.math.erf(v.to(tl.float64)).to(tl.float32)
    else:
        r = libdevice.erf(v)
    return r


@triton.jit
def _tanh_f64(u):
    """tanh in float64 from exp (the interpreter has no tanh): a short series below 2**-12,
    else ``sign(u) * (1 - t) / (1 + t)`` with ``t = exp(-2|u|)`` (no overflow)."""
    a = tl.abs(u)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    u2 = u * u
    small = u - u * u2 * (1.0 / 3.0) + u * u2 * u2 * (2.0 / 15.0)
    r = tl.where(a < 0.000244140625, small, tl.where(u < 0, -big, big))
    return tl.where(u != u, u, r)


@triton.jit
def _tanh(v, IS_F64: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        if IS_F64:
            r = _tanh_f64(v)
        else:
            r = _tanh_f64(v.to(tl.float64)).to(tl.float32)
    else:
        r = libdevice.tanh(v)
    return r


@triton.jit
def _div(a, b, IS_F64: tl.constexpr):
    if IS_F64:
        r = a / b  # float64 division is IEEE-rounded
    else:
        r = tl.math.div_rn(a, b)  # Triton's float32 ``/`` is not
    return r


@triton.jit
def _activation(x, FN: tl.constexpr, IS_F64: tl.constexpr, INTERPRET: tl.constexpr):
    """``f(x)`` in the compute dtype, in the order of operations of torch's CUDA kernel."""
    if IS_F64:
        one = tl.full((), 1.0, tl.float64)
        half = tl.full((), 0.5, tl.float64)
        alpha = tl.full((), _GELU_ALPHA, tl.float64)
        beta = tl.full((), _GELU_BETA, tl.float64)
        kappa = tl.full((), _GELU_KAPPA, tl.float64)
    else:
        one = tl.full((), 1.0, tl.float32)
        half = tl.full((), 0.5, tl.float32)
        alpha = tl.full((), _GELU_ALPHA, tl.float32)
        beta = tl.full((), _GELU_BETA, tl.float32)
        kappa = tl.full((), _GELU_KAPPA, tl.float32)
    if FN == 0:  # gelu: x * 0.5 * (1 + erf(x * kAlpha))
        y = x * half * (one + _erf(x * alpha, IS_F64, INTERPRET))
    elif FN == 1:  # gelu_tanh: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x**3)))
        inner = beta * _fma(kappa, x * x * x, x, IS_F64, INTERPRET)
        y = half * x * (one + _tanh(inner, IS_F64, INTERPRET))
    else:  # silu: x / (1 + exp(-x))
        y = _div(x, one + _exp(-x, IS_F64, INTERPRET), IS_F64)
    return y


@triton.jit
def _forward_encode_kernel(
    x_ptr,
    y_ptr,
    borders_ptr,
    codes_ptr,
    packed_ptr,
    rec_ptr,
    n,
    cap,
    FN: tl.constexpr,
    NB: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
    CLASSES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # One read of x: the codes (and the record) of the exact x, then y = f(x) unless FN < 0
    # (the encoder: codes only); y_ptr may be x_ptr (each element is loaded and stored by
    # the same program, the load first). Comparisons only for the codes: exact.
    grp, idx = _groups(BLOCK)
    valid = idx < n
    xc = _widen(tl.load(x_ptr + idx, mask=valid, other=0.0), IS_F64)  # exact
    if CLASSES != 0:
        _record_nonfinite(xc, idx, valid, rec_ptr, cap, CLASSES, BLOCK * 8)
    _pack_store(tl.where(valid, _interval_codes(xc, borders_ptr, codes_ptr, NB), 0), grp, packed_ptr, n, BITS)
    if FN >= 0:
        _store_rounded(y_ptr, idx, _activation(xc, FN, IS_F64, INTERPRET), valid, OUT_BF16)


# Whether the kernels are the interpreter's: triton decided it at ``@triton.jit`` time from
# its own setting (``TRITON_INTERPRET``, which it reads as a boolean: "1", "true", ...), so
# the kernel object says it; fixed for the process (tests run the interpreter in subprocesses).
_INTERPRET = _InterpretedFunction is not None and isinstance(_forward_encode_kernel, _InterpretedFunction)


def cdiv(a, b):
    """``ceil(a / b)`` for launch grids: an int, or a SymInt while a trace records (host
    code; ``triton.cdiv`` is a ``constexpr_function`` in recent triton, several µs a call)."""
    return -(-a // b)


def _nvcc_like_options() -> dict:
    """Launch options under which Triton compiles the fused forward as nvcc compiles torch's
    kernels by default: multiply-adds contracted (``-fmad=true``; inside the inlined
    libdevice functions too) and libdevice without flush-to-zero (``-ftz=false``; the option
    exists from triton 3.2 on, older ones always flush: that changes only subnormal
    intermediates, which ``1 + f`` absorbs)."""
    opts = {"enable_fp_fusion": True}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "enable_reflect_ftz" in getattr(CUDAOptions, "__dataclass_fields__", {}):
            opts["enable_reflect_ftz"] = False
    except ImportError:  # pragma: no cover - a triton without the NVIDIA backend
        pass
    return opts


_NVCC_LIKE = _nvcc_like_options()


def default_block() -> int:
    """Groups of 8 elements per program: 256 on a GPU, 4096 under the interpreter."""
    return 4096 if _INTERPRET else 256


def encode_triton(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, *, block: int | None = None,
    traceable: bool = True,
) -> torch.Tensor:
    """Launch the encoder. ``borders`` in compare dtype (float64 for float64 ``x``, else
    float32 rounded down); returns ``(ceil(numel * bits / 8),)`` uint8 on ``x.device``.
    ``traceable=False``: an eager call on real tensors (:func:`_launcher`)."""
    return _encode(x, borders, codes, bits, 0, 0, block, traceable=traceable)[0]


def encode_nonfinite_triton(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int,
    *, block: int | None = None, traceable: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder that also records the non-finite elements of the classes in the mask
    ``classes`` (fewbit.ops._nonfinite): returns ``(packed, record)``, record
    ``(1 + capacity,)`` int64, entries in an unspecified order. No host sync."""
    packed, record = _encode(x, borders, codes, bits, classes, capacity, block, traceable=traceable)
    if record is None:  # classes == 0: nothing to record
        record = torch.zeros((1 + capacity,), dtype=torch.int64, device=x.device)
    return packed, record


def _encode(x, borders, codes, bits, classes, capacity, block, fn_id=-1, y=None, traceable=True):
    """Launch :func:`_forward_encode_kernel`: ``(packed, record)`` (record ``None`` when
    ``classes == 0``), and ``y = f(x)`` into the contiguous ``y`` when ``fn_id >= 0``;
    ``traceable``: see :func:`_launcher`."""
    n = x.numel()
    out = torch.empty((packed_nbytes(n, bits),), dtype=torch.uint8, device=x.device)
    record = torch.zeros((1 + capacity,), dtype=torch.int64, device=x.device) if classes else None
    if n == 0:
        return out, record
    block = block or default_block()
    x = x.detach().reshape(-1).contiguous()
    b = borders.detach().to(x.device).contiguous()
    nb = b.numel()
    if nb == 0:  # one interval: pass a dummy (never read) instead of a null pointer
        b = torch.full((1,), float("inf"), dtype=b.dtype, device=x.device)
    c = codes.detach().to(device=x.device, dtype=torch.int32).contiguous()
    grid = (cdiv(cdiv(n, 8), block),)
    with on_device(x):
        _launcher(_forward_encode_kernel, traceable)[grid](
            x, x if y is None else y.detach().view(-1), b, c, out, record if record is not None else c, n,
            capacity, FN=fn_id, NB=nb, BITS=bits, BLOCK=block, IS_F64=x.dtype == torch.float64,
            OUT_BF16=x.dtype == torch.bfloat16, CLASSES=classes, INTERPRET=_INTERPRET, **_NVCC_LIKE,
        )  # x as y_ptr when FN < 0: never written; c as rec_ptr when CLASSES == 0: never written
    return out, record


def decode_mul_triton(
    grad: torch.Tensor, packed: torch.Tensor, values: torch.Tensor, bits: int, *,
    nonfinite: torch.Tensor | None = None, patch: torch.Tensor | None = None, select_zero: bool = False,
    block: int | None = None, traceable: bool = True,
) -> torch.Tensor:
    """Launch the decode-multiply; ``values`` (and ``patch``) already in compute dtype
    (float64 for float64 grads, else float32). With a ``nonfinite`` record every program
    reads its count (normally 0) and patches the recorded elements in its own range; past
    the record's capacity the whole result is NaN (decided on the device). Returns a
    contiguous tensor of ``grad``'s shape and dtype. ``traceable=False``: an eager call on
    real tensors (:func:`_launcher`)."""
    n = grad.numel()
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if n == 0:
        return out
    block = block or default_block()
    g = grad.detach().reshape(-1).contiguous()
    p = packed.detach().reshape(-1).contiguous()
    v = values.detach().to(grad.device).contiguous()
    has_rec = nonfinite is not None
    rec = nonfinite.detach().to(grad.device).contiguous() if has_rec else p
    pt = patch.detach().to(device=grad.device, dtype=v.dtype).contiguous() if has_rec else v
    cap = rec.numel() - 1 if has_rec else 0
    grid = (cdiv(cdiv(n, 8), block),)
    with on_device(g):
        _launcher(_decode_mul_kernel, traceable)[grid](
            g, p, v, out, rec, pt, n, cap, BITS=bits, BLOCK=block,
            IS_F64=grad.dtype == torch.float64, OUT_BF16=grad.dtype == torch.bfloat16,
            HAS_REC=has_rec, SELECT_ZERO=bool(select_zero), PB=256, N_PB=cdiv(cap, 256),
        )
    return out


def forward_encode_triton(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int,
    fn: str, params, out: Optional[torch.Tensor] = None, *, block: Optional[int] = None, traceable: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``y = fn(x)`` and the packed codes of ``x`` in one pass over ``x`` (reads ``x`` once).

    The codes (and the non-finite record) are those of :func:`encode_nonfinite_triton`,
    computed from the exact ``x`` before anything is written; ``y`` is torch's CUDA formula
    for ``fn`` (see the comment above :data:`FUSED_FORWARD`).

    Args:
        x: float16/bfloat16/float32/float64, any shape, on a Triton device (or CPU under
            ``TRITON_INTERPRET=1``); made contiguous (a copy) when it is not.
        borders, codes, bits: as for :func:`encode_triton` (compare-dtype borders).
        classes, capacity: the non-finite record (:mod:`fewbit.ops._nonfinite`); no record
            and no atomics when ``classes == 0``.
        fn: a name in :data:`FUSED_FORWARD`.
        params: ``fn``'s parameters (a mapping; none of the fused functions has any).
        out: where ``y`` goes: ``None`` for a new tensor, or a contiguous tensor of ``x``'s
            shape and dtype; ``x`` itself for in-place (the codes are computed first).
        traceable: False for an eager call on real tensors: the kernel is launched itself,
            not through ``torch.library.wrap_triton`` (:func:`_launcher`).

    Returns:
        ``(y, packed, record)``: ``y`` of ``x``'s shape and dtype (``out`` when given),
        ``packed`` ``(ceil(numel * bits / 8),)`` uint8, ``record`` ``(1 + capacity,)``
        int64 (entries in an unspecified order), or ``None`` when ``classes == 0``.

    Raises:
        ValueError: for ``fn`` not in :data:`FUSED_FORWARD`, parameters given, or an ``out``
            of another shape, dtype or device, or not contiguous.
    """
    if fn not in FUSED_FORWARD:
        raise ValueError(f"fn must be one of {sorted(FUSED_FORWARD)} for the fused forward, got {fn!r}")
    if params:
        raise ValueError(f"fn {fn!r} takes no parameters in the fused forward, got {dict(params)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous tensor of x's shape {tuple(x.shape)}, dtype {x.dtype} and device "
            f"{x.device}, got {tuple(out.shape)} {out.dtype} {out.device} contiguous={out.is_contiguous()}"
        )
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    packed, record = _encode(x, borders, codes, bits, classes, capacity, block, _FN_ID[fn], y, traceable)
    return y, packed, record


# --------------------------------------------------------------------------- ops
# torch.library.triton_op: torch.compile traces into these (the kernels are launched through
# wrap_triton) instead of treating them as opaque calls (torchao mx_formats/kernels.py).
# The ``cuda`` kernels of fewbit::encode / encode_nonfinite / decode_mul call them.


@triton_op("fewbit::encode_triton", mutates_args=())
def _encode_op(x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    return encode_triton(x, borders, codes, bits)


@triton_op("fewbit::encode_nonfinite_triton", mutates_args=())
def _encode_nonfinite_op(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_nonfinite_triton(x, borders, codes, bits, classes, capacity)


@triton_op("fewbit::decode_mul_triton", mutates_args=())
def _decode_mul_op(
    grad: torch.Tensor, packed: torch.Tensor, values: torch.Tensor, bits: int,
    nonfinite: Optional[torch.Tensor], patch: Optional[torch.Tensor], select_zero: bool,
) -> torch.Tensor:
    return decode_mul_triton(grad, packed, values, bits, nonfinite=nonfinite, patch=patch, select_zero=select_zero)


# ``fn``'s parameters travel as a float list (none of FUSED_FORWARD takes any); ``record`` is
# ``(1 + capacity,)`` int64, or ``(0,)`` when ``classes == 0`` (an op cannot return None).


@triton_op("fewbit::forward_encode_triton", mutates_args=())
def _forward_encode_op(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int,
    fn: str, params: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, packed, record = forward_encode_triton(x, borders, codes, bits, classes, capacity, fn, _no_params(fn, params))
    return y, packed, _record_or_empty(record, x)


@triton_op("fewbit::forward_encode_triton_", mutates_args=("x",))
def _forward_encode_inplace_op(
    x: torch.Tensor, borders: torch.Tensor, codes: torch.Tensor, bits: int, classes: int, capacity: int,
    fn: str, params: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    _, packed, record = forward_encode_triton(x, borders, codes, bits, classes, capacity, fn,
                                              _no_params(fn, params), out=x)
    return packed, _record_or_empty(record, x)


def _no_params(fn, params):
    if len(params):
        raise ValueError(f"fn {fn!r} takes no parameters in the fused forward, got {list(params)}")
    return {}


def _record_or_empty(record, x):
    return record if record is not None else torch.empty((0,), dtype=torch.int64, device=x.device)
