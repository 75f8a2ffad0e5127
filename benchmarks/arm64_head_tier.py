"""The head tier on arm64, under emulation: the wheel with ``[agent]`` in a Debian bookworm
arm64 root run by qemu-user, ``fit-head``, ``predict`` and a live head agent against a
Mosquitto and a coordinator on this (x86_64) host.

Needs root (debootstrap, chroot, mounts), ``apt-get install debootstrap qemu-user-static
binfmt-support mosquitto``, and this checkout's ``[train]`` environment (the host exports
the encoder and runs the coordinator). Steps, each timed (wall and CPU seconds; peak RSS of
the emulated processes, which includes qemu's own):

1. the root: ``debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv``,
   cached in ``--root`` (default ``/var/cache/edgepfl/arm64-bookworm``, or
   ``$EDGEPFL_ARM64_ROOT``) so that the next run skips it; ``--fresh`` makes a new one;
2. the wheel from ``scripts/release.sh``, installed with ``[agent]`` into the root's venv
   ``/opt/edgepfl`` from PyPI with ``--only-binary :all:`` (aarch64 wheels only); torch
   must not be installed;
3. on an encoder exported here (a FedAvg MLP on digits, ``tests/export_fixtures.py``):
   ``edgepfl fit-head`` and ``edgepfl predict`` (PNG files and a ``.npy``) in the root
   under ``QEMU_CPU=cortex-a53`` and the same commands on x86_64; the predicted classes must
   be identical and the probabilities equal to ``--tolerance`` (default 1e-4), for each
   machine's own head and for the x86 head run on both;
4. a live federation: Mosquitto on a free loopback port, two trainer agents and the
   coordinator here (``release_at_end``, ``min_head_agents: 1``) and a head agent in the
   root (it shares the host's network); its report must reach ``head_metrics.json``.

``--input series`` replaces steps 3 and 4 with the steps of ``benchmarks/series_head_tier.py``
(fit-head, predict, a head agent's install and serve on raw 6x100 sensor windows from an
``.npz`` and a CSV log, in processes where importing torch fails), in the root and in the
x86_64 venv; the x86_64 head run in the root must give x86_64's classes and probabilities.

Exit 0 when every check holds, 1 when one fails (the failures are listed), 2 on bad input
or a missing tool (one line). Results go to ``--out`` (``.json`` and ``.md``).

Usage (from the repository root)::

    .venv/bin/python benchmarks/arm64_head_tier.py             # reuses the cached root
    .venv/bin/python benchmarks/arm64_head_tier.py --fresh     # cold: a new root first
    .venv/bin/python benchmarks/arm64_head_tier.py --input series --repeats 1 --requests 10

Writes ``benchmarks/results/arm64_head_tier.json`` and ``.md`` by default
(``arm64_series_head_tier`` with ``--input series``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # tests/ (its fixtures); edgepfl as this environment installs it
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

DEFAULT_ROOT = "/var/cache/edgepfl/arm64-bookworm"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
VENV = "/opt/edgepfl"  # inside the root
HALF = 48  # images predicted from PNG files, and as many from a .npy
READY = ".edgepfl-root-ready"  # written into the root once debootstrap and the venv are done
APT_HINT = "apt-get install debootstrap qemu-user-static binfmt-support"
ROOT_PATH = "/opt/edgepfl/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# predict's imports and a head agent's, each timed in a fresh emulated process
IMPORTS = {
    "predict": "edgepfl.export.predict",
    "head_agent": "edgepfl.edge_agent.agent, edgepfl.edge_agent.head_tier",
}


class Refused(Exception):
    """Bad input or a missing tool: one line, exit 2."""


# ----------------------------------------------------------------------------- processes
# Starts a command and reports its rusage. ``ru_maxrss`` survives fork+exec: a command
# started by this process (torch imported, ~800 MiB) would report at least that much, so
# commands are started by a small stdlib-only Python instead, whose figure is ~10 MiB.
# It ignores SIGTERM (a handler, reset by exec) so that it outlives the command it waits for.
LAUNCHER = """
import json, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: None)
proc = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "cpu_s": ru.ru_utime + ru.ru_stime,
               "maxrss_kib": ru.ru_maxrss}, f)
"""


def launch(cmd: list[str], log: Path) -> list[str]:
    return [sys.executable, "-S", "-c", LAUNCHER, f"{log}.rusage", *cmd]


def measured(cmd: list[str], *, env: dict | None = None, log: Path, timeout: float = 900,
             cwd: str | Path = "/") -> dict:
    """Run ``cmd`` to its end with stdout in ``log`` and stderr in ``log``.err; its exit status,
    wall and CPU seconds and peak RSS (``wait4``: it and its children)."""
    with open(log, "wb") as out, open(f"{log}.err", "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(launch(cmd, log), stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        return _reap(proc, start, log, timeout)


def _reap(proc: subprocess.Popen, start: float, log: Path, timeout: float | None) -> dict:
    """Wait for a :func:`launch`-ed command (SIGKILL to its group after ``timeout``)."""
    killed = threading.Event()

    def kill():
        killed.set()
        _killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer:
        timer.start()
    try:
        proc.wait()
    finally:
        if timer:
            timer.cancel()
    wall = time.perf_counter() - start
    usage_path = Path(f"{log}.rusage")
    usage = json.loads(usage_path.read_text()) if usage_path.exists() else {}
    err = Path(f"{log}.err")
    return {
        "rc": usage.get("rc", proc.returncode), "timed_out": killed.is_set(),
        "wall_s": round(wall, 2), "cpu_s": round(usage.get("cpu_s", float("nan")), 2),
        "peak_rss_mib": round(usage.get("maxrss_kib", float("nan")) / 1024, 1),
        "stdout": Path(log).read_text(errors="replace"),
        "stderr": err.read_text(errors="replace") if err.exists() else "",
    }


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def in_root(root: Path, argv: list[str]) -> list[str]:
    """``argv`` run in ``root`` (chroot; aarch64 binaries start qemu through binfmt_misc), with
    /proc and /dev mounted in a private mount namespace that ends with the process.

    Not /sys: the host's x86 CPU topology there, beside qemu-user's /proc/cpuinfo, makes
    onnxruntime 1.32's cpuinfo crash (SIGSEGV on import); without it cpuinfo gives up with
    a warning, as it does under systemd's ``ProcSubset=pid``."""
    script = ('set -e; r="$1"; shift; mount -t proc proc "$r/proc"; mount --rbind /dev "$r/dev"; '
              'exec chroot "$r" "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(root), *argv]


def root_env(cpu: str | None) -> dict:
    env = {"PATH": ROOT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
           "PIP_CERT": "/etc/edgepfl-host-ca.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_DEFAULT_TIMEOUT": "180"}
    if cpu:
        env["QEMU_CPU"] = cpu
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def x86_env() -> dict:
    """The x86_64 venv's commands: this host's environment, nothing imported from a checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}


def check_host_imports() -> None:
    """The coordinator and trainer agents here must be this checkout's code (a venv whose
    editable install points at another checkout would mix the two)."""
    import edgepfl
    import edgepfl.coordinator
    import edgepfl.edge_agent
    import edgepfl.export

    for module in (edgepfl, edgepfl.coordinator, edgepfl.edge_agent, edgepfl.export):
        where = Path(module.__file__ or "").resolve()
        if not where.is_relative_to(REPO):
            raise Refused(f"{module.__name__} is imported from {where}, not from {REPO}: run this checkout's "
                          "own venv (or PYTHONPATH=build/mypy after bash scripts/check.sh mypy)")


def must(result: dict, what: str) -> dict:
    if result["rc"] != 0:
        tail = (result["stderr"] or result["stdout"]).strip().splitlines()[-15:]
        raise RuntimeError(f"{what} failed (exit {result['rc']}{', timed out' if result['timed_out'] else ''}):\n"
                           + "\n".join(tail))
    return result


def brief(result: dict) -> dict:
    return {k: result[k] for k in ("wall_s", "cpu_s", "peak_rss_mib")}


# ----------------------------------------------------------------------------- preflight
def preflight() -> dict:
    """Refuse (one line) what cannot work; register qemu-aarch64 with binfmt_misc if needed."""
    if os.geteuid() != 0:
        raise Refused("needs root (debootstrap, chroot and mounts); run it with sudo")
    for tool, package in (("debootstrap", "debootstrap"), ("qemu-aarch64-static", "qemu-user-static"),
                          ("unshare", "util-linux"), ("chroot", "coreutils")):
        if not shutil.which(tool) and not Path("/usr/sbin", tool).exists():
            raise Refused(f"{tool} is not installed: {APT_HINT} (it comes with {package})")
    from edgepfl.testing import find_mosquitto

    if not find_mosquitto():
        raise Refused("mosquitto is not installed: apt-get install mosquitto")
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists():
        if not Path("/proc/sys/fs/binfmt_misc/register").exists():
            subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc"],
                           capture_output=True)
        if shutil.which("update-binfmts"):
            subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    if not entry.exists() or "enabled" not in entry.read_text():
        raise Refused("qemu-aarch64 is not registered with binfmt_misc: " + APT_HINT +
                      ", then update-binfmts --enable qemu-aarch64")
    flags = next((line.split()[1] for line in entry.read_text().splitlines() if line.startswith("flags:")), "")
    if "F" not in flags:
        raise Refused(f"qemu-aarch64's binfmt_misc entry lacks the F flag (has {flags!r}): "
                      "a chroot cannot see the interpreter; reinstall qemu-user-static")
    version = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout
    cpus = subprocess.run(["qemu-aarch64-static", "-cpu", "help"], capture_output=True, text=True).stdout
    return {"qemu": version.splitlines()[0] if version else "?", "cpus": cpus.split()}


# ----------------------------------------------------------------------------- the root
def prepare_root(root: Path, fresh: bool, mirror: str, work_logs: Path) -> dict:
    """The cached arm64 root with python3 and the venv; made (debootstrap) when absent."""
    info: dict = {"path": str(root), "suite": SUITE, "mirror": mirror}
    if fresh and root.exists():
        shutil.rmtree(root)
    if (root / READY).exists():
        info["cached"] = True
        info["made"] = (root / READY).read_text().strip()
        return info
    info["cached"] = False
    partial = root.with_name(root.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    if root.exists():  # an unfinished root from an earlier run
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
           SUITE, str(partial), mirror]
    r = must(measured(cmd, log=work_logs / "debootstrap.log", timeout=1800), "debootstrap")
    info["debootstrap"] = brief(r)
    info["debootstrap_command"] = " ".join(cmd)
    r = must(measured(in_root(partial, ["python3", "-m", "venv", VENV]), env=root_env(None),
                      log=work_logs / "venv.log"), "python3 -m venv in the root")
    info["venv"] = brief(r)
    (partial / READY).write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {' '.join(cmd)}\n")
    partial.rename(root)
    return info


def du_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sxk", str(path)], capture_output=True, text=True).stdout.split()
    return round(int(out[0]) / 1024, 1) if out else float("nan")


# ----------------------------------------------------------------------------- the checks
def compare_predictions(a: str, b: str) -> dict:
    """Two ``predict --json --top N`` outputs: same inputs, same classes, the largest
    probability difference over every class."""
    ra = [json.loads(line) for line in a.splitlines() if line.strip()]
    rb = [json.loads(line) for line in b.splitlines() if line.strip()]
    same_inputs = [Path(x["input"]).name for x in ra] == [Path(x["input"]).name for x in rb]
    top_a = [x["predictions"][0]["class"] for x in ra]
    top_b = [x["predictions"][0]["class"] for x in rb]
    diff = 0.0
    for x, y in zip(ra, rb):
        pa = {p["class"]: p["probability"] for p in x["predictions"]}
        pb = {p["class"]: p["probability"] for p in y["predictions"]}
        if pa.keys() != pb.keys():
            diff = float("inf")
            break
        diff = max([diff] + [abs(pa[k] - pb[k]) for k in pa])
    return {"inputs": len(ra), "same_inputs": same_inputs and len(ra) == len(rb) and len(ra) > 0,
            "same_classes": top_a == top_b, "classes_differing": sum(p != q for p, q in zip(top_a, top_b)),
            "max_abs_probability_diff": diff}


def make_inputs(work: Path) -> dict:
    """Export a small encoder; the new client's data: a ``.npz`` to fit on, and 96 images it
    does not hold, 48 as PNG files and 48 as a ``.npy``, to predict."""
    import numpy as np
    from PIL import Image

    from tests.export_fixtures import NEW_CLIENT, client_pixels, export_dir

    start = time.perf_counter()
    export = export_dir(work, "fedavg", rounds=2)
    pixels, y, names = client_pixels(NEW_CLIENT)  # float pixels in [0, 1]
    keep = len(y) - 2 * HALF
    np.savez(work / "client.npz", x=pixels[:keep], y=y[:keep], class_names=np.array(names))
    images = work / "images"
    images.mkdir()
    raw = np.clip(np.rint(pixels[keep:keep + HALF, 0] * 255), 0, 255).astype(np.uint8)
    for i, img in enumerate(raw):
        Image.fromarray(img, mode="L").save(images / f"img{i:03d}.png")
    np.save(work / "more.npy", pixels[keep + HALF:])
    return {"export": export, "fit_samples": int(keep), "png_images": HALF, "npy_images": HALF,
            "labels": [names[int(c)] for c in y[keep:]],  # in predict's order: the PNG files, then the .npy
            "export_s": round(time.perf_counter() - start, 1), "encoder_bytes": (export / "encoder.onnx").stat().st_size}


def live_federation(root: Path, work: Path, chroot_work: str, cpu: str | None, logs: Path, timeout: float) -> dict:
    """Mosquitto, two trainer agents and a coordinator here; a head agent in the root."""
    import yaml

    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_config
    from edgepfl.testing import MosquittoBroker

    from tests.fleet_helpers import RunningFleet, run_config

    broker = MosquittoBroker()
    broker.start()
    config = run_config(method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 32},
                        data={"dataset": "digits", "samples_per_client": None}, rounds=2, release_at_end=True,
                        round_timeout_s=timeout, wait_for_agents_s=timeout, min_head_agents=1)
    out = work / "coordinator"
    state_dir = f"{chroot_work}/pi-00"
    result: dict = {"federation": config.federation, "broker": broker.url, "trainer_agents": 2, "rounds": 2}
    pi = None
    try:
        with RunningFleet(config, out, broker.url, 2) as fleet:
            cfg = fleet.config.model_copy(update={"data": fleet.config.data.model_copy(update={"num_clients": 3})})
            head_cfg = agent_config(cfg, out, broker.url, "pi-00", 2, "head", "svm", 1)
            head_cfg = head_cfg.model_copy(update={"state_dir": state_dir})
            (work / "pi.yaml").write_text(yaml.safe_dump(head_cfg.model_dump(mode="json")))
            log = logs / "head-agent.log"
            cmd = in_root(root, [f"{VENV}/bin/edgepfl", "--log-level", "info", "agent", "--config",
                                 f"{chroot_work}/pi.yaml"])
            with open(log, "wb") as f:
                start = time.perf_counter()
                pi = subprocess.Popen(launch(cmd, log), stdout=f, stderr=subprocess.STDOUT, env=root_env(cpu),
                                      start_new_session=True)
            fleet_ = MqttFleet(cfg.federation, cfg.broker, url=broker.url)
            coord_start = time.perf_counter()
            try:
                Coordinator(cfg, fleet_, out, progress=False, **fleet.shape()).run()
            finally:
                fleet_.close()
            result["coordinator_run_s"] = round(time.perf_counter() - coord_start, 1)
            _killpg(pi.pid, signal.SIGTERM)
            stop = time.perf_counter()
            agent = _reap(pi, start, log, 60)  # SIGKILL after 60 s
            pi = None
            result["head_agent"] = {**brief(agent), "rc_after_sigterm": agent["rc"], "killed": agent["timed_out"],
                                    "stop_s": round(time.perf_counter() - stop, 1)}
    finally:
        if pi is not None:
            _killpg(pi.pid, signal.SIGKILL)
            pi.wait()
        broker.stop()
    text = (logs / "head-agent.log").read_text(errors="replace")
    result["head_agent_log_tracebacks"] = text.count("Traceback")
    metrics = out / "head_metrics.json"
    reports = json.loads(metrics.read_text()) if metrics.exists() else {}
    release = root / state_dir.lstrip("/") / "release.json"
    record = json.loads(release.read_text()) if release.exists() else {}
    report = next((entry["reports"].get("pi-00") for entry in reports.values()), None)
    result["report"] = report
    result["installed_release"] = record.get("release_id")
    result["release_files"] = {"encoder": record.get("encoder_file"), "head": record.get("head_file")}
    return result


def image_steps(root: Path, work: Path, chroot_work: str, x86: Path, env: dict, cpu: str | None,
                ns: argparse.Namespace, logs: Path, result: dict, failures: list[str]) -> None:
    """Steps 3 and 4 on the digits release: fit-head and predict in the root and here, compared;
    a live head agent in the root."""
    # 3. fit-head and predict, here and in the root
    inputs = make_inputs(work)
    export = inputs.pop("export")
    result["labels"] = inputs.pop("labels")
    result["inputs"] = inputs
    rel = export.relative_to(root)
    inside = {"encoder": f"/{rel}/encoder.onnx", "npz": f"{chroot_work}/client.npz",
              "images": f"{chroot_work}/images", "npy": f"{chroot_work}/more.npy", "work": chroot_work}
    host = {"encoder": str(export / "encoder.onnx"), "npz": str(work / "client.npz"),
            "images": str(work / "images"), "npy": str(work / "more.npy"), "work": str(work)}
    machines = {"arm64": (lambda argv: in_root(root, [f"{VENV}/bin/edgepfl", *argv]), env, inside),
                "x86_64": (lambda argv: [str(x86 / "bin" / "edgepfl"), *argv], x86_env(), host)}
    result["fit_head"], result["predict"] = {}, {}
    for kind in ns.heads:
        fits: dict = {}
        for machine, (cmd, menv, p) in machines.items():
            r = must(measured(cmd(["fit-head", "--encoder", p["encoder"], "--data", p["npz"], "--head", kind,
                                   "--out", f"{p['work']}/{kind}-{machine}.onnx", "--json"]), env=menv,
                              log=logs / f"fit-{kind}-{machine}.log"), f"fit-head --head {kind} on {machine}")
            fits[machine] = {**brief(r), "report": json.loads(r["stdout"].strip().splitlines()[-1])}
        a, b = fits["arm64"]["report"], fits["x86_64"]["report"]
        fits["same_accuracies"] = (a["train_accuracy"], a["validation_accuracy"]) == (
            b["train_accuracy"], b["validation_accuracy"])
        if not fits["same_accuracies"]:
            failures.append(f"fit-head {kind}: arm64 {a['validation_accuracy']} vs x86_64 "
                            f"{b['validation_accuracy']} held-out accuracy")
        result["fit_head"][kind] = fits
        outs: dict = {}
        runs = {"own": {"arm64": "arm64", "x86_64": "x86_64"}, "x86_head": {"arm64": "x86_64", "x86_64": "x86_64"}}
        for case, heads in runs.items():
            for machine, (cmd, menv, p) in machines.items():
                head = f"{p['work']}/{kind}-{heads[machine]}.onnx"
                if case == "x86_head" and machine == "x86_64":
                    outs[(case, machine)] = outs[("own", "x86_64")]
                    continue
                r = must(measured(cmd(["predict", "--json", "--top", "10", "--encoder", p["encoder"], "--head",
                                       head, p["images"], p["npy"]]), env=menv,
                                  log=logs / f"predict-{kind}-{case}-{machine}.log"),
                         f"predict ({kind}, {case}) on {machine}")
                outs[(case, machine)] = r
        pred: dict = {"arm64": brief(outs[("own", "arm64")]), "x86_64": brief(outs[("own", "x86_64")])}
        for case in runs:
            cmp = compare_predictions(outs[(case, "arm64")]["stdout"], outs[(case, "x86_64")]["stdout"])
            pred[f"agreement_{case}"] = cmp
            if not (cmp["same_inputs"] and cmp["same_classes"] and cmp["max_abs_probability_diff"] <= ns.tolerance):
                failures.append(f"predict {kind} ({case} heads): arm64 and x86_64 disagree: {cmp}")
        pred["accuracy"] = accuracy(outs[("own", "arm64")]["stdout"], result["labels"])
        result["predict"][kind] = pred

    # 4. a live head agent in the root against a coordinator here
    live = live_federation(root, work, chroot_work, cpu, logs, ns.live_timeout)
    result["live"] = live
    report = live["report"]
    if not report:
        failures.append("the arm64 head agent's report did not reach the coordinator (head_metrics.json)")
    elif not (report.get("tier") == "head" and report.get("head") == "svm" and report.get("accuracy", 0) > 0.5
              and report.get("release_id") == live["installed_release"]):
        failures.append(f"the arm64 head agent's report is wrong: {report}")
    if live["head_agent_log_tracebacks"]:
        failures.append(f"the head agent's log has a traceback (log: {logs / 'head-agent.log'})")


def series_steps(root: Path, work: Path, chroot_work: str, x86: Path, env: dict, ns: argparse.Namespace,
                 logs: Path, result: dict, failures: list[str]) -> None:
    """``--input series``: the steps of ``benchmarks/series_head_tier.py`` (fit-head, predict, a head
    agent's install and serve on raw 6x100 windows from an .npz and a CSV log, in processes where
    importing torch fails) in the root and in the x86_64 venv, each in its own copy of the files.
    predict must agree: the x86_64 head run in the root gives the x86_64 classes and probabilities
    (to ``--tolerance``); each machine's own head the same classes (their probabilities differ by
    what the two fits differ: reported, not held to the tolerance); fit-head the same accuracies."""
    import series_head_tier as series

    prepared = work / "series"
    prepared.mkdir()
    result["series_inputs"] = series.prepare(prepared, ns.arch, ns.rows)
    machines = {"arm64": (in_root(root, [f"{VENV}/bin/python"]), env),
                "x86_64": ([str(x86 / "bin" / "python")], x86_env())}
    measures: dict = {}
    for machine, (command, menv) in machines.items():
        host = work / f"series-{machine}"
        shutil.copytree(prepared, host)
        inside = {"work": f"{chroot_work}/series-{machine}" if machine == "arm64" else str(host)}
        m = series.run_steps(command, menv, inside, host, logs, repeats=ns.repeats, requests=ns.requests,
                             tag=f"series-{machine}-")
        failures += [f"{machine}: {f}" for f in series.checks(m)]
        measures[machine] = m
    agreement: dict = {}
    arm_work = work / "series-arm64"
    shutil.copyfile(work / "series-x86_64" / "head-device.csv.onnx", arm_work / "head-x86_64.onnx")
    for step in ("predict npz", "predict csv"):
        x86_out = measures["x86_64"]["stdout"][step]
        own = compare_predictions(measures["arm64"]["stdout"][step], x86_out)
        argv = series.step_argv(step, {"work": f"{chroot_work}/series-arm64"}, 0, head="head-x86_64.onnx")
        modules = f"{chroot_work}/series-arm64/modules-x86-head.json"
        r = must(measured(machines["arm64"][0] + ["-c", series.WRAP, modules, *argv], env=env,
                          log=logs / f"series-arm64-{step.replace(' ', '-')}-x86-head.log"), f"{step} (x86_64 head) on arm64")
        x86_head = compare_predictions(r["stdout"], x86_out)
        agreement[step] = {"own": own, "x86_head": x86_head}
        if not (own["same_inputs"] and own["same_classes"]):
            failures.append(f"{step}, each machine's own head: arm64 and x86_64 disagree: {own}")
        if not (x86_head["same_inputs"] and x86_head["same_classes"]
                and x86_head["max_abs_probability_diff"] <= ns.tolerance):
            failures.append(f"{step}, the x86_64 head on both: arm64 and x86_64 disagree: {x86_head}")
    for step in ("fit-head npz", "fit-head csv"):
        a, b = (measures[m]["reports"][step] for m in machines)
        if (a["train_accuracy"], a["validation_accuracy"]) != (b["train_accuracy"], b["validation_accuracy"]):
            failures.append(f"{step}: arm64 {a['validation_accuracy']} vs x86_64 {b['validation_accuracy']} held-out")
    for m in measures.values():
        m.pop("stdout")
        m.pop("classes")
        m["summary"] = series.summary(m["steps"])
    result["series"] = {"repeats": ns.repeats, "agreement": agreement, **measures}


def run(ns: argparse.Namespace) -> dict:
    t_total = time.perf_counter()
    check_host_imports()
    qemu = preflight()
    cpu = ns.cpu if ns.cpu in qemu["cpus"] else None
    root = Path(ns.root).absolute()
    lock_path = root.with_name(root.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(lock_path, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time per root: each reinstalls the wheel
    result: dict = {"command": "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": host_info(),
                    "qemu": qemu["qemu"], "qemu_cpu": cpu or "(qemu's default: max)", "tolerance": ns.tolerance}
    failures: list[str] = []
    name = f"run-{uuid.uuid4().hex[:8]}"
    chroot_work = f"/work/{name}"
    # logs outside the root, so a fresh root may be made while they are written
    logs = root.with_name(root.name + ".logs") / name
    logs.mkdir(parents=True)
    work: Path | None = None
    try:
        t = time.perf_counter()
        result["root"] = prepare_root(root, ns.fresh, ns.mirror, logs)
        result["root"]["prepare_s"] = round(time.perf_counter() - t, 1)
        work = root / chroot_work.lstrip("/")
        work.mkdir(parents=True)
        os.environ["TMPDIR"] = str(work)  # what this run's tools write to a temporary folder stays here
        shutil.copyfile(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt",
                        root / "etc/edgepfl-host-ca.crt")
        shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf")
        env = root_env(cpu)

        # 2. the wheel, installed with [agent] from PyPI, aarch64 wheels only
        t = time.perf_counter()
        release = subprocess.run(["bash", "scripts/release.sh", str(work / "dist")], cwd=REPO, capture_output=True,
                                 text=True, env=dict(os.environ, PYTHON=sys.executable))
        if release.returncode != 0:
            raise RuntimeError(f"scripts/release.sh failed: {release.stderr.strip()[-2000:]}")
        wheel = Path(release.stdout.split()[-1])
        result["wheel"] = {"name": wheel.name, "build_s": round(time.perf_counter() - t, 1)}
        inside_wheel = f"{chroot_work}/dist/{wheel.name}"
        subprocess.run(in_root(root, [f"{VENV}/bin/pip", "uninstall", "-y", "-q", "edgepfl"]), env=env,
                       capture_output=True)
        r = must(measured(in_root(root, [f"{VENV}/bin/pip", "install", "--only-binary", ":all:",
                                         f"{inside_wheel}[agent]"]), env=env, log=logs / "pip-install.log",
                          timeout=1800), "pip install edgepfl[agent] in the root")
        freeze = must(measured(in_root(root, [f"{VENV}/bin/pip", "freeze"]), env=env, log=logs / "pip-freeze.log"),
                      "pip freeze")["stdout"].splitlines()
        probe = must(measured(in_root(root, [f"{VENV}/bin/python", "-c", PROBE]), env=env, log=logs / "probe.log"),
                     "the root's python")
        facts = json.loads(probe["stdout"].strip().splitlines()[-1])
        result["install"] = {**brief(r), "downloaded": "Downloading" in r["stdout"], "packages": freeze,
                             "venv_mib": du_mib(root / VENV.lstrip("/")), **facts}
        if facts["machine"] != "aarch64":
            failures.append(f"the root's python runs on {facts['machine']}, not aarch64")
        if facts["torch"] or any(p.lower().startswith("torch") for p in freeze):
            failures.append("torch is installed in the root's [agent] venv")

        # the same wheel and the same package versions in an x86_64 venv, for the comparison
        x86 = root.with_name(root.name + ".x86-venv")
        t = time.perf_counter()
        if ns.fresh and x86.exists():
            shutil.rmtree(x86)
        if not (x86 / "bin" / "python").exists():
            must(measured([sys.executable, "-m", "venv", str(x86)], env=x86_env(), log=logs / "x86-venv.log"),
                 "python -m venv (x86_64)")
        pins = work / "constraints.txt"
        pins.write_text("\n".join(p for p in freeze if not p.lower().startswith("edgepfl")) + "\n")
        subprocess.run([str(x86 / "bin" / "pip"), "uninstall", "-y", "-q", "edgepfl"], env=x86_env(),
                       capture_output=True)
        must(measured([str(x86 / "bin" / "pip"), "install", "--only-binary", ":all:", "-c", str(pins), f"{wheel}[agent]"],
                      env=x86_env(), log=logs / "x86-pip-install.log", timeout=1800), "pip install (x86_64)")
        result["install"]["x86_64_venv"] = {"path": str(x86), "install_s": round(time.perf_counter() - t, 1)}

        # import time and peak RSS of predict's and a head agent's imports, under emulation
        result["imports"] = {}
        for what, modules in IMPORTS.items():
            code = ("import time, json; t = time.perf_counter(); c = time.process_time(); import " + modules +
                    "; import sys; print(json.dumps({'import_s': time.perf_counter() - t, "
                    "'import_cpu_s': time.process_time() - c, 'torch': 'torch' in sys.modules, "
                    "'sklearn': 'sklearn' in sys.modules, 'scipy': 'scipy' in sys.modules}))")
            result["imports"][what] = {"modules": modules}
            for machine, cmd, menv in (("arm64", in_root(root, [f"{VENV}/bin/python", "-c", code]), env),
                                       ("x86_64", [str(x86 / "bin" / "python"), "-c", code], x86_env())):
                r = must(measured(cmd, env=menv, log=logs / f"import-{what}-{machine}.log"),
                         f"importing {modules} on {machine}")
                inner = json.loads(r["stdout"].strip().splitlines()[-1])
                result["imports"][what][machine] = {
                    **brief(r), **{k: round(v, 2) if isinstance(v, float) else v for k, v in inner.items()}}

        if ns.input == "series":
            series_steps(root, work, chroot_work, x86, env, ns, logs, result, failures)
        else:
            image_steps(root, work, chroot_work, x86, env, cpu, ns, logs, result, failures)
    except RuntimeError as exc:
        failures.append(str(exc))
    finally:
        if work is not None and not ns.keep:
            shutil.rmtree(work, ignore_errors=True)
        lock.close()
    result.setdefault("root", {"path": str(root)})["du_mib"] = du_mib(root) if root.exists() else None
    result["total_s"] = round(time.perf_counter() - t_total, 1)
    result["failures"] = failures
    result["logs"] = str(logs)
    return result


PROBE = """
import importlib.util, json, platform, sys
import numpy, onnxruntime, sklearn
print(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                  "numpy": numpy.__version__, "onnxruntime": onnxruntime.__version__,
                  "onnxruntime_providers": onnxruntime.get_available_providers(),
                  "scikit_learn": sklearn.__version__, "torch": importlib.util.find_spec("torch") is not None}))
"""


def accuracy(stdout: str, labels: list[str]) -> float:
    rows = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    hits = [r["predictions"][0]["class"] == label for r, label in zip(rows, labels)]
    return round(sum(hits) / len(hits), 4) if hits and len(rows) == len(labels) else float("nan")


def host_info() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "load_avg_start": [round(x, 2) for x in os.getloadavg()],
            "machine": platform.machine(), "python": platform.python_version()}


# ----------------------------------------------------------------------------- report
def markdown(r: dict) -> str:
    root, inst = r["root"], r.get("install", {})
    cold = not root.get("cached")
    lines = [
        "# The head tier on arm64 under emulation", "",
        f"Command: `{r['command']}` ({r['date']}; host {r['host']['cpu']}, {r['host']['cores']} cores, "
        f"load average {r['host']['load_avg_start'][0]} at start; {r['qemu']}, `QEMU_CPU={r['qemu_cpu']}`).", "",
        f"**Result: {'all checks passed' if not r['failures'] else 'FAILED: ' + '; '.join(r['failures'])}** — "
        f"{'cold run (a new root)' if cold else 'warm run (cached root)'}, total **{r['total_s']} s** wall.", "",
        "Wall and CPU seconds of each step; peak RSS is the emulated process's, qemu included.", "",
        "| step | wall | CPU | peak RSS |", "|---|---|---|---|",
    ]

    def row(name: str, m: dict | None) -> None:
        if m:
            lines.append(f"| {name} | {m['wall_s']} s | {m['cpu_s']} s | {m.get('peak_rss_mib', '')} MiB |")

    if cold:
        row(f"debootstrap (bookworm arm64 minbase + python3; root {root.get('du_mib')} MiB)", root.get("debootstrap"))
        row("python3 -m venv in the root", root.get("venv"))
    else:
        lines.append(f"| the root, cached ({root['path']}, {root.get('du_mib')} MiB) | 0 s | | |")
    if inst:
        row(f"pip install wheel[agent] --only-binary :all: ({'from PyPI' if inst.get('downloaded') else 'deps cached'}; "
            f"venv {inst.get('venv_mib')} MiB)", inst)
    for imp in r.get("imports", {}).values():
        for machine in ("arm64", "x86_64"):
            m = imp[machine]
            row(f"`import {imp['modules']}`, {machine} (timed inside: {m['import_s']} s, {m['import_cpu_s']} CPU-s)", m)
    for kind, fits in r.get("fit_head", {}).items():
        for machine in ("arm64", "x86_64"):
            rep = fits[machine]["report"]
            row(f"fit-head --head {kind}, {machine} (held-out {rep['validation_accuracy']:.4f} of "
                f"{rep['num_validation']})", fits[machine])
    for kind, pred in r.get("predict", {}).items():
        n = pred["agreement_own"]["inputs"]
        for machine in ("arm64", "x86_64"):
            row(f"predict {kind}, {machine} ({n} held-out inputs, 48 PNG + 48 .npy; accuracy "
                f"{pred['accuracy']:.4f})", pred[machine])
    if "series" in r:
        lines += series_markdown(r)
    live = r.get("live", {})
    if "head_agent" in live:
        row(f"live head agent, start to SIGTERM (coordinator run {live['coordinator_run_s']} s)", live["head_agent"])
    if r.get("predict"):
        lines += ["", "Agreement of `predict --json --top 10`, arm64 against x86_64:", "",
                  "| head | heads compared | inputs | same classes | max abs probability difference |",
                  "|---|---|---|---|---|"]
    for kind, pred in r.get("predict", {}).items():
        for case, what in (("own", "each machine's own fit-head"), ("x86_head", "the x86_64 head on both")):
            c = pred[f"agreement_{case}"]
            lines.append(f"| {kind} | {what} | {c['inputs']} | {c['same_classes']} | {c['max_abs_probability_diff']:.2g} |")
    if live.get("report"):
        rep = live["report"]
        values = rep.get("values") or {}
        lines += ["", f"Live: {live['trainer_agents']} trainer agents and the coordinator on x86_64, {live['rounds']} "
                      f"FedAvg rounds on digits, Mosquitto on loopback; the arm64 head agent installed release "
                      f"`{live['installed_release']}` and its report reached the coordinator (`head_metrics.json`): "
                      f"{rep.get('head')} head, held-out accuracy {rep.get('accuracy'):.4f} "
                      f"({rep.get('correct')}/{rep.get('total')}), fit {values.get('fit_seconds', float('nan')):.2f} s "
                      f"and features {values.get('feature_seconds', float('nan')):.2f} s under emulation. "
                      f"On SIGTERM it stopped in {live['head_agent']['stop_s']} s (exit {live['head_agent']['rc_after_sigterm']})."]
    if inst:
        lines += ["", f"Root's venv: Python {inst.get('python')}, numpy {inst.get('numpy')}, onnxruntime "
                      f"{inst.get('onnxruntime')}, scikit-learn {inst.get('scikit_learn')}, torch installed: "
                      f"{inst.get('torch')}; {len(inst.get('packages', []))} packages."]
    return "\n".join(lines) + "\n"


def series_markdown(r: dict) -> list[str]:
    """The ``--input series`` tables: each step on both machines, serve's requests, the agreement."""
    import series_head_tier as series

    s, info = r["series"], r["series_inputs"]
    lines = ["", f"Series steps (`benchmarks/series_head_tier.py`'s; FedAvg `model.arch: {info['model_arch']}`, untrained; device log "
                 f"{info['device_rows']} rows, {info['device_windows']} windows; unlabelled {info['unlabelled_windows']} "
                 f"windows), medians of {s['repeats']} rounds, each a fresh process in which importing torch fails; "
                 "peak RSS under emulation includes qemu's:", "",
             "| step | machine | wall s | CPU s | peak RSS | heavy modules imported |", "|---|---|---|---|---|---|"]
    for machine in ("arm64", "x86_64"):
        lines += series.markdown_rows(s[machine]["summary"], s[machine]["serve"], machine)
    lines += ["", "| serve request | machine | windows | p50 ms | p95 ms | server ms (p50) | server CPU ms (mean) |",
              "|---|---|---|---|---|---|---|"]
    for machine in ("arm64", "x86_64"):
        lines += series.serve_rows(s[machine]["serve"], machine)
    lines += ["", "| predict, arm64 against x86_64 | heads compared | inputs | same classes | "
                  "max abs probability difference |", "|---|---|---|---|---|"]
    for step, cases in s["agreement"].items():
        for case, what in (("own", "each machine's own fit-head"), ("x86_head", "the x86_64 head on both")):
            c = cases[case]
            lines.append(f"| {step} | {what} | {c['inputs']} | {c['same_classes']} | "
                         f"{c['max_abs_probability_diff']:.2g} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.environ.get("EDGEPFL_ARM64_ROOT", DEFAULT_ROOT),
                        help=f"the cached arm64 root (default {DEFAULT_ROOT} or $EDGEPFL_ARM64_ROOT)")
    parser.add_argument("--fresh", action="store_true", help="make a new root (a cold run)")
    parser.add_argument("--mirror", default=MIRROR)
    parser.add_argument("--cpu", default="cortex-a53", help="QEMU_CPU (qemu's default when it does not know it)")
    parser.add_argument("--heads", default="svm", help="head kinds to fit and compare, comma-separated")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest probability difference allowed")
    parser.add_argument("--live-timeout", type=float, default=600, help="seconds the coordinator waits for agents")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder in the root")
    parser.add_argument("--input", choices=("image", "series"), default="image",
                        help="image: the digits release and a live head agent; series: benchmarks/series_head_tier.py's "
                             "steps on raw sensor windows (npz and CSV), serve included")
    parser.add_argument("--arch", choices=("cnn1d", "plugin"), default="cnn1d", help="--input series: the encoder")
    parser.add_argument("--rows", type=int, default=2000, help="--input series: rows per class stretch of the logs")
    parser.add_argument("--repeats", type=int, default=3, help="--input series: rounds of the one-shot steps")
    parser.add_argument("--requests", type=int, default=20, help="--input series: serve requests of each kind")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/arm64_head_tier (image), "
                                                    "arm64_series_head_tier (series)")
    ns = parser.parse_args(argv)
    if ns.out is None:
        name = "arm64_head_tier" if ns.input == "image" else "arm64_series_head_tier"
        ns.out = str(REPO / "benchmarks" / "results" / name)
    ns.heads = [h for h in ns.heads.split(",") if h]
    try:
        from edgepfl.methods import available_head_kinds

        bad = [h for h in ns.heads if h not in available_head_kinds()]
        if bad or not ns.heads:
            raise Refused(f"--heads: unknown head kind(s) {bad} (known: {', '.join(available_head_kinds())})")
        if ns.tolerance < 0:
            raise Refused("--tolerance must be >= 0")
        result = run(ns)
    except Refused as exc:
        print(f"arm64_head_tier: {exc}", file=sys.stderr)
        return 2
    write_results(result, ns.out, markdown)
    for failure in result["failures"]:
        print(f"arm64_head_tier: FAILED: {failure}", file=sys.stderr)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
