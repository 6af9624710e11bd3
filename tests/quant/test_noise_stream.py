"""Compression's noise seeds come from fewbit's own stream, never from torch's generators.

A converted model must draw the same dropout masks (and anything else random) as the
vanilla model under the same seed; ``fewbit.manual_seed`` replays the compression noise
within a process, and a fresh process reproduces it from ``torch.manual_seed`` alone."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import fewbit
from fewbit import quant as fq


def _gpt2_losses(convert: bool, steps: int = 3):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)  # default dropout 0.1 (CPU dropout: torch's CPU generator)
    if convert:
        fewbit.convert_(model, fewbit.Config(saved_bits=4))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 100, (2, 32))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, torch.rand(4)


def test_converted_model_draws_the_vanilla_dropout_masks():
    """Step 1's loss is the vanilla loss bit for bit (same weights, same dropout masks:
    the forward is exact); later steps differ only by the compressed gradients, and the
    torch stream after training is where vanilla's is. Before, each compressed tensor took
    one draw from torch's CPU generator, so step 1's masks already differed."""
    vanilla, after_vanilla = _gpt2_losses(convert=False)
    converted, after_converted = _gpt2_losses(convert=True)
    assert converted[0] == vanilla[0]
    assert torch.equal(after_converted, after_vanilla)
    assert converted[1:] != vanilla[1:]  # the 4-bit gradients did train differently
    assert all(abs(a - b) < 0.05 for a, b in zip(converted, vanilla))


def test_dropout_mask_after_a_compressed_backward_is_vanilla_mask():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.5), nn.Linear(128, 128))


    ref = copy.deepcopy(model)
    fewbit.convert_(model, fewbit.Config(saved_bits=2))
    x = torch.randn(64, 128)
    outs = {}
    for name, m in (("vanilla", ref), ("converted", model)):
        torch.manual_seed(1)
        m(x).sum().backward()  # compresses the Linear inputs (64 x 128 = 8192 elements each)
        outs[name] = m(x)  # the second forward's dropout mask
    assert torch.equal(outs["converted"], outs["vanilla"])


def test_fewbit_manual_seed_replays_compression_noise():
    x = torch.randn(5000)
    fewbit.manual_seed(3)
    a = fq.quantize(x, 2)
    b = fq.quantize(x, 2)
    fewbit.manual_seed(3)
    c = fq.quantize(x, 2)
    assert torch.equal(a.packed, c.packed)
    assert not torch.equal(a.packed, b.packed)  # fresh noise at every call
    # torch's stream is seeded too, as torch.manual_seed does
    fewbit.manual_seed(3)
    r = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(r, torch.rand(3))


def test_a_new_torch_seed_restarts_the_noise_stream():
    x = torch.randn(5000)
    torch.manual_seed(11)
    a = fq.quantize(x, 2)
    torch.manual_seed(12)
    b = fq.quantize(x, 2)
    fewbit.manual_seed(11)
    c = fq.quantize(x, 2)
    assert torch.equal(a.packed, c.packed)
    assert not torch.equal(a.packed, b.packed)


def test_quantize_does_not_advance_torch_generator():
    torch.manual_seed(5)
    fq.quantize(torch.ones(5000).cumsum(0), 2)
    r = torch.rand(3)
    torch.manual_seed(5)
    torch.ones(5000).cumsum(0)
    assert torch.equal(r, torch.rand(3))


def test_fresh_process_reproduces_noise_from_torch_seed():
    code = (
        "import hashlib, torch, fewbit.quant as fq; torch.manual_seed(21); x = torch.linspace(-3, 3, 5000);"
        "print(*(hashlib.sha256(fq.quantize(x, 2).packed.numpy().tobytes()).hexdigest() for _ in range(2)))"
    )
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0] == outs[1]
    first, second = outs[0].split()
    assert first != second


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_manual_seed_refuses_out_of_range(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"):
        fewbit.manual_seed(seed)


@pytest.mark.parametrize("seed", [True, 1.5, "0", None])
def test_manual_seed_refuses_non_integers(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        fewbit.manual_seed(seed)


def test_a_side_computation_seeded_alike_every_step_does_not_restart_the_noise():
    """A stream per torch seed goes on where it left off: an evaluation seeded with
    ``torch.manual_seed(123)`` under ``fork_rng`` at every step must not make the training
    stream start over when torch's seed comes back (it did: one noise pattern for all
    steps, a bias that SGD does not average away)."""
    x = torch.randn(5000)
    fewbit.manual_seed(0)
    train, side = [], []
    for _ in range(4):
        train.append(fq.quantize(x, 2).packed.numpy().tobytes())
        with torch.random.fork_rng():
            torch.manual_seed(123)
            side.append(fq.quantize(x, 2).packed.numpy().tobytes())
    assert len(set(train)) == 4
    assert len(set(side)) == 4
    assert not set(train) & set(side)


def test_resuming_from_a_saved_torch_rng_state_draws_new_noise():
    """As a trainer resumes (a fresh process: ``set_seed``, then the saved torch RNG
    state), the resumed steps' noise is not the first steps' (the stream was created again
    from the seed alone and replayed them); it is made from torch's state at its first
    draw, which the run's own torch draws (data, dropout) have moved."""

    x = torch.linspace(-3, 3, 5000)

    def step():
        torch.randperm(100)  # the run's own draw from torch's generator (data order)
        return fq.quantize(x, 2).packed.numpy().tobytes()

    fewbit.manual_seed(42)
    first = [step(), step()]
    saved = torch.get_rng_state()
    fq._noise_stream.reset()  # a fresh process
    torch.manual_seed(42)
    torch.set_rng_state(saved)
    resumed = [step(), step()]
    assert not set(first) & set(resumed)


def test_noise_streams_are_bounded(monkeypatch):
    monkeypatch.setattr(fq._NoiseStream, "MAX_STREAMS", 8)
    fq._noise_stream.reset()
    for seed in range(20):  # seeding every step with a new value
        torch.manual_seed(seed)
        fq.quantize(torch.randn(5000), 2)
    assert len(fq._noise_stream.streams) == 8


def test_replay_is_per_thread_and_takes_the_forward_noise():
    """A checkpointed block records the stream at its forward and replays it in the
    recomputation: the same seeds, also when the stream is first made inside the block
    (from torch's state then, which the checkpoint restores), and other threads' draws
    are not affected (two overlapping replays left one thread's replayed copy installed
    for good, replaying old noise)."""
    import threading

    fewbit.manual_seed(1)
    state = fq._noise_stream.get_state()  # block entry: no stream yet
    torch_state = torch.get_rng_state()
    torch.rand(3)  # the block's dropout
    forward = [fq._draw_seed(None) for _ in range(3)]
    after = fq._noise_stream.get_state()

    torch.set_rng_state(torch_state)  # the recomputation, as torch.utils.checkpoint does
    torch.rand(3)
    entered, release, other = threading.Event(), threading.Event(), []

    def draw_elsewhere():
        entered.wait()
        other.append(fq._draw_seed(None))
        release.set()

    t = threading.Thread(target=draw_elsewhere)
    t.start()
    with fq._noise_stream.replay(state):
        entered.set()
        release.wait()
        recomputed = [fq._draw_seed(None) for _ in range(3)]
    t.join()
    assert recomputed == forward
    assert other[0] not in forward  # the other thread drew from the main stream, going on
    assert fq._noise_stream.get_state()[1:] == (after[1], after[2] + 1)


def _resumable_run(steps, resume_at=None, restore_fewbit=True):
    """A converted GPT-2 (dropout 0.1, 2-bit saved tensors) trained ``steps`` steps; with
    ``resume_at``, checkpointed there (weights, optimizer, torch's and fewbit's RNG state,
    through ``torch.save`` / ``torch.load(weights_only=True)``) and resumed as a fresh
    process would (every noise stream dropped, torch seeded otherwise)."""
    import io

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)

    def build():
        model = transformers.GPT2LMHeadModel(cfg)
        fewbit.convert_(model, fewbit.Config(saved_bits=2))
        return model.train()

    fewbit.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                        "fewbit_rng": fewbit.get_rng_state()}, buffer)
            fewbit.manual_seed(1234)  # a fresh process: other streams, other torch state
            fq.quantize(torch.randn(4096), 2)
            model = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            buffer.seek(0)
            ckpt = torch.load(buffer, weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            torch.set_rng_state(ckpt["torch_rng"])
            if restore_fewbit:
                fewbit.set_rng_state(ckpt["fewbit_rng"])
        ids = torch.randint(0, 100, (2, 32))  # data order from torch's generator
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_resuming_with_fewbit_rng_state_gives_the_uninterrupted_losses():
    """With fewbit.get_rng_state saved beside torch's and restored, a resumed run's losses
    are the uninterrupted run's bit for bit; with torch's state alone they are not (the
    resumed steps draw other rounding noise)."""
    uninterrupted = _resumable_run(5)
    assert _resumable_run(5, resume_at=2) == uninterrupted
    torch_only = _resumable_run(5, resume_at=2, restore_fewbit=False)
    assert torch_only[:3] == uninterrupted[:3]  # step 3's forward is exact; its noise shows from step 4
    assert torch_only[3:] != uninterrupted[3:]


def test_rng_state_round_trips_through_json_and_restores_draws():
    import json

    fewbit.manual_seed(3)
    x = torch.linspace(-3, 3, 5000)
    fq.quantize(x, 2)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        fq.quantize(x, 2)  # a second stream
    state = json.loads(json.dumps(fewbit.get_rng_state()))
    assert state["version"] == 1 and len(state["streams"]) == 2
    after = [fq.quantize(x, 2).packed.clone() for _ in range(3)]
    fq.quantize(x, 2)
    fewbit.set_rng_state(state)
    assert all(torch.equal(fq.quantize(x, 2).packed, a) for a in after)


@pytest.mark.parametrize("state, error, match", [
    ([], TypeError, "state must be the dict"),
    ({"streams": []}, TypeError, "keys"),
    ({"version": 2, "streams": []}, ValueError, r"state\['version'\] must be 1, got 2"),
    ({"version": 1, "streams": 5}, TypeError, r"state\['streams'\] must be a list"),
    ({"version": 1, "streams": [[1, 2]]}, ValueError, r"state\['streams'\]\[0\] must be three ints"),
    ({"version": 1, "streams": [[1, 2, -1]]}, ValueError, r"in \[0, 2\*\*64\)"),
    ({"version": 1, "streams": [[1, 2, 3.0]]}, ValueError, "three ints"),
    ({"version": 1, "streams": [[1, 2, True]]}, ValueError, "three ints"),
    ({"version": 1, "streams": [[1, 2, 3], [1, 5, 6]]}, ValueError, "twice"),
])
def test_set_rng_state_refuses_bad_state_and_changes_nothing(state, error, match):
    fewbit.manual_seed(3)
    fq.quantize(torch.randn(100), 2)
    before = fewbit.get_rng_state()
    with pytest.raises(error, match=match):
        fewbit.set_rng_state(state)
    assert fewbit.get_rng_state() == before
