"""Right labels end to end: every head records what its labels mean, and predict prints those names.

The bug these tests pin: a head agent fitted its head on the indices of its image
folder's sorted class folders and stored no names; ``edgepfl predict`` then named the
indices with the federation's classes (a Sandal printed as "Dress").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgepfl.heads.labels import FEDERATION, LabelSpace

from tests.export_fixtures import NEW_CLIENT, REPO_ROOT_HINT, client_pixels

# ----------------------------------------------------------------- end to end: folder -> head -> predict

#: digits classes chosen so that the folders' sorted order (0, 1, 2 locally) is not the
#: federation's (3, 7, 9): reading local indices with the federation's names prints "0"/"1"/"2"
FOLDERS = {"9": 9, "3": 3, "7": 7}


def _image_folder(root: Path, folders: dict[str, int]) -> Path:
    from PIL import Image

    pixels, y, _ = client_pixels(NEW_CLIENT)
    for name, digit in folders.items():
        (root / name).mkdir(parents=True)
        for i, px in enumerate(pixels[y == digit]):
            Image.fromarray(np.round(px[0] * 255).astype(np.uint8), mode="L").save(root / name / f"{i:03d}.png")
    return root


def _device_data(folder: Path):
    from edgepfl.config import DataSpec, PartitionSpec
    from edgepfl.data import load_client_data

    spec = DataSpec(dataset="imagefolder", root=str(folder), num_clients=1, partition=PartitionSpec(kind="iid"))
    return load_client_data(spec, 0)


def _predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepfl.cli", "predict", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT_HINT, timeout=120)


def _printed(stdout: str) -> dict[str, str]:
    """input path -> top class name, from ``edgepfl predict --json``."""
    rows = [json.loads(line) for line in stdout.splitlines()]
    return {Path(r["input"]).parent.name + "/" + Path(r["input"]).name: r["predictions"][0]["class"] for r in rows}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from tests.export_fixtures import export_dir

    return export_dir(tmp_path_factory.mktemp("labels"), "fedavg", rounds=2)


def test_head_agent_in_another_folder_order_predicts_the_right_names(release, tmp_path):
    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.export.onnx_export import read_release

    folder = _image_folder(tmp_path / "photos", FOLDERS)
    data = _device_data(folder)
    assert data.class_names == ["3", "7", "9"]  # the device's own numbering: 0, 1, 2
    manifest, artifact = read_release(release)
    rt = HeadRuntime(tmp_path / "state", "lr", data)
    metrics = rt.install_release(manifest, artifact, manifest.encoder.sha256)
    record = json.loads((tmp_path / "state" / "release.json").read_text())
    encoder = tmp_path / "state" / record["encoder_file"]
    head = tmp_path / "state" / record["head_file"]

    done = _predict("--encoder", str(encoder), "--head", str(head), "--json", str(folder))
    assert done.returncode == 0, done.stderr
    printed = _printed(done.stdout)
    assert len(printed) == sum(1 for _ in folder.rglob("*.png"))
    assert set(printed.values()) <= set(FOLDERS), printed  # never a class the device does not have
    right = sum(path.split("/")[0] == name for path, name in printed.items())
    # what predict prints is what the device measured: its accuracy on these very images is
    # about its held-out accuracy, far above chance (1/3) -- mapping through the wrong names gives 0
    assert right / len(printed) > 0.8 and metrics.accuracy > 0.8

    # fit-head on the same folder agrees on the names
    offline = tmp_path / "offline.onnx"
    fit = subprocess.run([sys.executable, "-m", "edgepfl.cli", "fit-head", "--encoder", str(release / "encoder.onnx"),
                          "--data", str(folder), "--head", "lr", "--out", str(offline)],
                         capture_output=True, text=True, cwd=REPO_ROOT_HINT, timeout=120)
    assert fit.returncode == 0, fit.stderr
    done = _predict("--encoder", str(release / "encoder.onnx"), "--head", str(offline), "--json", str(folder))
    assert done.returncode == 0, done.stderr
    offline_printed = _printed(done.stdout)
    assert sum(p.split("/")[0] == n for p, n in offline_printed.items()) / len(offline_printed) > 0.8


def test_a_new_task_keeps_its_own_names_on_device_and_offline(release, tmp_path):
    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.export.onnx_export import read_release

    folder = _image_folder(tmp_path / "pets", {"dog": 1, "cat": 0})
    manifest, artifact = read_release(release)
    rt = HeadRuntime(tmp_path / "state", "svm", _device_data(folder))
    rt.install_release(manifest, artifact, manifest.encoder.sha256)
    assert rt.class_names == ["cat", "dog"]
    record = json.loads((tmp_path / "state" / "release.json").read_text())
    done = _predict("--encoder", str(tmp_path / "state" / record["encoder_file"]),
                    "--head", str(tmp_path / "state" / record["head_file"]), "--json", str(folder))
    assert done.returncode == 0, done.stderr
    printed = _printed(done.stdout)
    assert set(printed.values()) <= {"cat", "dog"}
    assert sum(p.split("/")[0] == n for p, n in printed.items()) / len(printed) > 0.8


def test_predict_refuses_a_missing_manifest_and_a_head_without_names(release, tmp_path):
    from edgepfl.export.heads import head_to_onnx
    from edgepfl.export.predict import OnnxEncoder
    from edgepfl.heads import LRHead

    folder = _image_folder(tmp_path / "photos", {"3": 3})
    encoder = OnnxEncoder.from_dir(release)
    named = tmp_path / "named.onnx"
    x = encoder.preprocess(client_pixels(NEW_CLIENT)[0])
    y = client_pixels(NEW_CLIENT)[1]
    fitted = LRHead().fit(encoder.features(x), y)
    head_to_onnx(fitted, encoder.feature_dim, named, labels=LabelSpace(tuple(encoder.class_names), FEDERATION))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(release / "encoder.onnx", bare / "encoder.onnx")

    done = _predict("--encoder", str(bare / "encoder.onnx"), "--head", str(named), str(folder))
    assert done.returncode == 3 and "no manifest.json" in done.stderr and not done.stdout
    done = _predict("--encoder", str(bare / "encoder.onnx"), "--head", str(named), "--without-manifest", str(folder))
    assert done.returncode == 0 and "NOT normalized" in done.stderr

    unnamed = tmp_path / "unnamed.onnx"
    head_to_onnx(fitted, encoder.feature_dim, unnamed)
    done = _predict("--encoder", str(release / "encoder.onnx"), "--head", str(unnamed), str(folder))
    assert done.returncode == 3 and "records no class names" in done.stderr
    done = _predict("--encoder", str(release / "encoder.onnx"), "--head", str(unnamed), "--federation-labels",
                    "--json", str(folder))
    assert done.returncode == 0
    with_names = _predict("--encoder", str(release / "encoder.onnx"), "--head", str(named), "--json", str(folder))
    assert _printed(done.stdout) == _printed(with_names.stdout)
