"""What a new user meets first: progress of long commands, honest step times, plot legends."""

import json
import sys
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _data  # noqa: E402
import main_job  # noqa: E402
import summarize_runs  # noqa: E402

TINY = ["--model", "gpt2", "--layers", "1", "--hidden", "64", "--seq-len", "32"]


def test_memory_cli_shows_progress_on_stderr_only():
    from fewbit.memory_cli import memory

    r = CliRunner().invoke(memory, [*TINY, "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # stdout stays machine-readable
    for stage in ("fewbit memory gpt2", "building the model", "vanilla: forward+backward",
                  "fewbit: forward+backward", "fewbit+quant: forward+backward", "4/4"):
        assert stage in r.stderr, (stage, r.stderr)
    r = CliRunner().invoke(memory, [*TINY, "--json", "--no-progress"])
    assert r.exit_code == 0 and r.stderr == "", r.stderr


def test_memory_cli_builds_once_and_measures_as_three_fresh_builds(monkeypatch):
    """One build deep-copied per variant gives exactly what three fresh builds gave."""
    import torch
    import transformers

    from fewbit import memory as fm
    from fewbit.memory_cli import memory

    builds = []
    real = transformers.GPT2LMHeadModel.__init__

    def counting_init(self, *a, **k):
        builds.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "__init__", counting_init)
    r = CliRunner().invoke(memory, [*TINY, "--json", "--no-progress"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    n_cli = len(builds)
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "__init__", real)

    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=1, n_inner=256)
    ids = torch.randint(3, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))

    def fresh():
        m = transformers.GPT2LMHeadModel(cfg)
        m.train()
        return m

    want = json.loads(json.dumps(fm.compare(fresh, {"input_ids": ids, "labels": ids.clone()})))
    assert n_cli == 2  # one meta build to count parameters, one real build
    assert got == want


def test_summarize_legend_says_seed_in_singular(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    real = matplotlib.axes.Axes.legend

    def spy(self, *a, **k):
        labels.extend(self.get_legend_handles_labels()[1])
        return real(self, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    rows = [{"step": 1.0, "train_loss": 2.0, "val_loss": 2.0, "step_time_s": 0.1, "peak_saved_bytes": 1.0}]
    runs = {"lm": {"vanilla": {0: rows}, "fewbit3": {0: rows, 1: rows}}}
    summarize_runs.plot(runs, tmp_path)
    assert "vanilla (1 seed)" in labels and "fewbit3 (2 seeds)" in labels, labels


def test_summary_table_prints_no_step_times(tmp_path):
    rows = [{"step": 1.0, "train_loss": 2.0, "val_loss": 2.0, "accuracy": 0.5, "step_time_s": 0.5,
             "peak_saved_bytes": 2.0**20}]
    fast = [dict(rows[0], step_time_s=0.1, peak_saved_bytes=2.0**19)]
    md = summarize_runs.to_markdown(summarize_runs.summarize({"lm": {"vanilla": {0: rows}, "fewbit3": {0: fast}}}))
    assert "| fewbit3 | 1 | 2.0000 ± 0.0000 | 0.5000 ± 0.0000 | 0.50 | 2.00x |" in md
    assert "step ms" not in md and "time ratio" not in md


def test_main_job_times_steps_interleaved_after_warm_up(monkeypatch):
    data = _data.load_text(max_train_bytes=60_000, max_val_bytes=20_000)
    sizes = dict(batch_size=2, seq_len=16, n_layer=1, n_embd=16, n_head=2)
    order = []
    real = main_job.train_lm.apply_variant

    def spy_apply(model, variant):
        real(model, variant)
        fwd = model.forward

        def forward(*a, **k):
            order.append(variant)
            return fwd(*a, **k)

        model.forward = forward

    monkeypatch.setattr(main_job.train_lm, "apply_variant", spy_apply)
    times = main_job.time_steps(("vanilla", "fewbit3"), sizes, data, warmup=2, rounds=4)
    assert {k: len(v) for k, v in times.items()} == {"vanilla": 4, "fewbit3": 4}
    assert all(t > 0 for ts in times.values() for t in ts)
    v, f = "vanilla", "fewbit3"
    assert order == [v, v, f, f] + [v, f, f, v, v, f, f, v]  # warm-up, then ABBA


def test_main_job_uses_cuda_when_present(monkeypatch, capsys):
    """The main job's default device is CUDA when one is present (issue: it trained on the CPU
    of a GPU machine), the CPU otherwise; --help states the default."""
    import pytest
    import torch

    for present, device in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda present=present: present)
        with pytest.raises(SystemExit):
            main_job.main(["--help"])
        assert f"(default: {device})" in " ".join(capsys.readouterr().out.split())
