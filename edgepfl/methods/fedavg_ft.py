"""FedAvg-FT: FedAvg, then each client fine-tunes the classifier locally before evaluating.

The fine-tuned classifier is used for evaluation only; training continues from the
global model each round, as in the papers' baseline.
"""

from __future__ import annotations

import copy

from pydantic import Field

from .._torch import F
from . import register
from .base import EvalResult, LocalContext, Method, MethodConfig
from .training import fit


class FedAvgFTConfig(MethodConfig):
    ft_epochs: int = Field(1, ge=1, description="classifier fine-tuning epochs before evaluation")


@register
class FedAvgFT(Method):
    name = "fedavg_ft"
    summary = "FedAvg + local fine-tuning of the classifier before evaluation"
    config_class = FedAvgFTConfig
    config: FedAvgFTConfig

    def evaluate(self, model, data, ctx: LocalContext) -> EvalResult:
        tuned = copy.deepcopy(model)
        fit(
            tuned,
            data,
            ctx,
            lambda m, x, y: F.cross_entropy(m.head(m.encoder(x).detach()), y),
            tuned.head.parameters(),
            self.config.ft_epochs,
        )
        return super().evaluate(tuned, data, ctx)
