"""A series release carries its input contract: ``fit-head``, ``predict``, ``serve`` and a head
agent read raw sensor windows (npz or a CSV log, any range) and apply the manifest's
normalization with numpy alone, so their classes are those of the torch model on the same
windows; a window of another shape is one line with the data exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgepfl.config import MethodSpec, ModelSpec, RunConfig
from edgepfl.errors import ExitCode
from edgepfl.specs import CsvSpec, DataSpec

from tests.export_fixtures import REPO_ROOT_HINT

pytest.importorskip("onnxruntime")
pytest.importorskip("sklearn")

CHANNELS, WINDOW, CLASSES = 6, 100, ("idle", "walk", "run", "fall")


def write_log(path: Path, seed: int, *, offset: float = 0.0, label: bool = True) -> Path:
    """A sensor log of 6 channels in raw units (hundreds, ±tens), each class a stretch of rows
    with its own frequency, twice over; ``offset`` shifts every channel (another sensor)."""
    rng = np.random.default_rng(seed)
    lines = [",".join((["label"] if label else []) + [f"c{i}" for i in range(CHANNELS)])]
    for _ in range(2):
        for k, name in enumerate(CLASSES):
            t = np.arange(260)[:, None]
            values = (100 * np.arange(CHANNELS) + offset + 30 * np.sin(t * (k + 1) / 9 + np.arange(CHANNELS))
                      + rng.normal(0, 3, (len(t), CHANNELS)))
            lines += [",".join(([name] if label else []) + [f"{v:.3f}" for v in row]) for row in values]
    path.write_text("\n".join(lines) + "\n")
    return path


def raw_windows(path: Path, stride: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    from edgepfl.data.sensors import read_csv_windows

    x, y, _, _ = read_csv_windows(path, CsvSpec(window=WINDOW, stride=stride, classes=list(CLASSES)), labelled=False)
    return x, y


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A FedAvg cnn1d run on a CSV log, untrained, exported as a coordinator exports it."""
    import torch

    from edgepfl.data import load_client_data
    from edgepfl.export.onnx_export import export_state
    from edgepfl.methods import create_method
    from edgepfl.state import CheckpointMeta

    tmp = tmp_path_factory.mktemp("series-release")
    spec = DataSpec(dataset="csv", root=str(write_log(tmp / "fleet.csv", 0)),
                    csv=CsvSpec(window=WINDOW, stride=50, classes=list(CLASSES)), num_clients=1)
    data = load_client_data(spec, 0)
    torch.manual_seed(0)
    method = create_method("fedavg", {})
    model_spec = ModelSpec(arch="cnn1d", feature_dim=16)
    model = method.build_model(model_spec, data.input_shape, data.num_classes)
    run = RunConfig(method=MethodSpec(name="fedavg"), model=model_spec, data=spec, rounds=1)
    meta = CheckpointMeta(round=0, data_spec=spec,
                          run=run.run_spec(data.input_shape, data.num_classes, data.class_names, data.normalization))
    export_state(method.init_server(model), meta, tmp / "export", calibration=data.x_train)
    return tmp, method.encoder_module(model).eval()


def torch_classes(release, head_file: Path, raw: np.ndarray) -> np.ndarray:
    """The classes of the in-process model on raw windows: the manifest's normalization and
    the encoder in torch, then the fitted head."""
    tmp, encoder = release
    return model_classes(encoder, tmp / "export" / "manifest.json", head_file, raw)


def model_classes(encoder, manifest_file: Path, head_file: Path, raw: np.ndarray) -> np.ndarray:
    """The classes of the torch ``encoder`` (eval mode) and the head in ``head_file`` on raw
    windows normalized as the release's manifest says, computed in torch."""
    import torch

    from edgepfl.export.heads import OnnxHead
    from edgepfl.protocol.manifest import read_manifest

    norm = read_manifest(manifest_file).run.data.normalization
    assert norm is not None
    mean = torch.tensor(norm.mean, dtype=torch.float64).view(1, -1, 1)
    std = torch.tensor(norm.std, dtype=torch.float64).view(1, -1, 1)
    x = ((torch.from_numpy(raw).double() - mean) / std).float()
    with torch.no_grad():
        features = encoder(x).numpy()
    head = OnnxHead.load(head_file)
    return head.classes_[np.argmax(head.predict_proba(features), axis=1)]


#: the opening of a script for ``python -c`` in which any import of torch fails: the head path has none
NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

    sys.meta_path.insert(0, NoTorch)
""")


def run_cli(script: str) -> dict:
    """``script`` in a fresh interpreter in which importing torch fails; its last JSON line."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fit_head_and_predict_on_npz_and_csv_agree_with_torch_without_importing_it(release, tmp_path):
    export = release[0] / "export"
    device_log = write_log(tmp_path / "device.csv", 1, offset=7.0)
    x, y = raw_windows(device_log, stride=50)
    np.savez(tmp_path / "device.npz", x=x, y=y, class_names=np.array(CLASSES))
    unlabelled = write_log(tmp_path / "unlabelled.csv", 2, label=False)
    np.savez(tmp_path / "windows.npz", x=raw_windows(device_log)[0])  # no labels: predict needs none
    out = run_cli(f"""
        import contextlib, io, json
        from edgepfl.export.fit_head import main_fit_head
        from edgepfl.export.predict import main_predict

        enc, tmp, got = {str(export / "encoder.onnx")!r}, {str(tmp_path)!r}, {{}}
        for data in ("device.npz", "device.csv"):
            head = f"{{tmp}}/head-{{data}}.onnx"
            assert main_fit_head(["--encoder", enc, "--data", f"{{tmp}}/{{data}}", "--head", "lr", "--out", head,
                                  "--json"]) == 0
            for inputs in (["windows.npz"], ["device.csv"], ["unlabelled.csv"]):
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    assert main_predict(["--encoder", enc, "--head", head, "--json",
                                         *(f"{{tmp}}/{{i}}" for i in inputs)]) == 0
                rows = [json.loads(line) for line in buf.getvalue().splitlines()]
                got[f"{{data}} {{inputs[0]}}"] = [r["predictions"][0]["index"] for r in rows]
        got["torch"] = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
        print(json.dumps(got))
    """)
    assert out.pop("torch") == []
    windows = {"windows.npz": raw_windows(device_log)[0], "device.csv": raw_windows(device_log)[0],
               "unlabelled.csv": raw_windows(unlabelled)[0]}
    for key, classes in out.items():
        data, inputs = key.split()
        want = torch_classes(release, tmp_path / f"head-{data}.onnx", windows[inputs])
        assert len(classes) == len(want) == len(windows[inputs]) > 0
        assert classes == want.tolist(), key


def test_a_head_agent_fits_on_its_own_csv_and_serve_answers_with_the_torch_models_classes(release, tmp_path):
    from edgepfl.edge_agent.head_tier import read_installed

    export = release[0] / "export"
    device_log = write_log(tmp_path / "agent.csv", 3, offset=-20.0)  # its own sensor: its own normalization
    state = tmp_path / "agent-state"
    out = run_cli(f"""
        import json
        from edgepfl.data import load_client_data
        from edgepfl.edge_agent.head_tier import HeadRuntime
        from edgepfl.edge_agent.serve import ModelServer
        from edgepfl.export.onnx_export import read_release
        from edgepfl.specs import CsvSpec, DataSpec
        from pathlib import Path

        spec = DataSpec(dataset="csv", root={str(device_log)!r}, num_clients=1,
                        csv=CsvSpec(window={WINDOW}, stride=50, classes={list(CLASSES)!r}))
        data = load_client_data(spec, 0)
        manifest, artifact = read_release({str(export)!r})
        fit = HeadRuntime({str(state)!r}, "lr", data).install_release(manifest, artifact, manifest.encoder.sha256)
        server = ModelServer({str(state)!r})
        answer = server.answer([{str(device_log)!r}])
        assert answer.error is None, answer.error

        # a watch folder of a series release: its CSV answered, a file of another shape failed
        import io, shutil, threading
        import numpy as np
        from edgepfl.edge_agent.serve import serve_folder
        inbox = Path({str(tmp_path / "inbox")!r})
        inbox.mkdir()
        shutil.copy({str(device_log)!r}, inbox / "log.csv")
        np.savez(inbox / "short.npz", x=np.zeros((2, {CHANNELS}, {WINDOW} - 1), np.float32))
        (inbox / "photo.png").write_bytes(b"not looked at")
        stop, watched = threading.Event(), {{}}
        for a in serve_folder(server, inbox, io.StringIO(), stop, poll_s=0.01):
            watched[a.id] = a.error or [r["predictions"][0]["index"] for r in a.results]
            if len(watched) == 2:
                stop.set()
        print(json.dumps({{"classes": [r["predictions"][0]["index"] for r in answer.results],
                          "watched": watched, "left": sorted(p.name for p in inbox.iterdir() if p.is_file()),
                          "failed": sorted(p.name for p in (inbox / "failed").iterdir()),
                          "num_train": fit.num_train,
                          "torch": sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))}}))
    """)
    assert out["torch"] == [] and out["num_train"] > 0
    head_file = state / read_installed(state).head_file
    assert out["classes"] == torch_classes(release, head_file, raw_windows(device_log)[0]).tolist()
    assert out["watched"]["log.csv"] == out["classes"]
    assert "series inputs must be (N, 6, 100), got (2, 6, 99)" in out["watched"]["short.npz"]
    assert out["failed"] == ["short.npz"] and out["left"] == ["photo.png"]  # an image is not a series' input


def test_windows_of_another_shape_are_one_line_with_the_data_exit_code(release, tmp_path, capsys):
    from edgepfl.export.fit_head import main_fit_head
    from edgepfl.export.predict import main_predict

    encoder = str(release[0] / "export" / "encoder.onnx")
    head = str(tmp_path / "head.onnx")
    assert main_fit_head(["--encoder", encoder, "--data", str(write_log(tmp_path / "log.csv", 4)), "--head", "lr",
                          "--out", head]) == 0
    np.savez(tmp_path / "five.npz", x=np.zeros((3, CHANNELS - 1, WINDOW), np.float32))
    capsys.readouterr()
    code = main_predict(["--encoder", encoder, "--head", head, str(tmp_path / "five.npz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.DATA
    assert len(err) == 1 and err[0].startswith("edgepfl: series inputs must be (N, 6, 100), got (3, 5, 100)"), err
