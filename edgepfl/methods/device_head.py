"""A method's own device head, fitted on frozen features, as a scikit-learn estimator.

DualFed and FedPick personalize more than a linear classifier: DualFed's projector and
personal classifier, FedPick's feature-selection module and personal classifier, each
summed with the federation's global classifier. A new client fits those personal parts
on the exported encoder's features; :class:`TorchDeviceHead` does it with the method
itself, so nothing about the method is restated here:

* the model is the method's :meth:`~edgepfl.methods.Method.build_model` on an identity
  encoder (``ModelSpec(arch="identity")``: features in, features out);
* the federation's shared parameters outside the encoder (the release's
  ``global_heads.safetensors``) are loaded into it and frozen;
* the personal parts are trained by :meth:`~edgepfl.methods.Method.train_device_head`;
* inference and ONNX export use :meth:`~edgepfl.methods.Method.device_head`.

A method offers this head under its own name (``"dualfed" in DualFed.head_kinds``) and
builds it in its ``make_head``. Torch is imported only when fitting, predicting or
exporting; importing this module needs scikit-learn, not torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn.utils.validation import check_array, check_is_fitted, check_X_y

from ..heads.estimators import HeadEstimator, softmax

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ..heads import HeadRelease
    from .base import Method


class TorchDeviceHead(HeadEstimator):
    """The device head of method ``method`` (its options ``method_options``), fitted on features.

    ``global_heads``: the federation's ``global_heads.safetensors`` (a path) or its tensors
    (name -> array). ``epochs``, ``batch_size``, ``lr``, ``momentum``, ``weight_decay``:
    SGD on the personal parts. Labels are the federation's class indices.

    Learned: ``state_`` (the fitted model's ``state_dict`` as numpy arrays), ``classes_``,
    ``n_features_in_``, ``train_loss_``.
    """

    federation_classes_only = True

    def __init__(self, method: str = "", method_options: Mapping[str, Any] | None = None, global_heads: Any = None,
                 epochs: int = 20, batch_size: int = 64, lr: float = 0.01, momentum: float = 0.5,
                 weight_decay: float = 0.0, random_state: int | None = 0):
        self.method = method
        self.method_options = method_options
        self.global_heads = global_heads
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.random_state = random_state

    @property
    def kind(self) -> str:
        """A method's own head kind is the method's name."""
        return self.method

    @classmethod
    def for_method(cls, method: Method, release: HeadRelease | None = None, **params: Any) -> TorchDeviceHead:
        """A new head of ``method`` (its options included) for an encoder ``release``.

        The federation's global heads come from ``params["global_heads"]`` or the release;
        without them there is nothing to personalize around, so this raises ``ValueError``.
        """
        if release is not None and release.method != method.name:
            raise ValueError(f"a {method.name} head needs a {method.name} encoder, "
                             f"this one is {release.method or 'of an unknown method'}")
        if params.get("global_heads") is None:
            path = release.global_heads if release is not None else None
            if path is None or not Path(path).is_file():
                where = f"{path} not found" if path is not None else "the release's global_heads.safetensors"
                raise ValueError(f"a {method.name} head needs the federation's global heads ({where})")
            params["global_heads"] = str(path)
        return cls(method=method.name, method_options=method.config.model_dump(), **params)

    # ------------------------------------------------------------ the method's model on features
    def _method(self) -> Method:
        from . import create_method

        return create_method(self.method, dict(self.method_options or {}))

    def _model(self, method: Method, feature_dim: int, num_classes: int) -> nn.Module:
        from ..specs import ModelSpec

        return method.build_model(ModelSpec(arch="identity"), (feature_dim,), num_classes)

    def _global_tensors(self) -> dict[str, np.ndarray]:
        gh = self.global_heads
        if gh is None:
            raise ValueError(f"a {self.kind} head needs the federation's global heads (global_heads.safetensors)")
        if isinstance(gh, (str, Path)):
            from ..atomic import read_tensors

            return read_tensors(gh)
        return {k: np.asarray(v) for k, v in gh.items()}

    def fit(self, X, y):
        """Fit the personal parts on features ``X`` (N, d); ``y`` are the federation's class indices."""
        import torch

        from ..data.client import ClientTensors
        from ..specs import TrainConfig
        from .base import LocalContext, load_tensors
        from .training import freeze

        X, y = check_X_y(X, y, dtype=np.float32)
        glob = self._global_tensors()
        method = self._method()
        num_classes = _num_classes(glob)
        if y.min() < 0 or y.max() >= num_classes:
            raise ValueError(f"labels must be the federation's class indices 0..{num_classes - 1}, got {y.min()}..{y.max()}")
        seed = int(self.random_state or 0)
        torch.manual_seed(seed)
        model = self._model(method, X.shape[1], num_classes)
        load_tensors(model, glob)
        for key in glob:  # the federation's classifier stays as released
            freeze(model.get_submodule(key.rpartition(".")[0]))
        y64 = y.astype(np.int64)
        data = ClientTensors(torch.from_numpy(X), torch.from_numpy(y64), torch.from_numpy(X[:0]),
                             torch.from_numpy(y64[:0]), num_classes)
        train = TrainConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
                            weight_decay=self.weight_decay, optimizer="sgd")
        ctx = LocalContext(train=train, device="cpu", round=0, seed=seed, num_classes=num_classes,
                           generator=torch.Generator().manual_seed(seed))
        self.train_loss_ = float(method.train_device_head(model, data, ctx))
        model.eval()
        self.state_ = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        self.classes_ = np.arange(num_classes)
        self.n_features_in_ = X.shape[1]
        return self

    def device_module(self) -> nn.Module:
        """The fitted head as the method's torch device head (features -> logits), in eval mode."""
        import torch

        check_is_fitted(self)
        method = self._method()
        model = self._model(method, self.n_features_in_, len(self.classes_))
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in self.state_.items()})
        model.eval()
        head = method.device_head(model)
        if head is None:
            raise ValueError(f"method {self.method!r} has no torch device head to fit on features")
        return head.eval()

    def decision_function(self, X) -> np.ndarray:
        """The method's inference rule on features: its ensemble logits (N, K)."""
        import torch

        X = check_array(X, dtype=np.float32)
        module = self.device_module()
        with torch.no_grad():
            return module(torch.from_numpy(X)).numpy()

    def predict_proba(self, X) -> np.ndarray:
        """Softmax of :meth:`decision_function`."""
        return softmax(self.decision_function(X).astype(np.float64))


def _num_classes(glob: Mapping[str, np.ndarray]) -> int:
    """Class count of the federation's classifier: the rows of its (only) 2-D weight."""
    weights = [v for k, v in glob.items() if k.endswith("weight") and np.ndim(v) == 2]
    if len(weights) != 1:
        raise ValueError(f"global heads should hold one linear classifier, got {sorted(glob)}")
    return int(weights[0].shape[0])


__all__ = ["TorchDeviceHead"]
