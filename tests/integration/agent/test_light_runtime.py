"""A head tier that fits a Raspberry Pi: inference never loads scikit-learn, scipy or torch, and
out of memory is reported as out of memory (exit code 6), never as a missing extra (5).

Real exported encoder and head files, run by onnxruntime in fresh interpreters; the memory
failures are real too, under an address-space limit (``RLIMIT_AS``) low enough to fail.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.export.heads import META_ENCODER_SHA, head_to_onnx
from edgepfl.export.predict import OnnxEncoder
from edgepfl.heads.estimators import generic_head
from edgepfl.heads.labels import LabelSpace

from tests.export_fixtures import (
    DEVICE_PREAMBLE,
    NEW_CLIENT,
    REPO_ROOT_HINT,
    client_data,
    client_pixels,
    export_dir,
    write_device_files,
)

HEAVY = ("sklearn", "scipy", "torch", "skl2onnx")
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A real encoder release, an lr head fitted on a new client's features, and its raw pixels."""
    tmp = tmp_path_factory.mktemp("light")
    release = export_dir(tmp, "fedavg", rounds=1)
    encoder = OnnxEncoder.from_dir(release)
    data = client_data(NEW_CLIENT)
    head = generic_head("lr").fit(encoder.features(data.x_train), data.y_train)
    head_path = tmp / "head.onnx"
    head_to_onnx(head, encoder.feature_dim, head_path, labels=LabelSpace(tuple(data.class_names), "federation"),
                 metadata={META_ENCODER_SHA: encoder.sha256})
    pixels, _, _ = client_pixels(NEW_CLIENT)
    np.save(tmp / "pixels.npy", pixels[:16])
    expected = [data.class_names[c] for c in head.predict(encoder.features(encoder.preprocess(pixels[:16])))]
    return {"encoder": release / "encoder.onnx", "head": head_path, "pixels": tmp / "pixels.npy",
            "expected": expected, "tmp": tmp}


def _limited(limit_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


def _predict_args(exported) -> list[str]:
    return ["predict", "--encoder", str(exported["encoder"]), "--head", str(exported["head"]), str(exported["pixels"]),
            "--json"]


def test_predict_loads_neither_scikit_learn_scipy_nor_torch(exported):
    script = textwrap.dedent(f"""
        import json, sys
        from edgepfl.cli import main
        rc = main({_predict_args(exported)!r})
        heavy = sorted({{k.split(".")[0] for k in sys.modules}} & set({HEAVY!r}))
        print(json.dumps({{"rc": rc, "heavy": heavy}}), file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT_HINT)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result == {"rc": 0, "heavy": []}, proc.stderr
    predicted = [json.loads(line)["predictions"][0]["class"] for line in proc.stdout.splitlines()]
    assert predicted == exported["expected"]  # the same classes the scikit-learn head predicts


def test_a_head_agent_imports_no_run_side_module():
    """What a head agent imports before it connects (the ``agent`` command's imports, the
    agent loop, the head runtime) holds no run config, aggregation, simulation of a fleet's
    rounds or method registry: on a Pi each costs start-up time and memory for nothing
    (the head tier's import budget)."""
    script = textwrap.dedent("""
        import json, sys
        import edgepfl.cli
        from edgepfl.agent_config import load_agent_config
        from edgepfl.config_loading import ConfigError
        from edgepfl.edge_agent import run_agent
        from edgepfl.edge_agent.head_tier import HeadRuntime
        print(json.dumps(sorted(k for k in sys.modules if k.startswith("edgepfl"))))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "edgepfl.edge_agent.head_tier" in loaded  # the script imported what it says it did
    run_side = {"edgepfl.config", "edgepfl.aggregation", "edgepfl.methods", "edgepfl.coordinator"}
    assert not loaded & run_side, sorted(loaded & run_side)


def test_predict_out_of_memory_is_reported_as_out_of_memory_not_a_missing_extra(exported):
    """Under an address-space limit a library cannot be mapped (an ImportError, "failed to map
    segment"), or an allocation fails (MemoryError): either is exit code 6 and one line that
    says out of memory. Limits just below what predict needs here (about 200 MB of address
    space); which step fails first depends on the platform, so several are tried."""
    codes = {}
    for mb in (130, 150, 170):
        proc = subprocess.run([sys.executable, "-m", "edgepfl", *_predict_args(exported)], capture_output=True,
                              text=True, timeout=120, cwd=REPO_ROOT_HINT, preexec_fn=_limited(mb * MiB))
        codes[mb] = proc.returncode
        assert "not installed" not in proc.stderr and "pip install" not in proc.stderr, proc.stderr
        if proc.returncode != 0:
            assert proc.returncode == 6, (mb, proc.stderr[-2000:])
            last = proc.stderr.strip().splitlines()[-1]
            assert last.startswith("edgepfl: out of memory") and "run it again" in last, last
    assert 6 in codes.values(), codes


def test_a_head_agent_that_cannot_load_onnxruntime_for_lack_of_memory_exits_6_not_5(exported, tmp_path):
    """What a head agent on a Pi used to say: "needs onnxruntime, which is not installed" (exit 5, which the
    example unit never restarts) for a library that could not be mapped."""
    pixels, y, names = client_pixels(NEW_CLIENT)
    np.savez(tmp_path / "own.npz", x=pixels, y=y, class_names=np.asarray(names))
    config = {"agent_id": "pi", "federation": "memory", "tier": "head", "head": "lr",
              "broker": {"url": "mqtt://127.0.0.1:9"}, "data": {"dataset": "npz", "root": str(tmp_path / "own.npz"),
                                                                "num_clients": 1},
              "state_dir": str(tmp_path / "state")}
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "edgepfl", "agent", "--config", str(tmp_path / "agent.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT_HINT,
                          preexec_fn=_limited(150 * MiB))
    assert proc.returncode == 6, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("edgepfl: out of memory") and "not installed" not in last, last


def test_the_fitting_child_is_where_scikit_learn_goes(exported, tmp_path):
    """A head agent's fit runs in a child process (edge_agent/head_fit.py): the parent that
    installs a release, evaluates and predicts never holds the fitting libraries."""
    from edgepfl.export.onnx_export import read_release

    manifest, artifact = read_release(Path(exported["encoder"]).parent)
    write_device_files(tmp_path, manifest, artifact, client_data(NEW_CLIENT))
    script = DEVICE_PREAMBLE.format(tmp=str(tmp_path)) + textwrap.dedent(f"""
        from edgepfl.edge_agent.head_tier import HeadRuntime

        rt = HeadRuntime(tmp / "state", "lr", data)
        m = rt.install_release(manifest, artifact, manifest.encoder.sha256)
        again = HeadRuntime(tmp / "state", "lr", data)
        again.load()
        same = bool((again.predict(data.x_test) == rt.predict(data.x_test)).all())
        new = sorted({{k.split(".")[0] for k in sys.modules}} & set({HEAVY!r}))
        print(json.dumps({{"accuracy": m.accuracy, "same": same, "new_heavy": new}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["new_heavy"] == [] and result["same"] and result["accuracy"] > 0.5, result


def test_out_of_memory_during_an_install_keeps_the_release_to_install_again_not_refused(exported, tmp_path):
    """What a head agent on a Pi used to do: a good release refused as bad (never retried) when memory ran out
    while it was installed. Here the address space is capped just above what the agent holds
    once it is up (the fit child inherits the cap): the install fails as OutOfMemory — never a
    refusal, nothing installed — and the same release installs once memory is back."""
    from edgepfl.export.onnx_export import read_release

    manifest, artifact = read_release(Path(exported["encoder"]).parent)
    write_device_files(tmp_path, manifest, artifact, client_data(NEW_CLIENT))
    script = DEVICE_PREAMBLE.format(tmp=str(tmp_path)) + textwrap.dedent("""
        import resource
        from edgepfl.edge_agent.head_tier import HeadRuntime, ReleaseRefused
        from edgepfl.errors import OutOfMemory

        rt = HeadRuntime(tmp / "state", "lr", data)
        held = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
        outcomes = []
        for margin_mb in (4, 32, 128):
            resource.setrlimit(resource.RLIMIT_AS, (held + margin_mb * 2**20, resource.RLIM_INFINITY))
            try:
                rt.install_release(manifest, artifact, manifest.encoder.sha256)
                outcomes.append("installed")
            except OutOfMemory:  # and the previous state kept: here, nothing installed
                installed = (tmp / "state" / "release.json").exists() or rt.release_id is not None
                outcomes.append("out_of_memory, yet installed" if installed else "out_of_memory")
            except ReleaseRefused as exc:
                outcomes.append("refused: " + str(exc))
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            if outcomes[-1] != "out_of_memory":
                break
        if outcomes[-1] == "out_of_memory":
            rt.install_release(manifest, artifact, manifest.encoder.sha256)  # memory is back: the same release
            outcomes.append("installed")
        print(json.dumps({"outcomes": outcomes, "installed": rt.release_id == manifest.release_id}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    outcomes = result["outcomes"]
    assert outcomes[0] == "out_of_memory", result  # the cap bit: this test measures something
    assert all(o in ("out_of_memory", "installed") for o in outcomes), result  # never refused
    assert outcomes[-1] == "installed" and result["installed"], result
