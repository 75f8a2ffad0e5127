""".ts sets (the time-series archive's format): the real BasicMotions that sktime's wheel ships,
read with numpy alone, partitioned with label skew and a per-device sensor shift; and every
malformed file one DataError line naming the file and line."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from edgepfl.data import (
    DataError,
    clear_cache,
    client_indices,
    describe_partition,
    load_client_data,
    load_pool,
    tsfile,
)
from edgepfl.data.tsfile import TsFormatError, read_ts
from edgepfl.specs import DataSpec, PartitionSpec

SKTIME = importlib.util.find_spec("sktime") is not None
needs_sktime = pytest.mark.skipif(not SKTIME, reason="the sensors extra is not installed (pip install "
                                                     "'edgepfl[sensors]'); CI installs every extra")


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


HEADER = """# a comment
% another comment
@problemName Toy
@timeStamps false
@missing false
@univariate false
@dimensions 2
@equalLength true
@seriesLength 3
@classLabel true up down
@data
"""


def _ts(path, body, header=HEADER):
    path.write_text(header + body)
    return path


# ----------------------------------------------------------------------------- the real set


@needs_sktime
def test_basicmotions_from_the_installed_wheel_is_a_raw_series_pool():
    pool = load_pool(DataSpec(dataset="ts", name="BasicMotions"))
    assert pool.kind == "series" and pool.input_shape == (6, 100) and len(pool) == 80
    assert pool.class_names == ["Standing", "Running", "Walking", "Badminton"]  # @classLabel's order
    assert np.bincount(pool.y).tolist() == [20, 20, 20, 20]
    assert pool.pixels.min() < -1 and pool.pixels.max() > 1  # raw accelerometer / gyroscope values
    assert pool.pixels[0, 0, 0] == np.float32(0.079106)  # the first value of BasicMotions_TRAIN.ts
    files = tsfile.bundled_ts_files("BasicMotions")
    assert [f.name for f in files] == ["BasicMotions_TRAIN.ts", "BasicMotions_TEST.ts"]
    x_train, y_train, _ = read_ts(files[0])
    assert np.array_equal(pool.pixels[:40], x_train) and np.array_equal(pool.y[:40], y_train)
    # statistics per channel over every step of every window
    assert np.allclose(pool.normalization["mean"], pool.pixels.astype(np.float64).mean(axis=(0, 2)), rtol=1e-5)


@needs_sktime
def test_basicmotions_with_label_skew_and_sensor_shift_per_device():
    spec = DataSpec(dataset="ts", name="BasicMotions", num_clients=4,
                    partition=PartitionSpec(kind="dirichlet", alpha=0.5, shift=["gain"]))
    rows = describe_partition(spec)
    assert sum(r["n_train"] + r["n_test"] for r in rows) == 80
    assert len({tuple(r["class_counts"]) for r in rows}) == 4  # each device its own label mix
    pool = load_pool(spec)
    slopes = []
    for client in range(4):
        data = load_client_data(spec, client)
        assert data.domain == "gain" and data.class_names == pool.class_names
        base = pool.take(client_indices(spec, client)[0])
        slopes.append([np.polyfit(base[:, c].ravel(), data.x_train[:, c].ravel(), 1)[0] for c in range(6)])
    assert not np.allclose(slopes[0], slopes[1])  # every device its own sensor gain


def test_a_set_from_a_package_is_found_without_importing_it(tmp_path, monkeypatch):
    data = tmp_path / "tspkg" / "datasets" / "data" / "Toy"
    data.mkdir(parents=True)
    (tmp_path / "tspkg" / "__init__.py").write_text("raise ImportError('never imported')\n")
    _ts(data / "Toy_TRAIN.ts", "1,2,3:4,5,6:up\n")
    _ts(data / "Toy_TEST.ts", "7,8,9:1,1,1:down\n0,0,0:0,0,0:up\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tsfile, "TS_PACKAGES", (("tspkg", "datasets/data"),))
    pool = load_pool(DataSpec(dataset="ts", name="Toy", num_clients=1))
    assert pool.pixels.tolist() == [[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [1, 1, 1]], [[0, 0, 0], [0, 0, 0]]]
    assert pool.y.tolist() == [0, 1, 0] and pool.class_names == ["up", "down"]
    assert "tspkg" not in sys.modules
    assert load_pool(DataSpec(dataset="ts", name="Toy_TEST", num_clients=1)).y.tolist() == [1, 0]  # one split
    with pytest.raises(DataError, match=r"'Other' is not in tspkg \(.*\); it ships \['Toy'\]"):
        load_pool(DataSpec(dataset="ts", name="Other"))
    monkeypatch.setattr(tsfile, "TS_PACKAGES", (("no_such_package_here", "datasets/data"),))
    clear_cache()
    with pytest.raises(DataError, match=r"pip install 'edgepfl\[sensors\]' \(it brings no_such_package_here\)"):
        load_pool(DataSpec(dataset="ts", name="Toy"))


def test_a_ts_file_or_an_archive_folder_as_root(tmp_path):
    folder = tmp_path / "archive" / "Toy"
    folder.mkdir(parents=True)
    _ts(folder / "Toy_TEST.ts", "1,2,3:4,5,6:down\n")
    assert len(load_pool(DataSpec(dataset="ts", root=str(folder / "Toy_TEST.ts")))) == 1
    assert len(load_pool(DataSpec(dataset="ts", root=str(tmp_path / "archive"), name="Toy"))) == 1
    assert len(load_pool(DataSpec(dataset="ts", root=str(tmp_path / "archive"), name="Toy_TEST"))) == 1
    with pytest.raises(DataError, match=r"no Toy_TRAIN.ts in it or in .*archive/Toy$"):
        load_pool(DataSpec(dataset="ts", root=str(tmp_path / "archive"), name="Toy_TRAIN"))
    with pytest.raises(DataError, match="is a folder: give data.name"):
        load_pool(DataSpec(dataset="ts", root=str(folder)))
    with pytest.raises(DataError, match="no Nope_TRAIN.ts or Nope_TEST.ts"):
        load_pool(DataSpec(dataset="ts", root=str(folder), name="Nope"))
    with pytest.raises(DataError, match="needs data.name"):
        load_pool(DataSpec(dataset="ts"))
    with pytest.raises(DataError, match="a .ts set holds series; data.input.kind is image"):
        load_pool(DataSpec(dataset="ts", root=str(folder / "Toy_TEST.ts"), input={"kind": "image"}))


def test_a_ts_split_pair_must_agree_on_classes(tmp_path):
    _ts(tmp_path / "Toy_TRAIN.ts", "1,2,3:4,5,6:up\n")
    _ts(tmp_path / "Toy_TEST.ts", "1,2,3:4,5,6:up\n", header=HEADER.replace("up down", "down up"))
    with pytest.raises(DataError, match=r"Toy_TEST.ts: @classLabel \['down', 'up'\] differs"):
        load_pool(DataSpec(dataset="ts", root=str(tmp_path), name="Toy"))


def test_shift_is_for_label_partitions_and_names_known_transforms(tmp_path):
    with pytest.raises(ValidationError, match="kind domain gives each client its transform"):
        PartitionSpec(kind="domain", shift=["gain"])
    path = _ts(tmp_path / "t.ts", "".join(f"{i},2,3:4,5,{i}:{'up' if i % 2 else 'down'}\n" for i in range(8)))
    spec = DataSpec(dataset="ts", root=str(path), num_clients=2, partition={"kind": "iid", "shift": ["gainz"]})
    with pytest.raises(DataError, match=r"partition.shift: unknown domain transform\(s\) \['gainz'\]"):
        load_client_data(spec, 0)


# ----------------------------------------------------------------------------- malformed


@pytest.mark.parametrize("header, body, message", [
    ("@classLabel true up down\n", "", r"t.ts: no @data line"),
    ("@problemName Toy\n@data\n", "1,2:up\n", r"t.ts: no @classLabel header before @data \(line 2\)"),
    ("@classLabel false\n@data\n", "1,2\n", r"t.ts:1: @classLabel false"),
    ("@targetLabel true\n@data\n", "1,2:0.5\n", r"t.ts:1: a regression set"),
    ("@timeStamps true\n@classLabel true a b\n@data\n", "(0,1):a\n", r"t.ts:1: time-stamped series"),
    ("@classLabel maybe a b\n@data\n", "", r"t.ts:1: @classLabel must be true or false"),
    ("@classLabel true a\n@data\n", "", r"t.ts:1: @classLabel true must list at least two"),
    ("@dimensions two\n@classLabel true a b\n@data\n", "", r"t.ts:1: @dimensions must be a positive integer"),
    ("1,2:a\n", "", r"t.ts:1: a case before @data"),
    (HEADER, "", r"t.ts: no cases after @data \(line 11\)"),
    (HEADER, "1,2,3:4,5,6:sideways\n", r"t.ts:12: label 'sideways' is not among @classLabel \['up', 'down'\]"),
    (HEADER, "1,2,3:4,5,6\n", r"t.ts:12: label '4,5,6' is not among"),
    (HEADER, "up\n", r"t.ts:12: no ':' before the class label"),
    (HEADER, "1,2,3:up\n", r"t.ts:12: 1 dimensions, @dimensions says 2"),
    (HEADER, "1,2,3:4,?,6:up\n", r"t.ts:12: dimension 1 has a missing value \('\?'\) at step 1"),
    (HEADER, "1,2,3:4,x5,6:up\n", r"t.ts:12: dimension 1 step 1 holds 'x5', not a number"),
    (HEADER, "1,2,3:4,5,:up\n", r"t.ts:12: dimension 1 step 2 holds '', not a number"),
    (HEADER, "1,2,3:4,5,6,7:up\n", r"t.ts:12: its dimensions differ in length \(\[3, 4\]\)"),
    (HEADER, "1,2:4,5:up\n", r"t.ts:12: 2 values per dimension, @seriesLength says 3"),
    (HEADER, "1,2,3:4,5,nan:up\n", r"t.ts:12: a value that is not a finite float32"),
    (HEADER, "1,2,3:4,5,1e39:up\n", r"t.ts:12: a value that is not a finite float32"),
    ("@classLabel true up down\n@data\n", "1,2,3:4,5,6:up\n\n1,2:3,4:down\n",
     r"t.ts:5: 2 dimensions x 2 steps, line 3 has 2 x 3; series of unequal length are not supported"),
])
def test_a_malformed_ts_file_is_one_line_naming_the_file_and_line(tmp_path, header, body, message):
    path = _ts(tmp_path / "t.ts", body, header=header)
    with pytest.raises(TsFormatError, match=message) as caught:
        read_ts(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(DataError, match=message):  # the same line as the dataset's error
        load_pool(DataSpec(dataset="ts", root=str(path)))


def test_an_unreadable_or_missing_ts_file(tmp_path):
    with pytest.raises(TsFormatError, match=r".ts file not found: .*nope.ts"):
        read_ts(tmp_path / "nope.ts")
    (tmp_path / "bin.ts").write_bytes(b"\xff\xfe\x00@data")
    with pytest.raises(TsFormatError, match=r"bin.ts: not a readable text file"):
        read_ts(tmp_path / "bin.ts")
    with pytest.raises(DataError, match=r".ts data not found: .*missing"):
        load_pool(DataSpec(dataset="ts", root=str(tmp_path / "missing")))
