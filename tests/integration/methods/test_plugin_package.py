"""A third party's plugin package, pip-installed into an environment of its own, used through its
entry points alone.

tests/plugins/edgepfl_toy_plugin is such a package: a 1-D CNN for sensor windows in the
``edgepfl.models`` group (``toy-cnn1d``) and a personalized method in ``edgepfl.methods``
(``smooth_per``), with its own tests that run edgepfl's public checks. A second package,
written here, declares entry points whose module cannot be imported (a dependency it lacks).
Both are built and installed by pip (offline: no index, no build isolation) into a fresh
virtual environment whose only other packages are this interpreter's (edgepfl, torch, pytest),
reached through a ``.pth`` file; every command runs in a subprocess of that environment:

* the package's own tests pass (the method contract, its heads, its encoder under its
  entry-point name), and a mutant of its method that uploads its personal classifier fails
  exactly the checks that look at what is uploaded: the public check can fail;
* ``edgepfl simulate`` trains the plugin encoder with the plugin method by their names on raw
  sensor windows, over an embedded Mosquitto with agent processes of that environment: the
  server holds the plugin encoder's tensors, each device its classifier, and the exported
  encoder reaches a torch-free head agent that fits its head on it;
* with the broken package installed beside it, a run that names one of its entry points is
  refused in one line naming the entry point, and edgepfl's own contract suites still collect
  and pass (they check the built-in methods; a plugin's own tests check the plugin).
"""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.atomic import read_tensors

from tests.fleet_helpers import checkpoint_tensors

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "tests" / "plugins" / "edgepfl_toy_plugin"

#: a plugin package whose entry points name a module that needs a dependency nobody installed
BROKEN = {
    "pyproject.toml": """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "edgepfl-broken-plugin"
version = "0.1.0"

[project.entry-points."edgepfl.models"]
broken-cnn = "edgepfl_broken_plugin:build"

[project.entry-points."edgepfl.methods"]
broken_method = "edgepfl_broken_plugin:Broken"

[tool.setuptools]
packages = ["edgepfl_broken_plugin"]
""",
    "edgepfl_broken_plugin/__init__.py": "import edgepfl_missing_dependency  # noqa: F401\n",
}

#: a mutant of the plugin's method, as a test file of the plugin's: it uploads its personal classifier too
LEAKY = '''import pytest

from edgepfl.testing import method_checks
from edgepfl_toy_plugin.method import SmoothPer


class LeakySmoothPer(SmoothPer):
    name = "leaky_smooth_per"

    def local_update(self, model, data, ctx):
        result = super().local_update(model, data, ctx)
        result.upload.update({k: v for k, v in self.personal_state(model).items() if k.startswith("head.")})
        return result


@pytest.mark.parametrize("check", method_checks(LeakySmoothPer), ids=str)
def test_leaky_smooth_per(check):
    check()
'''

#: the checks a method that uploads a personal tensor fails: the upload's own, and each that hands
#: the upload to the coordinator's gate (``check_update``), which refuses it
LEAK_FAILS = {f"leaky_smooth_per-{check}" for check in (
    "upload_is_shared_keys_plus_stats_and_no_personal_key", "upload_passes_check_update_and_tampering_is_rejected",
    "any_arrival_order_gives_the_same_next_state_bit_for_bit[mean]",
    "any_arrival_order_gives_the_same_next_state_bit_for_bit[clipped_mean]",
    "compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order[q4]",
    "compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order[topk+q8]")}


@dataclass(frozen=True)
class PluginEnv:
    """A virtual environment with the plugin packages installed by pip; ``root`` holds their sources."""

    python: Path
    root: Path

    def run(self, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> PluginEnv:
    if find_spec("setuptools") is None:  # the packages' build backend, taken from here (no build isolation)
        pytest.fail("setuptools is not installed in this environment; pip cannot build the plugin packages")
    root = tmp_path_factory.mktemp("plugin-env")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's packages as site folders (not plain path entries), so that their own .pth
    # files apply too: edgepfl's editable install is one
    (Path(purelib) / "edgepfl_test_base.pth").write_text(
        "".join(f"import site; site.addsitedir({folder!r})\n" for folder in site.getsitepackages()))
    # pip builds a local folder in place: build copies, not the repository's files
    toy = shutil.copytree(PACKAGE, root / "edgepfl_toy_plugin",
                          ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    broken = root / "edgepfl_broken_plugin"
    for name, text in BROKEN.items():
        (broken / name).parent.mkdir(parents=True, exist_ok=True)
        (broken / name).write_text(text)
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--no-cache-dir", str(toy), str(broken)],
        capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    plugin_env = PluginEnv(python, root)
    where = plugin_env.run("-c", "import edgepfl_toy_plugin; print(edgepfl_toy_plugin.__file__)", cwd=root)
    assert where.returncode == 0 and where.stdout.startswith(purelib), where.stdout + where.stderr
    return plugin_env


def test_the_packages_own_tests_pass_edgepfls_public_checks_and_a_leaking_mutant_fails_them(env):
    mutant = env.root / "mutant"
    mutant.mkdir()
    (mutant / "test_leaky_smooth_per.py").write_text(LEAKY)
    package = env.root / "edgepfl_toy_plugin"
    report = env.root / "report.xml"
    done = env.run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(package / "pyproject.toml"),
                   "--rootdir", str(package), f"--junitxml={report}", str(package / "tests"), str(mutant), cwd=package)
    cases = ET.parse(report).getroot().iter("testcase")
    outcome = {}
    for case in cases:
        failure = case.find("failure")
        outcome[f"{Path(case.get('classname', '')).name}::{case.get('name')}"] = (
            "skipped" if case.find("skipped") is not None else "passed" if failure is None else failure.get("message"))
    own = {k: v for k, v in outcome.items() if "test_toy_plugin_contract" in k}
    assert len(own) > 20 and all(v == "passed" for v in own.values()), \
        {k: v for k, v in own.items() if v != "passed"} or done.stdout[-3000:]
    failed = {re.sub(r"^[^[]*\[(.*)\]$", r"\1", k): v for k, v in outcome.items()
              if "test_leaky" in k and v not in ("passed", "skipped")}
    assert set(failed) == LEAK_FAILS, failed
    assert all("['head.bias', 'head.weight']" in message for message in failed.values()), failed
    assert done.returncode == 1, done.stdout[-3000:]


def sensor_windows(path: Path, n: int = 240) -> None:
    """Raw accelerometer-like windows, 6 channels x 100 samples, 4 classes (each its own frequency): ranges
    of a few g around gravity on one axis, not [0, 1]."""
    rng = np.random.default_rng(0)
    y = np.arange(n) % 4
    t = np.arange(100) / 100
    phase = rng.uniform(0, 2 * np.pi, (n, 6, 1))
    x = 3.0 * np.sin(2 * np.pi * (2 + 3 * y)[:, None, None] * t + phase) + 9.81 * (np.arange(6) == 2)[:, None]
    np.savez(path, x=(x + rng.normal(0, 0.5, x.shape)).astype(np.float32), y=y)


def run_yaml(folder: Path, method: str, arch: str) -> Path:
    config = {"federation": "pluginpkg", "method": {"name": method}, "model": {"arch": arch, "feature_dim": 16},
              "train": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "rounds": 2,
              "data": {"dataset": "npz", "root": str(folder / "windows.npz"), "num_clients": 2,
                       "input": {"kind": "series"}}}
    path = folder / f"{method}-{arch}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_simulate_trains_the_plugin_encoder_with_the_plugin_method_by_their_entry_point_names(env, tmp_path):
    sensor_windows(tmp_path / "windows.npz")
    out = tmp_path / "run"
    # over an embedded Mosquitto with agent processes of that environment: two trainers that
    # load both plugins by name, and a torch-free head agent that fits on the exported encoder
    done = env.run("-m", "edgepfl", "simulate", "--agents", "2", "--head-agents", "1", "--head", "lr",
                   "--out", str(out), "--set", "release_at_end=true", "--set", "data.num_clients=3",
                   "--config", str(run_yaml(tmp_path, "smooth_per", "toy-cnn1d")), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Results — smooth_per" in done.stdout
    (release,) = (out / "releases").glob("round-*")
    manifest = json.loads((release / "manifest.json").read_text())
    assert manifest["run"]["model"]["arch"] == "toy-cnn1d" and manifest["run"]["data"]["input_kind"] == "series"
    reports = json.loads((out / "head_metrics.json").read_text())
    assert any(r.get("refused") is None for release_reports in reports.values()
               for r in release_reports.get("reports", {}).values()), reports
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows if not row["final"]] == [0, 1]
    assert all(len(row["participants"]) == 2 for row in rows if not row["final"]), rows
    # the server averages the plugin encoder's tensors alone; each device keeps its classifier
    shared = {k.removeprefix("global::") for k in checkpoint_tensors(out / "checkpoint") if k.startswith("global::")}
    assert shared and all(k.startswith("encoder.net.body.") or k.startswith("encoder.net.out.") for k in shared), shared
    for agent in ("agent-00", "agent-01"):
        personal = read_tensors(next((out / "agents" / agent).glob("personal-*.safetensors")))
        assert {"head.weight", "head.bias"} <= set(personal) and not set(personal) & shared


@pytest.mark.parametrize(("method", "arch", "line"), [
    ("broken_method", "toy-cnn1d", r"method 'broken_method': entry point broken_method = edgepfl_broken_plugin:Broken "
                                   r"\(edgepfl.methods\) cannot be loaded: ModuleNotFoundError: No module named "
                                   r"'edgepfl_missing_dependency'"),
    ("smooth_per", "broken-cnn", r"model.arch broken-cnn \(entry point edgepfl_broken_plugin:build\): cannot load it: "
                                 r"ModuleNotFoundError: No module named 'edgepfl_missing_dependency'"),
], ids=["method", "arch"])
def test_a_run_naming_a_plugin_that_cannot_load_is_one_line_naming_its_entry_point(env, tmp_path, method, arch, line):
    sensor_windows(tmp_path / "windows.npz", n=40)
    done = env.run("-m", "edgepfl", "simulate", "--in-process", "--agents", "2", "--out", str(tmp_path / "run"),
                   "--config", str(run_yaml(tmp_path, method, arch)), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgepfl: ") and re.search(line, lines[0]), done.stderr[-3000:]
    assert "internal error" not in done.stderr


def test_edgepfls_own_contract_suites_collect_and_pass_beside_a_plugin_that_cannot_load(env):
    """They check the built-in methods; looking up the head vocabulary skips the plugin that cannot load."""
    suites = ["tests/contract/test_method_contract.py", "tests/contract/test_head_contract.py",
              "tests/contract/test_models_doc.py"]
    done = env.run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *suites,
                   "-k", "registry_holds or head_vocabulary_is_the_methods or sees_every_table", cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b3 passed, \d+ deselected in", done.stdout), done.stdout[-3000:]
