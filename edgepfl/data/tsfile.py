"""Labelled series in the ``.ts`` format of the UEA/UCR time-series classification archive:
numpy and the standard library only.

A ``.ts`` file has comment lines (``#`` or ``%``), ``@`` header lines (``@problemName``,
``@dimensions 6``, ``@seriesLength 100``, ``@classLabel true Standing Running …``; keys
in any case), then ``@data`` and one case per line: each dimension's values separated by
commas, the dimensions by colons, the class label last (``0.07,0.08,…:-0.9,…:Walking``).

Real sensor sets in this format ship inside registry wheels (sktime's
``sktime/datasets/data/<Name>/<Name>_{TRAIN,TEST}.ts``: BasicMotions, a smartwatch's
accelerometer and gyroscope; ACSF1, appliance power; …). :func:`bundled_ts_files` finds
them in the installed package without importing it, so reading one needs neither the
package's dependencies nor a network.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["TS_PACKAGES", "TsFormatError", "bundled_ts_files", "read_ts", "read_ts_set", "split_name"]

#: installed packages whose wheels ship the archive's sets, searched in this order, and the
#: folder inside the package holding one sub-folder per set
TS_PACKAGES: tuple[tuple[str, str], ...] = (("sktime", "datasets/data"),)
#: the splits of a set in the archive's layout, ``<Name>_<SPLIT>.ts``
TS_SPLITS = ("TRAIN", "TEST")


class TsFormatError(ValueError):
    """A ``.ts`` file or set that cannot be read; one line naming the file (and line)."""


def _header_flag(path: Path, line: int, spelled: str, words: list[str]) -> bool:
    if not words or words[0].lower() not in ("true", "false"):
        raise TsFormatError(f"{path}:{line}: @{spelled} must be true or false, got {' '.join(words)!r}")
    return words[0].lower() == "true"


def _values(path: Path, line: int, dim: int, text: str) -> np.ndarray:
    """One dimension's comma-separated values as float64; a bad value is one error naming it."""
    cells = text.split(",")
    try:
        return np.array(cells, dtype=np.float64)
    except ValueError:
        pass
    for i, cell in enumerate(cells):
        if cell.strip() == "?":
            raise TsFormatError(f"{path}:{line}: dimension {dim} has a missing value ('?') at step {i}; "
                                f"fill or drop the case: series must be complete")
        try:
            float(cell)
        except ValueError:
            raise TsFormatError(f"{path}:{line}: dimension {dim} step {i} holds {cell.strip()!r}, "
                                f"not a number") from None
    raise AssertionError("unreachable: some value failed the array conversion")


def read_ts(path: str | Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The cases of the ``.ts`` file at ``path``: float32 (N, C, T) values, int64 labels (N,)
    indexing the returned class names (the ``@classLabel`` header's order).

    Series must be of one length with no missing values and no time stamps (the archive's
    fixed-length sets: every edgepfl series is a window of one length). Raises
    :class:`TsFormatError` with one line naming the file, and the line where there is one:
    no ``@data``, no or a false ``@classLabel`` (a regression set), a header it contradicts
    (dimensions, length), a value that is not a finite number, a missing value, a label the
    header does not list, lengths that differ.
    """
    path = Path(path)
    if not path.is_file():
        raise TsFormatError(f".ts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TsFormatError(f"{path}: not a readable text file ({exc})") from None
    classes: list[str] | None = None
    dimensions: int | None = None
    length: int | None = None
    data_at: int | None = None
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text[0] in "#%":
            continue
        if not text.startswith("@"):
            raise TsFormatError(f"{path}:{number}: a case before @data; the header lines start with '@'")
        spelled, *words = text[1:].split() or [""]
        key = spelled.lower()
        if key == "data":
            data_at = number
            break
        if key == "timestamps" and _header_flag(path, number, spelled, words):
            raise TsFormatError(f"{path}:{number}: time-stamped series (@timeStamps true) are not supported; "
                                f"store the values at equal steps")
        if key == "targetlabel" and _header_flag(path, number, spelled, words):
            raise TsFormatError(f"{path}:{number}: a regression set (@targetLabel true); edgepfl needs class labels")
        if key == "classlabel":
            if not _header_flag(path, number, spelled, words):
                raise TsFormatError(f"{path}:{number}: @classLabel false: the cases have no class labels")
            if len(words) < 3:
                raise TsFormatError(f"{path}:{number}: @classLabel true must list at least two class labels")
            classes = words[1:]
        if key in ("dimensions", "serieslength"):
            if len(words) != 1 or not words[0].isdigit() or int(words[0]) < 1:
                raise TsFormatError(f"{path}:{number}: @{spelled} must be a positive integer, got {' '.join(words)!r}")
            if key == "dimensions":
                dimensions = int(words[0])
            else:
                length = int(words[0])
    if data_at is None:
        raise TsFormatError(f"{path}: no @data line; is this a .ts file?")
    if classes is None:
        raise TsFormatError(f"{path}: no @classLabel header before @data (line {data_at}); edgepfl needs class labels")
    if len(set(classes)) != len(classes):
        raise TsFormatError(f"{path}: @classLabel lists a label twice: {classes}")
    index = {name: i for i, name in enumerate(classes)}
    cases: list[np.ndarray] = []
    labels: list[int] = []
    first: tuple[int, tuple[int, int]] | None = None  # line and (C, T) of the first case
    for number, raw in enumerate(lines[data_at:], start=data_at + 1):
        text = raw.strip()
        if not text or text[0] in "#%":
            continue
        *dims, label = text.split(":")
        label = label.strip()
        if not dims:
            raise TsFormatError(f"{path}:{number}: no ':' before the class label; a case is "
                                f"values:values:…:label")
        if label not in index:
            raise TsFormatError(f"{path}:{number}: label {label!r} is not among @classLabel {classes}")
        if dimensions is not None and len(dims) != dimensions:
            raise TsFormatError(f"{path}:{number}: {len(dims)} dimensions, @dimensions says {dimensions}")
        series = [_values(path, number, d, t) for d, t in enumerate(dims)]
        lengths = sorted({len(s) for s in series})
        if len(lengths) > 1:
            raise TsFormatError(f"{path}:{number}: its dimensions differ in length ({lengths}); series must be "
                                f"of one length")
        shape = (len(series), lengths[0])
        if length is not None and shape[1] != length:
            raise TsFormatError(f"{path}:{number}: {shape[1]} values per dimension, @seriesLength says {length}")
        if first is None:
            first = (number, shape)
        elif shape != first[1]:
            raise TsFormatError(f"{path}:{number}: {shape[0]} dimensions x {shape[1]} steps, line {first[0]} has "
                                f"{first[1][0]} x {first[1][1]}; series of unequal length are not supported")
        case = np.stack(series)
        if not np.isfinite(case).all() or (np.abs(case) > np.finfo(np.float32).max).any():
            raise TsFormatError(f"{path}:{number}: a value that is not a finite float32 (NaN, Inf or too large)")
        cases.append(case)
        labels.append(index[label])
    if not cases:
        raise TsFormatError(f"{path}: no cases after @data (line {data_at})")
    x = np.stack(cases).astype(np.float32)
    return x, np.array(labels, dtype=np.int64), list(classes)


def split_name(name: str) -> tuple[str, tuple[str, ...]]:
    """A set's name and the splits it asks for: ``BasicMotions`` both, ``BasicMotions_TRAIN`` one."""
    for split in TS_SPLITS:
        if name.endswith(f"_{split}") and len(name) > len(split) + 1:
            return name[: -len(split) - 1], (split,)
    return name, TS_SPLITS


def bundled_ts_files(name: str) -> list[Path]:
    """The ``.ts`` files of set ``name`` (``BasicMotions``) that an installed package of
    :data:`TS_PACKAGES` ships: ``<Name>_TRAIN.ts`` and ``<Name>_TEST.ts``, those present;
    ``<Name>_TRAIN`` or ``<Name>_TEST`` names that split alone.

    The package is found, not imported (``importlib.util.find_spec``): its own
    dependencies need not be importable. Raises :class:`TsFormatError` saying what to
    install, or which sets the installed package has.
    """
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise TsFormatError(f"not a .ts set name: {name!r} (e.g. BasicMotions)")
    name, splits = split_name(name)
    found: list[tuple[str, Path]] = []
    for package, folder in TS_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            data = Path(location) / folder
            files = [data / name / f"{name}_{split}.ts" for split in splits]
            if any(f.is_file() for f in files):
                return [f for f in files if f.is_file()]
            if data.is_dir():
                found.append((package, data))
    if not found:
        packages = " or ".join(p for p, _ in TS_PACKAGES)
        raise TsFormatError(f".ts set {name!r}: no package that ships the archive's sets is installed; "
                            f"pip install 'edgepfl[sensors]' (it brings {packages}), or give data.root: a .ts "
                            f"file or a folder holding {name}_TRAIN.ts / {name}_TEST.ts")
    package, data = found[0]
    sets = sorted(p.name for p in data.iterdir() if p.is_dir() and any(p.glob("*.ts")))
    raise TsFormatError(f".ts set {name!r} is not in {package} ({data}); it ships {sets}")


def read_ts_set(files: list[Path]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The cases of several ``.ts`` files of one set (its TRAIN and TEST splits) as one pool;
    the files must agree on the class labels and the series' shape."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    classes: list[str] | None = None
    for path in files:
        x, y, names = read_ts(path)
        if classes is None:
            classes = names
        elif names != classes:
            raise TsFormatError(f"{path}: @classLabel {names} differs from {files[0]}'s {classes}")
        if xs and x.shape[1:] != xs[0].shape[1:]:
            raise TsFormatError(f"{path}: cases of shape {x.shape[1:]}, {files[0]}'s are {xs[0].shape[1:]}")
        xs.append(x)
        ys.append(y)
    if classes is None:
        raise TsFormatError("no .ts files given")
    return np.concatenate(xs), np.concatenate(ys), classes
