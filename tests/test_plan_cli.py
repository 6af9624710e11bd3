"""``fewbit plan`` (fewbit/plan_cli.py), in-process with click's CliRunner; tiny GPT-2 configs."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("scipy")

from test_cli import assert_one_line_error, run  # noqa: E402

import fewbit  # noqa: E402

TINY = ("--model", "gpt2", "--layers", "1", "--hidden", "32", "--seq-len", "16", "--batch", "2",
        "--repeats", "1", "--optimizer", "sgd")


def test_plan_cli_prints_plan_and_measured_peak(tmp_path):
    out = tmp_path / "plan.json"
    r = run("plan", *TINY, "--budget", "100%", "--output", out)
    assert r.exit_code == 0, r.output
    assert "fewbit plan: budget" in r.stdout and "transformer.h.0" in r.stdout and "mlp.act" in r.stdout
    # on the CPU torch.profiler's memory timeline: a real peak (it had printed static +
    # saved for backward, a lower bound, "not checked"), held to the prediction
    m = re.search(r"measured peak ([\d.]+) MiB \(torch.profiler's memory timeline\) vs predicted ([\d.]+) MiB; "
                  r"budget ([\d.]+) MiB: (within|OVER by [\d.]+ KiB)", r.stdout)
    assert m, r.stdout
    measured, predicted, budget = map(float, m.groups()[:3])
    assert predicted <= budget and abs(measured - predicted) <= 0.01 * predicted, r.stdout
    p = fewbit.Plan.load(out)
    assert p.blocks[0].blocks == ["transformer.h.0"]
    # an existing --output is never overwritten
    before = out.read_text()
    assert_one_line_error(run("plan", *TINY, "--budget", "100%", "--output", out), "--output", "not overwriting")
    assert out.read_text() == before
    dangling = tmp_path / "dangling.json"  # a link to nothing: refused before profiling, not after
    dangling.symlink_to(tmp_path / "nothing.json")
    assert_one_line_error(run("plan", *TINY, "--budget", "100%", "--output", dangling), "--output", "not overwriting")


def test_plan_cli_infeasible_budget_is_one_line():
    line = assert_one_line_error(run("plan", *TINY, "--budget", "1000"), "--budget", "smallest feasible budget")
    assert re.search(r"\(\d+ bytes", line)


@pytest.mark.parametrize("args, needles", [
    (("--model", "gpt9", "--budget", "1GiB"), ("unknown model",)),
    (("--model", "gpt2", "--budget", "lots"), ("--budget", "'lots'")),
    (("--model", "gpt2", "--budget", "1GiB", "--options", "keep,zip"), ("--options", "'zip'")),
    (("--model", "gpt2", "--budget", "1GiB", "--device", "nonsense"), ("--device",)),
    (("--model", "gpt2", "--budget", "1GiB", "--device", "meta"), ("--device", "'meta'")),
    (("--model", "gpt2", "--budget", "1GiB", "--options", ","), ("--options", "at least one")),
    (("--model", "gpt2", "--budget", "1GiB", "--layers", "100000000"), ("GiB available",)),
])
def test_plan_cli_argument_errors(args, needles):
    assert_one_line_error(run("plan", *args), *needles)


def test_plan_cli_requires_budget():
    r = run("plan", "--model", "gpt2")
    assert r.exit_code != 0 and "--budget" in r.output


@pytest.mark.parametrize("args", [
    ("--model", "bert", "--seq-len", "100000"),
    ("--model", "gpt2", "--device", "nonsense"),
])
def test_memory_and_plan_share_the_model_checks(args):
    """`fewbit memory` and `fewbit plan` build the model through one set-up
    (memory_cli._model_setup): the same bad input gets the same one-line error."""
    a = assert_one_line_error(run("memory", *args))
    b = assert_one_line_error(run("plan", *args, "--budget", "1GiB"))
    assert a == b


def test_plan_cli_unwritable_output_fails_before_profiling(tmp_path):
    """An --output in a missing directory failed only after the profile and the solve."""
    r = run("plan", *TINY, "--budget", "100%", "--output", tmp_path / "nodir" / "p.json")
    assert_one_line_error(r, "nodir", "does not exist")
    assert "fewbit plan: budget" not in r.output


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen embeddings and attention"])
def test_cpu_plans_measure_their_prediction(frozen):
    """On the CPU the planner predicts a step's transient memory too (torch.profiler's
    memory timeline, ``fewbit.memory.peak_allocated_bytes``), and ``fewbit plan``'s measure
    holds it. An unfused LM's logits, held by the loop's output through backward, were left
    out of it (16.5 MiB short of 108.58), and frozen parameters' bytes were taken off the
    peak as gradients they do not have (20.4 MiB short of 85.50; review h59)."""
    import torch
    import transformers

    from fewbit.plan_cli import _measure

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=4096, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." in name)
    ids = torch.randint(0, 4096, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    p = fewbit.plan(model, batch, memory_budget="100%", fused_cross_entropy=False, repeats=1)
    fewbit.convert_(model, p)
    peak, _, _ = _measure(model, batch, "adamw", torch.device("cpu"))
    # at most a plan's own compression temporaries above (0.2 % on GPT-2 2 x 128); below by
    # what a frozen part's backward does not allocate (1.5 % here)
    assert 0.95 * p.predicted_peak_bytes <= peak <= 1.005 * p.predicted_peak_bytes, (peak, p.predicted_peak_bytes)
