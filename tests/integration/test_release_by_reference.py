"""A head agent downloads a release once (PROTOCOL.md §12, "Releases by reference", 1.4).

Real Mosquitto, real trainer and head agent processes, a real coordinator. The head
agent reaches the broker through :class:`~edgepfl.testing.relay.CountingRelay`, so every
byte on its link is counted, retained replays and MQTT framing included:

* while it has nothing, the release reaches it once (not also as the retained copy);
* restarted with the release installed, against the coordinator online and then after the
  coordinator exited, it downloads under 5 % of the release's bytes, and the online
  coordinator still gets its metrics (reported unasked).
"""

from __future__ import annotations

import json

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import CoordinatorMeta
from edgepfl.testing.relay import CountingRelay

from tests.fleet_helpers import run_config, wait_until

TRAINERS = 2
HEAD = "device-02"


def agent_log(out, agent: str) -> str:
    path = out / "agents" / f"{agent}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_head_agent_downloads_a_release_once_and_never_again_after_a_restart(mosquitto, tmp_path):
    config = prepare(run_config(rounds=1), TRAINERS, head_agents=1)
    out, url = tmp_path / "run", mosquitto.url
    trainers = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(TRAINERS)]
    with CountingRelay(mosquitto.host, mosquitto.port) as relay:
        head = spawn_agent(config, out, relay.url, HEAD, TRAINERS, tier="head")
        fleet = MqttFleet(config.federation, config.broker, url=url)
        try:
            coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
            coordinator.run()  # one round, the final evaluation, the release, the head agent's report
            release_id = next(reversed(coordinator.releases))
            assert HEAD in coordinator.head_reports
            size = len((out / "releases" / "current.frame").read_bytes())
            first = relay.down_bytes
            # one copy: sent to it by the coordinator, and not also the retained copy
            assert size <= first < 1.5 * size, (first, size)

            # restarted with the release installed, the coordinator online in a round of the run
            stop_agents([head])
            coordinator.inbox.reports_by_release.clear()
            fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=1))
            relay.reset()
            head = spawn_agent(config, out, relay.url, HEAD, TRAINERS, tier="head")
            coordinator.inbox.pump_until(lambda: HEAD in coordinator.inbox.reports_by_release.get(release_id, {}),
                                         coordinator.clock.now() + 120)
            report = coordinator.inbox.reports_by_release[release_id][HEAD]  # reported unasked
            installed = json.loads((out / "agents" / HEAD / "release.json").read_text())
            assert report.accuracy == installed["metrics"]["accuracy"]
            assert relay.down_bytes < 0.05 * size, (relay.down_bytes, size)
        finally:
            fleet.close()  # presence `done`, naming the release
            stop_agents(trainers)
        stop_agents([head])

        # restarted after the coordinator exited: the retained `done` presence names the release
        relay.reset()
        before = len(agent_log(out, HEAD))
        head = spawn_agent(config, out, relay.url, HEAD, TRAINERS, tier="head")
        try:
            wait_until(lambda: "nothing to download" in agent_log(out, HEAD)[before:], 120, interval=0.5,
                       what="the second restart deciding")
            assert relay.down_bytes > 0  # it is connected through the relay
            assert relay.down_bytes < 0.05 * size, (relay.down_bytes, size)
        finally:
            stop_agents([head])
    log = agent_log(out, HEAD)
    assert "Traceback" not in log and "refused" not in log, log[-3000:]
