"""FedProx [Li et al. 2020]: FedAvg with a proximal term in the local objective.

Local loss: ``CE + (mu / 2) * ||w - w_global||^2`` over every trainable parameter,
where ``w_global`` is the model as received this round (snapshot at the start of
:meth:`FedProx.local_update`). Server: FedAvg's sample-weighted mean.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field

from .._torch import F, torch
from . import register
from .base import LocalResult, Method, MethodConfig
from .training import fit


class FedProxConfig(MethodConfig):
    mu: float = Field(0.01, ge=0, description="weight of the proximal term (mu/2)||w - w_global||^2")


def proximal_term(params: Iterable[torch.Tensor], anchors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum ||p - a||^2`` over aligned parameter / anchor tensors (anchors carry no gradient)."""
    terms = [(p - a).pow(2).sum() for p, a in zip(params, anchors, strict=True)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


@register
class FedProx(Method):
    name = "fedprox"
    summary = "FedAvg + proximal term (mu/2)||w - w_global||^2 in the local loss"
    config_class = FedProxConfig
    config: FedProxConfig

    def local_update(self, model, data, ctx) -> LocalResult:
        # The anchor is local to this call: the method instance is shared by every
        # agent of an in-process simulation, so nothing per-client may live on self.
        params = [p for p in model.parameters() if p.requires_grad]
        anchors = [p.detach().clone() for p in params]
        mu = self.config.mu

        def loss_fn(m, x, y):
            loss = F.cross_entropy(self.logits(m, x), y)
            if mu > 0:
                loss = loss + 0.5 * mu * proximal_term(params, anchors)
            return loss

        loss = fit(model, data, ctx, loss_fn, params, ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)
