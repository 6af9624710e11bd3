"""The ``fewbit plan`` command: fit a training step of a Hugging Face model into a memory budget.

Builds the model from its transformers config class defaults (random weights; nothing is
downloaded), plans it with :func:`fewbit.plan` (profile + MILP, docs/compression.md §4), prints
the plan, applies it and runs one measured training step: on CPU the peak is static memory +
the bytes saved for backward (:class:`fewbit.memory.SavedTensorRecorder`), a lower bound (a
recomputed block's saves during backward are not counted), so the budget is checked only on
CUDA, where it is ``torch.cuda.max_memory_allocated`` over an AdamW/SGD step (optimizer
state included).

Imports only click and the standard library at import time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from fewbit._optimizers import OPTIMIZER_STATES
from fewbit.memory_cli import MODELS, OutputFile, _check_fits, _fail, _inputs, _model_setup, _positive

__all__ = ["plan"]

#: The optimizers ``--optimizer`` takes: the planner's, less "none" (the command measures a real step).
_OPTIMIZERS = [name for name in OPTIMIZER_STATES if name != "none"]


def _measure(model, batch, optimizer: str, device) -> tuple[int, int, float]:
    """One planned training step: ``(peak bytes, saved bytes, loss)``."""
    import torch

    from fewbit.memory import saved_tensor_report

    if device.type != "cuda":
        rep = saved_tensor_report(model, batch)
        model.zero_grad(set_to_none=True)
        return -1, rep.saved_bytes, rep.loss
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=1e-5) if optimizer in ("adamw", "adam")
           else torch.optim.SGD(params, lr=1e-5, momentum=0.9 if optimizer == "sgd_momentum" else 0.0))
    for _ in range(2):  # the first step allocates the optimizer state
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        rep = saved_tensor_report(model, batch)
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)), rep.saved_bytes, rep.loss


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
@click.option("--hidden", default=None, type=int, callback=_positive,
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
    if peak < 0:
        # a lower bound only: a recomputed block's saves during backward and the
        # temporaries are not counted (it had printed "within" for such plans unchecked)
        peak = p.static_bytes + saved
        how = "static + saved for backward (fewbit.memory counter); a lower bound on the CPU"
        verdict = "OVER" if peak > p.budget_bytes else "not checked on the CPU (run with --device cuda)"
    else:
        how = "torch.cuda.max_memory_allocated"
        verdict = "within" if peak <= p.budget_bytes else "OVER"
    click.echo(f"measured peak {peak / mib:.2f} MiB ({how}) vs predicted {p.predicted_peak_bytes / mib:.2f} MiB; "
               f"budget {p.budget_bytes / mib:.2f} MiB: {verdict}; loss {loss:.4f}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan())
