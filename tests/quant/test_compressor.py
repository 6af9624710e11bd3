"""ActivationCompressor: saved-tensor compression through saved_tensors_hooks."""

import contextlib
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fewbit
from fewbit.quant import ActivationCompressor, compress_activations
from fewbit.quant.compressor import _Handle, _pack_bool, _two_valued_scale, _unpack_bool
from fewbit._saved import Kept


def _grads(model, x, comp=None, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if comp is None:
        loss = model(x).square().mean()
    else:
        with comp:
            loss = model(x).square().mean()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _cos(a, b):
    return F.cosine_similarity(a.double(), b.double(), dim=0).item()


def _sqnr(ref, y):
    return 20 * torch.log10(ref.norm() / (ref - y).norm()).item()


class _Attn(nn.Module):
    def __init__(self, d=64, h=4):
        super().__init__()
        self.h = h
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        y = self.norm(x)
        q, k, v = (m(y).view(b, t, self.h, d // self.h).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.mlp(x)


@pytest.mark.parametrize("bits,min_sqnr", [(4, 14.0), (8, 35.0)])
def test_mlp_gradients_close(bits, min_sqnr):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 10))
    x = torch.randn(128, 64)
    exact = _grads(model, x)
    comp = ActivationCompressor(bits)
    approx = _grads(model, x, comp)
    assert comp.stats.compressed > 0
    assert _sqnr(exact, approx) > min_sqnr
    assert _cos(exact, approx) > (0.98 if bits == 4 else 0.9999)


def test_conv_net_gradients_close():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    x = torch.randn(8, 3, 32, 32)
    exact = _grads(model, x)
    comp = ActivationCompressor(4)
    approx = _grads(model, x, comp)
    # BatchNorm's and the second conv's inputs; ReLU keeps a 1-bit code, GELU its input exact
    # (backward not linear in them: fewbit.quant.nonlinear)
    assert comp.stats.compressed >= 2
    assert comp.stats.skipped["dtype"] == 1 and comp.stats.skipped["nonlinear"] == 1
    assert _cos(exact, approx) > 0.98
    # channels_last activations come back contiguous: autograd accepts them
    model_cl = model.to(memory_format=torch.channels_last)
    x_cl = x.to(memory_format=torch.channels_last)
    exact_cl = _grads(model_cl, x_cl)
    assert _cos(exact_cl, _grads(model_cl, x_cl, ActivationCompressor(8))) > 0.999


def test_attention_gradients_close_and_qkv_dedup():
    torch.manual_seed(0)
    model = _Attn()
    x = torch.randn(4, 64, 64)
    exact = _grads(model, x)
    comp = ActivationCompressor(8)
    approx = _grads(model, x, comp)
    assert _cos(exact, approx) > 0.999
    # q, k, v projections save the same LayerNorm output: one compressed copy, 2 dedup hits
    assert comp.stats.deduplicated >= 2
    comp4 = ActivationCompressor(4)
    assert _cos(exact, _grads(model, x, comp4)) > 0.97


def test_dedup_one_copy_and_cache_released():
    lin = [nn.Linear(256, 256) for _ in range(3)]
    x = torch.randn(64, 256, requires_grad=True)
    y = torch.tanh(x)
    comp = ActivationCompressor(4)
    with comp:
        outs = [m(y) for m in lin]
        loss = sum(o.sum() for o in outs)
    assert comp.stats.compressed == 1 + 0  # y once (tanh saves its output y too: same tensor)
    assert comp.stats.deduplicated >= 2
    assert len(comp._cache) == 1
    loss.backward()
    del loss, outs
    gc.collect()
    assert len(comp._cache) == 0  # nothing outlives the graph


def _as_is(packed, t):
    """``packed`` is ``t`` left as it is: an alias of the same elements (a detached view
    sharing storage and version counter, in a :class:`fewbit._saved.Kept`), not a copy."""
    if not isinstance(packed, Kept):
        return False
    packed = packed.tensor
    return (isinstance(packed, torch.Tensor) and packed.data_ptr() == t.data_ptr() and packed.shape == t.shape
            and packed.stride() == t.stride() and packed.dtype == t.dtype and packed._version == t._version)


def test_parameters_ints_small_untouched():
    comp = ActivationCompressor(4, min_numel=1000)
    w = nn.Parameter(torch.randn(64, 64))
    frozen = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    leaf = torch.randn(64, 64, requires_grad=True)
    kept = {
        "parameter": [w, frozen, frozen.t(), w.t()[:, :8], leaf, leaf.view(-1)],
        "dtype": [torch.randint(0, 9, (5000,)), torch.zeros(5000, dtype=torch.uint8),
                  torch.zeros(5000, dtype=torch.complex64)],
        "small": [torch.randn(999), torch.ones(10, dtype=torch.bool)],
        "layout": [torch.randn(64, 1).expand(64, 4096)],
        "no_grad": [torch.randn(5000), torch.randn(100, 50)],
    }
    for reason, tensors in kept.items():
        for t in tensors:
            assert _as_is(comp._pack(t), t), (reason, t.shape)
    for reason, tensors in kept.items():
        assert comp.stats.skipped[reason] == len(tensors)
    assert comp.stats.compressed == 0
    assert isinstance(comp._pack(torch.randn(1000, requires_grad=True) * 1), _Handle)
    # through autograd: leaf * w saves both (untouched), the grads are exact
    small = torch.randn(8, 8, requires_grad=True)
    with comp:
        a = (leaf * w).sum()
        s2 = small * 1
        c = (s2 * s2).sum()
    (a + c).backward()
    torch.testing.assert_close(w.grad, leaf.detach(), atol=0, rtol=0)
    torch.testing.assert_close(small.grad, 2 * small.detach())


def test_bool_masks_exact():
    m = torch.rand(3, 1001) > 0.5
    p = _pack_bool(m)
    assert p.dtype == torch.uint8 and p.numel() == (m.numel() + 7) // 8
    assert torch.equal(_unpack_bool(p, m.numel()).reshape(m.shape), m)
    # through autograd: masked_fill saves a bool mask
    x = torch.randn(3, 1001, requires_grad=True)
    comp = ActivationCompressor(4, min_numel=16)
    with comp:
        y = (x * 2).masked_fill(m, 0.0).sum()
    y.backward()
    assert comp.stats.packed_bool == 1
    torch.testing.assert_close(x.grad, (~m).float() * 2, atol=0, rtol=0)


def test_dropout_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.Dropout(0.5), nn.GELU(), nn.Linear(512, 128))
    x = torch.randn(64, 128)
    exact = _grads(model, x, seed=1)
    approx = _grads(model, x, ActivationCompressor(8), seed=1)
    # the mask is drawn before the first compressed save (the seeds of the compressed
    # tensors come from the global CPU generator afterwards), so the masks are the same
    assert _cos(exact, approx) > 0.999


def test_nested_reentrant_and_counters():
    comp = ActivationCompressor(4)
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    with comp:
        with comp:
            a = lin(torch.tanh(x))
        assert comp.active
        b = lin(torch.sigmoid(x))
    assert not comp.active
    (a.sum() + b.sum()).backward()
    st = comp.stats
    assert st.compressed == 2  # the inputs of lin, saved in the inner and in the outer block
    assert st.bytes_after < st.bytes_before
    before = st.bytes_before
    with comp:
        lin(torch.tanh(x)).sum().backward()
    assert comp.stats.bytes_before > before
    comp.stats.reset()
    assert comp.stats.bytes_before == 0 and comp.stats.skipped == {}
    with pytest.raises(RuntimeError):
        comp.__exit__(None, None, None)


def test_compress_activations_public_and_ratio():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
    x = torch.randn(64, 512)
    comp = fewbit.compress_activations(4)
    assert isinstance(comp, ActivationCompressor) and comp is not fewbit.compress_activations(4)
    with comp:
        loss = model(x).sum()
    loss.backward()
    # float32 -> 4 bits + 2 bf16 stats per 256 elements
    assert comp.stats.ratio == pytest.approx(32 / (4 + 32 / 256), rel=1e-3)


def test_unpack_shape_dtype_device_and_transposed_views():
    x = torch.randn(96, 128, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(128, 64, dtype=torch.bfloat16)
    comp = ActivationCompressor(8, min_numel=16)
    with comp:
        z = (x * 1).t().contiguous().t() @ (y.t() * 1).t()  # saves transposed views
    z.float().sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    ref = torch.ones(96, 64, dtype=torch.bfloat16) @ y.t()
    assert _cos(x.grad.reshape(-1).float(), ref.reshape(-1).float()) > 0.999


def test_errors():
    for kw, name in (({"bits": 3}, "bits"), ({"group_size": 0}, "group_size"), ({"min_numel": -1}, "min_numel"),
                     ({"stats_dtype": torch.float16}, "stats_dtype")):
        with pytest.raises(ValueError, match=name):
            ActivationCompressor(**kw)


def test_handle_nbytes():
    comp = ActivationCompressor(4, min_numel=0)
    x = torch.randn(1000, requires_grad=True) * 1
    h = comp._pack(x)
    assert isinstance(h, _Handle)
    assert h.nbytes == 500 + 2 * 4 * 2
    assert h.unpack().shape == x.shape


def test_originals_freed_while_graph_alive():
    import weakref

    lin1, lin2 = nn.Linear(256, 256), nn.Linear(256, 256)
    x = torch.randn(64, 256)
    comp = ActivationCompressor(4)
    with comp:
        h = torch.tanh(lin1(x))  # tanh saves h, lin2 saves h: both compressed/deduplicated
        ref = weakref.ref(h)
        loss = lin2(h).sum()
    del h
    gc.collect()
    assert ref() is None  # neither autograd nor the dedup cache keeps the float32 original
    assert len(comp._cache) >= 1
    loss.backward()
    assert lin1.weight.grad is not None


def _saved_no_grad_floats(out):
    """(grad_fn class, attribute, tensor) of the saved float tensors that need no grad."""
    found, stack, seen = [], [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for name in sorted(dir(fn)):
            if name.startswith("_saved_"):
                t = getattr(fn, name)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
                    found.append((type(fn).__name__, name, t))
        stack.extend(f for f, _ in fn.next_functions)
    return found


def test_attention_logsumexp_and_norm_stats_stay_exact():
    """SDPA's logsumexp and LayerNorm's mean/rstd do not require grad: never quantized.

    Backward rebuilds softmax as exp(s - lse); a 4-bit error in lse scales whole rows of
    attention probabilities, and it made a 2-layer GPT-2 diverge.
    """
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 256, 32, requires_grad=True) for _ in range(3))
    ln = nn.LayerNorm(32)

    def forward():
        a, b, c = (t * 1 for t in (q, k, v))
        return ln(torch.nn.functional.scaled_dot_product_attention(a, b, c))

    ref = _saved_no_grad_floats(forward())
    comp = ActivationCompressor(4, min_numel=0)
    # The compressor's hooks alone: `with comp:` also reroutes SDPA to
    # fewbit.quant.attention, which saves no logsumexp at all (tests/quant/test_attention.py).
    with torch.autograd.graph.saved_tensors_hooks(comp._pack, comp._unpack):
        out = forward()
    got = _saved_no_grad_floats(out)
    assert comp.stats.compressed > 0
    assert len(ref) >= 2, ref  # logsumexp (if the backend saves one) and mean/rstd
    assert [(c, n) for c, n, _ in got] == [(c, n) for c, n, _ in ref]
    for (cls, name, a), (_, _, b) in zip(got, ref):
        assert torch.equal(a, b), (cls, name)
    assert comp.stats.skipped["no_grad"] == len(ref)


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``item``, ``bool``, ``float``): each a
    device-to-host sync on CUDA."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("t", [(torch.rand(5000) > 0.1).float() / 0.9, torch.randn(5000), torch.zeros(5000),
                               torch.full((5000,), float("inf"))])
def test_mask_check_reads_the_device_once(t):
    with _DeviceReads() as reads:
        _two_valued_scale(t)
    assert reads.n == 1


def test_saved_no_grad_floats_checked_once_per_storage():
    """A LLaMA saves its rotary cos and sin (no grad, kept exact) four times in every layer;
    each check of a no-grad save for a {0, c} mask reads the device (a sync on CUDA). A
    storage already held exact is not checked again: two reads per step whatever the depth
    (before: 12 per layer)."""
    transformers = pytest.importorskip("transformers")

    def reads(layers):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                       max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg)
        fewbit.convert_(model, fewbit.Config(saved_bits=2))
        x = torch.randint(0, 128, (2, 128))
        model(input_ids=x, labels=x).loss.backward()
        with _DeviceReads() as counted:
            model(input_ids=x, labels=x).loss.backward()
        return counted.n

    assert reads(2) == reads(3) <= 2


def test_float_dropout_mask_packed_losslessly():
    """CPU dropout saves a float mask of 0 and 1/(1-p): packed at 1 bit, restored exactly."""
    comp = ActivationCompressor(4, min_numel=0)
    mask = (torch.rand(10_000) > 0.1).float() / 0.9
    h = comp._pack(mask)
    assert isinstance(h, _Handle) and h.nbytes == 10_000 // 8
    assert torch.equal(h.unpack(), mask)
    assert comp.stats.packed_bool == 1
    # not a mask: two non-zero values, negative zero, or non-finite -> kept as it is
    for t in (torch.full((5000,), 2.0).index_fill_(0, torch.tensor([3]), 1.0),
              torch.zeros(5000).index_fill_(0, torch.tensor([3]), -0.0).index_fill_(0, torch.tensor([4]), 2.0),
              torch.full((5000,), float("inf"))):
        assert _as_is(comp._pack(t), t)
    assert comp.stats.skipped["no_grad"] == 3
    # through autograd: dropout's gradient is exact
    x = torch.randn(64, 256, requires_grad=True)
    torch.manual_seed(3)
    with comp:
        y = torch.nn.functional.dropout(x * 1, 0.3, training=True)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.manual_seed(3)
    x2 = x.detach().requires_grad_()
    (g_ref,) = torch.autograd.grad(torch.nn.functional.dropout(x2 * 1, 0.3, training=True).sum(), x2)
    assert torch.equal(g, g_ref)


def test_reshaped_view_reuses_the_packed_copy():
    """Eager attention: matmul saves the probabilities as a (B*H, T, T) view of the softmax
    result already packed at 8 bits; that view unpacks from the same copy (no second, lower-
    bit one) and the gradients stay unbiased (mean of 200 draws, 3 sigma per projection)."""
    torch.manual_seed(0)
    s0 = torch.randn(2, 4, 16, 16)
    v0 = torch.randn(2, 4, 16, 8)
    w = torch.randn(2, 4, 16, 8)

    def grads(comp=None):
        s, v = s0.clone().requires_grad_(), v0.clone().requires_grad_()
        with comp if comp is not None else contextlib.nullcontext():
            out = torch.softmax(s * 1, -1) @ (v * 1)
        (out * w).sum().backward()
        return torch.cat([s.grad.reshape(-1), v.grad.reshape(-1)])

    comp = ActivationCompressor(2, min_numel=0)
    draws = torch.stack([grads(comp) for _ in range(200)])
    # the last pass: the probabilities once, at 8 bits, and v's (B*H, T, d) view at 2
    assert sorted((r.shape, r.bits) for r in comp.records.values()) == [((2, 4, 16, 16), 8), ((8, 16, 8), 2)]
    assert comp.stats.deduplicated >= 200  # the (8, 16, 16) view of each pass
    exact = grads()
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        u = torch.randn(exact.numel(), generator=gen)
        proj = draws @ u
        assert abs(float(proj.mean()) - float(exact @ u)) <= 3 * float(proj.std()) / math.sqrt(len(proj))


def test_other_views_of_one_storage_are_packed_apart():
    """A transposed (non-contiguous) view and a slice at another offset cover other
    elements or another order: each gets its own copy."""
    x = torch.randn(64, 64, requires_grad=True)
    w64, w128 = nn.Parameter(torch.randn(8, 64)), nn.Parameter(torch.randn(8, 128))
    comp = ActivationCompressor(4, min_numel=0)
    with comp:
        y = x * 1
        a = F.linear(y, w64)  # saves y
        b = F.linear(y.t(), w64)  # saves y.t()
        c = F.linear(y[32:], w64)  # saves y[32:]
        d = F.linear(y.view(32, 128), w128)  # the same elements as y: reused
    (a.sum() + b.sum() + c.sum() + d.sum()).backward()
    assert comp.stats.compressed == 3 and comp.stats.deduplicated == 1


@pytest.mark.parametrize("op", ["keep", "rsqrt", "small"])
def test_graph_dropped_without_backward_frees_results_kept_exact(op):
    """A result its own op saves and the compressor keeps exact (``rsqrt``'s, a statistic;
    anything below ``min_numel``) must not hold itself alive: a pack hook that returns the
    tensor itself (or a ``Keep`` compressor) closes a cycle result -> grad_fn -> saved result through C++, which gc
    cannot see, so every forward whose graph was dropped without backward (validation
    under grad mode, an exception mid-step) leaked it. Failed before the fix."""
    import weakref

    x = torch.rand(64, 256, requires_grad=True) + 0.5
    from fewbit.quant.compressors import get_compressor

    kw = {"compressor": get_compressor("keep")} if op == "keep" else {}
    comp = ActivationCompressor(2, min_numel=1 << 30 if op == "small" else 2048, **kw)
    with comp:
        y = torch.rsqrt(x * 1) if op == "rsqrt" else torch.exp(x * 1)
        loss = y.sum()
    ref = weakref.ref(y)
    del y, loss
    gc.collect()
    assert ref() is None
    assert sum(comp.stats.skipped.values()) >= 1


def test_a_graph_of_the_backward_through_compressed_tensors_raises():
    """A gradient penalty is quadratic in what the backward reads: through 2-bit copies its
    weight gradients were off by 0.38 of their norm over 300 draws (noise alone 0.02). A
    backward with ``create_graph=True`` that reaches a compressed tensor raises; one that
    reaches only exact tensors (kept small ones, stepwise activations) gives torch's
    second-order gradient; ``create_graph=False`` is unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(64, 16, requires_grad=True)

    def penalty_grads(comp):
        model.zero_grad(set_to_none=True)
        with comp if comp is not None else contextlib.nullcontext():
            loss = model(x).square().sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        gx.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    with pytest.raises(RuntimeError, match="create_graph=True.*compressed"):
        penalty_grads(compress_activations(2, min_numel=0))
    # every tensor under min_numel stays exact: torch's second-order gradient, bit for bit
    for got, want in zip(penalty_grads(compress_activations(2, min_numel=10**6)), penalty_grads(None)):
        assert torch.equal(got, want)
    # a converted model: activations only (stepwise ReLU is exact) works; with saved bits it raises
    fewbit.convert_(model, fewbit.Config(saved_bits=None))
    want = penalty_grads(None)
    model2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model2.load_state_dict(model.state_dict())
    fewbit.convert_(model2, fewbit.Config(saved_bits=2, min_numel=0))
    model2.zero_grad(set_to_none=True)
    loss = model2(x).square().sum()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)
    loss = model2(x).square().sum()
    (gx,) = torch.autograd.grad(loss, x)  # first order: fine
    assert gx.shape == x.shape and want[0].shape == model[0].weight.shape

    class Recompute(torch.autograd.Function):
        """Reads its saved tensor with grad on in an ordinary backward (recompute in backward)."""

        @staticmethod
        def forward(ctx, h):
            ctx.save_for_backward(h)
            return h * 2.0

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                (h,) = ctx.saved_tensors
                h = h.detach().requires_grad_()
                (gh,) = torch.autograd.grad(h * 2.0, h, g)
            return gh

    with compress_activations(2, min_numel=0) as comp:
        loss = Recompute.apply(model2[0](x)).square().sum()
    loss.backward()  # create_graph=False: no error although the saved tensor is unpacked with grad on
    assert comp.stats.compressed > 0 and model2[0].weight.grad is not None
    # an unpack outside any backward (the planner times pack + unpack so) is no graph of a backward
    with torch.enable_grad():
        assert comp._unpack(comp._pack(torch.randn(64, 64, requires_grad=True) * 1.0)).shape == (64, 64)


def test_kept_storage_registered_only_while_its_graph_holds_it():
    """A storage held exact is registered (later saves of it are kept, not copied) for as
    long as the graph holds it, not as long as the caller's tensor lives: a GAN's
    ``fake.detach()``, kept by the discriminator step's graph and still held by the user,
    had made the generator step keep ``fake`` exact instead of compressing it."""
    from fewbit.memory import SavedTensorRecorder

    torch.manual_seed(0)
    G = nn.Linear(64, 256)
    D = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    z = torch.randn(128, 64)

    def g_step_bytes(d_step_first):
        comp = ActivationCompressor(2)
        with comp:
            fake = G(z) * 1.0
            fake_d = fake.detach()
            if d_step_first:
                D(fake_d).mean().backward()  # saves fake_d (no grad); this graph is freed here
            with SavedTensorRecorder() as rec:
                g_loss = -D(fake).mean()
            g_loss.backward()
        return rec.saved_bytes

    assert g_step_bytes(True) == g_step_bytes(False)


def test_pickled_after_a_step_with_kept_tensors_alive():
    """The registry of storages held exact refers weakly to what live graphs hold: not
    state, and not picklable; a compressor pickled while the user still held such a tensor
    raised TypeError."""
    import pickle

    lin = nn.Linear(64, 64)
    x = torch.randn(256, 64, requires_grad=True)
    comp = ActivationCompressor(2)
    with comp:
        h = lin(x * 1.0)
        F.gelu(h).sum().backward()  # gelu's input kept exact ("nonlinear"); h still held
        held = comp._pack(torch.randn(5000))  # a no-grad float, kept exact, its handle alive
    copy = pickle.loads(pickle.dumps(comp))
    assert copy._kept == {} and copy.min_numel == comp.min_numel
    assert held is not None and h is not None


def test_every_exact_hold_of_a_storage_counts():
    """A storage is held exact while any graph holds it: a second save deduplicated onto the
    first keeps it registered after the first graph is gone (a third save had added a
    quantized copy of values held exact anyway)."""
    torch.manual_seed(0)
    W = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(512, 64, requires_grad=True)
    comp = ActivationCompressor(bits=2, min_numel=0)
    with comp:
        h = x * 1.5
        p, q = W * 1.0, W * 2.0
        d = h.detach()
        dead = (d[:, :1] * p[:1]).sum()  # save 1 of h's storage (no grad): kept exact
        alive = (d[:, :1] * q[:1]).sum()  # save 2: deduplicated onto it, held by this graph
        del dead  # the first graph, and its hold, are gone
        before = comp.stats.bytes_after
        out = (h @ W).sum()  # save 3 of the same storage
        added = comp.stats.bytes_after - before
    (out + alive).backward()
    assert added == 0 and comp.stats.deduplicated == 2


def test_copy_inside_a_forward_is_a_clear_error():
    import copy

    comp = ActivationCompressor(bits=2, min_numel=0)
    with comp:
        with pytest.raises(RuntimeError, match="cannot be copied or pickled inside its own `with` block"):
            copy.deepcopy(comp)
    assert copy.deepcopy(comp).min_numel == 0
