"""Peak memory of a head-tier agent: a fresh, torch-free process doing what a Pi does.

Two steps:

1. *prepare* (a child process, with torch): a short FedAvg federation on Fashion-MNIST
   (the in-process simulator, small CNN), exported with :func:`edgepfl.export.onnx_export.export_run`
   — a real encoder release — and one device's own data written as a ``.npz`` (raw uint8
   pixels, labels, class names, the federation's normalization). ``--export DIR`` skips
   the training and uses an existing release instead.
2. *measure* (one fresh ``python`` child per head kind, ``svm``, ``lr``, ``mlp``): the
   agent's own code path — ``load_client_data`` on the device's ``.npz`` (``DataSpec(dataset="npz",
   num_clients=1)``, as an agent config for a device with its own data says), then
   :class:`edgepfl.edge_agent.head_tier.HeadRuntime`: ``install_release`` (sha256 check, ONNX
   session, features of the train and held-out images, fit the head, export it with
   skl2onnx, evaluate, write to disk), then ``predict`` over the held-out images and one
   single-image prediction. After each phase it records ``ru_maxrss``
   (``resource.getrusage(RUSAGE_SELF)``, KiB on Linux) and ``VmHWM`` / ``VmRSS`` from
   ``/proc/self/status``, and at the end whether ``torch`` is in ``sys.modules``.

The parent process imports only the standard library: ``ru_maxrss`` survives ``fork`` +
``exec``, so a child of a large process would report its parent's high-water mark.
A last child repeats the install steps one by one, resetting the high-water mark
(``/proc/self/clear_refs``) before each, to show where the peak comes from.

``--pool`` additionally measures the simulation path, where the agent reads its partition
out of the whole pooled Fashion-MNIST (70 000 images decoded in the agent's process):
an upper bound that a real device, holding only its own images, does not pay.

Usage::

    .venv/bin/python benchmarks/head_rss.py --pool

Writes ``benchmarks/results/edge_head_rss.json`` and ``edge_head_rss.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: `python benchmarks/<script>.py`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

NUM_CLIENTS = 10
DEVICE_CLIENT = 9  # the device's partition; trainers use partitions 0..3

# The child: torch-free, nothing imported before the baseline measurement but the stdlib.
CHILD = textwrap.dedent(r"""
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[1])
    release_dir, data_spec, state_dir, head_kind = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]

    def mem():
        status = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    status[key] = int(value.split()[0])  # kB
        return {"ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "vmhwm_kib": status["VmHWM"], "vmrss_kib": status["VmRSS"]}

    phases = {"python_start": mem()}
    t0 = time.perf_counter()
    import numpy as np
    from edgepfl.config import DataSpec
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.export.onnx_export import read_release
    phases["imports"] = mem()
    index = int(data_spec.pop("_client", 0))
    data = load_client_data(DataSpec.model_validate(data_spec), index)
    phases["data_loaded"] = mem()
    manifest, artifact = read_release(release_dir)
    rt = HeadRuntime(state_dir, head_kind, data)
    metrics = rt.install_release(manifest, artifact, manifest.encoder.sha256)
    phases["release_installed_head_fitted"] = mem()
    pred = rt.predict(data.x_test)
    one = rt.predict_proba(data.x_test[:1])
    phases["predicted"] = mem()
    assert (pred == data.y_test).mean() == metrics["accuracy"]
    heavy = sorted(m for m in ("torch", "torchvision", "scipy", "sklearn", "skl2onnx", "onnx", "onnxruntime")
                   if m in sys.modules)
    print(json.dumps({"phases": phases, "metrics": metrics, "torch_imported": "torch" in sys.modules,
                      "heavy_modules_loaded": heavy, "seconds": time.perf_counter() - t0,
                      "num_train": data.num_train, "num_test": data.num_test,
                      "single_prediction_shape": list(one.shape)}))
""")


# Where the peak comes from: the steps of HeadRuntime.install_release done one by one, the
# peak reset before each (writing 5 to /proc/self/clear_refs resets VmHWM).
BREAKDOWN = textwrap.dedent(r"""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    release_dir, data_spec, head_kind = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    steps = []

    def step(name):
        status = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    status[key] = int(value.split()[0])
        steps.append({"step": name, "peak_kib": status["VmHWM"], "rss_after_kib": status["VmRSS"]})
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    step("python start")
    import numpy as np
    step("import numpy")
    from edgepfl.config import DataSpec
    from edgepfl.data import load_client_data
    step("import edgepfl.config, edgepfl.data (pydantic)")
    from edgepfl.edge_agent.head_tier import HeadRuntime  # noqa: F401 (what the agent imports)
    step("import edgepfl.edge_agent.head_tier (sklearn.base, onnxruntime)")
    data = load_client_data(DataSpec.model_validate(data_spec), 0)
    step("load device data (npz)")
    from edgepfl.export.onnx_export import read_release
    from edgepfl.export.predict import OnnxEncoder
    manifest, artifact = read_release(release_dir)
    encoder = OnnxEncoder(artifact, manifest, expected_sha256=manifest.encoder.sha256)
    step("open ONNX encoder session")
    f_train, f_test = encoder.features(data.x_train), encoder.features(data.x_test)
    step("features of train + test (OnnxEncoder default batch)")
    from edgepfl.export.heads import OnnxHead, head_to_onnx
    from edgepfl.heads import HeadRelease
    from edgepfl.methods import create_method
    release = HeadRelease.from_manifest(manifest)
    head = create_method(release.method, release.method_options).make_head(head_kind, release)
    head.fit(f_train, data.y_train)
    step(f"fit {head_kind} head (sklearn)")
    onnx_bytes = head_to_onnx(head, f_train.shape[1])
    step("export head (plain ONNX graph)")
    import tempfile, pathlib
    path = pathlib.Path(tempfile.mkdtemp()) / "head.onnx"
    path.write_bytes(onnx_bytes)
    served = OnnxHead(path).fit()
    served.predict(f_test)
    encoder.features(data.x_test[:1])
    step("ONNX head session, predict")
    print(json.dumps(steps))
""")


def prepare(work: Path, rounds: int) -> Path:
    """Train FedAvg briefly on Fashion-MNIST (in-process) and export it; returns the release dir."""
    from edgepfl.config import DataSpec, MethodSpec, ModelSpec, RunConfig, TrainConfig
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers
    from edgepfl.export.onnx_export import export_run

    config = RunConfig(method=MethodSpec(name="fedavg"), model=ModelSpec(arch="cnn"),
                       train=TrainConfig(epochs=1, batch_size=50, lr=0.05, momentum=0.5),
                       data=DataSpec(dataset="fmnist", samples_per_client=1500, seed=0), rounds=rounds, device="cpu")
    run = work / "run-fedavg"
    simulate(config, 4, run, in_process=local_trainers, progress=False)
    export_run(run, work / "release")
    return work / "release"


def write_device_npz(path: Path) -> dict:
    """Client DEVICE_CLIENT of a NUM_CLIENTS-way FMNIST partition, as the device's own .npz."""
    import numpy as np

    from edgepfl.config import DataSpec
    from edgepfl.data import client_indices, load_pool

    spec = DataSpec(dataset="fmnist", num_clients=NUM_CLIENTS, seed=0)
    pool = load_pool(spec)
    train, test = client_indices(spec, DEVICE_CLIENT)
    idx = np.sort(np.concatenate([train, test]))
    np.savez(path, x=np.asarray(pool.pixels[idx]), y=np.asarray(pool.y[idx]),
             class_names=np.asarray(pool.class_names), mean=np.asarray(pool.normalization["mean"]),
             std=np.asarray(pool.normalization["std"]))
    return {"samples": int(len(idx)), "bytes": path.stat().st_size}


def measure(release: Path, data_spec: dict, state_dir: Path, head: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(release), json.dumps(data_spec),
                           str(state_dir), head], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"head agent child failed ({head}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    lines = [
        "# Head-agent peak RSS (torch-free head tier)",
        "",
        f"Command: `{result['command']}`  ",
        f"Release: {result['release']['method']} small CNN on Fashion-MNIST, round {result['release']['round']}, "
        f"{result['release']['encoder_bytes']} bytes of ONNX. Device data: {result['device_data']}. "
        f"Load average {result['loadavg_start']} at start (shared 2-core machine; memory is not load-sensitive).",
        "",
        "| data path | head | peak RSS (ru_maxrss) | VmHWM | after imports | after data | held-out acc | torch imported |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        p = row["phases"]
        lines.append(
            f"| {row['data_path']} | {row['head']} | {p['predicted']['ru_maxrss_kib'] / 1024:.1f} MiB "
            f"| {p['predicted']['vmhwm_kib'] / 1024:.1f} MiB | {p['imports']['vmrss_kib'] / 1024:.1f} MiB "
            f"| {p['data_loaded']['vmrss_kib'] / 1024:.1f} MiB | {row['metrics']['accuracy']:.4f} "
            f"| {row['torch_imported']} |")
    lines += ["", "Each row is a fresh process (one head kind per device), started from a parent that imports only "
              "the standard library. Goal: <= 150 MB.", ""]
    for head, steps in result.get("breakdown", {}).items():
        lines += [f"Where the peak comes from ({head} head, device npz; peak of each step alone, the high-water mark "
                  "reset before it):", "", "| step | peak during step | RSS after |", "|---|---|---|"]
        lines += [f"| {s['step']} | {s['peak_kib'] / 1024:.1f} MiB | {s['rss_after_kib'] / 1024:.1f} MiB |" for s in steps]
        lines.append("")
    return "\n".join(lines) + "\n"


def breakdown(release: Path, data_spec: dict, head: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", BREAKDOWN, str(ROOT), str(release), json.dumps(data_spec), head],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"breakdown child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from edgepfl.heads import GENERIC_HEAD_KINDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", default=None, help="an existing release dir (default: train FedAvg briefly)")
    parser.add_argument("--rounds", type=int, default=3, help="FedAvg rounds for the release when --export is absent")
    parser.add_argument("--pool", action="store_true", help="also measure the pooled-FMNIST simulation data path")
    parser.add_argument("--prepare", default=None, help=argparse.SUPPRESS)  # child mode: train, export, write npz
    parser.add_argument("--out", default=str(RESULTS / "edge_head_rss"))
    ns = parser.parse_args()
    if ns.prepare:
        work = Path(ns.prepare)
        release = Path(ns.export) if ns.export else prepare(work, ns.rounds)
        info = write_device_npz(work / "device.npz")
        (work / "prepared.json").write_text(json.dumps({"release": str(release), **info}))
        return
    # This parent imports nothing but the standard library and trains nothing itself: a child's
    # ru_maxrss starts from the high-water mark of the process it was forked from.
    cmd = "python benchmarks/head_rss.py" + (" --pool" if ns.pool else "") + (
        f" --export {ns.export}" if ns.export else f" --rounds {ns.rounds}")
    result = {"command": cmd, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "loadavg_start": [round(v, 2) for v in os.getloadavg()], "runs": []}
    with tempfile.TemporaryDirectory(prefix="edgepfl-rss-") as tmp:
        work = Path(tmp)
        prep = [sys.executable, __file__, "--prepare", str(work), "--rounds", str(ns.rounds)]
        # training threads do not matter to what is measured; one thread avoids stalls on a busy machine
        subprocess.run(prep + (["--export", ns.export] if ns.export else []), check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        prepared = json.loads((work / "prepared.json").read_text())
        release, npz = Path(prepared["release"]), work / "device.npz"
        # plain JSON, not edgepfl.protocol.ReleaseManifest: this parent imports only the standard library
        manifest = json.loads((release / "manifest.json").read_text())
        result["release"] = {"method": manifest["run"]["method"]["name"], "round": manifest["round"],
                             "encoder_bytes": manifest["encoder"]["bytes"], "feature_dim": manifest["feature_dim"]}
        result["device_data"] = (f"FMNIST partition {DEVICE_CLIENT} of {NUM_CLIENTS} (seed 0), {prepared['samples']} "
                                 f"images in its own .npz ({prepared['bytes']} bytes), 25% held out")
        device = {"dataset": "npz", "root": str(npz), "num_clients": 1}
        paths = {"device npz": device}
        if ns.pool:
            paths["pooled FMNIST (simulation)"] = {"dataset": "fmnist", "num_clients": NUM_CLIENTS, "seed": 0,
                                                   "_client": DEVICE_CLIENT}
        for label, spec in paths.items():
            for head in GENERIC_HEAD_KINDS:
                row = measure(release, spec, work / f"state-{head}-{len(result['runs'])}", head)
                row.update(data_path=label, head=head)
                result["runs"].append(row)
                print(label, head, row["phases"]["predicted"], row["metrics"]["accuracy"], row["torch_imported"])
        result["breakdown"] = {head: breakdown(release, device, head) for head in ("lr", "mlp")}
    result["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(result, ns.out, markdown)


if __name__ == "__main__":
    main()
