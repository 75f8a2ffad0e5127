"""DualFed's device head, written from the documents alone: docs/METHODS.md ("## DualFed" and
"Head estimators", the paragraph "A method's own device head (`dualfed`, `fedpick`)"),
docs/PROTOCOL.md §12 (the manifest's `global_heads`) and docs/schemas/release-manifest.json.
numpy, torch and safetensors; nothing of edgepfl.

    heads = load_global_heads("global_heads.safetensors")     # name -> array
    head = fit_dualfed_head(z_train, y_train, heads, num_classes=10, con_lambda=5.0, tau=0.2)
    labels = predict(head, z_test)

What the text states, and this module does:
  * g = Linear(k,256) - ReLU - BN(256) - Linear(256,k) - BN(k), u = g(z); h_p a classifier on u;
    h_s the federation's global classifier on z, loaded and never updated; the encoder is the
    identity, so z is the feature row as it comes (float32).
  * loss per mini-batch: CE(h_p(u), y) + λ·SupCon(u, y; τ), SupCon in its one-view form:
    û = u/‖u‖, s_ab = û_a·û_b/τ with the self pair removed,
    loss = mean_a −Σ_{p: y_p = y_a, p≠a} log softmax_b(s_ab)_p / |P(a)|, anchors without positives add 0.
  * SGD lr 0.01, momentum 0.5, no weight decay; 20 epochs of mini-batches of 64 rows in an order
    shuffled each epoch (the last batch may be smaller); BatchNorm in training mode during the fit
    (batch statistics, running statistics updated with momentum 0.1), evaluation mode to predict.
  * nn.Linear's default initialization (uniform ±1/√fan_in, weights and bias), BatchNorm weight 1, bias 0.
  * prediction: argmax of h_p(g(z)) + h_s(z), raw logits summed.

Where the text was not enough (each a guess, made as stated here; every one agreed with edgepfl,
and docs/METHODS.md now states them, under the device-head paragraph):
  1. Which tensors of `global_heads.safetensors` are h_s. The manifest lists `tensors: {name: shape}`
     but no document names DualFed's h_s tensors, their layout, or whether h_s has a bias. Taken:
     the unique 2-D tensor of shape [num_classes, k] is the weight (PyTorch Linear layout,
     scores = z W^T + b) and the unique 1-D tensor of shape [num_classes] the bias (none → no bias).
     A file with several such tensors is refused rather than guessed further.
  2. h_p's architecture: "personal classifier h_p on u" only. Taken: one nn.Linear(k, num_classes)
     with a bias (the nn.Linear default), over all num_classes of the run (not only the classes
     present in the training rows, unlike the `lr`/`svm`/`mlp` heads).
  3. Input scaling of z: "Common to lr, svm, mlp" L2-normalizes rows (`head_normalize`); nothing says so
     for `dualfed`, and "z is the feature row" reads as raw. Taken: raw features, no normalization,
     for both g/h_p and h_s.
  4. SupCon's mean over anchors: "mean_a ... (anchors without positives add 0)" is read as a mean over
     every row of the batch, the anchors without positives contributing 0 to the sum and counting
     in the denominator (not a mean over only the anchors that have positives).
  5. The softmax_b runs over every other row b ≠ a of the batch (the self pair removed from the
     denominator as well as from the positives).
  6. A mini-batch of a single row (n ≡ 1 mod 64): BatchNorm cannot take batch statistics of one row
     in training mode, and the text does not say what to do. Taken: such a last batch is skipped.
     With fewer than 2 training rows in all, the fit is refused.
  7. CE's reduction (taken: the mean over the batch) and the SGD momentum convention (taken: PyTorch's,
     dampening 0, no Nesterov).
  8. Which random numbers: a seed (`random_state`) is not mentioned for this head. Taken: one
     torch.Generator seeded with `seed` draws the initializations (g's layers in order, then h_p,
     each weight then bias) and each epoch's permutation. Only the statistics of the result can then
     agree with another implementation, not its numbers.
  9. The method option names of λ and τ in `run.method.options`: the text says "the run's λ and τ";
     `con_lambda` appears in METHODS.md's deviations table, τ's name appears nowhere. This module
     takes them as arguments.
 10. Ties in the argmax: "ties to the earlier class" is stated for `lr`/`svm`/`mlp`; taken here too.
 11. Training with a single class present: the `lr`/`svm`/`mlp` heads refuse it; nothing is said for
     `dualfed`. Taken: fitted anyway (h_s supplies the other classes' scores).
 12. BatchNorm eps, and whether the BN layers are affine: not stated beyond "weight 1, bias 0".
     Taken: PyTorch's defaults, eps 1e-5, affine (weight and bias trained).
 13. dtype: float32 throughout (the features are float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from safetensors.numpy import load_file

PROJ_HIDDEN = 256
LR = 0.01
MOMENTUM = 0.5
EPOCHS = 20
BATCH = 64
BN_MOMENTUM = 0.1


@dataclass
class DualFedHead:
    g: torch.nn.Sequential
    h_p: torch.nn.Linear
    h_s_weight: torch.Tensor
    h_s_bias: torch.Tensor | None
    num_classes: int


def load_global_heads(path: str) -> dict[str, np.ndarray]:
    """The release's global heads file, name -> array."""
    return dict(load_file(path))


def global_classifier(global_heads: dict[str, np.ndarray], num_classes: int, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """h_s: the unique [num_classes, k] weight and the unique [num_classes] bias (guess 1 of the docstring)."""
    weights = [name for name, a in global_heads.items() if np.shape(a) == (num_classes, k)]
    biases = [name for name, a in global_heads.items() if np.shape(a) == (num_classes,)]
    if len(weights) != 1 or len(biases) > 1:
        raise ValueError(f"cannot tell h_s among the global heads {({n: np.shape(a) for n, a in global_heads.items()})}")
    bias = np.asarray(global_heads[biases[0]], np.float32) if biases else None
    return np.asarray(global_heads[weights[0]], np.float32), bias


def _linear(fan_in: int, fan_out: int, gen: torch.Generator) -> torch.nn.Linear:
    layer = torch.nn.Linear(fan_in, fan_out)
    bound = 1.0 / float(np.sqrt(fan_in))
    with torch.no_grad():
        layer.weight.copy_(torch.empty(fan_out, fan_in).uniform_(-bound, bound, generator=gen))
        layer.bias.copy_(torch.empty(fan_out).uniform_(-bound, bound, generator=gen))
    return layer


def _bn(width: int) -> torch.nn.BatchNorm1d:
    return torch.nn.BatchNorm1d(width, momentum=BN_MOMENTUM)  # weight 1, bias 0, running mean 0 / var 1


def supcon_one_view(u: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """mean_a −Σ_{p: y_p = y_a, p≠a} log softmax_{b≠a}(û_a·û_b/τ)_p / |P(a)|; anchors without positives add 0."""
    n = u.shape[0]
    uh = u / u.norm(dim=1, keepdim=True).clamp_min(1e-12)
    s = uh @ uh.T / tau
    self_pair = torch.eye(n, dtype=torch.bool)
    s = s.masked_fill(self_pair, float("-inf"))
    log_p = s - torch.logsumexp(s, dim=1, keepdim=True)
    positive = (y[:, None] == y[None, :]) & ~self_pair
    count = positive.sum(dim=1)
    per_anchor = -(log_p.masked_fill(~positive, 0.0)).sum(dim=1) / count.clamp_min(1)
    return per_anchor.mean()


def fit_dualfed_head(z_train: np.ndarray, y_train: np.ndarray, global_heads: dict[str, np.ndarray], num_classes: int,
                     con_lambda: float, tau: float, seed: int = 0) -> DualFedHead:
    """Fit g and h_p on frozen features around the release's h_s (METHODS.md, "A method's own device head")."""
    z = torch.as_tensor(np.asarray(z_train, np.float32))
    y = torch.as_tensor(np.asarray(y_train, np.int64))
    n, k = z.shape
    if n < 2:
        raise ValueError("a DualFed head needs at least two training rows (BatchNorm batch statistics)")
    w_s, b_s = global_classifier(global_heads, num_classes, k)
    gen = torch.Generator().manual_seed(int(seed))
    g = torch.nn.Sequential(_linear(k, PROJ_HIDDEN, gen), torch.nn.ReLU(), _bn(PROJ_HIDDEN),
                            _linear(PROJ_HIDDEN, k, gen), _bn(k))
    h_p = _linear(k, num_classes, gen)
    params = list(g.parameters()) + list(h_p.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=0.0)
    g.train()
    h_p.train()
    for _ in range(EPOCHS):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, BATCH):
            idx = order[start:start + BATCH]
            if len(idx) < 2:  # guess 6: no batch statistics of one row
                continue
            u = g(z[idx])
            loss = torch.nn.functional.cross_entropy(h_p(u), y[idx]) + con_lambda * supcon_one_view(u, y[idx], tau)
            opt.zero_grad()
            loss.backward()
            opt.step()
    g.eval()
    h_p.eval()
    return DualFedHead(g, h_p, torch.as_tensor(w_s), None if b_s is None else torch.as_tensor(b_s), num_classes)


def scores(head: DualFedHead, z: np.ndarray) -> np.ndarray:
    """h_p(g(z)) + h_s(z), raw logits, BatchNorm in evaluation mode."""
    zt = torch.as_tensor(np.asarray(z, np.float32))
    head.g.eval()
    head.h_p.eval()
    with torch.no_grad():
        s_global = zt @ head.h_s_weight.T
        if head.h_s_bias is not None:
            s_global = s_global + head.h_s_bias
        return (head.h_p(head.g(zt)) + s_global).numpy()


def predict(head: DualFedHead, z: np.ndarray) -> np.ndarray:
    """The class of the largest summed logit (np.argmax: ties to the earlier class)."""
    return np.argmax(scores(head, z), axis=1)
