"""Run an exported encoder and a head with onnxruntime only: ``edgepfl predict``.

::

    edgepfl predict --encoder release/encoder.onnx --head head.onnx img1.png photos/ batch.npy

Inputs are image files, directories (their images, recursively, in sorted order) or
``.npy`` arrays. Images and arrays are raw pixels, as the data package reads them
(uint8 0..255 or float in [0, 1]; shapes (N, H, W), (N, C, H, W) or (N, H, W, C)); the
encoder's ``manifest.json`` (next to it) says how to scale, normalize and resize them.
``--preprocessed`` takes ``.npy`` arrays that are already normalized float32
(N, C, H, W) model inputs. Without a manifest raw inputs cannot be normalized as in
training, so they are refused unless ``--without-manifest`` accepts that (with a warning).

Class names come from the head itself (``edgepfl.class_names`` in its metadata, written
by every head writer); a head without them (an older edgepfl's) is refused unless
``--federation-labels`` says its labels are the federation's class indices.

Torch-free: this module needs numpy, onnxruntime and (for image files) Pillow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from edgepfl.data.preprocess import IMAGE_SUFFIXES
from edgepfl.errors import InputError, OneLineParser, report
from edgepfl.protocol.manifest import ReleaseManifest, read_manifest
from edgepfl.protocol.run import PIXEL_SCALE

from .heads import OnnxHead, make_session


class OnnxEncoder:
    """An exported encoder: preprocessing from its manifest, features from onnxruntime.

    ``expected_sha256`` (default: the manifest's, for the main encoder file) is checked
    against the file's bytes before a session is opened.
    """

    def __init__(self, model: str | Path | bytes, manifest: ReleaseManifest | None = None, *,
                 threads: int | None = None, expected_sha256: str | None = None):
        import hashlib

        data = model if isinstance(model, bytes) else Path(model).read_bytes()
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise ValueError(f"encoder {model if not isinstance(model, bytes) else '<bytes>'} does not match sha256 "
                             f"{expected_sha256[:12]}…")
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.session = make_session(data, threads)
        self.manifest = manifest
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_name = self.session.get_outputs()[0].name
        shape = list(manifest.run.data.input_shape) if manifest else list(inp.shape[1:])
        if len(shape) != 3 or any(not isinstance(s, int) for s in shape):
            raise ValueError(f"encoder input shape {inp.shape} is not a fixed (N, C, H, W) and there is no manifest")
        c, h, w = shape
        self.input_shape: tuple[int, int, int] = (int(c), int(h), int(w))
        if tuple(int(s) if isinstance(s, int) else -1 for s in inp.shape[1:]) != self.input_shape:
            raise ValueError(f"encoder graph input {inp.shape} does not match the manifest's {list(self.input_shape)}")
        self.feature_dim = int(self.session.get_outputs()[0].shape[1]) if isinstance(
            self.session.get_outputs()[0].shape[1], int) else (manifest.feature_dim if manifest else 0)

    @classmethod
    def from_path(cls, encoder: str | Path, threads: int | None = None) -> OnnxEncoder:
        """An ``encoder.onnx`` with its ``manifest.json`` (if any) beside it, sha256 checked."""
        encoder = Path(encoder)
        if encoder.is_dir():
            return cls.from_dir(encoder, threads)
        manifest_path = encoder.with_name("manifest.json")
        manifest = read_manifest(manifest_path) if manifest_path.is_file() else None
        expected = None
        if manifest:  # the main encoder or a variant (int8 / fp16) listed in the same manifest
            files = [manifest.encoder, *manifest.variants.values()]
            expected = next((f.sha256 for f in files if f.file == encoder.name), None)
        return cls(encoder, manifest, threads=threads, expected_sha256=expected)

    @classmethod
    def from_dir(cls, export_dir: str | Path, threads: int | None = None) -> OnnxEncoder:
        export_dir = Path(export_dir)
        manifest = read_manifest(export_dir / "manifest.json")
        return cls(export_dir / manifest.encoder.file, manifest, threads=threads,
                   expected_sha256=manifest.encoder.sha256)

    @property
    def class_names(self) -> list[str]:
        return list(self.manifest.run.data.class_names) if self.manifest else []

    def features(self, x: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """Features (N, feature_dim) of normalized float32 inputs (N, C, H, W).

        Small batches keep onnxruntime's arena small: on a Pi, peak memory matters more
        than the last few percent of throughput (64 vs 256 saved ~27 MiB of peak RSS).
        """
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"inputs must be (N, {', '.join(map(str, self.input_shape))}), got {x.shape}")
        if len(x) == 0:
            return np.zeros((0, self.feature_dim), np.float32)
        out = [self.session.run([self.output_name], {self.input_name: np.ascontiguousarray(x[i : i + batch_size])})[0]
               for i in range(0, len(x), batch_size)]
        return np.concatenate(out)

    def preprocess(self, pixels: np.ndarray) -> np.ndarray:
        """Raw pixels (uint8 0..255 or float in [0, 1]; N,H,W / N,C,H,W / N,H,W,C) -> model inputs."""
        return preprocess_pixels(pixels, self.input_shape, self.manifest)


def preprocess_pixels(pixels: np.ndarray, input_shape: tuple[int, int, int],
                      manifest: ReleaseManifest | None) -> np.ndarray:
    """Scale, fix channels and normalize pixels as the manifest says; sizes must already match.

    Integer pixels are taken as 0..255 and multiplied by the run's ``pixel_scale``; without
    a manifest (or a normalization in it) inputs are left as scaled.
    """
    x = np.asarray(pixels)
    c, h, w = input_shape
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4:
        raise ValueError(f"pixels must be (N, H, W), (N, C, H, W) or (N, H, W, C), got {x.shape}")
    if tuple(x.shape[2:]) != (h, w):
        raise ValueError(f"images are {x.shape[2]}x{x.shape[3]}, the encoder wants {h}x{w}")
    data = manifest.run.data if manifest else None
    if x.dtype == np.uint8 or np.issubdtype(x.dtype, np.integer):
        # divided by 1 / scale (exactly 255.0 for the default): the same bits as before the scale was read
        x = x.astype(np.float32) / np.float32(1 / (data.pixel_scale if data else PIXEL_SCALE))
    else:
        x = x.astype(np.float32)
        if x.size and (x.min() < 0 or x.max() > 1):
            raise ValueError("float pixels must lie in [0, 1] (pass --preprocessed for normalized model inputs)")
    if x.shape[1] != c:
        if x.shape[1] == 3 and c == 1:  # ITU-R 601 luma, as Pillow's convert("L")
            x = (x * np.array([0.299, 0.587, 0.114], np.float32).reshape(1, 3, 1, 1)).sum(1, keepdims=True)
        elif x.shape[1] == 1 and c == 3:
            x = np.repeat(x, 3, axis=1)
        else:
            raise ValueError(f"images have {x.shape[1]} channels, the encoder wants {c}")
    norm = data.normalization if data else None
    mean = np.asarray(norm.mean if norm else [0.0] * c, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(norm.std if norm else [1.0] * c, np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((x - mean) / std, dtype=np.float32)


def load_images(paths: list[Path], input_shape: tuple[int, int, int]) -> np.ndarray:
    """Image files as uint8 pixels (N, C, H, W), converted and resized to the encoder's input."""
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit("reading image files needs Pillow: pip install pillow") from None
    c, h, w = input_shape
    mode = "L" if c == 1 else "RGB"
    out = []
    for p in paths:
        with Image.open(p) as im:
            im = im.convert(mode)
            if im.size != (w, h):
                im = im.resize((w, h), Image.Resampling.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
        out.append(a[None] if c == 1 else a.transpose(2, 0, 1))
    return np.stack(out) if out else np.zeros((0, c, h, w), np.uint8)


def collect_inputs(items: list[str], encoder: OnnxEncoder, preprocessed: bool = False) -> tuple[list[str], np.ndarray]:
    """(names, model inputs) for image files, directories and ``.npy`` files, in argument order."""
    names: list[str] = []
    batches: list[np.ndarray] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ValueError(f"{p}: no images found")
            batches.append(encoder.preprocess(load_images(files, encoder.input_shape)))
            names += [str(f) for f in files]
        elif p.suffix.lower() == ".npy":
            arr = np.load(p, allow_pickle=False)
            x = np.asarray(arr, np.float32) if preprocessed else encoder.preprocess(arr)
            if x.ndim == 3 and preprocessed:
                x = x[None]
            batches.append(x)
            names += [f"{p}[{i}]" for i in range(len(x))]
        elif p.is_file():
            batches.append(encoder.preprocess(load_images([p], encoder.input_shape)))
            names.append(str(p))
        else:
            raise ValueError(f"{p}: no such file or directory")
    if not batches:
        raise ValueError("no inputs given")
    return names, np.concatenate(batches)


def head_class_names(head: OnnxHead, encoder: OnnxEncoder, *, federation_labels: bool = False) -> list[str]:
    """Names of the head's probability columns, as the head records them.

    A head without recorded names is refused (ValueError): guessing the federation's
    names for a head fitted on a device's own folder order gives confidently wrong
    answers. ``federation_labels`` asserts that its labels are the federation's indices.
    """
    if head.class_names_ is not None:
        return list(head.class_names_)
    if not federation_labels:
        raise ValueError(f"{head.path} records no class names (fitted by an older edgepfl): refit it, or pass "
                         "--federation-labels if its labels are the federation's class indices")
    fed = encoder.class_names
    return [fed[int(c)] if 0 <= int(c) < len(fed) else str(c) for c in head.classes_]


def main_predict(args: list[str]) -> int:
    """``edgepfl predict``: print the predicted class (and its probability) per input."""
    parser = OneLineParser(prog="edgepfl predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", required=True, help="encoder.onnx (manifest.json beside it) or an export directory")
    parser.add_argument("--head", required=True, help="a head .onnx (from edgepfl fit-head or a head agent)")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, directories or .npy arrays")
    parser.add_argument("--preprocessed", action="store_true", help=".npy arrays are normalized float32 (N,C,H,W)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input instead of a table")
    parser.add_argument("--top", type=int, default=1, help="classes to show per input")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--without-manifest", action="store_true",
                        help="run an encoder that has no manifest.json: inputs are only scaled, not normalized")
    parser.add_argument("--federation-labels", action="store_true",
                        help="a head that records no class names predicts the federation's class indices")
    ns = parser.parse_args(args)
    try:
        encoder = OnnxEncoder.from_path(ns.encoder, ns.threads)
        if encoder.manifest is None and not ns.preprocessed:
            if not ns.without_manifest:
                raise ValueError(f"no manifest.json beside {ns.encoder}: inputs cannot be normalized as in training "
                                 "(pass --without-manifest to accept unnormalized inputs)")
            print(f"warning: no manifest.json beside {ns.encoder}: inputs are scaled but NOT normalized, and the "
                  "encoder's sha256 is not checked", file=sys.stderr)
        head = OnnxHead.load(ns.head, ns.threads)
        if head.n_features_in_ != encoder.feature_dim:
            raise ValueError(f"head expects {head.n_features_in_} features, encoder gives {encoder.feature_dim}")
        if head.encoder_sha256_ and head.encoder_sha256_ != encoder.sha256:
            print(f"warning: {ns.head} was fitted on another encoder (sha256 {head.encoder_sha256_[:12]}…)",
                  file=sys.stderr)
        labels = head_class_names(head, encoder, federation_labels=ns.federation_labels)
        names, x = collect_inputs(ns.inputs, encoder, ns.preprocessed)
        proba = head.predict_proba(encoder.features(x))
    except (ValueError, OSError, KeyError) as exc:
        return report(InputError(str(exc)), "predict")
    for name, row in zip(names, proba):
        ranked = top_predictions(row, head.classes_, labels, ns.top)
        if ns.json:
            print(json.dumps({"input": name, "predictions": ranked}))
        else:
            print(name + "\t" + "\t".join(f"{p['class']} {p['probability']:.3f}" for p in ranked))
    return 0


def top_predictions(probabilities: np.ndarray, classes: np.ndarray, labels: list[str], top: int = 1) -> list[dict]:
    """The ``top`` most probable classes of one input, most probable first: each its name
    (``class``), the head's label (``index``) and its probability (6 decimals) — the records
    ``predict --json`` and ``serve`` print."""
    order = np.argsort(-probabilities, kind="stable")[: max(1, top)]
    return [{"class": labels[i], "index": int(classes[i]), "probability": round(float(probabilities[i]), 6)}
            for i in order]


__all__ = ["OnnxEncoder", "collect_inputs", "head_class_names", "load_images", "main_predict", "preprocess_pixels",
           "top_predictions"]
