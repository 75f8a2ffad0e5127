"""The generic heads as scikit-learn estimators: logistic regression, linear SVM, MLP.

Each is a ``Pipeline`` of an optional L2 :class:`~sklearn.preprocessing.Normalizer`
and the classifier, fitted on feature rows (float32, ``(N, d)``). Parameters are the
constructor's (visible to ``get_params`` / ``clone``); learned attributes end in
``_``: ``pipeline_``, ``classes_``, ``n_features_in_``, ``n_iter_`` (the classifier's
solver iterations), and for lr / svm ``C_`` (with ``cv_scores_`` when C was chosen by
cross-validation, :meth:`_LinearHead.fit`). The estimators pass scikit-learn's own
estimator checks (``tests/contract/test_heads_sklearn_checks.py``, ``parametrize_with_checks``). Every
place that fits a head — RepPer's stage 2, a head-tier device, ``edgepfl fit-head`` —
calls the same ``fit``, so the same features give the same choice everywhere. ONNX export is
:func:`edgepfl.export.heads.head_to_onnx`'s business, not this module's.

Imports scikit-learn, never torch or onnx.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_array, check_is_fitted, check_X_y

from . import (
    DEFAULT_C,
    DEFAULT_C_GRID,
    DEFAULT_CV_FOLDS,
    DEFAULT_HIDDEN,
    DEFAULT_MAX_ITER,
    DEFAULT_NORMALIZE,
    FALLBACK_C,
    GENERIC_HEAD_KINDS,
)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large scores."""
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class HeadEstimator(ClassifierMixin, BaseEstimator):
    """What every head shares: a kind, and prediction as the argmax of ``predict_proba``."""

    if TYPE_CHECKING:
        # Read-only to the type checker, so a head may derive its kind from its parameters
        # (TorchDeviceHead: the method's name). At run time, the class attribute below.
        @property
        def kind(self) -> str:
            """The head kind, as in ``Method.head_kinds`` and the ONNX metadata."""
    else:
        #: the head kind, as in ``Method.head_kinds`` and the ONNX metadata; a generic head's
        #: is a class attribute, a method's own head's the method's name (TorchDeviceHead)
        kind = ""

    #: True when the head can only predict the federation's classes (it holds a global classifier)
    federation_classes_only: ClassVar[bool] = False

    def predict_proba(self, X) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def predict(self, X) -> np.ndarray:
        """Most probable class label per row."""
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(axis=1)]


class SklearnHead(HeadEstimator):
    """A scikit-learn classifier behind an optional L2 normalization, as one Pipeline."""

    def _classifier(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _pipeline(self):
        from sklearn.pipeline import Pipeline
        from sklearn.preprocessing import Normalizer

        steps = [("l2", Normalizer(norm="l2"))] if self.normalize else []
        steps.append(("clf", self._classifier()))
        return Pipeline(steps)

    def _checked(self, X, y) -> tuple[np.ndarray, np.ndarray]:
        X, y = check_X_y(X, y, dtype=np.float32)
        # labels, not values: a continuous or unknown y is refused before any fit (C's cross-validation too)
        check_classification_targets(y)
        classes = np.unique(y)
        if len(classes) < 2:
            raise ValueError(f"a {self.kind} head needs training samples of at least 2 classes, "
                             f"got one class: {classes.tolist()}")
        return X, y

    def _fit_pipeline(self, X: np.ndarray, y: np.ndarray):
        from sklearn.exceptions import ConvergenceWarning

        with warnings.catch_warnings():
            # a head is fitted within a fixed budget — on a device, or again at every
            # RepPer evaluation — and an unconverged fit is still a usable head; the
            # warning would only flood every agent's log
            warnings.simplefilter("ignore", ConvergenceWarning)
            return self._pipeline().fit(X, y)

    def fit(self, X, y):
        """Fit on feature rows ``X`` (N, d) and labels ``y`` (N,)."""
        X, y = self._checked(X, y)
        self.pipeline_ = self._fit_pipeline(X, y)
        self.classes_ = self.pipeline_.classes_
        self.n_features_in_ = X.shape[1]
        self.n_iter_ = self.pipeline_[-1].n_iter_
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (N, len(classes_))."""
        check_is_fitted(self)
        return self.pipeline_.predict_proba(check_array(X, dtype=np.float32))


class _LinearHead(SklearnHead):
    """A linear classifier with inverse regularization ``C`` (LR and SVM share these parameters).

    ``C=None`` chooses it on the training rows: ``cv``-fold stratified cross-validation
    (:func:`stratified_folds`, no shuffling) over ``C_grid``, the highest mean fold
    accuracy winning and ties going to the earlier grid value (the default grid lists the
most regularized first); then one fit on all
    rows. A rule a device runs on its own data, so it needs no validation split of its
    own. Learned: ``C_`` (the value used) and ``cv_scores_`` (mean fold accuracy per
    grid value; absent when C was given or the data too small to split, which uses
    :data:`~edgepfl.heads.FALLBACK_C`).
    """

    def __init__(self, C: float | None = DEFAULT_C, max_iter: int = DEFAULT_MAX_ITER,
                 normalize: bool = DEFAULT_NORMALIZE, random_state: int | None = 0,
                 C_grid: tuple[float, ...] = DEFAULT_C_GRID, cv: int = DEFAULT_CV_FOLDS):
        self.C = C
        self.max_iter = max_iter
        self.normalize = normalize
        self.random_state = random_state
        self.C_grid = C_grid
        self.cv = cv

    def _linear(self, C: float):  # pragma: no cover - abstract
        raise NotImplementedError

    def _classifier(self):
        return self._linear(self.C_)

    def fit(self, X, y):
        """Fit on feature rows ``X`` (N, d) and labels ``y`` (N,), choosing C first if it is None."""
        X, y = self._checked(X, y)
        if self.C is not None:
            self.C_ = float(self.C)
        else:
            self.C_, scores = self._select_C(X, y)
            if scores is not None:
                self.cv_scores_ = scores
        return super().fit(X, y)

    def _select_C(self, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray | None]:
        counts = np.unique(y, return_counts=True)[1]
        folds = min(self.cv, int(counts.max()))
        if folds < 2 or len(self.C_grid) == 0:
            return FALLBACK_C, None
        fold = stratified_folds(y, folds)
        # a class with fewer rows than folds is normal on a device: it is in some folds' test
        # parts only, which the mean over folds accounts for
        splits = [(np.flatnonzero(fold != k), np.flatnonzero(fold == k)) for k in range(folds)]
        scores = np.zeros(len(self.C_grid))
        for train, test in splits:
            classes = np.unique(y[train])
            for i, C in enumerate(self.C_grid):
                if len(classes) < 2:  # a fold without a second class predicts its one class
                    scores[i] += np.mean(y[test] == classes[0])
                    continue
                self.C_ = float(C)
                scores[i] += np.mean(self._fit_pipeline(X[train], y[train]).predict(X[test]) == y[test])
        scores /= len(splits)
        # argmax takes the first best: grid order decides ties
        return float(self.C_grid[int(np.argmax(scores))]), scores


def stratified_folds(y: np.ndarray, k: int) -> np.ndarray:
    """The fold of each row: the i-th row of a class (in the rows' order) goes to fold ``i mod k``.

    No random numbers, so an implementation in any language assigns the same folds
    (docs/METHODS.md, "Head estimators")."""
    fold = np.empty(len(y), dtype=np.int64)
    for label in np.unique(y):
        rows = np.flatnonzero(y == label)
        fold[rows] = np.arange(len(rows)) % k
    return fold


class LRHead(_LinearHead):
    """Multinomial logistic regression (lbfgs) on (L2-normalized) features."""

    kind = "lr"

    def _linear(self, C: float):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=C, max_iter=self.max_iter, random_state=self.random_state)


class SVMHead(_LinearHead):
    """Linear SVM (one-vs-rest ``LinearSVC``) on (L2-normalized) features.

    ``LinearSVC`` has no probabilities; ``predict_proba`` is the softmax of the decision
    scores (binary: of ``[-s, s]``, ``s`` the one score scikit-learn gives a binary
    problem), so its argmax is the SVM's own prediction. Chosen over
    Platt calibration because it needs no internal cross-validation (a device may hold a
    handful of samples of a class) and converts to ONNX exactly.
    """

    kind = "svm"

    def _linear(self, C: float):
        from sklearn.svm import LinearSVC

        return LinearSVC(C=C, max_iter=self.max_iter, random_state=self.random_state)

    def decision_function(self, X) -> np.ndarray:
        """Per-class scores (N, K), or for a binary problem scikit-learn's one score per
        row (N,), positive for ``classes_[1]``."""
        check_is_fitted(self)
        return self.pipeline_.decision_function(check_array(X, dtype=np.float32))

    def predict_proba(self, X) -> np.ndarray:
        """Softmax of the per-class scores: :meth:`decision_function`, a binary ``s`` as ``[-s, s]``."""
        s = self.decision_function(X)
        return softmax(np.stack([-s, s], axis=1) if s.ndim == 1 else s)


class MLPHead(SklearnHead):
    """A small MLP (ReLU, Adam) on (L2-normalized) features."""

    kind = "mlp"

    def __init__(self, hidden_layer_sizes: tuple[int, ...] = (DEFAULT_HIDDEN,), alpha: float = 1e-4,
                 learning_rate_init: float = 1e-3, max_iter: int = DEFAULT_MAX_ITER,
                 normalize: bool = DEFAULT_NORMALIZE, random_state: int | None = 0):
        self.hidden_layer_sizes = hidden_layer_sizes
        self.alpha = alpha
        self.learning_rate_init = learning_rate_init
        self.max_iter = max_iter
        self.normalize = normalize
        self.random_state = random_state

    def _classifier(self):
        from sklearn.neural_network import MLPClassifier

        return MLPClassifier(hidden_layer_sizes=tuple(self.hidden_layer_sizes), alpha=self.alpha,
                             learning_rate_init=self.learning_rate_init, max_iter=self.max_iter,
                             random_state=self.random_state)


_GENERIC: dict[str, type[SklearnHead]] = {cls.kind: cls for cls in (LRHead, SVMHead, MLPHead)}


def generic_head(kind: str, **params) -> SklearnHead:
    """A new, unfitted generic head of ``kind`` (``"lr"``, ``"svm"``, ``"mlp"``).

    Devices and methods reach heads through :meth:`edgepfl.methods.Method.make_head`,
    which knows the release's parameters; this is the family it draws from.
    """
    cls = _GENERIC.get(kind)
    if cls is None:
        raise ValueError(f"unknown generic head kind {kind!r}; choose from {', '.join(GENERIC_HEAD_KINDS)}")
    return cls(**params)


__all__ = ["HeadEstimator", "LRHead", "MLPHead", "SVMHead", "SklearnHead", "generic_head", "softmax"]
