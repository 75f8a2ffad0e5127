"""Data package: real datasets, partitioners, client splits, domains, local-file loaders."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from edgepfl.config import DataSpec, PartitionSpec
from edgepfl.data import (
    FMNIST_PACKAGE,
    PARTITIONERS,
    DataError,
    apply_domain,
    describe_partition,
    load_client_data,
    load_pool,
    partition,
    read_idx,
    resolve_kind,
)

from tests.conftest import require_fmnist


@pytest.fixture(scope="module")
def fmnist():
    require_fmnist()
    return load_pool(DataSpec(dataset="fmnist"))


@pytest.fixture(scope="module")
def digits():
    return load_pool(DataSpec(dataset="digits"))


def spec(**kw) -> DataSpec:
    part = kw.pop("partition", {})
    return DataSpec(dataset=kw.pop("dataset", "digits"), partition=PartitionSpec(**part), **kw)


# ----------------------------------------------------------------------------- real datasets


def test_fmnist_pool_is_the_full_pooled_dataset(fmnist):
    assert fmnist.pixels.shape == (70000, 1, 28, 28) and fmnist.pixels.dtype == np.uint8
    assert np.array_equal(np.bincount(fmnist.y), np.full(10, 7000))
    assert fmnist.class_names[0] == "T-shirt/top" and fmnist.class_names[9] == "Ankle boot"
    # statistics computed from the pool: Fashion-MNIST's well-known 0.286 / 0.353
    assert fmnist.normalization["mean"][0] == pytest.approx(0.286, abs=2e-3)
    assert fmnist.normalization["std"][0] == pytest.approx(0.353, abs=2e-3)
    x = fmnist.take(np.arange(0, 70000, 7))
    assert x.dtype == np.float32 and abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1) < 0.02
    assert load_pool(DataSpec(dataset="fmnist")) is fmnist  # cached per process
    assert resolve_kind(DataSpec(dataset="auto")) == "fmnist"


def test_fmnist_client_is_fast_after_first_load(fmnist):
    import time

    s = spec(dataset="fmnist", num_clients=20, partition={"kind": "dirichlet", "alpha": 0.1})
    t = time.perf_counter()
    for i in range(20):
        c = load_client_data(s, i)
    assert time.perf_counter() - t < 5.0
    assert c.input_shape == (1, 28, 28) and c.num_classes == 10
    assert sum(r["n_train"] + r["n_test"] for r in describe_partition(s)) == 70000


def test_digits_always_present(digits):
    assert digits.pixels.shape == (1797, 1, 8, 8) and digits.num_classes == 10
    assert digits.class_names == [str(i) for i in range(10)]
    x = digits.x
    assert x.shape == (1797, 1, 8, 8) and abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3
    assert not x.flags.writeable


def test_missing_fmnist_names_the_package(tmp_path):
    with pytest.raises(DataError, match=rf"apt-get install {FMNIST_PACKAGE}") as err:
        load_pool(DataSpec(dataset="fmnist", root=str(tmp_path)))
    assert isinstance(err.value, ValueError)
    assert resolve_kind(DataSpec(dataset="auto", root=str(tmp_path))) == "digits"


def _write_idx(path, arr: np.ndarray, magic_type: int = 0x08) -> None:
    header = bytes([0, 0, magic_type, arr.ndim]) + np.asarray(arr.shape, ">u4").tobytes()
    data = header + arr.astype(np.uint8).tobytes()
    if str(path).endswith(".gz"):
        data = gzip.compress(data, compresslevel=1)
    path.write_bytes(data)


def test_idx_reader_checks_header(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "ok.gz", arr)
    assert np.array_equal(read_idx(tmp_path / "ok.gz", 3), arr)
    _write_idx(tmp_path / "float", arr, magic_type=0x0D)
    with pytest.raises(DataError, match="element type"):
        read_idx(tmp_path / "float", 3)
    (tmp_path / "trunc").write_bytes((tmp_path / "float").read_bytes()[:-1].replace(b"\x0d", b"\x08", 1))
    with pytest.raises(DataError, match="body"):
        read_idx(tmp_path / "trunc", 3)
    (tmp_path / "junk").write_bytes(b"\x12\x34\x08\x03" + bytes(40))
    with pytest.raises(DataError, match="magic"):
        read_idx(tmp_path / "junk", 3)
    with pytest.raises(DataError, match="dimensions"):
        read_idx(tmp_path / "ok.gz", 1)


def test_fmnist_from_custom_root(tmp_path, fmnist):
    # a tiny copy in the Debian layout, read through the same loader
    idx = np.arange(0, 70000, 1000)
    for split, sl in (("train", slice(0, 60)), ("t10k", slice(60, 70))):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", fmnist.pixels[idx[sl], 0])
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", fmnist.y[idx[sl]])
    small = load_pool(DataSpec(dataset="fmnist", root=str(tmp_path)))
    assert np.array_equal(small.pixels, fmnist.pixels[idx]) and np.array_equal(small.y, fmnist.y[idx])


# ----------------------------------------------------------------------------- partitioners


def _parts(labels, kind, k=10, seed=0, **kw):
    return partition(labels, k, PartitionSpec(kind=kind, **kw), np.random.default_rng(seed))


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_partitions_disjoint_deterministic_seeded(digits, kind):
    labels = digits.y
    parts = _parts(labels, kind)
    assert len(parts) == 10 and all(len(p) > 0 for p in parts)
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "a sample went to two clients"
    if kind == "dominant":
        assert len(allidx) <= len(labels) and len({len(p) for p in parts}) == 1
    else:
        assert np.array_equal(np.sort(allidx), np.arange(len(labels))), "samples left out"
    again = _parts(labels, kind)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = _parts(labels, kind, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def _max_share(labels, parts):
    return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])


def test_dirichlet_small_alpha_is_skewed(fmnist):
    labels = fmnist.y
    skewed = _parts(labels, "dirichlet", k=20, alpha=0.1)
    flat = _parts(labels, "dirichlet", k=20, alpha=100.0)
    assert _max_share(labels, skewed) > 0.5
    assert _max_share(labels, flat) < 0.15
    assert min(len(p) for p in skewed) >= 10


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_gives_exactly_k_classes(digits, k):
    parts = _parts(digits.y, "pathological", k=10, classes_per_client=k)
    for p in parts:
        assert len(np.unique(digits.y[p])) == k


def test_pathological_rejects_more_classes_than_exist(digits):
    with pytest.raises(ValueError, match="classes_per_client"):
        _parts(digits.y, "pathological", classes_per_client=11)


@pytest.mark.parametrize("frac", [0.2, 0.5])
def test_dominant_share_and_class(fmnist, frac):
    labels = fmnist.y
    parts = _parts(labels, "dominant", k=20, uniform_fraction=frac)
    expected = (1 - frac) + frac / 10
    for i, p in enumerate(parts):
        counts = np.bincount(labels[p], minlength=10)
        assert counts.argmax() == i % 10
        assert counts.max() / len(p) == pytest.approx(expected, abs=0.01)
        others = np.delete(counts, i % 10)
        assert others.max() - others.min() <= 1  # the uniform share is spread evenly


def test_samples_per_client_cap_keeps_proportions(fmnist):
    # FedPAC's FMNIST setting: 20 clients x 600 training samples, s = 20 %
    s = spec(
        dataset="fmnist", num_clients=20, samples_per_client=800, test_fraction=0.25, partition={"kind": "dominant"}
    )
    rows = describe_partition(s)
    for i, r in enumerate(rows):
        assert (r["n_train"], r["n_test"]) == (600, 200)
        assert r["class_counts"][i % 10] / 600 == pytest.approx(0.82, abs=0.01)


#: FedPAC's published code for Fashion-MNIST (data_loader.py, mnist_noniid_s)
FEDPAC_CODE_SETS = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]


def test_dominant_sets_match_fedpac_code(fmnist):
    # 600 train and 600 test images a client, as the authors' code gives each: 12 of every
    # class (s = 20 %) and 160 more of each of its group's three dominant classes
    s = spec(dataset="fmnist", num_clients=20, samples_per_client=1200, test_fraction=0.5,
             partition={"kind": "dominant", "uniform_fraction": 0.2, "dominant_sets": FEDPAC_CODE_SETS})
    for i, r in enumerate(describe_partition(s)):
        expected = np.full(10, 12)
        expected[FEDPAC_CODE_SETS[i % 5]] += 160
        assert (r["n_train"], r["n_test"]) == (600, 600)
        assert r["class_counts"] == expected.tolist() and r["test_class_counts"] == expected.tolist()


def test_dominant_sets_size_is_the_largest_the_pool_supplies(fmnist):
    # overlapping sets draw unevenly on the classes: the size stops where the most
    # demanded class runs out, and no sample is used twice
    labels = fmnist.y
    parts = _parts(labels, "dominant", k=20, uniform_fraction=0.2, dominant_sets=FEDPAC_CODE_SETS)
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx)
    left = np.bincount(labels) - np.bincount(labels[allidx], minlength=10)
    assert left.min() < 20  # one more sample a client would take more than some class has left
    even, odd = left[::2], left[1::2]  # even classes are dominant in two groups, odd in one
    assert even.max() < odd.min()


def test_dominant_sets_rejected_clearly(digits):
    with pytest.raises(ValueError, match="pool has 10 classes"):
        _parts(digits.y, "dominant", dominant_sets=[[0, 10]])
    for bad in ([[]], [[1, 1]], [[-1]], []):
        with pytest.raises(ValueError, match="dominant_sets"):
            PartitionSpec(kind="dominant", dominant_sets=bad)


def test_test_split_follows_client_distribution(digits):
    s = spec(num_clients=6, test_fraction=0.3, partition={"kind": "dirichlet", "alpha": 0.3})
    for i in range(6):
        c = load_client_data(s, i)
        train, test = c.class_counts(), np.bincount(c.y_test, minlength=10)
        total = train + test
        # stratified: every class contributes its own share to the test split (±1 rounding)
        assert np.all(np.abs(test - total * c.num_test / total.sum()) <= 1.0)
        assert c.num_test == round(total.sum() * 0.3)


def test_client_data_deterministic_and_seeded(digits):
    s = spec(num_clients=4, seed=7)
    a, b = load_client_data(s, 2), load_client_data(s, 2)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    c = load_client_data(spec(num_clients=4, seed=8), 2)
    assert not (len(a.y_train) == len(c.y_train) and np.array_equal(a.x_train, c.x_train))
    assert a.normalization == digits.normalization and a.domain is None
    assert a.x_train.flags.writeable  # the client's own copy, not a view of the shared pool


def test_client_index_out_of_range():
    with pytest.raises(DataError, match="num_clients is 3"):
        load_client_data(spec(num_clients=3), 3)


# ----------------------------------------------------------------------------- domains


def test_domain_clients_see_distinct_transforms(digits):
    doms = ["identity", "rot90", "invert", "noise", "blur", "hflip"]
    s = spec(num_clients=6, partition={"kind": "domain", "domains": doms})
    plain = spec(num_clients=6, partition={"kind": "iid"})
    mean, std = digits.normalization["mean"][0], digits.normalization["std"][0]
    for i, name in enumerate(doms):
        c, ref = load_client_data(s, i), load_client_data(plain, i)
        assert c.domain == name and np.array_equal(c.y_train, ref.y_train)  # IID labels, same samples
        x, r = c.x_train, ref.x_train
        if name == "identity":
            assert np.array_equal(x, r)
            continue
        assert not np.allclose(x, r)
        if name == "rot90":
            assert np.array_equal(x, np.rot90(r, 1, axes=(2, 3)))
        elif name == "hflip":
            assert np.array_equal(x, r[..., ::-1])
        elif name == "invert":
            np.testing.assert_allclose(x * std + mean, 1 - (r * std + mean), atol=1e-5)
        elif name == "noise":
            assert 0.2 < float((x - r).std() * std) < 0.4  # sigma 0.3 in raw pixels
            np.testing.assert_array_equal(x, load_client_data(s, i).x_train)  # seeded
        elif name == "blur":
            assert float(np.abs(np.diff(x, axis=3)).mean()) < float(np.abs(np.diff(r, axis=3)).mean())
    assert [r["domain"] for r in describe_partition(s)] == doms


def test_domain_transforms_keep_shape_and_reject_unknown():
    x = np.random.default_rng(0).standard_normal((3, 2, 5, 5)).astype(np.float32)
    for name in ("rot180", "blur", "noise", "invert"):
        y = apply_domain(name, x, np.random.default_rng(0), [0.5, 0.5], [0.25, 0.25])
        assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(apply_domain("rot180", x, None, [0, 0], [1, 1]), np.rot90(x, 2, axes=(2, 3)))
    with pytest.raises(DataError, match="known"):
        load_client_data(spec(num_clients=2, partition={"kind": "domain", "domains": ["sepia"]}), 0)


# ----------------------------------------------------------------------------- local files


def test_npz_loads_and_device_owns_whole_file(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(40, 6, 6), dtype=np.uint8)
    y = np.repeat(np.arange(4), 10)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y, class_names=np.array(["a", "b", "c", "d"]))
    s = DataSpec(dataset="npz", root=str(path), num_clients=1, test_fraction=0.25)
    c = load_client_data(s, 0)
    assert c.num_train + c.num_test == 40 and c.class_names == ["a", "b", "c", "d"]
    assert sorted(np.bincount(c.y_test).tolist()) == [2, 2, 3, 3]  # 10 test samples, stratified
    # a device's own data gets the fixed normalization: raw [0, 1] -> [-1, 1]
    assert c.normalization == {"mean": [0.5], "std": [0.5]}
    pool = load_pool(s)
    np.testing.assert_allclose(pool.take(np.arange(40)) * 0.5 + 0.5, x[:, None] / 255, atol=1e-6)
    parts = describe_partition(DataSpec(dataset="npz", root=str(path), num_clients=4, partition={"kind": "iid"}))
    assert [r["n_train"] + r["n_test"] for r in parts] == [10, 10, 10, 10]


def test_npz_refuses_pickled_arrays(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, x=np.array([object()] * 4, dtype=object), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(DataError, match="pickle"):
        load_pool(DataSpec(dataset="npz", root=str(path)))
    np.savez(tmp_path / "nolabels.npz", x=np.zeros((4, 3, 3), np.uint8))
    with pytest.raises(DataError, match="'y'"):
        load_pool(DataSpec(dataset="npz", root=str(tmp_path / "nolabels.npz")))


def test_imagefolder_loads_png_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls, level in (("cat", 40), ("dog", 200)):
        (tmp_path / cls).mkdir()
        for j in range(5):
            arr = np.clip(rng.normal(level, 10, size=(12, 10)), 0, 255).astype(np.uint8)
            Image.fromarray(arr, mode="L").save(tmp_path / cls / f"{j}.png")
    # an odd-sized image is resized to the common size
    Image.fromarray(np.full((24, 20), 200, np.uint8), mode="L").save(tmp_path / "dog" / "big.PNG")
    s = DataSpec(dataset="imagefolder", root=str(tmp_path), num_clients=1)
    pool = load_pool(s)
    assert pool.class_names == ["cat", "dog"] and pool.pixels.shape == (11, 1, 12, 10)
    assert np.array_equal(np.bincount(pool.y), [5, 6])
    raw = pool.take(np.arange(11)) * 0.5 + 0.5
    assert raw[pool.y == 0].mean() < 0.25 < 0.7 < raw[pool.y == 1].mean()
    c = load_client_data(s, 0)
    assert c.num_train + c.num_test == 11 and set(c.y_test) == {0, 1}


def test_imagefolder_rgb_and_class_order_file(tmp_path):
    from PIL import Image

    (tmp_path / "classes.txt").write_text("zebra\nant\nbee\n")
    for cls in ("ant", "zebra"):  # this device holds no bee
        (tmp_path / cls).mkdir()
        for j in range(2):
            Image.fromarray(np.full((4, 4, 3), j * 100, np.uint8), mode="RGB").save(tmp_path / cls / f"{j}.jpg")
    pool = load_pool(DataSpec(dataset="imagefolder", root=str(tmp_path)))
    assert pool.class_names == ["zebra", "ant", "bee"] and pool.input_shape == (3, 4, 4)
    assert sorted(pool.y.tolist()) == [0, 0, 1, 1]
    with pytest.raises(DataError, match="not found"):
        load_pool(DataSpec(dataset="imagefolder", root=str(tmp_path / "nope")))


def test_torchvision_reads_local_root_never_downloads(tmp_path, fmnist):
    pytest.importorskip("torchvision")
    with pytest.raises(DataError, match="never downloads"):
        load_pool(DataSpec(dataset="torchvision", name="MNIST", root=str(tmp_path)))
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, sl in (("train", slice(0, 30)), ("t10k", slice(30, 40))):
        _write_idx(raw / f"{split}-images-idx3-ubyte", fmnist.pixels[sl, 0])
        _write_idx(raw / f"{split}-labels-idx1-ubyte", fmnist.y[sl])
    pool = load_pool(DataSpec(dataset="torchvision", name="MNIST", root=str(tmp_path)))
    assert np.array_equal(pool.pixels, fmnist.pixels[:40]) and np.array_equal(pool.y, fmnist.y[:40])
    with pytest.raises(DataError, match="no dataset"):
        load_pool(DataSpec(dataset="torchvision", name="NoSuchSet", root=str(tmp_path)))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_pool_statistics_are_exact_and_take_no_copy_of_the_pool(dtype):
    """The coordinator and every agent compute them at start: a pool-sized int64 or float64
    temporary was ~440 MB for Fashion-MNIST (the coordinator's peak RSS doubled)."""
    import tracemalloc

    from edgepfl.data.datasets import STATS_CHUNK, _stats

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(5 * STATS_CHUNK + 7, 2, 16, 16)).astype(dtype)
    if dtype == np.float32:
        pixels /= 255
    tracemalloc.start()
    try:
        stats = _stats(pixels)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    as_unit = pixels.astype(np.float64) / (255 if dtype == np.uint8 else 1)
    for c in range(2):
        assert stats["mean"][c] == pytest.approx(as_unit[:, c].mean(), abs=1e-6)
        assert stats["std"][c] == pytest.approx(as_unit[:, c].std(), abs=1e-6)
    # a slice's float64 copy, not the pool's (the pool is 8x one slice here)
    assert peak < 8 * STATS_CHUNK * 16 * 16 * 2, peak
