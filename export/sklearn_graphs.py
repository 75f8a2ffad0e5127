"""The generic heads' fitted pipelines as plain ONNX graphs, written with ``onnx.helper``.

A generic head (:mod:`edgepfl.heads.estimators`) is an optional L2 ``Normalizer`` and one
of three classifiers; each step has one emitter below, in a table keyed by the step's
class, and every emitter reads only the step's learned attributes (``coef_``,
``intercept_``, ``coefs_`` …). Why not skl2onnx: a head device fits its head in a short
child process beside the resident agent, and skl2onnx's import alone is 23 MiB of that
child's 112 MiB of anonymous memory, the difference between a device that installs a
release under a 150 MB cap and one the kernel kills (docs/BENCHMARKS.md, "A whole head
device in 150 MB"). The graphs use only standard operators of the default domain at the
opset the caller names (no ``ai.onnx.ml`` domain), so they fuse with an encoder of that opset.

The outputs follow :mod:`edgepfl.export.heads`' contract: ``probabilities`` float32
``(N, K)`` exactly as the estimator's ``predict_proba`` computes them (the SVM's softmax of
its scores, binary problems as scikit-learn spells them), and ``label`` int64 ``(N,)``, the
class of the first largest probability (numpy's ``argmax``). ``tests/unit/heads`` compares
them with scikit-learn's own predictions for every kind, binary and multiclass.

Imports numpy and onnx only; the estimators are read, never imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from edgepfl.heads.estimators import SklearnHead


class _Graph:
    """A growing list of nodes and initializers with fresh names."""

    def __init__(self, input_name: str, opset: int):
        self.opset = opset
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.current = input_name
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def constant(self, stem: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], stem: str, **attrs) -> str:
        from onnx import helper

        out = self.name(stem)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def affine(self, x: str, weights: np.ndarray, bias: np.ndarray, stem: str) -> str:
        """``x @ weights + bias`` in float32 (``weights``: (d_in, d_out))."""
        w = self.constant(f"{stem}_w", np.asarray(weights, np.float32))
        b = self.constant(f"{stem}_b", np.asarray(bias, np.float32).reshape(-1))
        return self.node("Gemm", [x, w, b], stem)


def _l2_normalizer(g: _Graph, step) -> str:
    """``Normalizer(norm="l2")``: each row over its Euclidean norm, a zero row left as it is."""
    if step.norm != "l2":
        raise TypeError(f"cannot export a Normalizer with norm={step.norm!r} (the heads use 'l2')")
    x = g.current
    if g.opset >= 18:  # the reduction's axes became an input in opset 18
        norm = g.node("ReduceL2", [x, g.constant("axis", np.array([1], np.int64))], "norm", keepdims=1)
    else:
        norm = g.node("ReduceL2", [x], "norm", axes=[1], keepdims=1)
    zero = g.node("Equal", [norm, g.constant("zero", np.array(0.0, np.float32))], "is_zero")
    safe = g.node("Where", [zero, g.constant("one", np.array(1.0, np.float32)), norm], "safe_norm")
    return g.node("Div", [x, safe], "normalized")


def _two_columns(g: _Graph, score: str, probability: bool) -> str:
    """A binary problem's one score per row as two columns: ``[1 - p, p]`` for a
    probability, ``[-s, s]`` for a score (as :class:`~edgepfl.heads.estimators.SVMHead`)."""
    if probability:
        other = g.node("Sub", [g.constant("one", np.array(1.0, np.float32)), score], "p0")
        return g.node("Concat", [other, score], "p01", axis=1)
    return g.node("Concat", [g.node("Neg", [score], "neg"), score], "s01", axis=1)


def _logistic_regression(g: _Graph, step) -> str:
    """``LogisticRegression``: softmax of the scores (multinomial), binary ``expit``."""
    scores = g.affine(g.current, step.coef_.T, step.intercept_, "lr")
    if step.coef_.shape[0] == 1:
        return _two_columns(g, g.node("Sigmoid", [scores], "p1"), probability=True)
    return g.node("Softmax", [scores], "proba", axis=1)


def _linear_svc(g: _Graph, step) -> str:
    """``LinearSVC``: softmax of the one-vs-rest scores, binary ``[-s, s]``."""
    scores = g.affine(g.current, step.coef_.T, step.intercept_, "svm")
    if step.coef_.shape[0] == 1:
        scores = _two_columns(g, scores, probability=False)
    return g.node("Softmax", [scores], "proba", axis=1)


_ACTIVATIONS = {"relu": "Relu", "tanh": "Tanh", "logistic": "Sigmoid"}


def _mlp(g: _Graph, step) -> str:
    """``MLPClassifier``: hidden layers with their activation, then softmax (binary: logistic)."""
    x = g.current
    last = len(step.coefs_) - 1
    for i, (w, b) in enumerate(zip(step.coefs_, step.intercepts_, strict=True)):
        x = g.affine(x, w, b, f"layer{i}")
        if i < last:
            if step.activation == "identity":
                continue
            if step.activation not in _ACTIVATIONS:
                raise TypeError(f"cannot export an MLP with activation {step.activation!r}")
            x = g.node(_ACTIVATIONS[step.activation], [x], f"act{i}")
    if step.out_activation_ == "logistic":
        return _two_columns(g, g.node("Sigmoid", [x], "p1"), probability=True)
    if step.out_activation_ != "softmax":
        raise TypeError(f"cannot export an MLP whose output is {step.out_activation_!r}")
    return g.node("Softmax", [x], "proba", axis=1)


#: one emitter per pipeline step, by the step's class name: (graph, step) -> the step's output
STEP_EMITTERS: dict[str, Callable[[_Graph, Any], str]] = {
    "Normalizer": _l2_normalizer,
    "LogisticRegression": _logistic_regression,
    "LinearSVC": _linear_svc,
    "MLPClassifier": _mlp,
}


def sklearn_head_graph(head: SklearnHead, feature_dim: int, input_name: str, label_name: str, proba_name: str,
                       opset: int):
    """The fitted ``head``'s pipeline as an ``onnx.ModelProto`` of ``opset`` (input ``input_name``
    float32 ``(N, feature_dim)``; outputs ``label_name`` int64 and ``proba_name`` float32).
    Raises ``TypeError`` for a step or a setting no emitter covers, or labels that are not integers."""
    from onnx import TensorProto, helper

    classes = np.asarray(head.classes_)
    if classes.dtype.kind not in "iub":
        raise TypeError(f"a head's labels are integers; got {classes.dtype} labels")
    g = _Graph(input_name, opset)
    for _, step in head.pipeline_.steps:
        emit = STEP_EMITTERS.get(type(step).__name__)
        if emit is None:
            raise TypeError(f"cannot export a {type(step).__name__} step to ONNX")
        g.current = emit(g, step)
    k = len(classes)
    g.nodes.append(helper.make_node("Identity", [g.current], [proba_name]))
    index = g.node("ArgMax", [proba_name], "index", axis=1, keepdims=0)
    g.nodes.append(helper.make_node("Gather", [g.constant("classes", classes.astype(np.int64)), index],
                                    [label_name], axis=0))
    graph = helper.make_graph(
        g.nodes, f"edgepfl_{head.kind}_head",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [None, feature_dim])],
        [helper.make_tensor_value_info(label_name, TensorProto.INT64, [None]),
         helper.make_tensor_value_info(proba_name, TensorProto.FLOAT, [None, k])],
        g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="edgepfl")


__all__ = ["STEP_EMITTERS", "sklearn_head_graph"]
