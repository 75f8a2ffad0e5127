"""The head contract, as a check anyone can run: edgepfl's own suite and a plugin method's tests.

A head belongs to its method: ``Method.head_kinds`` lists what a device may fit on the
method's frozen encoder (the generic kinds of :mod:`edgepfl.heads`, and at most one of the
method's own, named as the method) and ``Method.make_head`` builds it. So a plugin method
brings its heads with it, and :func:`check_method_heads` checks each the way a head-tier
device uses it: built by the method, fitted on synthetic features, exported to ONNX, and
onnxruntime's probabilities and labels are the estimator's. It lives with the head exporter
it drives (the export app; ``edgepfl.testing`` is core and imports no app)::

    from edgepfl.export.head_contract import check_method_heads

    def test_my_methods_heads_fit_and_export(tmp_path):
        check_method_heads(MyMethod, tmp_path)

tests/contract/test_head_contract.py runs the same check over every registered method.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.heads import GENERIC_HEAD_KINDS, HeadRelease
from edgepfl.methods import Method
from edgepfl.testing.method_contract import method_class, new_method

FEATURE_DIM = 12
NUM_CLASSES = 3


def synthetic_features(seed: int = 0, n: int = 90) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian clusters in feature space; labels are class indices 0..2."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(NUM_CLASSES, FEATURE_DIM)) * 2
    y = np.arange(n) % NUM_CLASSES
    x = centers[y] + rng.normal(size=(n, FEATURE_DIM))
    return x.astype(np.float32), y.astype(np.int64)


def synthetic_release(method: Method, folder: Path) -> HeadRelease:
    """A release of ``method`` as a device sees it, global heads included.

    Global heads are what the exporter writes: the shared parameters outside the
    encoder, here of a freshly built model on features (their values do not matter).
    """
    from edgepfl.atomic import write_tensors
    from edgepfl.specs import ModelSpec

    model = method.build_model(ModelSpec(arch="identity"), (FEATURE_DIM,), NUM_CLASSES)
    encoder = method.encoder_module(model)
    prefix = next(n for n, m in model.named_modules() if m is encoder)
    shared = method.shared_params(model)
    glob = {k: v for k, v in shared.items() if not (k == prefix or k.startswith(prefix + "."))}
    path = Path(folder) / "global_heads.safetensors"
    write_tensors(path, glob)
    return HeadRelease(method.name, {}, path)


def check_head_vocabulary(method: type[Method] | str) -> None:
    """A method offers generic heads and at most its own (named as the method), never another method's."""
    cls = method_class(method)
    kinds = cls.head_kinds
    assert kinds, f"{cls.name}: head_kinds is empty: a head-tier device could fit nothing on its encoder"
    assert set(kinds) - set(GENERIC_HEAD_KINDS) <= {cls.name}, \
        f"{cls.name}: head kinds {sorted(set(kinds) - set(GENERIC_HEAD_KINDS))} are neither generic nor its own"


def check_head_fits_and_exports(method: type[Method] | str, kind: str, folder: Path,
                                options: Mapping[str, Any] | None = None) -> None:
    """Head ``kind`` of ``method`` fits on synthetic features, exports to ONNX (in ``folder``) and
    onnxruntime's probabilities (within 1e-4) and labels are the estimator's."""
    from .heads import OnnxHead, head_to_onnx, make_session

    instance = new_method(method, options)
    name = instance.name
    # generic heads need nothing of the release; a method's own head needs its global heads
    release = synthetic_release(instance, folder) if kind == name else HeadRelease(name)
    head = instance.make_head(kind, release)
    assert head.kind == kind, f"{name}: make_head({kind!r}) built a {head.kind!r} head"
    x, y = synthetic_features()
    head.fit(x, y)
    path = Path(folder) / f"head-{kind}.onnx"
    head_to_onnx(head, FEATURE_DIM, path)
    served = OnnxHead.load(path)
    assert served.head_kind_ == kind and served.n_features_in_ == FEATURE_DIM, \
        f"{name}/{kind}: the ONNX head says kind {served.head_kind_!r} on {served.n_features_in_} features"
    np.testing.assert_array_equal(served.classes_, head.classes_, err_msg=f"{name}/{kind}: classes")
    x_new, _ = synthetic_features(seed=1, n=40)
    probe = np.concatenate([x, x_new])
    gap = np.abs(served.predict_proba(probe) - head.predict_proba(probe)).max()
    assert gap <= 1e-4, f"{name}/{kind}: onnxruntime's probabilities differ from the estimator's by {gap:.3g}"
    labels = make_session(path).run(["label"], {"features": probe})[0]
    np.testing.assert_array_equal(labels, head.predict(probe), err_msg=f"{name}/{kind}: onnxruntime's labels")


def check_method_heads(method: type[Method] | str, folder: Path, options: Mapping[str, Any] | None = None) -> None:
    """Every head ``method`` offers through the head contract (:func:`check_head_vocabulary`,
    :func:`check_head_fits_and_exports` for each of its ``head_kinds``); files go to ``folder``."""
    check_head_vocabulary(method)
    for kind in method_class(method).head_kinds:
        check_head_fits_and_exports(method, kind, folder, options)
