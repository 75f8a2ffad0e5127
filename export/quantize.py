"""Smaller encoder variants and what they cost in accuracy.

* ``int8`` — onnxruntime dynamic quantization (weights int8, activations quantized on
  the fly); the usual choice for a Raspberry Pi CPU.
* ``fp16`` — weights and activations in float16 with float32 inputs / outputs kept
  (onnxruntime's own float16 converter, ``onnxruntime.transformers.float16``, since
  onnxconverter-common is not a dependency); half the file size, but most CPU kernels
  run it no faster.

:func:`accuracy_change` measures, on one client's data, the head accuracy with the
float32 encoder against each variant (head fitted on float32 features, as a device
would after a float32 release), plus the largest feature difference.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "fp16")


def quantize_encoder(src: str | Path, kind: str) -> Path:
    """Write ``encoder.<kind>.onnx`` next to ``src``; returns its path."""
    src = Path(src)
    dst = src.with_name(f"{src.stem}.{kind}{src.suffix}")
    if kind == "int8":
        _int8(src, dst)
    elif kind == "fp16":
        _fp16(src, dst)
    else:
        raise ValueError(f"unknown quantization {kind!r}; choose from {', '.join(QUANTIZATIONS)}")
    import onnx

    onnx.checker.check_model(onnx.load(str(dst)))
    return dst


def _int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = dst.with_name(f".{dst.name}.tmp")
    root = logging.getLogger()
    # onnxruntime logs a generic "consider pre-processing" advice on the root logger each call
    quiet = _DropMessage("pre-processing before quantization")
    root.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # QUInt8 weights: the CPU kernels (ConvInteger, MatMulInteger) support it everywhere
            quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QUInt8)
    finally:
        root.removeFilter(quiet)
    tmp.replace(dst)


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def _fp16(src: Path, dst: Path) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from edgepfl.atomic import write_bytes

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    _topological_sort(model.graph)  # the converter appends its input casts after their consumers
    write_bytes(dst, model.SerializeToString())


def _topological_sort(graph) -> None:
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:
            raise ValueError("graph has a cycle or an undefined input")
        for n in ready:
            ordered.append(n)
            available.update(n.output)
        pending = [n for n in pending if all(n is not r for r in ready)]
    del graph.node[:]
    graph.node.extend(ordered)


def accuracy_change(export_dir: str | Path, data, *, head: str = "lr",
                    variants: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Head accuracy on ``data``'s held-out split: float32 encoder vs each variant in the manifest.

    Returns ``{"fp32": {"accuracy": ...}, "int8": {"accuracy", "delta", "max_abs_feature_diff",
    "bytes"}, ...}``. ``data`` is a :class:`~edgepfl.data.ClientData`.
    """
    from edgepfl.heads import HeadRelease
    from edgepfl.methods import create_method

    from .predict import OnnxEncoder

    export_dir = Path(export_dir)
    base = OnnxEncoder.from_dir(export_dir)
    manifest = base.manifest
    assert manifest is not None  # from_dir opens an encoder through its directory's manifest.json
    f_train, f_test = base.features(data.x_train), base.features(data.x_test)
    release = HeadRelease.from_manifest(manifest, export_dir)
    method = create_method(release.method, release.method_options)
    fitted = method.make_head(head, release).fit(f_train, data.y_train)
    acc = float((fitted.predict(f_test) == data.y_test).mean())
    report: dict[str, Any] = {"fp32": {"accuracy": acc, "bytes": manifest.encoder.bytes}}
    for kind, entry in manifest.variants.items():
        if variants is not None and kind not in variants:
            continue
        enc = OnnxEncoder(export_dir / entry.file, manifest, expected_sha256=entry.sha256)
        g_test = enc.features(data.x_test)
        acc_v = float((fitted.predict(g_test) == data.y_test).mean())
        report[kind] = {"accuracy": acc_v, "delta": acc_v - acc, "bytes": entry.bytes,
                        "max_abs_feature_diff": float(np.abs(g_test - f_test).max())}
    return report


__all__ = ["QUANTIZATIONS", "accuracy_change", "quantize_encoder"]
