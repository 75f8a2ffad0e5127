"""The head tier installs on a 64-bit Raspberry Pi from wheels alone (issue #33).

pip resolves the core dependencies and the ``[agent]`` extra, read from pyproject.toml,
for Linux aarch64 (manylinux2014) on CPython 3.10 and 3.11 with ``--only-binary :all:``
against the package index this machine is configured with, without installing anything
(``--dry-run --report``). It fails when one package of the closure has no aarch64 wheel
(a Pi would have to build it, or could not: onnxruntime has no source package) and when
torch creeps into the head tier. The index must be reachable (CI reaches the package
registries).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]


def agent_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["agent"]]


@pytest.mark.parametrize("python", ["3.10", "3.11"])
def test_the_agent_extra_resolves_to_aarch64_wheels_only_without_torch(python, tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--target", str(tmp_path / "target"),
         "--platform", "manylinux2014_aarch64", "--python-version", python, "--implementation", "cp",
         "--only-binary", ":all:", *agent_requirements()],
        capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 0, "\n".join(errors) or proc.stderr[-2000:]
    installed = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"onnxruntime", "scikit-learn", "numpy", "paho-mqtt", "cryptography"} <= installed
    assert not {"torch", "torchvision"} & installed, "the head tier must not pull torch"
