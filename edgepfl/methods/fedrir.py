"""FedRIR [paper 004; code tsmotlp/FedRIR]: masked client-specific learning + information distillation.

Parts (METHODS.md "FedRIR"): the global feature extractor GFE (module ``encoder``,
shared) gives f_g (512); the client-specific extractor CSFE, a VAE encoder on a
masked image, gives mean and log-variance (512 each), f_cs = the mean; a generator
reconstructs the image from a sample of N(mean, var); the information distillation
module q (two MLPs 512-128-512: mean, tanh log-variance) is a variational
conditional; the head is Linear(1024, C) on concat[f_g, f_cs]. Everything but the
GFE's parameters stays on the device (GFE BatchNorm statistics included).

Each round: stage 1 trains CSFE + generator to reconstruct the full image from a
masked one (4x4 patches, 60% zeroed): MSE + 0.1*KL. Stage 2 freezes the CSFE's
parameters (its BatchNorm runs in training mode, as in the authors' code) and trains
GFE, q and head with CE plus an information term, chosen by ``mi``:

* ``club_conditional`` (default): q(f_cs | f_g) takes ``q_steps`` maximum-likelihood
  steps on the batch (f_g detached) first, then the GFE minimises the vCLUB bound of
  I(f_cs; f_g) through mu(f_g) and sigma(f_g), q frozen: CLUB's reference procedure
  [Cheng et al. 2020]. It bounds the paper's quantity and stays stable;
* ``vclub`` (the paper's literal form): q(f_g | f_cs) is fit by maximum likelihood on a
  detached f_g in the same step, and the GFE minimises the bound through f_g. With q
  fixed the estimate is linear in f_g, so f_g can grow without limit (docs/METHODS.md);
* ``code`` (the authors' published code): q(f_cs | f_g), and only q's negative
  log-likelihood is added to CE (gradients reach the GFE through q's input).

``mi_clamp`` (default) adds the bound as max(estimate, 0): mutual information is never
negative, so a batch whose estimate is below zero says that q misfits it, and the GFE is
not pushed further along q's error there; max(bound, 0) still bounds the paper's
quantity. Unclamped, the default swings at the paper's steps per round
(research/RESULTS.md "At the paper's data size").

The Adam moments of both stages are kept across rounds (the authors' code builds its
two optimizers once per client) as personal buffers of the model (``adam.*``), so they
are saved and restored with the rest of the personal state.

The GFE's BatchNorm running statistics are personal while its weights are shared, and
the agent evaluates right after loading a new global GFE: the stored statistics were
estimated under the client's own GFE of its last local training, not the received one.
``bn_recalibrate = True`` re-estimates them on the client's training images before
evaluating (:meth:`Method.recalibrate`: the GFE is FedRIR's encoder; the CSFE's
statistics are left alone, its weights being personal too; docs/METHODS.md "FedRIR").
Training normalizes the GFE with batch statistics and never reads the running ones, so
the option changes what is evaluated (and stored), not what is trained. ``False``
evaluates the stored statistics, as the authors' code does.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Literal

from pydantic import Field

from .._torch import F, nn, torch
from ..errors import ModelSpecError
from ..models import ConvTrunk, is_plugin_arch, model_as
from . import register
from .base import LocalResult, Method, PersonalBatchNormConfig, method_optimizer, train_override
from .training import fit, freeze, noise_generator


class FedRIRConfig(PersonalBatchNormConfig):
    """FedRIR's options; defaults are the paper's (Adam 5e-4, batch 100, r = 0.6)."""

    mi: Literal["club_conditional", "vclub", "code"] = Field(
        "club_conditional",
        description="club_conditional: q(f_cs|f_g) fit first, bound through mu/sigma(f_g) (CLUB's procedure); "
                    "vclub: the paper's literal q(f_g|f_cs), bound through f_g; code: authors' code (q NLL only)")
    q_steps: int = Field(
        1, ge=1, description="q's maximum-likelihood steps per batch; in vclub and code the last one is the joint "
                             "stage-2 step, in club_conditional all come before the extractor's step")
    mi_normalize: bool = Field(False, description="f_g enters the information term L2-normalised (the head sees it as is)")
    keep_optimizer_state: bool = Field(
        True, description="keep the Adam moments across rounds (authors' code), saved with the personal state")
    mi_weight: float = Field(1.0, ge=0, description="weight of the information term in stage 2 (paper: 1)")
    csfe_train_mode: bool = Field(
        True, description="the frozen CSFE stays in training mode in stage 2 (authors' code): f_cs is normalised "
                          "with the batch's statistics, which its BatchNorm running statistics follow; False: "
                          "eval mode, its stored statistics from stage 1")
    mi_clamp: bool = Field(
        True, description="the bound enters the loss as max(estimate, 0): mutual information is never negative, "
                           "so a batch whose estimate is below zero measures q's misfit and gives the GFE no gradient")
    mask_ratio: float = Field(0.6, ge=0, lt=1, description="share of patches zeroed per sample")
    patch_size: int = Field(4, ge=1)
    kl_weight: float = Field(0.1, ge=0, description="weight of KL(N(mu, var) || N(0, I)) in stage 1")
    embed_dim: int = Field(512, ge=1, description="f_g and f_cs size (the paper's 512)")
    q_hidden: int = Field(128, ge=1, description="hidden width of q's two MLPs")
    optimizer: Literal["sgd", "adam"] = Field(
        "adam", description="paper: Adam; no None (the run's train.optimizer): whether the model keeps Adam "
                            "moments (keep_optimizer_state) is settled when it is built, before any task")
    lr: float | None = train_override("lr", 5e-4, "the paper's value")
    batch_size: int | None = train_override("batch_size", 100, "the paper's value")
    weight_decay: float | None = train_override("weight_decay", 0.0)
    recon_epochs: int | None = Field(None, ge=1, description="stage 1 epochs; None: train.epochs")
    cls_epochs: int | None = Field(None, ge=1, description="stage 2 epochs; None: train.epochs")
    bn_recalibrate: bool = Field(
        False, description="re-estimate the GFE's personal BatchNorm statistics on the client's training images "
                          "with each received GFE, before evaluating (False: the stored ones, as the authors' code)")


# ---------------------------------------------------------------------------- masking
def mask_patches(x: torch.Tensor, ratio: float, patch: int = 4,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero ``floor(ratio * P)`` random patch x patch squares (all channels) in each sample.

    P counts the patches of a ceil-divided grid, so border patches of sizes that are not
    a multiple of ``patch`` are patches too. The draw uses ``generator`` on the CPU.
    """
    n, _, h, w = x.shape
    gh, gw = -(-h // patch), -(-w // patch)
    num = gh * gw
    k = int(ratio * num + 1e-9)
    if k == 0:
        return x
    order = torch.rand(n, num, generator=generator).argsort(1)
    keep = torch.ones(n, num)
    keep.scatter_(1, order[:, :k], 0.0)
    keep = keep.view(n, 1, gh, gw).repeat_interleave(patch, 2).repeat_interleave(patch, 3)[:, :, :h, :w]
    return x * keep.to(device=x.device, dtype=x.dtype)


# ---------------------------------------------------------------------------- modules
def _trunk(in_channels: int, norm: str) -> ConvTrunk:
    def block(cin: int, cout: int) -> list[nn.Module]:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 5)]
        if norm == "batch":
            layers.append(nn.BatchNorm2d(cout))
        return layers + [nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    return ConvTrunk(*block(in_channels, 32), *block(32, 64), nn.Flatten())


def _trunk_sizes(h: int) -> tuple[int, int]:
    """Side after the first and the second conv-pool block."""
    a = (h - 4) // 2
    return a, (a - 4) // 2


class GlobalExtractor(nn.Module):
    """GFE: conv-BN-ReLU-pool x2 -> Linear(., embed_dim), no activation (f_g)."""

    def __init__(self, input_shape: tuple[int, int, int], embed_dim: int, norm: str = "batch"):
        super().__init__()
        c, h, w = input_shape
        self.conv = _trunk(c, norm)
        self.fc = nn.Linear(64 * _trunk_sizes(h)[1] * _trunk_sizes(w)[1], embed_dim)
        self.out_features = embed_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class ClientSpecificExtractor(nn.Module):
    """CSFE: the same trunk -> Linear(., 2*embed_dim), split into (mean, log-variance)."""

    def __init__(self, input_shape: tuple[int, int, int], embed_dim: int, norm: str = "batch"):
        super().__init__()
        c, h, w = input_shape
        self.conv = _trunk(c, norm)
        self.fc = nn.Linear(64 * _trunk_sizes(h)[1] * _trunk_sizes(w)[1], 2 * embed_dim)
        self.embed_dim = embed_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = self.fc(self.conv(x)).split(self.embed_dim, 1)
        return mean, logvar


class Generator(nn.Module):
    """Linear(embed_dim, 64*s*s) -> ConvT(64,32,5,s2)-ReLU-ConvT(32,c,5,s2): back to image size.

    Output paddings mirror the trunk's sizes (exact for 28 and 32 px, as in the authors'
    code); sizes whose inverse needs more than one extra pixel are zero-padded at the end.
    """

    def __init__(self, input_shape: tuple[int, int, int], embed_dim: int):
        super().__init__()
        c, h, w = input_shape
        (ah, sh), (aw, sw) = _trunk_sizes(h), _trunk_sizes(w)
        self.grid = (sh, sw)
        self.size = (h, w)

        def pad(target, side):
            return max(0, min(1, target - (2 * side + 3)))

        op1 = (pad(ah, sh), pad(aw, sw))
        mid = (2 * sh + 3 + op1[0], 2 * sw + 3 + op1[1])
        op2 = (pad(h, mid[0]), pad(w, mid[1]))
        self.fc = nn.Linear(embed_dim, 64 * sh * sw)
        self.deconv = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 5, stride=2, output_padding=op1),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(32, c, 5, stride=2, output_padding=op2),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.deconv(self.fc(z).view(z.shape[0], 64, *self.grid))
        dh, dw = self.size[0] - out.shape[2], self.size[1] - out.shape[3]
        if dh or dw:
            out = F.pad(out, (0, dw, 0, dh))[:, :, : self.size[0], : self.size[1]]
        return out


class InfoDistillation(nn.Module):
    """q(target | cond) = N(mu(cond), exp(logvar(cond))): two MLPs dim-hidden-dim, tanh log-variance."""

    def __init__(self, dim: int, hidden: int = 128):
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.logvar = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.Tanh())

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(cond), self.logvar(cond)


def q_nll(mu: torch.Tensor, logvar: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """q's training loss: mean_i sum_d ((mu - target)^2 / exp(logvar) + logvar).

    Twice the Gaussian negative log-likelihood up to a constant, as in CLUB's and the
    authors' code; its minimiser is the maximum-likelihood q.
    """
    return ((mu - target) ** 2 / logvar.exp() + logvar).sum(1).mean()


def vclub(mu: torch.Tensor, logvar: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """vCLUB estimate mean_i log q(t_i|c_i) - mean_{i,j} log q(t_j|c_i) for Gaussian q.

    The log-variance and normalising terms cancel between the two means (same c_i).
    The all-pairs mean of (t_j - mu_i)^2 is (mu_i - mean t)^2 + var t, so this costs
    O(B*d), not O(B^2*d).
    """
    inv = 0.5 / logvar.exp()
    positive = -((mu - target) ** 2 * inv).sum(1)
    t_mean = target.mean(0, keepdim=True)
    t_var = target.var(0, unbiased=False, keepdim=True)
    negative = -(((mu - t_mean) ** 2 + t_var) * inv).sum(1)
    return (positive - negative).mean()


def kl_standard_normal(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """mean_i KL(N(mean_i, exp(logvar_i)) || N(0, I))."""
    return (-0.5 * (1 + logvar - mean**2 - logvar.exp()).sum(1)).mean()


#: the ``mi`` choices; a choice's index is the ``mi_mode`` metric of an update (floats only)
MI_MODES = ("code", "vclub", "club_conditional")


def q_roles(f_g: torch.Tensor, f_cs: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(condition, target) of q: the paper's q(f_g | f_cs) for ``vclub``, else q(f_cs | f_g)."""
    return (f_cs, f_g) if mode == "vclub" else (f_g, f_cs)


@contextmanager
def frozen(module: nn.Module):
    """Inside, ``module``'s parameters take no gradient; gradients still pass through it to its input."""
    flags = [p.requires_grad for p in module.parameters()]
    freeze(module)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags):
            p.requires_grad_(flag)


def fit_q(q: InfoDistillation, optimizer, f_g: torch.Tensor, f_cs: torch.Tensor, mode: str, steps: int) -> None:
    """``steps`` maximum-likelihood steps of q on one batch, features detached.

    ``optimizer`` is the stage's: only q's parameters get gradients here, and Adam skips
    parameters without one, so only q moves; gradients are cleared afterwards.
    """
    cond, target = (t.detach() for t in q_roles(f_g, f_cs, mode))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        mu, logvar = q(cond)
        q_nll(mu, logvar, target).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def information_term(q: InfoDistillation, f_g: torch.Tensor, f_cs: torch.Tensor,
                     mode: str, clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2's information loss; returns (loss to add to CE, q's NLL, vCLUB estimate).

    ``vclub`` (paper): q(f_g | f_cs) learns by maximum likelihood on a detached f_g,
    and the GFE minimises the bound through f_g alone (q's outputs detached), so q is
    never trained to loosen the bound and the GFE never to help q's fit.
    ``club_conditional`` (CLUB's reference procedure): q(f_cs | f_g) was fit before
    (:func:`fit_q`) and is frozen here; the bound reaches the GFE through mu(f_g) and
    logvar(f_g). q's NLL is only reported.
    ``code`` (authors' code): q(f_cs | f_g), its NLL added as is; the GFE receives
    gradient through q's input. The vCLUB value is then only reported.
    With ``clamp`` the bound enters the loss as max(estimate, 0) (``vclub``,
    ``club_conditional``); the estimate is reported as it is.
    """
    if mode == "vclub":
        mu, logvar = q(f_cs)
        nll = q_nll(mu, logvar, f_g.detach())
        mi = vclub(mu.detach(), logvar.detach(), f_g)
        return nll + (mi.clamp(min=0) if clamp else mi), nll, mi
    if mode == "club_conditional":
        with frozen(q):
            mu, logvar = q(f_g)
        mi = vclub(mu, logvar, f_cs)
        with torch.no_grad():
            nll = q_nll(mu, logvar, f_cs)
        return (mi.clamp(min=0) if clamp else mi), nll, mi
    mu, logvar = q(f_g)
    nll = q_nll(mu, logvar, f_cs)
    with torch.no_grad():
        mi = vclub(mu, logvar, f_cs)
    return nll, nll, mi


class AdamMoments(nn.Module):
    """Adam's per-parameter state (step, first and second moments) as buffers.

    Buffers are in the model's ``state_dict``, so the state is personal state: saved
    by the agent after a round, restored after a restart, moved with ``.to(device)``.
    Buffer ``<param name with . as __>__<step|exp_avg|exp_avg_sq>``; step 0: no state yet.
    """

    def __init__(self, named_parameters):
        super().__init__()
        for name, p in named_parameters:
            key = self._key(name)
            self.register_buffer(f"{key}__step", torch.zeros(()))
            self.register_buffer(f"{key}__exp_avg", torch.zeros_like(p))
            self.register_buffer(f"{key}__exp_avg_sq", torch.zeros_like(p))

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "__")

    def restore(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Give ``optimizer`` (an Adam over parameters of ``model``) the kept state."""
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for i, p in enumerate(params):
            key = self._key(names[id(p)])
            step = getattr(self, f"{key}__step")
            if float(step) > 0:
                state[i] = {"step": step.detach().cpu().clone(),
                            "exp_avg": getattr(self, f"{key}__exp_avg").clone(),
                            "exp_avg_sq": getattr(self, f"{key}__exp_avg_sq").clone()}
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})

    @torch.no_grad()
    def store(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Keep ``optimizer``'s state of the parameters it has stepped."""
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            key = self._key(names[id(p)])
            getattr(self, f"{key}__step").fill_(float(st["step"]))
            getattr(self, f"{key}__exp_avg").copy_(st["exp_avg"])
            getattr(self, f"{key}__exp_avg_sq").copy_(st["exp_avg_sq"])


class FedRIRModel(nn.Module):
    """``encoder`` = GFE (shared), ``csfe``, ``generator``, ``q``, ``head`` (personal), and
    ``adam`` (personal, with ``keep_adam_state``): the optimizer state kept across rounds.

    ``forward`` is the inference rule: head([GFE(x), mean(CSFE(x))]) on the unmasked image.
    """

    adam: AdamMoments | None

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, embed_dim: int = 512,
                 q_hidden: int = 128, norm: str = "batch", keep_adam_state: bool = False):
        super().__init__()
        _, h, w = input_shape
        if min(h, w) < 16:
            raise ValueError(f"FedRIR's conv extractors need images of at least 16 px, got {h}x{w}")
        self.encoder = GlobalExtractor(input_shape, embed_dim, norm)
        self.csfe = ClientSpecificExtractor(input_shape, embed_dim, norm)
        self.generator = Generator(input_shape, embed_dim)
        self.q = InfoDistillation(embed_dim, q_hidden)
        self.head = nn.Linear(2 * embed_dim, num_classes)
        self.adam = AdamMoments(list(self.named_parameters())) if keep_adam_state else None

    def features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_g, f_cs) with f_cs the CSFE mean."""
        return self.encoder(x), self.csfe(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f_g, f_cs = self.features(x)
        return self.head(torch.cat([f_g, f_cs], 1))


@register
class FedRIR(Method):
    """FedRIR: GFE parameters shared (BN statistics local); CSFE, generator, q, head personal."""

    name = "fedrir"
    summary = "masked client-specific VAE features + information distillation (CLUB bound); head on both"
    config_class = FedRIRConfig
    config: FedRIRConfig
    shared_parts = ("encoder",)
    # The authors' code copies GFE .parameters() only: BN affine shared, running stats local.
    bn_policy = "local_stats"

    def build_model(self, spec, input_shape, num_classes) -> FedRIRModel:
        # FedRIR's model is its own (MODELS.md "fedrir"): a user's encoder would be dropped
        # without a word, and its extractors and decoder are 2-D convolutions over images
        if is_plugin_arch(spec.arch):
            raise ModelSpecError(f"model.arch {spec.arch}: fedrir builds its own image extractors and decoder and "
                                 "cannot train a plugin encoder; use a method that trains model.arch (fedavg, fedrep, "
                                 "repper, ...)")
        if len(input_shape) != 3:
            raise ModelSpecError(f"fedrir's extractors take images C x H x W, and the inputs are "
                                 f"{'x'.join(map(str, input_shape))}")
        c = self.config
        return FedRIRModel(tuple(input_shape), num_classes, c.embed_dim, c.q_hidden, spec.norm,
                           keep_adam_state=c.keep_optimizer_state and c.optimizer == "adam")

    @contextmanager
    def _optimizer(self, model: FedRIRModel, params, ctx):
        """The stage's optimizer, given the state kept from earlier rounds and keeping it after."""
        c = self.config
        opt = method_optimizer(c, params, ctx)
        if model.adam is not None:
            model.adam.restore(opt, model)
        yield opt
        if model.adam is not None:
            model.adam.store(opt, model)

    def train_stage1(self, model: FedRIRModel, data, ctx, noise: torch.Generator | None = None) -> dict[str, float]:
        """Masked client-specific learning: CSFE + generator reconstruct x from its masked copy."""
        c = self.config
        if noise is None:
            noise = noise_generator(ctx, salt=1)
        kl_sum, mse_sum, n = 0.0, 0.0, 0

        def loss_fn(m, x, y):
            nonlocal kl_sum, mse_sum, n
            mean, logvar = m.csfe(mask_patches(x, c.mask_ratio, c.patch_size, noise))
            eps = torch.randn(mean.shape, generator=noise).to(mean)
            recon = m.generator(mean + eps * (0.5 * logvar).exp())
            mse, kl = F.mse_loss(recon, x), kl_standard_normal(mean, logvar)
            mse_sum += float(mse.detach()) * len(y)
            kl_sum += float(kl.detach()) * len(y)
            n += len(y)
            return mse + c.kl_weight * kl

        params = [*model.csfe.parameters(), *model.generator.parameters()]
        with self._optimizer(model, params, ctx) as opt:
            loss = fit(model, data, ctx, loss_fn, params, c.recon_epochs or ctx.train.epochs,
                       optimizer=opt, batch_size=c.batch_size)
        return {"recon_loss": loss, "recon_mse": mse_sum / n if n else math.nan,
                "recon_kl": kl_sum / n if n else math.nan}

    def train_stage2(self, model: FedRIRModel, data, ctx) -> dict[str, float]:
        """Information distillation: CSFE parameters frozen; GFE, q and head on CE + the information term.

        The whole model is in training mode, the CSFE included, as in the authors' code
        (``model.train()`` before both stages): f_cs is normalised with the batch's
        statistics and the CSFE's BatchNorm running statistics follow the unmasked images.
        ``csfe_train_mode: false`` keeps the CSFE in eval mode instead.
        """
        c = self.config
        sums = {"cls_ce": 0.0, "q_nll": 0.0, "mi_vclub": 0.0}
        n = 0
        # club_conditional fits q only before the extractor's step; the other forms also in it
        q_first = c.q_steps if c.mi == "club_conditional" else c.q_steps - 1
        params = [*model.encoder.parameters(), *model.q.parameters(), *model.head.parameters()]
        with self._optimizer(model, params, ctx) as opt:

            def loss_fn(m, x, y):
                nonlocal n
                m.csfe.train(c.csfe_train_mode)  # fit() put the whole model in training mode
                with torch.no_grad():
                    f_cs = m.csfe(x)[0]
                f_g = m.encoder(x)
                f_info = F.normalize(f_g, dim=1) if c.mi_normalize else f_g
                if q_first:
                    fit_q(m.q, opt, f_info, f_cs, c.mi, q_first)
                ce = F.cross_entropy(m.head(torch.cat([f_g, f_cs], 1)), y)
                info, nll, mi = information_term(m.q, f_info, f_cs, c.mi, c.mi_clamp)
                sums["cls_ce"] += float(ce.detach()) * len(y)
                sums["q_nll"] += float(nll.detach()) * len(y)
                sums["mi_vclub"] += float(mi.detach()) * len(y)
                n += len(y)
                return ce + c.mi_weight * info

            loss = fit(model, data, ctx, loss_fn, params, c.cls_epochs or ctx.train.epochs,
                       optimizer=opt, batch_size=c.batch_size)
        out = {k: v / n if n else math.nan for k, v in sums.items()}
        out["cls_loss"] = loss
        return out

    def local_update(self, model: nn.Module, data, ctx) -> LocalResult:
        rir = model_as(model, FedRIRModel)
        s1 = self.train_stage1(rir, data, ctx)
        s2 = self.train_stage2(rir, data, ctx)
        # UpdateMeta.extra carries floats only: the information term's form as its index in MI_MODES
        metrics = {**s1, **s2, "mi_mode": float(MI_MODES.index(self.config.mi))}
        return LocalResult(upload=self.shared_params(model), train_loss=s2["cls_loss"], metrics=metrics)

    def device_head(self, model: nn.Module) -> None:
        """None: the personal head needs the personal CSFE's features, not only the shared GFE's.

        Head-tier devices fit ``head_kinds`` (lr / svm / mlp) on the exported GFE features.
        """
        return None
