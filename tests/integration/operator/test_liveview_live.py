"""A live view of the fleet: the retained JSON view, ``edgepfl status`` and Prometheus ``/metrics``.

A coordinator process and agent processes on the test Mosquitto, and the view read the
way an operator's tools would: a plain paho subscriber, ``edgepfl status`` as a subprocess
and an HTTP scrape parsed with ``prometheus_client.parser`` (the view's logic:
tests/unit/coordinator/test_liveview.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml

from edgepfl.broker import free_port, parse_broker_url

from tests.fleet_helpers import RunningFleet, read_rows, run_config, wait_until

REPO = Path(__file__).resolve().parents[3]

# ----------------------------------------------------------------- live: coordinator + agents + Mosquitto


class ViewWatcher:
    """What ``mosquitto_sub -t edgepfl/v1/F/view`` sees: a plain paho client, no edgepfl code."""

    def __init__(self, url: str, federation: str):
        host, port, _ = parse_broker_url(url)
        self.payloads: list[bytes] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        self.client.on_connect = lambda c, *a: c.subscribe(f"edgepfl/v1/{federation}/view", qos=1)
        self.client.on_message = lambda c, u, msg: self.payloads.append(msg.payload)
        self.client.connect(host, port)
        self.client.loop_start()

    def views(self) -> list[dict]:
        return [json.loads(p) for p in list(self.payloads)]  # plain JSON, whoever reads it

    def last(self) -> dict | None:
        views = self.views()
        return views[-1] if views else None

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _status(url: str, federation: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepfl.cli", "status", "--broker", url, "--federation", federation,
                           *extra], capture_output=True, text=True, timeout=60)


def test_live_view_status_and_metrics_of_a_running_federation(mosquitto, tmp_path):
    config = run_config(rounds=3, min_agents=3, round_timeout_s=30)
    out = tmp_path / "run"
    metrics_port = free_port()
    fleet = RunningFleet(config, out, mosquitto.url, 3)
    fed = fleet.config.federation
    watcher = ViewWatcher(mosquitto.url, fed)
    coordinator = None
    try:
        fleet.start_agent(0)
        fleet.start_agent(1)
        data = fleet.config.model_dump(mode="json")
        data["broker"]["url"] = mosquitto.url
        data["observe"] = {"view_interval_s": 0.2, "metrics_port": metrics_port}
        (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(data))
        log = open(tmp_path / "coordinator.log", "wb")
        coordinator = subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "coordinator", "--config",
                                        str(tmp_path / "coordinator.yaml"), "--out", str(out)],
                                       stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        # two of three agents: the coordinator waits, and says so
        wait_until(lambda: (v := watcher.last()) and v["online"]["trainer"] == 2, timeout=180, what="2 agents in view")
        assert watcher.last()["phase"] == "waiting"

        # an attacker who read PROTOCOL.md sends garbage on an agent's update topic
        host, port, _ = parse_broker_url(mosquitto.url)
        attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        attacker.connect(host, port)
        attacker.loop_start()
        attacker.publish(f"edgepfl/v1/{fed}/agents/agent-00/update", b"EPF1\x00\x00\x00\x05{oops", qos=1).wait_for_publish(5)
        attacker.loop_stop()
        attacker.disconnect()
        wait_until(lambda: watcher.last()["rejected"].get("malformed") == 1, timeout=30, what="rejection in view")

        metrics = _scrape(metrics_port)
        assert metrics[("edgepfl_agents_online", (("tier", "trainer"),))] == 2
        assert metrics[("edgepfl_rejected_messages_total", (("reason", "malformed"),))] == 1
        assert metrics[("edgepfl_phase", (("edgepfl_phase", "waiting"),))] == 1
        assert math.isnan(metrics[("edgepfl_accuracy", ())])  # nothing evaluated yet: not 0
        # the round loop keeps up with two agents: nothing held back at the broker
        assert metrics[("edgepfl_inbox_held_acks", ())] == 0 and ("edgepfl_inbox_queued_bytes", ()) in metrics
        # every metric the shipped alert rules use is one this coordinator serves
        rules = yaml.safe_load((REPO / "examples" / "prometheus" / "alerts.yml").read_text())
        used = {name for group in rules["groups"] for rule in group["rules"]
                for name in re.findall(r"\bedgepfl_[a-z_]+", rule["expr"])}
        served = {name for name, _ in metrics}
        assert used and used <= served, sorted(used - served)
        # and every metric the shipped Grafana dashboard's panels query
        grafana = json.loads((REPO / "examples" / "grafana" / "edgepfl.json").read_text())
        queried = {name for panel in grafana["panels"] for target in panel["targets"]
                   for name in re.findall(r"\bedgepfl_[a-z_]+", target["expr"])}
        assert queried and queried <= served, sorted(queried - served)
        assert ("edgepfl_uplink_bytes_total", ()) in metrics and ("edgepfl_downlink_bytes_total", ()) in metrics

        shown = _status(mosquitto.url, fed, "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        assert status["phase"] == "waiting" and status["rejected"] == {"malformed": 1}
        assert {(a["id"], a["tier"], a["online"]) for a in status["agents"]} == {
            ("agent-00", "trainer", True), ("agent-01", "trainer", True)}
        table = _status(mosquitto.url, fed)
        assert table.returncode == 0 and "agent-01" in table.stdout and "malformed 1" in table.stdout

        fleet.start_agent(2)
        completed_seen = 0.0
        while coordinator.poll() is None:  # scrape while it runs: the endpoint lives as long as the run
            try:
                completed_seen = max(completed_seen, _scrape(metrics_port)[("edgepfl_rounds_completed_total", ())])
            except OSError:
                pass
            time.sleep(0.05)
        assert coordinator.returncode == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert completed_seen >= 1
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.kill()
        fleet.__exit__(None, None, None)
        watcher.close()

    views = watcher.views()
    steps = [(v["phase"], v["round"]) for v in views]
    steps = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
    trained = [r for phase, r in steps if phase == "training"]
    assert trained == [0, 1, 2]  # one numbering: 0-based rounds, as metrics.jsonl
    assert steps[-1] == ("done", 3) and ("evaluating", 3) in steps
    for r in range(3):
        assert steps.index(("training", r)) < steps.index(("aggregating", r))
    final = views[-1]
    rows = read_rows(out)
    assert final["rounds_completed"] == 3 and final["last_accuracy_round"] == 3 and final["last_accuracy_final"]
    assert final["last_accuracy"] == pytest.approx(rows[-1].accuracy)
    assert final["online"]["trainer"] == 3 and final["rejected"] == {"malformed": 1}
