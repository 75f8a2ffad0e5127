"""docs/METHODS.md's "Head estimators" is exact enough to implement: an `lr` head written
from that section alone (tests/foreign_agent/lr_head.py: numpy and scipy, no edgepfl)
matches edgepfl's own within 0.5 point on clients with one-sample classes, the case in
which a reading of the old sentence ("fewer folds when a class has fewer samples") chose
another C and cost a Node.js agent written from the documents 3.7-5.7 points."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

from edgepfl.heads import LRHead

from tests.foreign_agent import lr_head

CLIENTS = 30


def _clients(seed: int = 0):
    """Digits rows as features; per client five classes, three with 5-30 training rows and two
    with a single one, ten held-out rows of each."""
    X, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    for _ in range(CLIENTS):
        classes = rng.choice(10, 5, replace=False)
        counts = [int(rng.integers(5, 30)) for _ in range(3)] + [1, 1]
        train, test = [], []
        for label, n in zip(classes, counts):
            rows = rng.permutation(np.flatnonzero(y == label))
            train += list(rows[:n])
            test += list(rows[n:n + 10])
        yield X[train].astype(np.float32), y[train], X[test].astype(np.float32), y[test]


def test_the_text_implementation_imports_nothing_of_edgepfl():
    tree = ast.parse(Path(lr_head.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "dataclasses", "numpy", "scipy"}, imported


def test_an_lr_head_written_from_the_text_matches_edgepfls_within_half_a_point():
    ours, theirs, same_c = [], [], 0
    for X, y, X_test, y_test in _clients():
        head = LRHead().fit(X, y)
        text = lr_head.fit_lr_head(X, y)
        ours.append(np.mean(head.predict(X_test) == y_test))
        theirs.append(np.mean(lr_head.predict(text, X_test) == y_test))
        same_c += head.C_ == text.C
    gap = 100 * abs(np.mean(ours) - np.mean(theirs))
    assert gap <= 0.5, (gap, np.mean(ours), np.mean(theirs))
    assert same_c >= 0.9 * CLIENTS  # the same C on (nearly) every client: the fold rule is pinned


def test_the_text_defines_the_objective_edgepfl_minimizes():
    """At a fixed C both reach the same optimum of C · sum CE + 1/2 ||W||^2 (up to the solvers'
    tolerance) and predict alike."""
    X, y = load_digits(return_X_y=True)
    X, y = X[:400].astype(np.float32), y[:400]
    head = LRHead(C=10.0).fit(X, y)
    text = lr_head.fit_logistic(lr_head.l2_rows(X), y, 10.0)
    coef = head.pipeline_[-1].coef_
    assert np.abs(coef - text.W).max() <= 0.05 * np.abs(coef).max()
    assert np.mean(head.predict(X) == lr_head.predict(text, X)) >= 0.99


def test_the_text_states_the_stopping_rule_edgepfl_runs():
    """#54: the section used to say "largest gradient component at most 10⁻⁴" of C · sum CE +
    1/2 ||W||^2, C·n times tighter than what edgepfl computes (3.7x a device's CPU for the same
    predictions). Both now stop by the stated rule: edgepfl's solution meets it, the text's
    takes as many iterations (measured: 22/22, 45/45, 49/49 at C = 1, 10, 100 on these rows),
    and a fit to the old literal reading takes about three times as many (140 at C = 100)."""
    X, y = load_digits(return_X_y=True)
    X, y = lr_head.l2_rows(X[:400].astype(np.float32)), y[:400]
    C = 100.0
    head = LRHead(C=C).fit(X, y)
    model = head.pipeline_[-1]
    text = lr_head.fit_logistic(X, y, C)
    # edgepfl's solution: the undivided objective's gradient within 10⁻⁴ · C · n (or the tiny
    # relative decrease stopped it first, still near it)
    Y = (y[:, None] == model.classes_[None, :]).astype(np.float64)
    scores = X @ model.coef_.T + model.intercept_
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    residual = C * (p / p.sum(axis=1, keepdims=True) - Y)
    gradient = np.concatenate([(residual.T @ X + model.coef_).ravel(), residual.sum(axis=0)])
    assert np.abs(gradient).max() <= 10 * lr_head.GTOL * C * len(y), np.abs(gradient).max()
    assert abs(model.n_iter_[0] - text.n_iter) <= 2, (model.n_iter_, text.n_iter)
    old_reading = lr_head.minimize(
        lambda theta: _undivided(theta, X, Y, C), np.zeros(text.W.size + len(text.b)), jac=True,
        method="L-BFGS-B", options={"maxiter": 1000, "gtol": lr_head.GTOL})
    assert old_reading.nit >= 2 * text.n_iter, (old_reading.nit, text.n_iter)
    assert np.mean(head.predict(X) == lr_head.predict(text, X, normalized=True)) >= 0.99


def _undivided(theta: np.ndarray, X: np.ndarray, Y: np.ndarray, C: float) -> tuple[float, np.ndarray]:
    """C · sum CE + 1/2 ||W||^2 and its gradient (the old literal reading's objective)."""
    K, d = Y.shape[1], X.shape[1]
    W, b = theta[:K * d].reshape(K, d), theta[K * d:]
    scores = X @ W.T + b
    scores -= scores.max(axis=1, keepdims=True)
    log_p = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    residual = C * (np.exp(log_p) - Y)
    return (-C * float(np.sum(Y * log_p)) + 0.5 * float(np.sum(W * W)),
            np.concatenate([(residual.T @ X + W).ravel(), residual.sum(axis=0)]))
