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
