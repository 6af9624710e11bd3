"""Tests of fewbit.convert: Config validation, convert_ on torch MLPs and on tiny GPT-2 /
BERT models built from configs (no download): forward unchanged, gradients close, saved
bytes lower, filter_fn, summary, idempotence, saved-tensor compression hooks."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fewbit
from fewbit import functional as FF
from fewbit import modules as fm
from fewbit.convert import Config, ConversionSummary, convert_, layer_kind

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path / "cache"))
    FF.clear_table_cache()
    yield
    FF.clear_table_cache()


# ----------------------------------------------------------------------------- measuring


def _is_param(t: torch.Tensor) -> bool:
    return any(u is not None and (isinstance(u, nn.Parameter) or (u.is_leaf and u.requires_grad))
               for u in (t, t._base))


class SavedBytes:
    """Bytes autograd keeps for backward: numel * element_size of every saved tensor that is
    not a parameter, de-duplicated by data_ptr; inside a fewbit compressor, the bytes of
    what the compressor keeps instead (its handles, de-duplicated by identity)."""

    def __init__(self, compressor=None):
        self.seen: set = set()
        self.total = 0
        self.compressor = compressor

    def _add_tensor(self, t):
        if _is_param(t) or t.numel() == 0:
            return
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in self.seen:
            self.seen.add(key)
            self.total += t.numel() * t.element_size()

    def _pack(self, t):
        self._add_tensor(t)
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        comp = self.compressor
        if comp is not None:
            orig = type(comp)._pack.__get__(comp)

            def pack(t):
                r = orig(t)
                if isinstance(r, torch.Tensor):
                    self._add_tensor(r)
                elif id(r) not in self.seen:
                    self.seen.add(id(r))
                    self.total += r.nbytes
                return r

            comp._pack = pack
        return self

    def __exit__(self, *exc):
        if self.compressor is not None:
            del self.compressor._pack
        self._ctx.__exit__(*exc)


def _loss(model, x):
    out = model(x)
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    return out


def _run(model, x, g, compressor=None):
    """Forward + backward with a fixed output gradient; returns output, param grads, bytes."""
    model.zero_grad(set_to_none=True)
    with SavedBytes(compressor) as sb:
        out = _loss(model, x)
    out.backward(g)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return out.detach(), grads, sb.total


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


# ----------------------------------------------------------------------------- models


def _mlp():
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(inplace=True),
        nn.Linear(256, 256), nn.LeakyReLU(0.2), nn.Linear(256, 8),
    )


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=256, max_position_embeddings=32,
    )
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


# ----------------------------------------------------------------------------- torch MLP


def test_mlp_conversion_outputs_grads_bytes():
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 32)
    g = torch.randn(64, 8)
    y0, g0, b0 = _run(ref, x, g)
    summary = convert_(model)
    assert isinstance(summary, ConversionSummary) and summary.model is model
    assert type(model[1]) is fm.GELU and model[1].bits == 3
    assert type(model[3]) is fm.ReLU and model[3].inplace and model[3].bits == 1
    assert type(model[5]) is fm.LeakyReLU and model[5].negative_slope == 0.2 and model[5].bits == 1
    assert summary.replaced == {
        "1": ("GELU", "GELU(approximate='none', bits=3)"),
        "3": ("ReLU", "ReLU(inplace=True, bits=1)"),
        "5": ("LeakyReLU", "LeakyReLU(negative_slope=0.2, bits=1)"),
    }
    assert summary.unsupported == {} and summary.compressed == {} and summary.compressor is None
    y1, g1, b1 = _run(model, x, g)
    torch.testing.assert_close(y1, y0, atol=0, rtol=0)  # forward is exactly torch's
    assert _cos(g1, g0) > 0.99
    assert b1 < b0
    # GELU's and LeakyReLU's inputs (64*256 fp32 each) are no longer saved; the three
    # activations keep 3 + 1 + 1 bits per element instead. (ReLU's output is also saved by
    # the next Linear, so it stays.) Allow 1 KiB for tables and bookkeeping.
    n = 64 * 256
    assert b0 - b1 >= 2 * n * 4 - n * (3 + 1 + 1) // 8 - 1024
    text = str(summary)
    assert "replaced 3 activation module(s)" in text and "LeakyReLU" in text


def test_mlp_stepwise_only_is_exact():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Hardtanh(-0.5, 0.75), nn.Linear(64, 4))
    ref = copy.deepcopy(model)
    x, g = torch.randn(16, 8), torch.randn(16, 4)
    y0, g0, _ = _run(ref, x, g)
    convert_(model, bits=5)
    assert model[3].min_val == -0.5 and model[3].max_val == 0.75 and model[3].bits == 1
    y1, g1, _ = _run(model, x, g)
    torch.testing.assert_close(y1, y0, atol=0, rtol=0)
    torch.testing.assert_close(g1, g0, atol=0, rtol=0)


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("make,act_cls,new_repr", [
    (_gpt2, "NewGELUActivation", "GELU(approximate='tanh', bits=3)"),
    (_bert, "GELUActivation", "GELU(approximate='none', bits=3)"),
])
def test_transformers_conversion(make, act_cls, new_repr):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 100, (4, 32))
    y_shape = _loss(ref, x).shape
    g = torch.randn(y_shape)
    y0, g0, b0 = _run(ref, x, g)
    summary = convert_(model)
    assert len(summary.replaced) == 2
    assert set(summary.replaced.values()) == {(act_cls, new_repr)}
    y1, g1, b1 = _run(model, x, g)
    # same function; the tanh formula vs torch's fused kernel differ by rounding only
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    assert _cos(g1, g0) > 0.99
    assert b1 < b0
    # saved-tensor compression of the other layers lowers the bytes further
    summary2 = convert_(model, Config(activation_bits=3, saved_bits=4, min_numel=1024))
    assert summary2.replaced == {}  # already converted: nothing double-wrapped
    kinds = set(summary2.compressed.values())
    assert kinds == {"linear", "norm", "attention"}
    y2, g2, b2 = _run(model, x, g, summary2.compressor)
    torch.testing.assert_close(y2, y0, atol=1e-5, rtol=1e-5)  # forward is unchanged by compression
    assert b2 < b1
    assert summary2.compressor.stats.compressed > 0 and not summary2.compressor.active
    assert _cos(g2, g0) > 0.95


def test_filter_fn_and_summary():
    model = _gpt2()
    seen = []

    def only_first_block(m, fqn):
        seen.append(fqn)
        return fqn.startswith("transformer.h.0.")

    s = convert_(model, Config(saved_bits=8, layers="norm"), filter_fn=only_first_block)
    assert list(s.replaced) == ["transformer.h.0.mlp.act"]
    assert type(model.transformer.h[1].mlp.act).__name__ == "NewGELUActivation"
    assert s.compressed == {"transformer.h.0.ln_1": "norm", "transformer.h.0.ln_2": "norm"}
    assert "transformer.h.1.mlp.act" in seen
    text = str(s)
    assert "transformer.h.0.mlp.act: NewGELUActivation -> GELU(approximate='tanh', bits=3)" in text
    assert "norm=2" in text


def test_unsupported_listed_and_left_alone():
    model = nn.Sequential(nn.Linear(4, 8), nn.PReLU(), nn.Linear(8, 8), nn.Softmax(dim=-1), nn.GLU(), nn.SiLU())
    s = convert_(model)
    assert s.unsupported == {"1": "PReLU", "3": "Softmax", "4": "GLU"}
    assert type(model[1]) is nn.PReLU and list(s.replaced) == ["5"]
    assert "unsupported" in str(s)
    root = nn.GELU()
    s = convert_(root)
    assert type(root) is nn.GELU and "root" in s.unsupported[""]


def test_activation_bits_none_and_shared_modules():
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Sequential(nn.Linear(4, 4), act))
    s = convert_(model, Config(activation_bits=None))
    assert s.replaced == {} and model[1] is act
    s = convert_(model, Config(activation_bits=2))
    assert type(model[1]) is fm.Tanh and model[2][1] is model[1] and model[1].bits == 2


def test_idempotent_hooks_and_exception_safety():
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64))
    cfg = Config(saved_bits=4, min_numel=1)
    s1 = convert_(model, cfg)
    s2 = convert_(model, cfg)
    for m in model:
        n_pre = sum(type(h).__name__ == "_EnterHook" for h in m._forward_pre_hooks.values())
        n_post = sum(type(h).__name__ == "_ExitHook" for h in m._forward_hooks.values())
        assert (n_pre, n_post) == ((1, 1) if layer_kind(m) else (0, 0))
    assert s1.compressed == s2.compressed == {"0": "linear", "1": "norm", "3": "linear"}
    comp = s2.compressor
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 65))  # wrong shape: Linear raises inside the compressor
    assert not comp.active
    y = model(torch.randn(8, 64))
    y.sum().backward()
    assert comp.stats.compressed > 0 and not comp.active
    # switching compression off removes the hooks
    convert_(model, Config(saved_bits=None))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model)


def test_converted_model_pickles_and_deepcopies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.SiLU(), nn.Linear(64, 4))
    s = convert_(model, Config(saved_bits=8, min_numel=1))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        x = torch.randn(5, 64)
        torch.testing.assert_close(clone(x), model(x), atol=0, rtol=0)
        clone(x).sum().backward()
        hook = next(iter(clone[0]._forward_pre_hooks.values()))
        assert hook.shared.compressor is not s.compressor
        assert hook.shared.compressor.stats.compressed > 0
        assert type(clone[2]) is fm.SiLU


def test_bad_input():
    with pytest.raises(TypeError, match="model"):
        convert_("not a model")
    with pytest.raises(TypeError, match="config"):
        convert_(nn.ReLU(), {"activation_bits": 3})
    with pytest.raises(ValueError, match="either config or bits"):
        convert_(nn.ReLU(), Config(), bits=2)
    with pytest.raises(ValueError, match="activation_bits"):
        convert_(nn.ReLU(), bits=9)
    with pytest.raises(TypeError, match="filter_fn"):
        convert_(nn.ReLU(), filter_fn=3)


@pytest.mark.parametrize("field,value", [
    ("activation_bits", 0), ("activation_bits", 9), ("activation_bits", 2.0), ("activation_bits", True),
    ("saved_bits", 3), ("saved_bits", 16), ("group_size", 0), ("min_numel", -1),
    ("layers", ("linear", "mlp")), ("layers", 5), ("stochastic", "yes"),
])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_config_layers_normalised_and_frozen():
    assert Config(layers="all").layers == ("linear", "conv", "norm", "attention")
    assert Config(layers=["norm", "linear", "norm"]).layers == ("linear", "norm")
    with pytest.raises(Exception):
        Config().activation_bits = 4  # frozen
    assert fewbit.Config is Config and fewbit.convert_ is convert_


def test_layer_kinds():
    from transformers.pytorch_utils import Conv1D

    assert layer_kind(nn.Linear(2, 2)) == "linear" and layer_kind(Conv1D(4, 2)) == "linear"
    assert layer_kind(nn.Conv2d(1, 1, 3)) == "conv" and layer_kind(nn.ConvTranspose1d(1, 1, 3)) == "conv"
    assert layer_kind(nn.BatchNorm1d(3)) == "norm" and layer_kind(nn.GroupNorm(1, 2)) == "norm"
    assert layer_kind(nn.MultiheadAttention(4, 2)) == "attention"
    assert layer_kind(nn.GELU()) is None and layer_kind(fm.GELU()) is None


def test_runtime_api_import_is_lean():
    """Importing functional/modules/convert loads neither numba, scipy, triton, the solver,
    the quantizer nor transformers, and does not initialise CUDA."""
    import subprocess
    import sys

    code = (
        "import sys, torch, fewbit.functional, fewbit.modules, fewbit.convert\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'scipy', 'triton', 'transformers')"
        " or m.startswith(('fewbit.solver', 'fewbit.quant')))\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _report() -> None:  # pragma: no cover - measurement, run as a script
    """Print saved bytes of the tiny GPT-2 / BERT configs: torch, few-bit activations, and
    few-bit activations + saved-tensor compression. ``python tests/test_convert.py``"""
    import os
    import tempfile

    os.environ.setdefault("FEWBIT_CACHE_DIR", tempfile.mkdtemp())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, batch 4 x 32 tokens, fp32, eval mode")
    for name, make in [("GPT-2 (n_layer=2, n_embd=64, n_head=2)", _gpt2),
                       ("BERT (2 layers, hidden 64, 2 heads, intermediate 256)", _bert)]:
        torch.manual_seed(0)
        ref = make()
        x = torch.randint(0, 100, (4, 32))
        g = torch.randn(_loss(ref, x).shape)
        y0, g0, b0 = _run(ref, x, g)
        model = copy.deepcopy(ref)
        convert_(model, Config(activation_bits=3))
        y1, g1, b1 = _run(model, x, g)
        print(f"{name}\n  torch:                 {b0:9d} B")
        print(f"  activation_bits=3:     {b1:9d} B  {b0 / b1:5.2f}x  grad cos {_cos(g1, g0):.4f}  "
              f"max|dy| {float((y1 - y0).abs().max()):.1e}")
        for saved_bits in (8, 4, 2):
            m2 = copy.deepcopy(model)
            s = convert_(m2, Config(activation_bits=3, saved_bits=saved_bits))
            y2, g2, b2 = _run(m2, x, g, s.compressor)
            print(f"  + saved_bits={saved_bits}:        {b2:9d} B  {b0 / b2:5.2f}x  grad cos {_cos(g2, g0):.4f}")


if __name__ == "__main__":  # pragma: no cover
    _report()


@pytest.mark.parametrize("name,kwargs,expected,tol", [
    ("GELUActivation", {}, "GELU(approximate='none', bits=3)", 0),
    ("GELUActivation", {"use_gelu_python": True}, "GELU(approximate='none', bits=3)", 1e-6),
    ("GELUTanh", {}, "GELU(approximate='tanh', bits=3)", 0),
    ("GELUTanh", {"use_gelu_tanh_python": True}, "GELU(approximate='tanh', bits=3)", 1e-6),
    ("NewGELUActivation", {}, "GELU(approximate='tanh', bits=3)", 1e-6),
    ("AccurateGELUActivation", {}, "GELU(approximate='tanh', bits=3)", 1e-6),
    ("FastGELUActivation", {}, "GELU(approximate='tanh', bits=3)", 1e-6),
    ("QuickGELUActivation", {}, "QuickGELU(bits=3)", 0),
    ("SiLUActivation", {}, "SiLU(bits=3)", 0),
    ("MishActivation", {}, "Mish(bits=3)", 0),
])
def test_transformers_activation_classes(name, kwargs, expected, tol):
    """Each replaced HF class computes the same function; forward stays within ``tol``
    (relative to max(1, |x|)) of the original, 0 where HF calls the same torch kernel."""
    acts = pytest.importorskip("transformers.activations")
    old = getattr(acts, name)(**kwargs)
    model = nn.Sequential(nn.Identity(), old)
    s = convert_(model)
    assert s.replaced == {"1": (name, expected)}
    x = torch.linspace(-8, 8, 4097)
    torch.testing.assert_close(model(x), old(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["ClippedGELUActivation", "LaplaceActivation", "ReLUSquaredActivation",
                                  "SqrtSoftplusActivation"])
def test_transformers_unsupported_listed(name):
    acts = pytest.importorskip("transformers.activations")
    cls = getattr(acts, name)
    old = cls(-10, 10) if name == "ClippedGELUActivation" else cls()
    model = nn.Sequential(nn.Linear(2, 2), old)
    s = convert_(model)
    assert s.unsupported == {"1": name} and model[1] is old and s.replaced == {}
