"""Tests of fewbit.convert: Config validation, convert_ on torch MLPs and on tiny Hugging Face
models built from configs (no download): forward bit-identical, gradients close, saved
bytes lower, filter_fn, summary, re-conversion, wrappers (TorchScript, torch.compile,
DataParallel, fx), saved-tensor compression hooks.

Only the tests that build Hugging Face modules need transformers; they skip without it."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fewbit
from fewbit import functional as FF
from fewbit import modules as fm
from fewbit.convert import Config, ConversionSummary, convert_, layer_kind
from fewbit.quant.compressor import _UsersPacked

try:
    import transformers
except ImportError:  # only the tests marked needs_transformers skip
    transformers = None

needs_transformers = pytest.mark.skipif(
    transformers is None, reason="needs transformers (pip install 'fewbit[hf]')"
)


pytestmark = pytest.mark.usefixtures("fewbit_env")  # tests/conftest.py: an empty user cache per test


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
                elif isinstance(r, _UsersPacked):
                    pass  # kept exact: handed to this recorder's own hooks, which counted it
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


@needs_transformers
@pytest.mark.parametrize("make,act_cls,new_repr", [
    (_gpt2, "NewGELUActivation", "FormulaActivation('gelu_new', bits=3)"),
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
    assert torch.equal(y1, y0)  # the HF module's own expression: bit for bit
    assert _cos(g1, g0) > 0.99
    assert b1 < b0
    # saved-tensor compression of the other layers lowers the bytes further
    summary2 = convert_(model, Config(activation_bits=3, saved_bits=4, min_numel=1024))
    assert summary2.replaced == {}  # already converted: nothing double-wrapped
    kinds = set(summary2.compressed.values())
    assert kinds == {"linear", "norm", "attention", "block"}
    y2, g2, b2 = _run(model, x, g, summary2.compressor)
    assert torch.equal(y2, y0)  # forward is unchanged by compression
    assert b2 < b1
    assert summary2.compressor.stats.compressed > 0 and not summary2.compressor.active
    assert _cos(g2, g0) > 0.95


@needs_transformers
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
    assert "transformer.h.0.mlp.act: NewGELUActivation -> FormulaActivation('gelu_new', bits=3)" in text
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


def _input_grad(model, x, g):
    xg = x.clone().requires_grad_(True)
    model(xg).backward(g)
    return xg.grad


@pytest.mark.parametrize("how", ["bits", "config"])
def test_reconversion_applies_new_bits_and_reports_them(how):
    """convert_(bits=3) then convert_(bits=2): the fewbit modules already there now keep 2
    bits (same gradient as a model converted once at 2 bits), and the summary says so."""
    torch.manual_seed(0)
    model = _mlp()
    fresh = copy.deepcopy(model)
    convert_(fresh, bits=2)
    x, g = torch.randn(16, 32), torch.randn(16, 8)
    s1 = convert_(model, bits=3) if how == "bits" else convert_(model, Config(activation_bits=3))
    gelu = model[1]
    assert gelu.bits == 3 and s1.changed == {}
    g3 = _input_grad(model, x, g)
    s2 = convert_(model, bits=2) if how == "bits" else convert_(model, Config(activation_bits=2))
    assert model[1] is gelu and gelu.bits == 2  # the same module, new setting
    assert s2.replaced == {}
    assert s2.changed == {"1": ("GELU(approximate='none', bits=3)", "GELU(approximate='none', bits=2)")}
    assert model[3].bits == 1 and model[5].bits == 1  # stepwise: exact at 1 bit, not "changed"
    g2 = _input_grad(model, x, g)
    assert torch.equal(g2, _input_grad(fresh, x, g)) and not torch.equal(g2, g3)
    text = str(s2)
    assert "activation_bits=2" in text and "changed 1 fewbit module(s)" in text
    assert "1: GELU(approximate='none', bits=3) -> GELU(approximate='none', bits=2)" in text
    # the same bits again: nothing to change
    s3 = convert_(model, bits=2)
    assert s3.changed == {} and s3.replaced == {}
    # activation_bits=None leaves fewbit modules as they are
    assert convert_(model, Config(activation_bits=None)).changed == {} and gelu.bits == 2


def test_reconversion_respects_filter_fn_and_fixed_tables():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    convert_(model, bits=3)
    s = convert_(model, bits=4, filter_fn=lambda m, fqn: fqn != "3")
    assert model[1].bits == 4 and model[3].bits == 3 and list(s.changed) == ["1"]
    # a generic module whose table was given at construction cannot take other bits
    table = FF.load_table("sigmoid", 2)
    fixed = fm.FewBitActivation("sigmoid", table=table)
    lazy = fm.FewBitActivation("sigmoid", bits=2)
    model = nn.Sequential(nn.Linear(4, 4), fixed, lazy)
    s = convert_(model, bits=3)
    assert fixed.bits == 2 and fixed.table is table and lazy.bits == 3
    assert "2-bit table was given at construction" in s.unsupported["1"]
    assert s.changed == {"2": ("FewBitActivation('sigmoid', bits=2)", "FewBitActivation('sigmoid', bits=3)")}


@needs_transformers
def test_reconversion_of_transformers_formula_modules():
    torch.manual_seed(0)
    model = _gpt2()
    ref = copy.deepcopy(model)
    convert_(model, Config(activation_bits=3))
    s = convert_(model, Config(activation_bits=1))
    assert s.replaced == {}
    assert s.changed == {
        f"transformer.h.{i}.mlp.act": ("FormulaActivation('gelu_new', bits=3)", "FormulaActivation('gelu_new', bits=1)")
        for i in range(2)
    }
    x = torch.randint(0, 100, (2, 32))
    assert torch.equal(_loss(model, x), _loss(ref, x))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torchscript_model_is_refused():
    """A scripted or traced model cannot be converted (its forward is compiled): a clear
    TypeError instead of "replaced 0"; nothing is changed."""
    model = _mlp()
    x = torch.randn(2, 32)
    for compiled in (torch.jit.script(model), torch.jit.trace(model, x)):
        before = str(compiled.code)
        with pytest.raises(TypeError, match="TorchScript.*eager model"):
            convert_(compiled)
        assert str(compiled.code) == before


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torchscript_submodule_is_listed_and_the_rest_converted():
    inner = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), inner)
    s = convert_(model)
    assert list(s.replaced) == ["1"] and model[2] is inner
    assert list(s.unsupported) == ["2"] and "TorchScript" in s.unsupported["2"]
    assert "left 1 unsupported" in str(s)


def test_torch_compile_wrapper_is_converted():
    """torch.compile's OptimizedModule: the wrapped model is converted in place and the
    next call recompiles it, so the few-bit gradient is used (also after a first call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    x, g = torch.randn(3, 8), torch.randn(3, 4)
    g_torch = _input_grad(compiled, x, g)  # compiled and run once with torch's GELU
    s = convert_(compiled, bits=2)
    assert list(s.replaced) == ["_orig_mod.1"] and type(model[1]) is fm.GELU
    convert_(eager, bits=2)
    g_fewbit = _input_grad(eager, x, g)
    assert not torch.equal(g_fewbit, g_torch)
    assert torch.equal(_input_grad(compiled, x, g), g_fewbit)


def test_data_parallel_wrapper_is_converted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    dp = nn.DataParallel(model)
    s = convert_(dp, bits=2)
    convert_(eager, bits=2)
    assert list(s.replaced) == ["module.1"]
    x, g = torch.randn(3, 8), torch.randn(3, 4)
    assert torch.equal(_input_grad(dp, x, g), _input_grad(eager, x, g))


def test_distributed_data_parallel_wrapper_is_converted(tmp_path):
    """DDP (one gloo process, in a subprocess so no process group leaks into other tests)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import copy, torch, torch.distributed as dist
        from torch import nn
        import fewbit
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        eager = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        s = fewbit.convert_(ddp, bits=2)
        fewbit.convert_(eager, bits=2)
        assert list(s.replaced) == ["module.1"], s
        x, g = torch.randn(3, 8), torch.randn(3, 4)
        grads = []
        for m in (ddp, eager):
            xg = x.clone().requires_grad_(True)
            m(xg).backward(g)
            grads.append(xg.grad)
        assert torch.equal(*grads)
        dist.destroy_process_group()
        print("ok")
    """)
    env = {**__import__("os").environ, "FEWBIT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


class _CallsGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.SiLU()

    def forward(self, x):
        return torch.nn.functional.gelu(self.act(self.fc(x)))


def test_fx_graph_modules():
    """symbolic_trace keeps activation modules as call_module nodes: they are converted;
    activations that are function calls in a graph (symbolic_trace of F.gelu, an exported
    program's aten.gelu) cannot be, and are listed instead of silently ignored."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_CallsGelu())
    ref = copy.deepcopy(gm)
    s = convert_(gm)
    assert list(s.replaced) == ["act"] and type(gm.act) is fm.SiLU
    assert list(s.unsupported) == ["gelu"]
    assert ".gelu (a function call in a torch.fx graph" in s.unsupported["gelu"]  # torch._C._nn.gelu
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), ref(x))
    exported = torch.export.export(_CallsGelu(), (x,)).module()
    s = convert_(exported)
    assert s.replaced == {}
    assert sorted(s.unsupported) == ["gelu", "silu"], s.unsupported
    assert s.unsupported["gelu"].startswith("aten.gelu.default (a function call in a torch.fx graph")


def test_exported_program_is_refused_with_a_hint():
    ep = torch.export.export(_CallsGelu(), (torch.randn(3, 4),))
    with pytest.raises(TypeError, match="torch.export program is not a module"):
        convert_(ep)


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
    with pytest.raises(ValueError, match=r"^bits must be an integer in 1\.\.8, got 9"):  # the argument's own name
        convert_(nn.ReLU(), bits=9)
    with pytest.raises(TypeError, match="filter_fn"):
        convert_(nn.ReLU(), filter_fn=3)


@pytest.mark.parametrize("field,value", [
    ("activation_bits", 0), ("activation_bits", 9), ("activation_bits", 2.0), ("activation_bits", True),
    ("saved_bits", 3), ("saved_bits", 16), ("group_size", 0), ("group_size", 2**63), ("min_numel", -1),
    ("layers", ("linear", "mlp")), ("layers", 5), ("stochastic", "yes"),
])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_config_layers_normalised_and_frozen():
    assert Config(layers="all").layers == ("linear", "conv", "norm", "attention", "block")
    assert Config(layers=["norm", "linear", "norm"]).layers == ("linear", "norm")
    assert Config(layers=()).layers == ()  # nothing compressed: without saved_bits, fine


@pytest.mark.parametrize("layers, needle", [
    ((), "at least one"), ([], "at least one"),  # compressed 0 modules, silently
    ({"linear": 0}, "got {'linear': 0}"), ({"linear"}, "got {'linear'}"),  # a dict, a set: taken by iteration
    (b"linear", "got b'linear'"),  # was shown as [108, 105, ...]
])
def test_config_layers_that_select_nothing_or_are_not_a_sequence_are_refused(layers, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Config(saved_bits=4, layers=layers)


def test_block_layers_of_a_model_without_repeated_blocks_are_refused_before_any_change():
    """``layers=("block",)`` on a model without repeated blocks compressed nothing, silently."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"layers=\('block',\) .* has none"):
        convert_(model, Config(activation_bits=3, saved_bits=4, layers="block"))
    assert type(model[1]) is nn.GELU and not model._forward_pre_hooks  # nothing changed
    with pytest.raises(Exception):
        Config().activation_bits = 4  # frozen
    assert fewbit.Config is Config and fewbit.convert_ is convert_


def test_layer_kinds():
    assert layer_kind(nn.Linear(2, 2)) == "linear"
    assert layer_kind(nn.Conv2d(1, 1, 3)) == "conv" and layer_kind(nn.ConvTranspose1d(1, 1, 3)) == "conv"
    assert layer_kind(nn.BatchNorm1d(3)) == "norm" and layer_kind(nn.GroupNorm(1, 2)) == "norm"
    assert layer_kind(nn.MultiheadAttention(4, 2)) == "attention"
    assert layer_kind(nn.GELU()) is None and layer_kind(fm.GELU()) is None


@needs_transformers
def test_layer_kind_of_transformers_conv1d():
    from transformers.pytorch_utils import Conv1D

    assert layer_kind(Conv1D(4, 2)) == "linear"


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

    if transformers is None:
        raise SystemExit("this report builds GPT-2 / BERT: pip install 'fewbit[hf]'")
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


HF_CLASSES = [  # (class, kwargs, repr of the fewbit module, table it uses)
    ("GELUActivation", {}, "GELU(approximate='none', bits=3)", "gelu"),
    ("GELUActivation", {"use_gelu_python": True}, "FormulaActivation('gelu_python', bits=3)", "gelu"),
    ("GELUTanh", {}, "GELU(approximate='tanh', bits=3)", "gelu_tanh"),
    ("GELUTanh", {"use_gelu_tanh_python": True}, "FormulaActivation('gelu_python_tanh', bits=3)", "gelu_tanh"),
    ("PytorchGELUTanh", {}, "GELU(approximate='tanh', bits=3)", "gelu_tanh"),
    ("NewGELUActivation", {}, "FormulaActivation('gelu_new', bits=3)", "gelu_tanh"),
    ("AccurateGELUActivation", {}, "FormulaActivation('gelu_accurate', bits=3)", "gelu_tanh"),
    ("FastGELUActivation", {}, "FormulaActivation('gelu_fast', bits=3)", "gelu_tanh"),
    ("QuickGELUActivation", {}, "QuickGELU(bits=3)", "quick_gelu"),
    ("SiLUActivation", {}, "SiLU(bits=3)", "silu"),
    ("MishActivation", {}, "Mish(bits=3)", "mish"),
    ("BloomGelu", {}, "FormulaActivation('bloom_gelu', bits=3)", "gelu_tanh"),  # transformers.models.bloom
]


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,kwargs,expected,table", HF_CLASSES, ids=lambda v: str(v) if isinstance(v, dict) else v)
def test_transformers_activation_classes(name, kwargs, expected, table, dtype):
    """Each replaced HF class is computed bit for bit (with and without autograd), and its
    gradient is ``grad * values[code(x)]`` of the table of the function it computes."""
    acts = pytest.importorskip("transformers.activations")
    if name == "BloomGelu":  # BLOOM's own module (a custom autograd Function of the formula)
        acts = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    if not hasattr(acts, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    old = getattr(acts, name)(**kwargs)
    model = nn.Sequential(nn.Identity(), old)
    s = convert_(model)
    assert s.replaced == {"1": (type(old).__name__, expected)}  # 5.x: PytorchGELUTanh is GELUTanh
    x = torch.cat([torch.linspace(-8, 8, 4097, dtype=torch.float64), torch.randn(4096, dtype=torch.float64) * 3])
    x = x.to(dtype)
    y_ref = old(x)
    assert torch.equal(model(x), y_ref)  # no autograd: the formula itself
    xg = x.clone().requires_grad_(True)
    y = model(xg)
    assert torch.equal(y.detach(), y_ref)  # few-bit autograd path: the same bits
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    y.backward(g)
    from fewbit.ops import decode_mul_reference, encode_reference

    t = FF.load_table(table, 3)
    want = decode_mul_reference(g, encode_reference(x, t.borders, t.codes, 3), t.values, 3)
    assert torch.equal(xg.grad, want)


@needs_transformers
@pytest.mark.parametrize("name,kwargs,attr,value,why", [
    ("AccurateGELUActivation", {}, "precomputed_constant", 0.8, "precomputed_constant=0.8 is not sqrt(2/pi)"),
    ("GELUActivation", {}, "act", torch.tanh, "neither F.gelu nor _gelu_python"),
    ("GELUTanh", {}, "act", torch.tanh, "neither F.gelu(approximate='tanh') nor _gelu_tanh_python"),
    ("MishActivation", {}, "act", torch.tanh, "not F.mish"),
    ("NewGELUActivation", {}, "forward", lambda x: x, "forward was replaced on the instance"),
])
def test_transformers_modules_computing_something_else_are_left_alone(name, kwargs, attr, value, why):
    """An HF module whose instance computes another expression (changed constant, other act,
    a forward replaced e.g. by a hub kernel) is not replaced by the class's formula."""
    acts = pytest.importorskip("transformers.activations")
    old = getattr(acts, name)(**kwargs)
    setattr(old, attr, value)
    model = nn.Sequential(nn.Identity(), old)
    s = convert_(model)
    assert model[1] is old and s.replaced == {}
    assert s.unsupported["1"].startswith(name) and why in s.unsupported["1"]


# Weights 10x larger than the configs' default initializer_range (0.02), so activation inputs
# spread over a few units, where the formulas' roundings differ (with |x| < 0.5 the
# gelu_new formula and F.gelu(approximate='tanh') happen to agree on every float32).
_INIT = 0.2


def _hf_models():
    """Tiny configs (no download) covering every activation Hugging Face configs name."""
    if transformers is None:
        return []
    T = transformers
    out = []
    for act in ["gelu_new", "gelu", "gelu_fast", "gelu_accurate", "gelu_python", "gelu_python_tanh",
                "gelu_pytorch_tanh", "quick_gelu", "silu", "mish", "relu"]:
        out.append((f"gpt2-{act}", lambda act=act: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, activation_function=act,
            initializer_range=_INIT))))
    for act in ["gelu", "gelu_new", "swish"]:
        out.append((f"bert-{act}", lambda act=act: T.BertForMaskedLM(T.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, hidden_act=act, initializer_range=_INIT))))
    out.append(("llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, initializer_range=_INIT))))
    out.append(("vit", lambda: T.ViTModel(T.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, initializer_range=_INIT), add_pooling_layer=False)))
    return out


@needs_transformers
@pytest.mark.parametrize("make", [m for _, m in _hf_models()], ids=[n for n, _ in _hf_models()])
def test_converted_transformers_logits_bit_identical(make):
    """convert_ changes no bit of a Hugging Face model's output, in autograd mode (the few-bit
    path) and under no_grad, and the model still trains (every activation is fewbit's)."""
    torch.manual_seed(0)
    ref = make().eval()
    model = copy.deepcopy(ref)
    if isinstance(ref, transformers.ViTModel):
        x = torch.randn(2, 3, 8, 8)
    else:
        x = torch.randint(0, 64, (2, 16))
    s = convert_(model)
    assert s.replaced and not s.unsupported, str(s)
    acts = [m for m in model.modules() if type(m).__module__ == "transformers.activations"]
    assert acts == [], acts  # every HF activation module was replaced
    y0 = _loss(ref, x)
    y1 = _loss(model, x)
    assert torch.equal(y1, y0)
    with torch.no_grad():
        assert torch.equal(_loss(model, x), _loss(ref, x))
    # and it trains: the few-bit gradient points where torch's does
    y0.float().pow(2).mean().backward()
    y1.float().pow(2).mean().backward()
    g0, g1 = ([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None] for m in (ref, model))
    assert len(g1) == len(g0) > 0
    assert _cos(torch.cat(g1), torch.cat(g0)) > 0.95


@needs_transformers
@pytest.mark.parametrize("make", [m for _, m in _hf_models()], ids=[n for n, _ in _hf_models()])
def test_bare_compress_block_keeps_transformers_outputs_bit_identical(make):
    """A bare ``fewbit.compress_activations`` block around a Hugging Face model (no
    conversion: its functional activations, ``x ** 3`` GELUs, norms and attention go through
    the compressor's torch function mode) changes no bit of the output, and at 8 bits the
    gradient is torch's up to the quantization noise."""
    torch.manual_seed(0)
    model = make().eval()  # no dropout; autograd records as in training
    x = torch.randn(2, 3, 8, 8) if isinstance(model, transformers.ViTModel) else torch.randint(0, 64, (2, 16))
    y0 = _loss(model, x)
    y0.float().pow(2).mean().backward()
    g0 = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    comp = fewbit.compress_activations(8, min_numel=0)
    with comp:
        y1 = _loss(model, x)
    assert torch.equal(y1, y0)
    y1.float().pow(2).mean().backward()
    g1 = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert comp.stats.compressed > 0 and torch.isfinite(g1).all()
    assert _cos(g1, g0) > 0.99


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_converted_gpt2_logits_bit_identical_in_other_dtypes(dtype):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32, initializer_range=_INIT)
    ref = transformers.GPT2LMHeadModel(cfg).eval().to(dtype)
    model = copy.deepcopy(ref)
    convert_(model)
    x = torch.randint(0, 100, (2, 32))
    assert torch.equal(_loss(model, x), _loss(ref, x))


@needs_transformers
@pytest.mark.parametrize("name", ["ClippedGELUActivation", "LaplaceActivation", "ReLUSquaredActivation",
                                  "SqrtSoftplusActivation"])
def test_transformers_unsupported_listed(name):
    acts = pytest.importorskip("transformers.activations")
    cls = getattr(acts, name)
    old = cls(-10, 10) if name == "ClippedGELUActivation" else cls()
    model = nn.Sequential(nn.Linear(2, 2), old)
    s = convert_(model)
    assert s.unsupported == {"1": name} and model[1] is old and s.replaced == {}


@pytest.mark.parametrize("kwargs, match", [
    ({"saved_bits": "auto"}, "average_bits must be a number in \\[1, 32\\]"),
    ({"saved_bits": "auto", "average_bits": 0.5}, "average_bits must be a number in \\[1, 32\\]"),
    ({"saved_bits": 4, "average_bits": 2}, "average_bits is only used with saved_bits='auto'"),
    ({"saved_bits": "four"}, "saved_bits must be one of"),
    ({"saved_bits": 4, "compressor": "zip"}, "compressor must be one of"),
    ({"saved_bits": "auto", "average_bits": 2, "compressor": "division"}, "compressor must be 'group'"),
    ({"saved_bits": 4, "adapt_interval": 0}, "adapt_interval"),
    ({"saved_bits": "auto", "average_bits": 2, "adapt_interval": 0}, "adapt_interval"),
    # GACT's settings and a compressor given for nothing were accepted and ignored
    ({"saved_bits": 4, "adapt_interval": 5}, "adapt_interval is only used with saved_bits='auto'"),
    ({"noise_norm": "absolute"}, "noise_norm is only used with saved_bits='auto'"),
    ({"compressor": "division"}, "compressor is only used with saved_bits set"),
    ({"saved_bits": "auto", "average_bits": 2, "noise_norm": "l2"}, "noise_norm"),
    # accepted once, then the first forward failed inside the q/k/v quantizer
    ({"saved_bits": 1, "compressor": "adacc"}, "saved_bits must be one of \\(2, 4, 8\\) with compressor='adacc'"),
    # DIVISION and Adacc round stochastically whatever the flag said
    ({"saved_bits": 2, "compressor": "division", "stochastic": False},
     "stochastic=False \\(nearest rounding\\) is only used with compressor='group', got compressor='division'"),
    ({"saved_bits": 4, "compressor": "adacc", "stochastic": False}, "stochastic=False .*compressor='adacc'"),
])
def test_config_compression_policy_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(**kwargs)


def test_reconversion_replaces_policy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    x = torch.randn(64, 64) * 1.0
    first = convert_(model, Config(saved_bits="auto", average_bits=2, min_numel=0))
    second = convert_(model, Config(saved_bits=8, min_numel=0))
    assert second.compressor is not first.compressor
    assert sum(type(h).__name__ == "_StepHook" for h in model._forward_pre_hooks.values()) == 1
    model(x.requires_grad_()).sum().backward()
    assert not first.compressor.records
    assert [r.bits for r in second.compressor.records.values()] == [8]


# ----------------------------------------------------- activations called as functions


class _FunctionalMLP(nn.Module):
    """Activations called as functions in forward: no module for convert_ to replace."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = F.gelu(self.a(x))
        h = F.leaky_relu(self.b(h), 0.2)
        h = torch.relu_(self.c(h))  # in place, on a non-leaf
        return self.d(h.sigmoid() * F.silu(h))  # sigmoid: a gate, left to torch


class _ExplicitMLP(_FunctionalMLP):
    """The same forward written with fewbit.functional at 3 bits."""

    def forward(self, x):
        h = FF.gelu(self.a(x), bits=3)
        h = FF.leaky_relu(self.b(h), 0.2)
        h = FF.relu(self.c(h), inplace=True)
        return self.d(h.sigmoid() * FF.silu(h, bits=3))


def _weight_grads(model, x):
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_activations_called_as_functions_run_as_fewbit():
    """convert_ reaches activations a forward calls as functions: the output is torch's bit
    for bit, the gradients those of the same forward written with fewbit.functional, and
    what is saved for them is a 3-bit (1-bit for stepwise) code instead of a float tensor.
    Before, they stayed torch's: exact gradients, full tensors saved."""
    torch.manual_seed(0)
    ref = _FunctionalMLP()
    model = copy.deepcopy(ref)
    summary = convert_(model)
    assert summary.functional_bits == 3 and "called as functions" in str(summary)
    explicit = _ExplicitMLP()
    explicit.load_state_dict(ref.state_dict())
    x = torch.randn(32, 16)
    assert torch.equal(model(x), ref(x))
    for got, want in zip(_weight_grads(model, x), _weight_grads(explicit, x)):
        assert torch.equal(got, want)
    from fewbit import memory as fmem

    loss = lambda o: o.pow(2).sum()  # noqa: E731
    saved = fmem.saved_tensor_report(model, x, loss_fn=loss).saved_bytes
    assert saved == fmem.saved_tensor_report(explicit, x, loss_fn=loss).saved_bytes
    assert saved < fmem.saved_tensor_report(ref, x, loss_fn=loss).saved_bytes - 3 * 32 * 64 * 4 * 3 // 4


class _OneCall(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.fc, self.call = nn.Linear(8, 8), call

    def forward(self, x):
        return self.call(self.fc(x))


#: Calls torch takes with parameters fewbit.functional refuses (or where torch raises
#: its own error): in a converted model they are torch's calls, result and error alike.
TORCH_ONLY_CALLS = {
    "leaky_relu slope nan": lambda h: F.leaky_relu(h, float("nan")),
    "threshold value -inf": lambda h: F.threshold(h, 0.1, float("-inf")),
    "threshold nan": lambda h: F.threshold(h, float("nan"), 0.0),
    "hardshrink lambd -1": lambda h: F.hardshrink(h, -1.0),
    "celu alpha -1": lambda h: F.celu(h, alpha=-1.0),  # f' = exp(-x): no table approximates it
    "celu alpha 0": lambda h: F.celu(h, alpha=0.0),  # torch raises
    "softshrink lambd -1": lambda h: F.softshrink(h, -1.0),  # torch raises
    "gelu approximate foo": lambda h: F.gelu(h, approximate="foo"),  # torch raises
    # torch's own signatures, not F's: aten::elu(self, alpha, scale, input_scale) took
    # ``scale`` for ``inplace`` (half the output, silently); silu and gelu raise TypeError
    "elu scale 2": lambda h: torch._C._nn.elu(h, 1.0, 2.0),
    "elu input_scale 0.5": lambda h: torch._C._nn.elu(h, 1.0, 1.0, 0.5),
    "elu_ scale 2": lambda h: torch._C._nn.elu_(h * 1, 1.0, 2.0),
    "silu inplace by position": lambda h: torch._C._nn.silu(h, True),  # torch raises
    "gelu approximate by position": lambda h: F.gelu(h, "tanh"),  # torch raises
    "relu inplace keyword": lambda h: torch.relu(h, inplace=True),  # torch raises
}


@pytest.mark.parametrize("name", list(TORCH_ONLY_CALLS))
def test_functional_calls_fewbit_refuses_stay_torch_calls(name):
    """Output and gradient bit for bit torch's, or torch's own error. Before: fewbit's
    ValueError inside a forward torch runs (threshold, leaky_relu, hardshrink), a
    ValueError instead of torch's RuntimeError, and for celu with alpha -1 a fitted table
    whose gradient was 15x off (relative norm), silently."""
    torch.manual_seed(0)
    ref = _OneCall(TORCH_ONLY_CALLS[name])
    model = copy.deepcopy(ref)
    convert_(model)
    x = torch.randn(4, 8)
    try:
        want = ref(x)
    except (RuntimeError, TypeError) as exc:
        with pytest.raises(type(exc), match=re.escape(str(exc).splitlines()[0])):
            model(x)
        return
    got = model(x)
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    for a, b in zip(_weight_grads(model, x), _weight_grads(ref, x)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_aten_elu_at_its_default_scales_is_taken_over_out_of_place():
    """``torch._C._nn.elu(h, 1.0, 1.0)`` (scale and input_scale spelled out at 1) is fewbit's
    elu, out of place: the third argument was bound as ``inplace``, so ``h + elu(h)`` read
    the overwritten ``h`` (0.30 off)."""
    torch.manual_seed(0)
    ref = _OneCall(lambda h: h + torch._C._nn.elu(h, 1.0, 1.0))
    model = copy.deepcopy(ref)
    summary = convert_(model)
    x = torch.randn(4, 8)
    assert torch.equal(model(x), ref(x))
    assert summary.functional_bits == 3
    from fewbit._activation_calls import bind

    assert bind(torch._C._nn.elu, (x, 1.0, 1.0, 1.0), {}) == {"input": x, "alpha": 1.0}
    assert bind(torch._C._nn.silu, (x, True), {}) is None
    assert bind(torch._C._nn.elu, (x,), {"scale": 2.0}) is None


def test_functional_activation_mode_off_without_such_calls_and_looks_again():
    """A model whose activations are all modules calls no functional activation: the mode
    (about 3 µs per torch call) is turned off after one forward and looked for again at
    forwards 2, 4, 8, ...; a model that calls one keeps it on."""
    from fewbit.convert import _ActivationModeHook

    def hook_of(m):
        return next(h for h in m._forward_pre_hooks.values() if isinstance(h, _ActivationModeHook))

    modules_only = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    convert_(modules_only)
    hook, seen = hook_of(modules_only), []
    x = torch.randn(2, 8)
    for i in range(1, 10):
        before = len(torch.overrides._get_current_function_mode_stack())
        modules_only(x).sum().backward()
        assert len(torch.overrides._get_current_function_mode_stack()) == before
        seen.append(hook.off_until)
    assert seen == [2, 4, 4, 8, 8, 8, 8, 16, 16]  # looked at forwards 1, 2, 4 and 8
    with torch.no_grad():
        modules_only(x)  # forwards without grad neither count nor decide
    assert hook.forwards == 9
    functional = _FunctionalMLP()
    convert_(functional)
    for _ in range(3):
        functional(torch.randn(2, 16)).sum().backward()
    assert hook_of(functional).off_until == 0


def test_functional_activation_hooks_reconvert_copy_and_raise():
    torch.manual_seed(0)
    model = _FunctionalMLP()
    convert_(model)
    convert_(model, Config(activation_bits=2))
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1  # not stacked
    x = torch.randn(4, 16)
    # a copy (deepcopy, pickle) reroutes as the original does
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(torch.equal(a, b) for a, b in zip(_weight_grads(copied, x), _weight_grads(model, x)))
    # a forward that raises leaves no mode behind
    depth = len(torch.overrides._get_current_function_mode_stack())
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 15))
    assert len(torch.overrides._get_current_function_mode_stack()) == depth
    # activation_bits=None, or a filter_fn that leaves the root out, leaves them as they are,
    # as it leaves converted modules (the calls went back to torch while the modules stayed
    # few-bit)
    before = _weight_grads(model, x)
    assert convert_(model, Config(activation_bits=None)).functional_bits == 2
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert convert_(model, filter_fn=lambda m, fqn: fqn != "").functional_bits == 2
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert all(torch.equal(a, b) for a, b in zip(_weight_grads(model, x), before))
    ref = _FunctionalMLP()
    ref.load_state_dict(model.state_dict())
    assert not all(torch.equal(a, b) for a, b in zip(_weight_grads(model, x), _weight_grads(ref, x)))


def test_functional_activations_of_a_converted_submodule_stay_with_activation_bits_none():
    """``convert_(m.enc, bits=4)`` then ``convert_(m, Config(activation_bits=None))``: the
    submodule's calls went back to torch (its hooks removed, only the root's restored)."""
    torch.manual_seed(0)
    model = nn.Sequential(_FunctionalMLP(), nn.Linear(4, 4))
    convert_(model[0], Config(activation_bits=4))
    x = torch.randn(4, 16)
    before = _weight_grads(model, x)
    summary = convert_(model, Config(activation_bits=None))
    assert summary.functional_bits is None  # the root's: none
    assert len(model[0]._forward_pre_hooks) == 1
    assert all(torch.equal(a, b) for a, b in zip(_weight_grads(model, x), before))


class _FailingInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.fail = nn.Linear(16, 64), False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            raise torch.OutOfMemoryError("simulated")
        return F.gelu(h)


class _FailingOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.d = _FailingInner(), nn.Linear(64, 4)

    def forward(self, x):
        return self.d(F.silu(self.enc(x)))


def _functional_bits_seen(model, x, monkeypatch):
    import fewbit._activation_calls as calls

    seen, run = [], calls.run
    monkeypatch.setattr(calls, "run", lambda name, bound, bits: (seen.append((name, bits)), run(name, bound, bits))[1])
    model(x).sum().backward()
    monkeypatch.setattr(calls, "run", run)
    return seen


def test_functional_activation_mode_survives_forwards_that_raise(monkeypatch):
    """Two forwards that raised before any activation call (an out-of-memory error caught
    and retried) counted as forwards without such calls: the mode turned itself off and the
    next step ran torch's activations."""
    torch.manual_seed(0)
    model, x = _FailingOuter(), torch.randn(8, 16)
    convert_(model, Config(activation_bits=3))
    assert _functional_bits_seen(model, x, monkeypatch) == [("gelu", 3), ("silu", 3)]
    model.enc.fail = True
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            model(x)
    model.enc.fail = False
    assert _functional_bits_seen(model, x, monkeypatch) == [("gelu", 3), ("silu", 3)]


def test_a_submodule_left_out_by_filter_fn_keeps_its_functional_bits(monkeypatch):
    """``convert_(m.enc, bits=4)`` then ``convert_(m, bits=2, filter_fn=not enc)``: the
    module activations of ``enc`` stay at 4 bits, and its functional calls went to 2."""
    torch.manual_seed(0)
    model, x = _FailingOuter(), torch.randn(8, 16)
    convert_(model.enc, Config(activation_bits=4))
    convert_(model, Config(activation_bits=2), filter_fn=lambda m, fqn: not fqn.startswith("enc"))
    assert _functional_bits_seen(model, x, monkeypatch) == [("gelu", 4), ("silu", 2)]


def test_functional_activations_compile_fullgraph():
    """Under torch.compile the mode stands aside (no graph break): the compiled graph keeps
    torch's activations; the output is the eager model's."""
    torch.manual_seed(0)
    model = _FunctionalMLP()
    convert_(model)
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_saved_tensor_compression_stands_aside_under_compile_whatever_was_compiled_before():
    """A compiled graph keeps its saved tensors exact, with no graph break and no guard on
    fewbit's state: before, the hooks graph-broke each Linear (13 breaks, 9 frames, recompile
    limit), and a model compiled after another converted instance of its class reused that
    graph (dynamo does not guard module hooks) and compressed nothing, silently. Eager calls
    of the same model compress as before."""
    from torch._dynamo.utils import counters

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.a, self.l2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)

        def forward(self, x):
            return self.l2(self.a(self.l1(x)))

    torch.manual_seed(0)
    vanilla, x = M(), torch.randn(8, 16)
    for compile_another_first in (False, True):
        torch._dynamo.reset()
        counters.clear()
        if compile_another_first:
            other = copy.deepcopy(vanilla)
            convert_(other, bits=3)
            torch.compile(other, backend="aot_eager")(x).sum().backward()
        model, exact = copy.deepcopy(vanilla), copy.deepcopy(vanilla)
        summary = convert_(model, Config(activation_bits=3, saved_bits=2, min_numel=0))
        convert_(exact, Config(activation_bits=3, saved_bits=None))
        compiled = torch.compile(model, backend="aot_eager")
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            compiled(x).square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        assert summary.compressor.stats.compressed == 0
        assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
        exact(x).square().sum().backward()
        for a, b, want in zip(*grads, (p.grad for p in exact.parameters())):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, want)
        model(x).square().sum().backward()  # eager: compressed
        assert summary.compressor.stats.compressed > 0


# ----------------------------------------------------------------------------- layer kind "block"


class _Gated(nn.Module):
    """LLaMA's MLP: ``down(silu(gate(x)) * up(x))``; the product is in the block's own code."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(width, 4 * width), nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.down(self.act(self.gate(x)) * self.up(x))


class _FusedGated(_Gated):
    """Phi-3's and Mixtral's layout: one fused ``gate_up`` projection split with ``chunk``,
    so ``up`` is a strided view (rows of 4 * width with a stride of 8 * width)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__(width)
        del self.gate, self.up
        self.gate_up = nn.Linear(width, 8 * width)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class _GatedNet(nn.Module):
    def __init__(self, block=_Gated) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _gated_grads(model, x, t):
    model.zero_grad()
    F.mse_loss(model(x), t).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_block_kind_compresses_what_blocks_save_in_their_own_code():
    """The product's two factors are saved by the block's own forward, outside every
    linear / norm / attention module: before the ``block`` kind they stayed exact (LLaMA at
    saved_bits=2 kept 0.33 of vanilla's saved bytes; now 0.14)."""
    torch.manual_seed(0)
    x = torch.randn(128, 64)
    ref = _GatedNet()
    vanilla = fewbit.memory.saved_tensor_report(copy.deepcopy(ref), x, loss_fn=lambda y: y.square().mean())
    sizes = {}
    for layers in (("linear", "norm", "attention"), "all"):
        model = copy.deepcopy(ref)
        s = convert_(model, Config(activation_bits=3, saved_bits=2, layers=layers, min_numel=0))
        rep = fewbit.memory.saved_tensor_report(model, x, loss_fn=lambda y: y.square().mean())
        sizes[layers] = rep.saved_bytes
    assert s.compressed["layers.0"] == s.compressed["layers.1"] == "block"
    factors = 2 * 2 * 128 * 256 * 4  # two blocks, two factors of 128 x 256 float32
    assert sizes[("linear", "norm", "attention")] - sizes["all"] > 0.8 * factors
    assert sizes["all"] < 0.15 * vanilla.saved_bytes


def test_block_kind_compresses_strided_halves_of_fused_projections():
    """``up``, half of a fused projection split with ``chunk``, is a strided view that does
    not overlap itself: it is compressed like any other tensor, which frees the projection's
    whole output (its other half is stored as few-bit codes). It was kept exact (reason
    ``layout``) with that whole output: 0.57 of vanilla's saved bytes against 0.13 with
    separate projections (now 0.13 for both)."""
    torch.manual_seed(0)
    x = torch.randn(128, 64)
    ref = _GatedNet(_FusedGated)
    vanilla = fewbit.memory.saved_tensor_report(copy.deepcopy(ref), x, loss_fn=lambda y: y.square().mean())
    s = convert_(ref, Config(activation_bits=3, saved_bits=2, min_numel=0))
    rep = fewbit.memory.saved_tensor_report(ref, x, loss_fn=lambda y: y.square().mean())
    assert "layout" not in s.compressor.stats.skipped
    assert rep.saved_bytes < 0.15 * vanilla.saved_bytes, (rep.saved_bytes, vanilla.saved_bytes)


@pytest.mark.parametrize("block", [_Gated, _FusedGated], ids=["separate", "fused"])
def test_block_kind_gradient_is_unbiased(block):
    """200 draws of the whole gradient of two gated blocks at 2 bits (the factors compressed in
    the blocks' own code, SiLU few-bit; with a fused ``gate_up``, ``up`` is a strided view):
    the mean, projected on 5 random directions, within 3 standard errors of the gradient
    with exact factors."""
    torch.manual_seed(0)
    model = _GatedNet(block)
    x, t = torch.randn(256, 64), torch.randn(256, 64)
    exact_model = copy.deepcopy(model)
    convert_(exact_model, Config(activation_bits=3, saved_bits=None))  # few-bit SiLU only: deterministic
    exact = _gated_grads(exact_model, x, t)
    convert_(model, Config(activation_bits=3, saved_bits=2, min_numel=0))
    fewbit.convert.compressor_of(model).generator = torch.Generator().manual_seed(1)
    draws = torch.stack([_gated_grads(model, x, t) for _ in range(200)])
    assert not torch.equal(draws[0], draws[1])  # stochastic: something was compressed
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        u = torch.randn(exact.numel(), generator=gen)
        proj = draws @ u
        assert abs(float(proj.mean() - exact @ u)) <= 3 * float(proj.std()) / len(proj) ** 0.5
    mean_err = (draws.mean(0) - exact).norm()
    noise = (draws.std(0) / len(draws) ** 0.5).norm()
    assert mean_err < 1.2 * noise, (float(mean_err), float(noise))


def test_compressed_layers_leave_torch_inference_fast_paths_alone():
    """Under no_grad / inference_mode nothing is saved, so the compressor is not entered: its
    torch-function mode had turned off ``nn.TransformerEncoder``'s fast path, whose nested
    tensors (a padding mask) then failed outside it ("MultiheadAttention does not support
    NestedTensor outside of its fast path"); without nested tensors the output differed from
    torch's by ~7e-7. Training forwards still compress."""
    import copy

    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                enable_nested_tensor=True)
    conv = copy.deepcopy(enc)
    summary = convert_(conv, Config(saved_bits=4, min_numel=0))
    enc.eval(), conv.eval()
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -2:] = True
    with torch.no_grad():
        assert torch.equal(conv(x, src_key_padding_mask=pad), enc(x, src_key_padding_mask=pad))
    layer, conv_layer = enc.layers[0], conv.layers[0]
    with torch.inference_mode():
        assert torch.equal(conv_layer(x), layer(x))
    assert summary.compressor.stats.compressed == 0
    conv.train()
    conv(x.requires_grad_()).sum().backward()
    assert summary.compressor.stats.compressed > 0


def test_hooks_and_attributes_of_replaced_activations_carry_over():
    """A replaced activation's hooks and the attributes set on it once vanished: a forward
    hook that changed the output no longer ran, so the converted model's forward differed."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    calls = []
    model[1].register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    model[1].register_forward_hook(lambda mod, args, out: out * 2)
    model[1].register_full_backward_hook(lambda mod, gin, gout: calls.append(type(mod).__name__))
    model[1].tag = "mlp act"
    converted = copy.deepcopy(model)
    summary = convert_(converted, bits=3)
    assert summary.replaced and isinstance(converted[1], fewbit.GELU) and converted[1].tag == "mlp act"
    x = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(converted(x), model(x))
    converted(x).sum().backward()
    assert calls == ["GELU"]  # the backward hook ran, on the replacement (converted[1])
    # handles taken before the conversion still remove the hooks
    model2 = nn.Sequential(nn.GELU())
    h = model2[0].register_forward_hook(lambda mod, args, out: out * 0)
    convert_(model2, bits=3)
    assert not torch.equal(model2(x), torch.nn.functional.gelu(x)) and (model2(x) == 0).all()
    h.remove()
    assert torch.equal(model2(x), torch.nn.functional.gelu(x))
    # state_dict's and load_state_dict's hooks too (they were dropped, review h72)
    model3 = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    log = []
    model3[1].register_state_dict_pre_hook(lambda mod, prefix, keep_vars: log.append("state_dict_pre"))
    model3[1].register_state_dict_post_hook(lambda mod, sd, prefix, local: log.append("state_dict_post"))
    model3[1].register_load_state_dict_pre_hook(lambda mod, sd, prefix, *rest: log.append(mod is model3[1]))
    model3[1].register_load_state_dict_post_hook(lambda mod, incompatible: log.append("load_post"))
    convert_(model3, bits=3)
    model3.load_state_dict(model3.state_dict())
    assert log == ["state_dict_pre", "state_dict_post", True, "load_post"]  # the pre-hook gets the replacement


def test_parameters_buffers_and_submodules_of_replaced_activations_carry_over():
    """Parameters, buffers and submodules registered on a replaced activation were dropped:
    ``state_dict()`` lost their keys, ``parameters()`` one tensor, and an earlier checkpoint
    no longer loaded. They move to the replacement, the same tensors."""
    act = nn.GELU()
    act.register_buffer("scale", torch.tensor(2.0))
    act.register_buffer("scratch", torch.zeros(2), persistent=False)
    act.register_parameter("p", nn.Parameter(torch.ones(3)))
    act.add_module("probe", nn.Identity())
    model = nn.Sequential(nn.Linear(4, 4), act)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    convert_(model, bits=3)
    assert isinstance(model[1], fewbit.GELU)
    assert list(model.state_dict()) == list(before) == ["0.weight", "0.bias", "1.p", "1.scale"]
    assert [id(p) for p in model.parameters()] == params
    assert model[1].scratch.shape == (2,) and isinstance(model[1].probe, nn.Identity)
    model.load_state_dict(before)  # an earlier checkpoint loads
    # a registered name the replacement uses itself ("bits") would be dropped: left as it is
    act = nn.GELU()
    act.register_buffer("bits", torch.tensor(3))
    model = nn.Sequential(nn.Linear(4, 4), act)
    s = convert_(model, bits=3)
    assert model[1] is act and s.unsupported == {"1": "GELU (it holds 'bits', a name its fewbit replacement uses)"}


def test_a_replaced_activation_is_not_kept_alive_by_its_own_methods():
    """transformers' ``GELUActivation(use_gelu_python=True)`` sets ``self.act =
    self._gelu_python``. Carried over as an attribute, that bound method kept the replaced
    module alive, and pickled it with the converted model."""
    import gc
    import pickle
    import weakref

    transformers = pytest.importorskip("transformers")
    act = transformers.activations.GELUActivation(use_gelu_python=True)
    act.tag = "mlp act"  # what the user set still carries over
    model = nn.Sequential(nn.Linear(4, 4), act)
    replaced = weakref.ref(act)
    del act
    convert_(model, bits=3)
    gc.collect()
    assert replaced() is None and model[1].tag == "mlp act" and not hasattr(model[1], "act")
    assert b"GELUActivation" not in pickle.dumps(model)


@pytest.mark.parametrize("bits", [0, 9, 2.5, True])
def test_convert_bits_shorthand_names_its_own_argument(bits):
    """``convert_(model, bits=0)`` named ``activation_bits`` (Config's field) in its error."""
    with pytest.raises(ValueError, match=r"^bits must be an integer in 1\.\.8"):
        convert_(nn.Sequential(nn.GELU()), bits=bits)
    with pytest.raises(ValueError, match="either config or bits"):
        convert_(nn.Sequential(nn.GELU()), Config(), bits=3)


class _BackboneNet(nn.Module):
    """``head(backbone(x))``; a training loop may call ``backbone`` alone."""

    def __init__(self, act: type = nn.GELU):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 128), act(), nn.Linear(128, 128), act(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_a_submodule_called_by_itself_starts_a_pass():
    """A training loop that calls a submodule of a converted model (``model.backbone(x)``)
    never ran the model's pass hook: the save ordinals never restarted and
    ``compressor.records`` grew by every step (3000 after 3000 steps), so a GACT plan keyed
    by them was never applied. The submodule's first enter now starts a pass."""
    torch.manual_seed(0)
    model = _BackboneNet()
    comp = fewbit.convert_(model, fewbit.Config(saved_bits=4, min_numel=0)).compressor
    x = torch.randn(32, 64)
    for _ in range(5):
        model.backbone(x).pow(2).mean().backward()
        # one pass per step holds every module's saves (a pass per module held the last one's)
        assert {r.fqn for r in comp.records.values()} == {"backbone.2", "backbone.4"}, comp.records
        assert sorted(comp.records) == list(range(len(comp.records)))
    n_backbone = len(comp.records)
    model(x).sum().backward()  # the whole model: one pass, its own
    assert len(comp.records) > n_backbone and "head" in {r.fqn for r in comp.records.values()}
    model.backbone(x).pow(2).mean().backward()
    assert len(comp.records) == n_backbone


def test_gact_applies_its_plan_to_a_submodule_called_alone():
    """The GACT plan of a model trained through a submodule (``model.backbone(x)``) was
    never applied (no pass restarted the save ordinals), then covered the last module only."""
    torch.manual_seed(0)
    model = _BackboneNet(nn.Tanh)
    comp = fewbit.convert_(model, fewbit.Config(saved_bits="auto", average_bits=2, min_numel=0)).compressor
    x = torch.randn(64, 64)

    def closure():
        return model.backbone(x).pow(2).mean()

    planned = None
    for _ in range(4):
        if comp.adapt(model, closure):
            planned = dict(comp.policy._by_key)  # (fqn, ordinal) -> bits
        closure().backward()
    assert planned, "GACT did not plan"
    used = {(r.fqn, r.bits) for r in comp.records.values()}
    assert {fqn for fqn, _ in planned} == {fqn for fqn, _ in used} == {"backbone.2", "backbone.4"}
    assert used == {(fqn, bits) for (fqn, _), bits in planned.items()}


def test_two_threads_in_one_compressor_raise():
    """``nn.DataParallel``'s replicas share a converted model's compressor and run its
    forward in threads: they popped each other's torch-function modes ('pop from empty mode
    stack') or ran with none, quantizing what must stay exact (input gradients 0.57 off).
    A second thread entering a compressor in use raises a ``RuntimeError`` that says so."""
    import threading

    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    comp = fewbit.convert_(model, fewbit.Config(saved_bits=4, min_numel=0)).compressor
    errors = []
    inside = threading.Event()
    leave = threading.Event()

    def first():
        with comp:
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    try:
        model(torch.randn(4, 16)).sum().backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    finally:
        leave.set()
        t.join()
    assert len(errors) == 1 and "in use by another thread" in errors[0] and "DistributedDataParallel" in errors[0]
    model(torch.randn(4, 16)).sum().backward()  # alone again: fine
    assert not comp.active


_RECORD = r"""
import sys, torch
from torch import nn
import fewbit
torch.manual_seed(0)
vanilla = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 4))
model = nn.Sequential(*[m for m in __import__("copy").deepcopy(vanilla)])
fewbit.convert_(model, fewbit.Config(saved_bits=2, min_numel=0))
assert type(model[1]).__module__.startswith("fewbit")
x = torch.randn(8, 16)
if len(sys.argv) > 2:  # a training step first: its calls are cached for the fast path
    model(x.requires_grad_()).sum().backward()
    x = x.detach()
if sys.argv[1] == "trace":
    program = torch.jit.trace(model, (x,))  # torch's check traces again under no_grad
    ops = str(program.inlined_graph)
    y = program(x)
else:
    program = torch.export.export(model, (x,))
    ops = str(program.graph)
    y = program.module()(x)
assert "fewbit::" not in ops and "aten::gelu" in ops.replace("aten.gelu", "aten::gelu"), ops
torch.testing.assert_close(y, vanilla(x), rtol=0, atol=0)
print("OK")
"""


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after a training step"])
@pytest.mark.parametrize("how", ["trace", "export"])
def test_a_converted_model_records_torchs_functions(how, trained):
    """``torch.jit.trace`` of a converted model crashed the process (SIGSEGV) and
    ``torch.export.export`` failed in a fresh process (data-dependent probes of fewbit's
    table set-up): a recorded program now holds torch's functions, outputs bit for bit.
    After a training step, the trace took the cached fast path and its check (traced again
    under no_grad) did not: "Graphs differed across invocations"."""
    import subprocess
    import sys

    args = [how] + (["trained"] if trained else [])
    r = subprocess.run([sys.executable, "-c", _RECORD, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.returncode, r.stderr[-3000:])


def test_fx_symbolic_trace_of_a_converted_model_records_torchs_functions():
    """``torch.fx.symbolic_trace`` (torchvision's feature extractors, ``quantize_fx``) steps
    into fewbit's modules, which are not torch.nn leaves: their functions got a Proxy and
    raised "input must be a torch.Tensor, got Proxy" (review h56). The graph records
    torch's functions, outputs bit for bit."""
    import copy

    torch.manual_seed(0)
    vanilla = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.SiLU(), nn.ELU(alpha=0.5), nn.Linear(32, 4))
    model = copy.deepcopy(vanilla)
    fewbit.convert_(model, fewbit.Config(saved_bits=2, min_numel=0))
    assert type(model[1]).__module__.startswith("fewbit")
    traced = torch.fx.symbolic_trace(model)
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert {F.gelu, F.silu, F.elu} <= targets, targets
    x = torch.randn(8, 16)
    torch.testing.assert_close(traced(x), vanilla(x), rtol=0, atol=0)
    y = FF.activation(torch.randn(3, requires_grad=True), "gelu")  # the generic entry point too
    g = torch.fx.symbolic_trace(lambda t: FF.activation(t, "gelu"))
    torch.testing.assert_close(g(y.detach()), F.gelu(y.detach()), rtol=0, atol=0)


def test_a_module_shared_with_another_converted_model_is_refused():
    """Two models sharing a backbone, converted with different Configs: the second
    conversion took the backbone's hooks over (the first model's forward compressed it at
    the second's 2 bits, unseen by its own compressor; or not at all after a conversion
    with saved_bits=None). It is refused before anything changes; a submodule of a
    converted model converted again on its own, and copies, are still converted."""
    import copy

    backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
    a, b = nn.Sequential(backbone, nn.Linear(32, 4)), nn.Sequential(backbone, nn.Linear(32, 3))
    fewbit.convert_(a, fewbit.Config(activation_bits=None, saved_bits=8, min_numel=0))
    hooks = {k: dict(m._forward_pre_hooks) for k, m in b.named_modules()}
    for config in (fewbit.Config(activation_bits=3, saved_bits=2, min_numel=0), fewbit.Config(activation_bits=None)):
        with pytest.raises(ValueError, match=r"module '0.0' \(Linear\) is compressed by another model"):
            fewbit.convert_(b, config)
        assert {k: dict(m._forward_pre_hooks) for k, m in b.named_modules()} == hooks
        assert isinstance(b[0][1], nn.GELU)  # nothing replaced
    fewbit.convert_(a, fewbit.Config(activation_bits=None))  # the other one without saved_bits first
    fewbit.convert_(b, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=0))

    # a module the other model has let go of (swapped out) is this model's to convert
    part = nn.Sequential(nn.Linear(16, 32), nn.GELU())
    c = nn.Sequential(part, nn.Linear(32, 4))
    fewbit.convert_(c, fewbit.Config(activation_bits=None, saved_bits=8, min_numel=0))
    c[0] = nn.Sequential(nn.Linear(16, 32), nn.GELU())
    d = nn.Sequential(part, nn.Linear(32, 3))
    fewbit.convert_(d, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=0))

    m = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 8))
    fewbit.convert_(m, fewbit.Config(saved_bits=4, min_numel=0))
    fewbit.convert_(m[0], fewbit.Config(saved_bits=8, min_numel=0))  # a submodule again: allowed
    fewbit.convert_(m, fewbit.Config(saved_bits=2, min_numel=0))
    c = copy.deepcopy(m)
    c(torch.randn(2, 8)).sum().backward()
    fewbit.convert_(c, fewbit.Config(saved_bits=8, min_numel=0))


@pytest.mark.parametrize("parametrization", ["weight_norm", "spectral_norm"])
def test_a_parametrized_weight_is_kept_exact(parametrization):
    """A weight computed by a parametrization (``torch.nn.utils.parametrizations``) from
    parameters is kept exact like a parameter: the gradient of the layer before, which
    flows through it and through ReLU's exact mask only, is the unconverted model's bit for
    bit. It was quantized like an activation (0.45 off at 2 bits)."""
    import copy

    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    wrap = getattr(parametrizations, parametrization)
    base = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), wrap(nn.Linear(256, 256)), nn.ReLU(), nn.Linear(256, 8))
    model = copy.deepcopy(base)
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2))
    x = torch.randn(64, 128)
    torch.manual_seed(1)
    want = torch.autograd.grad(base(x).pow(2).mean(), base[0].weight)[0]
    torch.manual_seed(1)
    got = torch.autograd.grad(model(x).pow(2).mean(), model[0].weight)[0]
    assert torch.equal(got, want)
    comp = fewbit.convert.compressor_of(model)
    assert sorted({r.fqn for r in comp.records.values()}) == ["2", "4"]  # the ReLUs' outputs
    assert all(r.shape == (64, 256) for r in comp.records.values())


class _EqualLinear(nn.Linear):
    """An equalized learning rate (ProGAN/StyleGAN): the weight scaled in the forward."""

    def forward(self, x):
        return F.linear(x, self.weight * (1 / 16), self.bias)


def _weight_hook_api(name):
    import torch.nn.utils.prune

    return {
        "weight_norm_hook": nn.utils.weight_norm,  # torch.nn.utils' hook-based API
        "spectral_norm_hook": nn.utils.spectral_norm,
        "prune": lambda layer: nn.utils.prune.l1_unstructured(layer, "weight", 0.5),
        "after_convert": lambda layer: layer,
        "equalized_lr": lambda layer: layer,
        "conv1d_pruned": lambda layer: nn.utils.prune.l1_unstructured(layer, "weight", 0.5),
    }[name]


@pytest.mark.parametrize("how", ["weight_norm_hook", "spectral_norm_hook", "prune", "after_convert", "equalized_lr",
                                 "conv1d_pruned"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_weight_computed_in_the_forward_is_kept_exact(how, autocast):
    """A Linear's weight computed in the forward from parameters, by the hook-based
    ``weight_norm``/``spectral_norm``, by pruning, by an equalized learning rate's scale, or
    by a parametrization added after ``convert_``, is the call's weight: kept exact (and
    its autocast copy). It was quantized like an activation: at 2 bits the first layer's
    weight gradient 0.44-0.56 off its norm (review h56)."""
    from torch.nn.utils import parametrizations

    def build():  # twice alike: the hook-based APIs' modules cannot be deep-copied
        torch.manual_seed(0)
        if how == "conv1d_pruned":  # transformers' Conv1D (GPT-2): torch.addmm(bias, x, weight)
            from transformers.pytorch_utils import Conv1D

            middle = Conv1D(256, 256)
        else:
            middle = _EqualLinear(256, 256) if how == "equalized_lr" else nn.Linear(256, 256)
        m = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), _weight_hook_api(how)(middle), nn.ReLU(), nn.Linear(256, 8))
        return m.eval()  # spectral_norm's power iteration frozen: the two models compute one weight

    base, model = build(), build()
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2))
    if how == "after_convert":
        parametrizations.weight_norm(base[2])
        parametrizations.weight_norm(model[2])
    x = torch.randn(64, 128)
    grads = []
    for m in (base, model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(x).float().pow(2).mean()
        grads.append(torch.autograd.grad(out, m[0].weight)[0])
    assert torch.equal(grads[1], grads[0])  # through the ReLUs' exact masks and exact weights only
    comp = fewbit.convert.compressor_of(model)
    assert sorted({r.fqn for r in comp.records.values()}) == ["2", "4"]  # the ReLUs' outputs
    assert all(r.shape == (64, 256) for r in comp.records.values())


class _GraphLayer(nn.Module):
    """A graph network's aggregation: ``addmm(b, attention, h)``, ``h`` an activation."""

    def __init__(self, features: int):
        super().__init__()
        self.lin, self.b = nn.Linear(features, 128), nn.Parameter(torch.zeros(128))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        attention = torch.softmax(h @ h.t(), dim=-1)
        return torch.addmm(self.b, attention, h)


def test_an_activation_as_addmm_mat2_is_still_compressed():
    """``addmm``'s mat2 is a weight only where it derives from a parameter at least its
    size (a pruned Conv1D's): a graph network's node features (512 x 128, from a 16 x 128
    weight) stay compressed at 2 bits (kept exact, 256 KiB a layer, after b68e7e7; h59)."""
    model = nn.Sequential(_GraphLayer(16), _GraphLayer(128), _GraphLayer(128))
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, layers=("block",)))
    x = torch.randn(512, 16)
    model(x).sum().backward()
    mat2 = [r for r in summary.compressor.records.values() if r.shape == (512, 128) and r.compressor == "group"]
    assert len(mat2) >= 2, summary.compressor.records
    assert summary.compressor.stats.skipped.get("parameter", 0) <= 4  # the Linear weights and biases only


def test_a_converted_parametrized_model_compiles_with_fullgraph():
    """The hook marking a parametrization's weight stands aside while torch.compile traces
    (it read ``grad_fn`` inside the trace: "Tensor with grad_fn()", fullgraph=True failed)."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), parametrizations.weight_norm(nn.Linear(32, 32)), nn.ReLU(),
                          nn.Linear(32, 4))
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=0))
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend="eager")(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())



class _Interruptible(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.interrupt = False

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc(x)))
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return h


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Interruptible()  # a converted "linear"-holding block: the compressor is
        self.head = nn.Linear(16, 16)  # entered by fc and fc2 inside it

    def forward(self, x):
        return self.head(self.inner(x))


def _interrupt_inside_fc2(model, x) -> None:
    """A forward of ``model`` (an ``_Outer``) stopped by a KeyboardInterrupt inside
    ``inner.fc2``'s call, after the compressor's enter hook (Ctrl-C in a notebook)."""
    def interrupt(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = model.inner.fc2.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x)


def test_a_forward_interrupted_by_keyboardinterrupt_leaves_nothing_behind():
    """Ctrl-C inside a converted model's forward skips torch's always-called forward hooks
    (they run for ``Exception`` only): the activation mode, and the compressor's saved-tensor
    hooks and mode when it came inside a compressed layer, stayed on in the thread for good.
    A never-converted model then ran ``F.gelu`` few-bit and had its saves quantized (a weight
    gradient 0.43 off at 2 bits), and the converted model never started a new pass. Now the
    first fewbit hook, pack hook or activation call that sees the leftover leaves it."""
    from torch.overrides import _get_current_function_mode_stack

    model = _Outer()
    fewbit.convert_(model, fewbit.Config(activation_bits=2, saved_bits=2, min_numel=0, layers=("linear",)))
    comp = fewbit.convert.compressor_of(model)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    _interrupt_inside_fc2(model, x)
    assert comp.active  # left over until something of fewbit's sees it

    plain = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    ref = copy.deepcopy(plain)
    h = F.gelu(plain[0](x))
    assert "fewbit" not in type(h.grad_fn).__name__.lower(), type(h.grad_fn).__name__
    y = plain[2](h)
    y.sum().backward()
    ref[2](F.gelu(ref[0](x))).sum().backward()
    assert torch.equal(plain[0].weight.grad, ref[0].weight.grad)  # nothing quantized
    assert not comp.active
    before = comp.stats.compressed
    for _ in range(2):
        model(x).sum().backward()
    assert comp.stats.compressed > before and not comp.active
    assert len(comp.records) == 2  # a pass per step again (fc's and fc2's inputs)
    assert not [m for m in _get_current_function_mode_stack() if type(m).__name__ in ("ActivationMode", "CompressionMode")]


def test_a_recursive_forward_keeps_its_activation_mode():
    """A module calling itself inside its forward keeps the outer call's mode (only modes of
    forwards that stopped without their exit hook are left)."""

    class Recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, depth=3):
            if depth:
                x = self(x, depth - 1)
            return F.gelu(self.fc(x))

    model = Recursive()
    fewbit.convert_(model, bits=2)
    y = model(torch.randn(2, 8, requires_grad=True))
    names, fn = [], y.grad_fn
    while fn is not None:
        names.append(type(fn).__name__)
        nxt = [f for f, _ in fn.next_functions if f is not None and "AccumulateGrad" not in type(f).__name__]
        fn = nxt[0] if nxt else None
    assert sum("FewBit" in n for n in names) == 4, names


def test_after_an_interrupt_an_evaluation_forward_runs_and_nothing_is_pinned():
    """After Ctrl-C inside a compressed layer: a forward under ``no_grad`` (evaluation) ran
    the layer's exit hook on a compressor already left ("__exit__ without a matching
    __enter__"); after it, the interrupted call's frame, kept to tell leftovers, holds
    neither the caller's batch nor the model."""
    import gc
    import weakref

    model = _Outer()
    fewbit.convert_(model, fewbit.Config(activation_bits=2, saved_bits=2, min_numel=0, layers=("linear",)))

    def interrupt(module, args):
        if model.inner.interrupt:
            raise KeyboardInterrupt

    model.inner.fc2.register_forward_pre_hook(interrupt)

    def train():
        batch = torch.randn(64, 16, requires_grad=True)
        model.inner.interrupt = True
        try:
            model(batch)
        except KeyboardInterrupt:
            pass
        model.inner.interrupt = False
        return weakref.ref(batch)

    batch = train()
    with torch.no_grad():
        model(torch.randn(4, 16))
    gc.collect()
    assert batch() is None  # fewbit's record of the interrupted call is gone with its leftovers
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_an_interrupts_leftover_under_a_users_hooks_is_taken_off():
    """The leftover of a Ctrl-C inside a compressed layer is left at the next fewbit hook;
    when a user's saved-tensor hooks had been entered since, it popped only from the top,
    stopped at the user's pair and forgot its own below: every later model's saves were
    quantized for good."""
    model = _Outer()
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=0, layers=("linear",)))
    x = torch.randn(4, 16, requires_grad=True)
    _interrupt_inside_fc2(model, x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        model(x).sum().backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    plain = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    ref = copy.deepcopy(plain)
    plain(x).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(plain[0].weight.grad, ref[0].weight.grad)


@pytest.mark.parametrize("saved_bits", [None, 2])
def test_an_interrupt_inside_a_users_compress_activations_block_leaves_the_block(saved_bits):
    """A user's ``with fewbit.compress_activations()`` around a converted model's step, Ctrl-C
    inside the forward: the block's exit popped the top of torch's stacks, the converted
    model's left-over mode or saved-tensor hooks, and the user's own stayed on for good (with
    ``saved_bits``, a plain model's saves quantized after it: its weight gradient 0.01 off).
    The block leaves its own, wherever they sit; the model's leftover goes at its next hook."""
    from torch.overrides import _get_current_function_mode_stack

    model = _Outer()
    fewbit.convert_(model, fewbit.Config(activation_bits=2, saved_bits=saved_bits, min_numel=0, layers=("linear",)))
    x = torch.randn(4, 16, requires_grad=True)
    user = fewbit.compress_activations(2, min_numel=0)

    def interrupt(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = model.inner.fc2.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), user:
        model(x)
    assert not user.active
    assert not [m for m in _get_current_function_mode_stack() if getattr(m, "compressor", None) is user]
    plain = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    ref = copy.deepcopy(plain)
    packed = user.stats.compressed
    plain(x).sum().backward()
    ref(x).sum().backward()
    assert user.stats.compressed == packed
    assert torch.equal(plain[0].weight.grad, ref[0].weight.grad)
    model(x).sum().backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not [m for m in _get_current_function_mode_stack() if type(m).__name__ in ("ActivationMode", "CompressionMode")]


def test_a_compiled_converted_model_compiles_once():
    """The per-thread record of a converted model's running forwards was made on first use,
    so torch.compile's guard on it failed at the second call and the model was compiled again."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    convert_(model, Config(saved_bits=4, min_numel=0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(8, 16)
    compiled(x).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_a_users_saved_tensor_hooks_get_what_fewbit_keeps_exact():
    """torch applies the innermost saved-tensor hooks only: a user's pair around a converted
    model (``save_on_cpu``) had seen none of the tensors saved inside its compressed layers,
    2 of 12 here. What fewbit keeps exact goes through the user's pair now (packed and
    unpacked once each); what it compresses stays its own; the gradients are those of the
    same step without the user's pair, bit for bit (the few-bit GELU's codes are saved
    outside the compressor: the user's pair sees them as torch's GELU's input)."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1))

    x = torch.randn(128, 64, requires_grad=True)
    seen = []

    def pack(t):
        seen.append(t)
        return len(seen) - 1

    unpacked = []

    def unpack(i):
        unpacked.append(i)
        return seen[i]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        make()(x).sum().backward()
    plain = len(seen)
    grads = {}
    for users in (False, True):
        seen.clear()
        unpacked.clear()
        model = make()
        comp = fewbit.convert_(model, fewbit.Config(activation_bits=3, saved_bits=4, min_numel=0)).compressor
        fewbit.quant.manual_seed(1)  # the same noise in both runs
        if users:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                y = model(x)
        else:
            y = model(x)
        y.sum().backward()
        grads[users] = [p.grad for p in model.parameters()]
    assert comp.stats.compressed > 0
    kept = sum(comp.stats.skipped.values())
    assert kept > 0 and len(seen) == plain - comp.stats.compressed + 1  # the GELU's codes and table for its input
    assert sorted(unpacked) == list(range(len(seen)))
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_the_summary_does_not_call_a_module_whose_calls_are_few_bit_left_as_it_was():
    """A root nn.GELU (not replaceable in place) was listed as "left as it was" while its
    forward's F.gelu ran fewbit's through the model's converted calls: its gradient was
    0.11 off torch's at 2 bits (review h72)."""
    model = nn.GELU()
    summary = fewbit.convert_(model, bits=2)
    assert "" in summary.unsupported and summary.functional_bits == 2
    text = str(summary)
    assert "as they were" not in text and "Python forward still runs" in text
    x = torch.randn(1000, requires_grad=True)
    model(x).sum().backward()
    ref = x.detach().clone().requires_grad_()
    torch.nn.functional.gelu(ref).sum().backward()
    assert not torch.equal(x.grad, ref.grad)  # few-bit, as the summary says


def test_filter_fn_is_asked_everything_before_anything_changes():
    """A filter_fn that raised on one module had left the model half converted (its
    activations replaced, hooks on the layers before, no activation mode); a module shared
    by two parents was asked about, and listed under, its first path only, so a filter on
    the second path left it torch's (review h72)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8, bias=False), nn.ReLU())
    before = [type(m) for m in model.modules()]

    def needs_a_bias(mod, fqn):
        return not isinstance(mod, nn.Linear) or mod.bias.shape[0] > 0  # no bias: AttributeError

    with pytest.raises(AttributeError):
        fewbit.convert_(model, fewbit.Config(saved_bits=4), filter_fn=needs_a_bias)
    assert [type(m) for m in model.modules()] == before
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    act = nn.GELU()
    shared = nn.Module()
    shared.a, shared.b = nn.Sequential(nn.Linear(4, 4), act), nn.Sequential(nn.Linear(4, 4), act)
    summary = fewbit.convert_(shared, bits=3, filter_fn=lambda mod, fqn: fqn.startswith("b."))
    assert isinstance(shared.b[1], fewbit.GELU) and shared.a[1] is shared.b[1]
    assert set(summary.replaced) == {"a.1", "b.1"}


def test_a_storage_kept_exact_stays_held_under_a_users_hooks():
    """A storage kept exact by one save (a custom Function's, "unseen") keeps later saves of
    it exact. Under a user's save_on_cpu the Kept that registered it was dropped at once,
    so the Linear's save of the same tensor was quantized: a weight gradient 0.77 off the
    same step without the user's hooks (review h73)."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * g * x

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc0, self.fc = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.fc0(x)
            return Square.apply(h) + self.fc(h)  # h saved by Square (kept exact), then by fc

    def run(users):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block(), nn.Linear(64, 1))
        comp = fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=2, min_numel=0)).compressor
        x = torch.randn(256, 64)
        fewbit.quant.manual_seed(1)
        if users:
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                y = model(x)
        else:
            y = model(x)
        y.square().sum().backward()
        return model[0].fc.weight.grad, comp.stats

    (plain, stats), (hooked, hooked_stats) = run(False), run(True)
    assert stats.deduplicated > 0 and hooked_stats.deduplicated == stats.deduplicated
    assert torch.equal(plain, hooked)


def test_compressor_of_a_wrapped_model():
    """The loop holds the DDP (or compiled) wrapper; ``compressor_of(wrapper)`` had been
    None, and the README's ``compressor_of(model).adapt(...)`` an AttributeError (review
    h76)."""
    from fewbit.convert import compressor_of

    model = nn.Sequential(nn.Linear(4, 4))
    comp = fewbit.convert_(model, fewbit.Config(saved_bits=4)).compressor
    assert compressor_of(model) is comp
    assert compressor_of(nn.DataParallel(model)) is comp
    assert compressor_of(torch.compile(model)) is comp
    assert compressor_of(nn.Linear(2, 2)) is None

    class OneChild(nn.Module):  # FSDP1 keeps the model as its one child, _fsdp_wrapped_module (review h78)
        def __init__(self, inner):
            super().__init__()
            self._fsdp_wrapped_module = inner

    assert compressor_of(OneChild(model)) is comp
    # a model holding a converted backbone is not a wrapper: its own saves are not compressed (review h79)
    assert compressor_of(nn.Sequential(model)) is None and compressor_of(nn.Sequential(model, nn.Linear(4, 4))) is None
