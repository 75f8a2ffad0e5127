"""The generic heads as scikit-learn estimators: logistic regression, linear SVM, MLP.

Each is a ``Pipeline`` of an optional L2 :class:`~sklearn.preprocessing.Normalizer`
and the classifier, fitted on feature rows (float32, ``(N, d)``). Parameters are the
constructor's (visible to ``get_params`` / ``clone``); learned attributes end in
``_``: ``pipeline_``, ``classes_``, ``n_features_in_``. ONNX export is
:func:`edgepfl.export.heads.head_to_onnx`'s business, not this module's.

Imports scikit-learn, never torch or skl2onnx.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_array, check_is_fitted, check_X_y

from . import DEFAULT_C, DEFAULT_HIDDEN, DEFAULT_MAX_ITER, DEFAULT_NORMALIZE, GENERIC_HEAD_KINDS


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

    def fit(self, X, y):
        """Fit on feature rows ``X`` (N, d) and labels ``y`` (N,)."""
        from sklearn.exceptions import ConvergenceWarning

        X, y = check_X_y(X, y, dtype=np.float32)
        if len(np.unique(y)) < 2:
            raise ValueError(f"a {self.kind} head needs training samples of at least 2 classes, got {np.unique(y).tolist()}")
        with warnings.catch_warnings():
            # a head is fitted within a fixed budget — on a device, or again at every
            # RepPer evaluation — and an unconverged fit is still a usable head; the
            # warning would only flood every agent's log
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.pipeline_ = self._pipeline().fit(X, y)
        self.classes_ = self.pipeline_.classes_
        self.n_features_in_ = X.shape[1]
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (N, len(classes_))."""
        check_is_fitted(self)
        return self.pipeline_.predict_proba(check_array(X, dtype=np.float32))


class _LinearHead(SklearnHead):
    """A linear classifier with inverse regularization ``C`` (LR and SVM share these parameters)."""

    def __init__(self, C: float = DEFAULT_C, max_iter: int = DEFAULT_MAX_ITER, normalize: bool = DEFAULT_NORMALIZE,
                 random_state: int | None = 0):
        self.C = C
        self.max_iter = max_iter
        self.normalize = normalize
        self.random_state = random_state


class LRHead(_LinearHead):
    """Multinomial logistic regression (lbfgs) on (L2-normalized) features."""

    kind = "lr"

    def _classifier(self):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=self.C, max_iter=self.max_iter, random_state=self.random_state)


class SVMHead(_LinearHead):
    """Linear SVM (one-vs-rest ``LinearSVC``) on (L2-normalized) features.

    ``LinearSVC`` has no probabilities; ``predict_proba`` is the softmax of the decision
    scores (binary: of ``[-s, s]``), so its argmax is the SVM's own prediction. Chosen over
    Platt calibration because it needs no internal cross-validation (a device may hold a
    handful of samples of a class) and converts to ONNX exactly.
    """

    kind = "svm"

    def _classifier(self):
        from sklearn.svm import LinearSVC

        return LinearSVC(C=self.C, max_iter=self.max_iter, random_state=self.random_state)

    def decision_function(self, X) -> np.ndarray:
        """Per-class scores (N, K); the binary case is expanded to ``[-s, s]``."""
        check_is_fitted(self)
        s = self.pipeline_.decision_function(check_array(X, dtype=np.float32))
        return np.stack([-s, s], axis=1) if s.ndim == 1 else s

    def predict_proba(self, X) -> np.ndarray:
        """Softmax of :meth:`decision_function`."""
        return softmax(self.decision_function(X))


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
