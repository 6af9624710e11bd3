"""The ``fewbit plan`` command: fit a training step of a Hugging Face model into a memory budget.

Builds the model from its transformers config class defaults (random weights; nothing is
downloaded), plans it with :func:`fewbit.plan` (profile + MILP, docs/compression.md §4), prints
the plan, applies it and runs two training steps, the second measured (AdamW/SGD, optimizer
state included): on CUDA ``torch.cuda.max_memory_allocated``; on the CPU the tensors held when
the step starts (parameters, gradients, buffers, optimizer state, the batch) plus the most
the step's own tensors held at once, from ``torch.profiler``'s memory timeline
(:func:`fewbit.memory.peak_allocated_bytes`).

Imports only click and the standard library at import time.
"""

from __future__ import annotations

import os
import sys

import click

from fewbit._optimizers import OPTIMIZER_STATES
from fewbit.memory_cli import MODELS, OutputFile, _check_fits, _fail, _hidden, _inputs, _model_setup, _positive

__all__ = ["plan"]

#: The optimizers ``--optimizer`` takes: the planner's, less "none" (the command measures a real step).
_OPTIMIZERS = [name for name in OPTIMIZER_STATES if name != "none"]


def _measure(model, batch, optimizer: str, device) -> tuple[int | None, int, float]:
    """One planned training step after a first one (which allocates the optimizer state):
    ``(peak bytes or None, saved bytes, loss)``. The peak: on CUDA
    ``torch.cuda.max_memory_allocated``; on the CPU what the step's tensors held at most
    (:func:`fewbit.memory.peak_allocated_bytes`, torch.profiler's memory timeline) beside
    what is held when it starts (:func:`fewbit.memory.held_bytes`: parameters, gradients,
    buffers, optimizer state, the batch); None where the profiler gives no timeline."""
    import torch

    from fewbit.memory import held_bytes, peak_allocated_bytes, saved_tensor_report

    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=1e-5) if optimizer in ("adamw", "adam")
           else torch.optim.SGD(params, lr=1e-5, momentum=0.9 if optimizer == "sgd_momentum" else 0.0))
    reports = []

    def step():
        reports.append(saved_tensor_report(model, batch))
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # the optimizer state and the gradients, held from then on
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        start = held_bytes(model, opt, batch)
        try:
            peak = start + peak_allocated_bytes(step, device)
        except RuntimeError:
            peak = None
    rep = reports[-1]
    return peak, rep.saved_bytes, rep.loss


@click.command("plan")
@click.option("--model", "model_name", required=True, metavar="NAME",
              help=f"Hugging Face architecture: {', '.join(MODELS)}.")
@click.option("--budget", required=True, metavar="SIZE",
              help="Memory budget: bytes, '2GiB', '512MB', or a share of the unplanned peak such as '50%'.")
@click.option("--seq-len", default=256, show_default=True, type=int, callback=_positive,
              help="Tokens per example (vision models use their image size instead).")
@click.option("--batch", default=1, show_default=True, type=int, callback=_positive)
@click.option("--layers", default=None, type=int, callback=_positive,
              help="Override the number of layers of the default config.")
@click.option("--hidden", default=None, type=int, callback=_hidden,
              help="Override the hidden size (MLP width and heads follow).")
@click.option("--device", default="cpu", show_default=True, help="torch device (cpu, cuda).")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(_OPTIMIZERS),
              help="Optimizer whose state counts as static memory.")
@click.option("--options", "options", default=None, metavar="LIST",
              help="Comma-separated options per tensor group, of keep, recompute, quant<b>, division<b>, "
                   "outlier<b> (b in 1,2,4,8) and fewbit<b> (default: keep,quant8,quant4,quant2,fewbit3,recompute); "
                   "keep is always one of them.")
@click.option("--repeats", default=3, show_default=True, type=int, callback=_positive,
              help="Timed profiling steps.")
@click.option("--output", type=OutputFile(), default=None,
              help="Save the plan as JSON here (an existing file is not overwritten).")
def plan(model_name, budget, seq_len, batch, layers, hidden, device, optimizer, options, repeats, output):
    """Plan a training step of a Hugging Face model under a memory budget, apply it, measure it.

    Per tensor group of each repeated block: keep, compress (group quantizer, few-bit
    activations) or recompute, chosen by a MILP that minimises the added step time (Adacc).
    """
    key = model_name.lower()
    if key not in MODELS:
        _fail(f"unknown model {model_name!r}; supported: {', '.join(MODELS)}")
    if output is not None:
        if os.path.lexists(output):  # a dangling link too (found after the whole profile)
            _fail(f"--output {output} exists; not overwriting it")
        from fewbit.cli import _check_writable

        _check_writable(output, force=True)  # before the profile and the solve, not after
    from fewbit import planner  # imports torch

    try:
        parsed = planner.parse_budget(budget, "--budget")
        opts = None if options is None else [o.strip() for o in options.split(",") if o.strip()]
        if opts is not None and not opts:
            _fail(f"--options must name at least one option, got {options!r}")
        if opts is not None:
            for o in opts:
                planner.get_option(o)
    except ValueError as e:
        _fail(str(e).replace("options must", "--options must"))

    import torch

    import fewbit

    dev, _, cfg, seq, model_cls = _model_setup(key, layers, hidden, seq_len, device)  # as `fewbit memory`
    _check_fits(key, cfg, model_cls, batch, seq, device)
    torch.manual_seed(0)
    model = model_cls(cfg).to(dev)
    model.train()
    inputs = _inputs(key, cfg, batch, seq_len, dev)
    try:
        p = fewbit.plan(model, inputs, parsed if isinstance(parsed, int) else budget, options=opts,
                        optimizer=optimizer, repeats=repeats)
    except ValueError as e:
        _fail(str(e).replace("memory_budget", "--budget"))
    except (MemoryError, torch.OutOfMemoryError) as e:
        _fail(f"out of memory while profiling {key}: lower --seq-len/--batch ({type(e).__name__})")
    click.echo(str(p))
    if output is not None:
        try:
            with open(output, "x") as fh:
                fh.write(p.to_json() + "\n")
        except OSError as e:
            _fail(f"cannot write --output {output}: {e.strerror or e}")
        click.echo(f"plan saved to {output}")
    fewbit.convert_(model, p)
    peak, saved, loss = _measure(model, inputs, optimizer, dev)
    mib = 2.0**20
    if peak is None:
        # a lower bound only: a recomputed block's saves during backward and the
        # temporaries are not counted (it had printed "within" for such plans unchecked)
        peak = p.static_bytes + saved
        how = "static + saved for backward (fewbit.memory counter); a lower bound: the profiler gave no timeline"
        verdict = "OVER" if peak > p.budget_bytes else "not checked"
    else:
        how = "torch.cuda.max_memory_allocated" if dev.type == "cuda" else "torch.profiler's memory timeline"
        over = peak - p.budget_bytes
        by = f"{over / mib:.2f} MiB" if over >= 2**20 else f"{over / 1024:.1f} KiB"
        verdict = "within" if over <= 0 else f"OVER by {by} ({100 * over / p.budget_bytes:.2f} %)"
    click.echo(f"measured peak {peak / mib:.2f} MiB ({how}) vs predicted {p.predicted_peak_bytes / mib:.2f} MiB; "
               f"budget {p.budget_bytes / mib:.2f} MiB: {verdict}; loss {loss:.4f}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan())
