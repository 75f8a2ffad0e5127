"""A third party's method, as its own package writes it: a module outside edgepfl, found through an
``edgepfl.methods`` entry point (``toy_avg = toy_method:ToyAvg``), never decorated by edgepfl's registry.

:class:`ToyAvg` is FedAvg with label smoothing in the local loss; :class:`BrokenShapes` is the
mistake the public check must name (its server returns a weight flattened). :class:`Misnamed`
is registered under an entry point that is not its name.
tests/unit/methods/test_plugin_methods.py registers and checks them.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F
from pydantic import Field

from edgepfl.methods import ClientUpdate, LocalResult, Method, MethodConfig, ServerState, TensorDict
from edgepfl.methods.training import fit


class ToyAvgConfig(MethodConfig):
    """ToyAvg's one option."""

    smoothing: float = Field(0.1, ge=0.0, lt=1.0, description="label smoothing of the local cross-entropy")


class ToyAvg(Method):
    """FedAvg (everything shared, the server's sample-weighted mean) with label smoothing on the device."""

    name = "toy_avg"
    summary = "everything shared; label-smoothed local loss, sample-weighted mean"
    config_class = ToyAvgConfig
    config: ToyAvgConfig

    def local_update(self, model, data, ctx) -> LocalResult:
        params = [p for p in model.parameters() if p.requires_grad]

        def loss_fn(m, x, y):
            return F.cross_entropy(self.logits(m, x), y, label_smoothing=self.config.smoothing)

        loss = fit(model, data, ctx, loss_fn, params, ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)


class BrokenShapes(ToyAvg):
    """A server that returns its largest weight flattened: the public check must say so."""

    name = "toy_broken"
    summary = "a broken server step"

    def finish_round(self, state: ServerState, shared: TensorDict, updates: list[ClientUpdate],
                     round: int) -> ServerState:
        new = super().finish_round(state, shared, updates, round)
        key = max(new.global_tensors, key=lambda k: new.global_tensors[k].size)
        new.global_tensors[key] = np.ascontiguousarray(new.global_tensors[key]).reshape(-1)
        return new


class Misnamed(ToyAvg):
    """A class whose name is not its entry point's."""

    name = "toy_other"
