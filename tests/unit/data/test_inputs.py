"""Inputs of every kind: series (C, T) and vectors (D) of any finite range load from npz and
CSV, images keep their range checks, statistics are per channel, and the run spec says the kind."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.config import ConfigError, DataSpec, PartitionSpec, RunConfig
from edgepfl.data import (
    DataError,
    clear_cache,
    client_indices,
    describe_partition,
    load_client_data,
    load_pool,
    read_csv_windows,
)
from edgepfl.data.datasets import input_kind_of
from edgepfl.data.preprocess import conversion, normalize
from edgepfl.protocol import DataShape, MessageType, Normalization, TaskMeta, decode, encode
from edgepfl.specs import CsvSpec

from tests.wire_samples import sample_run_spec


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _windows(n=120, channels=6, steps=100, classes=4, seed=0):
    """Accelerometer-like windows in about -3..3 (not images): a class-specific sine per channel plus noise."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    t = np.linspace(0, 2 * np.pi, steps)
    freq = (1 + y)[:, None, None] * (1 + np.arange(channels))[None, :, None] / 3
    x = 2.0 * np.sin(freq * t) + rng.normal(0, 0.4, (n, channels, steps)) + np.arange(channels)[None, :, None] * 0.1
    return x.astype(np.float32), y.astype(np.int64)


def _npz(path, x, y, **extra):
    np.savez(path, x=x, y=y, **extra)
    return str(path)


def test_series_of_raw_range_load_with_per_channel_statistics(tmp_path):
    x, y = _windows()
    assert x.min() < -2 and x.max() > 2
    pool = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "w.npz", x, y)))
    assert pool.kind == "series" and pool.input_shape == (6, 100) and pool.pixels.dtype == np.float32
    # a channel's statistics are over every time step of every sample
    assert np.allclose(pool.normalization["mean"], x.astype(np.float64).mean(axis=(0, 2)), atol=1e-6)
    assert np.allclose(pool.normalization["std"], x.astype(np.float64).std(axis=(0, 2)), atol=1e-6)
    standardized = pool.x
    assert np.allclose(standardized.mean(axis=(0, 2)), 0, atol=1e-4)
    assert np.allclose(standardized.std(axis=(0, 2)), 1, atol=1e-4)


def test_vectors_load_with_per_feature_statistics(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal([100.0, -5.0, 0.0], [20.0, 1.0, 1e-3], size=(60, 3))
    y = np.arange(60) % 3
    pool = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "v.npz", x, y)))
    assert pool.kind == "vector" and pool.input_shape == (3,)
    assert np.allclose(pool.normalization["mean"], x.mean(axis=0), atol=1e-5)
    assert np.allclose(pool.normalization["std"], x.std(axis=0), rtol=1e-4)
    assert np.allclose(pool.x.std(axis=0), 1, atol=1e-3)


def test_integer_series_and_a_single_channel_series(tmp_path):
    x = np.random.default_rng(2).integers(-2000, 2000, size=(20, 3, 50)).astype(np.int16)
    pool = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "i.npz", x, np.arange(20) % 2)))
    assert pool.kind == "series" and np.array_equal(pool.pixels, x.astype(np.float32))
    clear_cache()
    flat = np.random.default_rng(3).normal(size=(20, 64))
    spec = DataSpec(dataset="npz", root=_npz(tmp_path / "s.npz", flat, np.arange(20) % 2), input={"kind": "series"})
    assert load_pool(spec).input_shape == (1, 64)


def test_auto_kind_by_rank_and_values():
    assert input_kind_of(np.zeros((4, 7)), "auto", "t") == "vector"
    assert input_kind_of(np.zeros((4, 3, 8, 8), np.float32), "auto", "t") == "image"
    assert input_kind_of(np.zeros((4, 8, 8), np.uint8), "auto", "t") == "image"
    assert input_kind_of(np.full((4, 8, 8), 0.5), "auto", "t") == "image"
    assert input_kind_of(np.full((4, 8, 8), 300, np.int32), "auto", "t") == "series"
    assert input_kind_of(np.full((4, 8, 8), -0.5), "auto", "t") == "series"
    # [0, 1] windows are images unless the spec says otherwise
    assert input_kind_of(np.full((4, 6, 100), 0.5), "series", "t") == "series"
    with pytest.raises(DataError, match=r"vector samples must be \(N, D\)"):
        input_kind_of(np.zeros((4, 6, 100)), "vector", "t")
    with pytest.raises(DataError, match="got shape"):
        input_kind_of(np.zeros(4), "auto", "t")


def test_images_keep_their_range_checks(tmp_path):
    x = np.random.default_rng(4).uniform(-1, 2, size=(10, 1, 8, 8)).astype(np.float32)
    with pytest.raises(DataError, match=r"float images must lie in \[0, 1\] \(got -"):
        load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "img.npz", x, np.arange(10) % 2)))
    wide = np.full((10, 8, 8), 300, np.int32)
    with pytest.raises(DataError, match=r"integer images must lie in 0\.\.255"):
        load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "int.npz", wide, np.arange(10) % 2),
                           input={"kind": "image"}))
    ok = np.random.default_rng(5).integers(0, 256, size=(10, 8, 8)).astype(np.uint8)
    pool = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "ok.npz", ok, np.arange(10) % 2)))
    assert pool.kind == "image" and pool.input_shape == (1, 8, 8)
    # a device's own images keep the fixed normalization
    assert pool.normalization == {"mean": [0.5], "std": [0.5]}


def test_nan_or_inf_is_one_line_naming_the_sample(tmp_path):
    x, y = _windows(n=10)
    x[7, 2, 40] = np.nan
    with pytest.raises(DataError) as err:
        load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "nan.npz", x, y)))
    msg = str(err.value)
    assert "\n" not in msg and "nan.npz" in msg and "NaN or Inf" in msg and "sample 7" in msg
    v = np.ones((5, 3))
    v[1, 0] = np.inf
    with pytest.raises(DataError, match="1 vector samples contain NaN or Inf, the first is sample 1"):
        load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "inf.npz", v, np.arange(5) % 2)))
    big = np.full((5, 3), 1e300)
    with pytest.raises(DataError, match="beyond float32's range"):
        load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "big.npz", big, np.arange(5) % 2)))


def test_given_normalization_wins_over_file_and_computed(tmp_path):
    x, y = _windows(n=40)
    root = _npz(tmp_path / "w.npz", x, y, mean=np.zeros(6), std=np.full(6, 2.0))
    assert load_pool(DataSpec(dataset="npz", root=root)).normalization == {"mean": [0.0] * 6, "std": [2.0] * 6}
    clear_cache()
    given = DataSpec(dataset="npz", root=root, input={"mean": [1.0] * 6, "std": [3.0] * 6})
    pool = load_pool(given)
    assert pool.normalization == {"mean": [1.0] * 6, "std": [3.0] * 6}
    assert np.allclose(pool.x, (x - 1) / 3, atol=1e-6)
    with pytest.raises(DataError, match="normalization has 2 channels, the samples 6"):
        load_pool(DataSpec(dataset="npz", root=root, input={"mean": [0, 0], "std": [1, 1]}))
    with pytest.raises(ValueError, match="both mean and std"):
        DataSpec(input={"mean": [0.0]})


def test_image_datasets_refuse_another_kind():
    with pytest.raises(DataError, match="dataset digits holds images; data.input.kind is series"):
        load_pool(DataSpec(dataset="digits", input={"kind": "series"}))


def test_partitioners_and_client_splits_work_for_series(tmp_path):
    x, y = _windows(n=400)
    for kind in ("dirichlet", "pathological", "iid"):
        spec = DataSpec(dataset="npz", root=_npz(tmp_path / "w.npz", x, y), num_clients=4,
                        partition=PartitionSpec(kind=kind, alpha=0.3))
        rows = describe_partition(spec)
        assert sum(r["n_train"] + r["n_test"] for r in rows) == 400
        data = load_client_data(spec, 2)
        assert data.input_kind == "series" and data.x_train.shape[1:] == (6, 100)
        assert data.normalization["mean"] == load_pool(spec).normalization["mean"]
    # image domain transforms are refused for series with the data error, not a crash
    spec = DataSpec(dataset="npz", root=str(tmp_path / "w.npz"), num_clients=2, partition={"kind": "domain"})
    with pytest.raises(DataError, match=r"domain 'rot90' takes \(N, C, H, W\) images"):
        load_client_data(spec, 1)


def test_sensor_gain_is_one_device_shift_on_train_and_test(tmp_path):
    x, y = _windows(n=200)
    spec = DataSpec(dataset="npz", root=_npz(tmp_path / "w.npz", x, y), num_clients=3,
                    partition={"kind": "domain", "domains": ["identity", "gain", "gain"]})
    pool = load_pool(spec)
    gains = []
    for client in (1, 2):
        data = load_client_data(spec, client)
        train, test = client_indices(spec, client)
        base_train, base_test = pool.take(train), pool.take(test)
        # x' = g x + c per channel, the same g and c on both splits
        g = [np.polyfit(base_train[:, c].ravel(), data.x_train[:, c].ravel(), 1) for c in range(6)]
        g_test = [np.polyfit(base_test[:, c].ravel(), data.x_test[:, c].ravel(), 1) for c in range(6)]
        assert np.allclose(g, g_test, atol=1e-4)
        assert all(1 / 1.5 - 1e-6 <= a <= 1.5 + 1e-6 for a, _ in g)
        gains.append(g)
        assert np.array_equal(load_client_data(spec, client).x_train, data.x_train)  # deterministic
    assert not np.allclose(gains[0], gains[1])  # every device its own shift
    assert np.array_equal(load_client_data(spec, 0).x_train, pool.take(client_indices(spec, 0)[0]))


# ----------------------------------------------------------------------------- csv


def _log(path, rows, header="t,ax,ay,az,activity"):
    path.write_text(header + "\n" + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return path


def _walk_and_sit(n_walk=230, n_sit=120):
    rows = [(i, np.sin(i / 5), np.cos(i / 5), 9.8, "walk") for i in range(n_walk)]
    rows += [(n_walk + i, 0.01, 0.02, 9.81, "sit") for i in range(n_sit)]
    return rows


def test_csv_windows_counts_labels_and_channels(tmp_path):
    path = _log(tmp_path / "log.csv", _walk_and_sit())
    x, y, names, _ = read_csv_windows(path, CsvSpec(label="activity", channels=["ax", "ay", "az"], window=50, stride=25))
    # windows never span the label change: walk 230 rows -> 1 + (230-50)//25 = 8, sit 120 -> 1 + 70//25 = 3
    assert names == ["sit", "walk"] and x.shape == (11, 3, 50) and x.dtype == np.float32
    assert y.tolist() == [1] * 8 + [0] * 3
    assert np.allclose(x[1, 0], np.sin(np.arange(25, 75) / 5), atol=1e-6)  # second walk window starts at row 25
    assert np.allclose(x[8, 2], 9.81)
    # null channels: every column but the label (the time column too)
    x_all, _, _, _ = read_csv_windows(path, CsvSpec(label="activity", window=50, stride=50))
    assert x_all.shape == (4 + 2, 4, 50)


def test_csv_segments_split_windows_and_classes_fix_the_order(tmp_path):
    rows = [(i, 1.0, "a", "rec1" if i < 30 else "rec2") for i in range(60)]
    path = _log(tmp_path / "seg.csv", rows, header="t,v,label,rec")
    spec = CsvSpec(channels=["v"], segment="rec", window=20, stride=10, classes=["b", "a"])
    x, y, names, _ = read_csv_windows(path, spec)
    assert names == ["b", "a"] and y.tolist() == [1, 1, 1, 1]  # 2 per 30-row segment, none across
    without = read_csv_windows(path, spec.model_copy(update={"segment": None}))[0]
    assert len(without) == 5


def test_a_log_to_predict_on_may_lack_the_label_column(tmp_path):
    rows = [(r[0], r[1], r[2], r[3]) for r in _walk_and_sit()]
    path = _log(tmp_path / "unlabelled.csv", rows, header="t,ax,ay,az")
    spec = CsvSpec(label="activity", channels=["ax", "ay", "az"], window=50, stride=50)
    x, y, names, _ = read_csv_windows(path, spec, labelled=False)
    # one run of 350 rows: windows across the (unknown) activity change, the same rows as a labelled read's
    assert x.shape == (7, 3, 50) and y.tolist() == [0] * 7 and names == [""]
    assert np.array_equal(x, read_csv_windows(_log(tmp_path / "one.csv", [(*r, "any") for r in rows]), spec)[0])
    with pytest.raises(ValueError, match="no label column 'activity'"):
        read_csv_windows(path, spec)


def test_numeric_labels_sort_as_numbers(tmp_path):
    rows = [(0.5, lab) for lab in (10,) * 4 + (2,) * 4]
    _, y, names, _ = read_csv_windows(_log(tmp_path / "n.csv", rows, "v,label"), CsvSpec(window=2, stride=2))
    assert names == ["2", "10"] and y.tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("content", "spec", "message"),
    [
        ("t,ax,label\n0,1,a\n", {"channels": ["ax", "gx"]}, r"bad\.csv:1: no channel column 'gx'"),
        ("t,ax,state\n0,1,a\n", {}, r"bad\.csv:1: no label column 'label'"),
        ("t,ax,label\n0,1,a\n1,x1,a\n", {"window": 1}, r"bad\.csv:3: column 'ax' holds 'x1', not a number"),
        ("t,ax,label\n0,1,a\n1,,a\n", {"window": 1}, r"bad\.csv:3: column 'ax' holds '', not a number"),
        ("t,ax,label\n0,1,a\n1,nan,a\n", {"window": 1}, r"bad\.csv:3: column 'ax' holds 'nan', not a finite"),
        ("t,ax,label\n0,1,a\n1,2\n", {"window": 1}, r"bad\.csv:3: 2 fields, the header has 3"),
        ("t,ax,label\n0,1,a\n1,2, \n", {"window": 1}, r"bad\.csv:3: the label column 'label' is empty"),
        ("t,ax,label\n0,1,a\n1,2,a\n2,2,b\n", {"window": 3},
         r"bad\.csv: too few rows for one window of 3: the longest run of rows with one label has 2 \(lines 2\.\.3\)"),
        ("t,ax,label\n0,1,a\n1,2,c\n", {"window": 1, "classes": ["a", "b"]},
         r"bad\.csv:3: label 'c' is not among csv.classes \['a', 'b'\]"),
        ("t,t,label\n", {}, r"bad\.csv:1: columns \['t'\] appear more than once"),
        ("", {}, r"bad\.csv: empty"),
    ],
)
def test_a_bad_csv_is_one_data_error_line(tmp_path, content, spec, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=message) as err:
        load_pool(DataSpec(dataset="csv", root=str(path), csv=spec))
    assert "\n" not in str(err.value)


def test_csv_dataset_is_a_series_pool_a_device_owns(tmp_path):
    path = _log(tmp_path / "log.csv", _walk_and_sit())
    spec = DataSpec(dataset="csv", root=str(path), num_clients=1,
                    csv={"label": "activity", "channels": ["ax", "ay", "az"], "window": 50, "stride": 25})
    pool = load_pool(spec)
    assert pool.kind == "series" and len(pool) == 11 and pool.class_names == ["sit", "walk"]
    data = load_client_data(spec, 0)
    assert data.num_train + data.num_test == 11 and data.input_shape == (3, 50)
    with pytest.raises(DataError, match="a csv sensor log holds series; data.input.kind is vector"):
        load_pool(spec.model_copy(update={"input": spec.input.model_copy(update={"kind": "vector"})}))


# ----------------------------------------------------------------------------- the run spec


def test_the_run_spec_carries_the_kind_from_the_shape():
    config = RunConfig()
    series = config.run_spec((6, 100), 4, normalization={"mean": [0.0] * 6, "std": [1.0] * 6})
    assert series.data.input_kind == "series" and series.data.pixel_scale == 1.0
    assert config.run_spec((20,), 3).data.input_kind == "vector"
    image = config.run_spec((1, 28, 28), 10)
    assert image.data.input_kind == "image" and image.data.pixel_scale == pytest.approx(1 / 255)
    with pytest.raises(ConfigError, match="got \\[1, 2, 3, 4\\]"):
        config.run_spec((1, 2, 3, 4), 10)


def test_data_shape_checks_kind_against_shape_and_scale():
    with pytest.raises(ValueError, match="a series input has 2 dimensions"):
        DataShape(input_kind="series", input_shape=(1, 8, 8), num_classes=2, class_names=["a", "b"])
    with pytest.raises(ValueError, match="pixel_scale applies to images"):
        DataShape(input_kind="vector", input_shape=(4,), num_classes=2, class_names=["a", "b"], pixel_scale=0.5)


def test_an_image_run_spec_is_the_bytes_it_was_and_a_series_one_names_its_kind():
    image = sample_run_spec()
    assert "input_kind" not in image.model_dump_json()
    data = DataShape(input_kind="series", input_shape=(6, 100), num_classes=2, class_names=["a", "b"],
                     normalization=Normalization(mean=[0.0] * 6, std=[1.0] * 6))
    run = image.model_copy(update={"data": data})
    meta = TaskMeta(task_id="a" * 32, kind="train", run=run, seed=1, deadline_s=10)
    got = decode(encode(MessageType.TASK, federation="f", sender="coordinator", round=1, meta=meta)).meta
    assert got.run.data == data and got.run.data.input_kind == "series"


def test_a_device_with_other_statistics_converts_series_exactly(tmp_path):
    x, y = _windows(n=80)
    local = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "w.npz", x, y)))
    run = DataShape(input_kind="series", input_shape=(6, 100), num_classes=4, class_names=list("abcd"),
                    normalization=Normalization(mean=[0.5] * 6, std=[2.0] * 6))
    affine = conversion(local.normalization, run)
    assert affine is not None
    assert np.allclose(affine.apply(local.x), normalize(x, run), atol=1e-5)
    assert np.allclose(normalize(x, run), (x - 0.5) / 2, atol=1e-6)
    with pytest.raises(ValueError, match=r"series inputs must be \(N, 6, 100\)"):
        normalize(x[:, :3], run)


def test_a_constant_channel_stays_finite_and_small(tmp_path):
    x, y = _windows(n=20)
    x[:, 2] = 9.81
    x[:, 3] = 0.0
    pool = load_pool(DataSpec(dataset="npz", root=_npz(tmp_path / "c.npz", x, y)))
    assert np.isfinite(pool.x).all() and np.abs(pool.x[:, 2:4]).max() < 1
