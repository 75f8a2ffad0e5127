"""FedPick [paper 002]: personalized feature selection in the low-dimensional feature space.

A shared encoder E maps an image to universal features v (dimension d). Each client
owns a personalized feature selection module (PFSM): logits s = Linear(d,d)-ReLU-
Linear(d,d)(v), turned into a binary mask by a Gumbel-Sigmoid with a straight-through
gradient. The mask splits v into task-relevant v_r = m*v and task-irrelevant
v_ir = (1-m)*v. Three classifiers sit on top: the global C_g(v) (shared, the module
``head``), the personal C_p(v_r) and C_ir(v_ir). One loss trains everything at once:

    L = lam_g*CE(C_g(v), y) + lam_p*CE(C_p(v_r), y) - lam_ent*H(softmax C_ir(v_ir))
        + lam_kd*[KL(sg p_g || p_p) + KL(sg p_p || p_g)]

Shared: encoder (all BatchNorm layers personal) and C_g. Inference: C_g(v) + C_p(v_r)
with the noise-free mask (the softmax average or C_p alone as options, :mod:`.ensemble`).
See METHODS.md "FedPick".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from .._torch import F, nn, torch
from ..heads import GENERIC_HEAD_KINDS
from ..models import Encoder, SplitModel, build_encoder, model_as
from . import register
from .base import LocalResult, Method, PersonalBatchNormConfig
from .ensemble import EnsembleForm, ensemble_logits
from .training import fit, noise_generator

if TYPE_CHECKING:  # pragma: no cover
    from ..heads import HeadRelease
    from ..heads.estimators import HeadEstimator
    from ..specs import ModelSpec


class FedPickConfig(PersonalBatchNormConfig):
    """FedPick's options; defaults are the paper's real-image column of Table III."""

    lam_g: float = Field(1.0, ge=0, description="weight of CE on the global classifier C_g(v)")
    lam_p: float = Field(1.0, ge=0, description="weight of CE on the personal classifier C_p(v_r)")
    lam_ent: float = Field(0.001, ge=0, description="weight of the entropy of C_ir(v_ir) (maximised)")
    lam_kd: float = Field(1.0, ge=0, description="weight of the cyclic distillation between p_g and p_p")
    pfsm_hidden: int | None = Field(
        None, ge=1, description="hidden width of the PFSM's Linear(d, h)-ReLU-Linear(h, d) [inferred]; "
                                "None: h = d, the feature size (the paper's widths were lost in extraction)")
    temperature: float = Field(1.0, gt=0, description="Gumbel-Sigmoid temperature T [inferred]")
    threshold: float = Field(0.5, gt=0, lt=1, description="hard-mask threshold on the soft mask (paper: 0.5)")
    ensemble: EnsembleForm = Field(
        "logits", description="inference: C_g(v)+C_p(v_r) logit sum, the average of their softmaxes, "
        "or C_p(v_r) alone (label shift with many local epochs: research/RESULTS.md)"
    )


def gumbel_noise(shape: torch.Size, generator: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel(0, 1) samples, drawn on the CPU generator so runs repeat on any device."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    g = -torch.log(-torch.log(u.clamp(tiny, 1.0 - 1e-12)))
    return g.to(device=like.device, dtype=like.dtype)


def deterministic_mask(s: torch.Tensor, temperature: float, threshold: float) -> torch.Tensor:
    """The inference mask: no noise, 1 where sigmoid(s/T) exceeds the threshold."""
    return (torch.sigmoid(s / temperature) > threshold).to(s.dtype)


class FedPickModel(SplitModel):
    """Encoder + PFSM + three classifiers; ``head`` is the shared global classifier C_g.

    In training mode :meth:`parts` draws Gumbel noise (from ``generator`` when given);
    in eval mode the mask is deterministic, so repeated evaluations agree.
    """

    def __init__(self, encoder: Encoder, num_classes: int, *, temperature: float = 1.0,
                 threshold: float = 0.5, ensemble: str = "logits", pfsm_hidden: int | None = None):
        d = encoder.out_features
        super().__init__(encoder, nn.Linear(d, num_classes))  # head: C_g, shared
        # The output is d wide, a mask entry per feature; the hidden width was lost in extraction.
        h = pfsm_hidden or d
        self.pfsm = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))
        self.personal_head = nn.Linear(d, num_classes)  # C_p on v_r
        self.irrelevant_head = nn.Linear(d, num_classes)  # C_ir on v_ir
        self.temperature = temperature
        self.threshold = threshold
        self.ensemble = ensemble

    @classmethod
    def build(cls, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, *, temperature: float = 1.0,
              threshold: float = 0.5, ensemble: str = "logits", pfsm_hidden: int | None = None) -> FedPickModel:
        return cls(build_encoder(spec, input_shape), num_classes, temperature=temperature, threshold=threshold,
                   ensemble=ensemble, pfsm_hidden=pfsm_hidden)

    def mask(self, v: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, m_soft) for features ``v``.

        Forward value of ``m`` is the hard 0/1 mask; its gradient is that of ``m_soft``
        (straight-through), which is how the PFSM learns through a discrete selection.
        """
        s = self.pfsm(v)
        if self.training:
            s = s + gumbel_noise(s.shape, generator, s) - gumbel_noise(s.shape, generator, s)
        m_soft = torch.sigmoid(s / self.temperature)
        hard = (m_soft > self.threshold).to(m_soft.dtype)
        return hard - m_soft.detach() + m_soft, m_soft

    def parts(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Everything the loss needs: v, the mask and the three classifiers' logits."""
        v = self.encoder(x)
        m, m_soft = self.mask(v, generator)
        return {
            "v": v,
            "mask": m,
            "mask_soft": m_soft,
            "z_g": self.head(v),
            "z_p": self.personal_head(m * v),
            "z_ir": self.irrelevant_head((1 - m) * v),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parts(x)
        return ensemble_logits(p["z_g"], p["z_p"], self.ensemble)


class FedPickHead(nn.Module):
    """The on-device head: features v -> ensemble logits with the deterministic mask.

    Holds the model's own PFSM, C_p and C_g (no copies), so it is always current.
    """

    def __init__(self, model: FedPickModel):
        super().__init__()
        self.pfsm = model.pfsm
        self.personal_head = model.personal_head
        self.head = model.head
        self.temperature = model.temperature
        self.threshold = model.threshold
        self.ensemble = model.ensemble

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        m = deterministic_mask(self.pfsm(v), self.temperature, self.threshold)
        return ensemble_logits(self.head(v), self.personal_head(m * v), self.ensemble)


def fedpick_loss(parts: dict[str, torch.Tensor], y: torch.Tensor, cfg: FedPickConfig) -> dict[str, torch.Tensor]:
    """Eq. (15) of the paper and its terms; ``total`` is what is minimised.

    ``entropy`` is the mean entropy of softmax(C_ir(v_ir)); it enters ``total`` with a
    minus sign, so minimising the loss makes the irrelevant features uninformative.
    KL(sg p || q) = sum p (log p - log q) with p detached: each direction moves only
    the student side.
    """
    log_p_g = F.log_softmax(parts["z_g"], 1)
    log_p_p = F.log_softmax(parts["z_p"], 1)
    log_p_ir = F.log_softmax(parts["z_ir"], 1)
    ce_g = F.nll_loss(log_p_g, y)
    ce_p = F.nll_loss(log_p_p, y)
    entropy = -(log_p_ir.exp() * log_p_ir).sum(1).mean()
    kd = (F.kl_div(log_p_p, log_p_g.detach(), reduction="batchmean", log_target=True)
          + F.kl_div(log_p_g, log_p_p.detach(), reduction="batchmean", log_target=True))
    total = cfg.lam_g * ce_g + cfg.lam_p * ce_p - cfg.lam_ent * entropy + cfg.lam_kd * kd
    return {"total": total, "ce_g": ce_g, "ce_p": ce_p, "entropy": entropy, "kd": kd}


@register
class FedPick(Method):
    """FedPick: shared encoder (BN personal) and global classifier; personal PFSM, C_p, C_ir."""

    name = "fedpick"
    summary = "personalized Gumbel-Sigmoid feature selection; global + personal + irrelevant classifiers"
    config_class = FedPickConfig
    config: FedPickConfig
    shared_parts = ("encoder", "head")
    bn_policy = "local"
    # "fedpick": this method's own head (PFSM + C_p + the federation's C_g) fitted on a device
    head_kinds = (name, *GENERIC_HEAD_KINDS)

    def build_model(self, spec, input_shape, num_classes) -> FedPickModel:
        c = self.config
        return FedPickModel.build(spec, input_shape, num_classes, temperature=c.temperature, threshold=c.threshold,
                                  ensemble=c.ensemble, pfsm_hidden=c.pfsm_hidden)

    def local_update(self, model: nn.Module, data, ctx) -> LocalResult:
        pick = model_as(model, FedPickModel)
        noise = noise_generator(ctx, salt=0x9E3779B9)
        selected: list[float] = []

        def loss_fn(m: FedPickModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            parts = m.parts(x, noise)
            selected.append(float(parts["mask"].detach().mean()))
            return fedpick_loss(parts, y, self.config)["total"]

        loss = fit(pick, data, ctx, loss_fn, pick.parameters(), ctx.train.epochs)
        metrics = {"mask_ratio": sum(selected) / len(selected)} if selected else {}
        return LocalResult(upload=self.shared_params(model), train_loss=loss, metrics=metrics)

    def device_head(self, model: nn.Module) -> nn.Module:
        return FedPickHead(model_as(model, FedPickModel))

    def make_head(self, kind: str, release: HeadRelease | None = None, **params: Any) -> HeadEstimator:
        """``"fedpick"``: PFSM, ``C_p`` and ``C_ir`` fitted on a device's frozen v around the release's ``C_g``.

        Trained by the method's own local update (:meth:`train_device_head`'s default):
        Gumbel noise and the straight-through mask as in the federation.
        """
        if kind == self.name:
            from .device_head import TorchDeviceHead

            return TorchDeviceHead.for_method(self, release, **params)
        return super().make_head(kind, release, **params)
