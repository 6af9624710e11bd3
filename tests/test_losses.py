"""fewbit.losses: the fused linear + cross-entropy against F.cross_entropy(F.linear(...)).

Tolerances by dtype: float64 and float32 against the same-dtype torch computation
(float64 to 1e-12, float32 to 1e-5 relative to the largest value compared); float16 and
bfloat16 against the float64 truth, with an error at most twice torch's own same-dtype
error plus one epsilon of the dtype times the largest value (flash-attention's rule).
"""

from __future__ import annotations

import copy
import io
import types

import pytest
import torch
import torch.nn.functional as F

import fewbit
from fewbit.losses import (
    DEFAULT_CHUNK_LOGITS,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    logit_transform,
    patch_causal_lm_,
    unpatch_causal_lm_,
)

N, H, V = 37, 24, 101  # N not a multiple of the chunk sizes below but of none; V odd
CLOSE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _data(dtype=torch.float64, n=N, h=H, v=V, bias=True, ignored=(2, 5, 30), shape=None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        if i < n:
            t[i] = -100
    if shape is not None:
        x, t = x.reshape(*shape, h), t.reshape(shape)
    return x, w, b, t


def _run(fn, x, w, b, t, dtype, grad_output=None):
    """Loss and gradients (input, weight, bias) of ``fn(x, w, t, b)`` in ``dtype``, as float64."""
    leaves = [None if a is None else a.detach().to(dtype).clone().requires_grad_() for a in (x, w, b)]
    loss = fn(leaves[0], leaves[1], t, leaves[2])
    go = torch.ones_like(loss) if grad_output is None else grad_output.to(loss.dtype)
    loss.backward(go)
    return [loss.detach().double()] + [None if a is None else a.grad.double() for a in leaves]


def _assert_close(mine, ref, dtype, what=("loss", "grad input", "grad weight", "grad bias")):
    for name, m, r in zip(what, mine, ref):
        if r is None:
            assert m is None, name
            continue
        scale = max(r.abs().max().item(), 1e-30) if r.numel() else 1.0
        err = (m - r).abs().max().item() if r.numel() else 0.0
        assert err <= CLOSE[dtype] * scale, f"{name}: max error {err:.3g} > {CLOSE[dtype]:.0e} x {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction, grad_in_forward",  # "none" with grad_in_forward: test_bad_arguments
                         [("mean", False), ("sum", False), ("none", False), ("mean", True), ("sum", True)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 8, 37, 64, None])
def test_matches_torch(dtype, reduction, label_smoothing, grad_in_forward, chunk_size):
    x, w, b, t = _data()
    go = torch.randn(N, generator=torch.Generator().manual_seed(2)) if reduction == "none" else torch.tensor(1.7)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    mine = _run(lambda *a: linear_cross_entropy(*a, chunk_size=chunk_size, grad_in_forward=grad_in_forward, **kw),
                x, w, b, t, dtype, go)
    ref = _run(lambda *a: linear_cross_entropy_reference(*a, **kw), x, w, b, t, dtype, go)
    _assert_close(mine, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_half_precision(dtype, grad_in_forward, reduction):
    """Error to the float64 truth <= 2 x torch's same-dtype error + eps(dtype) x max |truth|."""
    x, w, b, t = _data()
    kw = dict(reduction=reduction, label_smoothing=0.05)
    truth = _run(lambda *a: linear_cross_entropy_reference(*a, **kw), x, w, b, t, torch.float64)
    mine = _run(lambda *a: linear_cross_entropy(*a, chunk_size=10, grad_in_forward=grad_in_forward, **kw),
                x, w, b, t, dtype)
    torch_half = _run(lambda *a: linear_cross_entropy_reference(*a, **kw), x, w, b, t, dtype)
    eps = torch.finfo(dtype).eps
    for name, m, h, r in zip(("loss", "grad input", "grad weight", "grad bias"), mine, torch_half, truth):
        err, torch_err = (m - r).abs().max().item(), (h - r).abs().max().item()
        bound = 2 * torch_err + eps * r.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3g} > 2 x {torch_err:.3g} + eps x max"


def test_loss_dtype_and_shape():
    x, w, b, t = _data(shape=(4, 9), n=36)
    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                            (torch.float32, torch.float32), (torch.float64, torch.float64)):
        loss = linear_cross_entropy(x.to(dtype), w.to(dtype), t, b.to(dtype), reduction="none")
        assert loss.dtype == expected and loss.shape == (4, 9)
        assert (loss[t == -100] == 0).all()
    assert linear_cross_entropy(x, w, t, b).shape == ()


def test_unbatched_and_nd_input():
    x, w, b, t = _data(shape=(3, 12), n=36)
    for reduction in ("mean", "none"):
        ref = F.cross_entropy(F.linear(x, w, b).permute(0, 2, 1), t, reduction=reduction)
        torch.testing.assert_close(linear_cross_entropy(x, w, t, b, reduction=reduction, chunk_size=5), ref)
    one = linear_cross_entropy(x[0, 0], w, t[0, 0], b, reduction="none")
    torch.testing.assert_close(one, F.cross_entropy(F.linear(x[0, 0], w, b), t[0, 0], reduction="none"))


def test_non_contiguous_input():
    x, w, b, t = _data(n=36)
    xt = x.reshape(6, 6, H).transpose(0, 1)  # a non-contiguous view
    tt = t.reshape(6, 6).t()
    mine = _run(lambda *a: linear_cross_entropy(*a, chunk_size=7), xt, w, b, tt, torch.float64)
    ref = _run(linear_cross_entropy_reference, xt, w, b, tt, torch.float64)
    _assert_close(mine, ref, torch.float64)


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_all_ignored_and_empty(grad_in_forward):
    x, w, b, t = _data(n=5, ignored=range(5))
    for reduction in ("mean", "sum"):
        mine = _run(lambda *a: linear_cross_entropy(*a, reduction=reduction, grad_in_forward=grad_in_forward),
                    x, w, b, t, torch.float64)
        ref = _run(lambda *a: linear_cross_entropy_reference(*a, reduction=reduction), x, w, b, t, torch.float64)
        for m, r in zip(mine, ref):
            torch.testing.assert_close(m, r, equal_nan=True, rtol=0, atol=0)
        assert mine[0].isnan().item() == (reduction == "mean")
    x, w, b, t = _data(n=0)
    for reduction in ("mean", "sum", "none"):
        ref = linear_cross_entropy_reference(x, w, t, b, reduction=reduction)
        got = linear_cross_entropy(x, w, t, b, reduction=reduction)
        torch.testing.assert_close(got, ref, equal_nan=True)


@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("frozen", ["input", "weight", "bias", "weight+bias", "no bias"])
def test_partial_requires_grad(grad_in_forward, frozen):
    x, w, b, t = _data()
    x, w = x.clone().requires_grad_("input" not in frozen), w.clone().requires_grad_("weight" not in frozen)
    b = None if frozen == "no bias" else b.clone().requires_grad_("bias" not in frozen)
    linear_cross_entropy(x, w, t, b, chunk_size=9, grad_in_forward=grad_in_forward).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    br = None if b is None else b.detach().clone().requires_grad_()
    linear_cross_entropy_reference(xr, wr, t, br).backward()
    for mine, ref in ((x, xr), (w, wr), (b, br)):
        if mine is None:
            continue
        if mine.requires_grad:
            torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-12, atol=1e-12)
        else:
            assert mine.grad is None


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_no_grad_mode_computes_no_gradient(grad_in_forward, monkeypatch):
    """Under torch.no_grad (evaluation) only the loss is computed: no gradient, no graph."""
    import fewbit.losses as losses

    with_grads = []
    real = losses._run_chunks
    monkeypatch.setattr(losses, "_run_chunks",
                        lambda *a, **k: (with_grads.append(k["row_scale"] is not None), real(*a, **k))[1])
    x, w, b, t = _data()
    x.requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, b, chunk_size=9, grad_in_forward=grad_in_forward)
    assert loss.grad_fn is None and with_grads == [False]
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, t, b).detach())


def _saved_bytes(fn) -> tuple[int, int]:
    """(total bytes, largest numel) of the tensors saved for backward by ``fn()``, by storage."""
    seen, largest = {}, 0

    def pack(t):
        nonlocal largest
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    return sum(seen.values()), largest


def test_saved_tensors_no_logits():
    """Nothing of size N x V is saved; the bytes are those stated in the docstring."""
    n, h, v = 64, 16, 1000
    x, w, b, t = _data(torch.float32, n=n, h=h, v=v)
    x, w, b = (a.float().requires_grad_() for a in (x, w, b))
    ref_bytes, ref_largest = _saved_bytes(lambda: linear_cross_entropy_reference(x, w, t, b))
    assert ref_largest == n * v and ref_bytes >= n * v * 4  # the log-softmax (float32: also the logits)
    params = w.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    rec_bytes, rec_largest = _saved_bytes(lambda: linear_cross_entropy(x, w, t, b, chunk_size=16))
    assert rec_largest < n * v
    assert rec_bytes == params + n * h * 4 + n * 8 + 4  # input, target, the token count
    fwd_bytes, fwd_largest = _saved_bytes(lambda: linear_cross_entropy(x, w, t, b, chunk_size=16,
                                                                       grad_in_forward=True))
    assert fwd_largest < n * v
    assert fwd_bytes == n * h * 4 + v * h * 4 + v * 4  # grad input, grad weight, grad bias


def test_double_backward_raises():
    x, w, b, t = _data()
    x.requires_grad_()
    loss = linear_cross_entropy(x, w, t, b)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(input=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "input must be a floating"),
        (dict(weight=torch.zeros(V, H + 1)), ValueError, r"weight must have shape \(V, H\) with H = input"),
        (dict(weight=torch.zeros(V, H, dtype=torch.float32)), ValueError, "weight must have the dtype of input"),
        (dict(bias=torch.zeros(V + 1, dtype=torch.float64)), ValueError, r"bias must have shape \(V,\)"),
        (dict(target=torch.zeros(N, dtype=torch.int32)), ValueError, "target must be an int64 \\(or uint8\\) tensor"),
        (dict(target=torch.zeros(N, V)), ValueError, "target must be an int64 \\(or uint8\\) tensor"),
        (dict(target=torch.zeros(N + 1, dtype=torch.int64)), ValueError, r"target must have shape input.shape\[:-1\]"),
        (dict(target=torch.full((N,), V)), ValueError, rf"target must be in \[0, {V - 1}\] or ignore_index .*got {V}"),
        (dict(target=torch.full((N,), -1)), ValueError, r"target must be in .*got -1"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a real number in \[0.0, 1.0\], got 1.5"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an integer >= 1, got 0"),
        (dict(chunk_size=2.0), ValueError, "chunk_size must be an integer >= 1, got 2.0"),
        (dict(ignore_index=1.5), ValueError, "ignore_index must be an integer"),
        (dict(grad_in_forward=1), ValueError, "grad_in_forward must be True or False"),
        (dict(grad_in_forward=True, reduction="none"), ValueError, "grad_in_forward=True needs reduction"),
        (dict(input=torch.zeros(N, 0, dtype=torch.float64), weight=torch.zeros(V, 0, dtype=torch.float64)),
         ValueError, r"input must have shape \(\.\.\., H\) with H >= 1 features, got shape \(\d+, 0\)"),
        (dict(input=torch.zeros(N, H, dtype=torch.float64, device="meta"),
              weight=torch.zeros(V, H, dtype=torch.float64, device="meta"), bias=None),
         ValueError, "input must be on a cpu or cuda device .*got meta"),
        # on another device torch raises; the fused op had returned uninitialised values
        (dict(target=torch.zeros(N, dtype=torch.int64, device="meta")), ValueError,
         r"target must be on input's device \(cpu\), got meta"),
        (dict(bias=torch.zeros(V, dtype=torch.float64, device="meta")), ValueError,
         r"bias must be on input's device \(cpu\), got meta"),
        (dict(ignore_index=2**63), ValueError, r"ignore_index must be an integer in \[-2\*\*63, 2\*\*63\)"),
    ],
)
def test_bad_arguments(change, exc, match):
    x, w, b, t = _data()
    args = dict(input=x, weight=w, target=t, bias=b)
    args.update(change)
    with pytest.raises(exc, match=match):
        linear_cross_entropy(**args)


def test_autocast_casts_like_linear():
    x, w, b, t = _data(torch.float32)
    x, w, b = (a.float().requires_grad_() for a in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = linear_cross_entropy(x, w, t, b, chunk_size=10)
        ref = F.cross_entropy(F.linear(x, w, b), t)
    assert mine.dtype == ref.dtype == torch.float32
    gm = torch.autograd.grad(mine, (x, w, b))
    gr = torch.autograd.grad(ref, (x, w, b))
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(gm, gr):
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-3)


def test_autocast_leaves_float64_as_linear_does():
    """torch's autocast casts no float64 tensor (F.linear stays float64); the fused loss had
    cast them to bfloat16 (loss 6.0701 against 6.0752)."""
    x, w, b, t = _data(torch.float64)
    x, w, b = (a.requires_grad_() for a in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = linear_cross_entropy(x, w, t, b, chunk_size=10)
        ref = F.cross_entropy(F.linear(x, w, b), t)
    assert mine.dtype == ref.dtype == torch.float64
    _assert_close(_run(linear_cross_entropy, x, w, b, t, torch.float64),
                  _run(lambda *a: F.cross_entropy(F.linear(a[0], a[1], a[3]), a[2]), x, w, b, t, torch.float64),
                  torch.float64)
    torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_torch_compile():
    x, w, b, t = _data(torch.float32)
    x, w, b = (a.float().requires_grad_() for a in (x, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: linear_cross_entropy(*a, chunk_size=10), backend="aot_eager")
    loss = compiled(x, w, t, b)
    grads = torch.autograd.grad(loss, (x, w, b))
    ref = linear_cross_entropy_reference(x, w, t, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    torch.testing.assert_close(loss, ref)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_torch_compile_keeps_no_logits(grad_in_forward):
    """Under torch.compile (Inductor) the fused loss saves what it saves eagerly, no logits:
    traced, the backward's recomputed logits were the forward's to Inductor, which kept every
    chunk's (a patched GPT-2 kept 14.5 MB compiled against 8.7 eager); the chunk loop is now
    one custom op, called opaquely. The gradients are eager's."""
    n, h, v = 64, 8, 2048
    x, w, b, t = _data(torch.float32, n=n, h=h, v=v)
    x, w, b = (a.float().requires_grad_() for a in (x, w, b))

    def f(x, w, t, b):
        return linear_cross_entropy(x * 1.0, w, t, b, chunk_size=16, grad_in_forward=grad_in_forward)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    total, largest = _saved_bytes(lambda: compiled(x, w, t, b))
    assert largest < 16 * v, (total, largest)  # one chunk's logits: 16 * 2048 elements; the weight 8 * 2048
    loss = compiled(x, w, t, b)
    grads = torch.autograd.grad(loss, (x, w, b))
    ref = f(x, w, t, b)
    for a, r in zip(grads, torch.autograd.grad(ref, (x, w, b))):
        torch.testing.assert_close(a, r)
    torch._dynamo.reset()


def test_chunk_op_opcheck():
    """``fewbit::linear_cross_entropy_chunks`` passes torch.library.opcheck (schema, fake
    kernel, no aliasing), with and without gradients, bias and smoothing."""
    x, w, b, t = _data(torch.float32)
    x, w, b = x.float(), w.float(), b.float()
    scale = torch.rand(x.shape[0])
    wt = w.t().contiguous().t()  # a transposed view's strides: the fake gradient had copied them
    for weight, bias, row_scale, need in ((w, b, scale, [True, True, True]), (w, None, scale, [True, False, False]),
                                          (w, b, None, [False, False, False]), (wt, b, scale, [True, True, True])):
        torch.library.opcheck(torch.ops.fewbit.linear_cross_entropy_chunks,
                              (x, weight, bias, t, -100, 0.1, 7, row_scale, need, True))


def test_torch_compile_with_a_transposed_weight():
    """A weight that is a transposed view (``F.linear(h, P.t())``): Inductor failed its size
    asserts in backward (the fake kernel gave grad_weight the weight's strides), and with
    them off gave P a gradient 0.34 off."""
    x, w, b, t = _data(torch.float64)
    p = w.t().contiguous().requires_grad_()  # (H, V)
    x = x.requires_grad_()

    def f(x, p, t, b):
        return linear_cross_entropy(x, p.t(), t, b, chunk_size=10)

    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, p, t, b), (x, p))
    ref = torch.autograd.grad(linear_cross_entropy_reference(x, p.t(), t, b), (x, p))
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()


def test_forward_mode_dual_tensors_get_their_tangent():
    """``torch.autograd.forward_ad`` dual inputs: the chunk op has no forward-AD rule, and
    the fused loss gave no tangent (None, i.e. 0); they now run unfused, as torch.func does."""
    import torch.autograd.forward_ad as fwAD

    x, w, b, t = _data()
    tangent = torch.randn_like(x)
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with grad_mode(), fwAD.dual_level():
            got = fwAD.unpack_dual(linear_cross_entropy(fwAD.make_dual(x, tangent), w, t, b)).tangent
            want = fwAD.unpack_dual(linear_cross_entropy_reference(fwAD.make_dual(x, tangent), w, t, b)).tangent
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_default_chunk_size(monkeypatch):
    """chunk_size=None: DEFAULT_CHUNK_LOGITS // V tokens per chunk (at least 1)."""
    import fewbit.losses as losses

    assert DEFAULT_CHUNK_LOGITS == 2**24
    used = []
    real = losses._chunks
    monkeypatch.setattr(losses, "_chunks", lambda n, c: (used.append(c), real(n, c))[1])
    monkeypatch.setattr(losses, "DEFAULT_CHUNK_LOGITS", 5 * V + 3)
    x, w, b, t = _data()
    x.requires_grad_()
    loss = linear_cross_entropy(x, w, t, b)
    loss.backward()
    assert used == [5, 5]  # forward and the recomputing backward
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, t, b), rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(losses, "DEFAULT_CHUNK_LOGITS", V - 1)
    linear_cross_entropy(x, w, t, b)
    assert used[-1] == 1


def test_exported():
    assert fewbit.linear_cross_entropy is linear_cross_entropy
    assert "linear_cross_entropy" in fewbit.__all__


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_tiny_lm_training_matches_unfused(grad_in_forward):
    """20 Adam steps of a tiny LM: the loss curve equals the unfused one (float32)."""

    def train(fused: bool) -> list[float]:
        torch.manual_seed(0)
        emb, mlp = torch.nn.Embedding(50, 16), torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                                    torch.nn.Linear(32, 16))
        head = torch.nn.Linear(16, 50)
        params = [*emb.parameters(), *mlp.parameters(), *head.parameters()]
        opt = torch.optim.Adam(params, lr=1e-2)
        data = torch.randint(0, 50, (8, 17), generator=torch.Generator().manual_seed(3))
        losses = []
        for _ in range(20):
            h = mlp(emb(data[:, :-1]))
            target = data[:, 1:]
            if fused:
                loss = linear_cross_entropy(h, head.weight, target, head.bias, chunk_size=24,
                                            grad_in_forward=grad_in_forward)
            else:
                loss = F.cross_entropy(head(h).reshape(-1, 50), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    fused, unfused = train(True), train(False)
    assert unfused[-1] < unfused[0] - 0.3  # it learns
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(unfused), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------
# Hugging Face models
# --------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _step(model, **inputs):
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_data_parallel_replica_uses_its_own_head(factory, monkeypatch):
    """``nn.DataParallel`` copies the patched head's forward into each replica of the head:
    the replica's pre-hook refused its own head as "replaced" (its loss would have taken the
    first GPU's weight). Each replica's loss and logits now come from its own head's copy
    of the weights, in its own thread; the patched weight's gradient is the replicas' sum."""
    from helpers import replicate_on_cpu, run_in_threads

    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    patch_causal_lm_(model, chunk_size=7)
    ids = torch.randint(0, 97, (4, 10))
    shifts = (0.01, -0.02)
    chunks = [{"input_ids": ids[j::2], "labels": ids[j::2]} for j in range(2)]
    replicas = replicate_on_cpu(model, shifts, monkeypatch)
    outs = run_in_threads(replicas, chunks)
    (outs[0].loss + outs[1].loss).backward()
    logits = run_in_threads(replicas, [{"input_ids": c["input_ids"]} for c in chunks])
    expect = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for j, s in enumerate(shifts):  # the unpatched model with replica j's weights, on its chunk
        ref = copy.deepcopy(reference)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(s)
        out = ref(**chunks[j])
        assert outs[j].logits is None
        torch.testing.assert_close(outs[j].loss, out.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(logits[j].logits, out.logits, rtol=0, atol=0)
        out.loss.backward()
        for n, p in ref.named_parameters():
            expect[n] += p.grad
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expect[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 11}], ids=["mean", "num_items_in_batch"])
def test_patch_causal_lm_matches_unpatched(factory, kwargs):
    torch.manual_seed(0)
    model = factory()
    ids = torch.randint(0, 97, (2, 10))
    labels = ids.clone()
    labels[0, :3] = -100
    ref, ref_grads = _step(model, input_ids=ids, labels=labels, **kwargs)
    assert patch_causal_lm_(model, chunk_size=7) is model
    out, grads = _step(model, input_ids=ids, labels=labels, **kwargs)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # tuples leave the logits out, as transformers leaves out None fields
    tup = model(input_ids=ids, labels=labels, return_dict=False, **kwargs)
    torch.testing.assert_close(tup[0], ref.loss, rtol=1e-6, atol=1e-6)
    assert all(t.shape != ref.logits.shape for t in tup if isinstance(t, torch.Tensor))
    # without labels: the logits, as before
    torch.testing.assert_close(model(input_ids=ids).logits, ref.logits)
    unpatch_causal_lm_(model)
    again, _ = _step(model, input_ids=ids, labels=labels, **kwargs)
    torch.testing.assert_close(again.logits, ref.logits)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)


def test_patch_causal_lm_shift_labels_and_ignore_index():
    torch.manual_seed(0)
    model = _gpt2()
    ids = torch.randint(0, 97, (2, 10))
    shift = torch.randint(0, 97, (2, 10))
    shift[1, 4:] = 7
    ref, ref_grads = _step(model, input_ids=ids, labels=ids, shift_labels=shift, ignore_index=7)
    patch_causal_lm_(model)
    out, grads = _step(model, input_ids=ids, labels=ids, shift_labels=shift, ignore_index=7)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_patch_causal_lm_saves_no_logits():
    torch.manual_seed(0)
    model = _gpt2()
    inputs = {"input_ids": torch.randint(0, 97, (2, 16)), "labels": torch.randint(0, 97, (2, 16))}
    before = fewbit.memory.saved_tensor_report(model, inputs)
    patch_causal_lm_(model)
    after = fewbit.memory.saved_tensor_report(model, inputs)
    logits_bytes = 2 * 16 * 97 * 4
    # the (tokens, vocab) log-softmax is gone; the head's input (tokens, 32) stays
    assert before.saved_bytes - after.saved_bytes == logits_bytes
    assert after.by_module[""] < 2 * 16 * 32 * 4 + 2 * 16 * 8 + 8
    assert after.loss == pytest.approx(before.loss, rel=1e-6)


def _untied_gpt2():
    model = _gpt2()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def test_patch_causal_lm_deepcopy_uses_its_own_head():
    """A deep copy of a patched model computes its loss and gradients with its own head,
    hooks and loss function (before the fix its head's forward and loss were the
    original's closures)."""
    torch.manual_seed(0)
    model = patch_causal_lm_(_untied_gpt2())
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        copy_.lm_head.weight.mul_(3.0)
    ids = torch.randint(0, 97, (2, 10))
    out, grads = _step(copy_, input_ids=ids, labels=ids)
    ref_model = unpatch_causal_lm_(copy.deepcopy(copy_))
    ref, ref_grads = _step(ref_model, input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert model.lm_head.weight.grad is None  # the original was not touched
    # the copy can be unpatched on its own; the original stays patched
    unpatch_causal_lm_(copy_)
    assert copy_(input_ids=ids, labels=ids).logits is not None
    assert model(input_ids=ids, labels=ids).logits is None


def test_patch_causal_lm_pickles():
    """torch.save / torch.load of a patched model keeps it patched and exact (the closures of
    an earlier build could not be pickled)."""
    torch.manual_seed(0)
    model = patch_causal_lm_(_gpt2(), chunk_size=5)
    ids = torch.randint(0, 97, (2, 10))
    ref, ref_grads = _step(model, input_ids=ids, labels=ids)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out, grads = _step(loaded, input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tying survives
    unpatch_causal_lm_(loaded)
    assert loaded(input_ids=ids, labels=ids).logits is not None


def test_patch_causal_lm_refuses_a_replaced_head():
    """Replacing the output embedding after patching is an error at the next forward with
    labels, not a loss computed with the old head (a deep copy of the head carries the
    patched forward along)."""
    torch.manual_seed(0)
    model = patch_causal_lm_(_untied_gpt2())
    ids = torch.randint(0, 97, (2, 10))
    new_head = copy.deepcopy(model.lm_head)
    with torch.no_grad():
        new_head.weight.mul_(3.0)
    model.lm_head = new_head
    with pytest.raises(RuntimeError, match="output embedding was replaced"):
        model(input_ids=ids, labels=ids)
    assert model(input_ids=ids).logits.shape == (2, 10, 97)  # without labels: no fused loss


def test_patch_causal_lm_refusals():
    with pytest.raises(ValueError, match="must be a transformers"):
        patch_causal_lm_(torch.nn.Linear(3, 3))
    model = patch_causal_lm_(_gpt2())
    with pytest.raises(ValueError, match="already patched"):
        patch_causal_lm_(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_causal_lm_(_gpt2())
    capped = _gpt2()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        patch_causal_lm_(capped)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        patch_causal_lm_(_gpt2(), chunk_size=0)


def test_uint8_targets_as_torch():
    x, w, b, t = _data(torch.float64, ignored=())
    torch.testing.assert_close(linear_cross_entropy(x, w, t.to(torch.uint8), b, chunk_size=7),
                               F.cross_entropy(F.linear(x, w, b), t.to(torch.uint8)), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="int64 \\(or uint8\\) tensor"):
        linear_cross_entropy(x, w, t.int(), b)


def test_patch_causal_lm_refuses_a_head_with_its_own_forward():
    """A Linear subclass whose forward does more (DoryForCausalLM's head scales the logits by
    a parameter): the fused loss takes only its weight and bias, so it would skip the scale
    and the scale would stop training."""
    class ScaledHead(torch.nn.Linear):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.logit_scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return super().forward(x) * self.logit_scale

    class PlainSubclass(torch.nn.Linear):
        pass

    model = _untied_gpt2()
    model.lm_head = ScaledHead(32, 97, bias=False)
    with pytest.raises(ValueError, match="ScaledHead, whose forward is not nn.Linear's"):
        patch_causal_lm_(model)
    with pytest.raises(ValueError, match="ScaledHead"):
        fewbit.convert_(model, fewbit.Config(activation_bits=None, fused_cross_entropy=True))
    assert fewbit.losses.fused_loss_refusal(model) is not None
    model.lm_head = PlainSubclass(32, 97, bias=False)
    assert fewbit.losses.fused_loss_refusal(model) is None


def test_patch_causal_lm_refuses_a_loss_other_than_causal_lm():
    """A loss function the user set (label smoothing, z-loss) or another loss type (a
    masked-LM loss has no shift) is not the loss the fused cross-entropy computes: refused
    before patching; replaced after patching, an error at the next forward with labels
    (the user's loss had got the hidden states as logits)."""
    def smoothed(logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size).float(), labels[:, 1:].reshape(-1),
                               label_smoothing=0.2)

    model = _gpt2()
    model.loss_function = smoothed
    with pytest.raises(ValueError, match="loss_function is smoothed, not transformers' ForCausalLMLoss"):
        patch_causal_lm_(model)
    masked = _gpt2()
    masked.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match="ForMaskedLMLoss"):
        fewbit.convert_(masked, fewbit.Config(activation_bits=None, fused_cross_entropy=True))
    model = patch_causal_lm_(_gpt2())
    ids = torch.randint(0, 97, (2, 8))
    model.loss_function = smoothed
    with pytest.raises(RuntimeError, match="loss_function was replaced after fewbit.losses.patch_causal_lm_"):
        model(input_ids=ids, labels=ids)
    assert model(input_ids=ids).logits.shape == (2, 8, 97)
    unpatch_causal_lm_(model)
    plain = _gpt2()
    plain.load_state_dict(model.state_dict())
    plain.loss_function = smoothed
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)


def test_a_subclass_whose_forward_calls_the_base_forward_is_accepted():
    """A causal LM subclass whose forward delegates to ``super().forward`` names no
    ``loss_function`` itself: it was refused although the base's forward computes the loss
    with it (review, a regression of the inline-loss refusal)."""
    class Mine(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    torch.manual_seed(0)
    model, ref = Mine(_gpt2().config), _gpt2()
    ref.load_state_dict(model.state_dict())
    assert fewbit.losses.fused_loss_refusal(model) is None
    patch_causal_lm_(model)
    ids = torch.randint(0, 97, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=ids).loss)


def test_a_subclass_computing_its_loss_itself_is_refused():
    """A subclass whose own forward computes the cross-entropy (no super().forward) passed
    the first version of the delegation rule because its base's forward names
    ``loss_function``, and then failed with an IndexError on the hidden states."""
    class Inline(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)

    with pytest.raises(ValueError, match="does not compute its loss with self.loss_function"):
        patch_causal_lm_(Inline(_gpt2().config))


def test_a_subclass_replacing_the_loss_after_super_forward_raises():
    """A subclass calling ``super().forward(labels=...)`` and then computing a loss of its
    own from ``out.logits`` (the hidden states under the fused loss) returned it silently
    (3.45 against 2.77); the forward's loss must be computed from the fused one."""
    class Smoothed(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            logits = out.logits[:, :-1]
            out.loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1) % 32,
                                       label_smoothing=0.1)
            return out

    class WithAux(transformers.GPT2LMHeadModel):  # a loss computed from the fused one (an MoE's aux loss)
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            aux = self.lm_head.weight.square().mean()
            for _ in range(600):  # a long graph beside the loss's (a depth-first search got lost in it)
                aux = aux * 1.0
            out.loss = out.loss + 0.01 * aux
            return out

    ids = torch.randint(0, 97, (2, 8))
    model = patch_causal_lm_(Smoothed(_gpt2().config))
    with pytest.raises(RuntimeError, match="returned a loss not computed from what its self.loss_function"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # no graph to tell by: not checked
        model(input_ids=ids, labels=ids)
    torch.manual_seed(0)
    model, ref = WithAux(_gpt2().config), WithAux(_gpt2().config)
    ref.load_state_dict(model.state_dict())
    patch_causal_lm_(model)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


def test_an_moe_auxiliary_loss_added_to_the_fused_one_passes_the_check():
    """Mixtral adds its router's auxiliary loss, computed through the whole model, to the
    loss: the check that the returned loss comes from the fused one searches the graph
    breadth first, so that branch does not hide the fused loss's node."""
    cfg = transformers.MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model, ref = transformers.MixtralForCausalLM(cfg), transformers.MixtralForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    patch_causal_lm_(model)
    ids = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


def test_a_patched_model_exports_with_the_unfused_loss():
    """torch.export of a model converted with the fused loss failed on its data-dependent
    target check: a recorded program takes the unfused loss (same value)."""
    torch.manual_seed(0)
    model, ref = _gpt2().eval(), _gpt2().eval()
    ref.load_state_dict(model.state_dict())
    patch_causal_lm_(model)
    ids = torch.randint(0, 97, (2, 8))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    program = torch.export.export(model, (), kwargs)
    torch.testing.assert_close(program.module()(**kwargs).loss, ref(**kwargs).loss)


def test_patch_causal_lm_refuses_a_loss_computed_inline():
    """BART's, Marian's, Whisper's ``*ForCausalLM`` compute the cross-entropy themselves:
    with the head returning hidden states their loss was silently wrong (or a shape error).
    Refused when the forward never names ``self.loss_function``; a forward that names it but
    computes the loss otherwise raises at the forward."""
    bart = transformers.BartForCausalLM(transformers.BartConfig(
        vocab_size=64, d_model=64, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
        encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, max_position_embeddings=32))
    with pytest.raises(ValueError, match="does not compute its loss with self.loss_function"):
        fewbit.convert_(bart, fewbit.Config(activation_bits=None, fused_cross_entropy=True))

    class Inline(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if labels is None:
                return out
            unused = self.loss_function if labels.ndim > 2 else None  # noqa: F841 (named, not called)
            loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels[:, 1:].reshape(-1))
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=out.logits)

    model = patch_causal_lm_(Inline(_gpt2().config))
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(RuntimeError, match="did not compute its loss with self.loss_function"):
        model(input_ids=ids, labels=ids)
    assert model(input_ids=ids).logits.shape == (2, 8, 97)


def test_patch_causal_lm_refuses_transformed_logits():
    class Scaled(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.transformer(input_ids).last_hidden_state) * 2.0
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)

    model = Scaled(_gpt2().config)
    ids = torch.randint(0, 97, (1, 8))
    model(input_ids=ids, labels=ids)  # unpatched: fine
    patch_causal_lm_(model)
    with pytest.raises(RuntimeError, match="did not get the output of its lm_head"):
        model(input_ids=ids, labels=ids)
    model(input_ids=ids)  # without labels the model is untouched


def test_patched_model_evaluates_under_inference_mode():
    """Inference tensors keep no version counter (reading it raised "Inference tensors do not
    track version counter"): under ``torch.inference_mode`` the head keeps a copy of what it
    returned and the loss compares bits; the loss is the unpatched model's."""
    model = _gpt2().eval()
    ids = torch.randint(0, 97, (2, 8))
    with torch.inference_mode():
        expect = model(input_ids=ids, labels=ids).loss
    patch_causal_lm_(model)
    with torch.inference_mode():
        got = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, expect)


def test_inference_mode_copy_is_dropped_also_when_the_loss_raises():
    """The head's copy of an inference tensor lived on after a refused forward (into later
    forwards, ``torch.save`` and ``deepcopy``), and a second loss call in one forward found
    it gone (``AttributeError``)."""
    from fewbit.losses import _PATCH_ATTR

    class Twice(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
            loss = self.loss_function(logits, labels, self.config.vocab_size)
            loss = loss + self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)

    class Scaled(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.transformer(input_ids).last_hidden_state) * 2.0
            return transformers.modeling_outputs.CausalLMOutput(
                loss=self.loss_function(logits, labels, self.config.vocab_size), logits=logits)

    ids = torch.randint(0, 97, (2, 8))
    twice = patch_causal_lm_(Twice(_gpt2().config).eval())
    with torch.inference_mode():
        loss = twice(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and getattr(twice, _PATCH_ATTR).running.hidden_copy is None
    scaled = patch_causal_lm_(Scaled(_gpt2().config).eval())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="did not get the output of its lm_head"):
        scaled(input_ids=ids, labels=ids)
    assert getattr(scaled, _PATCH_ATTR).running.hidden_copy is None


def _mask_(logits):
    """Chameleon's in-place write into its logits (its image tokens), in a function of its own."""
    logits[..., :3] = -30.0


class _Masked(transformers.GPT2LMHeadModel):
    """Writes into its logits in place after the head, as Chameleon does, out of sight of
    ``fused_loss_refusal``'s source scan (the check at the loss finds it)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
        _mask_(logits)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_patch_causal_lm_refuses_logits_changed_in_place(mode):
    """A model that changes its logits in place between the head and the loss (Chameleon
    masks its image tokens, xLSTM soft-caps under ``no_grad`` in eval mode) changed the
    hidden states the patched head returned: the loss was silently wrong (4.57 against inf,
    24.98 against 32.13). The version counter is checked, in training and evaluation."""
    model = _Masked(_gpt2().config)
    ids = torch.randint(0, 97, (2, 8))
    patch_causal_lm_(model)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context(), pytest.raises(RuntimeError, match="perhaps in place"):
        model(input_ids=ids, labels=ids)
    model(input_ids=ids)  # without labels the model is untouched


def test_models_whose_config_transforms_the_logits_are_refused_up_front():
    """xLSTM's ``output_logit_soft_cap`` (and a text config's soft cap) is named at patch
    time, by ``convert_`` before it changes anything, and ``fewbit.plan`` does not choose the
    fused loss for such a model."""
    from fewbit.losses import logit_transform

    capped = _gpt2()
    capped.config.output_logit_soft_cap = 30.0
    assert logit_transform(capped) == "config.output_logit_soft_cap = 30.0"
    with pytest.raises(ValueError, match="output_logit_soft_cap = 30.0"):
        patch_causal_lm_(capped)
    before = {n: type(m) for n, m in capped.named_modules()}
    with pytest.raises(ValueError, match="fused_cross_entropy=True: model .* transforms its logits"):
        fewbit.convert_(capped, fewbit.Config(fused_cross_entropy=True))
    assert {n: type(m) for n, m in capped.named_modules()} == before  # nothing converted
    text = _gpt2()
    text.config.get_text_config = lambda *a, **k: transformers.Gemma2Config(final_logit_softcapping=30.0)
    assert logit_transform(text) == "config.text_config.final_logit_softcapping = 30.0"
    assert logit_transform(_gpt2()) is None
    # Falcon-H1 multiplies its head's output by lm_head_multiplier, 1.0 included (h57's scan)
    falcon = types.SimpleNamespace(config=transformers.FalconH1Config())
    assert logit_transform(falcon) == "config.lm_head_multiplier = 1.0"
    assert logit_transform(transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        num_hidden_layers=1, vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        lru_width=32, attention_window_size=8))) == "config.logits_soft_cap = 30.0"
    ids = torch.randint(0, 97, (2, 8))
    prof = fewbit.planner.profile(capped, {"input_ids": ids, "labels": ids}, repeats=1)
    assert not prof.fused_cross_entropy


def _bamba(z_loss_coefficient):
    cfg = transformers.BambaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, attn_layer_indices=[0], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=8, z_loss_coefficient=z_loss_coefficient)
    return transformers.BambaForCausalLM(cfg)


def test_a_z_loss_is_refused_up_front_and_a_logits_scaling_where_it_acts():
    """Bamba adds ``z_loss_coefficient * logsumexp(logits)**2`` after its loss function: with
    the fused loss it was taken over the hidden states (loss 5.4676 against 5.4306, weight
    gradients 0.60 off, and fewbit.plan chose it by default). ``logits_scaling`` divides
    Granite's logits (refused at the forward, where fewbit.plan falls back) but MiniCPM3's
    hidden states before the head (exact: accepted, at every value)."""
    torch.manual_seed(0)
    model = _bamba(0.1)
    assert logit_transform(model) == "config.z_loss_coefficient = 0.1"
    with pytest.raises(ValueError, match="z_loss_coefficient = 0.1"):
        patch_causal_lm_(model)
    ids = torch.randint(0, 50, (2, 8))
    assert not fewbit.planner.profile(model, {"input_ids": ids, "labels": ids}, repeats=1).fused_cross_entropy
    plain = _bamba(0.0)  # no z-loss: the fused loss is the model's
    assert logit_transform(plain) is None
    expected = plain(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(patch_causal_lm_(plain)(input_ids=ids, labels=ids).loss, expected)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, logits_scaling=1.0))
    with pytest.raises(RuntimeError, match="did not get the output of its lm_head unchanged"):
        patch_causal_lm_(copy.deepcopy(granite))(input_ids=ids, labels=ids)
    assert not fewbit.planner.profile(granite, {"input_ids": ids, "labels": ids}, repeats=1).fused_cross_entropy
    for base in (None, 32):  # logits_scaling 1.0 and 2.0
        minicpm = transformers.MiniCPM3ForCausalLM(transformers.MiniCPM3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=50, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=16, dim_model_base=base))
        expected = minicpm(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(patch_causal_lm_(minicpm)(input_ids=ids, labels=ids).loss, expected)


def test_a_loss_computed_from_the_logits_beside_the_loss_function_is_refused():
    """A forward that adds its own term of the logits (here a z-loss, unnamed by the config)
    got the hidden states for them: refused at the forward, and fewbit.plan falls back on
    the unfused loss."""
    class ZLoss(transformers.GPT2LMHeadModel):
        inplace = False

        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            if labels is not None:  # patched, out.logits holds the hidden states here
                z = 0.1 * out.logits.logsumexp(-1).pow(2).mean()
                if self.inplace:  # moves the loss's grad_fn: it had slipped through (h58)
                    out.loss += z
                else:
                    out.loss = out.loss + z
            return out

    torch.manual_seed(0)
    model = ZLoss(_gpt2().config)
    ids = torch.randint(0, 97, (2, 8))
    for inplace in (False, True):
        patched = patch_causal_lm_(copy.deepcopy(model))
        patched.inplace = inplace
        with pytest.raises(RuntimeError, match="from the logits besides self.loss_function"):
            patched(input_ids=ids, labels=ids)
        try:  # a forward run while an exception is handled: the check had been skipped
            raise KeyError("elsewhere")
        except KeyError:
            with pytest.raises(RuntimeError, match="from the logits besides self.loss_function"):
                patched(input_ids=ids, labels=ids)
    # a user's subclass is a causal LM to the planner: profiled fused at first, refused, then
    # profiled unfused (the refusal inside the peak measurement had been taken for the
    # profiler's own error, and the step run again unchecked)
    assert not fewbit.planner.profile(model, {"input_ids": ids, "labels": ids}, repeats=1).fused_cross_entropy
    plain = _gpt2()  # GPT-2's own uses of its hidden states are not the logits'
    expected = plain(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(patch_causal_lm_(plain)(input_ids=ids, labels=ids).loss, expected)


def test_a_vocab_size_taken_from_the_logits_width_is_the_hidden_size_when_patched():
    """Inkling passes ``vocab_size=logits.shape[-1]``: patched, that is the hidden size, and
    every forward with labels raised (fewbit.plan too)."""
    torch.manual_seed(0)
    cfg = transformers.InklingTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=16, intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        mlp_layer_types=["dense"], layer_types=["full_attention"], d_rel=4, rel_extent=16,
        logits_mup_width_multiplier=1.0)
    model = transformers.InklingForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    patched = patch_causal_lm_(copy.deepcopy(model))
    torch.testing.assert_close(patched(input_ids=ids, labels=ids).loss, expected)


@pytest.mark.slow
def test_benchmark_script_runs_at_tiny_sizes():
    """scripts/bench_linear_cross_entropy.py (README, docs/compression.md §5) at tiny sizes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_linear_cross_entropy.py", "--hidden", "16", "--vocab", "50",
         "--tokens", "8", "21", "--chunk-size", "5", "--repeats", "1", "--threads", "1", "--skip-gpt2"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["8"], ["21"])]
    assert [r[1] for r in rows] == ["torch", "recompute", "grad_in_forward"] * 2
    bad = subprocess.run([sys.executable, "scripts/bench_linear_cross_entropy.py", "--tokens", "0"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--tokens and --chunk-size must be >= 1" in bad.stderr


def test_grad_in_forward_float16_under_a_loss_scale_stays_finite():
    """GradScaler's initial scale 2**16 is inf in float16: the stored gradients were
    multiplied by ``grad_output.to(float16)`` and every entry became non-finite."""
    torch.manual_seed(0)
    x0 = (torch.randn(64, 32) * 0.1).half()
    w0 = (torch.randn(100, 32) * 0.1).half()
    t = torch.randint(0, 100, (64,))
    grads = {}
    for gif in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (fewbit.losses.linear_cross_entropy(x, w, t, grad_in_forward=gif) * 65536.0).backward()
        grads[gif] = (x.grad, w.grad)
    for a, b in zip(grads[False], grads[True]):
        assert b.isfinite().all()
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2.0)


def test_convert_patches_again_after_a_hand_unpatch():
    """``unpatch_causal_lm_`` by hand (as the resize error tells users to), then
    ``convert_`` with the fused loss: the model is patched again (it was not, while the
    summary said it was)."""
    transformers = pytest.importorskip("transformers")
    import fewbit
    from fewbit.losses import unpatch_causal_lm_

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    config = fewbit.Config(activation_bits=None, fused_cross_entropy=True)
    fewbit.convert_(model, config)
    unpatch_causal_lm_(model)
    summary = fewbit.convert_(model, config)
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert summary.fused_cross_entropy and out.logits is None  # the fused loss returns no logits
    fewbit.convert_(model, fewbit.Config(activation_bits=None))  # and unpatching through convert_ works
    assert model(input_ids=ids, labels=ids).logits is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_func_transforms_run_the_unfused_loss(dtype):
    """Under ``torch.func`` (``grad``, ``vmap``: per-sample gradients, DP-SGD) the loss is the
    unfused computation's in the same dtypes (before: torch's "must override the
    setup_context staticmethod" error; under vmap also the target check's data-dependent
    ``if``)."""
    from torch.func import grad, vmap

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 16, generator=gen).to(dtype)
    w = torch.randn(30, 16, generator=gen).to(dtype)
    t = torch.randint(0, 30, (5, 4), generator=gen)
    t[1, 2] = -100

    def ours(w_, xi, ti):
        return fewbit.linear_cross_entropy(xi, w_, ti, label_smoothing=0.1)

    def theirs(w_, xi, ti):
        logits = F.linear(xi, w_)
        return F.cross_entropy(logits.float() if dtype != torch.float32 else logits, ti, label_smoothing=0.1)

    got = vmap(grad(ours), in_dims=(None, 0, 0))(w, x, t)
    expect = vmap(grad(theirs), in_dims=(None, 0, 0))(w, x, t)
    assert got.dtype == dtype and torch.equal(got, expect)
    assert torch.equal(grad(ours)(w, x[0], t[0]), grad(theirs)(w, x[0], t[0]))


def test_threads_sharing_a_patched_model_get_their_own_loss_and_logits():
    """A patched model kept its running forwards per model: a thread evaluating without
    labels beside one training with them (generation, evaluation) swapped their records, so
    one forward got the hidden states as logits and the other the unfused loss. Each thread
    has its own now. The interleaving is fixed: the training forward enters, the evaluation
    forward enters, the training forward finishes first."""
    import threading

    torch.manual_seed(0)
    ref = _llama().eval()
    model = patch_causal_lm_(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        want_logits, want_loss = ref(ids).logits, ref(ids, labels=ids).loss
    entered = {name: threading.Event() for name in ("train", "eval")}
    go = {name: threading.Event() for name in ("train", "eval")}

    def pause(module, args):
        name = threading.current_thread().name
        entered[name].set()
        assert go[name].wait(30)

    model.model.embed_tokens.register_forward_pre_hook(pause)
    out = {}

    def run(name, **labels):
        with torch.no_grad():
            out[name] = model(ids, **labels)

    threads = [threading.Thread(target=run, name="train", args=("train",), kwargs={"labels": ids}),
               threading.Thread(target=run, name="eval", args=("eval",))]
    threads[0].start()
    assert entered["train"].wait(30)
    threads[1].start()
    assert entered["eval"].wait(30)
    go["train"].set()
    threads[0].join(30)
    go["eval"].set()
    threads[1].join(30)
    assert out["train"].logits is None  # the fused loss: no logits
    torch.testing.assert_close(out["train"].loss, want_loss)
    assert out["eval"].logits.shape == want_logits.shape
    torch.testing.assert_close(out["eval"].logits, want_logits)


def test_a_forward_stopped_by_keyboardinterrupt_leaves_the_head_as_it_was():
    """Torch skips the always-called forward hook for a ``KeyboardInterrupt``: the record of
    a labelled forward stopped inside stayed, and the head, called on its own afterwards,
    returned its input instead of the logits."""
    torch.manual_seed(0)
    model = patch_causal_lm_(_llama())
    ids = torch.randint(0, 97, (2, 10))

    def interrupt(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = model.model.norm.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(ids, labels=ids)
    h = torch.randn(2, 10, 32)
    head = model.get_output_embeddings()
    torch.testing.assert_close(head(h), F.linear(h, head.weight, head.bias))
    _, grads = _step(model, input_ids=ids, labels=ids)  # and the next step is the fused one
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_a_patched_models_forward_compiled_alone_runs_without_labels():
    """transformers' ``model.forward = torch.compile(model.forward, fullgraph=True)``: the
    hooks run eagerly and record a real frame, and the compiled head asked it whether it
    had finished (``frame.clear()``, which dynamo cannot trace)."""
    torch.manual_seed(0)
    ref = _llama().eval()
    model = patch_causal_lm_(copy.deepcopy(ref))
    ids = torch.randint(1, 97, (2, 10))
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_the_hidden_states_of_an_interrupted_forward_go_before_the_next_forward():
    """After a KeyboardInterrupt inside the loss, the stopped forward's hidden states (and
    the graph behind them) stayed alive through the next forward: two graphs at its peak."""
    import weakref

    torch.manual_seed(0)
    model = patch_causal_lm_(_llama())
    ids = torch.randint(0, 97, (2, 10))
    seen = []

    def interrupt(module, args, output):  # after the head recorded them
        seen.append(weakref.ref(args[0]))
        handle.remove()
        raise KeyboardInterrupt

    handle = model.lm_head.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(ids, labels=ids)
    alive_during = []
    probe = model.model.embed_tokens.register_forward_hook(lambda *a: alive_during.append(seen[0]() is not None))
    model(ids, labels=ids)
    probe.remove()
    assert alive_during == [False]


def test_label_smoothing_takes_numpy_reals():
    """torch takes ``label_smoothing=np.float32(0.1)``; it was refused as "not a float in
    [0.0, 1.0]" (review h54)."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    x, w, t = torch.randn(6, 4), torch.randn(9, 4), torch.randint(0, 9, (6,))
    for eps in (np.float32(0.1), np.float64(0.25)):
        torch.testing.assert_close(linear_cross_entropy(x, w, t, label_smoothing=eps),
                                   F.cross_entropy(F.linear(x, w), t, label_smoothing=float(eps)))


@pytest.mark.parametrize("changed", ["weight", "input"])
def test_grad_in_forward_detects_an_inplace_change_before_backward(changed):
    """The gradients stored in forward are those of the weight and input of the forward: a
    change in place before backward (an optimizer step before a delayed backward) raises as
    torch and the default mode do; it had returned the old weight's gradients (review h54)."""
    torch.manual_seed(0)
    w = torch.randn(10, 4, requires_grad=True)
    h = torch.randn(4, 4, requires_grad=True)
    t = torch.tensor([2, 4, 6, 8])
    for grad_in_forward in (False, True):
        x = h * 1.0  # a non-leaf input, changeable in place
        loss = linear_cross_entropy(x, w, t, grad_in_forward=grad_in_forward)
        with torch.no_grad():
            (w if changed == "weight" else x).mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        if changed == "weight":
            with torch.no_grad():
                w.div_(2)


def test_label_smoothing_over_logits_with_a_large_common_offset():
    """The smoothing term summed the raw logits and took ``lse`` away after: with a bias of
    1e3 on every class it lost 2.9e-5 to cancellation against torch's 2.1e-6 (1e4: 3.7e-4
    against 4.1e-5). It sums the log-probabilities now (review h54)."""
    torch.manual_seed(0)
    n, v, h = 64, 32000, 16
    x, w, t = torch.randn(n, h), torch.randn(v, h) * 0.1, torch.randint(0, v, (n,))
    b = torch.full((v,), 1e3)
    truth = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), t, label_smoothing=0.1)
    torch_err = (F.cross_entropy(F.linear(x, w, b), t, label_smoothing=0.1).double() - truth).abs().item()
    fused_err = (linear_cross_entropy(x, w, t, b, label_smoothing=0.1, chunk_size=16).double() - truth).abs().item()
    assert fused_err <= max(3 * torch_err, 1e-6), (fused_err, torch_err)


def test_gradients_over_logits_with_a_large_common_offset():
    """``z - logsumexp(z)`` rounded the lse to the ulp of the offset: at a bias of 1e4 in
    float32 the fused gradients were 2.4-4.4x torch's error against float64 (``grad_w``
    1.36e-4 against 3.1e-5) and the loss 2x. The row's maximum is taken off first, as
    torch's log_softmax does (review h71)."""
    torch.manual_seed(0)
    n, h, v = 13, 8, 37
    x, w = torch.randn(n, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    b = torch.randn(v, dtype=torch.float64) + 1e4
    t = torch.randint(0, v, (n,))

    def run(fn, dtype):
        leaves = [a.to(dtype).detach().requires_grad_() for a in (x, w, b)]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach().double()] + [a.grad.double() for a in leaves]

    truth = run(lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t), torch.float64)
    plain = run(lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t), torch.float32)
    fused = run(lambda x, w, b: linear_cross_entropy(x, w, t, b, chunk_size=4), torch.float32)
    for name, a, c, d in zip(("loss", "x", "w", "b"), truth, plain, fused):
        torch_err, fused_err = (a - c).abs().max().item(), (a - d).abs().max().item()
        assert fused_err <= 1.5 * torch_err, (name, fused_err, torch_err)


def test_a_compiled_model_that_changes_its_logits_in_place_is_refused():
    """Traced by torch.compile, the hidden states' version counter was the trace's own: a
    model masking its logits in place (Chameleon's image tokens) gave a loss of 4.76
    against 4.58 unfused, silently. The version is read eagerly now, as without compile
    (review h71)."""
    model = _Masked(_gpt2().config)
    ids = torch.randint(0, 97, (2, 8))
    patch_causal_lm_(model)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="perhaps in place"):
        compiled(input_ids=ids, labels=ids)
    torch._dynamo.reset()


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_a_compiled_loss_refuses_a_weight_changed_before_backward(grad_in_forward):
    """An optimizer step before a delayed backward: torch refuses it, compiled or not. The
    compiled ``grad_in_forward=True`` returned the old weight's gradients instead (its own
    version check reads no versions in a trace); it runs as the default there now (review
    h71)."""
    torch.manual_seed(0)
    x, w, t = torch.randn(16, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True), torch.randint(0, 30, (16,))
    compiled = torch.compile(lambda x, w: linear_cross_entropy(x, w, t, grad_in_forward=grad_in_forward),
                             backend="aot_eager")
    loss = compiled(x * 1.0, w)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    torch._dynamo.reset()


def test_grad_in_forward_takes_inference_mode_inputs():
    """Features made under ``torch.inference_mode`` with a trainable head: reading their
    version counter (there is none) had raised (review h58)."""
    torch.manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(8, 4)
    w = torch.randn(10, 4, requires_grad=True)
    t = torch.randint(0, 10, (8,))
    linear_cross_entropy(x, w, t, grad_in_forward=True).backward()
    wr = w.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(x.clone(), wr), t).backward()
    torch.testing.assert_close(w.grad, wr.grad)


def test_a_forward_that_writes_into_its_logits_is_refused_up_front():
    """Chameleon masks its image tokens by writing into its logits; patched, that write hit
    the hidden states, indexed by vocabulary ids: an IndexError when an id was past the
    hidden size, before the loss could refuse (review h71). Its source names the write:
    refused at patch time, naming it. Of transformers' causal and conditional-generation
    models only Chameleon's forward does so."""
    from fewbit.losses import _writes_into_logits, fused_loss_refusal

    class Written(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
            logits[:, :, 100:] = -30.0
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)

    model = Written(_gpt2().config)
    assert "logits[:, :, 100:] = -30.0" in fused_loss_refusal(model)
    with pytest.raises(ValueError, match="changes its logits in place"):
        patch_causal_lm_(model)
    assert _writes_into_logits(transformers.ChameleonForConditionalGeneration).startswith("logits[:, :, image_tokens]")

    class Delegating(Written):  # a subclass's forward that calls super().forward: had passed (review h77)
        def forward(self, input_ids=None, labels=None, **kwargs):
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    assert "logits[:, :, 100:] = -30.0" in fused_loss_refusal(Delegating(_gpt2().config))
    writers = [n for n in dir(transformers) if n.endswith(("ForCausalLM", "ForConditionalGeneration"))
               and isinstance(getattr(transformers, n), type) and _writes_into_logits(getattr(transformers, n))]
    assert writers == ["ChameleonForConditionalGeneration"]


def test_a_users_subclass_of_a_causal_lm_takes_the_fused_loss_through_convert():
    """``class MyLlama(LlamaForCausalLM)`` was refused by ``convert_(fused_cross_entropy=True)``
    ("needs a Hugging Face *ForCausalLM model") while ``patch_causal_lm_`` took it, and
    ``fewbit.plan`` never fused it (review h71): the class's MRO is asked now."""
    base = _llama()

    class MyLlama(type(base)):
        pass

    torch.manual_seed(0)
    model = MyLlama(base.config)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, base.config.vocab_size, (2, 8))
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=None, fused_cross_entropy=True))
    assert summary.fused_cross_entropy
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, plain(input_ids=ids, labels=ids).loss)


def test_a_compiled_patched_model_raises_no_dynamo_warning():
    """The pre-hook read the forward's signature through a functools.lru_cache, and Dynamo
    warned of "silent incorrectness" at every compile of a patched model (review h71)."""
    import warnings

    torch.manual_seed(0)
    model = patch_causal_lm_(_gpt2())
    ids = torch.randint(0, 97, (2, 8))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    assert not [w for w in caught if "lru_cache" in str(w.message)]
