"""Heads on real releases: sklearn estimator contract, ONNX parity for every kind, fusion, fit-head / predict CLI.

Heads are obtained as a device obtains them: from the release's method (``Method.make_head``).
scikit-learn's own estimator checks of every generic head: tests/contract/test_heads_sklearn_checks.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from edgepfl.errors import ExitCode
from edgepfl.export.fit_head import main_fit_head
from edgepfl.export.heads import OnnxHead, fuse, head_to_onnx, make_session
from edgepfl.export.predict import OnnxEncoder, main_predict
from edgepfl.heads import GENERIC_HEAD_KINDS, HeadRelease
from edgepfl.methods import create_method
from edgepfl.protocol import read_manifest

from tests.export_fixtures import NEW_CLIENT, TRAIN_CLIENTS, client_data, client_pixels, export_dir

# the method whose release a head kind belongs to
RELEASE_OF = {"svm": "fedavg", "lr": "fedavg", "mlp": "fedavg", "dualfed": "dualfed", "fedpick": "fedpick"}
HEAD_KINDS = tuple(RELEASE_OF)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("releases")
    return {m: export_dir(tmp, m, rounds=2) for m in ("fedavg", "dualfed", "fedpick")}


@pytest.fixture(scope="module")
def new_client(tmp_path_factory):
    """The never-seen client's raw pixels as a .npz (what a device owner would hand over)."""
    tmp = tmp_path_factory.mktemp("client")
    px, y, _ = client_pixels(NEW_CLIENT)
    np.savez(tmp / "client.npz", x=px, y=y)
    np.save(tmp / "images.npy", px[:12])
    return {"npz": tmp / "client.npz", "npy": tmp / "images.npy", "pixels": px, "y": y}


def _features(release, index):
    enc = OnnxEncoder.from_dir(release)
    d = client_data(index)
    return enc, enc.features(d.x_train), d.y_train, enc.features(d.x_test), d.y_test


def make_head(release, kind, **params):
    """A new head of ``kind`` for an exported ``release``, from the release's method."""
    hr = HeadRelease.from_manifest(read_manifest(release / "manifest.json"), release)
    return create_method(hr.method, hr.method_options).make_head(kind, hr, **params)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_sklearn_estimator_contract(kind, releases):
    release = releases[RELEASE_OF[kind]]
    head = make_head(release, kind)
    # clone() and get_params/set_params round-trip: nothing is done in __init__
    twin = clone(head)
    assert twin.get_params() == head.get_params()
    assert type(head)(**head.get_params()).get_params() == head.get_params()
    head.set_params(**head.get_params())
    with pytest.raises(NotFittedError):
        head.predict_proba(np.zeros((1, 32), np.float32))
    before = set(vars(head))
    _, f_tr, y_tr, f_te, _ = _features(release, TRAIN_CLIENTS[0])
    head.fit(f_tr, y_tr)
    learned = set(vars(head)) - before
    assert learned and all(a.endswith("_") for a in learned), learned
    assert head.n_features_in_ == 32
    proba = head.predict_proba(f_te)
    assert proba.shape == (len(f_te), len(head.classes_))
    np.testing.assert_allclose(proba.sum(1), 1, atol=1e-5)
    np.testing.assert_array_equal(head.predict(f_te), head.classes_[proba.argmax(1)])
    # a clone of a fitted head is unfitted again
    with pytest.raises(NotFittedError):
        clone(head).predict(f_te)


def test_unknown_head_kind(releases):
    with pytest.raises(ValueError, match="does not fit a fedavg encoder"):
        make_head(releases["fedavg"], "knn")


def test_single_class_data_is_refused_clearly(releases):
    with pytest.raises(ValueError, match="at least 2 classes"):
        make_head(releases["fedavg"], "lr").fit(np.random.rand(5, 4).astype(np.float32), np.zeros(5, int))


# --------------------------------------------------------------------------- ONNX parity
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_head_onnx_parity_on_real_features(kind, releases, tmp_path):
    release = releases[RELEASE_OF[kind]]
    _, f_tr, y_tr, f_te, _ = _features(release, NEW_CLIENT)
    head = make_head(release, kind).fit(f_tr, y_tr)
    path = tmp_path / f"{kind}.onnx"
    head_to_onnx(head, 32, path)
    onnx_head = OnnxHead.load(path)
    assert onnx_head.head_kind_ == kind
    np.testing.assert_array_equal(onnx_head.classes_, head.classes_)
    x = np.concatenate([f_tr, f_te])
    assert np.abs(onnx_head.predict_proba(x) - head.predict_proba(x)).max() <= 1e-4
    np.testing.assert_array_equal(onnx_head.predict(x), head.predict(x))
    # the label output of the graph itself agrees too
    labels = make_session(path).run(["label"], {"features": x})[0]
    np.testing.assert_array_equal(labels, head.predict(x))


@pytest.mark.parametrize("kind", GENERIC_HEAD_KINDS)
def test_binary_heads_export_two_probability_columns(kind, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    y = np.where(x[:, 0] > 0, 7, 3)  # labels need not start at 0
    head = create_method("fedavg").make_head(kind).fit(x, y)
    head_to_onnx(head, 8, tmp_path / "h.onnx")
    oh = OnnxHead.load(tmp_path / "h.onnx")
    assert oh.predict_proba(x).shape == (60, 2)
    assert np.abs(oh.predict_proba(x) - head.predict_proba(x)).max() <= 1e-4
    np.testing.assert_array_equal(oh.predict(x), head.predict(x))
    assert set(oh.predict(x)) <= {3, 7}


def test_torch_heads_keep_the_federations_global_classifier(releases):
    from edgepfl.atomic import read_tensors

    for kind in ("dualfed", "fedpick"):
        release = releases[kind]
        glob = read_tensors(release / "global_heads.safetensors")
        _, f_tr, y_tr, _, _ = _features(release, NEW_CLIENT)
        head = make_head(release, kind).fit(f_tr, y_tr)
        for key, value in glob.items():
            np.testing.assert_array_equal(head.state_[key], value)
        # and it learned its personal parts: better than the global classifier alone
        assert (head.predict(f_tr) == y_tr).mean() > 0.5


def test_dualfed_head_needs_a_dualfed_release_and_its_global_heads(releases, tmp_path):
    fedavg = HeadRelease.from_manifest(read_manifest(releases["fedavg"] / "manifest.json"), releases["fedavg"])
    with pytest.raises(ValueError, match="needs a dualfed encoder"):
        create_method("dualfed").make_head("dualfed", fedavg)
    # a DualFed release whose files are not at hand (a device that received only the encoder)
    manifest = read_manifest(releases["dualfed"] / "manifest.json")
    for hr in (HeadRelease.from_manifest(manifest), HeadRelease.from_manifest(manifest, tmp_path)):
        with pytest.raises(ValueError, match="needs the federation's global heads"):
            create_method("dualfed").make_head("dualfed", hr)


def test_fused_encoder_and_head_match_the_two_steps(releases, tmp_path):
    release = releases["fedavg"]
    enc, f_tr, y_tr, _, _ = _features(release, NEW_CLIENT)
    head = make_head(release, "svm").fit(f_tr, y_tr)
    head_to_onnx(head, 32, tmp_path / "svm.onnx")
    fuse(release / "encoder.onnx", tmp_path / "svm.onnx", tmp_path / "fused.onnx")
    x = client_data(NEW_CLIENT).x_test
    labels, proba = make_session(tmp_path / "fused.onnx").run(["label", "probabilities"], {"input": x})
    two_step = OnnxHead.load(tmp_path / "svm.onnx").predict_proba(enc.features(x))
    assert np.abs(proba - two_step).max() <= 1e-5
    np.testing.assert_array_equal(labels, head.predict(enc.features(x)))


# --------------------------------------------------------------------------- CLI on a new client
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_fit_head_and_predict_on_a_never_seen_client(kind, releases, new_client, tmp_path, capsys):
    release = releases[RELEASE_OF[kind]]
    out = tmp_path / "head.onnx"
    rc = main_fit_head(["--encoder", str(release / "encoder.onnx"), "--data", str(new_client["npz"]),
                        "--head", kind, "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert report["head"] == kind and report["num_validation"] > 20
    assert report["validation_accuracy"] > 0.5  # ten classes: chance is 0.1
    head = OnnxHead.load(out)
    assert head.encoder_sha256_ == read_manifest(release / "manifest.json").encoder.sha256

    rc = main_predict(["--encoder", str(release / "encoder.onnx"), "--head", str(out), str(new_client["npy"]),
                       "--json"])
    lines = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    assert rc == 0 and len(lines) == 12
    predicted = np.array([ln["predictions"][0]["index"] for ln in lines])
    enc = OnnxEncoder.from_dir(release)
    np.testing.assert_array_equal(predicted, head.predict(enc.features(enc.preprocess(new_client["pixels"][:12]))))
    assert (predicted == new_client["y"][:12]).mean() >= 0.5


def test_new_task_classes_from_an_image_folder(releases, new_client, tmp_path, capsys):
    """A new client with its own classes (not the federation's): sklearn heads learn them by name."""
    from PIL import Image

    px, y = new_client["pixels"], new_client["y"]
    assert px.dtype == np.float32 and px.max() <= 1  # the digits pool: floats in [0, 1]
    names = {0: "zero", 1: "one", 2: "two"}
    root = tmp_path / "photos"
    for i, (img, label) in enumerate(zip(px, y)):
        if label in names:
            (root / names[label]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.round(img[0] * 255).astype(np.uint8)).save(root / names[label] / f"{i}.png")
    out = tmp_path / "lr.onnx"
    release = releases["fedavg"]
    assert main_fit_head(["--encoder", str(release / "encoder.onnx"), "--data", str(root), "--head", "lr",
                          "--out", str(out)]) == 0
    assert "validation accuracy" in capsys.readouterr().out
    # a DualFed head can only predict the federation's classes: refused with a reason
    assert main_fit_head(["--encoder", str(releases["dualfed"] / "encoder.onnx"), "--data", str(root),
                          "--head", "dualfed", "--out", str(tmp_path / "d.onnx")]) == ExitCode.DATA
    assert "federation's classes" in capsys.readouterr().err

    rc = main_predict(["--encoder", str(release / "encoder.onnx"), "--head", str(out), str(root / "two")])
    rows = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(rows) == len(list((root / "two").iterdir()))
    assert sum(r.split("\t")[1].split()[0] == "two" for r in rows) >= 0.6 * len(rows)


def test_head_kind_outside_the_release_is_refused(releases, new_client, tmp_path, capsys):
    rc = main_fit_head(["--encoder", str(releases["fedavg"] / "encoder.onnx"), "--data", str(new_client["npz"]),
                        "--head", "fedpick", "--out", str(tmp_path / "h.onnx")])
    assert rc == ExitCode.DATA and "does not fit a fedavg encoder" in capsys.readouterr().err


@pytest.mark.parametrize("setting, says", [
    ("Cc=1", "--set Cc: the lr head has no parameter 'Cc'; it has C, "),  # not "internal error"
    ("C=-1", "--set: The 'C' parameter of LogisticRegression must be"),  # scikit-learn's own words, as a usage error
    ("C", "--set expects KEY=VALUE"),
])
def test_a_head_parameter_it_does_not_have_or_cannot_take_is_a_usage_error(releases, new_client, tmp_path, capsys,
                                                                          setting, says):
    rc = main_fit_head(["--encoder", str(releases["fedavg"] / "encoder.onnx"), "--data", str(new_client["npz"]),
                        "--head", "lr", "--set", setting, "--out", str(tmp_path / "h.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.USAGE and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "h.onnx").exists()


def _scaled_blobs(scale: float, n: int = 120, d: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    centers = rng.normal(size=(3, d))
    return (scale * (centers[y] + 1.5 * rng.normal(size=(n, d)))).astype(np.float32), y


@pytest.mark.parametrize("kind", ["lr", "svm"])
def test_linear_heads_choose_C_by_stratified_cross_validation(kind):
    from sklearn.model_selection import cross_val_score

    from edgepfl.heads import DEFAULT_C_GRID, generic_head

    for scale in (0.01, 1.0):  # tiny features need weak regularization, larger ones less so
        X, y = _scaled_blobs(scale)
        head = generic_head(kind).fit(X, y)
        # the rule, computed independently: the i-th row of a class in fold i mod 3 (docs/METHODS.md,
        # "Head estimators"), the best mean fold accuracy, ties to the first grid value
        position = np.array([np.sum(y[:i] == y[i]) for i in range(len(y))])
        folds = [(np.flatnonzero(position % 3 != k), np.flatnonzero(position % 3 == k)) for k in range(3)]
        reference = [cross_val_score(generic_head(kind, C=c), X, y, cv=folds).mean() for c in DEFAULT_C_GRID]
        np.testing.assert_allclose(head.cv_scores_, reference)
        assert head.C_ == DEFAULT_C_GRID[int(np.argmax(reference))]
        assert head.get_params()["C"] is None  # a parameter stays what was given
    # raw features a hundred times smaller need a far weaker penalty than the old fixed C = 1
    assert generic_head(kind, normalize=False).fit(*_scaled_blobs(0.01)).C_ >= 10


def test_given_C_is_used_and_data_too_small_to_split_falls_back():
    from edgepfl.heads import FALLBACK_C, LRHead

    X, y = _scaled_blobs(1.0)
    fixed = LRHead(C=0.5).fit(X, y)
    assert fixed.C_ == 0.5 and not hasattr(fixed, "cv_scores_")
    tiny = LRHead().fit(X[:3], y[:3])  # one sample per class: no fold can hold a class out
    assert tiny.C_ == FALLBACK_C and not hasattr(tiny, "cv_scores_")
    skewed = LRHead().fit(X[:40], np.r_[np.zeros(38, int), 1, 2])  # dominant class, singletons
    assert skewed.C_ in skewed.C_grid and len(skewed.cv_scores_) == len(skewed.C_grid)
