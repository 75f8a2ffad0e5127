"""The head tier installs on a 64-bit Raspberry Pi from wheels alone.

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
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[3]


def agent_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["agent"]]


def documented_platforms() -> list[str]:
    """The ``--platform`` tags of docs/OPERATING.md's offline ``pip download``: what the test
    resolves is what a device owner runs."""
    import re

    text = (REPO / "docs" / "OPERATING.md").read_text()
    command = next(line for line in text.splitlines() if line.strip().startswith("pip download") and "aarch64" in line)
    return re.findall(r"--platform (\S+)", command)


@pytest.mark.parametrize("python", ["3.10", "3.11"])
def test_the_agent_extra_resolves_to_aarch64_wheels_only_without_torch(python, tmp_path):
    from packaging.version import Version

    platforms = documented_platforms()
    assert "manylinux_2_28_aarch64" in platforms  # bookworm's glibc: a 2014-only list took onnxruntime 1.16
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--target", str(tmp_path / "target"),
         *(arg for tag in platforms for arg in ("--platform", tag)), "--python-version", python,
         "--implementation", "cp", "--only-binary", ":all:", *agent_requirements()],
        capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 0, "\n".join(errors) or proc.stderr[-2000:]
    versions = {item["metadata"]["name"].lower().replace("_", "-"): Version(item["metadata"]["version"])
                for item in json.loads(report.read_text())["install"]}
    assert {"onnxruntime", "scikit-learn", "numpy", "paho-mqtt", "cryptography"} <= versions.keys()
    assert not {"torch", "torchvision"} & versions.keys(), "the head tier must not pull torch"
    # the closure must import together: numpy 2 needs an onnxruntime built for it (1.19 and later);
    # 1.16.3 beside numpy 2.2.6 installed fine and failed at import ("_ARRAY_API not found")
    if versions["numpy"] >= Version("2"):
        assert versions["onnxruntime"] >= Version("1.19"), versions


#: what JetPack 6 ships: NVIDIA's torch and the torchvision built against it (pre-release local versions)
NVIDIA_TORCH, NVIDIA_TORCHVISION = "2.3.0a0+ebedce2.nv24.2", "0.18.0a0+6043bc2"


def _metadata_only_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel that is metadata and nothing else: enough for pip's resolver, which is all the
    test asks of it (the real ones are NVIDIA's, for the Jetson only)."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{dist}/METADATA": "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                                       *(f"Requires-Dist: {r}" for r in requires)]) + "\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: edgepfl-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
    return path


def test_a_jetson_keeps_nvidias_torch_when_its_torchvision_is_there_too(tmp_path):
    """docs/OPERATING.md, "Jetson": with NVIDIA's torch and torchvision in place, pip resolves
    ``edgepfl[train]`` (read from pyproject.toml) for aarch64 / CPython 3.10 keeping both, and
    pulls no CUDA wheels of PyPI's torch. The torch pair are metadata-only stand-ins with
    NVIDIA's version strings, offered through --find-links; the rest comes from the index."""
    wheels = tmp_path / "jetpack"
    wheels.mkdir()
    _metadata_only_wheel(wheels, "torch", NVIDIA_TORCH, [])
    _metadata_only_wheel(wheels, "torchvision", NVIDIA_TORCHVISION, [f"torch=={NVIDIA_TORCH}"])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--target", str(tmp_path / "target"), "--find-links", str(wheels),
         # JetPack 6 is Ubuntu 22.04 (glibc 2.35): the tags the documented offline install names
         *(arg for tag in documented_platforms() for arg in ("--platform", tag)), "--python-version", "3.10",
         "--implementation", "cp", "--only-binary", ":all:", *project["dependencies"],
         *project["optional-dependencies"]["train"],
         f"torch=={NVIDIA_TORCH}", f"torchvision=={NVIDIA_TORCHVISION}"],
        capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 0, "\n".join(errors) or proc.stderr[-2000:]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert versions["torch"] == NVIDIA_TORCH and versions["torchvision"] == NVIDIA_TORCHVISION
    assert not [name for name in versions if name.startswith("nvidia-") or name == "triton"], sorted(versions)


def test_the_release_script_builds_an_sdist_and_a_wheel_that_twine_accepts_and_that_start(tmp_path):
    """scripts/release.sh, the release workflow (docs/OPERATING.md, "Installing"): the sdist, the wheel
    built from it, ``twine check --strict`` on both, the wheel's contents, and the wheel
    alone importing its apps. The build's isolated environment comes from the index."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "release.sh"), str(tmp_path / "dist")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    sdist, wheel = (Path(line) for line in proc.stdout.split())
    assert (sdist.name, wheel.name) == (f"edgepfl-{version}.tar.gz", f"edgepfl-{version}-py3-none-any.whl")
    assert proc.stderr.count("PASSED") == 2  # twine, one line per artifact
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "edgepfl/__init__.py", "coordinator/__init__.py",
            "edge_agent/__init__.py", "export/__init__.py"} <= members
