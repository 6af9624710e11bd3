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

    Blocks are the children that have submodules and a forward of their own, of an
    ``nn.ModuleList`` (GPT-2's ``transformer.h``) or a plain ``nn.ModuleDict`` (torchtitan's
    ``layers``; one with a forward of its own runs its entries as a model does), or of an
    ``nn.Sequential`` with at least two such children (a ResNet
    stage, ViT's ``encoder.layers``), not nested in another block; the outermost container
    wins. A child without a forward of its own (an ``nn.ModuleList`` of a layer's parts:
    ``ModuleList([ModuleList([norm, ff]), ...])``) is never called, so it is not a block:
    the search goes on inside it (``ff`` is). Blocks of one class and one structure (names,
    classes, parameter shapes) form a block type, which gets one policy. Everything else
    runs as it is and counts as saved outside the blocks.

    Raises:
        ValueError: if the model has no such blocks.
    """
    types: dict[tuple, list[str]] = {}
    names: dict[tuple, str] = {}
    taken: list[str] = []
    for fqn, m in model.named_modules():
        # a ModuleDict with a forward of its own runs its entries as a model's body does
        # (torchvision's IntermediateLayerGetter: stem, then stages): not a container of
        # blocks; the stages' blocks are (h73)
        plain_dict = isinstance(m, nn.ModuleDict) and type(m).forward is nn.Module.forward
        if not (isinstance(m, (nn.ModuleList, nn.Sequential)) or plain_dict) or any(
                (fqn + ".").startswith(p) for p in taken):
            continue
        # a child that is never called (no forward: a ModuleList of a layer's parts) had
        # been taken as a block: the block kind's hooks on it never ran, and the planner's
        # post-hook met a block no pre-hook had entered (KeyError, h72)
        children = [(n, c) for n, c in m.named_children()
                    if any(True for _ in c.children()) and type(c).forward is not nn.Module.forward]
        if isinstance(m, nn.Sequential) and len(children) < 2:
            continue
        for name, child in children:
            cfqn = f"{fqn}.{name}" if fqn else name
            sig = _signature(child)
            types.setdefault(sig, []).append(cfqn)
            names.setdefault(sig, type(child).__name__)
            taken.append(cfqn + ".")
    if not types:
        raise ValueError(f"model ({type(model).__name__}) has no repeated blocks (children with submodules and a "
                         "forward of an nn.ModuleList or nn.ModuleDict, or at least two of an nn.Sequential) to "
                         "plan for")
    out = []
    seen: dict[str, int] = {}
    for sig, fqns in types.items():
        base = names[sig]
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append((base if k == 0 else f"{base}#{k}", fqns))
    return out
