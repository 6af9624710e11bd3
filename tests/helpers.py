"""Helpers shared by test modules (import them with ``from helpers import ...``; pytest puts
``tests/`` on ``sys.path`` because ``tests/conftest.py`` lives there).

- :func:`reference_codes`, :func:`reference_grad`: the pure-torch few-bit backward,
  ``grad * values[Table.code(x)]`` (docs/method.md §1), computed on the CPU with float64
  lookups, independent of fewbit's kernels;
- :func:`toy_table`: a small valid :class:`fewbit.table.Table` without the solver;
- :class:`PyRMSNorm`: a transformers-style RMSNorm written in Python;
- :func:`replicate_on_cpu`, :func:`run_in_threads`: ``nn.DataParallel``'s replicas and
  threads on the CPU.

Fixtures shared by several modules live in ``tests/conftest.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from fewbit.activations import canonical_params, get_activation
from fewbit.table import Table
from fewbit.resolve import CACHE_REVISION

__all__ = ["reference_codes", "reference_grad", "replicate_on_cpu", "run_in_threads", "toy_table"]


def reference_codes(x: torch.Tensor, table: Table) -> torch.Tensor:
    """The table's code of every element of ``x`` (int64, shape of ``x``, on the CPU): the
    float64 definition of docs/method.md §2, :meth:`fewbit.table.Table.code`."""
    return torch.from_numpy(table.code(x.detach().double().cpu()))


def reference_grad(grad: torch.Tensor, x: torch.Tensor, table: Table) -> torch.Tensor:
    """``grad * values[code(x)]`` in float32 (float64 for float64 ``grad``), cast to ``grad``'s dtype."""
    cdt = torch.float64 if grad.dtype == torch.float64 else torch.float32
    values = torch.tensor(table.values, dtype=torch.float64).to(cdt)
    code = reference_codes(x, table).to(grad.device)
    return (grad.to(cdt) * values.to(grad.device)[code]).to(grad.dtype)


def toy_table(name: str, bits: int, params=None, lo: float = -6.0, hi: float = 6.0) -> Table:
    """Equal-width intervals on [lo, hi]; each level is the mean of torch's derivative."""
    act = get_activation(name)
    full = canonical_params(act, params)
    m = 1 << bits
    borders = torch.linspace(lo, hi, m + 1, dtype=torch.float64)[1:-1]
    edges = [-10.0, *borders.tolist(), 10.0]
    values = []
    for a, b in zip(edges[:-1], edges[1:]):
        t = torch.linspace(a, b, 257, dtype=torch.float64, requires_grad=True)
        act.torch_fn(t, **full).sum().backward()
        values.append(float(t.grad.mean()))
    nd = {k: v for k, v in full.items() if v != act.defaults[k]}
    return Table(name=act.name, bits=bits, borders=borders.tolist(), codes=list(range(m)),
                 values=values, params=nd, weight="uniform", provenance={"test": "toy", "cache_revision": CACHE_REVISION})


class PyRMSNorm(nn.Module):
    """A transformers-style RMSNorm: a Python forward (``pow``, ``mean``, ``rsqrt``), a class
    name ending in RMSNorm (so ``fewbit.convert_`` treats it as a norm layer)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def replicate_on_cpu(model: nn.Module, shifts: tuple[float, ...], monkeypatch) -> list[nn.Module]:
    """``nn.DataParallel``'s own ``replicate`` on the CPU: its broadcast of the weights to
    devices replaced by differentiable copies, replica ``j``'s parameters shifted by
    ``shifts[j]`` so that each replica has weights of its own (as on its own GPU)."""
    import importlib

    rep = importlib.import_module("torch.nn.parallel.replicate")  # the module (the package names the function)

    def broadcast(tensors, devices, detach=False):
        return [[(t.detach() if detach else t) + (s if isinstance(t, nn.Parameter) else 0) for t in tensors]
                for s in shifts]

    monkeypatch.setattr(rep, "_broadcast_coalesced_reshape", broadcast)
    return rep.replicate(model, list(range(len(shifts))))


def run_in_threads(modules: list[nn.Module], kwargs: list[dict]) -> list:
    """``modules[j](**kwargs[j])`` each in a thread of its own, as ``nn.DataParallel``'s
    ``parallel_apply`` runs its replicas; their outputs, or the first error raised here."""
    import threading

    outputs, errors = [None] * len(modules), []

    def run(j):
        try:
            outputs[j] = modules[j](**kwargs[j])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outputs
