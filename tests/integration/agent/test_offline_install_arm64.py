"""The documented offline install, run: docs/OPERATING.md's ``pip download`` (its platform tags,
read from the page) makes a wheelhouse here; a Debian bookworm arm64 root takes it with the
device's own ``pip install --no-index --find-links`` into the venv where the unit runs it,
under qemu-user; onnxruntime imports there and ``edgepfl predict`` gives what it gives here.

Issue 53: the page's old single tag resolved onnxruntime 1.16.3 beside numpy 2.2.6; that
install succeeded and ``predict`` failed on arm64 ("_ARRAY_API not found", then a segfault).
A resolver check (``test_packaging.py``) passed on exactly that closure; this test imports it.

The root is bookworm's ``python3`` and ``python3-venv`` as debootstrap downloads them,
unpacked with ``dpkg-deb`` (debootstrap's first stage: no maintainer scripts, which would
run under emulation for minutes; Python needs none of them). About five minutes, most of
it pip and the imports under emulation. Needs root, debootstrap, qemu-user-static with its
binfmt handler, and Debian's and the Python package index (CI reaches both).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.export_fixtures import NEW_CLIENT, client_pixels, export_dir

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

from arm64_head_tier import compare_predictions  # noqa: E402

MIRROR = "http://deb.debian.org/debian"
#: where the unit runs the agent (examples/edgepfl-agent.service) and the page installs it
VENV = "/opt/edgepfl/venv"


def documented(command: str) -> str:
    """The one line of docs/OPERATING.md that starts with ``command`` (the page's own words)."""
    lines = [line.strip() for line in (REPO / "docs" / "OPERATING.md").read_text().splitlines()]
    found = [line for line in lines if line.startswith(command)]
    assert found, f"docs/OPERATING.md no longer says `{command} …`"
    return found[0]


def _needs() -> None:
    missing = [t for t in ("debootstrap", "qemu-aarch64-static", "dpkg-deb", "unshare", "chroot")
               if not shutil.which(t) and not Path("/usr/sbin", t).exists()]
    handler = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not missing and not handler.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    why = []
    if os.geteuid() != 0:
        why.append("root (debootstrap, chroot)")
    if missing:
        why.append("apt-get install debootstrap qemu-user-static binfmt-support (missing: " + ", ".join(missing) + ")")
    elif not handler.exists():
        why.append("qemu-aarch64's binfmt handler (binfmt-support)")
    if why:
        if os.environ.get("CI"):
            pytest.fail("the arm64 install test needs " + "; ".join(why))
        pytest.skip("needs " + "; ".join(why))


def in_root(root: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``argv`` in the arm64 root, with its own /proc and none of this process's environment
    (a ``PIP_*`` variable here must not steer the device's pip)."""
    script = 'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"'
    return subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", script, str(root), *argv],
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"},
                          capture_output=True, text=True, timeout=timeout)


def test_the_documented_offline_install_runs_predict_on_arm64(tmp_path):
    _needs()
    # 1. here: the wheel and the documented wheelhouse (its tags, its python version)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("edgepfl-*.whl")
    download = documented("pip download")
    tags = re.findall(r"--platform (\S+)", download)
    python = re.search(r"--python-version (\S+)", download).group(1)
    wheelhouse = tmp_path / "root" / "wheelhouse"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
                           *(a for t in tags for a in ("--platform", t)), "--python-version", python,
                           "--implementation", "cp", "-d", str(wheelhouse), f"{wheel}[agent]"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copy(wheel, wheelhouse)

    # 2. the device: bookworm arm64 with python3 and python3-venv, unpacked
    root = tmp_path / "root"
    proc = subprocess.run(["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase",
                           "--include=python3,python3-venv", "bookworm", str(root), MIRROR],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for deb in sorted((root / "var" / "cache" / "apt" / "archives").glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
    py = in_root(root, ["python3", "-c", "import platform, sys; print(platform.machine(), sys.version_info[:2])"],
                 timeout=300)
    assert py.returncode == 0 and py.stdout.startswith("aarch64"), py.stderr[-2000:]
    assert py.stdout.split(" ", 1)[1].strip() == str(tuple(int(v) for v in python.split("."))), py.stdout

    # 3. the page's device commands: the venv where the unit looks, the offline install
    assert VENV in documented("sudo python3 -m venv")
    venv = in_root(root, ["python3", "-m", "venv", VENV], timeout=900)
    assert venv.returncode == 0, venv.stderr[-2000:]
    install = documented("then on the device `pip install --no-index --find-links")
    assert "'edgepfl[agent]'" in install
    pip = in_root(root, [f"{VENV}/bin/pip", "install", "--no-index", "--find-links", "/wheelhouse",
                         f"/wheelhouse/{wheel.name}[agent]"], timeout=1500)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    versions = in_root(root, [f"{VENV}/bin/python", "-c", "import json, numpy, onnxruntime, sklearn; print(json.dumps("
                              "[numpy.__version__, onnxruntime.__version__, sklearn.__version__]))"], timeout=600)
    assert versions.returncode == 0, versions.stderr[-2000:]
    numpy_v, onnxruntime_v, _ = json.loads(versions.stdout.strip().splitlines()[-1])
    listed = in_root(root, [f"{VENV}/bin/pip", "list", "--format", "json"], timeout=600)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not {"torch", "torchvision"} & names, names

    # 4. predict there and here: same classes, same probabilities
    export = export_dir(tmp_path / "export", "fedavg", rounds=1)
    work = root / "work"
    shutil.copytree(export, work)
    pixels, labels, class_names = client_pixels(NEW_CLIENT)
    np.savez(work / "client.npz", x=pixels, y=labels, class_names=np.asarray(class_names))  # the device's own
    np.save(work / "pixels.npy", pixels[:48])
    fit = subprocess.run([sys.executable, "-m", "edgepfl.cli", "fit-head", "--encoder", str(work / "encoder.onnx"),
                          "--data", str(work / "client.npz"), "--head", "lr", "--out", str(work / "head.onnx")],
                         capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stderr[-2000:]
    args = ["predict", "--json", "--top", "10"]
    there = in_root(root, [f"{VENV}/bin/edgepfl", *args, "--encoder", "/work/encoder.onnx", "--head",
                           "/work/head.onnx", "/work/pixels.npy"], timeout=900)
    assert there.returncode == 0, there.stderr[-3000:]
    here = subprocess.run([sys.executable, "-m", "edgepfl.cli", *args, "--encoder", str(work / "encoder.onnx"),
                           "--head", str(work / "head.onnx"), str(work / "pixels.npy")],
                          capture_output=True, text=True, timeout=600)
    assert here.returncode == 0, here.stderr[-2000:]
    agree = compare_predictions(there.stdout, here.stdout)
    assert agree["same_inputs"] and agree["same_classes"] and agree["max_abs_probability_diff"] <= 1e-4, agree
    print(f"arm64 offline install: numpy {numpy_v}, onnxruntime {onnxruntime_v}; predict agrees on "
          f"{agree['inputs']} inputs (max |dp| {agree['max_abs_probability_diff']:.1e})")
