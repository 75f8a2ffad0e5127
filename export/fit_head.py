"""Fit a personalized head for a new client offline: ``edgepfl fit-head``.

::

    edgepfl fit-head --encoder release/encoder.onnx --data my_images/ --head svm --out head.onnx

``--data`` is an image folder (``DIR/<class>/*.png``; or ``DIR/train/<class>/…`` and
``DIR/test/<class>/…`` for an explicit split) or a ``.npz`` with arrays ``x`` (raw pixels)
and ``y`` (labels), optionally ``class_names``. For a series or vector release it is a
``.npz`` of raw samples (N, C, T) or (N, D) of any range, or (series) a CSV sensor log cut
into labelled windows of the manifest's length (``--label``, ``--channels``, ``--segment``,
``--stride``). The encoder's manifest says how to preprocess, and only numpy applies it.
``--head`` is a kind the release's method offers (its ``head_kinds``): the method builds
the head, with its own parameters where it has them (RepPer's ``head_*`` options).
Class folders named like the federation's classes keep the federation's
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

from edgepfl.errors import EXTRA_OF_MODULE, InputError, MissingExtra, OneLineParser, UsageError, require_installed
from edgepfl.errors import report as report_error
from edgepfl.heads import HeadRelease, fitting_modules
from edgepfl.heads.labels import FEDERATION, LOCAL, LabelSpace
from edgepfl.methods import available_head_kinds, create_method
from edgepfl.specs import CsvSpec

from .heads import META_ENCODER_SHA, fuse, head_to_onnx
from .predict import OnnxEncoder, add_csv_arguments, csv_spec, csv_spec_of, in_run_channel_order


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


def load_dataset(path: str | Path, encoder: OnnxEncoder, *, val_fraction: float = 0.25, seed: int = 0,
                 csv: CsvSpec | None = None) -> Dataset:
    """Read an image folder, ``.npz`` or (a series release) CSV sensor log, preprocess for
    ``encoder`` as its manifest says and split (stratified when possible). ``csv``: how a log
    is read (default :func:`~.predict.csv_spec` of the encoder's input)."""
    from edgepfl.config import DataSpec
    from edgepfl.data import load_imagefolder, load_pool
    from edgepfl.data.sensors import read_csv_windows
    from edgepfl.specs import InputSpec

    path = Path(path)
    fed = encoder.class_names
    if encoder.input_kind != "image":
        if path.suffix.lower() == ".csv" and encoder.input_kind == "series":
            raw, y, names, _ = read_csv_windows(path, csv or csv_spec(encoder))
            named = True
        elif path.suffix.lower() == ".npz":
            # the release's kind, never guessed: a raw (N, C, T) of small values is not an image
            pool = load_pool(DataSpec(dataset="npz", root=str(path), input=InputSpec(kind=encoder.input_kind)))
            raw = in_run_channel_order(pool.pixels, pool.channel_names, encoder, path)
            y, names = np.asarray(pool.y), list(pool.class_names)
            with np.load(path, allow_pickle=False) as f:
                named = "class_names" in f.files
        else:
            files = ".npz or .csv file" if encoder.input_kind == "series" else ".npz file"
            raise ValueError(f"{path}: a {encoder.input_kind} release fits its head on a {files}")
        y, names, use_fed = _label_space(np.asarray(y), names, named, fed)
        x = encoder.preprocess(raw)
        tr, va = _split(y, val_fraction, seed)
        return Dataset(x[tr], y[tr], x[va], y[va], names, use_fed)
    c, h, w = encoder.image_shape

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
        y, names, use_fed = _label_space(y, names, named, fed)
    else:
        raise ValueError(f"{path}: expected an image folder or a .npz file")
    x = encoder.preprocess(pixels)
    tr, va = _split(np.asarray(y), val_fraction, seed)
    return Dataset(x[tr], y[tr], x[va], y[va], names, use_fed)


def _label_space(y: np.ndarray, names: list[str], named: bool, fed: list[str]) -> tuple[np.ndarray, list[str], bool]:
    """(labels, class names, whether they are the federation's) of a file's labelled samples:
    named classes all among the federation's take its indices; unnamed labels are taken as
    the federation's class indices; other names make a new task."""
    if named and fed and set(names) <= set(fed):
        return np.array([fed.index(names[i]) for i in y], np.int64), list(fed), True
    use_fed = not named and bool(fed) and (len(y) == 0 or int(y.max()) < len(fed))
    return y, list(fed) if use_fed else names, use_fed


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
    head = _head_with(create_method(release.method, release.method_options), kind, release, params or {})
    if head.federation_classes_only and not data.federation_classes:
        raise ValueError(f"a {kind} head predicts the federation's classes {encoder.class_names}; "
                         f"the data's classes {data.class_names} are not among them")
    f_train = encoder.features(data.x_train)
    f_val = encoder.features(data.x_val)
    start = time.perf_counter()
    try:
        head.fit(f_train, data.y_train)
    except ValueError as exc:  # scikit-learn checks its parameters' values when it fits
        if params and type(exc).__name__ == "InvalidParameterError":
            raise UsageError(f"--set: {_one_line(exc)}") from None
        raise
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


def _head_with(method, kind: str, release: HeadRelease, params: dict[str, Any]):
    """The method's new ``kind`` head with ``params`` set; a parameter it does not have is a
    UsageError naming the ones it has (not a TypeError from its constructor)."""
    head = method.make_head(kind, release)
    unknown = sorted(set(params) - set(head.get_params(deep=False)))
    if unknown:
        raise UsageError(f"--set {unknown[0]}: the {kind} head has no parameter {unknown[0]!r}; it has "
                         f"{', '.join(sorted(head.get_params(deep=False)))}")
    return method.make_head(kind, release, **params) if params else head


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main_fit_head(args: list[str]) -> int:
    """``edgepfl fit-head``: fit, report accuracy, write the head as ONNX."""
    parser = OneLineParser(prog="edgepfl fit-head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", required=True, help="encoder.onnx from edgepfl export (manifest.json beside it)")
    parser.add_argument("--data", required=True,
                        help="image folder or .npz of the new client; a series release: .npz (raw x, y) or .csv log")
    parser.add_argument("--head", required=True, choices=available_head_kinds(),
                        help="a head kind of the encoder's method (edgepfl methods; the manifest's head_kinds)")
    parser.add_argument("--out", required=True, help="where to write the head .onnx")
    parser.add_argument("--fused", default=None, help="also write encoder+head as one .onnx here")
    parser.add_argument("--val-fraction", type=float, default=0.25, help="held-out share when DIR has no train/test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="head parameter, e.g. --set C=0.5 --set hidden_layer_sizes=(64,)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_csv_arguments(parser)
    ns = parser.parse_args(args)
    try:
        for module in fitting_modules(ns.head):  # before any work: the extra that is missing, by name
            require_installed(module, f"fitting a {ns.head} head")
    except MissingExtra as exc:
        return report_error(exc, "fit-head")
    try:
        params = dict(_parse_param(s) for s in ns.set)
        encoder = OnnxEncoder.from_path(ns.encoder)
        data = load_dataset(ns.data, encoder, val_fraction=ns.val_fraction, seed=ns.seed,
                            csv=csv_spec_of(ns, encoder))
        head, report = fit_head(encoder, data, ns.head, export_dir=Path(ns.encoder).parent, params=params)
        head_to_onnx(head, encoder.feature_dim, ns.out, labels=data.labels, metadata={META_ENCODER_SHA: encoder.sha256})
        if ns.fused:
            fuse(ns.encoder, ns.out, ns.fused)
    except ImportError as exc:  # a module the check above does not know of, named with its extra
        top = (exc.name or "torch").split(".")[0]
        return report_error(MissingExtra(f"a {ns.head} head", top, EXTRA_OF_MODULE.get(top, "all")), "fit-head")
    except UsageError as exc:  # a head parameter that does not exist or takes no such value
        return report_error(exc, "fit-head")
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
        raise UsageError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


__all__ = ["Dataset", "fit_head", "load_dataset", "main_fit_head"]
