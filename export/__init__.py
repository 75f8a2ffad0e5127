"""ONNX export of frozen encoders, personalized heads, offline head fitting and prediction.

* :mod:`edgepfl.export.onnx_export` — :func:`export_run`: a run's encoder -> ``encoder.onnx`` +
  ``manifest.json`` (+ ``global_heads.safetensors``); needs torch.
* :mod:`edgepfl.export.heads` — fitted heads to ONNX (:func:`~edgepfl.export.heads.head_to_onnx`),
  :class:`~edgepfl.export.heads.OnnxHead` and :func:`~edgepfl.export.heads.fuse`. The heads
  themselves are :mod:`edgepfl.heads` (generic) and their methods' (``Method.make_head``).
* :mod:`edgepfl.export.fit_head` / :mod:`edgepfl.export.predict` — ``edgepfl fit-head`` and ``edgepfl predict``.
* :mod:`edgepfl.export.quantize` — int8 / fp16 encoder variants and their accuracy change.

Importing this package imports nothing heavy; names are resolved on first use so the
torch-free head tier can use the heads and the predictor without torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "export_run": "onnx_export", "export_state": "onnx_export", "load_run": "onnx_export",
    "read_release": "onnx_export", "ExportError": "onnx_export",
    "head_to_onnx": "heads", "fuse": "heads", "OnnxHead": "heads", "make_session": "heads",
    "OnnxEncoder": "predict", "main_predict": "predict", "main_fit_head": "fit_head",
    "quantize_encoder": "quantize", "accuracy_change": "quantize",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'export' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_LAZY)
