"""FedRoD [Chen & Chao 2022, as implemented in PFLlib]: generic and personalized heads.

Body ``f`` and generic head ``h_G`` are shared; a personal head ``h_P`` never leaves the
device. Each mini-batch:

1. ``z_G = h_G(f(x))``; balanced-softmax loss ``CE(z_G + log n_c, y)`` with ``n_c`` the
   client's training class counts (an absent class gets ``-inf``, so it has probability
   0 and cannot be pushed down); step ``(f, h_G)``.
2. ``z_P = h_P(stopgrad f(x))``; loss ``CE(stopgrad z_G + z_P, y)``; step ``h_P`` only.

Inference: ``argmax(z_G + z_P)``. The personal head starts as a copy of the generic
head, as in PFLlib (``self.head = copy.deepcopy(self.model.head)``).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from .._torch import F, nn, torch
from ..models import SplitModel, build_encoder, model_as
from . import register
from .base import LocalResult, Method
from .training import fit

if TYPE_CHECKING:  # pragma: no cover
    from ..specs import ModelSpec


class RoDModel(SplitModel):
    """``encoder`` (f), generic ``head`` (h_G, shared) and ``personal_head`` (h_P).

    The generic head keeps the name ``head`` so that FedAvg-style export and
    aggregation code that looks for ``model.head`` finds the shared classifier.
    """

    def __init__(self, encoder: nn.Module, head: nn.Module, personal_head: nn.Module):
        super().__init__(encoder, head)
        self.personal_head = personal_head

    @classmethod
    def build(cls, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> RoDModel:
        encoder = build_encoder(spec, input_shape)
        head = nn.Linear(encoder.out_features, num_classes)
        return cls(encoder, head, copy.deepcopy(head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RoDHead(self.head, self.personal_head)(self.encoder(x))


class RoDHead(nn.Module):
    """Features -> ``h_G(f) + h_P(f)``: FedRoD's inference rule on a frozen encoder.

    Holds the model's own head modules (not copies), so it always reflects the model.
    """

    def __init__(self, head: nn.Module, personal_head: nn.Module):
        super().__init__()
        self.head = head
        self.personal_head = personal_head

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features) + self.personal_head(features)


def log_prior(counts: torch.Tensor) -> torch.Tensor:
    """``log n_c`` as float; classes with no training sample give ``-inf``."""
    return torch.log(counts.to(torch.float32))


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor) -> torch.Tensor:
    """Balanced softmax [Ren et al. 2020]: ``CE(logits + log n_c, y)``.

    Labels must be classes the client has (``n_y > 0``); absent classes enter as
    ``-inf`` logits, whose softmax probability and gradient are exactly zero.
    """
    return F.cross_entropy(logits + log_counts.to(logits.device), y)


def rod_losses(model: RoDModel, x: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor):
    """The two FedRoD losses on one batch: ``(generic, personal)``.

    The personal loss sees the body's features and the generic logits only through
    ``detach``, so its gradient reaches ``personal_head`` alone.
    """
    features = model.encoder(x)
    z_g = model.head(features)
    generic = balanced_softmax_loss(z_g, y, log_counts)
    z_p = model.personal_head(features.detach())
    personal = F.cross_entropy(z_g.detach() + z_p, y)
    return generic, personal


@register
class FedRoD(Method):
    name = "fedrod"
    summary = "shared body + generic head (balanced softmax), personal head on detached features"
    # default shared_parts ("encoder", "head"): body and generic head; personal_head stays

    def build_model(self, spec, input_shape, num_classes) -> RoDModel:
        return RoDModel.build(spec, input_shape, num_classes)

    def local_update(self, model: nn.Module, data, ctx) -> LocalResult:
        rod = model_as(model, RoDModel)
        log_counts = log_prior(data.class_counts())

        # One backward of the sum is the same as PFLlib's two steps per batch: the
        # personal loss reaches only personal_head (detached inputs), the generic loss
        # never reaches personal_head, and SGD/Adam state is per parameter — so the
        # (f, h_G) step and the h_P step see exactly the gradients they would alone.
        def loss_fn(m: RoDModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            generic, personal = rod_losses(m, x, y, log_counts)
            return generic + personal

        loss = fit(rod, data, ctx, loss_fn, rod.parameters(), ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def device_head(self, model: nn.Module) -> nn.Module:
        rod = model_as(model, RoDModel)
        return RoDHead(rod.head, rod.personal_head)
