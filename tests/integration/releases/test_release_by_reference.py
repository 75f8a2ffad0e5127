"""A head agent downloads each release once (PROTOCOL.md §12, "Releases by reference", 1.4).

Real Mosquitto, real trainer and head agent processes, a real coordinator. Each head
agent reaches the broker through its own :class:`~edgepfl.testing.relay.CountingRelay`,
so every byte on its link is counted, retained replays and MQTT framing included:

* joined before the run's first release, it takes the retained copy, and the coordinator
  does not send it a second one;
* joined while the coordinator is online with a release, it is sent that release once;
* a new release reaches a head agent online once, sent by the coordinator (as a delta
  against the release it has: under a quarter of the bytes, since protocol 1.7);
* restarted with the release installed — against the coordinator online, after the
  coordinator exited, and against a coordinator that resumed the run — it downloads under
  5 % of the release's bytes, and an online coordinator still gets its metrics (reported
  unasked).
"""

from __future__ import annotations

import json
from pathlib import Path

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.releases.release import CURRENT_FILE
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import AgentChannel, CoordinatorMeta, agent_topic
from edgepfl.testing.relay import CountingRelay

from tests.fleet_helpers import retained_state, run_config, wait_until

TRAINERS = 2
EARLY, LATE = "device-02", "device-03"  # a head agent there from the start, and one that joins later


def agent_log(out: Path, agent: str) -> str:
    path = out / "agents" / f"{agent}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_head_agent_downloads_each_release_once_and_nothing_after_a_restart(mosquitto, tmp_path, request):
    # the early head agent is there for the run's release (its end waits for it); the late one joins after
    config = prepare(run_config(rounds=1), TRAINERS, head_agents=2).model_copy(update={"min_head_agents": 1})
    out, url = tmp_path / "run", mosquitto.url
    trainers = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(TRAINERS)]
    spawned = list(trainers)
    request.addfinalizer(lambda: stop_agents(spawned))  # whatever fails, no agent outlives the test
    early_link, late_link = CountingRelay(mosquitto.host, mosquitto.port), CountingRelay(mosquitto.host, mosquitto.port)
    with early_link, late_link:
        def head(agent: str):
            link, index = (early_link, TRAINERS) if agent == EARLY else (late_link, TRAINERS + 1)
            spawned.append(spawn_agent(config, out, link.url, agent, index, tier="head"))
            return spawned[-1]

        early = head(EARLY)
        # joined before the run's first release: online before the coordinator starts (its
        # trainers may well be quicker to start than a head agent)
        wait_until(lambda: retained_state(url, agent_topic(config.federation, EARLY, AgentChannel.STATUS)) == "online",
                   120, interval=0.5, what="the early head agent online")
        fleet = MqttFleet(config.federation, config.broker, url=url)
        late = None
        try:
            coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
            reports = coordinator.inbox.reports_by_release

            def report_from(agent: str, release_id: str):
                coordinator.inbox.pump_until(lambda: agent in reports.get(release_id, {}),
                                             coordinator.clock.now() + 120)
                return reports[release_id][agent]

            coordinator.run()  # one round, the final evaluation, the release, the head agent's report
            first = next(reversed(coordinator.releases))
            size = len((out / "releases" / CURRENT_FILE).read_bytes())
            assert EARLY in coordinator.head_reports
            # joined before the first release: the retained copy, not also the coordinator's
            assert size <= early_link.down_bytes < 1.5 * size, (early_link.down_bytes, size)

            # the coordinator online with its release (a round of a run): a late joiner is sent it once
            fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=1))
            late = head(LATE)
            report_from(LATE, first)
            assert size <= late_link.down_bytes < 1.5 * size, (late_link.down_bytes, size)

            # a new release reaches each head agent online once, as a delta against the one it has
            early_link.reset()
            late_link.reset()
            second = coordinator.release(1)
            assert second is not None and second != first
            report_from(EARLY, second)
            report_from(LATE, second)
            for link in (early_link, late_link):
                assert 0 < link.down_bytes < 0.25 * size, (link.down_bytes, size)

            # restarted with it installed, the coordinator online: nothing downloaded, metrics reported unasked
            stop_agents([early])
            reports.clear()
            early_link.reset()
            early = head(EARLY)
            report = report_from(EARLY, second)
            installed = json.loads((out / "agents" / EARLY / "release.json").read_text())
            assert installed["release_id"] == second and report.accuracy == installed["metrics"]["accuracy"]
            assert early_link.down_bytes < 0.05 * size, (early_link.down_bytes, size)
        finally:
            fleet.close()  # presence `done`, naming the release
            stop_agents([*trainers, *([late] if late else [])])
        stop_agents([early])

        # restarted after the coordinator exited: the retained `done` presence names its release
        early_link.reset()
        before = len(agent_log(out, EARLY))
        early = head(EARLY)
        try:
            wait_until(lambda: "nothing to download" in agent_log(out, EARLY)[before:], 120, interval=0.5,
                       what="the restarted head agent deciding")
            assert 0 < early_link.down_bytes < 0.05 * size, (early_link.down_bytes, size)
        finally:
            stop_agents([early])

        # a coordinator that resumes the run names the run's release again: a restarted head agent
        # downloads nothing and reports on it
        fleet = MqttFleet(config.federation, config.broker, url=url)
        try:
            resumed = Coordinator(config, fleet, out, progress=False, **data_shape(config))
            resumed.init_or_resume()  # from the run's checkpoint: its release from releases/current.frame
            fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=resumed.start_round))
            early_link.reset()
            early = head(EARLY)
            resumed.inbox.pump_until(lambda: EARLY in resumed.inbox.reports_by_release.get(second, {}),
                                     resumed.clock.now() + 120)
            assert EARLY in resumed.inbox.reports_by_release.get(second, {})
            assert early_link.down_bytes < 0.05 * size, (early_link.down_bytes, size)
        finally:
            fleet.close()
            stop_agents([early])
    for agent in (EARLY, LATE):
        log = agent_log(out, agent)
        assert "Traceback" not in log and "refused" not in log, log[-3000:]


def test_statuses_forged_with_ever_higher_connection_numbers_get_a_release_at_most_three_times(
        mosquitto, broker_capture):
    """An unsigned deployment lets anyone publish an agent's status: 30 statuses of one head
    agent's session, each on a "new connection" and naming no release, make the coordinator
    publish its release MAX_RELEASE_COPIES times, not 30 (SECURITY.md). A restarted agent (a
    new session) gets it again."""
    from edgepfl.config import BrokerConfig
    from edgepfl.coordinator.releases.head_releases import MAX_RELEASE_COPIES
    from edgepfl.protocol import Capabilities, ReleaseRef, StatusMeta, agent_topic

    fleet = MqttFleet("forged", BrokerConfig(), url=mosquitto.url)
    ref = ReleaseRef(release_id="fedavg-r3-aaaaaaaaaaaa", sequence=7)
    frame = b"a release frame"  # the fleet only forwards it
    topic = agent_topic("forged", "pi", "task")
    try:
        fleet.releases.publish(frame, 3, ref=ref)
        for connection in range(1, 31):
            fleet.agent_status("pi", StatusMeta(state="online", tier="head", session="a" * 32, connection=connection,
                                                capabilities=Capabilities()), came_online=connection == 1)
        fleet.agent_status("pi", StatusMeta(state="online", tier="head", session="b" * 32, connection=1,
                                            capabilities=Capabilities()), came_online=False)
        fleet.tell("pi", b"end")  # after every copy, in order on the same topic
        wait_until(lambda: (topic, b"end") in broker_capture.snapshot(), 30, what="the end marker")
    finally:
        fleet.close()
    assert [p for t, p in broker_capture.snapshot() if t == topic] == [frame] * (MAX_RELEASE_COPIES + 1) + [b"end"]
