"""The central coordinator of a fleet of sites: its CPU per round and its WAN bytes as the
devices behind the sites grow (docs/BENCHMARKS.md, "Sites: the central coordinator's cost").

    python benchmarks/site_scale.py --devices 1000 5000 20000 --sites 10 --rounds 4 \\
        --out benchmarks/results/site_scale

Per fleet size N it starts a Mosquitto, ``--sites`` S virtual site aggregators in one
process (each one MQTT connection speaking PROTOCOL.md §20 through ``edgepfl.protocol``: a
``site`` status listing N/S devices; every task decoded in full, then answered with one
partial sum over the site's devices ordered to train, in the one-word form, with each
device's weight, evaluation and record), then the real ``edgepfl coordinator`` process on a
FedAvg run with ``sites.enabled`` (``min_agents`` = N: round 0 starts with every device),
and measures as ``benchmarks/capacity.py`` does: the coordinator's CPU-seconds per round
(``/proc/<pid>/stat`` at each new ``metrics.jsonl`` row, rounds 1..R-1) and the bytes the
coordinator counts per round (down: the sites' tasks; up: their answers), i.e. what
crosses the WAN. A virtual site sums nothing (its integers are its devices' count of
ones): the central coordinator's work does not depend on the values, only on the frames.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from capacity import run_metered  # noqa: E402
from loadgen import raise_fd_limit  # noqa: E402

from edgepfl.metrics import read_metrics  # noqa: E402
from edgepfl.testing.brokers import MosquittoBroker  # noqa: E402

from results_io import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def site_ids(sites: int) -> list[str]:
    return [f"site-{i:03d}" for i in range(sites)]


def virtual_sites(url: str, federation: str, devices: int, sites: int, ready: Path, mode: str = "exact") -> None:
    """Run ``sites`` virtual site aggregators of ``devices`` devices in all, until killed; in
    ``mode`` summary each announces its count and answers with totals (PROTOCOL.md §20 item 5)."""
    import paho.mqtt.client as mqtt

    from edgepfl.broker import parse_broker_url
    from edgepfl.coordinator.sampling import round_half_up, sample_size
    from edgepfl.protocol import MessageType, StatusMeta, TaskMeta, UpdateMeta, decode, encode
    from edgepfl.protocol.reassembly import Reassembler
    from edgepfl.protocol.site import SUM, DeviceAnswer, SiteAnswer, SiteDevice, SiteStatus, SiteTotals

    host, port, _ = parse_broker_url(url)
    clients = []
    per_site = [list(range(devices))[i::sites] for i in range(sites)]
    names = {site: [f"dev-{d:06d}" for d in members] for site, members in zip(site_ids(sites), per_site)}

    def summary(client, message, meta, site, base):
        """A summary site's answer: one partial sum and totals that name no device. Only the
        draw's sizes are computed (what the centre sees); drawing 50,000 names at each of ten
        sites in this one process would make the centre wait, which real sites do in parallel."""
        sample = meta.site.sample
        online = len(names[site])
        trained = sample_size(sample.train_fraction, online) if sample.train_fraction > 0 else 0
        answered = max(trained, round_half_up(sample.evaluate_share * online) if sample.evaluate_share > 0 else 0)
        tensors = {SUM + k: np.full(v.shape, trained, np.int64) for k, v in message.tensors.items()
                   if "/" not in k} if trained else {}
        totals = SiteTotals(sampled=trained, trained=trained, evaluated=answered, eval_total=50 * answered,
                            eval_correct=40 * answered, train_loss=0.5 if trained else None,
                            largest_change=0.01 if trained else None)
        answer = SiteAnswer(devices=[], total_weight=200 * trained, change_norms=[0.01] * min(trained, 16),
                            totals=totals)
        reply = UpdateMeta(task_id=meta.task_id, kind=meta.kind, num_train=max(1, answer.total_weight)
                           if meta.kind == "train" else 0, num_test=50 * answered, eval_correct=40 * answered,
                           site=answer)
        client.publish(f"{base}/update", encode(MessageType.UPDATE, federation=federation, sender=site,
                                                round=message.header.round, meta=reply, tensors=tensors), qos=1)

    for site, members in zip(site_ids(sites), per_site):
        base = f"edgepfl/v1/{federation}/agents/{site}"
        reassembler = Reassembler()

        def on_message(client, userdata, msg, site=site, base=base, reassembler=reassembler):
            message = decode(bytes(msg.payload))
            if message.type == MessageType.CHUNK:
                frame = reassembler.add(site, message)
                if frame is None:
                    return
                message = decode(frame)
            if message.type != MessageType.TASK:
                return
            meta = message.meta_as(TaskMeta)
            orders = meta.site
            if orders is None:
                return
            if orders.sample is not None:
                return summary(client, message, meta, site, base)
            cap = orders.weight_cap or 200
            answers = [DeviceAnswer(agent=a, kind="train", num_train=min(200, cap), num_test=50, eval_correct=40,
                                    train_loss=0.5, weight=min(200, cap), record=(0.01, {})) for a in orders.train]
            answers += [DeviceAnswer(agent=a, kind="evaluate", num_train=0, num_test=50, eval_correct=40)
                        for a in orders.evaluate]
            trained = len(orders.train)
            tensors = {SUM + k: np.full(v.shape, trained, np.int64) for k, v in message.tensors.items()
                       if "/" not in k} if trained else {}
            answer = SiteAnswer(devices=answers, total_weight=sum(d.weight or 0 for d in answers),
                                change_norms=[0.01] * trained)
            reply = UpdateMeta(task_id=meta.task_id, kind=meta.kind, num_train=max(1, answer.total_weight)
                               if meta.kind == "train" else 0, num_test=50 * len(answers),
                               eval_correct=40 * len(answers), site=answer)
            client.publish(f"{base}/update", encode(MessageType.UPDATE, federation=federation, sender=site,
                                                    round=message.header.round, meta=reply, tensors=tensors), qos=1)

        site_status = SiteStatus(count=len(members)) if mode == "summary" else \
            SiteStatus(devices=[SiteDevice(agent=f"dev-{d:06d}", num_train=200, num_test=50) for d in members])
        status = StatusMeta(state="online", tier="site", num_train=200 * len(members), num_test=50 * len(members),
                            site=site_status)
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"virtual-{site}", protocol=mqtt.MQTTv311)
        client.on_message = on_message
        client.max_inflight_messages_set(100)
        client.connect(host, port, keepalive=60)
        client.subscribe(f"{base}/task", qos=1)
        client.publish(f"{base}/status", encode(MessageType.STATUS, federation=federation, sender=site, round=-1,
                                                meta=status), qos=1, retain=True)
        client.loop_start()
        clients.append(client)
    ready.write_text("ready")
    threading.Event().wait()


def measure(devices: int, args: argparse.Namespace, work: Path) -> dict:
    federation = f"sites{devices}"
    run_dir = work / f"n{devices}"
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "federation": federation, "method": {"name": "fedavg"},
        "model": {"arch": args.arch, "feature_dim": args.feature_dim}, "input_shape": [1, 28, 28], "num_classes": 10,
        "device": "cpu", "rounds": args.rounds, "min_agents": devices, "quorum": 0.5, "fraction": args.fraction,
        "round_timeout_s": args.round_timeout_s, "wait_for_agents_s": 600,
        "sites": {"enabled": True, "ids": site_ids(args.sites), "mode": args.mode},
    }
    if args.mode == "summary":  # the sites are the trainers
        config["min_agents"] = args.sites
    if args.buffer_size:  # buffered states of that many sites' sums
        config["asynchrony"] = {"mode": "buffered", "buffer_size": args.buffer_size}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(config))
    raise_fd_limit()
    with MosquittoBroker(max_queued_messages=0) as broker:
        assert broker._proc is not None
        ready = run_dir / "sites.ready"
        sites_log = open(run_dir / "sites.log", "w")  # noqa: SIM115
        sites = subprocess.Popen([sys.executable, __file__, "--virtual-sites", broker.url, federation, str(devices),
                                  str(args.sites), str(ready), args.mode], stdout=sites_log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            while not ready.exists():
                if sites.poll() is not None:
                    raise RuntimeError(f"virtual sites exited {sites.returncode}; see {run_dir / 'sites.log'}")
                time.sleep(0.1)
            meter = run_metered((sys.executable, "-m", "edgepfl.cli"), run_dir / "run.yaml", broker, run_dir,
                                args.rounds, args.timeout_s, f"N={devices}")
        finally:
            sites.kill()
            sites.wait()
    rows = read_metrics(run_dir / "out" / "metrics.jsonl")
    per_round = []
    for i, row in enumerate(rows):
        if row.final or row.round < 1:
            continue
        per_round.append({"round": row.round, "seconds": row.seconds,
                          "cpu_s": round(meter.cpu_at_row[i] - meter.cpu_at_row[i - 1], 3),
                          "participants": len(row.participants) + len(row.late), "bytes_down": row.bytes_down,
                          "bytes_up": row.bytes_up})
    n = len(per_round)
    return {
        "devices": devices, "sites": args.sites,
        "participants": min(r["participants"] for r in per_round),
        "round_s": round(sum(r["seconds"] for r in per_round) / n, 3),
        "coordinator_cpu_s_per_round": round(sum(r["cpu_s"] for r in per_round) / n, 3),
        "coordinator_peak_rss_mb": round(meter.peak["coordinator"] / 2**20, 1),
        "wan_bytes_down_per_round": round(sum(r["bytes_down"] for r in per_round) / n),
        "wan_bytes_up_per_round": round(sum(r["bytes_up"] for r in per_round) / n),
        "shared_bytes": rows[-1].shared_bytes,
        "rounds": per_round,
    }


def markdown(result: dict) -> str:
    buffered = f", buffered states of {result['buffer_size']} sums" if result.get("buffer_size") else ""
    lines = [f"Sites ({result.get('mode', 'exact')}{buffered}): FedAvg, {result['model']}, {result['rounds']} rounds (rounds "
             f"1..R-1), {result['sites']} virtual sites; {result['machine']}", "",
             "| devices | sites | participants / round | round s (wall) | central CPU s / round | central peak RSS MB "
             "| WAN MB down / round | WAN MB up / round | flat fleet's MB / round (N x model each way) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        flat = 2 * r["devices"] * r["shared_bytes"] / 1e6
        lines.append(f"| {r['devices']} | {r['sites']} | {r['participants']} | {r['round_s']} | "
                     f"{r['coordinator_cpu_s_per_round']} | {r['coordinator_peak_rss_mb']} | "
                     f"{r['wan_bytes_down_per_round'] / 1e6:.2f} | {r['wan_bytes_up_per_round'] / 1e6:.2f} | "
                     f"{flat:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--virtual-sites":
        url, federation, devices, sites, ready, mode = argv[1:7]
        virtual_sites(url, federation, int(devices), int(sites), Path(ready), mode)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", required=True)
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--mode", choices=("exact", "summary"), default="exact",
                    help="sites.mode: exact (every device through the centre) or summary (counts and totals)")
    ap.add_argument("--fraction", type=float, default=1.0, help="the run's fraction of devices trained a round")
    ap.add_argument("--buffer-size", type=int, default=None,
                    help="buffered states (summary sites only): a state per that many sites' sums")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arch", default="cnn")
    ap.add_argument("--feature-dim", type=int, default=32)
    ap.add_argument("--round-timeout-s", type=float, default=300)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", default=None, help="results path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for n in args.devices:
            started = time.monotonic()
            runs.append(measure(n, args, Path(tmp)))
            print(f"{n} devices behind {args.sites} sites: {runs[-1]['coordinator_cpu_s_per_round']} CPU-s a round "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    result = {"command": "python benchmarks/site_scale.py " + " ".join(argv), "model": f"{args.arch} {args.feature_dim}",
              "rounds": args.rounds, "sites": args.sites, "mode": args.mode, "fraction": args.fraction,
              "buffer_size": args.buffer_size,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "runs": runs}
    if args.out:
        write_results(result, args.out, markdown)
    print(markdown(result))
    print(json.dumps({r["devices"]: r["coordinator_cpu_s_per_round"] for r in result["runs"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
