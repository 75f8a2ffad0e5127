"""Installed size of edgepfl's ``agent`` extra vs its ``train`` extra, in fresh venvs.

Creates, under a temporary directory outside the repository (``--work``, default
``/tmp/edgepfl-install-size``), fresh ``python3 -m venv`` environments and installs into each:

* ``core``  — ``pip install -e REPO`` (the dependencies every tier needs);
* ``agent`` — ``pip install -e 'REPO[agent]'`` (head tier: onnxruntime, scikit-learn, onnx);
* ``train`` — ``pip install -e 'REPO[train]' torch==2.14.1 torchvision==0.29.1`` (the local
  pin; this box's 2.14.1 wheel is a CUDA build that pulls the nvidia-* and triton wheels);
* ``torch-cpu`` — only the CPU build of torch on this disk (``torch==2.13.0+cpu``,
  ``--no-deps``, nothing beside it), to say what ``train`` weighs with a CPU torch.

It records ``du`` of each venv's ``site-packages`` (and of an empty venv's, which is
pip + setuptools alone), the largest packages of ``train``, and an estimate of ``train`` with
the CPU torch: ``train`` minus (torch + nvidia + triton + cuda* directories) plus the CPU
torch's installed directories. The venvs are deleted afterwards unless ``--keep``.

Usage::

    python3 benchmarks/install_size.py

Writes ``benchmarks/results/edge_install_size.json`` and ``edge_install_size.md``.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TORCH_PIN = ["torch==2.14.1", "torchvision==0.29.1"]
CPU_WHEEL_GLOB = "/opt/wheels/torch-2.13.0+cpu-*.whl"
# directories a CUDA torch brings that a CPU torch does not need
GPU_ONLY = ("nvidia", "triton", "cuda")


def du_kib(path: Path) -> int:
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def site_packages(venv: Path) -> Path:
    return Path(glob.glob(str(venv / "lib" / "python3*" / "site-packages"))[0])


def make_venv(venv: Path, packages: list[str], log: Path, pip_args: tuple[str, ...] = ()) -> dict:
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    start = time.perf_counter()
    if packages:
        with open(log, "w") as f:
            subprocess.run([str(venv / "bin" / "pip"), "install", *pip_args, *packages], stdout=f,
                           stderr=subprocess.STDOUT, check=True)
    sp = site_packages(venv)
    sizes = {p.name: du_kib(p) for p in sp.iterdir()}
    freeze = subprocess.run([str(venv / "bin" / "pip"), "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True).stdout.split()
    return {"packages_requested": packages, "site_packages_kib": du_kib(sp), "venv_kib": du_kib(venv),
            "installed": freeze, "largest": dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:12]),
            "entries_kib": sizes, "install_seconds": round(time.perf_counter() - start, 1)}


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f} MiB" if kib < 1024 * 1024 else f"{kib / 1024 / 1024:.2f} GiB"


def markdown(r: dict) -> str:
    env = r["envs"]
    empty = env["empty"]["site_packages_kib"]
    lines = [
        "# Installed size: `agent` extra vs `train` extra",
        "",
        f"Command: `{r['command']}` (Python {r['python']}, fresh `python3 -m venv`, pip {r['pip']}).",
        "",
        "| environment | what | site-packages | minus empty venv (pip, setuptools) |",
        "|---|---|---|---|",
    ]
    what = {"empty": "nothing", "core": "`pip install -e .`", "agent": "`pip install -e '.[agent]'`",
            "train": "`pip install -e '.[train]' " + " ".join(TORCH_PIN) + "` (CUDA torch build)",
            "torch-cpu": "`torch==2.13.0+cpu` wheel alone, `--no-deps`"}
    for name, e in env.items():
        lines.append(f"| {name} | {what[name]} | {mib(e['site_packages_kib'])} | {mib(e['site_packages_kib'] - empty)} |")
    est = r["train_with_cpu_torch_estimate_kib"]
    lines += [
        "",
        f"`train` with the CPU torch instead of the CUDA build (estimate: `train` minus torch, nvidia*, triton, cuda* "
        f"directories, plus the CPU torch's): **{mib(est)}** ({mib(est - empty)} net).",
        "",
        "Largest entries of `train` site-packages: " + ", ".join(
            f"{k} {mib(v)}" for k, v in list(env["train"]["largest"].items())[:8]) + ".",
        "",
        "Largest entries of `agent` site-packages: " + ", ".join(
            f"{k} {mib(v)}" for k, v in list(env["agent"]["largest"].items())[:8]) + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/edgepfl-install-size")
    parser.add_argument("--keep", action="store_true", help="keep the venvs")
    parser.add_argument("--out", default=str(RESULTS / "edge_install_size"))
    ns = parser.parse_args()
    work = Path(ns.work)
    if str(work.resolve()).startswith(str(ROOT)):
        raise SystemExit("keep the venvs out of the repository")
    work.mkdir(parents=True, exist_ok=True)
    cpu_wheels = sorted(glob.glob(CPU_WHEEL_GLOB))
    plans = {
        "empty": [],
        "core": ["-e", str(ROOT)],
        "agent": ["-e", f"{ROOT}[agent]"],
        "train": ["-e", f"{ROOT}[train]", *TORCH_PIN],
    }
    if cpu_wheels:
        plans["torch-cpu"] = [cpu_wheels[-1]]
    result = {"command": "python3 benchmarks/install_size.py", "python": sys.version.split()[0], "envs": {}}
    try:
        for name, pkgs in plans.items():
            print(f"installing {name} ...", flush=True)
            extra = ("--no-deps",) if name == "torch-cpu" else ()
            result["envs"][name] = make_venv(work / name, pkgs, work / f"{name}.log", extra)
            print(f"  {name}: {mib(result['envs'][name]['site_packages_kib'])}", flush=True)
        result["pip"] = subprocess.run([str(work / "empty" / "bin" / "pip"), "--version"], capture_output=True,
                                       text=True).stdout.split()[1]
        train = result["envs"]["train"]["entries_kib"]
        gpu = sum(v for k, v in train.items() if k == "torch" or k.startswith(GPU_ONLY)
                  or (k.startswith("torch-") and k.endswith(".dist-info")))
        cpu = result["envs"].get("torch-cpu", {}).get("entries_kib", {})
        cpu_torch = sum(v for k, v in cpu.items() if k == "torch" or k.startswith("torch-"))
        result["train_gpu_only_entries_kib"] = gpu
        result["torch_cpu_kib"] = cpu_torch
        result["train_with_cpu_torch_estimate_kib"] = result["envs"]["train"]["site_packages_kib"] - gpu + cpu_torch
        if cpu_wheels:
            result["torch_cpu_wheel"] = {"file": Path(cpu_wheels[-1]).name, "bytes": Path(cpu_wheels[-1]).stat().st_size}
    finally:
        if not ns.keep:
            shutil.rmtree(work, ignore_errors=True)
    for e in result["envs"].values():
        e.pop("entries_kib", None)
    write_results(result, ns.out, markdown)


if __name__ == "__main__":
    main()
