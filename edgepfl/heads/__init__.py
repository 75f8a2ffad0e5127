"""Personal heads on frozen features: one family of estimators for federation and device.

A head maps an encoder's feature vector to class probabilities. The generic kinds are
scikit-learn estimators in :mod:`edgepfl.heads.estimators`:

* ``"lr"`` — :class:`~edgepfl.heads.estimators.LRHead`, multinomial logistic regression;
* ``"svm"`` — :class:`~edgepfl.heads.estimators.SVMHead`, one-vs-rest linear SVM;
* ``"mlp"`` — :class:`~edgepfl.heads.estimators.MLPHead`, one hidden ReLU layer;

each optionally on L2-normalized features (default on); the linear kinds choose their
regularization C by cross-validation on the training rows unless it is given. The same classes, with the
same defaults, are RepPer's stage-2 heads in a federation, the heads a head-tier device
fits and the heads ``edgepfl fit-head`` fits, so an accuracy measured in one place is
the accuracy of the same estimator in the others.

Which heads fit on a given encoder is the release's method's business:
:meth:`edgepfl.methods.Method.make_head` builds them and ``Method.head_kinds`` lists
them. A method with a head of its own (DualFed, FedPick: torch modules around the
federation's global classifier) offers it under its own name; those heads live with
their method, not here. ``"onnx"`` (:data:`OFFLINE_HEAD_KIND`) is not a kind one fits: it
names a head fitted elsewhere and shipped to a device as an ONNX file.

Importing this package is cheap (no scikit-learn, no torch): method configs read the
defaults below when they are validated, on a device without torch too. The estimator
classes are imported on first use (``edgepfl.heads.LRHead`` works).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol.manifest import ReleaseManifest

#: the generic head kinds, fitted by scikit-learn (:mod:`edgepfl.heads.estimators`)
GENERIC_HEAD_KINDS: tuple[str, ...] = ("lr", "svm", "mlp")
#: a head fitted offline for exactly the installed encoder, run from its ONNX file
OFFLINE_HEAD_KIND = "onnx"


def fitting_modules(kind: str) -> tuple[str, ...]:
    """The third-party modules fitting and exporting a ``kind`` head needs: scikit-learn and
    onnx for the generic heads, torch for a method's own (DualFed's, FedPick's), none
    for an offline head (run as it is)."""
    if kind == OFFLINE_HEAD_KIND:
        return ()
    return ("sklearn", "onnx") if kind in GENERIC_HEAD_KINDS else ("torch", "onnx")

# The one set of defaults of the generic heads; RepPer's options (``head_C``,
# ``head_hidden``, ...) default to these too. A C chosen by cross-validation replaced the
# fixed C = 1 (docs/METHODS.md, "RepPer": measured effect and reasoning).
#: inverse L2 regularization of lr and svm; None: chosen by k-fold cross-validation on
#: the training rows over :data:`DEFAULT_C_GRID` (the chosen value is the head's ``C_``)
DEFAULT_C: float | None = None
#: candidate values of C when it is chosen by cross-validation, most regularized first
DEFAULT_C_GRID: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)
#: folds of that cross-validation (fewer when the data is too small for them)
DEFAULT_CV_FOLDS = 3
#: the C used when the data is too small to cross-validate (every class a single sample)
FALLBACK_C = 1.0
#: solver iteration budget of every kind (lbfgs for lr, liblinear for svm, Adam epochs for mlp)
DEFAULT_MAX_ITER = 1000
#: hidden units of the mlp head (scikit-learn's default)
DEFAULT_HIDDEN = 100
#: L2-normalize features before the classifier
DEFAULT_NORMALIZE = True


@dataclass(frozen=True)
class HeadRelease:
    """What fitting a head needs to know about the encoder release it is fitted on.

    ``method`` and ``method_options``: the method that trained the encoder and its
    options (which heads fit, and with which parameters). ``global_heads``: the
    federation's shared parameters outside the encoder (``global_heads.safetensors``)
    when they are at hand — beside an exported encoder, not on a device that received
    only the encoder over MQTT.
    """

    method: str
    method_options: Mapping[str, Any] = field(default_factory=dict)
    global_heads: Path | None = None

    @classmethod
    def from_manifest(cls, manifest: ReleaseManifest, directory: str | Path | None = None) -> HeadRelease:
        """The head's view of a release manifest; ``directory`` holds the release's files, if any.

        The only place that reads a manifest for fitting heads.
        """
        entry = manifest.global_heads
        path = Path(directory) / entry.file if directory is not None and entry is not None else None
        return cls(manifest.run.method.name, dict(manifest.run.method.options), path)


# estimator classes, imported with scikit-learn on first use
_LAZY = {name: "estimators" for name in ("HeadEstimator", "LRHead", "MLPHead", "SVMHead", "SklearnHead",
                                         "generic_head")}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DEFAULT_C", "DEFAULT_CV_FOLDS", "DEFAULT_C_GRID", "DEFAULT_HIDDEN", "DEFAULT_MAX_ITER", "DEFAULT_NORMALIZE",
    "FALLBACK_C", "GENERIC_HEAD_KINDS", "OFFLINE_HEAD_KIND", "fitting_modules",
    "HeadRelease", *sorted(_LAZY),
]
