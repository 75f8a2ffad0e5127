"""The generic heads' graphs, written without skl2onnx (``export/sklearn_graphs.py``), give
what scikit-learn's own ``predict_proba`` and ``predict`` give, run by onnxruntime: every
kind, binary and multiclass, with and without the L2 normalizer, a zero row, deeper MLPs."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.export.heads import HEAD_INPUT, OUT_LABEL, OUT_PROBA, OnnxHead, head_to_onnx, make_session
from edgepfl.export.sklearn_graphs import STEP_EMITTERS, sklearn_head_graph
from edgepfl.heads.estimators import LRHead, MLPHead, SVMHead


def _data(classes: int, rows: int = 240, dim: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2, size=(classes, dim))
    y = rng.integers(0, classes, rows)
    x = (centres[y] + rng.normal(size=(rows, dim))).astype(np.float32)
    labels = np.array([3, 7, 11, 20, 42])[:classes]  # labels need not be 0..K-1
    return x, labels[y]


HEADS = {
    "lr": lambda normalize: LRHead(C=1.0, normalize=normalize),
    "svm": lambda normalize: SVMHead(C=1.0, normalize=normalize),
    "mlp": lambda normalize: MLPHead(hidden_layer_sizes=(16, 8), max_iter=300, normalize=normalize),
}


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("classes", [2, 5])
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_the_graph_computes_what_the_estimator_computes(kind, classes, normalize, tmp_path):
    x, y = _data(classes)
    head = HEADS[kind](normalize).fit(x, y)
    probe = np.concatenate([x, np.zeros((1, x.shape[1]), np.float32), 50 * x[:3]])  # a zero row, large rows
    head_to_onnx(head, x.shape[1], tmp_path / "h.onnx")
    onnx_head = OnnxHead.load(tmp_path / "h.onnx")
    assert np.abs(onnx_head.predict_proba(probe) - head.predict_proba(probe)).max() <= 1e-5
    label, proba = make_session(tmp_path / "h.onnx").run([OUT_LABEL, OUT_PROBA], {HEAD_INPUT: probe})
    np.testing.assert_array_equal(label, head.predict(probe))
    assert label.dtype == np.int64 and proba.shape == (len(probe), classes)


def test_the_graphs_use_the_default_domain_only_and_either_form_of_the_reduction(tmp_path):
    """No ai.onnx.ml operators (any runtime with the standard ones runs a head); opset 18 takes
    the normalizer's axes as an input, 17 as an attribute: both run and agree."""
    import onnx

    x, y = _data(4)
    head = LRHead(C=1.0, normalize=True).fit(x, y)
    out = {}
    for opset in (17, 18):
        model = sklearn_head_graph(head, x.shape[1], HEAD_INPUT, OUT_LABEL, OUT_PROBA, opset)
        onnx.checker.check_model(model)
        assert {op.domain for op in model.opset_import} == {""} and {n.domain for n in model.graph.node} == {""}
        out[opset] = make_session(model.SerializeToString()).run([OUT_PROBA], {HEAD_INPUT: x})[0]
    np.testing.assert_allclose(out[17], out[18], atol=1e-6)
    np.testing.assert_allclose(out[17], head.predict_proba(x), atol=1e-5)


def test_a_step_no_emitter_covers_is_refused_by_name():
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _data(3)
    head = LRHead(C=1.0).fit(x, y)
    head.pipeline_ = Pipeline([("scale", StandardScaler().fit(x)), *head.pipeline_.steps])
    assert "StandardScaler" not in STEP_EMITTERS
    with pytest.raises(TypeError, match="cannot export a StandardScaler step"):
        sklearn_head_graph(head, x.shape[1], HEAD_INPUT, OUT_LABEL, OUT_PROBA, 17)
