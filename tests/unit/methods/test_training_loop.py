"""The local training loop every method's phases run (:func:`edgepfl.methods.training.fit`):
``train.max_grad_norm`` bounds each step of the parameters a phase trains, and leaves
training as it was when unset."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgepfl.data import ClientTensors
from edgepfl.methods.training import fit
from edgepfl.testing.method_kit import MethodKit

KIT = MethodKit()


def scaled_problem() -> tuple[nn.Module, ClientTensors]:
    """A linear classifier whose inputs are so large that its first gradient's norm is near a hundred."""
    torch.manual_seed(0)
    x = 100.0 * torch.randn(16, 5)
    y = torch.arange(16) % 3
    model = nn.Sequential(nn.Linear(5, 3))
    return model, ClientTensors(x_train=x, y_train=y, x_test=x, y_test=y, num_classes=3)


def one_step(max_grad_norm: float | None) -> tuple[float, float]:
    """(the step's parameter change norm, the gradient norm before any clip) of one
    plain-SGD step on the whole batch."""
    model, data = scaled_problem()
    before = copy.deepcopy(model)
    ctx = KIT.ctx(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=16, max_grad_norm=max_grad_norm)
    probe = copy.deepcopy(model)
    nn.functional.cross_entropy(probe(data.x_train), data.y_train).backward()
    grad_norm = float(torch.sqrt(sum((p.grad**2).sum() for p in probe.parameters())))
    fit(model, data, ctx, lambda m, x, y: nn.functional.cross_entropy(m(x), y), model.parameters(), 1)
    change = float(torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(model.parameters(), before.parameters()))))
    return change, grad_norm


def test_a_step_moves_the_phases_parameters_at_most_lr_times_max_grad_norm():
    change, grad_norm = one_step(max_grad_norm=2.0)
    assert grad_norm > 50  # the problem is one the clip acts on
    assert change == pytest.approx(0.1 * 2.0, rel=1e-4)


def test_without_max_grad_norm_a_step_is_plain_sgd():
    change, grad_norm = one_step(max_grad_norm=None)
    assert change == pytest.approx(0.1 * grad_norm, rel=1e-4)


def test_the_clip_reaches_only_the_parameters_the_phase_trains():
    """A phase that trains the last layer alone: its step is clipped, the first layer stays put
    (its gradient was computed and neither counted in the norm nor stepped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    data = scaled_problem()[1]
    first, last = copy.deepcopy(model[0]), copy.deepcopy(model[1])
    ctx = KIT.ctx(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=16, max_grad_norm=0.5)
    fit(model, data, ctx, lambda m, x, y: nn.functional.cross_entropy(m(x), y), model[1].parameters(), 1)
    assert all(torch.equal(p, q) for p, q in zip(model[0].parameters(), first.parameters()))
    moved = float(torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(model[1].parameters(), last.parameters()))))
    assert moved == pytest.approx(0.1 * 0.5, rel=1e-4)
