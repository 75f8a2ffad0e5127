"""FedPAC [Xu, Tong, Huang, ICLR 2023]: feature alignment and classifier collaboration.

Body ``encoder`` (x -> d-dim feature) is shared and averaged by sample count; the
linear ``head`` is personal, but uploaded so the server can combine it with other
clients' heads. Per round, per selected client (order as in the authors' code):

1. statistics with the received model in eval mode, before training: label prior
   p(k) = n_k / n, class means mu_k, h[k] = p(k) mu_k, and
   v = (sum_k p(k) mean_{x in k} ||f(x)||^2 - sum_k p(k)^2 ||mu_k||^2) / n;
2. head phase: ``head_epochs`` of CE on the head only (SGD lr 0.1);
3. body phase: ``body_epochs`` (default ``train.epochs``) on the body only with
   CE + lam * MSE(f(x), c_y), c_y the global centroid of class y from the previous
   round (the term is off while the payload carries no centroids, i.e. in round 0;
   a class without a global centroid is pulled to its local one);
4. upload body, head, local class centroids after training, class counts, h and v.

Server: body = sample-weighted mean (the run's aggregation rule); global centroids count-weighted; for every
participant i, combination weights alpha_i = argmin a^T P a on the simplex with
P = diag(v) + D, D_jl = sum_k (h_i[k] - h_j[k]) . (h_i[k] - h_l[k]), and its new
head = sum_j alpha_ij W_j / sum_j alpha_ij. The "prototype" weighting variant sets
alpha_ij proportional to exp(-CE of head j on client i's centroids).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from . import register
from .aggregate import count_weighted_centroids, weighted_mean
from .base import (
    SERVER,
    STAT,
    ClientUpdate,
    LocalResult,
    Method,
    MethodConfig,
    ServerState,
    TensorDict,
    UpdateRejected,
    load_tensors,
    method_optimizer,
    train_override,
)
from .training import encoder_features

if TYPE_CHECKING:  # pragma: no cover
    from ..data import ClientTensors
    from .base import LocalContext

CENTROIDS = SERVER + "centroids"
CENTROID_COUNTS = SERVER + "centroid_counts"
#: where :meth:`FedPAC.receive` leaves the global centroids for the next local update;
#: a plain attribute (not a buffer) so it never enters the saved personal state
_RECEIVED = "_fedpac_centroids"


class FedPACConfig(MethodConfig):
    lam: float = Field(1.0, ge=0, description="weight of the feature-alignment MSE term (paper: lambda = 1)")
    head_lr: float = Field(0.1, gt=0, description="SGD learning rate of the head phase")
    body_lr: float = Field(0.01, gt=0, description="SGD learning rate of the body phase")
    momentum: float | None = train_override("momentum", 0.5, "SGD momentum, both phases")
    weight_decay: float | None = train_override("weight_decay", 5e-4, "SGD weight decay, both phases")
    head_epochs: int = Field(1, ge=1, description="head-only epochs per round")
    body_epochs: int | None = Field(None, ge=1, description="body-only epochs per round; default train.epochs (paper 5)")
    weighting: Literal["qp", "prototype"] = Field(
        "qp", description="head combination weights: the paper's QP, or softmax(-CE) on class centroids"
    )
    alpha_eps: float = Field(1e-3, ge=0, lt=1, description="QP weights below this are zeroed, then renormalised")
    eig_floor: float = Field(0.01, ge=0, description="a non-PSD P keeps only eigenvalues >= this")


# ---------------------------------------------------------------------- server math
def feature_statistics(features: np.ndarray, labels: np.ndarray, num_classes: int):
    """FedPAC's per-client statistics from features (n, d) and labels (n,).

    Returns ``(counts (K,), means (K, d), h (K, d), v)``: absent classes have a zero
    mean and a zero row in ``h``. Accumulates in float64.
    """
    f = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    n, d = f.shape
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    sums = np.zeros((num_classes, d))
    np.add.at(sums, y, f)
    sq = np.bincount(y, weights=(f * f).sum(1), minlength=num_classes)
    safe = np.maximum(counts, 1)
    means = sums / safe[:, None]
    p = counts / n
    h = p[:, None] * means
    v = (np.sum(p * sq / safe) - np.sum(p**2 * (means * means).sum(1))) / n
    return counts, means, h, float(v)


def collaboration_matrix(hs: np.ndarray, vs: np.ndarray, i: int) -> np.ndarray:
    """P = diag(v) + D for client ``i``; ``hs`` is (m, K, d), ``vs`` is (m,).

    D_jl = sum_k (h_i[k] - h_j[k]) . (h_i[k] - h_l[k]), the Gram matrix of the
    flattened differences to client i.
    """
    hs = np.asarray(hs, dtype=np.float64)
    u = (hs[i][None] - hs).reshape(len(hs), -1)
    return np.diag(np.asarray(vs, dtype=np.float64)) + u @ u.T


def repair_psd(p: np.ndarray, floor: float = 0.01) -> np.ndarray | None:
    """``p`` if it is positive semidefinite, else its eigen-reconstruction from the
    eigenvalues >= ``floor`` (the authors' repair); None when nothing is left.

    The PSD test allows float64 rounding (1e-12 of the largest eigenvalue's size),
    which a Gram matrix plus a diagonal can show without being indefinite.
    """
    p = 0.5 * (p + p.T)
    evals, evecs = np.linalg.eigh(p)
    tol = 1e-12 * max(1.0, float(np.abs(evals).max()))
    if evals.min() >= -tol:
        return p
    keep = evals >= floor
    if not keep.any():
        return None
    return (evecs[:, keep] * evals[keep]) @ evecs[:, keep].T


def solve_simplex_qp(p: np.ndarray) -> np.ndarray | None:
    """argmin_a a^T p a subject to a >= 0, sum a = 1, by scipy's SLSQP; None on failure.

    The matrix is rescaled first (the minimiser does not change) so the solver's
    absolute tolerances mean the same whatever the scale of the features.
    """
    from scipy.optimize import minimize

    m = len(p)
    if m == 1:
        return np.ones(1)
    scale = float(np.abs(p).max())
    if scale == 0.0:
        return np.full(m, 1.0 / m)
    q = p / scale
    res = minimize(
        lambda a: float(a @ q @ a),
        np.full(m, 1.0 / m),
        jac=lambda a: 2.0 * (q @ a),
        method="SLSQP",
        bounds=[(0.0, 1.0)] * m,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
        options={"ftol": 1e-12, "maxiter": 1000},
    )
    if not res.success or not np.all(np.isfinite(res.x)):
        return None
    a = np.clip(res.x, 0.0, None)
    return a / a.sum()


def qp_weights(hs: np.ndarray, vs: np.ndarray, i: int, *, eps: float = 1e-3, floor: float = 0.01) -> np.ndarray | None:
    """FedPAC's combination weights for client ``i``: QP on the repaired P, weights
    below ``eps`` zeroed and the rest renormalised. None: keep the local head."""
    p = repair_psd(collaboration_matrix(hs, vs, i), floor)
    if p is None:
        return None
    a = solve_simplex_qp(p)
    if a is None:
        return None
    a = np.where(a < eps, 0.0, a)
    total = a.sum()
    return a / total if total > 0 else None


def prototype_weights(heads: list[TensorDict], centroids: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """Prototype weighting: alpha_j proportional to exp(-CE_j), CE_j the mean
    cross-entropy of linear head j on this client's class centroids (present classes
    only) with their class labels. None when the client has no class centroid."""
    classes = np.flatnonzero(np.asarray(counts) > 0)
    if classes.size == 0:
        return None
    c = np.asarray(centroids, dtype=np.float64)[classes]
    ce = np.empty(len(heads))
    for j, head in enumerate(heads):
        z = c @ np.asarray(head["head.weight"], dtype=np.float64).T + np.asarray(head["head.bias"], dtype=np.float64)
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        ce[j] = -logp[np.arange(len(classes)), classes].mean()
    w = np.exp(-(ce - ce.min()))
    return w / w.sum()


def combine_heads(heads: list[TensorDict], alpha: np.ndarray) -> TensorDict:
    """sum_j alpha_j W_j / sum_j alpha_j, per head tensor, in float64, cast back."""
    return weighted_mean(heads, alpha)


# ---------------------------------------------------------------------- the method
@register
class FedPAC(Method):
    """FedPAC: see the module docstring; options in :class:`FedPACConfig`."""

    name = "fedpac"
    summary = "shared body with centroid alignment; personal heads combined by server QP weights"
    config_class = FedPACConfig
    config: FedPACConfig
    shared_parts = ("encoder",)
    upload_personal = ("head",)
    exact_uploads = ("head",)  # the server weighs the heads against each other: no rounding
    streaming = False  # the QP / prototype weights and the centroids need every update of the round

    # -------------------------------------------------------------- agent side
    def receive(self, model, payload: TensorDict, ctx) -> None:
        """Load body (and the combined head when the server has one); keep centroids."""
        load_tensors(model, {k: v for k, v in payload.items() if "/" not in k})
        if CENTROIDS in payload:
            setattr(model, _RECEIVED, (np.asarray(payload[CENTROIDS]), np.asarray(payload[CENTROID_COUNTS])))
        else:  # round 0, or a payload without centroids: alignment off
            setattr(model, _RECEIVED, None)

    def local_update(self, model, data: ClientTensors, ctx: LocalContext) -> LocalResult:
        k = data.num_classes
        feats = encoder_features(model, data.x_train).float().cpu().numpy()
        counts, means, h, v = feature_statistics(feats, data.y_train.cpu().numpy(), k)
        head_loss = self.head_phase(model, data, ctx)
        targets = alignment_targets(getattr(model, _RECEIVED, None), means)
        body_loss = self.body_phase(model, data, ctx, targets)
        after = encoder_features(model, data.x_train).float().cpu().numpy()
        _, centroids, _, _ = feature_statistics(after, data.y_train.cpu().numpy(), k)
        upload = self.shared_params(model)
        upload.update({key: val.detach().cpu().numpy().copy() for key, val in model.state_dict().items()
                       if key.startswith("head.")})
        upload[STAT + "centroids"] = centroids.astype(np.float32)
        upload[STAT + "counts"] = counts
        upload[STAT + "h"] = h.astype(np.float32)
        upload[STAT + "v"] = np.array([v], dtype=np.float32)
        return LocalResult(upload=upload, train_loss=body_loss,
                           metrics={"head_loss": head_loss, "feature_var": v,
                                    "aligned": float(targets is not None)})

    def head_phase(self, model, data, ctx) -> float:
        """Train the head alone with CE (features detached); the body is not stepped."""
        import torch.nn.functional as F

        cfg = self.config
        return _fit_sgd(model, data, ctx, lambda m, x, y: F.cross_entropy(m.head(m.encoder(x).detach()), y),
                        model.head, cfg.head_epochs, cfg.head_lr, cfg)

    def body_phase(self, model, data, ctx, targets: np.ndarray | None) -> float:
        """Train the body alone (head frozen) with CE + lam * MSE(f(x), targets[y]);
        ``targets`` None (no global centroids yet) trains on CE only."""
        import torch
        import torch.nn.functional as F

        cfg = self.config
        t = None if targets is None or cfg.lam == 0 else torch.as_tensor(
            targets, dtype=torch.float32, device=data.x_train.device)

        def loss(m, x, y):
            z = m.encoder(x)
            out = F.cross_entropy(m.head(z), y)
            if t is not None:
                out = out + cfg.lam * F.mse_loss(z, t[y])
            return out

        return _fit_sgd(model, data, ctx, loss, model.encoder, cfg.body_epochs or ctx.train.epochs, cfg.body_lr, cfg,
                        frozen=model.head)

    # -------------------------------------------------------------- server side
    def init_server(self, model) -> ServerState:
        k, d = model.head.weight.shape
        return ServerState(global_tensors=self.shared_params(model),
                           extra={"num_classes": int(k), "feature_dim": int(d)})

    def stat_shapes(self, state: ServerState) -> dict[str, tuple[int | None, ...]]:
        k, d = state.extra["num_classes"], state.extra["feature_dim"]
        return {"centroids": (k, d), "counts": (k,), "h": (k, d), "v": (1,)}

    def check_update(self, state: ServerState, update: ClientUpdate) -> None:
        super().check_update(state, update)
        k, d = state.extra["num_classes"], state.extra["feature_dim"]
        got = update.params()
        for key, shape in (("head.weight", (k, d)), ("head.bias", (k,))):
            if key not in got:
                raise UpdateRejected("wrong_tensors", f"missing {key}")
            if got[key].shape != shape:
                raise UpdateRejected("wrong_shape", f"{key}: got {list(got[key].shape)}, want {list(shape)}")

    def finish_round(self, state: ServerState, shared: TensorDict, updates: list[ClientUpdate],
                     round: int) -> ServerState:
        """Body from the round's rule (sample-weighted with ``mean``); centroids and the
        clients' combined heads from every update's statistics (hence ``streaming = False``)."""
        cfg = self.config
        ids = [u.agent_id for u in updates]
        stats = [u.stats() for u in updates]
        heads = [{key: val for key, val in u.params().items() if key.startswith("head.")} for u in updates]

        merged = dict(state.global_tensors)
        merged.update(shared)
        centroids, totals = count_weighted_centroids([s["centroids"] for s in stats], [s["counts"] for s in stats])
        merged[CENTROIDS] = centroids
        merged[CENTROID_COUNTS] = totals.astype(np.int64)

        hs = np.stack([s["h"] for s in stats])
        vs = np.array([float(s["v"].reshape(-1)[0]) for s in stats])
        client_tensors = {a: dict(t) for a, t in state.client_tensors.items()}
        alphas: dict[str, dict[str, float]] = {}
        kept_local: list[str] = []
        for i, agent in enumerate(ids):
            if cfg.weighting == "qp":
                alpha = qp_weights(hs, vs, i, eps=cfg.alpha_eps, floor=cfg.eig_floor)
            else:
                alpha = prototype_weights(heads, stats[i]["centroids"], stats[i]["counts"])
            if alpha is None:  # no usable weights: the client keeps the head it trained
                kept_local.append(agent)
                client_tensors[agent] = {key: val.copy() for key, val in heads[i].items()}
                continue
            alphas[agent] = {other: float(a) for other, a in zip(ids, alpha)}
            client_tensors[agent] = combine_heads(heads, alpha)

        extra = dict(state.extra)
        extra.update({"alphas": alphas, "alphas_round": int(round), "kept_local_head": kept_local,
                      "weighting": cfg.weighting})
        return ServerState(global_tensors=merged, client_tensors=client_tensors, extra=extra)

    def payload_for(self, state: ServerState, agent_id: str) -> TensorDict:
        payload = dict(state.global_tensors)
        payload.update(state.client_tensors.get(agent_id, {}))
        return payload


# ---------------------------------------------------------------------- helpers
def alignment_targets(received, local_means: np.ndarray) -> np.ndarray | None:
    """Per-class MSE targets (K, d): the global centroid where some client had the
    class last round, else this client's own class mean. None without centroids."""
    if received is None:
        return None
    centroids, counts = received
    have = np.asarray(counts).reshape(-1) > 0
    return np.where(have[:, None], np.asarray(centroids, dtype=np.float64), local_means)


def _fit_sgd(model, data, ctx, loss_fn, part, epochs: int, lr: float, cfg: FedPACConfig, frozen=None) -> float:
    """SGD on ``part`` only (FedPAC fixes its optimizer and each phase's lr), ``frozen`` kept out of autograd."""
    from .training import fit, freeze

    if frozen is not None:
        freeze(frozen, True)
    try:
        params = list(part.parameters())
        opt = method_optimizer(cfg, params, ctx, optimizer="sgd", lr=lr)
        return fit(model, data, ctx, loss_fn, params, epochs, optimizer=opt)
    finally:
        if frozen is not None:
            freeze(frozen, False)
