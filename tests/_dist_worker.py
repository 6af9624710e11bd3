"""Training runs for ``tests/test_distributed.py``: one code path for a single process and for
each rank of a ``torch.distributed`` group (gloo on CPU, or NCCL on CUDA).

:func:`train` builds a model from a fixed seed, converts it with ``fewbit.convert_`` (before or
after wrapping it), wraps it in DDP or FSDP2 (``torch.distributed.fsdp.fully_shard``) and runs a
few SGD steps on a global batch that every rank slices the same way; it returns the global loss
curve (all-reduced mean of the ranks' losses), the final full parameters and what the
compressor saw. :func:`rank_noise` measures whether the ranks' stochastic compression noise
differs. :func:`run_rank` is the entry point of a spawned process: it runs a list of jobs and
writes one result file per rank (an exception is stored as its traceback, so one failing job
does not hide the others).
"""

from __future__ import annotations

import datetime
import gc
import os
import traceback
import weakref
from dataclasses import dataclass

import torch
from torch import nn

#: Steps of every training run, and examples of one global batch (split over the ranks).
STEPS = 5
GLOBAL_BATCH = 8
SEQ_LEN = 32
LR = {"gpt2": 0.5, "cnn": 0.2}
#: seconds after which a rank prints its stacks (a hang); the test kills it later
HANG_DUMP_S = 200


@dataclass(frozen=True)
class Job:
    """One training run.

    Attributes:
        model: ``"gpt2"`` (transformers GPT2LMHeadModel, 2 layers, width 64, seq 32) or ``"cnn"``.
        config: ``"det"`` (``Config(activation_bits=3)``: deterministic backward),
            ``"stoch"`` (``Config(activation_bits=3, saved_bits=4)``: stochastic rounding),
            ``"plan"`` (``fewbit.convert_(model, fewbit.plan(...))``) or ``"none"``.
        wrap: ``"none"``, ``"ddp"``, ``"ddp_after"`` (convert the DDP-wrapped model) or ``"fsdp2"``.
        noise_seed: ``torch.manual_seed(noise_seed + rank)`` after the model is built (the
            per-rank random state that stochastic compression draws its seeds from).
    """

    model: str
    config: str
    wrap: str = "none"
    noise_seed: int = 1000

    @property
    def name(self) -> str:
        return f"{self.model}-{self.config}-{self.wrap}-{self.noise_seed}"


def build_model(kind: str) -> nn.Module:
    """The model of ``kind`` with weights from ``torch.manual_seed(0)``; no dropout."""
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=96, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(cfg)
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )
    raise ValueError(f"model must be 'gpt2' or 'cnn', got {kind!r}")


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets), the same at every step, on every rank and in every
    run (the model memorises it, so the loss falls within a few steps)."""
    g = torch.Generator().manual_seed(12345)
    if kind == "gpt2":
        x = torch.randint(0, 96, (GLOBAL_BATCH, SEQ_LEN), generator=g)
        return x, x
    x = torch.randn(GLOBAL_BATCH, 1, 16, 16, generator=g)
    return x, torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt2":
        return model(input_ids=x, labels=y).loss
    return nn.functional.cross_entropy(model(x), y)


#: Where :func:`make_plan` keeps the plan of each model kind (set by the test and by
#: :func:`run_rank`): the planner picks by measured step times, which vary from process to
#: process on a busy machine, so every rank and every single-process reference must load
#: the one plan made first, or they would train different plans.
PLAN_DIR: str | None = None


def make_plan(model: nn.Module, kind: str):
    """A ``fewbit.plan`` for ``model`` (the planner of issue 12, when it is there): half of
    the saved bytes of a vanilla step as activation budget on top of params, grads and AdamW
    state; loaded from :data:`PLAN_DIR` when made there before. Only called when
    ``hasattr(fewbit, "plan")``."""
    import fewbit

    path = os.path.join(PLAN_DIR, f"plan-{kind}.json") if PLAN_DIR else None
    if path is not None and os.path.exists(path):
        return fewbit.Plan.load(path)
    made = _make_plan(model, kind)
    if path is not None:
        made.save(path)
    return made


def _make_plan(model: nn.Module, kind: str):
    import fewbit
    from fewbit.memory import SavedTensorRecorder

    x, y = batch(kind)
    with SavedTensorRecorder() as rec:
        loss_of(kind, model, x, y).backward()
    model.zero_grad(set_to_none=True)
    static = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    example = {"input_ids": x, "labels": y} if kind == "gpt2" else x
    return fewbit.plan(model, example, memory_budget=static + rec.saved_bytes // 2)


def _convert(model: nn.Module, job: Job):
    import fewbit

    if job.config == "none":
        return None
    if job.config == "det":
        return fewbit.convert_(model, fewbit.Config(activation_bits=3))
    if job.config == "stoch":
        return fewbit.convert_(model, fewbit.Config(activation_bits=3, saved_bits=4))
    if job.config == "plan":
        inner = model.module if hasattr(model, "module") else model
        return fewbit.convert_(model, make_plan(inner, job.model))
    raise ValueError(f"config must be det, stoch, plan or none, got {job.config!r}")


def _wrap(model: nn.Module, job: Job, world: int) -> nn.Module:
    if job.wrap in ("none",) or world == 1:
        return model
    if job.wrap in ("ddp", "ddp_after"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if job.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        blocks = model.transformer.h if job.model == "gpt2" else [model[0], model[3]]
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    raise ValueError(f"wrap must be none, ddp, ddp_after or fsdp2, got {job.wrap!r}")


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by their name in the bare model, whole (FSDP2's DTensors gathered)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = t.detach().clone()
    return out


def _compressor(summary):
    """The ActivationCompressor of a conversion (None if nothing is compressed)."""
    return getattr(summary, "compressor", None)


class _ForwardTensors(torch.overrides.TorchFunctionMode):
    """Weak references to every tensor a torch function returns while active (also inside
    fewbit's CompressionMode, which hands its own calls down to this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                self.refs.append(weakref.ref(t))
        return out

    def alive(self) -> int:
        """Tensors still referenced that hold memory (FSDP2 keeps its unsharded parameter
        objects between steps with their storage freed; those do not count)."""
        n = 0
        for ref in self.refs:
            t = ref()
            if t is not None and not isinstance(t, nn.Parameter) and t.untyped_storage().nbytes() > 0:
                n += 1
        return n


def train(job: Job, rank: int = 0, world: int = 1) -> dict:
    """Run ``job`` on this rank; return ``losses`` (global mean per step), ``params`` (final,
    whole), ``compressed`` (tensors the compressor quantized on this rank), ``live``
    (compressed copies still referenced after the last backward) and ``leaked`` (tensors made
    in the last forward that still hold memory after its backward); both 0 unless
    something leaks."""
    import torch.distributed as dist

    model = build_model(job.model)
    if job.wrap == "ddp_after" and world > 1:
        model = _wrap(model, job, world)
        summary = _convert(model, job)
    else:
        summary = _convert(model, job)
        model = _wrap(model, job, world)
    torch.manual_seed(job.noise_seed + rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR[job.model])
    per_rank = GLOBAL_BATCH // world
    losses = []
    x, y = batch(job.model)
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    x, y = x[part], y[part]
    for step in range(STEPS):
        tracked = _ForwardTensors()
        with tracked:
            loss = loss_of(job.model, model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
        del loss
    gc.collect()
    comp = _compressor(summary)
    return {
        "losses": losses,
        "params": _full_state(model),
        "compressed": comp.stats.compressed if comp is not None else 0,
        "live": len(comp._cache) if comp is not None else 0,
        "leaked": tracked.alive(),
    }


def rank_noise(noise_seeds: tuple[int, int], rank: int, world: int) -> dict:
    """Local gradients (DDP ``no_sync``: not averaged) of the stochastic GPT-2 on the SAME
    input on every rank, after ``fewbit.manual_seed(noise_seeds[rank])``, run twice (the same
    per-rank seed must give the same gradient bit for bit), all-gathered; and ``exact``, the
    gradient of the same model without saved-tensor compression (its expectation)."""
    import fewbit
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = batch("gpt2")
    x, y = x[:2], y[:2]
    exact_model = build_model("gpt2")
    fewbit.convert_(exact_model, fewbit.Config(activation_bits=3))
    loss_of("gpt2", exact_model, x, y).backward()
    exact = torch.cat([p.grad.reshape(-1) for p in exact_model.parameters()])

    model = build_model("gpt2")
    summary = fewbit.convert_(model, fewbit.Config(activation_bits=3, saved_bits=4))
    ddp = DDP(model)
    runs = []
    for _ in range(2):
        fewbit.manual_seed(noise_seeds[rank])  # torch and the compressors' noise stream
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            loss_of("gpt2", ddp, x, y).backward()
        runs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    gathered = [torch.empty_like(runs[0]) for _ in range(world)]
    torch.distributed.all_gather(gathered, runs[0])
    return {"runs": runs, "gathered": gathered, "exact": exact, "compressed": summary.compressor.stats.compressed}


def run_rank(rank: int, world: int, workdir: str, jobs: list, backend: str = "gloo") -> None:
    """Entry point of spawned process ``rank``: join the group through a FileStore in
    ``workdir``, run ``jobs`` (``Job`` or ``("noise", (seed0, seed1))``), write
    ``workdir/rank<rank>.pt``."""
    global PLAN_DIR
    PLAN_DIR = workdir  # the plans the test made before spawning (make_plan)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import faulthandler
    import sys

    # a hang shows every thread's stack on stderr before the parent kills this process
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False, file=sys.stderr)
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    try:
        for job in jobs:
            key = job.name if isinstance(job, Job) else f"noise-{job[1]}"
            try:
                if isinstance(job, Job):
                    results[key] = train(job, rank, world)
                else:
                    results[key] = rank_noise(job[1], rank, world)
            except Exception:  # recorded; the test of that job reports it
                results[key] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def gact_uneven_batches(rank: int, world: int, workdir: str, scenario: str = "uneven") -> None:
    """GACT under DDP where the ranks' re-plans could take different branches; writes, per
    step, the re-plan schedule and the parameters' checksum to ``workdir/gact<rank>.txt``
    (or the traceback). ``scenario``: ``"uneven"``, a batch size per rank (96 and 48 of 64
    features: one rank's hidden tensors under ``min_numel``); ``"masked"``, rank 1's tensors
    all under ``min_numel`` and rank 0's first batch with every label ignored (a zero
    loss); ``"nosync"``, ``adapt`` inside ``ddp.no_sync()`` (its probe backwards not
    all-reduced) with rank 1's first micro-batch overflowing (checksums then differ by
    design: only the schedules are compared); ``"manual"``, no DDP (gradients averaged by
    hand) and rank 0's second batch with every label ignored: its zero sensitivities must
    not become its plan (written: whether every planned sensitivity is positive)."""
    import warnings

    import fewbit
    from fewbit.convert import compressor_of
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=60))
    out = []
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
        min_numel = {"uneven": 4096, "masked": 4000, "nosync": 0, "manual": 0}[scenario]
        fewbit.convert_(model, fewbit.Config(activation_bits=3, saved_bits="auto", average_bits=2,
                                             min_numel=min_numel))
        ddp = model if scenario == "manual" else DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        rows = (96 if rank == 0 else 48) if scenario == "uneven" else (96 if rank == 0 else 16)
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):
            x, y = torch.randn(rows, 32, generator=gen), torch.randint(0, 10, (rows,), generator=gen)
            if (scenario, rank, step) in (("masked", 0, 0), ("manual", 0, 1)):
                y = torch.full_like(y, -100)

            def loss():
                return nn.functional.cross_entropy(ddp(x), y, reduction="sum" if scenario == "masked" else "mean")

            if scenario == "nosync":
                if rank == 1 and step == 0:
                    x[0, 0] = float("inf")  # this rank's first micro-batch overflows
                with ddp.no_sync():
                    compressor_of(model).adapt(ddp, loss, opt)
                    loss().backward()
                x = torch.randn(rows, 32, generator=gen)
                loss().backward()
                for p in model.parameters():
                    p.grad.nan_to_num_(0.0, 0.0, 0.0)
            else:
                compressor_of(model).adapt(ddp, loss, opt)
                loss().backward()
            if scenario == "manual":  # averaged by hand, as without DDP
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            opt.zero_grad()
            total = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum())
            policy = compressor_of(model).policy
            if scenario == "manual":
                out.append(f"{policy.schedule()[:3]} {all(v > 0 for v in policy.sensitivity.values())}")
            else:
                out.append(f"{policy.schedule()[:3]}" + ("" if scenario == "nosync" else f" {total!r}"))
        torch.distributed.barrier()
    except Exception:  # noqa: BLE001 - the test reads it
        out = [traceback.format_exc()]
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(workdir, f"gact{rank}.txt"), "w") as f:
        f.write("\n".join(out))
