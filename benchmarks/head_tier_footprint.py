"""Import cost and peak memory of the head tier's inference path, with and without scikit-learn on it.

Each measurement is a fresh ``python`` child started from this parent, which imports only
the standard library before it spawns them (``ru_maxrss`` survives ``fork`` + ``exec``).
The paths, interleaved over ``--repeats`` rounds so a busy machine slows them alike:

* ``predict new``: ``edgepfl predict`` (``edgepfl.cli.main``) on ``--images`` raw images with
  a real exported encoder and an lr head, as it runs now;
* ``predict old``: the same after importing what the old import path loaded with it
  (``sklearn.utils.validation`` and ``edgepfl.heads.estimators``, the base of the old
  ``OnnxHead``; and ``edgepfl.config``, which the old ``edgepfl.cli`` imported);
* ``agent imports new`` / ``old``: what a head agent imports before it connects
  (``edgepfl.cli``, ``edgepfl.agent_config``, the agent loop, ``HeadRuntime``, onnxruntime), the
  old path with scikit-learn's estimator base as the old ``export/heads.py`` imported it;
* ``agent imports + run config``: the new path plus ``edgepfl.config`` (the run's config, with
  the aggregation and simulation models), which it imported until the agent's config moved to
  ``edgepfl.agent_config``;
* ``agent install new``: ``HeadRuntime.install_release`` + ``predict`` in a fresh process
  (its own peak; the fit child's is the next row);
* ``fit child``: the child process the agent now fits a head in (``python -m
  edgepfl.edge_agent.head_fit``), on the new client's features, measured on its own.

Per child: CPU seconds of the whole child (its own rusage, ``os.wait4``), wall seconds, peak RSS
(``ru_maxrss``) and, for the import rows, the CPU seconds of the imports alone.

Usage::

    python benchmarks/head_tier_footprint.py --repeats 3

Writes ``benchmarks/results/head_tier_footprint.json`` and ``.md``. Preparing the release
trains a tiny model (needs torch, in a child, not in this parent).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HEAVY = ("sklearn", "scipy", "torch", "skl2onnx", "onnx")

PREPARE = textwrap.dedent(r"""
    import json, sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from tests.export_fixtures import NEW_CLIENT, client_data, client_pixels, export_dir
    from edgepfl.export.heads import META_ENCODER_SHA, head_to_onnx
    from edgepfl.export.predict import OnnxEncoder
    from edgepfl.heads.estimators import generic_head
    from edgepfl.heads.labels import LabelSpace
    from edgepfl.edge_agent.head_fit import FitRequest
    work, images = Path(sys.argv[2]), int(sys.argv[3])
    release = export_dir(work, "fedavg", rounds=1)
    enc = OnnxEncoder.from_dir(release)
    data = client_data(NEW_CLIENT)
    f = enc.features(data.x_train)
    head = generic_head("lr").fit(f, data.y_train)
    head_to_onnx(head, enc.feature_dim, work / "head.onnx", labels=LabelSpace(tuple(data.class_names), "federation"),
                 metadata={META_ENCODER_SHA: enc.sha256})
    pixels, _, _ = client_pixels(NEW_CLIENT)
    np.save(work / "pixels.npy", np.resize(pixels, (images, *pixels.shape[1:])))
    np.savez(work / "data.npz", x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)
    fit = work / "fit"
    fit.mkdir()
    m = json.loads((release / "manifest.json").read_text())
    (fit / "request.json").write_text(FitRequest(method="fedavg", method_options={}, head_kind="lr", head_params={},
        label_names=list(data.class_names), label_kind="federation", encoder_sha256=enc.sha256).model_dump_json())
    np.save(fit / "features.npy", f)
    np.save(fit / "labels.npy", data.y_train)
    print(json.dumps({"encoder": str(release / "encoder.onnx"), "train_rows": int(len(f))}))
""")

CHILD = textwrap.dedent(r"""
    import json, resource, sys, time
    what, args = sys.argv[1], json.loads(sys.argv[2])
    t0 = time.process_time()
    if what.endswith("old"):
        import sklearn.utils.validation, edgepfl.heads.estimators, edgepfl.config  # the old import path's extra
    if what == "agent imports + run config":
        import edgepfl.config  # what the agent imported until the agent's config had its own module
    if what == "agent install new":
        import numpy as np
        from edgepfl.data.client import ClientData
        from edgepfl.edge_agent.head_tier import HeadRuntime
        from edgepfl.export.onnx_export import read_release
        from pathlib import Path
        imports = time.process_time() - t0
        a = np.load(args["data"])
        data = ClientData(a["x_train"], a["y_train"], a["x_test"], a["y_test"], 10)
        manifest, artifact = read_release(Path(args["encoder"]).parent)
        rt = HeadRuntime(args["state"], "lr", data)
        rt.install_release(manifest, artifact, manifest.encoder.sha256)
        rt.predict(data.x_test)
        heavy = sorted({k.split(".")[0] for k in sys.modules} & set(args["heavy"]))
        print(json.dumps({"rc": 0, "imports_cpu_s": imports, "heavy": heavy,
                          "self_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        sys.exit(0)
    if what.startswith("agent"):
        import edgepfl.cli, edgepfl.agent_config, edgepfl.config_loading, onnxruntime
        from edgepfl.edge_agent.agent import run_agent
        from edgepfl.edge_agent.head_tier import HeadRuntime
        rc = 0
    else:
        from edgepfl.cli import main
        import edgepfl.export.predict, onnxruntime
    imports = time.process_time() - t0
    if what.startswith("predict"):
        import io, contextlib
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["predict", "--encoder", args["encoder"], "--head", args["head"], args["pixels"]])
    heavy = sorted({k.split(".")[0] for k in sys.modules} & set(args["heavy"]))
    print(json.dumps({"rc": rc, "imports_cpu_s": imports, "heavy": heavy}))
""")


def run_child(cmd: list[str]) -> dict:
    """Run ``cmd``; its own CPU seconds and peak RSS (``os.wait4``: this child's rusage alone)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    if "self_peak_rss_mib" in result:  # wait4's figure would include its own children's (the fit child)
        usage_peak = result.pop("self_peak_rss_mib")
    else:
        usage_peak = usage.ru_maxrss / 1024
    return {**result, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage_peak}


def _loaded(run: dict) -> str:
    if "heavy" not in run:  # the fit child reports nothing: it imports them by design
        return "(the fitting libraries, by design)"
    return ", ".join(run["heavy"]) or "none"


def markdown(result: dict) -> str:
    lines = ["# Head tier footprint: imports and peak RSS, with and without scikit-learn on the path", "",
             f"Command: `{result['command']}`  ",
             f"{result['images']} images of the digits new client (8x8), FedAvg MLP encoder, lr head; "
             f"load average {result['loadavg_start']} at start, {result['loadavg_end']} at end (shared 2-core "
             "machine: wall and CPU times inflate under load, peak RSS does not). Median of "
             f"{result['repeats']} interleaved runs.", "",
             "| path | imports CPU-s | whole child CPU-s | wall s | peak RSS | sklearn / scipy / torch / skl2onnx / onnx |",
             "|---|---|---|---|---|---|"]
    for name, runs in result["paths"].items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("cpu_s", "wall_s", "peak_rss_mib")}
        imp = [r["imports_cpu_s"] for r in runs if "imports_cpu_s" in r]
        lines.append(f"| {name} | {statistics.median(imp):.2f} | " if imp else f"| {name} | – | ")
        lines[-1] += (f"{med['cpu_s']:.2f} | {med['wall_s']:.2f} | {med['peak_rss_mib']:.1f} MiB | "
                      f"{_loaded(runs[0])} |")
    lines += ["", "Peak RSS is the child's own `ru_maxrss`. `agent install new`: a fresh process that installs the "
              "release with `HeadRuntime` (features, the fit in its child, evaluation, files) and predicts the "
              "held-out rows; its CPU-s include the fit child's. The fit child's peak is its own: while it runs, the "
              "installing process holds its RSS beside it.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS / "head_tier_footprint"))
    ns = parser.parse_args()
    env_python = sys.executable
    result: dict = {"command": f"python benchmarks/head_tier_footprint.py --repeats {ns.repeats} --images {ns.images}",
                    "images": ns.images, "repeats": ns.repeats,
                    "loadavg_start": [round(v, 2) for v in os.getloadavg()], "paths": {}}
    with tempfile.TemporaryDirectory(prefix="edgepfl-footprint-") as tmp:
        work = Path(tmp)
        prep = subprocess.run([env_python, "-c", PREPARE, str(ROOT), str(work), str(ns.images)], capture_output=True,
                              text=True, check=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        info = json.loads(prep.stdout.strip().splitlines()[-1])
        args = json.dumps({"encoder": info["encoder"], "head": str(work / "head.onnx"),
                           "pixels": str(work / "pixels.npy"), "heavy": list(HEAVY), "data": str(work / "data.npz"),
                           "state": str(work / "state")})
        paths = {name: [env_python, "-c", CHILD, name, args]
                 for name in ("predict new", "predict old", "agent imports new", "agent imports + run config",
                              "agent imports old",
                              "agent install new")}
        paths["fit child (lr)"] = [env_python, "-m", "edgepfl.edge_agent.head_fit", str(work / "fit")]
        for _ in range(ns.repeats):
            for name, cmd in paths.items():
                result["paths"].setdefault(name, []).append(run_child(cmd))
    result["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(result, ns.out, markdown)


if __name__ == "__main__":
    main()
