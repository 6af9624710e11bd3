"""A saved tensor changed in place after the forward: torch's error, never a wrong gradient.

torch refuses backward when a tensor saved for it was changed in place, but skips that check
for tensors saved under saved-tensor hooks; every fewbit hook that keeps a tensor as it is
restores it (fewbit._saved). A compressed copy holds the values of the forward that ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fewbit
from fewbit.memory import SavedTensorRecorder
from fewbit.quant import compress_activations
from fewbit.quant.compressors import Keep

INPLACE = "modified by an inplace operation"


def _mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def _forward_then_step(model: nn.Module, x: torch.Tensor, ctx=None) -> torch.Tensor:
    """The classic bug: the weights are updated in place between forward and backward."""
    if ctx is None:
        loss = model(x).sum()
    else:
        with ctx:
            loss = model(x).sum()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an optimizer.step() before backward
        model[2].weight.add_(1.0)
    return loss


def _converted(config):
    def make():
        m = _mlp()
        fewbit.convert_(m, config)
        return m, None
    return make


CASES = {
    "vanilla": lambda: (_mlp(), None),
    "convert_saved_bits": _converted(fewbit.Config(saved_bits=2)),
    "convert_saved_bits_linear": _converted(fewbit.Config(saved_bits=2, layers=("linear",))),
    "compress_activations_keep": lambda: (_mlp(), compress_activations(compressor=Keep())),
    "compress_activations": lambda: (_mlp(), compress_activations(bits=2)),
    "recorder": lambda: (_mlp(), SavedTensorRecorder()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_kept_tensor_changed_in_place_raises_as_torch_does(case):
    """Parameters are saved as they are (never compressed): a change between forward and
    backward is torch's error with every fewbit hook, as without (before: fewbit's hooks
    returned the changed weight and backward used it silently)."""
    model, ctx = CASES[case]()
    loss = _forward_then_step(model, torch.randn(16, 32), ctx)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_small_kept_input_changed_in_place_raises():
    """A tensor below ``min_numel`` is kept as it is: changing it in place is torch's error."""
    model = _mlp(8)
    fewbit.convert_(model, fewbit.Config(saved_bits=2))
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    loss = model(h).sum()
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_compressed_tensor_changed_in_place_gives_the_gradient_of_the_forward_that_ran():
    """A compressed copy holds the values saved: the same gradients, to the bit, whether the
    input is changed in place after the forward or not (same seed, same noise)."""
    grads = []
    for change in (False, True):
        model = _mlp(256)
        fewbit.convert_(model, fewbit.Config(saved_bits=2))
        fewbit.manual_seed(1)  # torch and the compressors' noise stream
        h = torch.randn(64, 256, requires_grad=True) * 1.0  # an activation (inputs are kept)
        loss = model(h).sum()
        if change:
            with torch.no_grad():
                h.mul_(2.0)
        loss.backward()
        grads.append(model[0].weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_kept_tensors_unchanged_give_vanillas_gradients():
    """The check changes nothing else: with the keep compressor every gradient is torch's."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    x = torch.randn(16, 32)
    ref(x).sum().backward()
    with compress_activations(compressor=Keep()):
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
