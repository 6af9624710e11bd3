"""The training loop shared by ``train_lm.py`` and ``train_cnn.py`` (and ``main_job.py``).

Each script keeps its model, its data and its defaults; everything else lives here:

- the variants (``--variants``) and how a model is converted for one
  (:func:`apply_variant`):

  - ``vanilla``: torch/transformers as is;
  - ``fewbit1`` .. ``fewbit4``: activations replaced by fewbit b-bit backward
    (``fewbit.convert_``; Novikov et al., "Few-bit Backward", ICML 2023);
  - ``actnn2``: the paper's ActNN baseline: only the activation functions' saved inputs
    are group-quantized to 2 bits (``fewbit.compress_activations`` inside each activation);
  - ``fewbit3+quant4``, ``fewbit3+quant2``: fewbit 3-bit activations and every other saved
    tensor quantized to 4 (2) bits (docs/method.md §7; ``+quant2`` is the uniform baseline of
    ``gact2``);
  - ``fewbit3+quant2+warm4``: the same at 4 bits for the first :data:`WARM_STEPS` training
    steps, then at 2 bits (``Config(warmup_steps=WARM_STEPS, warmup_bits=4)``; the README's
    remedy for 2-bit runs that stay on the early plateau; the run's peak is the 4-bit one);
  - ``fewbit3+quant2+block4``: 2 bits, but the blocks' own saves (a gated MLP's product
    ``act(gate(x)) * up(x)``) at 4 bits (``Config(layer_bits={"block": 4})``);

- seeding and building a model for a (variant, seed) (:func:`prepare_model`);
- the AdamW loop with warm-up + cosine learning rate, exact saved-bytes counting, the
  evaluation cadence, the CSV rows and the progress bar (:func:`train_loop`,
  :func:`train_variant`);
- the common command-line options (:func:`build_parser`, :func:`setup`) and the loop over
  variants and seeds that writes ``OUT/<kind>_<variant>_seed<seed>.csv`` (:func:`run_all`)
  with the columns :data:`CSV_FIELDS`.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import fewbit
from _cli import out_dir, run_tag

VARIANTS = ("vanilla", "fewbit1", "fewbit2", "fewbit3", "fewbit4", "actnn2", "fewbit3+quant4",
            "fewbit3+quant2", "fewbit3+quant2+warm4", "fewbit3+quant2+block4", "gact2", "gact4", "division", "adacc")

#: Training steps at 4 bits of ``fewbit3+quant2+warm4`` before it goes to 2 bits.
WARM_STEPS = 100

#: Draws of fewbit's noise stream skipped per ``--noise-draw`` (a noise seed per compressed
#: tensor: more than a run of train_lm.py's defaults makes, about 30 per step; runs of more
#: than 10**5 compressed tensors share seeds with the next draw's later steps).
NOISE_DRAW_STRIDE = 100_000

#: Saved-tensor compression variants (docs/compression.md §2-§4): fewbit 3-bit activations and
#: ``fewbit.Config`` compression fields.
_POLICY_VARIANTS = {
    "gact2": {"saved_bits": "auto", "average_bits": 2},
    "gact4": {"saved_bits": "auto", "average_bits": 4},
    "fewbit3+quant2+warm4": {"saved_bits": 2, "warmup_steps": WARM_STEPS, "warmup_bits": 4},
    "fewbit3+quant2+block4": {"saved_bits": 2, "layer_bits": {"block": 4}},
    "division": {"saved_bits": 2, "compressor": "division"},
    "adacc": {"saved_bits": 4, "compressor": "adacc"},
}
CSV_FIELDS = ("step", "train_loss", "val_loss", "accuracy", "step_time_s", "peak_saved_bytes")


@dataclass(frozen=True)
class Task:
    """What a script trains on: its data and its loss (the model comes separately).

    Attributes:
        next_batch: ``() -> (inputs, targets)``, the next training batch, on the device.
        forward_loss: ``(model, inputs, targets) -> loss``, a scalar tensor.
        evaluate: ``(model) -> (val_loss, accuracy)``, called in eval mode without grad.
    """

    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    forward_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], tuple[float, float]]


# ---------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------

class _QuantizedInputBackward(torch.autograd.Function):
    """The ActNN baseline's activation: forward as ``inner``; what is kept for backward is
    the input group-quantized (``fewbit.quant.quantize``, stochastic rounding), and backward
    is ``inner``'s at the dequantized input (ActNN, Chen et al. 2021; the baseline of
    Novikov et al. 2023, Table 2). Its own autograd function, not a compressor's saved-tensor
    hook: the compressor keeps the input of a call whose backward is not linear in it exact
    (fewbit.quant.nonlinear), which is exactly what this baseline does not do."""

    @staticmethod
    def forward(ctx, x, inner, bits, group_size, *params):
        from fewbit.quant import quantize

        qt = quantize(x, bits, group_size=group_size)
        ctx.save_for_backward(qt.packed, qt.mins, qt.scales)
        ctx.meta = (qt.shape, qt.dtype, bits, group_size, qt.decode_seed)
        ctx.inner = inner
        return inner(x.clone() if getattr(inner, "inplace", False) else x)

    @staticmethod
    def backward(ctx, grad):
        from fewbit.quant import QuantizedTensor, dequantize

        params = [p for p in ctx.inner.parameters()]
        x = dequantize(QuantizedTensor(*ctx.saved_tensors, *ctx.meta)).requires_grad_()
        with torch.enable_grad():
            y = ctx.inner(x)
        wanted = [x] + [p for p in params if p.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
        gx = next(grads)
        return (gx, None, None, None) + tuple(next(grads) if p.requires_grad else None for p in params)


class QuantizedSavedActivation(nn.Module):
    """Run an activation module with its input kept group-quantized for backward (the
    ActNN baseline; :class:`_QuantizedInputBackward`). The saved bytes are those of the
    packed codes and their per-group statistics (``bits`` per element + 2 bfloat16 values
    per ``group_size`` elements)."""

    def __init__(self, inner: nn.Module, bits: int = 2, group_size: int = 256) -> None:
        super().__init__()
        self.inner, self.bits, self.group_size = inner, bits, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.inner(x)
        return _QuantizedInputBackward.apply(x, self.inner, self.bits, self.group_size, *self.inner.parameters())

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}"


def _replace_activations(model: nn.Module, make: Callable[[nn.Module], nn.Module]) -> int:
    from fewbit.memory import is_activation_module

    targets = [(name, m) for name, m in model.named_modules() if name and is_activation_module(m)]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(m))
    return len(targets)


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    return variant


def apply_variant(model: nn.Module, variant: str, *, group_size: int = 256) -> None:
    """Convert ``model`` in place for ``variant``.

    ``fewbitB``: ``fewbit.convert_(model, Config(activation_bits=B))``; ``fewbit3+quantQ``:
    ``Config(activation_bits=3, saved_bits=Q)`` (linear/conv/norm/attention saved tensors
    group-quantized); ``gact2``/``gact4``: ``Config(activation_bits=3, saved_bits="auto",
    average_bits=2/4)`` (:func:`train_loop` calls ``adapt`` before each step); ``division``:
    ``saved_bits=2, compressor="division"``; ``adacc``: ``saved_bits=4, compressor="adacc"``; ``actnn2``: activation modules wrapped in
    :class:`QuantizedSavedActivation` (inputs kept at 2 bits); ``fewbit3+quant2+warm4``: ``saved_bits=2,
    warmup_steps=WARM_STEPS, warmup_bits=4``; ``fewbit3+quant2+block4``: ``saved_bits=2,
    layer_bits={"block": 4}`` (a block's own saves, e.g. a gated MLP's product, at 4 bits).

    ``group_size`` goes to ``Config(group_size=...)`` (and to the actnn2 wrappers): the
    group quantizer's elements per (min, scale) pair; variants without one ignore it.

    Raises:
        ValueError: for an unknown variant.
        RuntimeError: if a fewbit variant finds no activation to convert.
    """
    check_variant(variant)
    if variant == "vanilla":
        return
    if variant == "actnn2":
        n = _replace_activations(model, lambda m: QuantizedSavedActivation(m, bits=2, group_size=group_size))
        if n == 0:
            raise RuntimeError("actnn2: the model has no activation module")
        return
    import fewbit

    if variant in _POLICY_VARIANTS:
        fewbit.convert_(model, fewbit.Config(activation_bits=3, group_size=group_size, **_POLICY_VARIANTS[variant]))
        return
    bits = int(variant[len("fewbit")])
    saved_bits = int(variant[-1]) if "+quant" in variant else None
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=bits, saved_bits=saved_bits, group_size=group_size))
    if not summary.replaced:
        raise RuntimeError(f"{variant}: fewbit.convert_ replaced no activation")


def prepare_model(
    variant: str, seed: int, build_model: Callable[[], nn.Module], device: str | torch.device = "cpu",
    *, group_size: int = 256, noise_draw: int = 0,
) -> nn.Module:
    """Seed torch's generator with ``seed``, build the model on ``device`` and convert it
    for ``variant`` (with ``group_size``, :func:`apply_variant`); return the model. ``noise_draw`` K > 0: skip K · :data:`NOISE_DRAW_STRIDE` draws of
    fewbit's noise stream for ``seed``, so the run compresses with other rounding noise and
    the same initialisation, data order and dropout masks (0: the stream as it is)."""
    check_variant(variant)
    # fewbit.manual_seed, not torch's alone: it restarts fewbit's noise streams too, so a run's
    # rounding noise depends on its seed only. With torch.manual_seed a second compressed run of
    # a seed in one process (another variant before it, --variants a b) went on with the
    # stream the first had drawn from, and got other noise than the same run alone.
    fewbit.manual_seed(seed)
    model = build_model().to(torch.device(device))
    apply_variant(model, variant, group_size=group_size)
    if noise_draw:
        from fewbit.quant import _noise_stream

        _noise_stream.advance(noise_draw * NOISE_DRAW_STRIDE)
    return model


# ---------------------------------------------------------------------------------------
# Loop
# ---------------------------------------------------------------------------------------

def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def train_loop(
    model: nn.Module,
    task: Task,
    *,
    steps: int,
    lr: float,
    warmup: int,
    eval_every: int,
    weight_decay: float = 0.01,
    progress: str | None = None,
) -> list[dict]:
    """AdamW training with exact saved-bytes counting; returns the CSV rows.

    A row every ``eval_every`` steps and after the last one: the mean training loss and
    step time since the previous row, ``task.evaluate(model)``'s ``(val_loss, accuracy)`` (in
    eval mode, without grad) and the largest number of bytes one step saved for backward
    (``fewbit.memory.SavedTensorRecorder``). ``progress``: the description of a tqdm bar,
    or ``None`` for none.

    Raises:
        FloatingPointError: if a training loss is not finite.
    """
    from fewbit.convert import compressor_of
    from fewbit.memory import SavedTensorRecorder

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rows: list[dict] = []
    losses, times, peak = [], [], 0
    rec = SavedTensorRecorder(model)
    comp = compressor_of(model)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress, leave=True, dynamic_ncols=True)
    for step in range(1, steps + 1):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, steps, lr, warmup)
        x, y = task.next_batch()
        t0 = time.perf_counter()
        rec.reset()
        if comp is not None:  # GACT re-plans when due (doubling gaps), noise weighed by AdamW's moments; others: no-op
            comp.adapt(model, lambda: task.forward_loss(model, x, y), opt)
        with rec:
            loss = task.forward_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        peak = max(peak, rec.saved_bytes)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"training diverged at step {step} (loss {losses[-1]})")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % eval_every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                val_loss, acc = task.evaluate(model)
            rows.append({
                "step": step,
                "train_loss": f"{sum(losses) / len(losses):.6f}",
                "val_loss": f"{val_loss:.6f}",
                "accuracy": f"{acc:.6f}",
                "step_time_s": f"{sum(times) / len(times):.6f}",
                "peak_saved_bytes": peak,
            })
            losses, times, peak = [], [], 0
    if bar is not None:
        bar.close()
    return rows


def train_variant(
    kind: str,
    variant: str,
    seed: int,
    build_model: Callable[[], nn.Module],
    task: Task,
    *,
    device: str = "cpu",
    progress: bool = False,
    group_size: int = 256,
    noise_draw: int = 0,
    **loop: Any,
) -> list[dict]:
    """Train one (variant, seed): :func:`prepare_model`, then :func:`train_loop` with the
    keyword arguments ``loop`` (``steps``, ``lr``, ``warmup``, ``eval_every``) and a progress
    bar titled ``"<kind> <variant> seed <seed>"`` if ``progress``; return the CSV rows."""
    model = prepare_model(variant, seed, build_model, device, group_size=group_size, noise_draw=noise_draw)
    if torch.device(device).type == "cpu" and variant != "vanilla":  # step times of the numba kernels from step 1
        from fewbit.ops import load_cpu_kernels

        load_cpu_kernels()
    return train_loop(model, task, progress=f"{kind} {variant} seed {seed}" if progress else None, **loop)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def saved_bytes(make_y: Callable[[], Any], exclude: nn.Module | None = None) -> int:
    """Bytes saved for backward while ``make_y()`` runs (its result dropped at once), every
    storage counted once; the storages of ``exclude``'s parameters are left out. Works for a
    ``torch.compile``d ``make_y`` too (what the compiled graph saves)."""
    params = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = make_y()
    del y
    return sum(seen.values())


def _at_least(kind, low: float, strict: bool):
    def parse(s):
        v = kind(s)
        if not math.isfinite(v) or (v <= low if strict else v < low):  # nan and inf too (--lr nan)
            finite = " and finite" if kind is float else ""
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}{finite}, got {s}")
        return v
    return parse


positive_int, positive_float, nonneg_int = _at_least(int, 0, True), _at_least(float, 0, True), _at_least(int, 0, False)


def thread_count(s: str) -> int:
    """An argparse type for ``--threads``: 0 (torch's default) to the machine's CPU count
    (``torch.set_num_threads`` of a much larger count crashes the process)."""
    v, top = int(s), os.cpu_count() or 1
    if not 0 <= v <= top:
        raise argparse.ArgumentTypeError(f"must be in [0, {top}] (0: torch's default), got {s}")
    return v


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    """``p.error`` unless ``device`` is cpu or an available cuda device
    (:func:`fewbit._checks.check_device`)."""
    from fewbit._checks import check_device as _check

    try:
        _check(device)
    except ValueError as e:
        p.error(str(e))


def build_parser(description: str) -> argparse.ArgumentParser:
    """The options every training script takes (the first paragraph of ``description`` is
    the help text); a script adds its own and changes defaults with ``set_defaults``."""
    p = argparse.ArgumentParser(description=description.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT",
                   help=f"variants to train, of: {' '.join(VARIANTS)}")
    p.add_argument("--seeds", nargs="+", type=nonneg_int, default=[0])
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--warmup", type=nonneg_int, default=20)
    p.add_argument("--eval-every", type=positive_int, default=25)
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for the CSVs")
    p.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar per run")
    p.add_argument("--group-size", type=positive_int, default=256,
                   help="elements per (min, scale) pair of the group quantizer: fewbit.Config(group_size=...) "
                        "of the variants that quantize saved tensors (+quantQ, gact2/4, actnn2); CSVs of a "
                        "size other than 256 are named <task>_<variant>_g<size>_seed<N>.csv")
    p.add_argument("--noise-draw", type=nonneg_int, default=0,
                   help="train with the K-th other draw of the compression noise: the same initialisation, data "
                        "order and dropout masks (fewbit's noise stream of the seed skipped K * 10**5 draws); "
                        "CSVs of K > 0 are named <task>_<variant>_draw<K>_seed<N>.csv")
    return p


def setup(p: argparse.ArgumentParser, args: argparse.Namespace, quick: dict[str, Any],
          check: Callable[[argparse.Namespace], None] | None = None) -> None:
    """Apply the ``quick`` sizes if ``--quick`` was given, then run the script's own
    ``check(args)`` of the sizes (it calls ``p.error``), stop on a ``--device`` other than
    cpu or an available cuda (:func:`check_device`), make ``--out`` (``p.error`` on a file
    there: before any run, after every check) and set torch's CPU threads."""
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    if check is not None:
        check(args)
    check_device(p, args.device)
    out_dir(p, args.out)
    if args.threads:
        torch.set_num_threads(args.threads)


def loop_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`build_parser` that every ``run_<kind>`` function takes."""
    return dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                eval_every=args.eval_every, device=args.device, progress=args.progress,
                group_size=args.group_size, noise_draw=args.noise_draw)


def run_all(
    args: argparse.Namespace, kind: str, run: Callable[[str, int], list[dict]], *, mib_digits: int = 2
) -> int:
    """Train every ``--variants`` x ``--seeds`` with ``run(variant, seed)``, write each run's
    rows to ``OUT/<kind>_<variant>[_g<group size>][_draw<K>]_seed<seed>.csv`` and print its
    last row; return 0."""
    for variant in args.variants:
        for seed in args.seeds:
            rows = run(variant, seed)
            path = args.out / f"{kind}_{variant}{run_tag(args.group_size, getattr(args, 'noise_draw', 0))}_seed{seed}.csv"
            write_csv(path, rows)
            last = rows[-1]
            print(f"{variant:>15} seed {seed}: val_loss {float(last['val_loss']):.4f} "
                  f"acc {float(last['accuracy']):.4f} step {float(last['step_time_s']) * 1e3:.1f} ms "
                  f"saved {int(last['peak_saved_bytes']) / 2**20:.{mib_digits}f} MiB -> {path}", flush=True)
    return 0
