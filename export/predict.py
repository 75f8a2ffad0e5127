"""Run an exported encoder and a head with onnxruntime only: ``edgepfl predict``.

::

    edgepfl predict --encoder release/encoder.onnx --head head.onnx img1.png photos/ batch.npy

    edgepfl predict --encoder release/encoder.onnx --head head.onnx log.csv windows.npz

For an image release inputs are image files, directories (their images, recursively, in
sorted order) or ``.npy`` arrays. Images and arrays are raw pixels, as the data package
reads them (uint8 0..255 or float in [0, 1]; shapes (N, H, W), (N, C, H, W) or (N, H, W,
C)); the encoder's ``manifest.json`` (next to it) says how to scale, normalize and resize
them. For a series or vector release (the manifest's ``run.data.input_kind``) inputs are
raw samples of any range: ``.npy`` arrays and ``.npz`` files (array ``x``; ``y`` is not
needed) of shape (N, C, T) or (N, D), and, for a series, CSV sensor logs cut into windows
of the manifest's length T (``--label``, ``--channels``, ``--segment``, ``--stride``; the
label column may be absent); the manifest's per-channel normalization is applied with
numpy alone (docs/DATA.md, "What a release's devices apply"). ``--preprocessed`` takes
arrays that are already normalized float32 model inputs (N, *input_shape). Without a manifest raw inputs cannot be normalized as in
training, so they are refused unless ``--without-manifest`` accepts that (with a warning).

Class names come from the head itself (``edgepfl.class_names`` in its metadata, written
by every head writer); a head without them (an older edgepfl's) is refused unless
``--federation-labels`` says its labels are the federation's class indices.

Torch-free: this module needs numpy, onnxruntime and (for image files) Pillow.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.data.preprocess import IMAGE_SUFFIXES, channel_order, normalize
from edgepfl.data.sensors import read_csv_windows
from edgepfl.errors import InputError, OneLineParser, report
from edgepfl.protocol.manifest import ReleaseManifest, read_manifest
from edgepfl.protocol.run import PIXEL_SCALE, InputKind, kind_of_shape
from edgepfl.specs import CsvSpec

from .heads import OnnxHead, make_session

if TYPE_CHECKING:  # pragma: no cover
    from PIL.Image import Image as PilImage


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
        if not 1 <= len(shape) <= 3 or any(not isinstance(s, int) for s in shape):
            raise ValueError(f"encoder input shape {inp.shape} is not a fixed (N, C, H, W), (N, C, T) or (N, D) and "
                             "there is no manifest")
        #: one sample's shape: image (C, H, W), series (C, T) or vector (D,)
        self.input_shape: tuple[int, ...] = tuple(int(s) for s in shape)
        #: what one sample is: the manifest's ``run.data.input_kind``, else what the graph's rank says
        self.input_kind: InputKind = manifest.run.data.input_kind if manifest else kind_of_shape(self.input_shape)
        #: the channels (a series) or features (a vector) by name in input order, as the run read
        #: them (None: unnamed); a named CSV log or npz is read by these names
        self.channel_names: list[str] | None = manifest.run.data.channel_names if manifest else None
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
        """Features (N, feature_dim) of normalized float32 inputs (N, *input_shape).

        Small batches keep onnxruntime's arena small: on a Pi, peak memory matters more
        than the last few percent of throughput (64 vs 256 saved ~27 MiB of peak RSS).
        """
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"inputs must be (N, {', '.join(map(str, self.input_shape))}), got {x.shape}")
        if len(x) == 0:
            return np.zeros((0, self.feature_dim), np.float32)
        out = [self.session.run([self.output_name], {self.input_name: np.ascontiguousarray(x[i : i + batch_size])})[0]
               for i in range(0, len(x), batch_size)]
        return np.concatenate(out)

    def preprocess(self, raw: np.ndarray) -> np.ndarray:
        """Raw samples -> model inputs, exactly as the manifest's ``run.data`` says (numpy only).

        Images: pixels (uint8 0..255 or float in [0, 1]; N,H,W / N,C,H,W / N,H,W,C), see
        :func:`preprocess_pixels`. Series (N, C, T) and vectors (N, D): raw values of any
        range, normalized per channel by :func:`edgepfl.data.preprocess.normalize`; without a
        manifest they are taken as they are. ``ValueError`` names the shape for another one.
        """
        if self.input_kind == "image":
            return preprocess_pixels(raw, self.image_shape, self.manifest)
        if self.manifest is not None:
            return normalize(raw, self.manifest.run.data)
        x = np.asarray(raw, np.float32)
        if x.ndim != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.input_kind} inputs must be (N, {', '.join(map(str, self.input_shape))}), "
                             f"got {x.shape}")
        return np.ascontiguousarray(x)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """An image release's (C, H, W); ``ValueError`` for a series or vector release."""
        if self.input_kind != "image":
            raise ValueError(f"this release takes {self.input_kind}s {list(self.input_shape)}, not images")
        c, h, w = self.input_shape
        return c, h, w


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


#: the most pixels (width x height, as the file's header declares them) an image input may have,
#: by default. An encoder takes at most a few hundred pixels a side, so every input is scaled
#: down; the largest photo a device's camera commonly writes is 24 megapixels (6000 x 4000), about
#: 100 MB to decode. Pillow's own limit (89 million, an error only beyond twice that) lets a 400 kB
#: file cost the better part of a gigabyte. ``--max-pixels`` raises it (a 48 MP phone's full size).
MAX_IMAGE_PIXELS = 25_000_000


def open_image(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> PilImage:
    """``path`` opened by Pillow (nothing decoded yet), once its header's size is at most ``max_pixels``.

    ``ValueError`` (one line naming the file) for an image that declares more, or for a file
    that is no image Pillow can read; the image's pixels are never decoded then.
    """
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit("reading image files needs Pillow: pip install pillow") from None
    with warnings.catch_warnings():  # Pillow warns beyond its own limit: ours, lower, says it once
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(path)
        except Image.DecompressionBombError as exc:  # beyond twice Pillow's limit: refused from the header
            declared = re.search(r"\((\d+) pixels\)", str(exc))
            size = f"{int(declared.group(1)):,} pixels" if declared else "more pixels than Pillow reads"
            raise ValueError(f"{path}: declares {size}, more than the {max_pixels:,} an input image may have "
                             "(--max-pixels); scale it down") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ValueError(f"{path}: not a readable image ({exc})") from None
    width, height = im.size
    if width * height > max_pixels:
        im.close()
        raise ValueError(f"{path}: declares {width}x{height} = {width * height:,} pixels, more than the {max_pixels:,} "
                         "an input image may have (--max-pixels); scale it down")
    return im


def load_images(paths: list[Path], input_shape: tuple[int, int, int],
                max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Image files as uint8 pixels (N, C, H, W), converted and resized to the encoder's input.

    Each file's declared size is checked against ``max_pixels`` before it is decoded
    (:func:`open_image`); a file that is not, or not wholly, a readable image is a
    ``ValueError`` naming it."""
    from PIL import Image

    c, h, w = input_shape
    mode = "L" if c == 1 else "RGB"
    out = []
    for p in paths:
        with open_image(p, max_pixels) as im:
            try:
                im = im.convert(mode)
                if im.size != (w, h):
                    im = im.resize((w, h), Image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
            except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt pixel data
                raise ValueError(f"{p}: not a readable image ({exc})") from None
        out.append(a[None] if c == 1 else a.transpose(2, 0, 1))
    return np.stack(out) if out else np.zeros((0, c, h, w), np.uint8)


#: the files a series or vector release reads: raw arrays (``.npy``; ``.npz`` with ``x``) and sensor logs
SAMPLE_SUFFIXES = (".npy", ".npz", ".csv")


def collect_inputs(items: list[str], encoder: OnnxEncoder, preprocessed: bool = False,
                   csv: CsvSpec | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[list[str], np.ndarray]:
    """(names, model inputs) in argument order.

    An image release reads image files, directories of them and ``.npy`` arrays of pixels.
    A series or vector release reads ``.npy`` arrays and ``.npz`` files (array ``x``) of raw
    samples and, for a series, CSV sensor logs cut into windows as ``csv`` says
    (:func:`csv_spec`); a directory gives its files of those kinds, in sorted order. An image
    that declares more than ``max_pixels`` is refused before it is decoded (:func:`open_image`).
    """
    names: list[str] = []
    batches: list[np.ndarray] = []
    for item in items:
        p = Path(item)
        if encoder.input_kind != "image":
            for f in _sample_files(p, encoder.input_kind):
                raw = _read_samples(f, encoder, csv)
                x = np.asarray(raw, np.float32) if preprocessed else encoder.preprocess(raw)
                batches.append(x)
                names += [f"{f}[{i}]" for i in range(len(x))]
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ValueError(f"{p}: no images found")
            batches.append(encoder.preprocess(load_images(files, encoder.image_shape, max_pixels)))
            names += [str(f) for f in files]
        elif p.suffix.lower() == ".npy":
            arr = load_npy(p)
            x = np.asarray(arr, np.float32) if preprocessed else encoder.preprocess(arr)
            if x.ndim == 3 and preprocessed:
                x = x[None]
            batches.append(x)
            names += [f"{p}[{i}]" for i in range(len(x))]
        elif p.is_file():
            batches.append(encoder.preprocess(load_images([p], encoder.image_shape, max_pixels)))
            names.append(str(p))
        else:
            raise ValueError(f"{p}: no such file or directory")
    if not batches:
        raise ValueError("no inputs given")
    return names, np.concatenate(batches)


def _sample_files(path: Path, kind: str) -> list[Path]:
    """The files of a series or vector input: ``path`` itself, or a directory's files it can read."""
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in SAMPLE_SUFFIXES)
        if not files:
            raise ValueError(f"{path}: no .npy, .npz or .csv files found")
        return files
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.suffix.lower() not in SAMPLE_SUFFIXES:
        raise ValueError(f"{path}: a {kind} release reads .npy, .npz or .csv files, not {path.suffix or 'this file'}")
    return [path]


def _read_samples(path: Path, encoder: OnnxEncoder, csv: CsvSpec | None) -> np.ndarray:
    """The raw samples of one ``.npy``, ``.npz`` (array ``x``) or ``.csv`` file."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        if encoder.input_kind != "series":
            raise ValueError(f"{path}: a CSV sensor log holds series; this release takes {encoder.input_kind}s")
        return read_csv_windows(path, csv or csv_spec(encoder), labelled=False).x
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as f:
                if "x" not in f.files:
                    raise ValueError(f"{path}: needs an array 'x' of raw samples, found {sorted(f.files)}")
                x = _npz_member(f, "x", path)
                named = ([str(s) for s in _npz_member(f, "channel_names", path).ravel()]
                         if "channel_names" in f.files else None)
            return in_run_channel_order(x, named, encoder, path)
        return load_npy(path)
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable {suffix} file ({exc})") from None


def load_npy(path: Path, *, header_only: bool = False) -> np.ndarray:
    """A ``.npy`` file's array, read only when the data its header declares is in the file:
    numpy allocates what the header declares before it reads, so a 128-byte file declaring
    46 TiB would be an out-of-memory error, not a bad input. ``ValueError`` names the file.
    ``header_only``: that check alone (the array returned is a read-only view of the file)."""
    try:
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)  # mapping checks the length, allocates nothing
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npy file ({exc})") from None
    except ValueError as exc:  # the declared data is longer than the file, an object array, a bad header
        raise ValueError(f"{path}: not a readable .npy file ({exc})") from None
    return mapped if header_only else np.array(mapped)


def _npz_member(npz: Any, name: str, path: Path) -> np.ndarray:
    """Array ``name`` of an open ``.npz`` file, read only when its header declares no more data
    than the archive says the member holds (numpy allocates the declared size first)."""
    _check_npz_member(npz, name, path)
    return np.asarray(npz[name])


def _check_npz_member(npz: Any, name: str, path: Path) -> None:
    with npz.zip.open(f"{name}.npy") as member:
        try:
            version = np.lib.format.read_magic(member)
            shape, _, dtype = (np.lib.format.read_array_header_1_0(member) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(member))
        except ValueError as exc:
            raise ValueError(f"{path}: array {name!r} is not a readable .npy member ({exc})") from None
    declared = math.prod(shape) * dtype.itemsize
    if declared > npz.zip.getinfo(f"{name}.npy").file_size:
        raise ValueError(f"{path}: array {name!r} declares {declared:,} bytes of {shape}, more than its member holds")


def check_input(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """What can be told of an input file from its header alone, without decoding it: an image's
    declared size (:func:`open_image`), that a ``.npy`` file holds the data its header declares,
    that an ``.npz`` file's arrays do. ``ValueError`` naming the file when it cannot be an input."""
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        open_image(path, max_pixels).close()
    elif suffix == ".npy":
        load_npy(path, header_only=True)
    elif suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as f:
                for name in f.files:
                    _check_npz_member(f, name, path)
        except (OSError, EOFError, zlib.error, zipfile.BadZipFile, KeyError) as exc:
            raise ValueError(f"{path}: not a readable .npz file ({exc})") from None


def csv_spec(encoder: OnnxEncoder, *, label: str = "label", channels: list[str] | None = None,
             segment: str | None = None, stride: int | None = None) -> CsvSpec:
    """How a device's CSV sensor log becomes a series release's inputs: windows as long as the
    release's input ((C, T): T rows), every ``stride`` rows (default: T, each row in one
    window), of the ``channels`` columns in the order the run was trained on (default: the
    run's channel names where the manifest has them, whatever the file's column order; else
    every column but the label and segment columns, in file order)."""
    window = int(encoder.input_shape[-1])
    return CsvSpec(label=label, channels=channels or encoder.channel_names, segment=segment, window=window,
                   stride=stride or window)


def in_run_channel_order(x: np.ndarray, named: list[str] | None, encoder: OnnxEncoder, source: object) -> np.ndarray:
    """Raw samples ``x`` whose channels (axis 1) are ``named`` taken in the run's order
    (:attr:`OnnxEncoder.channel_names`); as they are when either side names none.
    ``ValueError`` (one line naming ``source``) when the names are not the run's."""
    try:
        order = channel_order(named, encoder.channel_names)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if order is None:
        return x
    if x.ndim < 2 or x.shape[1] != len(order):
        raise ValueError(f"{source}: {len(named or [])} channel names for samples of shape {x.shape[1:]}")
    return np.ascontiguousarray(x[:, order])


def add_max_pixels_argument(parser: argparse.ArgumentParser) -> None:
    """``--max-pixels`` (``predict``, ``serve``): the largest image, by its declared size, that is decoded."""

    def positive(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of pixels")
        return value

    parser.add_argument("--max-pixels", type=positive, default=MAX_IMAGE_PIXELS, metavar="N",
                        help=f"refuse an image whose header declares more than N pixels (width x height), before "
                             f"decoding it (default {MAX_IMAGE_PIXELS:,}: a 24-megapixel photo)")


def add_csv_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say how a CSV sensor log is read (``fit-head``, ``predict``, ``serve``)."""
    group = parser.add_argument_group("CSV sensor logs (series releases; window length: the manifest's input)")
    group.add_argument("--label", default="label", help="the column holding each row's class (default: label)")
    group.add_argument("--channels", default=None, metavar="A,B,…",
                       help="the channel columns in the run's channel order (default: the run's channel names "
                            "where its manifest has them, else every other column in file order)")
    group.add_argument("--segment", default=None, help="a column that changes where a recording starts")
    group.add_argument("--stride", type=int, default=None, help="rows between window starts (default: the window)")


def csv_spec_of(ns: argparse.Namespace, encoder: OnnxEncoder) -> CsvSpec | None:
    """The :func:`csv_spec` that :func:`add_csv_arguments`' options give for ``encoder`` (None: not a series)."""
    if encoder.input_kind != "series":
        return None
    if ns.stride is not None and ns.stride < 1:
        raise ValueError(f"--stride must be at least 1, got {ns.stride}")
    channels = [c.strip() for c in ns.channels.split(",")] if ns.channels else None
    return csv_spec(encoder, label=ns.label, channels=channels, segment=ns.segment, stride=ns.stride)


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
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files, directories or .npy arrays; a series or vector release: .npy, .npz (x) "
                             "or .csv files of raw samples, or directories of them")
    parser.add_argument("--preprocessed", action="store_true",
                        help="arrays are normalized float32 model inputs (N, *input_shape)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input instead of a table")
    parser.add_argument("--top", type=int, default=1, help="classes to show per input")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--without-manifest", action="store_true",
                        help="run an encoder that has no manifest.json: inputs are only scaled, not normalized")
    parser.add_argument("--federation-labels", action="store_true",
                        help="a head that records no class names predicts the federation's class indices")
    add_max_pixels_argument(parser)
    add_csv_arguments(parser)
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
        names, x = collect_inputs(ns.inputs, encoder, ns.preprocessed, csv_spec_of(ns, encoder), ns.max_pixels)
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


__all__ = ["MAX_IMAGE_PIXELS", "SAMPLE_SUFFIXES", "OnnxEncoder", "add_csv_arguments", "add_max_pixels_argument",
           "check_input", "collect_inputs", "csv_spec", "csv_spec_of", "head_class_names", "load_images", "load_npy",
           "main_predict", "open_image", "preprocess_pixels", "top_predictions"]
