"""Latency of the device's model as its owner uses it: ``edgepfl serve`` (kept loaded) against
``edgepfl predict`` (a new process per request), per image and per batch.

For each model — the default CNN on Fashion-MNIST (1x28x28) and the MLP on digits (1x8x8),
each trained for one round on three clients, exported, and installed with an ``lr`` head
by the head tier's own install path — this script starts one ``edgepfl serve --state``
process and then, interleaved within each repeat so that load from other processes hits
both paths alike:

* ``serve``: one request line of ``batch`` PNG paths on its stdin, timed from the write to
  the answer line (what a client sees), and the server's own ``ms`` (images read to
  probabilities), and the server process's CPU seconds for the request (``/proc``);
* ``predict``: ``edgepfl predict --encoder … --head …`` on the same PNGs, a new process:
  wall time and the child's CPU seconds (``os.wait4``).

Figures are medians over ``--repeats`` (CPU: the mean, the server's ticks being 10 ms), per
request and per image, at batch 1, 8 and 32.

Usage::

    .venv/bin/python benchmarks/serve_latency.py --repeats 9

Writes ``benchmarks/results/serve_latency.json`` and ``.md``. Preparing the releases trains
two tiny models in a child process (needs torch; the measured processes never import it).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

BATCHES = (1, 8, 32)
MODELS = {"cnn-fmnist": ("cnn", "fmnist"), "mlp-digits": ("mlp", "digits")}

PREPARE = textwrap.dedent(r"""
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from PIL import Image
    sys.path.insert(0, sys.argv[1])
    from tests.export_fixtures import NEW_CLIENT, client_data, client_pixels, export_dir
    from edgepfl.edge_agent.head_tier import HeadRuntime, open_installed
    from edgepfl.export.onnx_export import read_release
    out, arch, dataset = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    export = export_dir(out, "fedavg", arch=arch, dataset=dataset, rounds=1, epochs=1)
    manifest, artifact = read_release(export)
    HeadRuntime(out / "state", "lr", client_data(NEW_CLIENT, dataset)).install_release(
        manifest, artifact, manifest.encoder.sha256)
    record = json.loads((out / "state" / "release.json").read_text())
    (out / "predict").mkdir()
    (out / "predict" / "encoder.onnx").write_bytes((out / "state" / record["encoder_file"]).read_bytes())
    (out / "predict" / "manifest.json").write_text(manifest.model_dump_json())
    pixels, _, _ = client_pixels(NEW_CLIENT, dataset)
    (out / "images").mkdir()
    for i, px in enumerate(pixels[:32]):
        mode = "L" if px.shape[0] == 1 else "RGB"
        img = np.round(px.transpose(1, 2, 0) * 255).astype(np.uint8)
        Image.fromarray(img[..., 0] if mode == "L" else img, mode=mode).save(out / "images" / f"{i:03d}.png")
    print(json.dumps({"head": str(out / "state" / record["head_file"])}))
""")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prepare(out: Path, arch: str, dataset: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PREPARE, str(ROOT), str(out), arch, dataset], check=True,
                          capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_serve(server: subprocess.Popen, paths: list[str]) -> dict:
    assert server.stdin is not None and server.stdout is not None
    cpu0, t0 = _cpu_seconds(server.pid), time.perf_counter()
    server.stdin.write(json.dumps({"inputs": paths}) + "\n")
    server.stdin.flush()
    answer = json.loads(server.stdout.readline())
    wall = time.perf_counter() - t0
    assert "error" not in answer, answer
    return {"wall_s": wall, "server_s": answer["ms"] / 1000, "cpu_s": _cpu_seconds(server.pid) - cpu0}


def time_predict(encoder: Path, head: str, paths: list[str]) -> dict:
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "predict", "--encoder", str(encoder), "--head",
                              head, *paths], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, child.stderr.read() if child.stderr else ""
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def run(repeats: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgepfl-serve-bench-") as tmp:
        for label, (arch, dataset) in MODELS.items():
            out = Path(tmp) / label
            out.mkdir()
            print(f"{label}: preparing a release", file=sys.stderr, flush=True)
            head = prepare(out, arch, dataset)["head"]
            images = sorted(str(p) for p in (out / "images").iterdir())
            server = subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "serve", "--state", str(out / "state")],
                                      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            try:
                time_serve(server, images[:1])  # the first request opens nothing new; warm the sessions
                samples: dict[tuple[str, int], list[dict]] = {}
                for rep in range(repeats):
                    print(f"{label}: repeat {rep + 1}/{repeats}", file=sys.stderr, flush=True)
                    for batch in BATCHES:
                        paths = images[:batch]
                        samples.setdefault(("serve", batch), []).append(time_serve(server, paths))
                        samples.setdefault(("predict", batch), []).append(
                            time_predict(out / "predict" / "encoder.onnx", head, paths))
            finally:
                assert server.stdin is not None
                server.stdin.close()
                server.wait(timeout=60)
            for (path, batch), got in sorted(samples.items()):
                # CPU from /proc ticks (10 ms) is too coarse for one request: the mean over repeats
                med = {k: (statistics.mean if k == "cpu_s" else statistics.median)(s[k] for s in got) for k in got[0]}
                rows.append({"model": label, "path": path, "batch": batch, **{k: round(v, 5) for k, v in med.items()},
                             "ms_per_image": round(1000 * med["wall_s"] / batch, 3)})
    return {"command": f"benchmarks/serve_latency.py --repeats {repeats}", "repeats": repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# edgepfl serve vs predict: latency per request ({result['machine']})", "",
             f"`{result['command']}`; medians over {result['repeats']} interleaved repeats (CPU: mean). serve: one "
             "request line to its answer line (server ms: its own, images read to probabilities); predict: a new "
             "process per request.", "",
             "| model | path | batch | wall ms | ms / image | server ms | CPU ms |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        server = f"{1000 * r['server_s']:.1f}" if "server_s" in r else "—"
        lines.append(f"| {r['model']} | {r['path']} | {r['batch']} | {1000 * r['wall_s']:.1f} | {r['ms_per_image']:.2f} "
                     f"| {server} | {1000 * r['cpu_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_latency"))
    ns = parser.parse_args()
    write_results(run(ns.repeats), ns.out, markdown)


if __name__ == "__main__":
    main()
