"""RepPer [paper 003]: contrastive common representation, then personal heads.

Stage 1, common representation learning (federated): the encoder ``f`` maps an image
to ``r``; the supervised contrastive loss (:func:`~edgepfl.methods.losses.supcon_loss`,
temperature 0.1) is applied to the L2-normalized features of **two random
augmentations** of every image in a batch (2B views, labels repeated). Default form
``supcon_form = "out"`` (mean of logs over positives); the paper's eq. 5 (``"in"``, log
of the mean) measured worse on both held-out settings (docs/METHODS.md). Labels serve
only to say which views are positives: no classifier is trained during federated
training, and only the encoder is uploaded. Optimizer Adam, lr 1e-3, weight decay
1e-4 (paper), carried by this method's config because the run's ``train`` section
defaults to SGD. The server is FedAvg of the encoder weighted by sample count.

Stage 2, personalized classification: the encoder is frozen and each client fits its
own scikit-learn head (logistic regression, linear SVM or a one-hidden-layer MLP) on
features of its own training split, L2-normalized by default (``head_normalize``), the linear
heads' C chosen per client by 3-fold cross-validation on that split unless ``head_C``
is set (docs/METHODS.md "RepPer"). The heads are the
generic family of :mod:`edgepfl.heads`, built by :meth:`RepPer.make_head` from this
method's ``head_*`` options: a head-tier device or ``edgepfl fit-head`` fitting a head
on a RepPer encoder gets exactly the estimator of stage 2.

Where the personal head lives: the head is **re-fitted at every evaluation** (cheap:
a few hundred samples, one convex fit) and its fitted weights are copied into the
torch module ``model.head`` (:class:`RepPerHead`: normalize + linear or MLP), whose
softmax equals the sklearn ``predict_proba`` for lr / mlp and whose logits equal
the per-class scores of svm (``decision_function``; ``[-s, s]`` for a binary one). So the head is ordinary personal state: it survives
the agent's save / load, ``logits`` uses it between evaluations, and
:meth:`RepPer.device_head` exports it to ONNX like any torch head.

Augmentations (torch, on normalized tensors, drawn from ``ctx.generator``): a
random resized crop (area fraction in ``aug_crop_scale``, aspect ratio in [3/4, 4/3],
resampled to the input size with bilinear interpolation), a horizontal flip with
probability 0.5, and additive Gaussian noise (``aug_noise_std``). The paper does not
list its augmentations; these are the SupCon recipe minus colour jitter, which
grayscale inputs do not need [inferred].

Paper details not reproduced: the learning-rate decay of 0.1 (schedule unstated) and
the 10-epoch SGD fine-tuning of the heads; the heads here are fitted to convergence
by their sklearn solvers instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from .._torch import F, nn, torch
from ..heads import DEFAULT_C, DEFAULT_HIDDEN, DEFAULT_MAX_ITER, DEFAULT_NORMALIZE, GENERIC_HEAD_KINDS
from ..models import SplitModel, build_encoder, model_as
from . import register
from .base import EvalResult, LocalContext, LocalResult, Method, MethodConfig, method_optimizer, train_override
from .losses import supcon_loss
from .training import encoder_features, fit

if TYPE_CHECKING:  # pragma: no cover
    from ..data.client import ClientTensors
    from ..heads import HeadRelease
    from ..heads.estimators import SklearnHead
    from ..specs import ModelSpec

#: logit bias of a class the client has never seen: probability exp(-1e4) == 0 in
#: float32, yet finite, so saved state and exported graphs hold no inf
ABSENT_CLASS_LOGIT = -1e4


class RepPerConfig(MethodConfig):
    """RepPer options; defaults from the paper unless marked [inferred]."""

    tau: float = Field(0.1, gt=0, description="SupCon temperature")
    supcon_form: Literal["out", "in"] = Field(
        "out", description="'out': mean of logs over positives (METHODS.md; measured better); "
                           "'in': the paper's eq. 5 and its gradient (log of the positive mean)"
    )
    optimizer: Literal["sgd", "adam"] | None = train_override("optimizer", "adam", "stage-1 optimizer (paper: Adam)")
    lr: float | None = train_override("lr", 1e-3, "the paper's value")
    weight_decay: float | None = train_override("weight_decay", 1e-4, "the paper's value")
    momentum: float | None = train_override("momentum", None, "SGD only")
    batch_size: int | None = train_override("batch_size", None, "paper: 256", ge=2)
    projection_dim: int | None = Field(
        None, ge=2, description="optional projection MLP k-k-dim for the loss only [inferred; default off]"
    )
    aug_crop_scale: tuple[float, float] = Field((0.5, 1.0), description="area fraction range of the random crop")
    aug_flip: bool = True
    aug_noise_std: float = Field(0.05, ge=0, description="std of added Gaussian noise, in normalized units")
    # the head options are the parameters of the generic heads (edgepfl.heads), whose
    # defaults they share; RepPer.make_head maps them onto the estimators
    head: Literal[GENERIC_HEAD_KINDS] = Field(  # type: ignore[valid-type]
        "lr", description="stage-2 personal head: logistic regression, linear SVM or MLP"
    )
    head_normalize: bool = Field(DEFAULT_NORMALIZE, description="L2-normalize features before the head [measured default]")
    head_C: float | None = Field(
        DEFAULT_C, gt=0, description="inverse regularization of lr / svm; None: chosen per client by k-fold "
                                     "cross-validation on its training split (edgepfl.heads)"
    )
    head_hidden: int = Field(DEFAULT_HIDDEN, ge=1, description="MLP head hidden units (sklearn's default)")
    head_max_iter: int = Field(DEFAULT_MAX_ITER, ge=1, description="solver iterations of every head kind")


# ---------------------------------------------------------------------- augmentation
def augment(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    crop_scale: tuple[float, float] = (0.5, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    noise_std: float = 0.05,
) -> torch.Tensor:
    """One random view of each image in ``x`` (N, C, H, W): resized crop, flip, noise.

    Random numbers are drawn on the CPU from ``generator`` (so a CPU generator seeds
    CUDA data too); crop and flip are one affine resampling per image. A series (N, C, T)
    is taken as an image one row high: a window of it stretched to T samples, reversed in
    time where ``flip``, plus noise. A vector (N, D) gets the noise alone.
    """
    if x.dim() == 3:
        return augment(x.unsqueeze(2), generator, crop_scale=crop_scale, ratio=ratio, flip=flip,
                       noise_std=noise_std).squeeze(2)
    if x.dim() == 2:
        noise = torch.randn(x.shape, generator=generator).to(device=x.device, dtype=x.dtype)
        return x + noise_std * noise if noise_std > 0 else x.clone()
    n = x.shape[0]
    rand = torch.rand(n, 5, generator=generator)
    lo, hi = crop_scale
    area = lo + (hi - lo) * rand[:, 0]
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * rand[:, 1]
    aspect = torch.exp(log_r)
    # half-extents in affine_grid's [-1, 1] coordinates equal the kept fraction
    w = torch.sqrt(area * aspect).clamp(max=1.0)
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (1 - w) * (2 * rand[:, 2] - 1)
    cy = (1 - h) * (2 * rand[:, 3] - 1)
    sx = torch.where(rand[:, 4] < 0.5, -w, w) if flip else w
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = sx, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    theta = theta.to(device=x.device, dtype=x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if noise_std > 0:
        out = out + noise_std * torch.randn(x.shape, generator=generator).to(device=x.device, dtype=x.dtype)
    return out


# ---------------------------------------------------------------------- heads
class RepPerHead(nn.Module):
    """Torch twin of a fitted stage-2 head: optional L2 normalization + ``net``.

    ``net`` is ``Linear(k, C)`` for lr / svm and ``Linear(k, h)-ReLU-Linear(h, C)``
    for mlp; :meth:`load_head` copies a fitted :mod:`edgepfl.heads` estimator into it.
    """

    def __init__(self, in_features: int, num_classes: int, kind: str = "lr", hidden: int = DEFAULT_HIDDEN,
                 normalize: bool = DEFAULT_NORMALIZE):
        super().__init__()
        self.kind = kind
        self.normalize = normalize
        self.num_classes = num_classes
        if kind == "mlp":
            self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        else:
            self.net = nn.Sequential(nn.Linear(in_features, num_classes))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        if self.normalize:
            r = F.normalize(r, dim=1)
        return self.net(r)

    @torch.no_grad()
    def load_head(self, head: SklearnHead) -> None:
        """Copy a fitted head's weights (its classes are label ids).

        Softmax of the logits is then the head's ``predict_proba`` (for svm: the
        logits are its ``decision_function``). Binary estimators keep one output row
        ``s``: for lr / mlp it becomes the logit of the second class against 0 for the
        first (softmax of ``[0, s]`` is their sigmoid), for svm ``[-s, s]``, the scores
        the SVM head's ``predict_proba`` takes the softmax of. Classes the estimator never saw get :data:`ABSENT_CLASS_LOGIT`.
        """
        if head.normalize != self.normalize:
            raise ValueError(f"head normalize={head.normalize} does not match this module's {self.normalize}")
        clf = head.pipeline_[-1]
        classes = np.asarray(clf.classes_, dtype=np.int64)
        if self.kind == "mlp":
            if len(clf.coefs_) != 2:
                raise ValueError("only one-hidden-layer MLP heads map onto RepPerHead")
            hidden, out = self._linear(0), self._linear(2)
            hidden.weight.copy_(torch.as_tensor(clf.coefs_[0].T, dtype=hidden.weight.dtype))
            hidden.bias.copy_(torch.as_tensor(clf.intercepts_[0], dtype=hidden.bias.dtype))
            w, b = clf.coefs_[1].T, clf.intercepts_[1]
        else:
            out = self._linear(0)
            w, b = clf.coef_, clf.intercept_
        self._fill_output(out, classes, np.asarray(w, dtype=np.float64), np.asarray(b, dtype=np.float64))

    @torch.no_grad()
    def set_constant(self, label: int) -> None:
        """A head that always predicts ``label`` (a client whose train split has one class)."""
        for p in self.net.parameters():
            p.zero_()
        out = self._linear(-1)
        out.bias.fill_(ABSENT_CLASS_LOGIT)
        out.bias[label] = 0.0

    def _linear(self, index: int) -> nn.Linear:
        """Layer ``index`` of ``net``, one of its Linear layers (``net[i]`` is typed as any Module)."""
        return model_as(self.net[index], nn.Linear)

    def _fill_output(self, out: nn.Linear, classes: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
        weight = np.zeros((self.num_classes, out.in_features))
        bias = np.full(self.num_classes, ABSENT_CLASS_LOGIT)
        if w.shape[0] == 1 and len(classes) == 2:
            weight[classes[1]], bias[classes[1]] = w[0], b[0]
            if self.kind == "svm":
                weight[classes[0]], bias[classes[0]] = -w[0], -b[0]
            else:
                bias[classes[0]] = 0.0
        else:
            weight[classes], bias[classes] = w, b
        out.weight.copy_(torch.as_tensor(weight, dtype=out.weight.dtype))
        out.bias.copy_(torch.as_tensor(bias, dtype=out.bias.dtype))


class RepPerModel(SplitModel):
    """``encoder`` (x -> r), personal ``head`` (r -> logits), optional ``projector`` (loss only)."""

    head: RepPerHead

    def __init__(self, encoder: nn.Module, head: RepPerHead, projector: nn.Module | None = None):
        super().__init__(encoder, head)
        self.projector = projector

    @classmethod
    def build(cls, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, *, head: str = "lr",
              hidden: int = DEFAULT_HIDDEN, normalize: bool = DEFAULT_NORMALIZE,
              projection_dim: int | None = None) -> RepPerModel:
        """Encoder, then the projector MLP ``k-k-projection_dim`` when asked, then the head
        (the order their weights are drawn in)."""
        encoder = build_encoder(spec, input_shape)
        k = encoder.out_features
        projector = None
        if projection_dim is not None:
            projector = nn.Sequential(nn.Linear(k, k), nn.ReLU(inplace=True), nn.Linear(k, projection_dim))
        return cls(encoder, RepPerHead(k, num_classes, head, hidden, normalize), projector)


@register
class RepPer(Method):
    name = "repper"
    summary = "SupCon on two augmented views for a shared encoder; personal sklearn heads on frozen features"
    config_class = RepPerConfig
    # the projector, when enabled, is trained by the federated loss and averaged with
    # the encoder; when it is off no key matches the prefix
    shared_parts = ("encoder", "projector")
    bn_policy = "shared"

    config: RepPerConfig

    def build_model(self, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        cfg = self.config
        return RepPerModel.build(spec, input_shape, num_classes, head=cfg.head, hidden=cfg.head_hidden,
                                 normalize=cfg.head_normalize, projection_dim=cfg.projection_dim)

    # ------------------------------------------------------------------ stage 1
    def views(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Two augmented views of the batch (:func:`augment`), stacked: (2B, *input_shape)."""
        cfg = self.config

        def view() -> torch.Tensor:
            return augment(x, generator, crop_scale=cfg.aug_crop_scale, flip=cfg.aug_flip,
                           noise_std=cfg.aug_noise_std)

        return torch.cat([view(), view()])

    def contrastive_loss(self, model: RepPerModel, x: torch.Tensor, y: torch.Tensor, generator=None) -> torch.Tensor:
        """Stage-1 loss of one batch: SupCon over 2B views, the labels repeated."""
        r = model.encoder(self.views(x, generator))
        z = model.projector(r) if model.projector is not None else r
        return supcon_loss(z, torch.cat([y, y]), self.config.tau, form=self.config.supcon_form)

    def local_update(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> LocalResult:
        """Stage 1 on this client: ``train.epochs`` epochs of SupCon; uploads the encoder."""
        cfg = self.config
        rep = model_as(model, RepPerModel)
        params = list(rep.encoder.parameters())
        if rep.projector is not None:
            params += list(rep.projector.parameters())
        opt = method_optimizer(cfg, params, ctx)
        loss = fit(rep, data, ctx, lambda m, x, y: self.contrastive_loss(m, x, y, ctx.generator), params,
                   ctx.train.epochs, optimizer=opt, batch_size=cfg.batch_size)
        return LocalResult(upload=self.shared_params(model), train_loss=loss, metrics={"supcon": loss})

    # ------------------------------------------------------------------ stage 2
    def make_head(self, kind: str, release: HeadRelease | None = None, **params: Any) -> SklearnHead:
        """A generic head with this method's ``head_*`` options as its parameters.

        Stage 2 fits ``make_head(config.head)``; a device fitting a head on a RepPer
        encoder gets the same estimator for the same kind. ``params`` override.
        """
        cfg = self.config
        options: dict[str, Any] = {"normalize": cfg.head_normalize, "max_iter": cfg.head_max_iter}
        if kind == "mlp":
            options["hidden_layer_sizes"] = (cfg.head_hidden,)
        else:
            options["C"] = cfg.head_C
        return super().make_head(kind, release, **{**options, **params})

    def fit_head(self, model: RepPerModel, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> SklearnHead | None:
        """Fit the personal head on frozen features of (x, y); returns the fitted estimator.

        The fitted weights are also copied into ``model.head``. Returns ``None`` when
        ``y`` holds a single class (no estimator fits that; the head predicts it).
        """
        labels = y.detach().cpu().numpy()
        present = np.unique(labels)
        if len(present) < 2:
            model.head.set_constant(int(present[0]) if len(present) else 0)
            return None
        feats = encoder_features(model, x).cpu().numpy()
        head = self.make_head(self.config.head, random_state=seed).fit(feats, labels)
        model.head.load_head(head)
        return head

    def evaluate(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> EvalResult:
        """Re-fit the personal head on the current encoder, then score the test split."""
        self.fit_head(model_as(model, RepPerModel), data.x_train, data.y_train, seed=ctx.seed)
        return super().evaluate(model, data, ctx)

    # ------------------------------------------------------------------ export plan
    def device_head(self, model: nn.Module) -> nn.Module:
        """The fitted personal head (normalization included): encoder features -> logits."""
        return model_as(model, RepPerModel).head
