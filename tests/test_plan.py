"""fewbit.plan: profiler, MILP planner, Plan (JSON), applying a plan, Replanner (docs/compression.md §4)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import time
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")

import fewbit  # noqa: E402
from fewbit import planner  # noqa: E402
from fewbit.memory import saved_tensor_report  # noqa: E402
from helpers import replicate_on_cpu, run_in_threads  # noqa: E402

CFG = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)


def make_model(seed: int = 0, **over) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(**{**CFG, **over})
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG["vocab_size"], (8, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def prof(batch):
    torch.manual_seed(0)
    return planner.profile(make_model(), batch, optimizer="sgd", repeats=1)


def choices_plan(prof, choice: dict[str, str], default: str = "keep") -> fewbit.Plan:
    """A plan with the given options per group (the MILP's output format), not solved."""
    choices = [[choice.get(g.name, default) for g in bp.groups] for bp in prof.blocks]
    return planner._make_plan(prof, choices, budget_bytes=prof.vanilla_peak_bytes)


def measured(model, batch, seed=1):
    fewbit.manual_seed(seed)  # torch and the compressors' noise: runs compare alike
    rep = saved_tensor_report(model, batch)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return rep, grads


# ----------------------------------------------------------------------------- small pieces


@pytest.mark.parametrize("value, expected", [
    (1000, 1000), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("7b", 7),
    ("3 gib", 3 * 2**30), ("50%", 0.5), ("100%", 1.0),
])
def test_parse_budget(value, expected):
    assert planner.parse_budget(value) == expected


@pytest.mark.parametrize("value", ["", "2 parsecs", "-1GiB", "0", 0, -5, 1.5, True, None, "150%", "0%", "GiB",
                                   "1" * 400 + "GiB", "0.5b"])
def test_parse_budget_rejects(value):
    with pytest.raises(ValueError, match="memory_budget"):
        planner.parse_budget(value)


def test_get_option():
    assert planner.get_option("quant4") == planner.Option("quant4", "quant", 4, "group")
    assert planner.get_option("division2") == planner.Option("division2", "quant", 2, "division")
    assert planner.get_option("outlier4") == planner.Option("outlier4", "quant", 4, "outlier")
    assert planner.get_option("fewbit3").kind == "fewbit"
    for bad in ("quant3", "fewbit9", "division3", "outlier0", "zip", 4):
        with pytest.raises(ValueError, match="options"):
            planner.get_option(bad)


def test_find_blocks():
    blocks = planner.find_blocks(make_model())
    assert blocks == [("GPT2Block", ["transformer.h.0", "transformer.h.1"])]
    with pytest.raises(ValueError, match="no repeated blocks"):
        planner.find_blocks(torch.nn.Linear(3, 3))


class _Res(torch.nn.Module):
    """A residual MLP block, ``x + fc2(act(fc1(x)))``."""

    def __init__(self, width: int, act: type = torch.nn.GELU) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(width, 2 * width), act(), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def _stage(width: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())


def make_sequential(seed: int = 0) -> torch.nn.Sequential:
    """Blocks in an nn.Sequential (a ResNet-like stack), no ModuleList."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), _Res(64), _Res(64), _Res(64),
                               torch.nn.Sequential(_stage(64), _stage(64)), torch.nn.Linear(64, 4))


def test_find_blocks_in_sequentials():
    """Before: a model without an nn.ModuleList had no blocks (planning it was a ValueError)."""
    assert planner.find_blocks(make_sequential()) == [("_Res", ["1", "2", "3"]), ("Sequential", ["4"])]
    one = torch.nn.Sequential(torch.nn.Linear(4, 4), _Res(4), torch.nn.Linear(4, 4))  # one block: no stage
    with pytest.raises(ValueError, match="no repeated blocks"):
        planner.find_blocks(one)
    named = torch.nn.Sequential(collections.OrderedDict(a=_Res(4), b=_Res(4)))
    assert planner.find_blocks(named) == [("_Res", ["a", "b"])]
    nested = torch.nn.ModuleList([torch.nn.Sequential(_Res(4), _Res(4)) for _ in range(2)])
    assert planner.find_blocks(nested) == [("Sequential", ["0", "1"])]  # the outermost container


class _PartsNet(torch.nn.Module):
    """Research code's layout: ``layers = ModuleList([ModuleList([norm, ff]), ...])``, the
    parts called one by one (the inner ModuleLists never are)."""

    def __init__(self, width: int = 16, depth: int = 3, container: str = "list") -> None:
        super().__init__()
        parts = [torch.nn.ModuleList([torch.nn.LayerNorm(width), _Res(width)]) for _ in range(depth)]
        self.layers = (torch.nn.ModuleList(parts) if container == "list"
                       else torch.nn.ModuleDict({f"l{i}": p for i, p in enumerate(parts)}))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x):
        for norm, ff in self.layers if isinstance(self.layers, torch.nn.ModuleList) else self.layers.values():
            x = ff(norm(x))
        return self.out(x)


@pytest.mark.parametrize("container", ["list", "dict"])
def test_blocks_are_modules_that_run(container):
    """Before: the inner ModuleLists were the blocks; the block kind's hooks on them never
    ran (convert_ reported 3 blocks and compressed nothing) and fewbit.plan died in a
    KeyError. An nn.ModuleDict of layers had no blocks at all."""
    model = _PartsNet(container=container)
    names = [f"layers.{k}.1" for k in (("0", "1", "2") if container == "list" else ("l0", "l1", "l2"))]
    assert planner.find_blocks(model) == [("_Res", names)]
    fewbit.convert_(model, fewbit.Config(activation_bits=None, saved_bits=4, layers=("block",), min_numel=0))
    model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert fewbit.convert.compressor_of(model).stats.compressed > 0
    layers = torch.nn.ModuleDict({"a": _Res(4), "b": _Res(4)})  # torchtitan's layers
    assert planner.find_blocks(torch.nn.Sequential(collections.OrderedDict(layers=layers))) == [
        ("_Res", ["layers.a", "layers.b"])]

    class Getter(torch.nn.ModuleDict):  # torchvision's IntermediateLayerGetter: runs its entries
        def forward(self, x):
            for m in self.values():
                x = m(x)
            return x

    getter = Getter({"stem": torch.nn.Linear(4, 4), "layer1": torch.nn.Sequential(_Res(4), _Res(4)),
                     "layer2": torch.nn.Sequential(_Res(4), _Res(4), _Res(4))})
    assert planner.find_blocks(torch.nn.Sequential(collections.OrderedDict(backbone=getter))) == [
        ("_Res", ["backbone.layer1.0", "backbone.layer1.1", "backbone.layer2.0", "backbone.layer2.1",
                  "backbone.layer2.2"])]  # its stages' blocks, not the stages (review h73)


def test_plan_a_sequential_model_trains_like_vanilla_in_budget():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)  # learnable labels

    def loss_fn(out):
        return torch.nn.functional.cross_entropy(out, y)

    p = fewbit.plan(make_sequential(), (x,), memory_budget="50%", loss_fn=loss_fn, optimizer="sgd", repeats=1,
                    min_numel=0)
    assert [b.block_type for b in p.blocks] == ["_Res", "Sequential"]
    assert p.predicted_peak_bytes <= p.budget_bytes
    losses = {}
    for name in ("vanilla", "planned"):
        model = make_sequential()
        if name == "planned":
            fewbit.convert_(model, p)
            rep = saved_tensor_report(model, (x,), loss_fn=loss_fn)
            assert p.static_bytes + rep.saved_bytes <= p.budget_bytes
            model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(60):
            opt.zero_grad()
            loss = loss_fn(model(x))
            loss.backward()
            opt.step()
        losses[name] = loss.item()
    assert losses["planned"] == pytest.approx(losses["vanilla"], rel=0.05), losses
    assert losses["vanilla"] < 0.5  # it learned (log 4 = 1.39 at the start)


class _ReluNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)
        self.h = torch.nn.ModuleList([_Res(64, torch.nn.ReLU) for _ in range(3)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.h:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("budget", ["60%", "55%"])
def test_tensors_two_groups_save_are_kept_while_one_keeps_them(budget):
    """ReLU saves its result, which fc2 saves as its input: one tensor, counted once, for ReLU.
    Before: the plan took fewbit/quant on ReLU for freeing it, fc2 kept it all the same and was
    no group; at 60 % the measured saved bytes were 2.3x the prediction (1380357 against 593927),
    far over the budget."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = torch.randint(0, 4, (512,), generator=g)

    def loss_fn(out):
        return torch.nn.functional.cross_entropy(out, y)

    prof = planner.profile(_ReluNet(), (x,), loss_fn=loss_fn, optimizer="sgd", repeats=1, min_numel=0)
    assert [(sh.groups, sh.bytes) for sh in prof.shared if sh.bytes] == [
        ([("_Res", "act"), ("_Res", "fc2")], 3 * 512 * 128 * 4)]
    # the few-bit ReLUs of the three blocks share one table of values: stored once
    assert [(sh.groups, sh.options["fewbit3"]) for sh in prof.shared if not sh.bytes] == [([("_Res", "act")], 8)]
    assert [(g.name, g.options["keep"][0], g.shared_bytes) for g in prof.blocks[0].groups] == [
        ("fc1", 512 * 64 * 4, 0), ("act", 0, 512 * 128 * 4), ("fc2", 0, 512 * 128 * 4)]
    rep0 = saved_tensor_report(_ReluNet(), (x,), loss_fn=loss_fn)
    assert prof.vanilla_peak_bytes == prof.static_bytes + rep0.saved_bytes
    p = planner.plan_from_profile(prof, budget)
    model = _ReluNet()
    fewbit.convert_(model, p)
    rep = saved_tensor_report(model, (x,), loss_fn=loss_fn)
    assert rep.saved_bytes == p.predicted_saved_bytes, (rep.saved_bytes, p.predicted_saved_bytes)
    assert p.static_bytes + rep.saved_bytes <= p.budget_bytes
    # ReLU keeps its result, fc2 compresses its input: the result stays, and fc2's copy is its own
    mixed = planner._make_plan(prof, [["keep", "keep", "quant2"]], prof.vanilla_peak_bytes)
    assert mixed.shared_bytes == 3 * 512 * 128 * 4
    model = _ReluNet()
    fewbit.convert_(model, mixed)
    rep = saved_tensor_report(model, (x,), loss_fn=loss_fn)
    assert rep.saved_bytes == mixed.predicted_saved_bytes


class _GatedBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(width, 2 * width), torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_a_tensor_two_groups_compress_alike_is_stored_once():
    """gate and up save the same input. Under one option the compressor packs it once; under
    two, twice; and the block's own saves are measured under their option. Before (at 50 % on
    a tiny RoBERTa, whose q, k, v share their input) the plan counted no copy for k and v:
    25600 to 50176 bytes more than predicted, over the budget."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(_GatedBlock(64), _GatedBlock(64))

    def loss_fn(out):
        return out.square().mean()

    prof = planner.profile(make(), (x,), loss_fn=loss_fn, optimizer="sgd", repeats=1, min_numel=0,
                           options=("keep", "quant2", "quant4"))
    # the block's own forward saves silu's input (kept exact: its backward is not linear in
    # it) and the product's two factors (compressed). Before, a recorder under the block's
    # hooks saw none of it and the profile said 0 bytes under quant2.
    root = next(g for g in prof.blocks[0].groups if g.name == "")
    assert root.options["keep"][0] == 3 * 256 * 128 * 4
    assert 256 * 128 * 4 < root.options["quant2"][0] < 256 * 128 * 4 * 5 // 4  # + two factors at < 2/8
    inputs = next(sh for sh in prof.shared if sh.bytes)
    assert inputs.groups == [("_GatedBlock", "gate"), ("_GatedBlock", "up")] and inputs.bytes == 2 * 256 * 64 * 4
    # the first block's input needs no gradient: every option keeps it as it is, one storage,
    # the one keep keeps
    assert inputs.raw == {"quant2": 256 * 64 * 4, "quant4": 256 * 64 * 4}
    raw = 256 * 64 * 4
    for choice, stored, over in (({"gate": "quant2", "up": "quant2"}, inputs.options["quant2"], 0),
                                 ({"gate": "quant4", "up": "quant2"},
                                  inputs.options["quant4"] + inputs.options["quant2"] - raw, 0),
                                 ({"gate": "keep", "up": "quant4"}, inputs.bytes + inputs.options["quant4"] - raw, 0)):
        p = choices_plan(prof, choice)
        assert p.shared_bytes == stored, choice
        model = make()
        fewbit.convert_(model, p)
        rep = saved_tensor_report(model, (x,), loss_fn=loss_fn)
        # keep's storage and quant4's kept input are one storage
        assert rep.saved_bytes == p.predicted_saved_bytes - over, (choice, rep.saved_bytes, p.predicted_saved_bytes)


class _PyRMSNorm(torch.nn.Module):
    """A Python RMSNorm, as transformers' LLaMA / Gemma write it (no F.rms_norm)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _NormBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = _PyRMSNorm(width), torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def test_quantized_norm_groups_stay_inside_its_rows():
    """A plan that quantizes a norm's group gives the compressor the norm's rows, as
    convert_ does (Compressor.within). Before: groups of 256 spanned rows of 64 of very
    different scales, and on a tiny Gemma the gradient of quant2 on post_attention_layernorm
    had a cosine of 0.006 to vanilla's."""
    g = torch.Generator().manual_seed(0)
    scale = 10 ** (4 * torch.rand(512, 1, generator=g) - 2)  # neighbouring rows up to 10^4 apart
    x = torch.randn(512, 64, generator=g) * scale
    w = torch.randn(64, generator=g)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(_NormBlock(64), _NormBlock(64))

    def loss_fn(out):
        return (out @ w).square().mean()

    prof = planner.profile(make(), (x,), loss_fn=loss_fn, optimizer="sgd", repeats=1, min_numel=0,
                           options=("keep", "quant2"))
    p = choices_plan(prof, {"norm": "quant2"})
    ref = make()
    loss_fn(ref(x)).backward()
    g0 = torch.cat([q.grad.flatten() for q in ref.parameters()])
    model = make()
    fewbit.convert_(model, p)
    cos = []
    for seed in range(4):
        torch.manual_seed(seed)
        model.zero_grad()
        loss_fn(model(x)).backward()
        g1 = torch.cat([q.grad.flatten() for q in model.parameters()])
        cos.append(float(g1 @ g0 / g1.norm() / g0.norm()))
    assert min(cos) > 0.99, cos  # 0.17-0.27 before


@pytest.mark.parametrize("arch", ["roberta", "llama"])
def test_plan_of_models_whose_groups_share_inputs_measures_its_prediction(arch):
    """q, k, v share their input (and LLaMA's gate and up theirs); LLaMA's RMSNorm is Python.
    Before: RoBERTa's plans measured up to 50 KB over their prediction and the 50 % budget."""
    torch.manual_seed(0)
    if arch == "roberta":
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=40))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100))
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    # no recompute: its transient (counted in the peak, not saved) would make the comparison loose
    p = fewbit.plan(model, batch, memory_budget="75%", optimizer="sgd", repeats=1,
                    options=("keep", "quant8", "quant4", "quant2", "fewbit3"))
    assert p.shared_bytes > 0
    fewbit.convert_(model, p)
    rep = saved_tensor_report(model, batch)
    assert rep.saved_bytes == p.predicted_saved_bytes
    assert p.static_bytes + rep.saved_bytes <= p.budget_bytes


def test_profile_groups_and_static(prof):
    """The groups are GPT-2's per-block savers, in call order; static memory is 2x parameters for
    SGD (parameters + gradients); the profile counts exactly what the unplanned step saves."""
    (bp,) = prof.blocks
    names = [g.name for g in bp.groups]
    for name in ("ln_1", "attn.c_attn", "attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.act", "mlp.c_proj"):
        assert name in names
    assert names.index("ln_1") < names.index("attn.c_attn") < names.index("ln_2") < names.index("mlp.act")
    model = make_model()
    n = sum(p.numel() * 4 for p in model.parameters())
    assert prof.parameter_bytes == n and prof.gradient_bytes == n and prof.optimizer_bytes == 0
    assert bp.input_bytes == 8 * 32 * 64 * 4
    act = next(g for g in bp.groups if g.name == "mlp.act")
    assert act.bytes >= 8 * 32 * 256 * 4 and act.activation  # gelu_new saves its intermediates too
    assert "fewbit3" in act.options
    assert "fewbit3" not in next(g for g in bp.groups if g.name == "ln_1").options
    # quant options keep fewer bytes, and their timing was measured
    for g in bp.groups:
        assert g.options["quant4"][0] <= g.bytes and g.options["quant4"][1] > 0
    total = prof.outside_bytes + sum(g.bytes for g in bp.groups) * len(bp.blocks)
    assert total == prof.saved_bytes


# ----------------------------------------------------------------------------- planning under a budget


@pytest.mark.parametrize("fraction", [0.5, 0.4])
def test_plan_fits_budget(prof, batch, fraction):
    """Under 1/2 and 1/4 of the unplanned peak, the measured saved bytes (fewbit.memory's counter)
    stay within budget - static, and equal the prediction."""
    budget = int(fraction * prof.vanilla_peak_bytes)
    p = planner.plan_from_profile(prof, budget)
    assert p.budget_bytes == budget and p.predicted_peak_bytes <= budget
    model = make_model()
    summary = fewbit.convert_(model, p)
    assert summary.plan is p
    rep, _ = measured(model, batch)
    assert rep.saved_bytes <= budget - p.static_bytes
    # the prediction also holds what one block recomputes during backward (not saved: the
    # counter does not see it); the plan recomputes or not depending on the profiled times
    transient = max((sum(g.saved_bytes for g in bp.groups if g.option == "recompute") for bp in p.blocks),
                    default=0)
    counted = p.predicted_saved_bytes - transient
    assert abs(rep.saved_bytes - counted) <= 0.01 * counted


def test_percent_budget(prof):
    p = planner.plan_from_profile(prof, "50%")
    assert p.budget_bytes == int(0.5 * prof.vanilla_peak_bytes)


def test_infeasible_budget_names_smallest(prof):
    with pytest.raises(ValueError, match=r"smallest feasible budget is .*\((\d+) bytes") as e:
        planner.plan_from_profile(prof, 1000)
    import re

    smallest = int(re.search(r"smallest feasible budget is [^(]*\((\d+) bytes", str(e.value)).group(1))
    assert smallest > prof.static_bytes + prof.outside_bytes
    p = planner.plan_from_profile(prof, smallest)  # exactly the smallest is feasible
    assert p.predicted_peak_bytes <= smallest
    with pytest.raises(ValueError, match="smallest feasible"):
        planner.plan_from_profile(prof, smallest - 1)


def test_plan_only_recompute_checkpoints_blocks(prof, batch):
    """With only keep/recompute available the MILP checkpoints; the result runs and fits."""
    restricted = copy.deepcopy(prof)
    for bp in restricted.blocks:
        for g in bp.groups:
            g.options = {k: v for k, v in g.options.items() if k in ("keep", "recompute")}
    budget = int(0.7 * prof.vanilla_peak_bytes)  # a recomputed block is materialised in backward
    p = planner.plan_from_profile(restricted, budget)
    assert p.blocks[0].checkpoint and any(g.option == "recompute" for g in p.blocks[0].groups)
    model = make_model()
    fewbit.convert_(model, p)
    rep, _ = measured(model, batch)
    assert prof.static_bytes + rep.saved_bytes <= budget


# ----------------------------------------------------------------------------- applying: exactness


def test_recompute_gradients_exact(prof, batch):
    """Recompute (non-reentrant checkpoint, early stop) changes no gradient: dropout masks are
    replayed from the saved RNG state. Both a partial and a whole-block recompute."""
    ref = make_model()
    rep0, g0 = measured(ref, batch)
    for choice, default in (({"ln_2": "recompute", "mlp.c_fc": "recompute", "mlp.act": "recompute"}, "keep"),
                            ({}, "recompute")):
        p = choices_plan(prof, choice, default)
        assert p.blocks[0].checkpoint
        model = make_model()
        fewbit.convert_(model, p)
        rep, g = measured(model, batch)
        # the plan's fused loss against torch's: the same up to rounding (it takes the row's
        # max off before its logsumexp, torch's CPU log-softmax after)
        assert rep.loss == pytest.approx(rep0.loss, rel=1e-6)
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
        predicted = p.predicted_saved_bytes - sum(  # the recomputation's transient is not saved
            g.saved_bytes for g in p.blocks[0].groups if g.option == "recompute")
        # the kept block input is counted once more by the plan when ln_1 keeps it too (conservative)
        slack = 0 if default == "recompute" else 2 * p.blocks[0].input_bytes
        assert predicted - slack <= rep.saved_bytes <= predicted
        assert rep.saved_bytes < rep0.saved_bytes


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_plan_stands_aside_under_the_users_gradient_checkpointing(prof, batch, use_reentrant):
    """Under Hugging Face's gradient checkpointing the checkpoint drops and recomputes what
    its layers save: the plan's group hooks on top of it had kept it (a planned GPT-2 saved
    more than the checkpointed vanilla model), and inside a reentrant recomputation in
    backward they only added noise. A keep/recompute plan stays exact."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    ref = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref.gradient_checkpointing_enable(**kwargs)
    rep0, g0 = measured(ref, batch)
    for choice, default in (({"ln_2": "recompute", "mlp.c_fc": "recompute"}, "keep"), ({}, "quant2")):
        p = choices_plan(prof, choice, default)
        model = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        fewbit.convert_(model, p)
        model.gradient_checkpointing_enable(**kwargs)
        rep, g = measured(model, batch)
        assert rep.saved_bytes <= rep0.saved_bytes, choice
        assert rep.loss == pytest.approx(rep0.loss, rel=1e-6)
        for n in g0:  # the checkpointed blocks are exact (quant2 applies outside them only)
            if n.startswith("transformer.h.") or default == "keep":
                torch.testing.assert_close(g[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_recomputed_block_uses_the_parameters_its_forward_used(prof, batch):
    """torch.func.functional_call's fast weights (MAML) and a parameter reassigned between
    forward and backward: the recomputation ran with the weights the block held at backward
    (gradients 0.53 of their norm off); it now runs with those of its forward, as the
    unplanned model's saved tensors are."""
    p = choices_plan(prof, {}, "recompute")
    ref = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    fewbit.convert_(model, p)
    _assert_fast_weight_grads_equal(model, ref, batch)

    def reassigned_grads(m):
        loss = m(**batch).loss
        old = m.transformer.h[0].mlp.c_fc.weight
        m.transformer.h[0].mlp.c_fc.weight = torch.nn.Parameter(old.detach() * 3.0)
        loss.backward()
        grads = [old.grad] + [q.grad for n, q in m.named_parameters() if n != "transformer.h.0.mlp.c_fc.weight"]
        m.zero_grad(set_to_none=True)
        return grads

    for a, b in zip(reassigned_grads(model), reassigned_grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_recomputed_block_with_a_tied_weight_uses_its_fast_weight_under_both_names(batch):
    """A weight tied inside a block is one parameter under two names: only the first name
    got the forward's tensor back, the recomputation used the original under the second
    (every gradient of the block 15-33 % off under functional_call)."""
    def make():
        m = make_model(n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        mlp = m.transformer.h[0].mlp
        mlp.c_proj.weight = mlp.c_fc.weight  # both (64, 64)
        return m

    prof = planner.profile(make(), batch, optimizer="sgd", repeats=1)
    p = choices_plan(prof, {}, "recompute")
    ref, model = make(), make()
    fewbit.convert_(model, p)
    _assert_fast_weight_grads_equal(model, ref, batch)


def _assert_fast_weight_grads_equal(model, ref, batch):
    """The gradients of a MAML-style step (``torch.func.functional_call`` with the weights
    times 1.5) through ``model`` and through ``ref``, the same model unplanned, agree."""
    def fast_weight_grads(m):
        params = {n: t.detach().requires_grad_() for n, t in m.named_parameters()}
        fast = {n: t * 1.5 for n, t in params.items()}
        loss = torch.func.functional_call(m, fast, (), batch).loss
        return torch.autograd.grad(loss, list(params.values()))

    for a, b in zip(fast_weight_grads(model), fast_weight_grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _recompute_everything(model, batch, loss_fn=None) -> fewbit.Plan:
    """A plan of ``model`` whose every group recomputes (its profile's own, not solved)."""
    prof = planner.profile(model, batch, loss_fn=loss_fn, options=("keep", "recompute"), repeats=1)
    choices = [["recompute"] * len(bp.groups) for bp in prof.blocks]
    return planner._make_plan(prof, choices, budget_bytes=prof.vanilla_peak_bytes)


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)

    def block():
        return torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8, momentum=None),
                                   torch.nn.ReLU())

    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), block(), block(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 64, 10))


def test_recomputed_batch_norm_counts_the_step_once():
    """A recomputed block ran its BatchNorms twice in training mode: ``num_batches_tracked``
    2 after one step, the running statistics moved twice (also a cumulative average,
    ``momentum=None``). Gradients and buffers are the unplanned model's."""
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    p = _recompute_everything(_conv_net(), x, loss_fn)
    assert all(b.checkpoint for b in p.blocks)
    vanilla, planned = _conv_net(), _conv_net()
    fewbit.convert_(planned, p)
    for _ in range(2):
        loss_fn(vanilla(x)).backward()
        loss_fn(planned(x)).backward()
    for (name, a), b in zip(vanilla.state_dict().items(), planned.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(vanilla.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_recomputed_decoder_layers_get_no_kv_cache():
    """transformers 5 passes decoder layers their cache as ``cache=``: the recomputation
    wrote it a second time (LLaMA with a padded batch failed in backward, the cache came
    back twice as long); it is not passed, as transformers' own checkpointing does."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    vanilla = transformers.LlamaForCausalLM(cfg)
    planned = copy.deepcopy(vanilla)
    fewbit.convert_(planned, _recompute_everything(vanilla, batch))
    want = vanilla(**batch).loss
    want.backward()
    got = planned(**batch).loss  # the plan's fused cross-entropy: equal up to rounding
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(vanilla.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_recomputed_decoder_layers_keep_the_cache_in_evaluation():
    """In evaluation (grad enabled, as in eval-mode fine-tuning) a KV cache asked for is
    kept: the layer runs without recomputation and a RuntimeWarning says so (the cache came
    back empty, and continuing a prefix's cache failed: nulled as in training); with
    ``use_cache=False`` the plan recomputes (it had silently kept everything)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(1, 64, (2, 12))
    vanilla = transformers.LlamaForCausalLM(cfg).eval()
    planned = copy.deepcopy(vanilla)
    fewbit.convert_(planned, _recompute_everything(vanilla.train(), {"input_ids": ids, "labels": ids}))
    vanilla.eval(), planned.eval()
    outs = []
    for model in (vanilla, planned):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            prefix = model(input_ids=ids[:, :8], use_cache=True)
            out = model(input_ids=ids[:, 8:], past_key_values=prefix.past_key_values, use_cache=True)
        out.logits.sum().backward()
        outs.append((prefix.past_key_values.get_seq_length(), out.logits))
        if model is planned:
            assert any("pass use_cache=False" in str(w.message) for w in seen)
            assert any("holding earlier tokens" in str(w.message) for w in seen)
    assert outs[0][0] == outs[1][0] == 12
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
    batch = {"input_ids": ids, "use_cache": False}
    assert saved_tensor_report(planned, batch, loss_fn=lambda o: o.logits.sum()).saved_bytes < 0.5 * \
        saved_tensor_report(vanilla, batch, loss_fn=lambda o: o.logits.sum()).saved_bytes


class _CachedArgBlocks(torch.nn.Module):
    """Blocks of the user's with an argument named ``cache`` (a precomputed table) and a
    counter buffer of their own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_CachedArgBlock() for _ in range(2)])

    def forward(self, x):
        pos = torch.linspace(0, 1, x.shape[-1])
        for b in self.blocks:
            x = b(x, cache=pos)
        return x.pow(2).mean()


class _CachedArgBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, cache=None):
        if self.training:
            self.calls += 1
        if cache is not None:
            x = x + cache
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_a_users_block_keeps_its_cache_argument_and_buffers():
    """Only transformers blocks in training lose their KV cache (a user's ``cache=`` argument
    was set to None: the loss 4.46 against 1.07); a recomputation puts back every buffer it
    changed (a block's own counter counted each step twice)."""
    x = torch.randn(4, 16)
    p = _recompute_everything(_CachedArgBlocks(), x, lambda out: out)
    vanilla, planned = _CachedArgBlocks(), _CachedArgBlocks()
    fewbit.convert_(planned, p)
    saved = [saved_tensor_report(m, x, loss_fn=lambda o: o).saved_bytes for m in (vanilla, planned)]
    assert saved[1] < 0.5 * saved[0]  # recomputed (a block given a cache= had kept everything)
    vanilla, planned = _CachedArgBlocks(), _CachedArgBlocks()
    fewbit.convert_(planned, p)
    for model in (vanilla, planned):
        model(x).backward()
    assert torch.equal(planned.blocks[0].calls, vanilla.blocks[0].calls) and int(vanilla.blocks[0].calls) == 1
    for (name, a), b in zip(vanilla.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


class _ShiftBlock(torch.nn.Module):
    """Reads its buffer, then updates it in place (a moving average), and counts its calls
    by reassigning another."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.register_buffer("shift", torch.zeros(64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x)) - self.shift
        if self.training:
            with torch.no_grad():
                self.shift.mul_(0.5).add_(h.mean(0), alpha=0.5)
            self.calls = self.calls + 1
        return x + self.fc2(h)


class _ShiftNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_ShiftBlock() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def test_a_recomputation_starts_from_the_buffers_the_forward_started_from():
    """A buffer read and then updated by the forward was recomputed from its updated value
    (gradients 80 % off), and a reassigned counter counted twice."""
    x = torch.randn(4, 16)
    p = _recompute_everything(_ShiftNet(), x, lambda out: out)
    vanilla, planned = _ShiftNet(), _ShiftNet()
    fewbit.convert_(planned, p)
    for _ in range(3):
        for model in (vanilla, planned):
            model(x).backward()
    for (name, a), b in zip(vanilla.state_dict().items(), planned.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(vanilla.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    # a deep copy carries what the blocks learnt (by path, not by the modules' ids)
    clone, vanilla_clone = copy.deepcopy(planned), copy.deepcopy(vanilla)
    clone.zero_grad(), vanilla_clone.zero_grad()
    for model in (vanilla_clone, clone):
        model(x).backward()
    for (name, a), b in zip(vanilla_clone.state_dict().items(), clone.state_dict().values()):
        assert torch.equal(a, b), name


class _PreActivation(torch.nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList([
            torch.nn.Sequential(torch.nn.ReLU(inplace=inplace), torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16)) for _ in range(3)])

    def forward(self, x):
        h = self.inp(x) * 1.0
        for b in self.blocks:
            h = b(h) + 0.5
        return h.pow(2).mean()


def test_a_block_that_changes_its_input_in_place_is_not_recomputed():
    """A pre-activation block (``ReLU(inplace=True)`` first) cannot be recomputed from its
    input: the profile offers it no ``recompute`` (before, a plan that recomputed it failed at
    its first forward with torch's error about a custom Function's view), and a plan that
    recomputes it anyway says why at the forward."""
    x = torch.randn(4, 8, 16)
    loss_fn = lambda out: out  # noqa: E731
    prof = planner.profile(_PreActivation(), x, loss_fn=loss_fn, options=("keep", "recompute"), repeats=1)
    assert not any("recompute" in g.options for g in prof.blocks[0].groups)
    p = fewbit.plan(_PreActivation(), x, "100%", loss_fn=loss_fn, options=("keep", "recompute"), repeats=1)
    assert not any(b.checkpoint for b in p.blocks)
    model = _PreActivation()
    fewbit.convert_(model, p)
    model(x).backward()
    forced = _recompute_everything(_PreActivation(inplace=False), x, loss_fn)  # the same modules
    model = _PreActivation()
    fewbit.convert_(model, forced)
    with pytest.raises(RuntimeError, match="changed its input .* in place"):
        model(x)


class _KeywordBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList([_KeywordBlock() for _ in range(2)])
        self.mutate = False

    def forward(self, x):
        h, out = self.inp(x), 0
        for b in self.blocks:
            y = b(hidden_states=h)
            if self.mutate:
                h.mul_(0.5)  # the block's input changes after its forward
            out, h = out + y, h + y
        return out.pow(2).mean()


class _KeywordBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, hidden_states):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(hidden_states))))


def test_a_recomputed_block_refuses_a_keyword_input_changed_in_place():
    """Torch refuses backward when a block's input was changed in place after its forward;
    a plan that recomputes the block gave a gradient of the changed input when it came by
    keyword (only positional inputs were held)."""
    x = torch.randn(4, 8, 16)
    p = _recompute_everything(_KeywordBlocks(), x, lambda out: out)
    assert all(b.checkpoint for b in p.blocks)
    vanilla = _KeywordBlocks()
    vanilla.mutate = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        vanilla(x).backward()
    model = _KeywordBlocks()
    fewbit.convert_(model, p)
    model(x).backward()  # unchanged: fine
    model.mutate = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()


def test_compress_inside_checkpoint(prof, batch):
    """Groups that compress inside a checkpointed block are compressed (their bytes shrink, they are
    not recomputed), the later groups are recomputed. The recomputation replays the RNG (dropout
    masks and the compressor's seeds), so the gradients equal those of the same compression
    without recomputation."""
    compress = {"ln_1": "quant8", "attn.c_attn": "quant8", "attn": "quant4", "ln_2": "quant8"}
    p = choices_plan(prof, {**compress, "mlp.c_fc": "recompute", "mlp.act": "recompute"})
    q = choices_plan(prof, compress)
    assert p.blocks[0].checkpoint and not q.blocks[0].checkpoint
    runs = []
    for plan_ in (None, q, p):
        model = make_model()
        if plan_ is not None:
            fewbit.convert_(model, plan_)
        else:
            fewbit.losses.patch_causal_lm_(model)
        runs.append(measured(model, batch))
    (rep0, g0), (rep_q, g_q), (rep, g) = runs
    assert rep.loss == rep_q.loss
    for n in g_q:
        torch.testing.assert_close(g[n], g_q[n], rtol=1e-5, atol=1e-6, msg=n)
    predicted = p.predicted_saved_bytes - sum(x.saved_bytes for x in p.blocks[0].groups if x.option == "recompute")
    assert rep.saved_bytes == predicted  # ln_1 compresses: the checkpointed input is counted once
    assert rep.by_category["compressed"] > 0
    assert rep.saved_bytes < rep_q.saved_bytes < rep0.saved_bytes


@pytest.mark.parametrize("choice", [{"mlp.c_fc": "recompute"}, {"mlp.c_fc": "keep"}, {"mlp.c_fc": "quant4"},
                                    {"mlp.c_fc": "recompute", "attn": "quant2"}])
def test_a_keyboardinterrupt_inside_a_group_leaves_nothing_behind(prof, batch, choice):
    """Torch calls forward hooks for an ``Exception`` only: a ``KeyboardInterrupt`` (Ctrl-C
    in a notebook) inside a planned group left its saved-tensor hooks on; torch's checkpoint
    then left them instead of its own, and every later backward in the process failed
    (``CheckpointError``), a plain model's included. The groups are left as the interrupt
    unwinds the block (a version that left them at the model's next forward left them on
    until then: torch.func and ``disable_saved_tensors_hooks`` failed everywhere)."""
    model = make_model()
    plan = choices_plan(prof, choice)
    fewbit.convert_(model, plan)
    model(**batch).loss.backward()

    def interrupt(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**batch)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    plain = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    ref = copy.deepcopy(plain)
    x = torch.randn(4, 16)
    plain(x).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(plain[0].weight.grad, ref[0].weight.grad)
    model.zero_grad(set_to_none=True)
    rep, grads = measured(model, batch)  # the planned model's next step: as a fresh one's
    fresh = make_model()
    fewbit.convert_(fresh, choices_plan(prof, choice))
    rep_fresh, grads_fresh = measured(fresh, batch)
    assert rep.saved_bytes == rep_fresh.saved_bytes
    for n in grads_fresh:
        torch.testing.assert_close(grads[n], grads_fresh[n], rtol=0, atol=0, msg=n)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not vars(model)[planner._STATE_ATTR].entered


@pytest.mark.parametrize("kind", ["keep", "recompute", "quant4"])
def test_a_no_grad_forward_in_another_thread_leaves_the_training_forwards_groups(prof, batch, kind):
    """A training forward and a ``no_grad`` evaluation forward of one planned model in two
    threads, overlapping inside a group (training enters, evaluation enters, training
    leaves): the groups' records were shared, so each thread left the other's; the
    evaluation failed on torch's internal assert (popping an empty hook stack) and the
    training thread kept a group's hooks (with recompute, every later backward failed)."""
    import threading

    model = make_model()
    fewbit.convert_(model, choices_plan(prof, {"mlp.c_fc": kind}))
    fresh = make_model()
    fewbit.convert_(fresh, choices_plan(prof, {"mlp.c_fc": kind}))
    c_fc = model.transformer.h[0].mlp.c_fc
    main_in, eval_in, main_out = threading.Event(), threading.Event(), threading.Event()

    def pre(module, args):
        if threading.current_thread() is threading.main_thread():
            main_in.set()
            assert eval_in.wait(30)
        else:
            assert main_in.wait(30)
            eval_in.set()
            assert main_out.wait(30)

    def post(module, args, output):  # after the plan's
        if threading.current_thread() is threading.main_thread():
            main_out.set()

    handles = [c_fc.register_forward_pre_hook(pre), c_fc.register_forward_hook(post)]
    failed = []

    def evaluate():
        try:
            with torch.no_grad():
                model(**batch)
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        except BaseException as e:  # noqa: BLE001 - reported below, in the test's thread
            failed.append(e)

    thread = threading.Thread(target=evaluate)
    thread.start()
    model(**batch).loss.backward()
    thread.join(30)
    for h in handles:
        h.remove()
    assert not failed, failed
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not vars(model)[planner._STATE_ATTR].entered
    model.zero_grad(set_to_none=True)
    rep, grads = measured(model, batch)
    rep_fresh, grads_fresh = measured(fresh, batch)
    assert rep.saved_bytes == rep_fresh.saved_bytes
    for n in grads_fresh:
        torch.testing.assert_close(grads[n], grads_fresh[n], rtol=0, atol=0, msg=n)


def test_a_compiled_planned_model_compiles_once(prof, batch):
    """The per-thread record of running groups was made on first use, so torch.compile's
    guard on it failed at the second call and the whole model was compiled again."""
    from torch._dynamo.utils import counters

    model = make_model()
    fewbit.convert_(model, choices_plan(prof, {"mlp.c_fc": "quant4"}))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    for _ in range(3):
        loss = compiled(**batch).loss
        loss.backward()
    frames = counters["stats"]["unique_graphs"]
    assert not vars(model)[planner._STATE_ATTR].entered  # every group left
    assert torch.isfinite(loss)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    compiled(**batch).loss.backward()
    assert counters["stats"]["unique_graphs"] == frames  # nothing compiled again after the first call


def test_recompute_replays_noise_of_a_stream_made_inside_the_block(prof, batch):
    """The first compressed tensor comes after the block's dropout, so the noise stream is
    made inside the block, from torch's state there; the recomputation makes it again from
    the same (restored) state. Recording the stream at block entry had made it early, from
    another torch state: the c_fc weight gradient then differed by 1.32 of its largest
    entry from the plan without recomputation."""
    grads = []
    for choice in ({"mlp.c_fc": "quant2", "mlp.act": "recompute"}, {"mlp.c_fc": "quant2"}):
        model = make_model()
        fewbit.convert_(model, choices_plan(prof, choice))
        grads.append(measured(model, batch)[1])
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("default", ["keep", "quant4", "recompute"])
def test_a_planned_model_refuses_weights_changed_before_backward(prof, batch, default):
    """Keep groups hold their tensors as they are and every option keeps the weights: a weight
    changed in place between forward and backward (an optimizer step too early) is torch's
    error, as without the plan (before: a keep group's hooks returned the changed weight and
    backward used it silently)."""
    model = make_model()
    fewbit.convert_(model, choices_plan(prof, {}, default))
    loss = model(**batch).loss
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_fewbit_option_replaces_activation_and_remove_restores(prof, batch):
    model = make_model()
    keys = list(model.state_dict())
    original_act = model.transformer.h[0].mlp.act
    p = choices_plan(prof, {"mlp.act": "fewbit3", "mlp.c_proj": "recompute"})
    fewbit.convert_(model, p)
    assert isinstance(model.transformer.h[0].mlp.act, (fewbit.FormulaActivation, fewbit.FewBitActivation))
    assert model.transformer.h[0].mlp.act.bits == 3
    fewbit.convert_(model, p)  # again: hooks are not stacked
    hooks = len(model.transformer.h[0].ln_1._forward_pre_hooks)
    assert hooks == 1
    assert list(model.state_dict()) == keys
    rep, _ = measured(model, batch)
    assert rep.activation_bytes < 2 * (8 * 32 * 256 * 4) // 8  # 2 blocks of 3-bit codes, not 32-bit floats
    assert planner.remove_plan(model)
    assert model.transformer.h[0].mlp.act is original_act
    assert "forward" not in vars(model.transformer.h[0])
    assert len(model.transformer.h[0].ln_1._forward_pre_hooks) == 0
    assert not planner.remove_plan(model)


def test_a_plan_and_a_config_conversion_do_not_mix(prof, batch):
    """Both would compress the same saved tensors (a Config's hooks inside a plan's
    groups): each order is one ValueError, and the model is left as it was."""
    p = choices_plan(prof, {"mlp.c_proj": "quant4"})
    model = make_model()
    fewbit.convert_(model, p)
    hooks = {n: len(m._forward_pre_hooks) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"model has a fewbit plan applied.*remove_plan"):
        fewbit.convert_(model, fewbit.Config(saved_bits=4))
    assert {n: len(m._forward_pre_hooks) for n, m in model.named_modules()} == hooks
    assert planner.remove_plan(model)
    fewbit.convert_(model, fewbit.Config(saved_bits=4))  # after remove_plan: fine

    with pytest.raises(ValueError, match=r"model \(or a module in it\) compresses its saved tensors by an earlier"):
        fewbit.convert_(model, p)
    assert "_fewbit_plan_state" not in vars(model)
    fewbit.convert_(model, fewbit.Config(saved_bits=None))  # re-converted without compression
    fewbit.convert_(model, p)
    model(**batch).loss.backward()

    # the same with a part of the model: a block converted with a Config, or a block of a planned model
    with pytest.raises(ValueError, match=r"is part of a planned model"):
        fewbit.convert_(model.transformer.h[0], fewbit.Config(saved_bits=2))
    other = make_model()
    fewbit.convert_(other.transformer, fewbit.Config(saved_bits=2))
    with pytest.raises(ValueError, match=r"model \(or a module in it\) compresses its saved tensors"):
        fewbit.convert_(other, p)


def test_division_and_outlier_options(batch):
    """DIVISION and Adacc's outlier compressor as planner options: profiled (fewer bytes
    than keep), applied through a Plan that survives JSON, and the planned model's weight
    gradients are unbiased (mean of 40 steps with fresh noise, projected on random
    directions, within 3 standard errors of the exact gradient)."""
    nodrop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    opts = ("keep", "quant2", "division2", "outlier4", "recompute")
    prof2 = planner.profile(make_model(**nodrop), batch, options=opts, optimizer="sgd", repeats=1)
    groups = {g.name: g for g in prof2.blocks[0].groups}
    for name in ("attn.c_attn", "mlp.c_fc", "mlp.c_proj"):
        keep = groups[name].options["keep"][0]
        assert 0 < groups[name].options["division2"][0] < keep / 4, name
        assert 0 < groups[name].options["outlier4"][0] < keep / 4, name
    choice = {"attn.c_attn": "outlier4", "mlp.c_fc": "division2", "mlp.c_proj": "division2"}
    choices = [[choice.get(g.name, "keep") for g in bp.groups] for bp in prof2.blocks]
    p = planner.Plan.from_json(planner._make_plan(prof2, choices, budget_bytes=prof2.vanilla_peak_bytes).to_json())
    model = make_model(**nodrop)
    fewbit.convert_(model, p)
    ref = fewbit.losses.patch_causal_lm_(make_model(**nodrop))
    rep_ref, exact = measured(ref, batch)
    names = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
             "transformer.h.1.mlp.c_proj.weight"]
    draws = {n: [] for n in names}
    for seed in range(40):
        rep, grads = measured(model, batch, seed=seed)
        for n in names:
            draws[n].append(grads[n].reshape(-1))
    assert rep.saved_bytes < rep_ref.saved_bytes and rep.by_category["compressed"] > 0
    gen = torch.Generator().manual_seed(0)
    for n in names:
        d = torch.stack(draws[n]).double()
        assert not torch.equal(d[0], d[1]), n  # compressed with fresh noise
        e = exact[n].reshape(-1).double()
        for _ in range(3):
            u = torch.randn(e.numel(), generator=gen, dtype=torch.float64)
            proj = d @ u
            se = float(proj.std()) / len(proj) ** 0.5
            assert abs(float(proj.mean()) - float(e @ u)) <= 3 * se + 1e-9, n


def test_deep_copy_of_planned_model(prof, batch):
    """A deep copy carries the plan (its own hooks, compressors, checkpointed forwards); removing
    it from the copy leaves the original planned."""
    p = choices_plan(prof, {"ln_1": "quant8", "mlp.act": "recompute"})
    assert p.fused_cross_entropy  # the copy carries its own fused-loss patch too
    model = make_model()
    fewbit.convert_(model, p)
    clone = copy.deepcopy(model)
    (rep_a, g_a), (rep_b, g_b) = measured(model, batch), measured(clone, batch)
    assert rep_a.saved_bytes == rep_b.saved_bytes and rep_a.loss == rep_b.loss
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_b[n], msg=n)
    assert planner.remove_plan(clone)
    assert len(clone.transformer.h[0].ln_1._forward_pre_hooks) == 0
    assert len(model.transformer.h[0].ln_1._forward_pre_hooks) == 1
    assert "forward" in vars(model.transformer.h[0])
    with torch.no_grad():  # the copy's loss uses the copy's head
        clone.lm_head.weight.mul_(2.0)
    assert measured(clone, batch)[0].loss != measured(model, batch)[0].loss


def test_planning_a_planned_model_leaves_it_untouched(prof, batch):
    """fewbit.plan on a planned, patched model works on a copy: the model keeps its hooks,
    block forwards and fused-loss patch, the very same objects."""
    p = choices_plan(prof, {"ln_1": "quant8", "mlp.act": "recompute"})
    model = make_model()
    fewbit.convert_(model, p)
    hooks = dict(model.transformer.h[0].ln_1._forward_pre_hooks)
    block_forward = vars(model.transformer.h[0])["forward"]
    patch = model._fewbit_fused_cross_entropy
    fewbit.plan(model, batch, memory_budget="70%", repeats=1, options=("keep", "quant4", "recompute"))
    assert dict(model.transformer.h[0].ln_1._forward_pre_hooks) == hooks
    assert vars(model.transformer.h[0])["forward"] is block_forward
    assert model._fewbit_fused_cross_entropy is patch
    assert model.lm_head.forward.patch is patch


def test_trained_loss_close_to_vanilla(prof, batch):
    """A few SGD steps under the 1/4 plan follow the unplanned run."""
    p = planner.plan_from_profile(prof, int(0.4 * prof.vanilla_peak_bytes))
    losses = []
    for planned in (False, True):
        model = make_model()
        if planned:
            fewbit.convert_(model, p)
        else:
            fewbit.losses.patch_causal_lm_(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(3)
        run = []
        for _ in range(6):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < losses[0][0] - 0.2  # it trains
    for a, b in zip(*losses):
        assert b == pytest.approx(a, rel=0.03)


# ----------------------------------------------------------------------------- Plan object


def test_json_round_trip(prof, tmp_path):
    p = planner.plan_from_profile(prof, "40%")
    q = fewbit.Plan.from_json(p.to_json())
    assert q == p
    p.save(tmp_path / "p.json")
    assert fewbit.Plan.load(tmp_path / "p.json") == p
    text = str(p)
    assert "predicted peak" in text and "mlp.act" in text and "choice" in text
    d = json.loads(p.to_json())
    d["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        fewbit.Plan.from_dict(d)
    d["version"] = planner.PLAN_VERSION
    d["blocks"][0]["groups"][0]["option"] = "zip"
    with pytest.raises(ValueError, match="options"):
        fewbit.Plan.from_dict(d)
    with pytest.raises(ValueError, match="invalid JSON"):
        fewbit.Plan.from_json("{")


def test_plan_does_not_fit_other_model(prof):
    p = planner.plan_from_profile(prof, "50%")
    other = make_model(n_layer=1)
    with pytest.raises(ValueError, match="transformer.h.1"):
        fewbit.convert_(other, p)
    assert planner.remove_plan(other) is False  # nothing was touched
    with pytest.raises(ValueError, match="neither bits nor filter_fn"):
        fewbit.convert_(make_model(), p, bits=3)


def test_plan_does_not_fit_a_model_with_more_blocks(prof):
    """Before: applied to the first blocks only; the others ran unplanned, over the
    predicted peak, and nothing said so."""
    p = planner.plan_from_profile(prof, "50%")
    other = make_model(n_layer=3)
    with pytest.raises(ValueError, match=r"3 against 2; 'transformer.h.2' is GPT2Block here"):
        fewbit.convert_(other, p)
    assert planner.remove_plan(other) is False  # nothing was touched


@pytest.mark.parametrize("other, what", [
    (lambda: make_model(n_embd=128), "wider"),
    (lambda: make_model().double(), "float64"),
])
def test_plan_does_not_fit_a_model_of_other_parameters(prof, other, what):
    """Before: a plan made for width 64 applied to width 128 (or to the float64 copy) was
    accepted: same blocks, same names, and a predicted peak that is not this model's."""
    p = planner.plan_from_profile(prof, "50%")
    m = other()
    with pytest.raises(ValueError, match=r"parameters add up to .* here and .* in the plan"):
        fewbit.convert_(m, p)
    assert planner.remove_plan(m) is False  # nothing was touched
    d = json.loads(p.to_json())
    del d["parameter_bytes"]  # a plan saved before the field existed: applies unchecked
    fewbit.convert_(make_model(), fewbit.Plan.from_dict(d))


def test_planning_a_frozen_model_is_a_clear_error(batch):
    """Before: torch's "element 0 of tensors does not require grad" from inside the profile."""
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        fewbit.plan(make_model().requires_grad_(False), batch, memory_budget="50%", repeats=1)


def test_plan_end_to_end_and_argument_errors(batch):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # 50 %: GPT-2's Python GELU saves its tanh result (kept at 8 bits under quant4, the
    # nonlinear-result rule) and its input for x ** 3 (kept exact: fewbit.quant.nonlinear),
    # so 45 % is now below the smallest feasible plan without fewbit activations (48 %); a
    # planned step's own transient memory, measured, puts 60 % below it too (64-68 %)
    p = fewbit.plan(model, batch, memory_budget="70%", repeats=1, options=("keep", "quant4", "recompute"))
    assert isinstance(p, fewbit.Plan)
    assert all(g.option in ("keep", "quant4", "recompute") for g in p.blocks[0].groups)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # model untouched
    assert not hasattr(model, "_fewbit_fused_cross_entropy") and "forward" not in vars(model.transformer.h[0])
    with pytest.raises(ValueError, match="memory_budget"):
        fewbit.plan(model, batch, memory_budget="lots")
    with pytest.raises(ValueError, match="optimizer"):
        fewbit.plan(model, batch, memory_budget="1GiB", optimizer="lion")
    with pytest.raises(ValueError, match="options"):
        fewbit.plan(model, batch, memory_budget="1GiB", options=("quant3",))
    with pytest.raises(ValueError, match="fused_cross_entropy"):
        fewbit.plan(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2))])),
                    torch.randn(2, 2), memory_budget="1GiB", fused_cross_entropy=True)


def test_profile_and_plan_leave_torch_and_fewbit_random_streams(batch, monkeypatch):
    """The profile's steps drew fewbit's compression noise (and, from a Replanner's
    re-profile, torch's dropout masks): the same planned step after ``fewbit.manual_seed``
    gave other gradients when a plan() ran in between. Bad arguments that need no profile are
    refused before it (``accuracy_weight`` was checked after a minute of profiling)."""
    model = make_model()
    fewbit.manual_seed(5)
    torch_state, fewbit_state = torch.get_rng_state(), fewbit.get_rng_state()
    fewbit.quant._noise_stream.draw()  # a stream for this seed exists, as in a run
    fewbit_state = fewbit.get_rng_state()
    planner.profile(model, batch, repeats=1, options=("keep", "quant2", "recompute"))
    assert torch.equal(torch.get_rng_state(), torch_state) and fewbit.get_rng_state() == fewbit_state
    fewbit.plan(model, batch, "70%", repeats=1, options=("keep", "quant2"))  # its steps measured too
    assert torch.equal(torch.get_rng_state(), torch_state) and fewbit.get_rng_state() == fewbit_state

    def no_profile(*args, **kwargs):
        raise AssertionError("profiled before checking the arguments")

    monkeypatch.setattr(planner, "_profile", no_profile)
    for bad in (-1.0, "1", True, float("nan")):
        with pytest.raises(ValueError, match="accuracy_weight"):
            fewbit.plan(model, batch, "60%", accuracy_weight=bad)
    with pytest.raises(ValueError, match="fused_cross_entropy must be True, False or None, got 'yes'"):
        fewbit.plan(model, batch, "60%", fused_cross_entropy="yes")
    with pytest.raises(ValueError, match="options must name at least one option"):
        fewbit.plan(model, batch, "60%", options=[])


def _mask_(logits):
    """Chameleon's in-place write into its logits (its image tokens), in a function of its own."""
    logits[..., :3] = -30.0


class MaskedLMHeadModel(transformers.GPT2LMHeadModel):
    """Changes its logits in place after the head (Chameleon's image tokens), naming no
    transform in its config (in a module of transformers, as Chameleon is)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.transformer(input_ids).last_hidden_state)
        _mask_(logits)  # out of sight of fused_loss_refusal's source scan: the profiled step finds it
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


MaskedLMHeadModel.__module__ = "transformers.models.masked"


def test_plan_of_a_model_that_changes_its_logits_unannounced_uses_the_unfused_loss(batch):
    """The default fused loss is chosen from the config; a model that changes its logits in
    its forward without naming it there made the profile raise the fused loss's RuntimeError.
    It falls back to the unfused loss (asked for explicitly, the error stands)."""
    torch.manual_seed(0)
    model = MaskedLMHeadModel(transformers.GPT2Config(**CFG))
    assert fewbit.convert._is_causal_lm(model)
    p = fewbit.plan(model, batch, memory_budget="70%", repeats=1, options=("keep", "quant4", "recompute"))
    assert not p.fused_cross_entropy
    assert not hasattr(model, "_fewbit_fused_cross_entropy")
    fewbit.convert_(model, p)
    assert not hasattr(model, "_fewbit_fused_cross_entropy")
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="perhaps in place"):
        planner.profile(MaskedLMHeadModel(transformers.GPT2Config(**CFG)), batch, repeats=1, fused_cross_entropy=True)


def test_milp_solves_gpt2_sized_problem_fast(prof):
    """GPT-2 small's per-block tensor list (the same GPT2Block groups), 12 blocks, bytes scaled to
    n_embd 768, seq 1024: the MILP solve takes < 1 s."""
    big = copy.deepcopy(prof)
    (bp,) = big.blocks
    scale = (768 / 64) * (1024 / 32)
    bp.blocks = [f"transformer.h.{i}" for i in range(12)]
    bp.input_bytes = int(bp.input_bytes * scale)
    for g in bp.groups:
        g.options = {k: [int(b * scale), t * scale] for k, (b, t) in g.options.items()}
        g.end_time *= scale
    big.parameter_bytes = big.gradient_bytes = 124_000_000 * 4
    big.optimizer_bytes = 2 * big.parameter_bytes
    big.saved_bytes = big.outside_bytes + 12 * sum(g.bytes for g in bp.groups)
    t0 = time.perf_counter()
    p = planner.plan_from_profile(big, int(big.static_bytes + 0.25 * (big.saved_bytes)))
    elapsed = time.perf_counter() - t0
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert elapsed < 1.0, elapsed


# ----------------------------------------------------------------------------- policy evolution


def test_replanner_schedule_and_drift(prof, batch):
    assert [s for s in range(1, 40) if planner.Replanner.due(s)] == [1, 2, 4, 8, 16, 32]
    p = planner.plan_from_profile(prof, "40%")
    assert p.rates()
    drift = {"factor": 1.0}
    calls = []

    def profiler(model, b):
        calls.append(b)
        q = copy.deepcopy(prof)
        for bp in q.blocks:
            for g in bp.groups:
                for k, v in g.options.items():
                    if k.startswith(("quant", "fewbit")):
                        v[0] = int(v[0] * drift["factor"])
        return q

    model = make_model()
    r = planner.Replanner(model, p, batch, tolerance=0.1, profiler=profiler)
    assert vars(model)[planner._STATE_ATTR].plan is p  # applied
    assert r.step(1) is None and r.step(3) is None  # no drift; 3 is not scheduled
    assert len(calls) == 1
    drift["factor"] = 1.5  # compressed tensors got 50% bigger (more outliers)
    new = r.step(2)
    assert new is not None and r.plan is new and new is not p
    assert vars(model)[planner._STATE_ATTR].plan is new
    assert new.predicted_peak_bytes <= p.budget_bytes
    assert r.history[-1][1] and r.history[-1][2] == pytest.approx(0.5, rel=0.01)
    assert r.step(4) is None  # same rates as the new plan
    with pytest.raises(ValueError, match="tolerance"):
        planner.Replanner(model, p, batch, tolerance=0)


def test_replanner_profiles_the_options_its_plan_uses(prof, batch, monkeypatch):
    """A plan with DIVISION groups was re-profiled with the default options only, so those
    groups' rates were never measured again (their drift unseen)."""
    p = choices_plan(prof, {"mlp.c_fc": "quant2"})
    next(g for g in p.blocks[0].groups if g.name == "mlp.c_fc").option = "division2"
    seen = []

    def fake_profile(model, b, **kwargs):
        seen.append(kwargs["options"])
        return prof

    monkeypatch.setattr(planner, "profile", fake_profile)
    r = planner.Replanner(make_model(), p, batch)
    r.step(1)
    assert "division2" in seen[0] and set(planner.DEFAULT_OPTIONS) <= set(seen[0])
    planner.Replanner(make_model(), p, batch, options=("keep", "quant4")).step(1)
    assert seen[1] == ("keep", "quant4")


# ----------------------------------------------------------------------------- fused CE in convert_


def test_convert_fused_cross_entropy():
    """Same loss and gradients as the unconverted model, the logits no longer saved; a
    re-conversion with False undoes it; not for other models."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (4, 32), generator=g)
    ref = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    rep0 = saved_tensor_report(ref, {"input_ids": ids, "labels": ids})
    model = make_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=None, fused_cross_entropy=True))
    assert summary.fused_cross_entropy and "fused" in str(summary)
    rep = saved_tensor_report(model, {"input_ids": ids, "labels": ids})
    assert rep.loss == pytest.approx(rep0.loss, rel=1e-6)
    for (n, p0), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p0.grad, rtol=1e-4, atol=1e-6, msg=n)
    logits_bytes = 4 * 32 * 100 * 4
    assert rep0.saved_bytes - rep.saved_bytes >= logits_bytes
    assert model(ids).logits is not None
    assert model(ids, labels=ids).logits is None
    fewbit.convert_(model, fewbit.Config(activation_bits=None, fused_cross_entropy=False))
    assert model(ids, labels=ids).logits is not None
    assert not hasattr(model, "_fewbit_fused_cross_entropy")
    with pytest.raises(ValueError, match="fused_cross_entropy"):
        fewbit.convert_(torch.nn.Linear(2, 2), fewbit.Config(fused_cross_entropy=True))
    with pytest.raises(ValueError, match="fused_cross_entropy"):
        fewbit.Config(fused_cross_entropy="yes")
    # fields added later come after it: positional Config(...) calls keep their meaning
    assert [f.name for f in dataclasses.fields(fewbit.Config)].index("fused_cross_entropy") == 10


class _Block(torch.nn.Module):
    def __init__(self, shared=None):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.ln = shared if shared is not None else torch.nn.LayerNorm(32)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.fc(self.ln(x)))


class _Blocks(torch.nn.Module):
    def __init__(self, shared=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(shared), _Block(shared)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _square_loss(out):
    return out.pow(2).mean()


def test_a_forward_set_on_a_block_survives_reapplying_and_removing_the_plan():
    """Re-applying a plan, or remove_plan, popped the block's instance ``forward``: one the
    user (or accelerate's hooks) had set was lost."""
    import types

    torch.manual_seed(0)
    model, x, calls = _Blocks(), torch.randn(1024, 32), []
    p = fewbit.plan(model, x, "95%", loss_fn=_square_loss, repeats=1, options=("recompute",))
    assert any(b.checkpoint for b in p.blocks)
    own = types.MethodType(lambda self, h: (calls.append(1), type(self).forward(self, h))[1], model.blocks[0])
    model.blocks[0].forward = own
    for _ in range(2):
        fewbit.convert_(model, p)
        model(x)
    assert len(calls) == 2
    planner.remove_plan(model)
    assert vars(model.blocks[0])["forward"] is own
    model(x)
    assert len(calls) == 3


def test_planning_leaves_the_random_state_and_refuses_shared_modules_clearly():
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(1024, 32)
    torch.manual_seed(123)
    fewbit.plan(model, x, "75%", loss_fn=_square_loss, repeats=1)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))  # the profile's draws did not move the caller's stream
    shared = _Blocks(torch.nn.LayerNorm(32))
    with pytest.raises(ValueError, match=r"module blocks\.1\.ln is the module blocks\.0\.ln .*shared"):
        fewbit.plan(shared, x, "100%", loss_fn=_square_loss, repeats=1)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["blocks"][0].update(checkpoint="false"), r"blocks\[0\]\.checkpoint must be bool"),
    (lambda d: d.update(version=True), "version True is not supported"),
    (lambda d: d.update(parameter_bytes="123"), "parameter_bytes must be an int >= 0 or null"),
    (lambda d: d.update(budget_bytes="x"), "budget_bytes must be an int >= 0"),
    (lambda d: d.update(budget_bytes=-1), "budget_bytes must be an int >= 0, got -1"),
    (lambda d: d["blocks"][0]["groups"][0].update(saved_bytes=-5), r"groups\[0\]\.saved_bytes must be an int >= 0"),
    (lambda d: d["blocks"][0].update(blocks=[]), r"blocks\[0\]\.blocks must be a non-empty list of str"),
    (lambda d: d["blocks"][0].update(blocks="blocks.0"), r"blocks\[0\]\.blocks must be a non-empty list of str"),
    (lambda d: d.update(fused_cross_entropy="yes"), "fused_cross_entropy must be bool"),
    (lambda d: d["blocks"][0]["groups"].append(dict(d["blocks"][0]["groups"][0])), "lists a group twice"),
    (lambda d: d.pop("version"), "not a fewbit plan: no 'version'"),
])
def test_plan_files_with_fields_of_the_wrong_type_are_refused(prof, edit, needle, tmp_path):
    """A plan file edited by hand: ``"checkpoint": "false"`` was truthy (the block ran
    checkpointed), ``"version": true`` passed, ``"parameter_bytes": "123"`` failed at
    ``convert_`` with a TypeError, an empty ``blocks`` list made ``str(plan)`` raise."""
    d = json.loads(planner.plan_from_profile(prof, "100%").to_json())
    edit(d)
    with pytest.raises(ValueError, match=needle):
        fewbit.Plan.from_dict(d)


def test_plan_json_refuses_repeated_keys_deep_nesting_and_bad_bytes(prof, tmp_path):
    p = planner.plan_from_profile(prof, "100%")
    text = p.to_json()
    with pytest.raises(ValueError, match="twice"):
        fewbit.Plan.from_json(text[:-1] + ', "optimizer": "sgd"}')
    with pytest.raises(ValueError, match="invalid JSON"):
        fewbit.Plan.from_json("[" * 100000 + "]" * 100000)
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe" + text.encode())
    with pytest.raises(ValueError, match="not UTF-8"):
        fewbit.Plan.load(path)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())  # a byte-order mark, as table files allow
    assert fewbit.Plan.load(path) == p
    p.save(path)
    assert fewbit.Plan.load(path) == p


def test_a_plan_carries_over_what_is_registered_on_a_replaced_activation():
    """``convert_(model, plan)`` with a ``fewbit`` option replaced activations by calling the
    factory directly: buffers the user registered on them left ``state_dict()`` and their
    forward hooks stopped running (``convert_(model, Config)`` carries them over). Now as
    convert_: the same tensors and hooks move to the replacement, and ``remove_plan`` puts
    the original back; an activation whose forward was set on the instance stays."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.act, self.l2 = nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)

        def forward(self, x):
            return x + self.l2(self.act(self.l1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    model = Net()
    calls = []
    for i, b in enumerate(model.blocks):
        b.act.register_buffer("calib", torch.full((1,), float(i)))
        b.act.register_forward_hook(lambda mod, a, o, i=i: calls.append(i))
    originals = [b.act for b in model.blocks]
    keys = sorted(model.state_dict())
    x = torch.randn(128, 64)
    plan = fewbit.plan(model, (x,), "90%", loss_fn=lambda out: out.pow(2).sum(), options=("fewbit3",), repeats=1)
    assert {g.option for bp in plan.blocks for g in bp.groups} >= {"fewbit3"}
    fewbit.convert_(model, plan)
    assert all(isinstance(b.act, fewbit.modules.GELU) for b in model.blocks)
    assert sorted(model.state_dict()) == keys
    assert model.blocks[2].act.calib is originals[2].calib
    calls.clear()
    model(x)
    assert calls == [0, 1, 2]
    planner.remove_plan(model)
    assert [b.act for b in model.blocks] == originals
    calls.clear()
    model(x)
    assert calls == [0, 1, 2]


def test_a_planned_model_runs_without_grad():
    """Under ``torch.no_grad`` the plan's group hooks entered the compressor and pushed its
    torch-function mode, which turns off ``nn.TransformerEncoderLayer``'s fast path: its
    nested tensors then raised. They stand aside without grad, as convert_'s hooks do."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=True)
    x = torch.randn(4, 32, 64)
    mask = torch.zeros(4, 32, dtype=torch.bool)
    mask[:, 20:] = True
    plan = fewbit.plan(enc, {"src": x, "src_key_padding_mask": mask}, "85%", loss_fn=lambda out: out.pow(2).sum(),
                       options=("quant4",), repeats=1)
    enc.eval()
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask)
    fewbit.convert_(enc, plan)
    with torch.no_grad():
        out = enc(x, src_key_padding_mask=mask)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("default", ["quant4", "recompute"])
def test_torch_func_grad_of_a_planned_model_is_exact(prof, batch, default):
    """``torch.func`` transforms refuse saved-tensor hooks (torch's ``RuntimeError``: "don't
    yet support saved tensor hooks"), so a planned model's groups stand aside under them: the
    gradient is the unplanned model's."""
    from torch.func import functional_call, grad

    def loss_grads(model):
        model.eval()  # no dropout: both calls see the same forward
        params = {n: p.detach() for n, p in model.named_parameters()}
        return grad(lambda p: functional_call(model, p, (), batch).loss)(params)

    expect = loss_grads(make_model())
    model = make_model()
    fewbit.convert_(model, choices_plan(prof, {}, default))
    got = loss_grads(model)
    for n in expect:
        torch.testing.assert_close(got[n], expect[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("choice", [{"mlp.c_fc": "quant4"}, {"mlp.c_fc": "recompute"}])
def test_a_forward_wrapper_set_on_a_block_after_planning_stays(prof, batch, choice):
    """accelerate-style ``block.forward = wrapper(block.forward)`` after planning: it stays
    through ``remove_plan`` and another ``convert_`` (removing the plan's instance forward
    dropped it), and the old plan's wrapper inside it passes calls through."""
    model = make_model()
    plan = choices_plan(prof, choice)
    fewbit.convert_(model, plan)
    block = model.transformer.h[0]
    calls = []
    inner = block.forward

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    block.forward = wrapper
    planner.remove_plan(model)
    model(**batch).loss.backward()
    assert calls == [1]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    fewbit.convert_(model, plan)
    model.zero_grad(set_to_none=True)
    rep, grads = measured(model, batch)
    assert len(calls) == (3 if plan.blocks[0].checkpoint else 2)  # a recomputation calls it again
    fresh = make_model()
    fewbit.convert_(fresh, plan)
    rep_fresh, grads_fresh = measured(fresh, batch)
    assert rep.saved_bytes == rep_fresh.saved_bytes  # the old plan's groups do nothing any more
    for n in grads_fresh:
        torch.testing.assert_close(grads[n], grads_fresh[n], rtol=0, atol=0, msg=n)



@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("choice, default", [({"mlp.act": "fewbit3"}, "keep"), ({}, "recompute")])
def test_a_data_parallel_replica_runs_its_own_block(prof, batch, choice, default, fused, monkeypatch):
    """``nn.DataParallel`` copies each module's ``__dict__`` into its replica, and with it
    the planned forward bound to the original block: the replica ran the first GPU's block
    (its weights; a device mismatch on real GPUs). Each replica now runs its own block in
    the plan's groups, in its own thread as DataParallel's ``parallel_apply`` does; the
    originals' gradients are the sum of the replicas' (their weights are copies of them).
    The fused loss likewise: each replica's loss takes its own copy of the output embedding
    (before, its pre-hook refused the replica's head as "replaced")."""
    plan = dataclasses.replace(choices_plan(prof, choice, default), fused_cross_entropy=fused)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # the threads draw no RNG
    model = make_model(**no_dropout)
    fewbit.convert_(model, plan)
    shifts = (0.01, -0.02)
    chunks = [{k: v[j::2] for k, v in batch.items()} for j in range(2)]
    replicas = replicate_on_cpu(model, shifts, monkeypatch)
    losses = [out.loss for out in run_in_threads(replicas, chunks)]
    (losses[0] + losses[1]).backward()

    expect = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for j, s in enumerate(shifts):  # the planned model itself, with replica j's weights, on its chunk
        ref = make_model(**no_dropout)
        fewbit.convert_(ref, plan)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(s)
        loss = ref(**chunks[j]).loss
        torch.testing.assert_close(losses[j], loss, rtol=1e-6, atol=0)
        loss.backward()
        for n, p in ref.named_parameters():
            expect[n] += p.grad
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expect[n], rtol=1e-5, atol=1e-7, msg=n)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    planner.remove_plan(model)
    assert "_replicate_for_data_parallel" not in vars(model.transformer.h[0])


def test_profiles_leave_nothing_alive(batch):
    """The capture of the tensors to time held them from its pack hook, which the graph's
    saved variables hold: a cycle through C++ that gc cannot see, and every profile (each
    ``fewbit.plan``, each Replanner re-profile) leaked the copy's graph and parameters."""
    import gc

    def live_parameters():
        gc.collect()
        return sum(isinstance(o, nn.Parameter) for o in gc.get_objects())

    model = make_model()
    planner.profile(model, batch, optimizer="sgd", repeats=1)
    before = live_parameters()
    for _ in range(3):
        planner.profile(model, batch, optimizer="sgd", repeats=1)
    assert live_parameters() == before  # 12 more per call before


def test_a_model_in_eval_mode_is_planned_for_a_training_step(batch):
    """``from_pretrained`` returns a model in eval mode: its profile had no dropout masks, and
    the plan's step trained 17 % over its budget. The copy profiled is in training mode; the
    model stays as it was."""
    train = planner.profile(make_model(), batch, optimizer="sgd", repeats=1)
    model = make_model().eval()
    evaluated = planner.profile(model, batch, optimizer="sgd", repeats=1)
    assert not model.training and not any(m.training for m in model.modules())
    assert evaluated.vanilla_peak_bytes == train.vanilla_peak_bytes
    assert evaluated.saved_bytes == train.saved_bytes


def test_replanner_keeps_the_plans_options_and_accuracy_weight(prof, batch, monkeypatch):
    """A plan made from ``("keep", "quant2", "quant4")`` was re-planned from the default
    options too (a re-plan chose fewbit3), and with ``accuracy_weight`` 1; a wrong keyword
    raised at the first ``step()``, in the middle of training."""
    seen = []
    narrowed = planner.profile(make_model(), batch, optimizer="sgd", repeats=1, options=("keep", "quant2", "quant4"))
    p = planner.plan_from_profile(narrowed, "60%", accuracy_weight=0.25)
    assert p.options == ["keep", "quant2", "quant4"] and p.accuracy_weight == 0.25
    assert fewbit.Plan.from_json(p.to_json()) == p

    def fake_profile(model, b, **kwargs):
        seen.append(kwargs["options"])
        return prof

    solves = []
    real = planner.plan_from_profile
    monkeypatch.setattr(planner, "profile", fake_profile)
    monkeypatch.setattr(planner, "plan_from_profile", lambda *a, **k: solves.append(k) or real(*a, **k))
    r = planner.Replanner(make_model(), p, batch, tolerance=float("inf"))
    r.step(1)
    assert seen[0] == ("keep", "quant2", "quant4")
    for bad in ({"repeat": 1}, {"optimizer": "sgd"}, {"min_numel": 0}):
        with pytest.raises(TypeError, match=f"Replanner got '{next(iter(bad))}'"):
            planner.Replanner(make_model(), p, batch, **bad)
    with pytest.raises(ValueError, match="accuracy_weight"):
        planner.Replanner(make_model(), p, batch, accuracy_weight=-1)
    for tolerance in (True, "0.1", None):
        with pytest.raises(TypeError, match="tolerance must be a number"):
            planner.Replanner(make_model(), p, batch, tolerance=tolerance)
    # a plan over its budget (a larger batch's profile: here more saved outside the blocks)
    # re-plans, with the plan's accuracy_weight, though no rate moved
    grown = dataclasses.replace(narrowed, outside_bytes=narrowed.outside_bytes + p.budget_bytes
                                - p.predicted_peak_bytes + 1)
    monkeypatch.setattr(planner, "profile", lambda model, b, **kwargs: grown)
    r = planner.Replanner(make_model(), p, batch, tolerance=float("inf"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.step(1)
    assert solves and solves[-1] == {"accuracy_weight": 0.25}
    assert r.history[-1] == (1, True, 0.0) or any("no plan fits the budget" in str(w.message) for w in caught)


def test_replanner_warns_and_keeps_its_plan_when_no_plan_fits_any_more(prof, batch, monkeypatch):
    """A profile no plan fits (a much larger batch: here more saved outside the blocks than
    the budget) raised ValueError from ``step`` in the middle of training. It warns and the
    plan in force stays."""
    p = planner.plan_from_profile(prof, "100%")
    big = dataclasses.replace(prof, outside_bytes=prof.outside_bytes + p.budget_bytes)
    monkeypatch.setattr(planner, "profile", lambda model, b, **kwargs: big)
    model = make_model()
    r = planner.Replanner(model, p, batch)
    with pytest.warns(RuntimeWarning, match="no plan fits the budget any more"):
        assert r.step(1) is None
    assert r.plan is p and vars(model)[planner._STATE_ATTR].plan is p


def _planned_step_peak(model, batch, loss_fn):
    """What a training loop with AdamW holds at most in its second step: the tensors held
    when it starts plus the most the step's own tensors held at once."""
    from fewbit.memory import held_bytes, peak_allocated_bytes

    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)

    def step():
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = loss_fn(out)
        loss.backward()
        del out, loss
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    return held_bytes(model, opt, batch) + peak_allocated_bytes(step, "cpu")


@pytest.mark.parametrize("arch", ["cnn", "gpt2"])
@pytest.mark.parametrize("budget", ["70%", "85%", "100%"])
def test_planned_steps_fit_their_budget(arch, budget):
    """The MILP's memory row holds the unplanned step's transient memory, not a compressed
    step's (quantizer and few-bit temporaries; the peak moves into the forward once little
    is saved): planned steps went 9-18 % over budgets of 50-70 %, and 100 % budgets over by
    the model's buffers and Adam's step counts. Each plan is now measured and solved again
    with what it held beyond its prediction: the measured step fits, and its prediction is
    what it holds."""
    fewbit.manual_seed(0)
    if arch == "cnn":
        make, loss_fn = _conv_net, (lambda out: out.float().pow(2).mean())
        batch = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    else:
        make, loss_fn = make_model, (lambda out: out.loss)
        ids = torch.randint(0, CFG["vocab_size"], (8, 32), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
    p = fewbit.plan(make(), batch, budget, loss_fn=loss_fn, repeats=1)
    model = make()
    fewbit.convert_(model, p)
    peak = _planned_step_peak(model, batch, loss_fn)
    assert peak <= p.budget_bytes, (peak, p.budget_bytes, p.predicted_peak_bytes)
    assert abs(peak - p.predicted_peak_bytes) <= 256, (peak, p.predicted_peak_bytes)


def test_planning_inside_the_users_profiler_session_keeps_the_session(batch):
    """The CPU peak is measured with torch.profiler: a plan made inside the user's own
    session ended it (its trace came back with no events) and silently left the step's
    transient memory out. The session keeps its events, and the plan says what it left out."""
    from torch.profiler import ProfilerActivity, profile

    model = make_model()
    with profile(activities=[ProfilerActivity.CPU]) as session:
        torch.randn(64, 64) @ torch.randn(64, 64)
        with pytest.warns(RuntimeWarning, match="could not measure a step's peak on the CPU"):
            planner.profile(model, batch, optimizer="sgd", repeats=1, options=("keep", "quant4"))
        torch.randn(64, 64) @ torch.randn(64, 64)
    names = [e.name for e in session.events()]
    assert names.count("aten::mm") >= 2


def test_replanner_measures_the_plan_in_force_on_a_larger_batch():
    """The Replanner judged "over its budget" by the MILP's row, which leaves out a
    compressed step's own temporaries: a CNN planned at 70 % on a batch of 16 went 5.4 %
    over on a batch of 18, with no re-plan and no warning. The plan in force is measured."""
    loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(16, 3, 8, 8, generator=g)
    fewbit.manual_seed(0)
    p = fewbit.plan(_conv_net(), batch, "70%", loss_fn=loss_fn, repeats=1)
    model = _conv_net()
    fewbit.convert_(model, p)
    r = planner.Replanner(model, p, batch, loss_fn=loss_fn, repeats=1)
    big = torch.randn(18, 3, 8, 8, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.step(1, big)
    warned = any("no plan fits the budget" in str(w.message) for w in caught)
    assert r.history[-1][1] or warned
    if r.history[-1][1]:  # re-planned: the new plan fits on the larger batch
        m = _conv_net()
        fewbit.convert_(m, r.plan)
        assert _planned_step_peak(m, big, loss_fn) <= p.budget_bytes


def test_measured_plans_search_below_the_rounds_for_a_faster_plan(prof, monkeypatch):
    """Where every correction round's plan measures over the budget (each compresses more
    and holds more temporaries), ``plan`` took the row's smallest plan, the slowest, though
    plans solved for budgets in between fit and ran faster (a small GPT-2 at 70 %: 13.24 ms
    where a 65 % plan of 9.92 ms fit). The budget solved for is bisected between them. Here
    a synthetic measure: 5 % of the budget plus 0.9 of the row's distance below it, except
    for the smallest plan, which holds none: plans fit below half the budget, which three
    rounds do not reach."""
    budget = int(0.9 * prof.vanilla_peak_bytes)
    smallest = planner._make_plan(prof, planner.solve(prof, None)[0], budget)

    def measured(model, batch, loss_fn, p, prof_):
        if p.blocks == smallest.blocks:
            return p.predicted_peak_bytes
        return p.predicted_peak_bytes + budget // 20 + 9 * (budget - p.predicted_peak_bytes) // 10

    monkeypatch.setattr(planner, "_planned_step_bytes", measured)
    p = planner._plan_measured(None, None, None, prof, budget, 1.0)
    assert p.predicted_peak_bytes <= budget
    assert p.blocks != smallest.blocks and p.predicted_step_time < smallest.predicted_step_time


def test_a_loss_of_the_users_that_reads_the_logits_is_profiled_unfused(batch):
    """The fused loss was chosen by default whenever the batch had labels, and it leaves
    the output's logits None: a ``loss_fn`` of the user's that reads them died in a
    TypeError inside it (review h71). With a loss of the user's the default is unfused;
    ``fused_cross_entropy=True`` still asks for it."""
    def loss_fn(out):
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    prof = planner.profile(make_model(), batch, loss_fn=loss_fn, optimizer="sgd", repeats=1)
    assert not prof.fused_cross_entropy
    assert planner.profile(make_model(), batch, optimizer="sgd", repeats=1).fused_cross_entropy


def test_a_batch_object_is_profiled():
    """``model(batch)`` with a dataclass batch: the profile counted the batch's bytes with
    ``held_bytes``, which now refuses objects it cannot walk, and the plan died in its
    TypeError (review h77). The batch's tensors are found in its fields."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_Res(16) for _ in range(2))

        def forward(self, batch):
            x = batch.x
            for b in self.blocks:
                x = b(x)
            return x

    @dataclasses.dataclass
    class Nested:  # a batch inside a batch: its tensors had been missed (review h78)
        inner: Batch

        @property
        def x(self):
            return self.inner.x

    @dataclasses.dataclass
    class WithScheduler:  # a batch referring to another model's optimizer: not the batch's bytes (review h79)
        x: torch.Tensor
        scheduler: object

    other = torch.nn.Linear(256, 256)
    adam = torch.optim.Adam(other.parameters())
    other(torch.randn(2, 256)).sum().backward()
    adam.step()  # its moments exist
    x = torch.randn(64, 16)
    transient = []
    for batch in (Batch(x), Nested(Batch(x)), WithScheduler(x, torch.optim.lr_scheduler.StepLR(adam, 1))):
        torch.manual_seed(0)
        transient.append(planner.profile(Net(), batch, optimizer="sgd", repeats=1).transient_bytes)
    assert transient[0] == transient[1] == transient[2] >= x.untyped_storage().nbytes()
