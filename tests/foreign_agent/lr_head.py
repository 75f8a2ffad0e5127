"""The `lr` head of docs/METHODS.md ("Head estimators: what a head agent computes"),
written from that section alone: numpy and scipy, nothing of edgepfl.

    head = fit_lr_head(features, labels)          # C chosen by the section's cross-validation
    labels = predict(head, other_features)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

C_GRID = (0.1, 1.0, 10.0, 100.0)
FOLDS = 3


@dataclass
class Head:
    classes: np.ndarray
    W: np.ndarray
    b: np.ndarray
    C: float
    n_iter: int = 0


def l2_rows(X: np.ndarray) -> np.ndarray:
    """Each row divided by its Euclidean norm (a zero row stays zero)."""
    X = np.asarray(X, np.float64)
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.where(norms == 0, 1.0, norms)


#: the section's stopping rule: on the objective divided by C·n, the largest gradient component,
#: the relative decrease of one iteration, the line-search steps per iteration
GTOL, FTOL, MAX_LINE_SEARCH = 1e-4, 64 * np.finfo(float).eps, 50


def fit_logistic(X: np.ndarray, y: np.ndarray, C: float, max_iter: int = 1000) -> Head:
    """Minimize C · sum_i -log softmax(W x_i + b)_{y_i} + 1/2 ||W||^2 (b not penalized) by L-BFGS
    from zero, on that objective divided by C·n with the section's stopping rule; ``n_iter``
    (set on the head) is the iterations it took."""
    classes = np.unique(y)
    K, d = len(classes), X.shape[1]
    Y = (y[:, None] == classes[None, :]).astype(np.float64)
    scale = 1.0 / (C * len(y))

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        W, b = theta[:K * d].reshape(K, d), theta[K * d:]
        scores = X @ W.T + b
        scores -= scores.max(axis=1, keepdims=True)
        log_p = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
        loss = -C * float(np.sum(Y * log_p)) + 0.5 * float(np.sum(W * W))
        residual = C * (np.exp(log_p) - Y)
        gradient = np.concatenate([(residual.T @ X + W).ravel(), residual.sum(axis=0)])
        return scale * loss, scale * gradient

    result = minimize(objective, np.zeros(K * d + K), jac=True, method="L-BFGS-B",
                      options={"maxiter": max_iter, "gtol": GTOL, "ftol": FTOL, "maxls": MAX_LINE_SEARCH})
    head = Head(classes, result.x[:K * d].reshape(K, d), result.x[K * d:], C)
    head.n_iter = int(result.nit)
    return head


def predict(head: Head, X: np.ndarray, normalized: bool = False) -> np.ndarray:
    """The class of the largest score (ties to the earlier class)."""
    X = X if normalized else l2_rows(X)
    return head.classes[np.argmax(X @ head.W.T + head.b, axis=1)]


def folds(y: np.ndarray, k: int) -> np.ndarray:
    """The i-th row of each class, in the rows' order, is in fold i mod k."""
    fold = np.empty(len(y), dtype=np.int64)
    for label in np.unique(y):
        rows = np.flatnonzero(y == label)
        fold[rows] = np.arange(len(rows)) % k
    return fold


def fit_lr_head(features: np.ndarray, labels: np.ndarray) -> Head:
    """The section's `lr` head with `head_C: null`: C by cross-validation, then one fit on all rows."""
    X, y = l2_rows(features), np.asarray(labels)
    if len(np.unique(y)) < 2:
        raise ValueError("a head needs training rows of at least two classes")
    k = min(FOLDS, int(np.unique(y, return_counts=True)[1].max()))
    if k < 2:
        return fit_logistic(X, y, 1.0)
    fold = folds(y, k)
    scores = np.zeros(len(C_GRID))
    for f in range(k):
        train, test = fold != f, fold == f
        for i, C in enumerate(C_GRID):
            if len(np.unique(y[train])) < 2:  # one class to learn: it is every prediction
                scores[i] += np.mean(y[test] == y[train][0])
            else:
                scores[i] += np.mean(predict(fit_logistic(X[train], y[train], C), X[test], normalized=True) == y[test])
    best = C_GRID[int(np.argmax(scores / k))]  # argmax takes the first best: ties to the smaller C
    return fit_logistic(X, y, best)
