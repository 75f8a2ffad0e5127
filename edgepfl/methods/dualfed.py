"""DualFed [paper 000; code GuogangZhu/DualFed]: dual representations around a personal projector.

Parts: encoder ``f`` (x -> z, pre-projection, shared); in ``model.head``
(:class:`DualFedHead`) the personal projector ``g``:
Linear(k,256)-ReLU-BN(256)-Linear(256,k)-BN(k) (z -> u, post-projection), the personal
classifier ``h_p`` on u and the global classifier ``h_s`` on z (shared).

Shared: encoder weights including BatchNorm affine parameters, and ``h_s``. Personal:
``g``, ``h_p`` and the running mean / var of every BatchNorm layer
(``bn_policy = "local_stats"``). The server takes the plain, unweighted mean over the
round's participants [code] (every update has weight 1 in the run's aggregation rule).

Local training, ``schedule = "stagewise"`` (default) [paper 4.2, code], each round:

* stage A, E epochs: ``h_s`` frozen; ``f, g, h_p`` minimise
  ``CE(h_p(u), y) + lambda * SupCon(u, y; tau)`` (single view: the batch itself);
* stage B, E epochs, fresh optimizer: only ``h_s``, on ``CE(h_s(z), y)`` with ``z``
  computed without gradient. As in the authors' code the model stays in training
  mode, so BatchNorm normalizes with batch statistics and keeps updating its running
  statistics during stage B (the projector's too: the code runs the full forward).

``schedule = "simultaneous"`` (paper Table 4) trains every part for E epochs on the
sum ``CE(h_p(u), y) + lambda * SupCon(u, y) + CE(h_s(z), y)``, gradients reaching the
encoder from both classifiers.

Personal BatchNorm statistics at evaluation, ``bn_recalibrate = True`` (default,
measured; docs/METHODS.md "DualFed"): the agent evaluates right after loading a new
global encoder, and the stored running statistics were estimated under the client's
own previous encoder — an EMA over its last local training — so they do not describe
the received encoder's features. Before evaluating, every personal BatchNorm layer
(encoder and projector) is re-estimated on the client's training images: no gradient,
train-mode forward passes, cumulative average (momentum None). Training normalizes with
batch statistics and never reads the running ones, so the option changes what is
evaluated (and stored), not what is trained. ``False`` evaluates the stored statistics,
as the authors' code does.

Inference: ``argmax(h_p(u) + h_s(z))`` on raw logits [code]; ``ensemble = "softmax"``
sums the probabilities instead and returns ``log((p_p + p_s) / 2)`` so that the
evaluation loss stays a proper negative log-likelihood (:mod:`.ensemble`, shared with FedPick).

Defaults: SGD lr 0.01 momentum 0.5 (the run's ``train`` section, whose defaults are
these), no weight decay [code], batch 256 and E = 1 in the paper (``train``),
lambda 40, tau 0.2 (PACS, from the code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from .._torch import F, nn, torch
from ..heads import GENERIC_HEAD_KINDS
from ..models import SplitModel, build_encoder, model_as
from . import register
from .base import (
    ClientUpdate,
    LocalContext,
    LocalResult,
    Method,
    PersonalBatchNormConfig,
    method_optimizer,
    train_override,
)
from .ensemble import ensemble_logits
from .losses import SupConForm, supcon_loss
from .training import fit, recalibrate_batchnorm

if TYPE_CHECKING:  # pragma: no cover
    from ..data.client import ClientTensors
    from ..heads import HeadRelease
    from ..heads.estimators import HeadEstimator
    from ..specs import ModelSpec


class DualFedConfig(PersonalBatchNormConfig):
    """DualFed options; the optimizer options follow :func:`~edgepfl.methods.base.train_override`'s rule."""

    con_lambda: float = Field(40.0, ge=0, description="weight of the SupCon term (code, PACS)")
    tau: float = Field(0.2, gt=0, description="SupCon temperature (code, PACS)")
    supcon_form: Literal["out", "in"] = "out"
    schedule: Literal["stagewise", "simultaneous"] = "stagewise"
    ensemble: Literal["logits", "softmax"] = Field("logits", description="sum raw logits [code] or probabilities")
    proj_hidden: int = Field(256, ge=1, description="projector hidden width")
    optimizer: Literal["sgd", "adam"] | None = train_override("optimizer")
    lr: float | None = train_override("lr")
    momentum: float | None = train_override("momentum")
    weight_decay: float | None = train_override("weight_decay", 0.0, "the authors' SGD has none")
    batch_size: int | None = train_override("batch_size", None, "paper: 256", ge=2)
    bn_recalibrate: bool = Field(
        True, description="re-estimate the personal BatchNorm statistics on the client's training images with "
                          "each received encoder, before evaluating (False: the stored ones, as the authors' code)"
    )


class DualFedHead(nn.Module):
    """Everything after the encoder: projector ``g``, personal ``h_p`` on u, global ``h_s`` on z.

    ``forward(z)`` is DualFed's inference rule, so this module is the device head:
    frozen pre-projection features in, ensemble logits out.
    """

    def __init__(self, in_features: int, num_classes: int, hidden: int = 256, ensemble: str = "logits"):
        super().__init__()
        k = in_features
        self.projector = nn.Sequential(
            nn.Linear(k, hidden), nn.ReLU(), nn.BatchNorm1d(hidden), nn.Linear(hidden, k), nn.BatchNorm1d(k)
        )
        self.personal_classifier = nn.Linear(k, num_classes)
        self.global_classifier = nn.Linear(k, num_classes)
        self.ensemble = ensemble

    def parts(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, personal logits h_p(u), global logits h_s(z))."""
        u = self.projector(z)
        return u, self.personal_classifier(u), self.global_classifier(z)

    def combine(self, personal: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
        return ensemble_logits(global_, personal, self.ensemble)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        _, personal, global_ = self.parts(z)
        return self.combine(personal, global_)


class DualFedModel(SplitModel):
    """``encoder`` (x -> z) + :class:`DualFedHead` as the ``head``."""

    head: DualFedHead

    def __init__(self, encoder: nn.Module, head: DualFedHead):
        super().__init__(encoder, head)

    @classmethod
    def build(cls, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 256,
              ensemble: str = "logits") -> DualFedModel:
        encoder = build_encoder(spec, input_shape)
        return cls(encoder, DualFedHead(encoder.out_features, num_classes, hidden, ensemble))

    def parts_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder and projector only: every BatchNorm layer, no classifier."""
        return self.head.projector(self.encoder(x))


def stage_a_loss(head: DualFedHead, z: torch.Tensor, y: torch.Tensor, *, con_lambda: float, tau: float,
                 form: SupConForm = "out") -> torch.Tensor:
    """``CE(h_p(g(z)), y) + lambda * SupCon(g(z), y; tau)`` — stage A from given features.

    Also the loss a new client uses offline to fit ``g`` and ``h_p`` on frozen z.
    """
    u = head.projector(z)
    return F.cross_entropy(head.personal_classifier(u), y) + con_lambda * supcon_loss(u, y, tau, form=form)


@register
class DualFed(Method):
    name = "dualfed"
    summary = "shared encoder + global classifier on z; personal projector + classifier on u; SupCon; logit-sum"
    config_class = DualFedConfig
    shared_parts = ("encoder", "head.global_classifier")
    bn_policy = "local_stats"
    # "dualfed": this method's own head (projector + h_p + the federation's h_s) fitted on a device
    head_kinds = (name, *GENERIC_HEAD_KINDS)

    config: DualFedConfig

    def build_model(self, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return DualFedModel.build(spec, input_shape, num_classes, hidden=self.config.proj_hidden,
                                  ensemble=self.config.ensemble)

    # ------------------------------------------------------------------ agent side
    def _stage_a(self, m: DualFedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return stage_a_loss(m.head, m.encoder(x), y, con_lambda=cfg.con_lambda, tau=cfg.tau, form=cfg.supcon_form)

    def train_stage_a(self, model: DualFedModel, data: ClientTensors, ctx: LocalContext) -> float:
        """Stage A: encoder, projector and personal classifier; ``h_s`` frozen."""
        params = [*model.encoder.parameters(), *model.head.projector.parameters(),
                  *model.head.personal_classifier.parameters()]
        return fit(model, data, ctx, self._stage_a, params, ctx.train.epochs,
                   optimizer=method_optimizer(self.config, params, ctx), batch_size=self.config.batch_size)

    def train_stage_b(self, model: DualFedModel, data: ClientTensors, ctx: LocalContext) -> float:
        """Stage B: only ``h_s`` on detached pre-projection features, fresh optimizer."""

        def loss(m: DualFedModel, x, y):
            with torch.no_grad():
                z = m.encoder(x)
                # no loss uses u; run the projector only so its BatchNorm running
                # statistics follow the final encoder, as the authors' full forward does
                m.head.projector(z)
            return F.cross_entropy(m.head.global_classifier(z), y)

        params = list(model.head.global_classifier.parameters())
        return fit(model, data, ctx, loss, params, ctx.train.epochs,
                   optimizer=method_optimizer(self.config, params, ctx), batch_size=self.config.batch_size)

    def train_simultaneous(self, model: DualFedModel, data: ClientTensors, ctx: LocalContext) -> float:
        """Variant: every part on the sum of both stages' losses, z not detached."""
        cfg = self.config

        def loss(m: DualFedModel, x, y):
            z = m.encoder(x)
            a = stage_a_loss(m.head, z, y, con_lambda=cfg.con_lambda, tau=cfg.tau, form=cfg.supcon_form)
            return a + F.cross_entropy(m.head.global_classifier(z), y)

        params = list(model.parameters())
        return fit(model, data, ctx, loss, params, ctx.train.epochs,
                   optimizer=method_optimizer(self.config, params, ctx), batch_size=cfg.batch_size)

    def local_update(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> LocalResult:
        dual = model_as(model, DualFedModel)
        if self.config.schedule == "simultaneous":
            loss = self.train_simultaneous(dual, data, ctx)
            metrics = {"loss": loss}
        else:
            loss = self.train_stage_a(dual, data, ctx)
            loss_b = self.train_stage_b(dual, data, ctx)
            metrics = {"loss_stage_a": loss, "loss_stage_b": loss_b}
        return LocalResult(upload=self.shared_params(model), train_loss=loss, metrics=metrics)

    def recalibrate(self, model: nn.Module, data: ClientTensors) -> int:
        """Re-estimate every personal BatchNorm statistic (encoder and projector) for the current
        encoder on the client's training images; returns the number of images used."""
        dual = model_as(model, DualFedModel)
        return recalibrate_batchnorm(dual, dual.parts_forward, data.x_train)

    # ------------------------------------------------------------------ server side
    def update_weight(self, update: ClientUpdate) -> int:
        """Every participant counts once, whatever its sample count: the plain mean [code]."""
        return 1

    # ------------------------------------------------------------------ export plan
    def device_head(self, model: nn.Module) -> nn.Module:
        """Projector + personal classifier + global classifier: z -> ensemble logits."""
        return model_as(model, DualFedModel).head

    # ------------------------------------------------------------------ heads on the frozen encoder
    def make_head(self, kind: str, release: HeadRelease | None = None, **params: Any) -> HeadEstimator:
        """``"dualfed"``: ``g`` and ``h_p`` fitted on a device's frozen z around the release's ``h_s``."""
        if kind == self.name:
            from .device_head import TorchDeviceHead

            return TorchDeviceHead.for_method(self, release, **params)
        return super().make_head(kind, release, **params)

    def train_device_head(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> float:
        """Stage A on frozen features: ``g`` and ``h_p`` on CE + lambda * SupCon (``h_s`` is fixed)."""
        return self.train_stage_a(model_as(model, DualFedModel), data, ctx)
