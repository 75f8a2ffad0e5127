"""Fit a personalized head for a new client offline: ``edgepfl fit-head``.

::

    edgepfl fit-head --encoder release/encoder.onnx --data my_images/ --head svm --out head.onnx

``--data`` is an image folder (``DIR/<class>/*.png``; or ``DIR/train/<class>/…`` and
``DIR/test/<class>/…`` for an explicit split) or a ``.npz`` with arrays ``x`` (raw pixels)
and ``y`` (labels), optionally ``class_names``. The encoder's manifest says how to
preprocess. ``--head`` is a kind the release's method offers (its ``head_kinds``): the
method builds the head, with its own parameters where it has them (RepPer's ``head_*``
options). Class folders named like the federation's classes keep the federation's
label indices; other names make a new task, which only the generic heads (lr, svm,
mlp) can learn. A method's own head (``dualfed``, ``fedpick``) needs the release's
``global_heads.safetensors`` next to the encoder and torch installed.

Prints train and validation accuracy; writes ``head.onnx`` (and ``--fused`` an
encoder+head graph) with the encoder's sha256 in its metadata.
"""

from __future__ import annotations

import ast
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.errors import EXTRA_OF_MODULE, InputError, MissingExtra, OneLineParser, require_installed
from edgepfl.errors import report as report_error
from edgepfl.heads import HeadRelease, fitting_modules
from edgepfl.heads.labels import FEDERATION, LOCAL, LabelSpace
from edgepfl.methods import available_head_kinds, create_method

from .heads import META_ENCODER_SHA, fuse, head_to_onnx
from .predict import OnnxEncoder


@dataclass
class Dataset:
    """A new client's data as model inputs, split into train and validation."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    class_names: list[str]  # label i is class_names[i]
    federation_classes: bool  # labels are the federation's class indices

    @property
    def labels(self) -> LabelSpace:
        """What the labels mean, as the fitted head records it."""
        return LabelSpace(tuple(self.class_names), FEDERATION if self.federation_classes else LOCAL)


def load_dataset(path: str | Path, encoder: OnnxEncoder, *, val_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """Read an image folder or ``.npz``, preprocess for ``encoder`` and split (stratified when possible)."""
    from edgepfl.config import DataSpec
    from edgepfl.data import load_imagefolder, load_pool

    path = Path(path)
    fed = encoder.class_names
    c, h, w = encoder.input_shape

    def folder(root: Path):
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        use_fed = bool(fed) and set(names) <= set(fed)
        pool = load_imagefolder(root, class_names=fed if use_fed else None, size=(w, h))
        return pool.pixels, pool.y, list(pool.class_names), use_fed

    if path.is_dir() and (path / "train").is_dir():
        px_tr, y_tr, names, use_fed = folder(path / "train")
        test_dir = path / "test" if (path / "test").is_dir() else path / "val"
        px_va, y_va, names_va, _ = folder(test_dir)
        y_va = np.array([names.index(names_va[i]) for i in y_va], np.int64)  # same label space as train
        return Dataset(encoder.preprocess(px_tr), y_tr, encoder.preprocess(px_va), y_va, names, use_fed)
    if path.is_dir():
        pixels, y, names, use_fed = folder(path)
    elif path.suffix == ".npz":
        pool = load_pool(DataSpec(dataset="npz", root=str(path)))
        pixels, y, names = pool.pixels, np.asarray(pool.y), list(pool.class_names)
        with np.load(path, allow_pickle=False) as f:
            named = "class_names" in f.files
        if named and fed and set(names) <= set(fed):
            y = np.array([fed.index(names[i]) for i in y], np.int64)  # into the federation's label space
            names, use_fed = list(fed), True
        else:
            # unnamed labels are taken as the federation's class indices
            use_fed = not named and bool(fed) and (len(y) == 0 or int(y.max()) < len(fed))
            names = list(fed) if use_fed else names
    else:
        raise ValueError(f"{path}: expected an image folder or a .npz file")
    x = encoder.preprocess(pixels)
    tr, va = _split(np.asarray(y), val_fraction, seed)
    return Dataset(x[tr], y[tr], x[va], y[va], names, use_fed)


def _split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    counts = np.bincount(y)
    stratify = y if counts[counts > 0].min() >= 2 else None
    tr, va = train_test_split(idx, test_size=fraction, random_state=seed, stratify=stratify)
    return np.sort(tr), np.sort(va)


def fit_head(encoder: OnnxEncoder, data: Dataset, kind: str, *, export_dir: str | Path | None = None,
             params: dict[str, Any] | None = None):
    """Fit a head of ``kind`` on the encoder's features of ``data``; returns (head, report).

    The head is the release's method's (:meth:`edgepfl.methods.Method.make_head`);
    ``export_dir`` holds the release's files, ``params`` override the head's parameters.
    """
    if encoder.manifest is None:
        raise ValueError("fitting a head needs the encoder's manifest.json (the method it was trained with)")
    release = HeadRelease.from_manifest(encoder.manifest, export_dir or ".")
    head = create_method(release.method, release.method_options).make_head(kind, release, **(params or {}))
    if head.federation_classes_only and not data.federation_classes:
        raise ValueError(f"a {kind} head predicts the federation's classes {encoder.class_names}; "
                         f"the data's classes {data.class_names} are not among them")
    f_train = encoder.features(data.x_train)
    f_val = encoder.features(data.x_val)
    start = time.perf_counter()
    head.fit(f_train, data.y_train)
    seconds = time.perf_counter() - start
    report = {
        "head": kind,
        "train_accuracy": float((head.predict(f_train) == data.y_train).mean()),
        "validation_accuracy": float((head.predict(f_val) == data.y_val).mean()) if len(data.y_val) else float("nan"),
        "num_train": int(len(data.y_train)),
        "num_validation": int(len(data.y_val)),
        "fit_seconds": seconds,
    }
    return head, report


def main_fit_head(args: list[str]) -> int:
    """``edgepfl fit-head``: fit, report accuracy, write the head as ONNX."""
    parser = OneLineParser(prog="edgepfl fit-head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", required=True, help="encoder.onnx from edgepfl export (manifest.json beside it)")
    parser.add_argument("--data", required=True, help="image folder or .npz of the new client")
    parser.add_argument("--head", required=True, choices=available_head_kinds(),
                        help="a head kind of the encoder's method (edgepfl methods; the manifest's head_kinds)")
    parser.add_argument("--out", required=True, help="where to write the head .onnx")
    parser.add_argument("--fused", default=None, help="also write encoder+head as one .onnx here")
    parser.add_argument("--val-fraction", type=float, default=0.25, help="held-out share when DIR has no train/test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="head parameter, e.g. --set C=0.5 --set hidden_layer_sizes=(64,)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = parser.parse_args(args)
    try:
        for module in fitting_modules(ns.head):  # before any work: the extra that is missing, by name
            require_installed(module, f"fitting a {ns.head} head")
    except MissingExtra as exc:
        return report_error(exc, "fit-head")
    try:
        params = dict(_parse_param(s) for s in ns.set)
        encoder = OnnxEncoder.from_path(ns.encoder)
        data = load_dataset(ns.data, encoder, val_fraction=ns.val_fraction, seed=ns.seed)
        head, report = fit_head(encoder, data, ns.head, export_dir=Path(ns.encoder).parent, params=params)
        head_to_onnx(head, encoder.feature_dim, ns.out, labels=data.labels, metadata={META_ENCODER_SHA: encoder.sha256})
        if ns.fused:
            fuse(ns.encoder, ns.out, ns.fused)
    except ImportError as exc:  # a module the check above does not know of, named with its extra
        top = (exc.name or "torch").split(".")[0]
        return report_error(MissingExtra(f"a {ns.head} head", top, EXTRA_OF_MODULE.get(top, "all")), "fit-head")
    except (ValueError, OSError, KeyError) as exc:
        return report_error(InputError(str(exc)), "fit-head")
    if ns.json:
        print(json.dumps(report))
    else:
        print(f"{ns.head} head on {report['num_train']} training samples ({report['fit_seconds']:.2f} s)")
        print(f"  train accuracy      {report['train_accuracy']:.4f}")
        print(f"  validation accuracy {report['validation_accuracy']:.4f} ({report['num_validation']} samples)")
        print(f"wrote {ns.out}" + (f" and {ns.fused}" if ns.fused else ""))
    return 0


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


__all__ = ["Dataset", "fit_head", "load_dataset", "main_fit_head"]
