"""Heads as ONNX: export of fitted heads, the onnxruntime head, and encoder + head fusion.

The heads themselves are estimators of their own modules — the generic family in
:mod:`edgepfl.heads`, a method's own head in its method module — and a device gets them
through :meth:`edgepfl.methods.Method.make_head`. This module turns any fitted head into
one ONNX contract, so a device runs them all the same way:

* input ``features``: float32 ``(N, feature_dim)``;
* outputs ``label`` (int64 ``(N,)``) and ``probabilities`` (float32 ``(N, K)``, a plain
  tensor, columns in the order of ``classes_``);
* metadata ``edgepfl.head`` (kind), ``edgepfl.classes`` (JSON list), ``edgepfl.feature_dim``,
  ``edgepfl.class_names`` (JSON list: the name of each probability column) with
  ``edgepfl.label_space`` (``federation`` or ``local``, :mod:`edgepfl.heads.labels`) and,
  when known, ``edgepfl.encoder_sha256`` (the encoder the head was fitted on). The class
  names live here and nowhere else: whoever runs the head reads them from its file.

* :func:`head_to_onnx` — generic heads as plain ONNX graphs (:mod:`.sklearn_graphs`: the
  SVM with a softmax over its decision scores), a method's own head as the method's
  :meth:`~edgepfl.methods.Method.device_head` through ``torch.onnx``;
* :class:`OnnxHead` — any head ``.onnx`` run with onnxruntime only: what a device runs, and
  what ``edgepfl predict`` runs;
* :func:`fuse` — encoder and head as one graph; :func:`make_session` — an onnxruntime session.

Importing this module imports numpy only: scikit-learn, scipy, onnx and torch are
imported by the functions that export a head, onnxruntime by :func:`make_session`. So
inference (:class:`OnnxHead`, ``edgepfl predict``, a head agent that is not fitting) never
loads scikit-learn or scipy, 80 MB and most of a second of imports on a Pi (docs/BENCHMARKS.md;
``tests/integration/agent/test_light_runtime.py`` holds it to that). :class:`OnnxHead` is therefore
not a scikit-learn estimator, only shaped like one (``fit``, ``predict``, ``predict_proba``,
``classes_``, ``n_features_in_``).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from edgepfl.heads import OFFLINE_HEAD_KIND
from edgepfl.heads.labels import LabelSpace
from edgepfl.protocol import bounded_json

if TYPE_CHECKING:
    from edgepfl.heads.estimators import HeadEstimator

HEAD_INPUT = "features"
OUT_LABEL = "label"
OUT_PROBA = "probabilities"
#: the ONNX opset every exported graph targets, so encoder and head graphs can be fused
OPSET = 17
META_KIND = "edgepfl.head"
META_CLASSES = "edgepfl.classes"
META_FEATURE_DIM = "edgepfl.feature_dim"
META_ENCODER_SHA = "edgepfl.encoder_sha256"
META_CLASS_NAMES = "edgepfl.class_names"
META_LABEL_SPACE = "edgepfl.label_space"


# --------------------------------------------------------------------------- export
def head_model(head: HeadEstimator | OnnxHead, feature_dim: int, *, labels: LabelSpace | None = None,
               metadata: dict[str, str] | None = None):
    """A fitted head as an ``onnx.ModelProto`` following the module's contract.

    ``labels``: what the head's labels mean; every head a device or ``fit-head`` writes
    passes it, so ``edgepfl predict`` can name its classes (None only for a head whose
    names nobody will read, as in a benchmark).
    """
    import onnx

    props = dict(metadata or {})
    if isinstance(head, OnnxHead):
        head.check_opened()
        if labels is not None:
            props.update(label_metadata(labels, head.classes_))
        model = onnx.load(str(head.path))
        if props:
            _set_metadata(model, props)
        return model
    # the estimators (and with them scikit-learn) only where a head is exported
    from sklearn.utils.validation import check_is_fitted

    from edgepfl.heads.estimators import SklearnHead
    from edgepfl.methods.device_head import TorchDeviceHead

    check_is_fitted(head)
    if labels is not None:
        props.update(label_metadata(labels, head.classes_))
    if feature_dim != head.n_features_in_:
        raise ValueError(f"head was fitted on {head.n_features_in_} features, not {feature_dim}")
    if isinstance(head, SklearnHead):
        from .sklearn_graphs import sklearn_head_graph

        model = sklearn_head_graph(head, feature_dim, HEAD_INPUT, OUT_LABEL, OUT_PROBA, OPSET)
    elif isinstance(head, TorchDeviceHead):
        model = _torch_graph(head.device_module(), feature_dim)
    else:
        raise TypeError(f"cannot export a {type(head).__name__} head to ONNX")
    _set_metadata(model, {
        META_KIND: head.kind,
        META_CLASSES: json.dumps([_py(c) for c in head.classes_]),
        META_FEATURE_DIM: str(feature_dim),
        **props,
    })
    _dedupe_opsets(model)
    onnx.checker.check_model(model)
    return model


def head_to_onnx(head: HeadEstimator | OnnxHead, feature_dim: int, path: str | Path | None = None, *,
                 labels: LabelSpace | None = None, metadata: dict[str, str] | None = None) -> bytes:
    """Export a fitted head to ONNX (written atomically to ``path`` when given); returns the bytes."""
    data = head_model(head, feature_dim, labels=labels, metadata=metadata).SerializeToString()
    if path is not None:
        from edgepfl.atomic import write_bytes

        write_bytes(path, data)
    return data


def _torch_graph(module, feature_dim: int):
    """A torch head (features -> logits) with argmax and softmax appended, through ``torch.onnx``."""
    import onnx
    import torch

    class WithProbabilities(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            logits = self.inner(features)
            return logits.argmax(dim=1), torch.softmax(logits, dim=1)

    wrapped = WithProbabilities(module).eval()
    buf = io.BytesIO()
    # torch.onnx.export's hints say f is a path (str | PathLike), but the TorchScript exporter
    # (dynamo=False) writes through torch.serialization._open_file_like, which takes a buffer too
    # (onnx_proto_utils._export_file: f: io.BytesIO | str). The head graph stays in memory, no
    # temporary file; tests/unit/heads/test_heads.py's ONNX parity tests exercise this call.
    target = cast(Any, buf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped, (torch.zeros(2, feature_dim),), target, dynamo=False, opset_version=OPSET,
            input_names=[HEAD_INPUT], output_names=[OUT_LABEL, OUT_PROBA],
            dynamic_axes={HEAD_INPUT: {0: "batch"}, OUT_LABEL: {0: "batch"}, OUT_PROBA: {0: "batch"}},
        )
    return onnx.load_from_string(buf.getvalue())


def label_metadata(labels: LabelSpace, classes) -> dict[str, str]:
    """The metadata entries naming a head's probability columns (``classes``: its ``classes_``)."""
    return {META_CLASS_NAMES: json.dumps(labels.column_names(classes)), META_LABEL_SPACE: labels.kind}


def _py(value):
    return value.item() if isinstance(value, np.generic) else value


# --------------------------------------------------------------------------- runtime
class OnnxHead:
    """A head ``.onnx`` run with onnxruntime only (no scikit-learn, no torch): what a device runs.

    ``OnnxHead(path).fit()`` (or :meth:`load`) opens the file; there is nothing to learn,
    ``fit`` ignores ``X``/``y``. Shaped like the estimators it was exported from (``fit``,
    ``predict``, ``predict_proba``, ``classes_``, ``n_features_in_``) without being one:
    a scikit-learn base class would import scikit-learn and scipy into every process that
    only predicts.
    """

    kind = OFFLINE_HEAD_KIND
    #: like a generic head, an offline head may predict any label space (its file names it)
    federation_classes_only = False

    def __init__(self, path: str | Path | None = None, threads: int | None = None):
        self.path = path
        self.threads = threads

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None) -> OnnxHead:
        return cls(path, threads).fit()

    def fit(self, X=None, y=None) -> OnnxHead:
        """Open the ONNX file and read its classes and feature size from the metadata."""
        if self.path is None:
            raise ValueError("OnnxHead needs a path")
        self.session_ = make_session(Path(self.path).read_bytes(), self.threads)
        meta = self.session_.get_modelmeta().custom_metadata_map
        try:
            self.classes_ = np.asarray(bounded_json.loads(meta[META_CLASSES]))
            self.n_features_in_ = int(meta[META_FEATURE_DIM])
        except KeyError as exc:
            raise ValueError(f"{self.path} is not an edgepfl head (missing metadata {exc})") from None
        self.head_kind_ = meta.get(META_KIND, "unknown")
        self.encoder_sha256_ = meta.get(META_ENCODER_SHA)
        self.class_names_: list[str] | None = None
        self.label_space_: str | None = meta.get(META_LABEL_SPACE)
        if META_CLASS_NAMES in meta:
            names = bounded_json.loads(meta[META_CLASS_NAMES])
            if not isinstance(names, list) or len(names) != len(self.classes_):
                raise ValueError(f"{self.path}: {META_CLASS_NAMES} must name each of its {len(self.classes_)} classes")
            self.class_names_ = [str(n) for n in names]
        names = [o.name for o in self.session_.get_outputs()]
        if OUT_PROBA not in names or [i.name for i in self.session_.get_inputs()] != [HEAD_INPUT]:
            raise ValueError(f"{self.path}: expected input {HEAD_INPUT!r} and output {OUT_PROBA!r}, got {names}")
        return self

    def check_opened(self) -> None:
        """Raise ``ValueError`` unless :meth:`fit` (or :meth:`load`) opened the file."""
        if not hasattr(self, "session_"):
            raise ValueError(f"this OnnxHead is not opened yet: call fit() or OnnxHead.load({self.path!r})")

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (N, len(classes_)) from the graph's ``probabilities`` output.

        ``X``: feature rows (N, ``n_features_in_``), refused (``ValueError``) when of another
        shape or not finite, as the estimators' own input check refuses them.
        """
        self.check_opened()
        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"expected features of shape (N, {self.n_features_in_}), got {X.shape}")
        if not np.isfinite(X).all():
            raise ValueError("features contain NaN or infinity")
        return self.session_.run([OUT_PROBA], {HEAD_INPUT: X})[0]

    def predict(self, X) -> np.ndarray:
        """Most probable class label per row."""
        return self.classes_[self.predict_proba(X).argmax(axis=1)]


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
    """A graph may list a domain twice (older exporters did); keep the highest version of each."""
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
    "META_CLASS_NAMES", "META_CLASSES", "META_ENCODER_SHA", "META_FEATURE_DIM", "META_KIND", "META_LABEL_SPACE", "OPSET",
    "OnnxHead", "fuse", "head_model", "head_to_onnx", "label_metadata", "make_session",
]
