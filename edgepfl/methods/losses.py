"""Losses shared by methods: the supervised contrastive loss (RepPer, DualFed).

One function serves both forms the founding papers use:

* **two views** (RepPer): the batch of ``B`` images is augmented twice, the ``2B``
  feature vectors are stacked and the labels repeated (``torch.cat([y, y])``);
* **one view** (DualFed): the batch itself, ``B`` vectors with their labels.

For anchor ``a`` among the ``N`` vectors, with ``z = f / ||f||``,
``A(a)`` = every vector but ``a`` and ``P(a)`` = those of ``A(a)`` with ``a``'s label:

``out`` form (Khosla et al. 2020 eq. 2, METHODS.md for RepPer and DualFed, the DualFed
code)::

    l_a = -(1/|P(a)|) * sum_{p in P(a)} log( exp(z_a.z_p/tau) / sum_{b in A(a)} exp(z_a.z_b/tau) )

``in`` form (RepPer paper eq. 5 as printed, log outside the positive mean)::

    l_a = -log( (1/|P(a)|) * sum_{p in P(a)} exp(z_a.z_p/tau) / sum_{b in A(a)} exp(z_a.z_b/tau) )

The loss is the mean of ``l_a`` over all ``N`` anchors; an anchor without positives
contributes 0 and still counts in the mean (as the DualFed code does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch

SupConForm = Literal["out", "in"]


def supcon_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    tau: float,
    *,
    form: SupConForm = "out",
    normalize: bool = True,
) -> torch.Tensor:
    """Supervised contrastive loss of ``features`` (N, d) with integer ``labels`` (N,).

    ``normalize`` L2-normalizes the rows first (both papers do); pass ``False`` only
    for features that are already unit vectors. ``form`` picks where the log sits
    (see the module docstring). Returns a scalar; 0 when no anchor has a positive.
    """
    import torch
    import torch.nn.functional as F

    if features.ndim != 2 or labels.ndim != 1 or features.shape[0] != labels.shape[0]:
        raise ValueError(f"features (N, d) and labels (N,) expected, got {tuple(features.shape)}, {tuple(labels.shape)}")
    if tau <= 0:
        raise ValueError(f"temperature must be positive, got {tau}")
    n = features.shape[0]
    if n < 2:
        # no pair at all; keep the graph so callers can still backward()
        return features.sum() * 0.0
    z = F.normalize(features, dim=1) if normalize else features
    sim = z @ z.T / tau
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    # the anchor is excluded from its own denominator: -inf before the log-sum-exp
    sim = sim.masked_fill(self_mask, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    positive = (labels[:, None] == labels[None, :]) & ~self_mask
    num_pos = positive.sum(dim=1)
    has_pos = num_pos > 0
    if form == "out":
        # where() rather than multiplication: the diagonal holds -inf and 0 * -inf is nan
        pos_sum = torch.where(positive, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
        per_anchor = -pos_sum / num_pos.clamp(min=1)
    elif form == "in":
        masked = log_prob.masked_fill(~positive, float("-inf"))
        # a row of only -inf would give nan gradients through where(); fill it with 0
        masked = torch.where(has_pos[:, None], masked, torch.zeros_like(masked))
        pos_lse = torch.logsumexp(masked, dim=1)
        per_anchor = -(pos_lse - torch.log(num_pos.clamp(min=1).to(log_prob.dtype)))
    else:
        raise ValueError(f"unknown SupCon form {form!r}")
    per_anchor = torch.where(has_pos, per_anchor, torch.zeros_like(per_anchor))
    return per_anchor.mean()


__all__ = ["SupConForm", "supcon_loss"]
