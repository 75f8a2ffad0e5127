"""A personalized method from outside edgepfl: the encoder is shared, the classifier stays on the
device, and the local loss is label-smoothed cross-entropy."""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field

from edgepfl.methods import LocalResult, Method, MethodConfig
from edgepfl.methods.training import fit


class SmoothPerConfig(MethodConfig):
    """SmoothPer's one option."""

    smoothing: float = Field(0.1, ge=0.0, lt=1.0, description="label smoothing of the local cross-entropy")


class SmoothPer(Method):
    """FedPer with a label-smoothed local loss: encoder shared, classifier personal, trained jointly."""

    name = "smooth_per"
    summary = "encoder shared, classifier personal; label-smoothed local loss"
    shared_parts = ("encoder",)
    config_class = SmoothPerConfig
    config: SmoothPerConfig

    def local_update(self, model, data, ctx) -> LocalResult:
        def loss_fn(m, x, y):
            return F.cross_entropy(self.logits(m, x), y, label_smoothing=self.config.smoothing)

        loss = fit(model, data, ctx, loss_fn, model.parameters(), ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)
