"""The repeated blocks of a model (a transformer's layers, a ResNet's stages): the planner's
unit (:func:`fewbit.planner.plan`) and a layer kind of :func:`fewbit.convert_` (``"block"``)."""

from __future__ import annotations

from torch import nn

__all__ = ["find_blocks"]


def _signature(m: nn.Module) -> tuple:
    return (type(m).__qualname__,) + tuple(
        (n, type(s).__qualname__, tuple(tuple(p.shape) for p in s.parameters(recurse=False)))
        for n, s in m.named_modules())


def find_blocks(model: nn.Module) -> list[tuple[str, list[str]]]:
    """The repeated blocks of ``model``: ``[(block type, [fqn, ...]), ...]``.

    Blocks are the children that have submodules of an ``nn.ModuleList`` (GPT-2's
    ``transformer.h``) or of an ``nn.Sequential`` with at least two such children (a ResNet
    stage, ViT's ``encoder.layers``), not nested in another block; the outermost container
    wins. Blocks of one class and one structure (names, classes, parameter shapes) form a block
    type, which gets one policy. Everything else runs as it is and counts as saved outside
    the blocks.

    Raises:
        ValueError: if the model has no such blocks.
    """
    types: dict[tuple, list[str]] = {}
    names: dict[tuple, str] = {}
    taken: list[str] = []
    for fqn, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or any((fqn + ".").startswith(p) for p in taken):
            continue
        children = [(n, c) for n, c in m.named_children() if any(True for _ in c.children())]
        if isinstance(m, nn.Sequential) and len(children) < 2:
            continue
        for name, child in children:
            cfqn = f"{fqn}.{name}" if fqn else name
            sig = _signature(child)
            types.setdefault(sig, []).append(cfqn)
            names.setdefault(sig, type(child).__name__)
            taken.append(cfqn + ".")
    if not types:
        raise ValueError(f"model ({type(model).__name__}) has no repeated blocks (children with submodules of an "
                         "nn.ModuleList, or at least two of an nn.Sequential) to plan for")
    out = []
    seen: dict[str, int] = {}
    for sig, fqns in types.items():
        base = names[sig]
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append((base if k == 0 else f"{base}#{k}", fqns))
    return out
