"""``Config(warmup_steps=..., warmup_bits=...)``: more bits for the first training steps
(fewbit.quant.policies.WarmupPolicy), counted by optimizer steps after a compressed forward."""

import copy
import gc

import pytest
import torch
from torch import nn

import fewbit
from fewbit import Config
from fewbit.convert import compressor_of
from fewbit.memory import SavedTensorRecorder
from fewbit.quant.policies import FixedPolicy, WarmupPolicy
from fewbit.quant import compressors as C


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 32))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(64, 32, generator=g)


def _train(model, opt, steps, *, first=0, accumulate=1):
    """``steps`` optimizer steps (``accumulate`` forwards each); the saved bytes of each forward."""
    rec = SavedTensorRecorder(model)
    saved = []
    for i in range(first, first + steps):
        opt.zero_grad()
        for _ in range(accumulate):
            rec.reset()
            with rec:
                loss = model(_batch(i)).square().mean()
            loss.backward()
            saved.append(rec.saved_bytes)
        opt.step()
    return saved


def _saved_bytes(bits):
    model = _model()
    fewbit.convert_(model, Config(saved_bits=bits, min_numel=0))
    return _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)[0]


def test_warm_up_bits_then_saved_bits_by_optimizer_step():
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=3, warmup_bits=8, min_numel=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = _train(model, opt, 5)
    b8, b2 = _saved_bytes(8), _saved_bytes(2)
    assert b8 > b2
    assert saved == [b8] * 3 + [b2] * 2
    policy = compressor_of(model).policy
    assert isinstance(policy, WarmupPolicy) and policy.steps_done == 3 and policy.current is policy.policy


def test_gradient_accumulation_and_several_optimizers_count_one_step():
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=2, warmup_bits=4, min_numel=0))
    policy = compressor_of(model).policy
    # 3 forwards per optimizer step: one step each
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), 1, accumulate=3)
    assert policy.steps_done == 1
    # two optimizers stepping after one backward: one step
    opts = [torch.optim.SGD(list(model.parameters())[:2], lr=0.01),
            torch.optim.SGD(list(model.parameters())[2:], lr=0.01)]
    model(_batch(7)).sum().backward()
    for opt in opts:
        opt.step()
    assert policy.steps_done == 2


def test_steps_without_a_compressed_forward_do_not_count():
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=2, min_numel=0))
    policy = compressor_of(model).policy
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():  # evaluation saves nothing
        model(_batch(0))
    opt.step()
    other = nn.Linear(4, 4)  # another model's optimizer, this model idle
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    assert policy.steps_done == 0
    _train(model, opt, 1)
    assert policy.steps_done == 1


def test_same_run_as_converting_again_after_the_warm_up():
    """The field is the two-call recipe it replaces (convert_ at 4 bits, then at 2 bits
    before step 3), bit for bit: same losses and weights."""
    def run(warm_field):
        fewbit.manual_seed(0)
        model = _model()
        if warm_field:
            fewbit.convert_(model, Config(saved_bits=2, warmup_steps=2, warmup_bits=4, min_numel=0))
        else:
            fewbit.convert_(model, Config(saved_bits=4, min_numel=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for i in range(4):
            if not warm_field and i == 2:
                fewbit.convert_(model, Config(saved_bits=2, min_numel=0))
            opt.zero_grad()
            loss = model(_batch(i)).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    (la, wa), (lb, wb) = run(True), run(False)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(wa, wb))


def test_state_dict_deepcopy_and_resume():
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=3, min_numel=0))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), 2)
    policy = compressor_of(model).policy
    assert policy.state_dict() == {"steps_done": 2, "owner_seen": True, "policy": None}
    twin = copy.deepcopy(model)
    tp = compressor_of(twin).policy
    assert tp is not policy and tp.steps_done == 2
    _train(twin, torch.optim.SGD(twin.parameters(), lr=0.01), 1)  # the copy counts its own steps
    assert (tp.steps_done, policy.steps_done) == (3, 2)
    # a resumed run: a fresh conversion given the saved state goes on at 2 bits
    fresh = _model()
    fewbit.convert_(fresh, Config(saved_bits=2, warmup_steps=3, min_numel=0))
    compressor_of(fresh).policy.load_state_dict(tp.state_dict())
    assert _train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01), 1) == [_saved_bytes(2)]
    for bad in ({}, {"steps_done": -1}, {"steps_done": 1.5}, None):
        with pytest.raises(ValueError, match="steps_done"):
            compressor_of(fresh).policy.load_state_dict(bad)
    assert compressor_of(fresh).policy.steps_done == 3


def test_hook_goes_with_the_policy():
    from torch.optim.optimizer import _global_optimizer_post_hooks

    gc.collect()  # the policies of earlier tests' models
    before = len(_global_optimizer_post_hooks)
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=1, min_numel=0))
    assert len(_global_optimizer_post_hooks) == before + 1
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), 1)  # warm-up over: the hook idles
    model(_batch(1)).sum()  # and goes at the next save (not inside torch's loop over the hooks)
    assert len(_global_optimizer_post_hooks) == before
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=5, min_numel=0))
    assert len(_global_optimizer_post_hooks) == before + 1
    del model
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before


def test_gact_re_plans_start_after_the_warm_up():
    model = _model()
    summary = fewbit.convert_(model, Config(saved_bits="auto", average_bits=2, warmup_steps=2, min_numel=0))
    comp, opt = summary.compressor, torch.optim.AdamW(model.parameters(), lr=1e-3)
    replans = []
    for i in range(4):
        x = _batch(i)
        replans.append(comp.adapt(model, lambda: model(x).square().mean(), opt))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert replans == [False, False, True, True]  # GACT's calls 1 and 2 re-plan
    assert comp.policy.state_dict()["policy"]["bits"]


@pytest.mark.parametrize("kwargs, match", [
    ({"saved_bits": 2, "warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"saved_bits": 2, "warmup_steps": 2.5}, "warmup_steps must be an integer >= 0"),
    ({"saved_bits": 2, "warmup_bits": 8}, "warmup_bits is only used with warmup_steps >= 1"),
    ({"warmup_steps": 10}, "warmup_steps is only used with saved_bits set"),
    ({"saved_bits": 4, "warmup_steps": 10}, "warmup_bits must be more than saved_bits .* got warmup_bits=4 "
                                             "with saved_bits=4"),
    ({"saved_bits": 2, "warmup_steps": 10, "warmup_bits": 3}, "warmup_bits must be one of \\(1, 2, 4, 8\\)"),
    ({"saved_bits": 2, "warmup_steps": 10, "warmup_bits": True}, "warmup_bits must be"),
    ({"saved_bits": 2, "compressor": "adacc", "warmup_steps": 10, "warmup_bits": 1}, "warmup_bits must be one of"),
    ({"saved_bits": "auto", "average_bits": 4, "warmup_steps": 10}, "warmup_bits must be more than average_bits"),
])
def test_config_warmup_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(**kwargs)


@pytest.mark.parametrize("compressor, after, warm", [("division", 2, 4), ("adacc", 2, 8)])
def test_warm_up_of_other_compressors_is_the_same_compressor_at_more_bits(compressor, after, warm):
    policy = compressor_of(fewbit.convert_(_model(), Config(saved_bits=after, compressor=compressor,
                                                            warmup_steps=1, warmup_bits=warm)).model).policy
    assert type(policy.warm) is type(policy.policy)
    assert policy.warm.default.name == policy.policy.default.name
    assert (policy.warm.default.bits, policy.policy.default.bits) == (warm, after)


def test_warmup_policy_arguments():
    fixed = FixedPolicy(C.GroupQuantizer(2))
    with pytest.raises(TypeError, match="warm must be a fewbit.quant.policies.Policy"):
        WarmupPolicy(C.GroupQuantizer(4), fixed, 3)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        WarmupPolicy(fixed, fixed, 0)


@pytest.mark.parametrize("critic_steps", [1, 5])
def test_another_models_optimizer_does_not_count(critic_steps):
    """A GAN: the discriminator compresses tensors during the generator's step too, and the
    generator's optimizer step had counted for it (its warm-up ended after half its steps)."""
    gen, disc = _model(), _model()
    for m in (gen, disc):
        fewbit.convert_(m, Config(saved_bits=2, warmup_steps=100, min_numel=0))
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (gen, disc))
    for i in range(4):
        for _ in range(critic_steps):  # WGAN: several critic steps, the generator's forward with grad
            opt_d.zero_grad()
            disc(gen(_batch(i)).detach()).square().mean().backward()
            opt_d.step()
        opt_g.zero_grad()
        disc(gen(_batch(i))).square().mean().backward()  # disc saves tensors here too
        opt_g.step()
    assert compressor_of(disc).policy.steps_done == 4 * critic_steps
    assert compressor_of(gen).policy.steps_done == 4  # its own steps, also before its optimizer's first
    twin = copy.deepcopy(disc)  # the copy's own model, set at its first forward
    opt_t = torch.optim.SGD(twin.parameters(), lr=1e-3)
    done = compressor_of(twin).policy.steps_done
    twin(_batch(0)).sum().backward()
    opt_t.step()
    assert compressor_of(twin).policy.steps_done == done + 1
    twin(_batch(1)).sum().backward()
    opt_d.step()  # the original's optimizer: not the copy's step
    assert compressor_of(twin).policy.steps_done == done + 1


@pytest.mark.parametrize("over", ["master copies", "a prompt outside the model"])
def test_an_optimizer_over_other_tensors_ends_the_warm_up(over):
    """Mixed precision's float32 master copies, or a soft prompt before a frozen model: no
    optimizer holds the model's parameters, and the first version of the ownership rule
    never ended the warm-up (the run stayed at the warm-up's bits)."""
    model = _model()
    fewbit.convert_(model, Config(saved_bits=2, warmup_steps=2, min_numel=0))
    if over == "master copies":
        tensors = [p.detach().clone().requires_grad_() for p in model.parameters()]
    else:
        model.requires_grad_(False)
        tensors = [torch.zeros(32, requires_grad=True)]
    opt = torch.optim.SGD(tensors, lr=1e-3)
    for i in range(3):
        x = _batch(i) + tensors[0].sum() * 0 if over == "master copies" else _batch(i) + tensors[0]
        model(x).square().mean().backward()
        opt.step()
    assert compressor_of(model).policy.steps_done == 2


def test_two_warm_ups_in_one_process():
    """torch calls the optimizer step hooks while iterating over its dict of them: a
    warm-up's hook removed itself there, and with a second warm-up's hook behind it (a
    GAN's two networks, a model and its loaded copy) the step raised RuntimeError
    ("OrderedDict mutated during iteration")."""
    models = []
    for _ in range(2):
        model = _model()
        fewbit.convert_(model, Config(saved_bits=2, min_numel=0, warmup_steps=1, warmup_bits=4))
        models.append((model, torch.optim.SGD(model.parameters(), lr=0.01)))
    for i in range(3):
        for model, opt in models:
            opt.zero_grad()
            model(_batch(i)).square().mean().backward()
            opt.step()
    for model, _ in models:
        policy = compressor_of(model).policy
        assert policy.steps_done == 1 and policy.current is policy.policy and policy._handle is None
