"""FedRep [Collins et al. 2021]: shared encoder, personal classifier.

Each round trains the classifier alone first (``head_epochs``, features detached),
then the encoder alone with the classifier fixed (``body_epochs``).
"""

from __future__ import annotations

from pydantic import Field

from .._torch import F
from . import register
from .base import LocalResult, Method, MethodConfig
from .training import fit


class FedRepConfig(MethodConfig):
    head_epochs: int = Field(4, ge=1, description="classifier-only epochs per round (papers: 4 of 5)")
    body_epochs: int | None = Field(None, ge=1, description="encoder-only epochs; default train.epochs")


@register
class FedRep(Method):
    name = "fedrep"
    summary = "encoder shared, classifier personal; head epochs then body epochs"
    shared_parts = ("encoder",)
    config_class = FedRepConfig
    config: FedRepConfig

    def local_update(self, model, data, ctx) -> LocalResult:
        fit(model, data, ctx, lambda m, x, y: F.cross_entropy(m.head(m.encoder(x).detach()), y),
            model.head.parameters(), self.config.head_epochs)
        loss = fit(model, data, ctx, lambda m, x, y: F.cross_entropy(m(x), y),
                   model.encoder.parameters(), self.config.body_epochs or ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)
