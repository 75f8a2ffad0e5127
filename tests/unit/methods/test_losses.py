"""The supervised contrastive loss against a direct, loop-based evaluation of its formula."""

from __future__ import annotations

import math

import pytest
import torch

from edgepfl.methods.losses import supcon_loss
from edgepfl.testing.method_kit import generator


def reference_supcon(features: torch.Tensor, labels: list[int], tau: float, form: str) -> float:
    """The formula of METHODS.md / RepPer eq. 5, anchor by anchor, in plain Python floats."""
    z = [[float(v) for v in row / row.norm()] for row in features.double()]
    n = len(z)

    def dot(a, b):
        return sum(p * q for p, q in zip(z[a], z[b]))

    total = 0.0
    for a in range(n):
        others = [b for b in range(n) if b != a]
        positives = [p for p in others if labels[p] == labels[a]]
        if not positives:
            continue  # an anchor without positives adds 0
        denom = sum(math.exp(dot(a, b) / tau) for b in others)
        ratios = [math.exp(dot(a, p) / tau) / denom for p in positives]
        if form == "out":
            total += -sum(math.log(r) for r in ratios) / len(positives)
        else:
            total += -math.log(sum(ratios) / len(positives))
    return total / n


@pytest.mark.parametrize("form", ["out", "in"])
def test_two_view_form_matches_formula(form):
    # RepPer: 2B views, the labels repeated; every anchor has its other view as a positive
    g = generator(0)
    y = [0, 1, 0, 2]
    views = torch.randn(8, 5, generator=g)
    labels = torch.tensor(y + y)
    got = supcon_loss(views, labels, tau=0.1, form=form)
    assert got.item() == pytest.approx(reference_supcon(views, y + y, 0.1, form), rel=1e-5)


@pytest.mark.parametrize("form", ["out", "in"])
def test_single_view_form_matches_formula_with_lonely_anchors(form):
    # DualFed: one view; labels 1 and 3 occur once, so those anchors have no positive
    g = generator(1)
    y = [0, 0, 1, 2, 2, 3, 2]
    feats = torch.randn(len(y), 6, generator=g)
    got = supcon_loss(feats, torch.tensor(y), tau=0.2, form=form)
    assert got.item() == pytest.approx(reference_supcon(feats, y, 0.2, form), rel=1e-5)


def test_forms_differ_when_anchors_have_several_positives():
    # guards against "in" silently computing "out": Jensen makes in <= out, equal only
    # with one positive per anchor
    g = generator(2)
    feats = torch.randn(6, 4, generator=g)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    assert supcon_loss(feats, y, 0.5, form="in") < supcon_loss(feats, y, 0.5, form="out") - 1e-4


def test_anchors_without_positives_add_zero_and_count_in_the_mean():
    g = generator(3)
    feats = torch.randn(5, 3, generator=g, requires_grad=True)
    all_distinct = supcon_loss(feats, torch.arange(5), tau=0.1)
    assert all_distinct.item() == 0.0
    all_distinct.backward()
    assert torch.isfinite(feats.grad).all()

    # per-anchor contributions: only anchors 0 and 1 (the pair) add; the mean is over 5
    y = torch.tensor([7, 7, 1, 2, 3])
    pair_only = supcon_loss(feats.detach(), y, tau=0.1)
    z = torch.nn.functional.normalize(feats.detach(), dim=1)
    s = z @ z.T / 0.1
    l0 = -(s[0, 1] - torch.logsumexp(s[0, 1:], 0))
    l1 = -(s[1, 0] - torch.logsumexp(torch.cat([s[1, :1], s[1, 2:]]), 0))
    assert pair_only.item() == pytest.approx(((l0 + l1) / 5).item(), rel=1e-5)


@pytest.mark.parametrize("form", ["out", "in"])
def test_gradients_are_finite_with_mixed_anchors(form):
    feats = torch.randn(6, 4, generator=generator(4), requires_grad=True)
    supcon_loss(feats, torch.tensor([0, 0, 1, 2, 3, 3]), 0.1, form=form).backward()
    assert torch.isfinite(feats.grad).all() and feats.grad.abs().sum() > 0


def test_scale_invariant_because_features_are_normalized():
    feats = torch.randn(6, 4, generator=generator(5))
    y = torch.tensor([0, 1, 0, 1, 2, 2])
    assert supcon_loss(3.7 * feats, y, 0.1).item() == pytest.approx(supcon_loss(feats, y, 0.1).item(), rel=1e-5)


def test_rejects_misaligned_inputs():
    with pytest.raises(ValueError):
        supcon_loss(torch.randn(4, 3), torch.tensor([0, 1, 2]), 0.1)
    with pytest.raises(ValueError):
        supcon_loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]), 0.0)
