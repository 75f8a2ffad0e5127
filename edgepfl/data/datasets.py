"""Datasets from local files, and each client's train / test split of them.

A sample is an image (C, H, W), a series (C channels over T steps) or a vector (D
features); docs/DATA.md says how the kind is chosen and how each is normalized. Only
images have a value range (uint8 0..255 or floats in [0, 1]); a series' or vector's raw
values may be any finite numbers. Nothing here downloads anything. Importing this module needs numpy only (the head
tier imports it without torch); scikit-learn, Pillow and torchvision are imported
lazily by the dataset kinds that need them.

:func:`load_pool` decodes a whole dataset into a :class:`Pool` (cached per process,
since the simulator loads it for many clients); :func:`load_client_data` partitions
the pool, takes one client's share, splits it into train / test and applies the
client's domain transform; :func:`describe_partition` summarises every client's share
from labels alone.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol.run import INPUT_DIMS, InputKind, kind_of_shape
from ..specs import CsvSpec, DataSpec, InputSpec
from .client import ClientData
from .domains import apply_domain, check_domains
from .partition import PartitionError, partition, stratified_quota, stratified_take
from .preprocess import IMAGE_SUFFIXES
from .sensors import read_csv_windows
from .tsfile import TsFormatError, bundled_ts_files, read_ts_set, split_name

#: where Debian's ``dataset-fashion-mnist`` installs the gzipped IDX files
FMNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FMNIST_PACKAGE = "dataset-fashion-mnist"
FMNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
#: normalization of a device's own data (imagefolder, npz without stats): fixed, so
#: devices holding different files still feed the shared encoder the same scale
DEVICE_NORMALIZATION = 0.5


class DataError(ValueError):
    """A dataset that cannot be loaded; the message says what to install or fix."""


#: the array ranks of a batch of each input kind, and its name
_BATCH_RANK = {kind: ndim + 1 for kind, ndim in INPUT_DIMS.items()}
_LAYOUT = {"image": "(N, C, H, W)", "series": "(N, C, T)", "vector": "(N, D)"}


@dataclass(eq=False)
class Pool:
    """A whole decoded dataset.

    ``pixels`` is the compact raw form: images (N, C, H, W) uint8 in 0..255 or float32
    in [0, 1]; series (N, C, T) or vectors (N, D) float32 of any finite value (the
    :attr:`kind` follows from the rank). ``normalization`` is per channel (axis 1) of the
    raw values, images in [0, 1] units. :meth:`take` returns normalized float32 rows, and
    :attr:`x` the whole normalized array (built on first use). Arrays are read-only: the
    pool is shared by every client loaded in this process.
    """

    pixels: np.ndarray
    y: np.ndarray
    class_names: list[str]
    normalization: dict[str, list[float]]
    source: str = ""
    #: a series' channels or a vector's features by name (a CSV log's columns, an npz's
    #: ``channel_names``); None: unnamed
    channel_names: list[str] | None = None
    _x: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        rank, dtype = self.pixels.ndim, self.pixels.dtype
        if rank not in _BATCH_RANK.values() or dtype not in (np.uint8, np.float32) or (dtype == np.uint8 and rank != 4):
            raise DataError(
                f"{self.source}: samples must be uint8/float32 images (N, C, H, W), or float32 series (N, C, T) or "
                f"vectors (N, D), got {dtype}{self.pixels.shape}"
            )
        if len(self.pixels) != len(self.y):
            raise DataError(f"{self.source}: {len(self.pixels)} samples but {len(self.y)} labels")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= len(self.class_names)):
            raise DataError(f"{self.source}: labels must lie in 0..{len(self.class_names) - 1}")
        channels = self.pixels.shape[1]
        for key in ("mean", "std"):
            if len(self.normalization.get(key, ())) != channels:
                raise DataError(f"{self.source}: normalization {key} needs {channels} values")
        if min(self.normalization["std"]) <= 0:
            raise DataError(f"{self.source}: normalization std must be positive")
        if self.channel_names is not None and (len(self.channel_names) != channels or rank == 4
                                               or len(set(self.channel_names)) != channels):
            raise DataError(f"{self.source}: channel_names must be {channels} distinct names of a series' channels "
                            f"or a vector's features, got {self.channel_names}")
        self.pixels.setflags(write=False)
        self.y.setflags(write=False)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: (C, H, W), (C, T) or (D,)."""
        return tuple(int(d) for d in self.pixels.shape[1:])

    @property
    def kind(self) -> InputKind:
        """What one sample is: ``image``, ``series`` or ``vector``."""
        return kind_of_shape(self.input_shape)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Normalized float32 samples (n, *input_shape) of the given pool indices (a copy)."""
        raw = self.pixels[np.asarray(indices, dtype=np.int64)].astype(np.float32)
        scale = np.float32(1 / 255) if self.pixels.dtype == np.uint8 else np.float32(1)
        per_channel = (1, -1) + (1,) * (raw.ndim - 2)
        mean = np.asarray(self.normalization["mean"], np.float32).reshape(per_channel)
        std = np.asarray(self.normalization["std"], np.float32).reshape(per_channel)
        # (raw*scale - mean)/std folded into one multiply-add over the batch
        raw *= scale / std
        raw -= mean / std
        return raw

    @property
    def x(self) -> np.ndarray:
        """All samples, normalized float32 (N, *input_shape), read-only."""
        if self._x is None:
            x = self.take(np.arange(len(self)))
            x.setflags(write=False)
            self._x = x
        return self._x


# ----------------------------------------------------------------------------- stats

#: samples per slice when computing a pool's statistics
STATS_CHUNK = 4096


def _stats(pixels: np.ndarray) -> dict[str, list[float]]:
    """Per-channel mean / std of the pool, exact, in bounded memory: images in [0, 1]
    units, series and vectors in their own (a series' channel over every time step of
    every sample, a vector's feature over every sample).

    Taken over slices of :data:`STATS_CHUNK` images: ``np.bincount`` casts its input to
    int64 and a float std subtracts the mean into a copy, so one call over a whole pool
    of 70k images held ~440 MB for a moment, in every coordinator and agent.
    """
    mean, std = [], []
    chunks = range(0, len(pixels), STATS_CHUNK)
    for c in range(pixels.shape[1]):
        if pixels.dtype == np.uint8:
            # a histogram gives exact moments without a float copy of the pool
            h = np.zeros(256, dtype=np.float64)
            for i in chunks:
                h += np.bincount(pixels[i:i + STATS_CHUNK, c].ravel(), minlength=256)
            v = np.arange(256, dtype=np.float64) / 255
            m = float((h * v).sum() / h.sum())
            s = float(np.sqrt((h * (v - m) ** 2).sum() / h.sum()))
        else:
            count = pixels[:, c].size
            m = sum(float(pixels[i:i + STATS_CHUNK, c].sum(dtype=np.float64)) for i in chunks) / count
            squares = sum(float(np.square(pixels[i:i + STATS_CHUNK, c] - m, dtype=np.float64).sum()) for i in chunks)
            s = float(np.sqrt(squares / count))
        if pixels.ndim == 4:
            mean.append(round(m, 6))
            std.append(round(max(s, 1e-6), 6))
        else:
            # raw values have any scale: 7 significant digits (float32's), not 6 decimals; a constant
            # channel's std is floored relative to its mean, so its float32 rounding stays small
            mean.append(float(f"{m:.7g}"))
            std.append(float(f"{max(s, abs(m) * 1e-6, 1e-12):.7g}"))
    return {"mean": mean, "std": std}


def _fixed_stats(channels: int) -> dict[str, list[float]]:
    return {"mean": [DEVICE_NORMALIZATION] * channels, "std": [DEVICE_NORMALIZATION] * channels}


def _to_nchw(x: np.ndarray, source: str) -> np.ndarray:
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        if x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):  # channels-last (N, H, W, C)
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return x
    raise DataError(f"{source}: images must be (N, H, W) or (N, C, H, W), got shape {x.shape}")


def _to_pixels(x: np.ndarray, source: str) -> np.ndarray:
    """uint8 stays uint8; floats must already be in [0, 1]; other integers are 0..255."""
    x = _to_nchw(np.asarray(x), source)
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        if not np.isfinite(x).all():
            raise DataError(f"{source}: images contain NaN or Inf")
        if x.size and (x.min() < 0 or x.max() > 1):
            raise DataError(f"{source}: float images must lie in [0, 1] (got {x.min():.3g}..{x.max():.3g})")
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise DataError(f"{source}: integer images must lie in 0..255")
        return np.ascontiguousarray(x.astype(np.uint8))
    raise DataError(f"{source}: unsupported image dtype {x.dtype}")


def _looks_like_image(x: np.ndarray) -> bool:
    """Whether an (N, H, W) array is grayscale images by its values: uint8, integers in
    0..255 or finite floats in [0, 1] (anything else is a series)."""
    if x.dtype == np.uint8:
        return True
    if np.issubdtype(x.dtype, np.integer):
        return not x.size or (x.min() >= 0 and x.max() <= 255)
    if np.issubdtype(x.dtype, np.floating):
        return bool(np.isfinite(x).all()) and (not x.size or (x.min() >= 0 and x.max() <= 1))
    return False


def input_kind_of(x: np.ndarray, requested: str, source: str) -> InputKind:
    """The kind of the samples in array ``x`` (N, ...): ``requested`` (``data.input.kind``), or
    for ``auto`` by rank: (N, D) a vector, (N, C, H, W) an image, (N, H, W) an image when
    :func:`_looks_like_image`, else a series (N, C, T)."""
    layouts = {"image": (3, 4), "series": (2, 3), "vector": (2,)}
    if requested != "auto":
        if x.ndim not in layouts[requested]:
            want = {"image": "(N, H, W) or (N, C, H, W)", "series": "(N, T) or (N, C, T)", "vector": "(N, D)"}
            raise DataError(f"{source}: {requested} samples must be {want[requested]}, got shape {x.shape}")
        return requested  # type: ignore[return-value]
    if x.ndim == 2:
        return "vector"
    if x.ndim == 4 or (x.ndim == 3 and _looks_like_image(x)):
        return "image"
    if x.ndim == 3:
        return "series"
    raise DataError(f"{source}: samples must be vectors (N, D), series (N, C, T) or images (N, H, W) / (N, C, H, W), "
                    f"got shape {x.shape}")


def _to_values(x: np.ndarray, kind: InputKind, source: str) -> np.ndarray:
    """A series' or vector's raw values as float32 (N, C, T) / (N, D): any finite numbers."""
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
        raise DataError(f"{source}: unsupported {kind} dtype {x.dtype}; store numbers")
    with np.errstate(over="ignore"):  # float64 past float32's range: refused below
        values = x.astype(np.float32)
    if kind == "series" and values.ndim == 2:
        values = values[:, None]  # (N, T): one channel
    bad = (~np.isfinite(values)).reshape(len(values), -1).any(axis=1)
    if bad.any():
        # float64 values past float32's range become Inf here, not in the file
        in_file = np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all()
        what = "NaN or Inf" if in_file else f"values beyond float32's range ({x.dtype})"
        raise DataError(f"{source}: {int(bad.sum())} {kind} samples contain {what}, the first is sample "
                        f"{int(np.flatnonzero(bad)[0])}; drop or fill them")
    return np.ascontiguousarray(values)


def _normalization(given: InputSpec, stored: dict[str, list[float]] | None, pixels: np.ndarray,
                   computed: bool, source: str) -> dict[str, list[float]]:
    """Per-channel statistics: the config's (``data.input.mean/std``), else the file's, else
    computed from ``pixels`` (``computed``) or the fixed :data:`DEVICE_NORMALIZATION`."""
    if given.mean is not None and given.std is not None:
        norm = {"mean": list(given.mean), "std": list(given.std)}
    elif stored is not None:
        norm = stored
    else:
        return _stats(pixels) if computed else _fixed_stats(pixels.shape[1])
    if len(norm["mean"]) != pixels.shape[1]:
        raise DataError(f"{source}: normalization has {len(norm['mean'])} channels, the samples {pixels.shape[1]}")
    return norm


def _to_labels(y: Any, source: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{source}: labels must be a 1-D integer array, got {y.dtype}{y.shape}")
    return y.astype(np.int64)


# ----------------------------------------------------------------------------- fmnist


def read_idx(path: str | Path, expect_ndim: int) -> np.ndarray:
    """Parse one IDX file (gzipped or plain) of unsigned bytes, checking its header."""
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = zlib.decompress(data, 31)  # 31: gzip container
        except zlib.error as exc:
            raise DataError(f"{path}: not a valid gzip file ({exc})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path}: bad IDX magic number")
    if data[2] != 0x08:
        raise DataError(f"{path}: IDX element type 0x{data[2]:02x}, expected unsigned byte (0x08)")
    ndim = data[3]
    if ndim != expect_ndim:
        raise DataError(f"{path}: IDX file has {ndim} dimensions, expected {expect_ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    if len(data) - header != int(np.prod(shape)):
        raise DataError(f"{path}: IDX body has {len(data) - header} bytes, header says {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find(root: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def fmnist_root(root: str | None = None) -> Path:
    """Where Fashion-MNIST is looked for: ``root``, else ``$EDGEPFL_FMNIST_ROOT``, else Debian's path."""
    return Path(root or os.environ.get("EDGEPFL_FMNIST_ROOT") or FMNIST_ROOT)


def fmnist_available(root: str | None = None) -> bool:
    """True when all four Fashion-MNIST files are under :func:`fmnist_root` of ``root``."""
    r = fmnist_root(root)
    return all(_find(r, stem) for pair in _FMNIST_FILES.values() for stem in pair)


def _load_fmnist(root: str | None) -> Pool:
    r = fmnist_root(root)
    xs, ys = [], []
    for images, labels in _FMNIST_FILES.values():
        pi, pl = _find(r, images), _find(r, labels)
        if pi is None or pl is None:
            raise DataError(
                f"Fashion-MNIST not found: {r}/{images if pi is None else labels}.gz is missing. "
                f"Install the Debian package {FMNIST_PACKAGE} (`apt-get install {FMNIST_PACKAGE}`), "
                f"or point data.root at a folder holding the four IDX files."
            )
        x, y = read_idx(pi, 3), read_idx(pl, 1)
        if len(x) != len(y):
            raise DataError(f"{pi}: {len(x)} images but {pl.name} has {len(y)} labels")
        xs.append(x)
        ys.append(y)
    pixels = np.concatenate(xs)[:, None]
    return Pool(pixels, np.concatenate(ys).astype(np.int64), list(FMNIST_CLASSES), _stats(pixels), f"fmnist:{r}")


# ----------------------------------------------------------------------------- digits


def _load_digits() -> Pool:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the digits dataset needs scikit-learn: pip install scikit-learn") from None
    d = load_digits()
    pixels = (np.asarray(d.images, dtype=np.float32) / 16.0)[:, None]  # values are 0..16
    names = [str(int(t)) for t in d.target_names]
    return Pool(np.ascontiguousarray(pixels), d.target.astype(np.int64), names, _stats(pixels), "digits")


# ----------------------------------------------------------------------------- torchvision


def _tv_arrays(ds: Any, source: str) -> tuple[np.ndarray, np.ndarray]:
    data = getattr(ds, "data", None)
    targets = getattr(ds, "targets", getattr(ds, "labels", None))
    if data is not None and targets is not None and not isinstance(data, (list, tuple)):
        return np.asarray(data), np.asarray(targets)
    # generic datasets (file lists): decode item by item through PIL
    xs, ys = [], []
    for i in range(len(ds)):
        img, target = ds[i]
        xs.append(np.asarray(img))
        ys.append(int(target))
    if not xs:
        raise DataError(f"{source}: dataset is empty")
    shapes = {a.shape for a in xs}
    if len(shapes) != 1:
        raise DataError(f"{source}: images differ in size {sorted(shapes)[:3]}; use an imagefolder or npz instead")
    return np.stack(xs), np.asarray(ys)


def _load_torchvision(name: str | None, root: str | None) -> Pool:
    if not name:
        raise DataError("data.dataset 'torchvision' needs data.name, e.g. CIFAR10")
    if not root:
        raise DataError(f"torchvision dataset {name} needs data.root (a local folder; edgepfl never downloads)")
    try:
        import torchvision.datasets as tvd
    except ImportError:
        raise DataError("torchvision datasets need torchvision: pip install 'edgepfl[train]'") from None
    found = getattr(tvd, name, None)
    if not inspect.isclass(found):
        raise DataError(f"torchvision.datasets has no dataset {name!r}")
    cls: Callable[..., Any] = found  # a dataset class picked by name: their constructors differ
    params = inspect.signature(cls).parameters
    if "train" in params:
        splits: list[dict[str, Any]] = [{"train": True}, {"train": False}]
    elif "split" in params:
        splits = [{"split": "train"}, {"split": "test"}]
    else:
        splits = [{}]
    source = f"torchvision:{name}:{root}"
    xs, ys, classes = [], [], None
    for kw in splits:
        try:
            ds = cls(root, download=False, **kw)
        except (RuntimeError, FileNotFoundError, OSError) as exc:
            raise DataError(
                f"torchvision dataset {name} not found under {root} ({exc}). edgepfl never downloads: "
                f"fetch it once with torchvision on a connected machine and copy the folder here."
            ) from None
        except (TypeError, ValueError) as exc:
            raise DataError(f"{source}: cannot open with {kw}: {exc}") from None
        x, y = _tv_arrays(ds, source)
        xs.append(_to_pixels(x, source))
        ys.append(_to_labels(y, source))
        classes = classes or list(getattr(ds, "classes", []) or [])
    pixels = np.concatenate(xs)
    y = np.concatenate(ys)
    names = [str(c) for c in classes] if classes else [str(i) for i in range(int(y.max()) + 1)]
    return Pool(pixels, y, names, _stats(pixels), source)


# ----------------------------------------------------------------------------- npz


def _load_npz(root: str | None, given: InputSpec) -> Pool:
    if not root:
        raise DataError("data.dataset 'npz' needs data.root: the path of a .npz file")
    path = Path(root)
    if not path.is_file():
        raise DataError(f"npz dataset not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except ValueError as exc:
        # numpy refuses object (pickled) arrays when allow_pickle=False
        raise DataError(f"{path}: cannot load without pickle ({exc}); store plain numeric arrays") from None
    except (OSError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"{path}: needs arrays 'x' (samples) and 'y' (labels), found {sorted(arrays)}")
    source = f"npz:{path}"
    x = np.asarray(arrays["x"])
    kind = input_kind_of(x, given.kind, source)
    pixels = _to_pixels(x, source) if kind == "image" else _to_values(x, kind, source)
    y = _to_labels(arrays["y"], source)
    if "class_names" in arrays:
        names = [str(s) for s in np.asarray(arrays["class_names"]).ravel()]
    else:
        names = [str(i) for i in range(int(y.max()) + 1 if len(y) else 0)]
    channel_names = [str(s) for s in np.asarray(arrays["channel_names"]).ravel()] if "channel_names" in arrays else None
    stored = None
    if "mean" in arrays and "std" in arrays:
        stored = {k: [float(v) for v in np.asarray(arrays[k], np.float64).ravel()] for k in ("mean", "std")}
    # images of a device's own file: fixed statistics, as before kinds existed; a series or
    # vector has no common scale to fix, so its statistics come from the file
    return Pool(pixels, y, names, _normalization(given, stored, pixels, kind != "image", source), source, channel_names)


# ----------------------------------------------------------------------------- csv


def _load_csv(root: str | None, csv: CsvSpec, given: InputSpec) -> Pool:
    if not root:
        raise DataError("data.dataset 'csv' needs data.root: the path of a .csv sensor log")
    if given.kind not in ("auto", "series"):
        raise DataError(f"a csv sensor log holds series; data.input.kind is {given.kind}")
    try:
        x, y, names, channels = read_csv_windows(root, csv)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    source = f"csv:{Path(root)}"
    return Pool(x, y, names, _normalization(given, None, x, True, source), source, channels)


# ----------------------------------------------------------------------------- ts


def ts_files(root: str | None, name: str | None) -> list[Path]:
    """The ``.ts`` files ``data.root`` / ``data.name`` name: ``root`` a file; ``root`` a folder
    holding ``<name>_TRAIN.ts`` and/or ``<name>_TEST.ts`` (directly or in ``<name>/``, the
    archive's layout; ``name`` ``<set>_TRAIN`` or ``<set>_TEST``: that split alone); no root:
    set ``name`` as an installed package ships it."""
    if not root:
        if not name:
            raise DataError("data.dataset 'ts' needs data.name (a set an installed package ships, e.g. "
                            "BasicMotions) or data.root (a .ts file or a folder of them)")
        try:
            return bundled_ts_files(name)
        except TsFormatError as exc:
            raise DataError(str(exc)) from None
    path = Path(root)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f".ts data not found: {path}")
    if not name:
        raise DataError(f"data.root {path} is a folder: give data.name, the set whose <name>_TRAIN.ts / "
                        f"<name>_TEST.ts it holds")
    stem, splits = split_name(name)
    for folder in (path, path / stem):
        files = [folder / f"{stem}_{split}.ts" for split in splits]
        if any(f.is_file() for f in files):
            return [f for f in files if f.is_file()]
    wanted = " or ".join(f"{stem}_{split}.ts" for split in splits)
    raise DataError(f"{path}: no {wanted} in it or in {path / stem}")


def _load_ts(root: str | None, name: str | None, given: InputSpec) -> Pool:
    if given.kind not in ("auto", "series"):
        raise DataError(f"a .ts set holds series; data.input.kind is {given.kind}")
    files = ts_files(root, name)
    try:
        x, y, names = read_ts_set(files)
    except TsFormatError as exc:
        raise DataError(str(exc)) from None
    source = f"ts:{','.join(str(f) for f in files)}"
    return Pool(x, y, names, _normalization(given, None, x, True, source), source)


# ----------------------------------------------------------------------------- imagefolder


def load_imagefolder(
    root: str | Path, class_names: list[str] | None = None, size: tuple[int, int] | None = None
) -> Pool:
    """One device's images: ``root/<class_name>/*.png|jpg|…``.

    Class order is ``class_names`` if given, else the lines of ``root/classes.txt`` if
    present (so devices that lack some class still agree on label indices), else the
    sorted sub-folder names. Images load as grayscale when every file is grayscale,
    otherwise RGB, resized to ``size`` (W, H) or to the most common size in the folder.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"imagefolder not found: {root}")
    try:
        from PIL import Image
    except ImportError:
        raise DataError("imagefolder datasets need Pillow: pip install pillow") from None
    if class_names is None and (root / "classes.txt").is_file():
        class_names = [ln.strip() for ln in (root / "classes.txt").read_text().splitlines() if ln.strip()]
    subdirs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if class_names is None:
        class_names = subdirs
    extra = sorted(set(subdirs) - set(class_names))
    if extra:
        raise DataError(f"{root}: folders {extra} are not among the class names {class_names}")
    files: list[tuple[Path, int]] = []
    for label, name in enumerate(class_names):
        d = root / name
        if d.is_dir():
            files += [(p, label) for p in sorted(d.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"{root}: no images found (expected {root}/<class>/*.png or *.jpg)")
    images = []
    for p, _ in files:
        try:
            with Image.open(p) as im:
                im.load()
                images.append(im.copy())
        except OSError as exc:
            raise DataError(f"{p}: unreadable image ({exc})") from None
    gray = all(im.mode in ("1", "L", "I", "I;16", "F", "LA") for im in images)
    mode = "L" if gray else "RGB"
    target = tuple(size) if size else Counter(im.size for im in images).most_common(1)[0][0]
    arrays = []
    for im in images:
        im = im.convert(mode)
        if im.size != target:
            im = im.resize(target, Image.Resampling.BILINEAR)
        arrays.append(np.asarray(im, dtype=np.uint8))
    x = np.stack(arrays)
    pixels = x[:, None] if gray else np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    y = np.array([label for _, label in files], dtype=np.int64)
    return Pool(
        np.ascontiguousarray(pixels), y, list(class_names), _fixed_stats(pixels.shape[1]), f"imagefolder:{root}"
    )


# ----------------------------------------------------------------------------- load_pool

_lock = threading.Lock()


def resolve_kind(spec: DataSpec) -> str:
    """The concrete dataset kind: ``auto`` is FMNIST when its files exist, else digits."""
    if spec.dataset == "auto":
        return "fmnist" if fmnist_available(spec.root) else "digits"
    return spec.dataset


@functools.lru_cache(maxsize=8)
def _cached_pool(kind: str, root: str | None, name: str | None, input_json: str, csv_json: str | None) -> Pool:
    given = InputSpec.model_validate_json(input_json)
    if kind == "npz":
        return _load_npz(root, given)
    if kind == "csv":
        return _load_csv(root, CsvSpec.model_validate_json(csv_json or "{}"), given)
    if kind == "ts":
        return _load_ts(root, name, given)
    if given.kind not in ("auto", "image"):
        raise DataError(f"dataset {kind} holds images; data.input.kind is {given.kind}")
    if kind == "fmnist":
        pool = _load_fmnist(root)
    elif kind == "digits":
        pool = _load_digits()
    elif kind == "torchvision":
        pool = _load_torchvision(name, root)
    elif kind == "imagefolder":
        if not root:
            raise DataError("data.dataset 'imagefolder' needs data.root: a folder of <class>/<image> files")
        pool = load_imagefolder(root)
    else:
        raise DataError(f"unknown dataset kind {kind!r}")
    if given.mean is not None:
        norm = _normalization(given, None, pool.pixels, False, pool.source)
        pool = Pool(pool.pixels, pool.y, pool.class_names, norm, pool.source, pool.channel_names)
    return pool


def load_pool(spec: DataSpec) -> Pool:
    """Decode the dataset ``spec`` names into a :class:`Pool`, once per process."""
    with _lock:  # the in-process simulator may load many clients from threads
        return _cached_pool(*_pool_key(spec))


def clear_cache() -> None:
    """Forget decoded pools and partitions (tests; files changed on disk)."""
    _cached_pool.cache_clear()
    _cached_split.cache_clear()


# ----------------------------------------------------------------------------- clients


def _owns_whole_pool(spec: DataSpec, kind: str) -> bool:
    # a device's own file or folder is not partitioned when it is the only client
    return kind in ("imagefolder", "npz", "csv", "ts") and spec.num_clients == 1


def _seeded(spec: DataSpec, *stream: int) -> np.random.Generator:
    # independent streams per purpose and client: loading client 3 never depends on client 2
    return np.random.default_rng([spec.seed, *stream])


_PARTITION_STREAM, _CAP_STREAM, _SPLIT_STREAM, _DOMAIN_STREAM = 0, 1, 2, 3


def _split_train_test(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Positions of a stratified train / test split; both sides non-empty."""
    n = len(labels)
    n_test = min(max(int(round(n * fraction)), 1), n - 1)
    classes, inverse = np.unique(labels, return_inverse=True)
    quota = stratified_quota(np.bincount(inverse, minlength=len(classes)), n_test, rng)
    test = [rng.choice(np.flatnonzero(inverse == c), size=q, replace=False) for c, q in enumerate(quota) if q]
    test_pos = np.concatenate(test)
    mask = np.ones(n, dtype=bool)
    mask[test_pos] = False
    return rng.permutation(np.flatnonzero(mask)), rng.permutation(test_pos)


@functools.lru_cache(maxsize=16)
def _cached_split(pool_key: tuple, spec_json: str) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    spec = DataSpec.model_validate_json(spec_json)
    labels = _cached_pool(*pool_key).y
    kind = pool_key[0]
    if _owns_whole_pool(spec, kind):
        parts = [np.arange(len(labels), dtype=np.int64)]
    else:
        try:
            parts = partition(labels, spec.num_clients, spec.partition, _seeded(spec, _PARTITION_STREAM))
        except PartitionError as exc:
            raise DataError(
                f"cannot partition {kind} ({len(labels)} samples) over {spec.num_clients} clients: {exc}"
            ) from None
    out = []
    for i, idx in enumerate(parts):
        if spec.samples_per_client is not None and len(idx) > spec.samples_per_client:
            idx = idx[stratified_take(labels[idx], spec.samples_per_client, _seeded(spec, _CAP_STREAM, i))]
        if len(idx) < 2:
            raise DataError(f"client {i} holds {len(idx)} samples; a train / test split needs at least 2")
        tr, te = _split_train_test(labels[idx], spec.test_fraction, _seeded(spec, _SPLIT_STREAM, i))
        train, test = idx[tr], idx[te]
        train.setflags(write=False)
        test.setflags(write=False)
        out.append((train, test))
    return tuple(out)


def _pool_key(spec: DataSpec) -> tuple[str, str | None, str | None, str, str | None]:
    """Cache key: only the fields that change what is decoded."""
    kind = resolve_kind(spec)
    root = os.path.abspath(os.path.expanduser(spec.root)) if spec.root and kind != "digits" else None
    return (kind, root, spec.name if kind in ("torchvision", "ts") else None, spec.input.model_dump_json(),
            spec.csv.model_dump_json() if kind == "csv" else None)


def client_indices(spec: DataSpec, client_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool indices of client ``client_index``'s (train, test) samples; read-only arrays."""
    if not 0 <= client_index < spec.num_clients:
        raise DataError(f"client_index {client_index} out of range: data.num_clients is {spec.num_clients}")
    transforms = spec.partition.domains if spec.partition.kind == "domain" else spec.partition.shift
    if transforms is not None:
        try:
            check_domains(transforms)
        except ValueError as exc:
            what = "partition.domains" if spec.partition.kind == "domain" else "partition.shift"
            raise DataError(f"{what}: {exc}") from None
    load_pool(spec)  # decode (and cache) first, under the lock
    with _lock:
        return _cached_split(_pool_key(spec), spec.model_dump_json())[client_index]


def client_domain(spec: DataSpec, client_index: int) -> str | None:
    """The domain transform of this client: ``partition.domains`` for a partition by domain,
    ``partition.shift`` on top of any other; None when there is neither."""
    doms = spec.partition.domains if spec.partition.kind == "domain" else spec.partition.shift
    if not doms:
        return None
    return doms[client_index % len(doms)]


def load_client_data(spec: DataSpec, client_index: int) -> ClientData:
    """Client ``client_index``'s train / test data: pool -> partition -> cap -> split.

    Deterministic for ``spec.seed``. The test split is stratified over the client's
    own samples, so it follows the client's training distribution. The client's domain
    transform (:func:`client_domain`), if any, is applied to both splits.
    """
    pool = load_pool(spec)
    train, test = client_indices(spec, client_index)
    x_train, x_test = pool.take(train), pool.take(test)
    dom = client_domain(spec, client_index)
    if dom is not None:
        rng = _seeded(spec, _DOMAIN_STREAM, client_index)
        mean, std = pool.normalization["mean"], pool.normalization["std"]
        try:
            x_train = apply_domain(dom, x_train, rng, mean, std)
            x_test = apply_domain(dom, x_test, rng, mean, std)
        except ValueError as exc:
            raise DataError(f"client {client_index}: {exc}") from None
    return ClientData(
        x_train=x_train,
        y_train=pool.y[train].copy(),
        x_test=x_test,
        y_test=pool.y[test].copy(),
        num_classes=pool.num_classes,
        class_names=list(pool.class_names),
        domain=dom,
        normalization={k: list(v) for k, v in pool.normalization.items()},
        channel_names=None if pool.channel_names is None else list(pool.channel_names),
    )


def describe_partition(spec: DataSpec) -> list[dict[str, Any]]:
    """Per client: sample counts, train / test class counts and domain (labels only, fast)."""
    pool = load_pool(spec)
    out = []
    for i in range(spec.num_clients):
        train, test = client_indices(spec, i)
        out.append(
            {
                "client": i,
                "n_train": int(len(train)),
                "n_test": int(len(test)),
                "class_counts": np.bincount(pool.y[train], minlength=pool.num_classes).tolist(),
                "test_class_counts": np.bincount(pool.y[test], minlength=pool.num_classes).tolist(),
                "domain": client_domain(spec, i),
            }
        )
    return out
