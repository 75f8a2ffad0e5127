"""Personalized heads on frozen features, as scikit-learn estimators that export to ONNX.

Every head maps a feature vector (the exported encoder's ``features`` output) to class
probabilities and follows one ONNX contract, so a device runs any of them the same way:

* input ``features``: float32 ``(N, feature_dim)``;
* outputs ``label`` (int64 ``(N,)``) and ``probabilities`` (float32 ``(N, K)``, a plain
  tensor, columns in the order of ``classes_``);
* metadata ``edgepfl.head`` (kind), ``edgepfl.classes`` (JSON list), ``edgepfl.feature_dim``
  and, when known, ``edgepfl.encoder_sha256`` (the encoder the head was fitted on).

Heads:

* :class:`SVMHead`, :class:`LRHead`, :class:`MLPHead` — RepPer's stage 2 (linear SVM,
  logistic regression, small MLP), optionally on L2-normalized features (default on).
  scikit-learn only; exported with skl2onnx.
* :class:`DualFedHead` — DualFed's projector ``g`` + personal classifier ``h_p`` fitted
  on frozen pre-projection features with CE + lambda * SupCon, plus the federation's
  global classifier ``h_s``; inference sums the raw logits.
* :class:`FedPickHead` — FedPick's PFSM (deterministic mask at inference) + personal
  classifier ``C_p`` fitted on frozen universal features, plus the federation's ``C_g``.
  Both use torch (imported inside ``fit`` only) and export with ``torch.onnx``.
* :class:`OnnxHead` — any head ``.onnx`` run with onnxruntime only: what a device without
  torch runs.

This module imports neither torch nor skl2onnx at import time.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_array, check_is_fitted, check_X_y

from edgepfl.protocol.manifest import ReleaseManifest

HEAD_INPUT = "features"
OUT_LABEL = "label"
OUT_PROBA = "probabilities"
#: the ONNX opset every exported graph targets, so encoder and head graphs can be fused
OPSET = 17
ML_OPSET = 3
META_KIND = "edgepfl.head"
META_CLASSES = "edgepfl.classes"
META_FEATURE_DIM = "edgepfl.feature_dim"
META_ENCODER_SHA = "edgepfl.encoder_sha256"

SKLEARN_HEADS = ("svm", "lr", "mlp")
TORCH_HEADS = ("dualfed", "fedpick")
HEAD_KINDS = SKLEARN_HEADS + TORCH_HEADS


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class _Head(ClassifierMixin, BaseEstimator):
    """What every head shares: prediction from ``predict_proba`` and the ONNX contract."""

    kind: ClassVar[str] = ""
    #: True when the head can only predict the federation's classes (it holds a global classifier)
    federation_classes_only: ClassVar[bool] = False

    @classmethod
    def for_release(cls, manifest: ReleaseManifest | None, export_dir: str | Path, **params) -> _Head:
        """A new head for an exported encoder (``manifest``, files in ``export_dir``)."""
        return cls(**params)

    def predict(self, X) -> np.ndarray:
        """Most probable class label per row."""
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(axis=1)]

    def _onnx_body(self, feature_dim: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def to_onnx(self, feature_dim: int, *, metadata: dict[str, str] | None = None):
        """The fitted head as an ``onnx.ModelProto`` following the module's contract."""
        check_is_fitted(self)
        if feature_dim != self.n_features_in_:
            raise ValueError(f"head was fitted on {self.n_features_in_} features, not {feature_dim}")
        model = self._onnx_body(feature_dim)
        props = {
            META_KIND: self.kind,
            META_CLASSES: json.dumps([_py(c) for c in self.classes_]),
            META_FEATURE_DIM: str(feature_dim),
        }
        props.update(metadata or {})
        _set_metadata(model, props)
        _dedupe_opsets(model)
        import onnx

        onnx.checker.check_model(model)
        return model


def _py(value):
    return value.item() if isinstance(value, np.generic) else value


# --------------------------------------------------------------------------- sklearn heads
class _SklearnHead(_Head):
    """An sklearn classifier behind an optional L2 normalization, as one Pipeline."""

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
        X, y = check_X_y(X, y, dtype=np.float32)
        if len(np.unique(y)) < 2:
            raise ValueError(f"a {self.kind} head needs training samples of at least 2 classes, got {np.unique(y).tolist()}")
        self.pipeline_ = self._pipeline().fit(X, y)
        self.classes_ = self.pipeline_.classes_
        self.n_features_in_ = X.shape[1]
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (N, len(classes_))."""
        check_is_fitted(self)
        return self.pipeline_.predict_proba(check_array(X, dtype=np.float32))

    def _skl2onnx(self, feature_dim: int, options: dict):
        from skl2onnx import to_onnx
        from skl2onnx.common.data_types import FloatTensorType

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return to_onnx(
                self.pipeline_,
                initial_types=[(HEAD_INPUT, FloatTensorType([None, feature_dim]))],
                options=options,
                target_opset={"": OPSET, "ai.onnx.ml": ML_OPSET},
            )

    def _onnx_body(self, feature_dim: int):
        # zipmap=False: probabilities as a plain (N, K) tensor rather than a list of dicts
        clf = self.pipeline_.named_steps["clf"]
        return self._skl2onnx(feature_dim, {id(clf): {"zipmap": False}})


class LRHead(_SklearnHead):
    """Multinomial logistic regression on (L2-normalized) features."""

    kind = "lr"

    def __init__(self, C: float = 10.0, max_iter: int = 2000, normalize: bool = True):
        self.C = C
        self.max_iter = max_iter
        self.normalize = normalize

    def _classifier(self):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=self.C, max_iter=self.max_iter)


class MLPHead(_SklearnHead):
    """A small MLP (ReLU, Adam) on (L2-normalized) features."""

    kind = "mlp"

    def __init__(self, hidden_layer_sizes: tuple[int, ...] = (128,), alpha: float = 1e-4, learning_rate_init: float = 1e-3,
                 max_iter: int = 300, normalize: bool = True, random_state: int | None = 0):
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

    def fit(self, X, y):
        from sklearn.exceptions import ConvergenceWarning

        # a device fits within a fixed budget; not converging to tolerance is expected
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return super().fit(X, y)


class SVMHead(_SklearnHead):
    """Linear SVM (one-vs-rest ``LinearSVC``) on (L2-normalized) features.

    ``LinearSVC`` has no probabilities; ``predict_proba`` is the softmax of the decision
    scores (binary: of ``[-s, s]``), so its argmax is the SVM's own prediction. Chosen over
    Platt calibration because it needs no internal cross-validation (a device may hold a
    handful of samples of a class) and skl2onnx converts it exactly.
    """

    kind = "svm"

    def __init__(self, C: float = 1.0, max_iter: int = 5000, normalize: bool = True, random_state: int | None = 0):
        self.C = C
        self.max_iter = max_iter
        self.normalize = normalize
        self.random_state = random_state

    def _classifier(self):
        from sklearn.svm import LinearSVC

        return LinearSVC(C=self.C, max_iter=self.max_iter, random_state=self.random_state)

    def fit(self, X, y):
        from sklearn.exceptions import ConvergenceWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return super().fit(X, y)

    def decision_function(self, X) -> np.ndarray:
        """Per-class scores (N, K); the binary case is expanded to ``[-s, s]``."""
        check_is_fitted(self)
        s = self.pipeline_.decision_function(check_array(X, dtype=np.float32))
        return np.stack([-s, s], axis=1) if s.ndim == 1 else s

    def predict_proba(self, X) -> np.ndarray:
        return _softmax(self.decision_function(X))

    def _onnx_body(self, feature_dim: int):
        from onnx import TensorProto, helper

        clf = self.pipeline_.named_steps["clf"]
        model = self._skl2onnx(feature_dim, {id(clf): {"nocl": False}})
        graph = model.graph
        # skl2onnx names the raw scores "probabilities"; rename, then append the softmax
        raw = "svm_scores"
        for node in graph.node:
            node.output[:] = [raw if o == OUT_PROBA else o for o in node.output]
        outputs = [o for o in graph.output if o.name != OUT_PROBA]
        del graph.output[:]
        graph.output.extend(outputs)
        k = len(self.classes_)
        if k == 2:
            graph.node.extend([
                helper.make_node("Neg", [raw], ["svm_neg"]),
                helper.make_node("Concat", ["svm_neg", raw], ["svm_scores2"], axis=1),
                helper.make_node("Softmax", ["svm_scores2"], [OUT_PROBA], axis=1),
            ])
        else:
            graph.node.append(helper.make_node("Softmax", [raw], [OUT_PROBA], axis=1))
        graph.output.append(helper.make_tensor_value_info(OUT_PROBA, TensorProto.FLOAT, [None, k]))
        return model


_SKLEARN_CLASSES: dict[str, type[_SklearnHead]] = {"svm": SVMHead, "lr": LRHead, "mlp": MLPHead}


# --------------------------------------------------------------------------- torch heads
class _TorchHead(_Head):
    """A method's device head trained with torch on frozen features, reusing the method itself.

    The head is the method's own model built around an identity encoder (features in,
    features out), so :meth:`~edgepfl.methods.Method.device_head`, the method's losses
    and its training loops apply unchanged; the federation's global classifier is loaded
    from ``global_heads`` and kept fixed. Torch is imported only when fitting, predicting
    or exporting.

    ``global_heads``: the federation's ``global_heads.safetensors`` (path) or its tensors
    (name -> array), as written by :func:`edgepfl.export.onnx_export.export_run`.
    ``method_options``: the method's options (the manifest's ``run.method.options``).
    """

    method_name: ClassVar[str] = ""
    federation_classes_only = True

    def __init__(self, global_heads: Any = None, method_options: dict | None = None, epochs: int = 20,
                 batch_size: int = 64, lr: float = 0.01, momentum: float = 0.5, weight_decay: float = 0.0,
                 random_state: int | None = 0):
        self.global_heads = global_heads
        self.method_options = method_options
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.random_state = random_state

    @classmethod
    def for_release(cls, manifest: ReleaseManifest | None, export_dir: str | Path, **params) -> _TorchHead:
        """A head for an exported encoder: global heads and method options from the release."""
        method = manifest.run.method if manifest else None
        if method is None or method.name != cls.method_name:
            raise ValueError(f"a {cls.kind} head needs a {cls.method_name} encoder, this one is "
                             f"{method.name if method else 'unknown (no manifest)'}")
        gh = manifest.global_heads
        path = Path(export_dir) / (gh.file if gh else "global_heads.safetensors")
        if not path.is_file():
            raise ValueError(f"a {cls.kind} head needs the federation's global heads: {path} not found")
        params.setdefault("global_heads", str(path))
        params.setdefault("method_options", dict(method.options))
        return cls(**params)

    # ------------------------------------------------------------ model around an identity encoder
    def _method(self):
        from edgepfl.methods import create_method

        return create_method(self.method_name, self.method_options or {})

    def _global_tensors(self) -> dict[str, np.ndarray]:
        gh = self.global_heads
        if gh is None:
            raise ValueError(f"a {self.kind} head needs the federation's global heads (global_heads.safetensors)")
        if isinstance(gh, (str, Path)):
            from edgepfl.atomic import read_tensors

            return read_tensors(gh)
        return {k: np.asarray(v) for k, v in gh.items()}

    def _model(self, method, feature_dim: int, num_classes: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def _train(self, method, model, data, ctx) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def fit(self, X, y):
        """Fit the personal parts on features ``X`` (N, d); labels are the federation's class indices."""
        import torch

        from edgepfl.config import TrainConfig
        from edgepfl.data.client import ClientTensors
        from edgepfl.methods.base import LocalContext, load_tensors
        from edgepfl.methods.training import freeze

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
            module_name = key.rpartition(".")[0]
            freeze(model.get_submodule(module_name))
        data = ClientTensors(torch.from_numpy(X), torch.from_numpy(y.astype(np.int64)),
                             torch.from_numpy(X[:0]), torch.from_numpy(y[:0].astype(np.int64)), num_classes)
        train = TrainConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
                            weight_decay=self.weight_decay, optimizer="sgd")
        ctx = LocalContext(train=train, device="cpu", round=0, seed=seed, num_classes=num_classes,
                           generator=torch.Generator().manual_seed(seed))
        self.train_loss_ = float(self._train(method, model, data, ctx))
        model.eval()
        self.state_ = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        self.classes_ = np.arange(num_classes)
        self.n_features_in_ = X.shape[1]
        return self

    def _device_module(self):
        import torch

        check_is_fitted(self)
        method = self._method()
        model = self._model(method, self.n_features_in_, len(self.classes_))
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in self.state_.items()})
        model.eval()
        return method.device_head(model).eval()

    def decision_function(self, X) -> np.ndarray:
        """The method's inference rule on features: ensemble logits (N, K)."""
        import torch

        X = check_array(X, dtype=np.float32)
        module = self._device_module()
        with torch.no_grad():
            return module(torch.from_numpy(X)).numpy()

    def predict_proba(self, X) -> np.ndarray:
        return _softmax(self.decision_function(X).astype(np.float64))

    def _onnx_body(self, feature_dim: int):
        import onnx
        import torch

        class WithProbabilities(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, features):
                logits = self.inner(features)
                return logits.argmax(dim=1), torch.softmax(logits, dim=1)

        module = WithProbabilities(self._device_module()).eval()
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, (torch.zeros(2, feature_dim),), buf, dynamo=False, opset_version=OPSET,
                input_names=[HEAD_INPUT], output_names=[OUT_LABEL, OUT_PROBA],
                dynamic_axes={HEAD_INPUT: {0: "batch"}, OUT_LABEL: {0: "batch"}, OUT_PROBA: {0: "batch"}},
            )
        return onnx.load_from_string(buf.getvalue())


def _num_classes(glob: dict[str, np.ndarray]) -> int:
    """Class count of the federation's classifier: the rows of its (only) 2-D weight."""
    weights = [v for k, v in glob.items() if k.endswith("weight") and np.ndim(v) == 2]
    if len(weights) != 1:
        raise ValueError(f"global heads should hold one linear classifier, got {sorted(glob)}")
    return int(weights[0].shape[0])


def _identity_encoder(feature_dim: int):
    import torch

    enc = torch.nn.Identity()
    enc.out_features = feature_dim  # what the methods read to size their heads
    return enc


class DualFedHead(_TorchHead):
    """DualFed on device: ``h_p(g(z)) + h_s(z)`` on frozen pre-projection features ``z``.

    ``fit`` runs DualFed's own stage A on the features (encoder = identity): the
    projector ``g`` and personal classifier ``h_p`` minimise
    ``CE(h_p(u), y) + lambda * SupCon(u, y; tau)`` with the method's lambda / tau; the
    federation's ``h_s`` is fixed.
    """

    kind = "dualfed"
    method_name = "dualfed"

    def _model(self, method, feature_dim: int, num_classes: int):
        from edgepfl.methods.dualfed import DualFedHead as _Module
        from edgepfl.methods.dualfed import DualFedModel

        cfg = method.config
        return DualFedModel(_identity_encoder(feature_dim), _Module(feature_dim, num_classes, cfg.proj_hidden, cfg.ensemble))

    def _train(self, method, model, data, ctx) -> float:
        return method.train_stage_a(model, data, ctx)


class FedPickHead(_TorchHead):
    """FedPick on device: ``C_g(v) + C_p(m(v) * v)`` with the deterministic PFSM mask.

    ``fit`` runs FedPick's own local update on the features (encoder = identity): PFSM,
    ``C_p`` and ``C_ir`` learn with the method's loss (Gumbel noise, straight-through
    mask); the federation's ``C_g`` is fixed.
    """

    kind = "fedpick"
    method_name = "fedpick"

    def _model(self, method, feature_dim: int, num_classes: int):
        from edgepfl.methods.fedpick import FedPickModel

        c = method.config
        return FedPickModel(_identity_encoder(feature_dim), num_classes, temperature=c.temperature,
                            threshold=c.threshold, ensemble=c.ensemble)

    def _train(self, method, model, data, ctx) -> float:
        return method.local_update(model, data, ctx).train_loss


_TORCH_CLASSES: dict[str, type[_TorchHead]] = {"dualfed": DualFedHead, "fedpick": FedPickHead}


# --------------------------------------------------------------------------- ONNX runtime head
class OnnxHead(_Head):
    """A head ``.onnx`` run with onnxruntime only (no torch, no skl2onnx): what a device runs.

    ``OnnxHead(path).fit()`` (or :meth:`load`) opens the file; there is nothing to learn,
    ``fit`` ignores ``X``/``y`` and exists so the object is a regular estimator.
    """

    kind = "onnx"

    def __init__(self, path: str | Path | None = None, threads: int | None = None):
        self.path = path
        self.threads = threads

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None) -> OnnxHead:
        return cls(path, threads).fit()

    def fit(self, X=None, y=None):
        """Open the ONNX file and read its classes and feature size from the metadata."""
        if self.path is None:
            raise ValueError("OnnxHead needs a path")
        self.session_ = make_session(Path(self.path).read_bytes(), self.threads)
        meta = self.session_.get_modelmeta().custom_metadata_map
        try:
            self.classes_ = np.asarray(json.loads(meta[META_CLASSES]))
            self.n_features_in_ = int(meta[META_FEATURE_DIM])
        except KeyError as exc:
            raise ValueError(f"{self.path} is not an edgepfl head (missing metadata {exc})") from None
        self.head_kind_ = meta.get(META_KIND, "unknown")
        self.encoder_sha256_ = meta.get(META_ENCODER_SHA)
        names = [o.name for o in self.session_.get_outputs()]
        if OUT_PROBA not in names or [i.name for i in self.session_.get_inputs()] != [HEAD_INPUT]:
            raise ValueError(f"{self.path}: expected input {HEAD_INPUT!r} and output {OUT_PROBA!r}, got {names}")
        return self

    def predict_proba(self, X) -> np.ndarray:
        check_is_fitted(self)
        X = np.ascontiguousarray(check_array(X, dtype=np.float32))
        return self.session_.run([OUT_PROBA], {HEAD_INPUT: X})[0]

    def to_onnx(self, feature_dim: int, *, metadata: dict[str, str] | None = None):
        import onnx

        check_is_fitted(self)
        model = onnx.load(str(self.path))
        if metadata:
            _set_metadata(model, metadata)
        return model


# --------------------------------------------------------------------------- functions
def head_class(kind: str) -> type[_Head]:
    """The estimator class of a head kind ("svm", "lr", "mlp", "dualfed", "fedpick")."""
    cls = _SKLEARN_CLASSES.get(kind) or _TORCH_CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"unknown head kind {kind!r}; choose from {', '.join(HEAD_KINDS)}")
    return cls


def make_head(kind: str, **params) -> _Head:
    """A new, unfitted head of ``kind`` ("svm", "lr", "mlp", "dualfed", "fedpick")."""
    return head_class(kind)(**params)


def head_to_onnx(head: _Head, feature_dim: int, path: str | Path | None = None, *,
                 metadata: dict[str, str] | None = None) -> bytes:
    """Export a fitted head to ONNX (written atomically to ``path`` when given); returns the bytes."""
    model = head.to_onnx(feature_dim, metadata=metadata)
    data = model.SerializeToString()
    if path is not None:
        from edgepfl.atomic import write_bytes

        write_bytes(path, data)
    return data


def make_session(model: bytes | str | Path, threads: int | None = None):
    """An onnxruntime CPU session; ``threads`` caps intra-op threads (small devices)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


def fuse(encoder_onnx: str | Path, head_onnx: str | Path, out: str | Path | None = None):
    """One ONNX graph ``input -> label, probabilities``: the encoder followed by the head.

    The head's graph is prefixed with ``head/`` so names cannot collide; the fused
    model keeps the head's metadata. Returns the ``ModelProto`` (written when ``out``).
    """
    import onnx
    from onnx import compose

    enc = onnx.load(str(encoder_onnx))
    head = onnx.load(str(head_onnx))
    _dedupe_opsets(enc)
    _dedupe_opsets(head)
    # merge_models refuses differing IR versions; both graphs target OPSET, so the lower one fits both
    ir = min(enc.ir_version, head.ir_version)
    enc.ir_version = head.ir_version = ir
    _align_opsets(enc, head)
    head = compose.add_prefix(head, "head/")
    fused = compose.merge_models(enc, head, io_map=[("features", "head/" + HEAD_INPUT)],
                                 outputs=["head/" + OUT_LABEL, "head/" + OUT_PROBA])
    # expose the head's outputs under their plain names (consumers inside the graph keep theirs)
    for name in (OUT_LABEL, OUT_PROBA):
        fused.graph.node.append(onnx.helper.make_node("Identity", ["head/" + name], [name]))
    for out_vi in fused.graph.output:
        out_vi.name = out_vi.name[len("head/"):]
    meta = {p.key: p.value for p in head.metadata_props}
    meta.update({"edgepfl.fused": "1"})
    _set_metadata(fused, meta)
    onnx.checker.check_model(fused)
    if out is not None:
        from edgepfl.atomic import write_bytes

        write_bytes(out, fused.SerializeToString())
    return fused


def _set_metadata(model, props: dict[str, str]) -> None:
    existing = {p.key: p for p in model.metadata_props}
    for key, value in props.items():
        if key in existing:
            existing[key].value = str(value)
        else:
            entry = model.metadata_props.add()
            entry.key, entry.value = key, str(value)


def _dedupe_opsets(model) -> None:
    """skl2onnx may list a domain twice; keep the highest version of each."""
    best: dict[str, int] = {}
    for op in model.opset_import:
        best[op.domain] = max(best.get(op.domain, 0), op.version)
    del model.opset_import[:]
    for domain, version in best.items():
        op = model.opset_import.add()
        op.domain, op.version = domain, version


def _align_opsets(a, b) -> None:
    """Give both models the same version for each shared domain (merge_models requires it)."""
    va = {o.domain: o for o in a.opset_import}
    vb = {o.domain: o for o in b.opset_import}
    for domain in set(va) & set(vb):
        if va[domain].version != vb[domain].version:
            raise ValueError(f"encoder and head use different opsets for domain {domain!r}: "
                             f"{va[domain].version} vs {vb[domain].version}; re-export with opset {OPSET}")


__all__ = [
    "HEAD_KINDS", "SKLEARN_HEADS", "TORCH_HEADS", "DualFedHead", "FedPickHead", "LRHead", "MLPHead",
    "OnnxHead", "SVMHead", "fuse", "head_class", "head_to_onnx", "make_head", "make_session",
]
