"""Small real federations for the export / heads / head-tier tests.

:func:`make_run` trains a method for a couple of rounds in-process on scikit-learn's
digits (always present) through the method interface exactly as the coordinator and
agents call it, and writes a coordinator checkpoint; clients from ``NEW_CLIENT`` on
never take part, so they play the new client of an offline head fit.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import numpy as np

from edgepfl.config import DataSpec, MethodSpec, ModelSpec, RunConfig, TrainConfig

NUM_CLIENTS = 6
TRAIN_CLIENTS = (0, 1, 2)
NEW_CLIENT = 5


def data_spec(dataset: str = "digits") -> DataSpec:
    return DataSpec(dataset=dataset, num_clients=NUM_CLIENTS, seed=0)


def client_data(index: int, dataset: str = "digits"):
    from edgepfl.data import load_client_data

    return load_client_data(data_spec(dataset), index)


def client_pixels(index: int, dataset: str = "digits"):
    """Raw pixels and labels of one client (train + test), as a device would store them."""
    from edgepfl.data import client_indices, load_pool

    spec = data_spec(dataset)
    pool = load_pool(spec)
    train, test = client_indices(spec, index)
    idx = np.concatenate([train, test])
    return np.asarray(pool.pixels[idx]), np.asarray(pool.y[idx]), list(pool.class_names)


def make_run(run_dir: Path, method_name: str, *, options: dict | None = None, arch: str = "mlp",
             dataset: str = "digits", rounds: int = 3, feature_dim: int = 32, epochs: int = 2) -> Path:
    """Train ``method_name`` for ``rounds`` on TRAIN_CLIENTS and checkpoint it in ``run_dir``."""
    import torch

    from edgepfl.methods import ClientUpdate, LocalContext, create_method
    from edgepfl.state import CheckpointMeta, save_checkpoint

    torch.manual_seed(0)
    options = dict(options or {})
    method = create_method(method_name, options)
    spec = ModelSpec(arch=arch, feature_dim=feature_dim)
    train = TrainConfig(epochs=epochs, batch_size=32, lr=0.05, momentum=0.5)
    datas = [client_data(i, dataset) for i in TRAIN_CLIENTS]
    first = datas[0]
    model = method.build_model(spec, first.input_shape, first.num_classes)
    state = method.init_server(model)
    models = [copy.deepcopy(model) for _ in datas]
    for rnd in range(rounds):
        updates = []
        for i, (m, d) in enumerate(zip(models, datas)):
            ctx = LocalContext(train=train, device="cpu", round=rnd, seed=0, num_classes=d.num_classes,
                               generator=torch.Generator().manual_seed(1000 * rnd + i))
            method.receive(m, method.payload_for(state, f"a{i}"), ctx)
            res = method.local_update(m, d.to_torch(), ctx)
            updates.append(ClientUpdate(f"a{i}", d.num_train, res.upload))
        state = method.server_step(state, updates, rnd)
    run = RunConfig(method=MethodSpec(name=method_name, **options), model=spec, train=train, data=data_spec(dataset),
                    rounds=rounds)
    meta = CheckpointMeta(
        round=rounds - 1,
        run=run.run_spec(first.input_shape, first.num_classes, first.class_names, first.normalization),
        data_spec=run.data,
    )
    save_checkpoint(Path(run_dir) / "checkpoint", state, meta)
    return Path(run_dir)


#: exports made in this process, by their arguments (a folder holding the run and its export):
#: the same arguments train and export the same bits (seeded), so a later call copies them
_EXPORTS: dict[tuple, Path] = {}
_EXPORTS_ROOT: list[tempfile.TemporaryDirectory] = []


def export_dir(tmp: Path, method_name: str, **kwargs) -> Path:
    """A trained run of ``method_name`` exported with :func:`edgepfl.export.onnx_export.export_run`:
    ``tmp/run-<method>`` and ``tmp/export-<method>`` (trained once per arguments in a session, then copied)."""
    from edgepfl.export.onnx_export import export_run

    run_name, export_name = f"run-{method_name}", f"export-{method_name}"
    key = (method_name, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    cached = _EXPORTS.get(key)
    if cached is not None:
        shutil.copytree(cached / run_name, tmp / run_name)
        shutil.copytree(cached / export_name, tmp / export_name)
        return tmp / export_name
    run = make_run(tmp / run_name, method_name, **kwargs)
    calibration = np.concatenate([client_data(i, kwargs.get("dataset", "digits")).x_train for i in TRAIN_CLIENTS])
    export_run(run, tmp / export_name, calibration=calibration)
    if not _EXPORTS_ROOT:
        _EXPORTS_ROOT.append(tempfile.TemporaryDirectory(prefix="edgepfl-exports-"))
    keep = Path(_EXPORTS_ROOT[0].name) / str(len(_EXPORTS))
    shutil.copytree(tmp / run_name, keep / run_name)
    shutil.copytree(tmp / export_name, keep / export_name)
    _EXPORTS[key] = keep
    return tmp / export_name


#: repository root, the working directory for subprocesses that import this checkout
REPO_ROOT_HINT = str(Path(__file__).resolve().parent.parent)


def write_device_files(tmp: Path, manifest, artifact: bytes, data) -> None:
    """What a fresh interpreter needs to play a head device (:data:`DEVICE_PREAMBLE`): the
    release's encoder and manifest, and the device's data as arrays (digits come from
    scikit-learn, which the device's process must not import)."""
    (tmp / "encoder.onnx").write_bytes(artifact)
    (tmp / "manifest.json").write_text(manifest.model_dump_json())
    np.savez(tmp / "data.npz", x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)


#: the opening of a head device's script (``{tmp}``: the folder of :func:`write_device_files`):
#: ``data``, ``manifest`` and ``artifact`` loaded without scikit-learn or torch
DEVICE_PREAMBLE = """
import json, sys
from pathlib import Path
import numpy as np
from edgepfl.data.client import ClientData
from edgepfl.protocol import read_manifest

tmp = Path({tmp!r})
arrays = np.load(tmp / "data.npz")
data = ClientData(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], 10)
manifest = read_manifest(tmp / "manifest.json")
artifact = (tmp / "encoder.onnx").read_bytes()
"""
