"""The head tier on sensor series: ``edgepfl fit-head``, ``predict`` and ``serve`` on raw
windows (6 channels x 100 samples, raw units), from an ``.npz`` and from a CSV sensor log,
torch-free: wall and CPU seconds and peak RSS of each, and ``serve``'s latency per request.

The release: a FedAvg run of the built-in ``cnn1d`` (``--arch cnn1d``) or of the plugin
encoder ``tests/plugins/sensor_cnn.py`` (``--arch plugin``, ``model.arch: sensor_cnn:build``),
untrained, exported as a coordinator exports it (the manifest carries the input contract and
the per-channel normalization of the fleet's CSV log). Preparing it needs torch, in a child;
this process imports only the standard library, and every measured command runs in a fresh
``python -c`` in which importing torch fails (a meta-path blocker) and which reports, at
exit, whether scikit-learn, scipy or torch were imported.

The device's data: a labelled CSV log of ``4 x 2 x --rows`` rows (4 activities, each a
stretch of ``--rows`` rows, twice over, every channel offset: another sensor), its windows
at stride 100 as an ``.npz`` (``x``, ``y``, ``class_names``), and an unlabelled log of the
same length with its windows as an ``.npz`` (``x`` only). Steps, interleaved within each of
``--repeats`` rounds so that load from other processes hits them alike:

* ``fit-head npz`` / ``fit-head csv``: ``edgepfl fit-head --head lr`` on the labelled windows;
* ``predict npz`` / ``predict csv``: ``edgepfl predict --json`` of the unlabelled windows with
  the CSV's head (the same windows both ways: the classes must be identical);
* ``agent install csv``: what a head agent does with a release (``HeadRuntime.install_release``
  on the labelled log: features, the fit in its child process, files); peak RSS is the larger
  of the installing process and its fit child;
* ``serve``: one ``edgepfl serve --state`` process (on the last install's state), its start to
  the first answer, then ``--requests`` requests of each kind interleaved — one window
  (``.npz``), every window of the unlabelled ``.npz``, the unlabelled CSV log — each timed from
  the request line's write to its answer line (p50 / p95), with the server's own ``ms`` and its
  CPU seconds (``/proc``, 10 ms ticks: the mean); its peak RSS is ``VmHWM`` at the end.

One-shot commands are started by a stdlib-only launcher (``benchmarks/arm64_head_tier.py``'s):
``ru_maxrss`` survives fork+exec, so it is reported from a parent of about 10 MiB.
``benchmarks/arm64_head_tier.py --input series`` runs these steps in its arm64 root under
qemu-user and in its x86_64 venv (:func:`run_steps`).

Usage::

    .venv/bin/python benchmarks/series_head_tier.py --repeats 3 --requests 20

Writes ``benchmarks/results/series_head_tier.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arm64_head_tier import brief, measured, must  # noqa: E402

from results_io import write_results  # noqa: E402

CLASSES = ("idle", "walk", "run", "fall")
CHANNELS, WINDOW = 6, 100
ARCHS = {"cnn1d": "cnn1d", "plugin": "sensor_cnn:build"}
HEAVY = ("torch", "sklearn", "scipy")

PREPARE = textwrap.dedent(r"""
    import json, sys, time
    from pathlib import Path
    import numpy as np
    repo, work, arch, rows = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    sys.path[:0] = [repo, f"{repo}/tests/plugins"]  # the plugin encoder, as a user's own file
    CLASSES, CHANNELS, WINDOW = ("idle", "walk", "run", "fall"), 6, 100

    def write_log(path, seed, rows, offset=0.0, label=True):
        # 6 channels in raw units (hundreds, +-tens); each class a stretch with its own frequency, twice over
        rng = np.random.default_rng(seed)
        lines = [",".join((["label"] if label else []) + [f"c{i}" for i in range(CHANNELS)])]
        for _ in range(2):
            for k, name in enumerate(CLASSES):
                t = np.arange(rows)[:, None]
                values = (100 * np.arange(CHANNELS) + offset + 30 * np.sin(t * (k + 1) / 9 + np.arange(CHANNELS))
                          + rng.normal(0, 3, (rows, CHANNELS)))
                lines += [",".join(([name] if label else []) + [f"{v:.3f}" for v in row]) for row in values]
        path.write_text("\n".join(lines) + "\n")
        return path

    import torch
    from edgepfl.config import MethodSpec, ModelSpec, RunConfig
    from edgepfl.data import load_client_data
    from edgepfl.data.sensors import read_csv_windows
    from edgepfl.export.onnx_export import export_state
    from edgepfl.methods import create_method
    from edgepfl.specs import CsvSpec, DataSpec
    from edgepfl.state import CheckpointMeta

    start = time.perf_counter()
    spec = DataSpec(dataset="csv", root=str(write_log(work / "fleet.csv", 0, 260)),
                    csv=CsvSpec(window=WINDOW, stride=50, classes=list(CLASSES)), num_clients=1)
    data = load_client_data(spec, 0)
    torch.manual_seed(0)
    method = create_method("fedavg", {})
    model_spec = ModelSpec(arch=arch, feature_dim=16)
    model = method.build_model(model_spec, data.input_shape, data.num_classes)
    run = RunConfig(method=MethodSpec(name="fedavg"), model=model_spec, data=spec, rounds=1)
    meta = CheckpointMeta(round=0, data_spec=spec,
                          run=run.run_spec(data.input_shape, data.num_classes, data.class_names, data.normalization))
    export_state(method.init_server(model), meta, work / "export", calibration=data.x_train)

    every = CsvSpec(window=WINDOW, stride=WINDOW, classes=list(CLASSES))  # predict's and fit-head's default stride
    device = write_log(work / "device.csv", 1, rows, offset=7.0)
    x, y, _, _ = read_csv_windows(device, every)
    np.savez(work / "device.npz", x=x, y=y, class_names=np.array(CLASSES))
    unlabelled = write_log(work / "unlabelled.csv", 2, rows, offset=7.0, label=False)
    xu = read_csv_windows(unlabelled, every, labelled=False)[0]
    np.savez(work / "windows.npz", x=xu)
    np.savez(work / "one.npz", x=xu[:1])
    print(json.dumps({"model_arch": arch, "device_rows": 8 * rows, "device_windows": int(len(x)),
                      "unlabelled_windows": int(len(xu)), "device_csv_bytes": device.stat().st_size,
                      "encoder_bytes": (work / "export" / "encoder.onnx").stat().st_size,
                      "encoder_params": int(sum(p.numel() for p in method.encoder_module(model).parameters())),
                      "prepare_s": round(time.perf_counter() - start, 1)}))
""")

#: run by the measured ``python -c``: torch cannot be imported; at exit, which heavy modules were
WRAP = textwrap.dedent(r"""
    import atexit, json, sys

    class NoTorch:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

    sys.meta_path.insert(0, NoTorch)
    modules_file, argv = sys.argv[1], sys.argv[2:]

    def loaded():
        with open(modules_file, "w") as f:
            json.dump(sorted({k.split(".")[0] for k in sys.modules} & {"torch", "sklearn", "scipy"}), f)

    atexit.register(loaded)
    if argv[0] == "install":  # a head agent's install of a release, on its own CSV log
        export, log, state = argv[1:4]
        from edgepfl.data import load_client_data
        from edgepfl.edge_agent.head_tier import HeadRuntime
        from edgepfl.export.onnx_export import read_release
        from edgepfl.specs import CsvSpec, DataSpec
        spec = DataSpec(dataset="csv", root=log, num_clients=1,
                        csv=CsvSpec(window=100, stride=100, classes=["idle", "walk", "run", "fall"]))
        manifest, artifact = read_release(export)
        fit = HeadRuntime(state, "lr", load_client_data(spec, 0)).install_release(
            manifest, artifact, manifest.encoder.sha256)
        print(json.dumps({"num_train": fit.num_train, "accuracy": fit.accuracy}))
        sys.exit(0)
    from edgepfl.cli import main
    sys.exit(main(argv))
""")

ONE_SHOTS = ("fit-head npz", "fit-head csv", "predict npz", "predict csv", "agent install csv")


def step_argv(name: str, p: dict, rep: int, head: str = "head-device.csv.onnx") -> list[str]:
    """The arguments after ``python -c WRAP MODULES_FILE`` of one step; ``p``: the files as the
    measured machine sees them (``work``: the folder :data:`PREPARE` wrote); ``head``: the file in
    it that predict runs (fit-head's on the CSV log)."""
    encoder, work = f"{p['work']}/export/encoder.onnx", p["work"]
    if name.startswith("fit-head"):
        data = "device.npz" if name.endswith("npz") else "device.csv"
        return ["fit-head", "--encoder", encoder, "--data", f"{work}/{data}", "--head", "lr",
                "--out", f"{work}/head-{data}.onnx", "--json"]
    if name.startswith("predict"):
        data = "windows.npz" if name.endswith("npz") else "unlabelled.csv"
        return ["predict", "--json", "--top", str(len(CLASSES)), "--encoder", encoder,
                "--head", f"{work}/{head}", f"{work}/{data}"]
    if name == "agent install csv":
        return ["install", f"{work}/export", f"{work}/device.csv", f"{work}/state-{rep}"]
    raise ValueError(name)


def prepare(work: Path, arch: str, rows: int, python: str = sys.executable) -> dict:
    """Export the release and write the device's files into ``work`` (a child that imports torch)."""
    done = subprocess.run([python, "-c", PREPARE, str(ROOT), str(work), ARCHS[arch], str(rows)], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"preparing the series release failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _classes(stdout: str) -> list[str]:
    return [json.loads(line)["predictions"][0]["class"] for line in stdout.splitlines() if line.strip()]


def _pid_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def time_serve(command: list[str], env: dict, p: dict, requests: int, log: Path, timeout: float) -> dict:
    """One ``serve`` process on ``state-0``; its start, ``requests`` requests of each kind, its peak RSS."""
    kinds = {"one window (npz)": [f"{p['work']}/one.npz"], "all windows (npz)": [f"{p['work']}/windows.npz"],
             "CSV log": [f"{p['work']}/unlabelled.csv"]}
    t0 = time.perf_counter()
    with open(f"{log}.err", "wb") as err:
        server = subprocess.Popen(command + ["serve", "--state", f"{p['work']}/state-0"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, env=env, text=True, cwd="/")
    assert server.stdin is not None and server.stdout is not None

    def ask(inputs: list[str]) -> tuple[dict, float, float]:
        cpu0, start = _pid_cpu_s(server.pid), time.perf_counter()
        server.stdin.write(json.dumps({"inputs": inputs}) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        wall = time.perf_counter() - start
        if not line:
            raise RuntimeError(f"serve ended without an answer: {Path(f'{log}.err').read_text()[-2000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"serve answered an error: {answer['error']}")
        return answer, wall, _pid_cpu_s(server.pid) - cpu0

    try:
        first, _, _ = ask(kinds["one window (npz)"])
        start_s = time.perf_counter() - t0
        samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
        answers: dict[str, int] = {}
        for _ in range(requests):
            for kind, inputs in kinds.items():
                answer, wall, cpu = ask(inputs)
                samples[kind].append((wall, answer["ms"] / 1000, cpu))
                answers[kind] = len(answer["results"])
        peak = _vm_hwm_mib(server.pid)
        server.stdin.close()
        rc = server.wait(timeout=timeout)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    rows = {}
    for kind, got in samples.items():
        walls = [w for w, _, _ in got]
        rows[kind] = {"windows": answers[kind], "requests": len(got), "p50_ms": round(1000 * _percentile(walls, 50), 2),
                      "p95_ms": round(1000 * _percentile(walls, 95), 2),
                      "server_p50_ms": round(1000 * statistics.median(s for _, s, _ in got), 2),
                      "cpu_ms_mean": round(1000 * statistics.mean(c for _, _, c in got), 2)}
    return {"start_to_first_answer_s": round(start_s, 2), "peak_rss_mib": peak, "rc": rc,
            "release_id": first.get("release_id"), "requests": rows}


def run_steps(command: list[str], env: dict, p: dict, host_work: Path, logs: Path, *, repeats: int, requests: int,
              timeout: float = 900, tag: str = "", on_round: Callable[[int], None] | None = None) -> dict:
    """Every step on one machine: ``command`` + ``[WRAP, …]`` starts a measured Python (the x86_64
    venv's, or the arm64 root's through ``in_root``); ``p``: the files as it sees them, ``host_work``
    the same folder here. Returns per step its runs (wall, CPU, peak RSS, heavy modules), the
    reports of fit-head and the installs, the classes predict printed, and serve's figures."""
    out: dict = {"steps": {name: [] for name in ONE_SHOTS}, "reports": {}, "classes": {}}
    for rep in range(repeats):
        if on_round:
            on_round(rep)
        for name in ONE_SHOTS:
            slug = name.replace(" ", "-")
            modules = f"{p['work']}/modules-{tag}{slug}.json"
            r = must(measured(command + ["-c", WRAP, modules, *step_argv(name, p, rep)], env=env,
                              log=logs / f"{tag}{slug}-{rep}.log", timeout=timeout), f"{tag}{name}")
            heavy = json.loads((host_work / Path(modules).name).read_text())
            out["steps"][name].append({**brief(r), "heavy": heavy})
            if name.startswith("predict"):
                out["classes"][name] = _classes(r["stdout"])
                out.setdefault("stdout", {})[name] = r["stdout"]
            elif r["stdout"].strip():
                out["reports"][name] = json.loads(r["stdout"].strip().splitlines()[-1])
    out["serve"] = time_serve(command + ["-c", WRAP, f"{p['work']}/modules-{tag}serve.json"], env, p, requests,
                              logs / f"{tag}serve", timeout)
    out["serve"]["heavy"] = json.loads((host_work / f"modules-{tag}serve.json").read_text())
    return out


def summary(steps: dict) -> dict:
    """Medians of each one-shot step's runs."""
    return {name: {k: round(statistics.median(r[k] for r in runs), 2) for k in ("wall_s", "cpu_s", "peak_rss_mib")}
            | {"heavy": sorted({m for r in runs for m in r["heavy"]})} for name, runs in steps.items()}


def checks(measure: dict) -> list[str]:
    """What must hold on every machine: no torch anywhere, the same classes from npz and CSV."""
    failures = []
    for name, runs in measure["steps"].items():
        if any("torch" in r["heavy"] for r in runs):
            failures.append(f"{name} imported torch")
        if name.startswith("predict") and any({"sklearn", "scipy"} & set(r["heavy"]) for r in runs):
            failures.append(f"{name} imported scikit-learn or scipy")
    if {"sklearn", "scipy", "torch"} & set(measure["serve"]["heavy"]):
        failures.append(f"serve imported {measure['serve']['heavy']}")
    npz, csv = measure["classes"].get("predict npz"), measure["classes"].get("predict csv")
    if not npz or npz != csv:
        failures.append("predict gave other classes for the CSV log than for its windows as .npz")
    return failures


def _loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def markdown_rows(s: dict, serve: dict, label: str = "") -> list[str]:
    """The one-shot steps' medians and serve's figures as table rows (``label``: a machine column)."""
    col = f" {label} |" if label else ""
    lines = []
    for name, m in s.items():
        lines.append(f"| {name} |{col} {m['wall_s']:.2f} | {m['cpu_s']:.2f} | {m['peak_rss_mib']:.1f} MiB | "
                     f"{', '.join(m['heavy']) or 'none'} |")
    lines.append(f"| serve: start to first answer |{col} {serve['start_to_first_answer_s']:.2f} | | "
                 f"{serve['peak_rss_mib']:.1f} MiB (VmHWM, at the end) | {', '.join(serve['heavy']) or 'none'} |")
    return lines


def serve_rows(serve: dict, label: str = "") -> list[str]:
    col = f" {label} |" if label else ""
    return [f"| {kind} |{col} {r['windows']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['server_p50_ms']:.1f} | "
            f"{r['cpu_ms_mean']:.1f} |" for kind, r in serve["requests"].items()]


def markdown(result: dict) -> str:
    info, m = result["inputs"], result["measure"]
    fit = m["reports"]
    lines = [f"# The head tier on sensor series ({result['machine']})", "",
             f"Command: `{result['command']}`  ",
             f"Release: FedAvg encoder `model.arch: {info['model_arch']}` ({info['encoder_params']} "
             f"parameters, ONNX {info['encoder_bytes']} bytes), untrained, exported with the fleet log's per-channel "
             f"normalization. Device: a labelled CSV log of {info['device_rows']} rows x 6 channels "
             f"({info['device_csv_bytes']} bytes, {info['device_windows']} windows of 6x100 at stride 100) and its "
             f"windows as .npz; an unlabelled log of {info['unlabelled_windows']} windows, as CSV and as .npz. "
             f"Load average {result['loadavg_start']} at start, {result['loadavg_end']} at end. Medians of "
             f"{result['repeats']} interleaved runs, each a fresh process in which importing torch fails.", "",
             f"**Checks: {'all passed' if not result['failures'] else 'FAILED: ' + '; '.join(result['failures'])}**", "",
             "| step | wall s | CPU s | peak RSS | heavy modules imported |", "|---|---|---|---|---|"]
    lines += markdown_rows(summary(m["steps"]), m["serve"])
    lines += ["", f"serve, {m['serve']['requests']['CSV log']['requests']} requests of each kind, interleaved, one "
                  "after another (request line written to answer line read):", "",
              "| request | windows | p50 ms | p95 ms | server ms (p50) | server CPU ms (mean) |", "|---|---|---|---|---|---|"]
    lines += serve_rows(m["serve"])
    lines += ["", f"fit-head (lr) held-out accuracy: npz {fit['fit-head npz']['validation_accuracy']:.4f}, CSV "
                  f"{fit['fit-head csv']['validation_accuracy']:.4f}; agent install: {fit['agent install csv']}. "
                  "predict: the same classes for the CSV log and its windows as .npz.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="cnn1d")
    parser.add_argument("--rows", type=int, default=2000, help="rows per class stretch of the device's logs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="serve requests of each kind")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "series_head_tier"))
    ns = parser.parse_args()
    result: dict = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
                    "machine": f"{platform.machine()}, {_cpu_model()}, {os.cpu_count()} CPUs, Python "
                               f"{platform.python_version()}",
                    "repeats": ns.repeats, "loadavg_start": _loadavg()}
    with tempfile.TemporaryDirectory(prefix="edgepfl-series-bench-") as tmp:
        work, logs = Path(tmp), Path(tmp) / "logs"
        logs.mkdir()
        result["inputs"] = prepare(work, ns.arch, ns.rows)
        paths = {"work": str(work)}
        measure = run_steps([sys.executable], dict(os.environ), paths, work, logs, repeats=ns.repeats,
                            requests=ns.requests,
                            on_round=lambda rep: print(f"round {rep + 1}/{ns.repeats}", file=sys.stderr, flush=True))
    result["failures"] = checks(measure)
    measure.pop("stdout")
    measure["predicted_windows"] = {step: len(classes) for step, classes in measure.pop("classes").items()}
    result["measure"] = measure
    result["summary"] = summary(measure["steps"])
    result["loadavg_end"] = _loadavg()
    write_results(result, ns.out, markdown)
    if result["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
