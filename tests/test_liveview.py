"""A live view of the fleet: the retained JSON view, ``edgepfl status`` and Prometheus ``/metrics``.

The fast tests check the view's logic (rate limit, size bound, table); the slow one runs a
coordinator process and agent processes on the test Mosquitto and reads the view the way
an operator's tools would: a plain paho subscriber, ``edgepfl status`` as a subprocess and
an HTTP scrape parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import paho.mqtt.client as mqtt
import pytest
import yaml

from edgepfl.broker import free_port, parse_broker_url
from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import Fleet
from edgepfl.coordinator.observe import Observer
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.result import RunCounters
from edgepfl.coordinator.status import format_view
from edgepfl.protocol import StatusMeta
from edgepfl.protocol.view import AgentView, FleetView, encode_view, parse_view

from tests.fleet_helpers import RunningFleet, read_rows, run_config, wait_until


class RecordingFleet(Fleet):
    """A fleet with no agents that keeps the views it is asked to publish (the view logic's unit tests)."""

    def __init__(self):
        self.views: list[bytes] = []

    def publish_view(self, payload: bytes) -> None:
        self.views.append(payload)

    def send(self, agent_id, frame, round):
        return 0

    def poll(self, timeout):
        return None

    def publish_release(self, frame, round, earlier_parts=0):
        return 0

    def agent_online(self, agent_id, tier):
        pass

    def announce(self, meta):
        pass

    def close(self):
        pass


def _observer(**observe) -> tuple[Observer, Registry, RecordingFleet, Counter]:
    config = RunConfig(federation="viewtest", rounds=5, observe=observe)
    fleet, registry, counters = RecordingFleet(), Registry(), RunCounters()
    return Observer(config, fleet, registry, counters), registry, fleet, counters.rejected


def test_a_thousand_agents_coming_online_cost_one_view_per_interval_not_one_each():
    obs, registry, fleet, _ = _observer(view_interval_s=2.0)
    obs.start(resumed_from=None)
    fleet.views.clear()
    for i in range(1000):
        registry.update(f"pi-{i:04d}", StatusMeta(state="online", tier="head" if i % 4 == 0 else "trainer"))
        obs.tick()
    assert len(fleet.views) <= 1
    time.sleep(2.0)
    obs.tick()  # the batched changes go out once the interval has passed
    view = parse_view(fleet.views[-1])
    assert view.online == {"trainer": 750, "head": 250} and len(view.agents) == 1000
    obs.tick()
    assert len(fleet.views) <= 2  # nothing changed since: nothing more until the heartbeat


def test_a_phase_change_is_published_at_once_and_rejections_mark_the_view_dirty():
    obs, registry, fleet, rejected = _observer(view_interval_s=60)
    obs.start(resumed_from=None)
    obs.enter("training", 0)
    assert parse_view(fleet.views[-1]).phase == "training"
    rejected["malformed"] += 1
    obs.tick()  # within the interval: batched
    assert "malformed" not in parse_view(fleet.views[-1]).rejected
    obs.enter("aggregating", 0)
    assert parse_view(fleet.views[-1]).rejected == {"malformed": 1}


def test_the_view_stays_within_one_mqtt_message_listing_online_agents_first():
    agents = [AgentView(id=f"agent-{i:05d}", tier="trainer", online=i % 2 == 0, last_seen=1.0, device="cpu")
              for i in range(5000)]
    agents.sort(key=lambda a: (not a.online, a.id))
    view = FleetView(federation="f", method="fedavg", updated=2.0, started=1.0, phase="training", round=3, rounds=10,
                     rounds_completed=3, agents=agents)
    data = encode_view(view, 100_000)
    assert len(data) <= 100_000
    back = json.loads(data)
    assert back["agents_left_out"] == 5000 - len(back["agents"]) > 0
    assert all(a["online"] for a in back["agents"])  # offline agents went first


def test_status_table_names_the_run_the_agents_and_the_rejections():
    view = FleetView(federation="demo", method="fedrep", updated=100.0, started=10.0, phase="training", round=4,
                     rounds=10, rounds_completed=4, last_accuracy=0.8123, last_accuracy_round=4,
                     release="fedrep-r3-abc", online={"trainer": 1, "head": 0}, rejected={"malformed": 2},
                     agents=[AgentView(id="pi-07", tier="trainer", online=True, last_seen=95.0, device="cpu",
                                       num_train=600),
                             AgentView(id="pi-08", tier="head", online=False, last_seen=40.0)])
    table = format_view(view, now=100.0)
    assert "phase      training, round 4 of 0..9 (4 completed)" in table
    assert "81.23% (round 4)" in table and "fedrep-r3-abc" in table and "malformed 2" in table
    pi7 = next(line for line in table.splitlines() if line.startswith("pi-07"))
    assert "online" in pi7 and "5s ago" in pi7 and "600" in pi7
    assert "offline" in next(line for line in table.splitlines() if line.startswith("pi-08"))


def test_the_views_refused_totals_survive_a_coordinator_restart(tmp_path):
    """Like ``rejected``: a resumed run's view counts the refusals of the rounds before the restart."""
    from dataclasses import replace

    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.tiers import TrainerTier
    from edgepfl.state import read_checkpoint_meta

    names = [f"class-{i}" for i in range(10)]
    config = prepare(run_config(rounds=1, model={"arch": "mlp", "feature_dim": 8}, device="cpu",
                                data={"dataset": "digits", "samples_per_client": 60}), 2)
    out = tmp_path / "run"

    def coordinator(rounds: int) -> Coordinator:
        # agent-01's classes are not the run's: it refuses its task (data_mismatch) in every process's first round
        agents = {a: TrainerTier(a, replace(load_client_data(config.data, i), class_names=names
                                            if i == 0 else ["cat", *names[1:]]), str(out / "agents" / a), "cpu")
                  for i, a in enumerate(agent_ids(2))}
        run = config.model_copy(update={"rounds": rounds})
        return Coordinator(run, LocalFleet(agents, config.federation), out, progress=False,
                           **{**data_shape(config), "class_names": names})

    first = coordinator(rounds=1)
    first.run()
    assert first.observer.view().refused == {"data_mismatch": 1}
    assert read_checkpoint_meta(out / "checkpoint").refused_total == {"data_mismatch": 1}
    resumed = coordinator(rounds=2)  # a new process resumes after round 0 and runs round 1
    resumed.run()
    assert resumed.start_round == 1
    assert resumed.observer.view().refused == {"data_mismatch": 2}  # round 0's refusal is still counted


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


@pytest.mark.slow
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
        # the round loop keeps up with two agents: nothing held back at the broker
        assert metrics[("edgepfl_inbox_held_acks", ())] == 0 and ("edgepfl_inbox_queued_bytes", ()) in metrics

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
    assert final["rounds_completed"] == 3 and final["last_accuracy_round"] == 3
    assert final["last_accuracy"] == pytest.approx(rows[-1].accuracy)
    assert final["online"]["trainer"] == 3 and final["rejected"] == {"malformed": 1}
