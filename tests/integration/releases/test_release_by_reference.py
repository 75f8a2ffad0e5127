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
  unasked);
* releases published faster than a head agent installs them: each one it gets comes once,
  and it gets the current one when it has reported on the one it was installing (as a delta
  where it holds the delta's base); one that took its first release from the retained
  copies takes no second one from there;
* an agent before 1.4, which takes the retained copies on every connect, is sent no copy of
  its own on top.
"""

from __future__ import annotations

import json
import os
import signal
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


def test_releases_faster_than_installs_reach_each_head_agent_once_and_the_current_one_after_its_report(
        mosquitto, tmp_path, request):
    """Two head agents online before the coordinator's first release, both taking it from the
    retained copies. One is stopped (SIGSTOP: an install that takes as long as we like) right
    after it took that release and before it reported on it, the other right after it reported.
    Two more releases are published while they are stopped. Continued, the first installs the
    first release, reports, and is sent the third, whole (the third's delta is against the
    second, which it never had); the other is sent the second as a delta at once and the third
    as a delta after its report. Before, the coordinator sent every release at once, whole to an
    agent it had not heard a report from, and an agent that took the retained copies stayed
    subscribed to them until it had installed the first release, so that the releases
    published meanwhile also came from there."""
    config = prepare(run_config(rounds=1), TRAINERS, head_agents=2)
    out, url = tmp_path / "run", mosquitto.url
    spawned: list = []
    stopped: list = []

    def cleanup() -> None:
        for proc in stopped:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        stop_agents(spawned)

    request.addfinalizer(cleanup)
    fresh_link, other_link = CountingRelay(mosquitto.host, mosquitto.port), CountingRelay(mosquitto.host, mosquitto.port)
    fresh_id, other_id = EARLY, LATE
    with fresh_link, other_link:
        fresh = spawn_agent(config, out, fresh_link.url, fresh_id, TRAINERS, tier="head")
        other = spawn_agent(config, out, other_link.url, other_id, TRAINERS + 1, tier="head")
        spawned += [fresh, other]
        for agent in (fresh_id, other_id):
            wait_until(lambda a=agent: retained_state(url, agent_topic(config.federation, a, AgentChannel.STATUS))
                       == "online", 120, interval=0.5, what=f"{agent} online")
        fleet = MqttFleet(config.federation, config.broker, url=url)
        try:
            coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
            coordinator.init_or_resume()
            fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=0))
            inbox = coordinator.inbox
            reports = inbox.reports_by_release

            def pump(until, what: str) -> None:
                inbox.pump_until(until, coordinator.clock.now() + 120)
                assert until(), what

            # both said they have nothing while the coordinator named nothing: both take the retained copies
            pump(lambda: set(fleet.releases.online()) == {fresh_id, other_id}, "both head agents online")
            first = coordinator.release(0)
            took = "took the coordinator's first release from the retained copies"
            pump(lambda: took in agent_log(out, fresh_id), "the first release taken from the retained copies")
            os.kill(fresh.pid, signal.SIGSTOP)  # before it has installed it, let alone reported
            stopped.append(fresh)
            pump(lambda: other_id in reports.get(first, {}), "the other head agent's report on the first release")
            os.kill(other.pid, signal.SIGSTOP)
            stopped.append(other)
            size = len((out / "releases" / CURRENT_FILE).read_bytes())
            assert fresh_id not in reports.get(first, {})
            other_link.reset()
            second, third = coordinator.release(1), coordinator.release(2)
            assert len({first, second, third}) == 3
            for proc in (fresh, other):
                os.kill(proc.pid, signal.SIGCONT)
            pump(lambda: {fresh_id, other_id} <= set(reports.get(third, {})), "both head agents' reports on the third")
        finally:
            fleet.close()
    # the fresh agent: the first from the retained copies, the third whole after its report, the second never
    fresh_log = agent_log(out, fresh_id)
    assert size < fresh_link.down_bytes < 2.1 * size, (fresh_link.down_bytes, size)
    assert f"installing release {second}" not in fresh_log
    # the other: the second and the third, each a delta against the one before (an unchanged state: small)
    assert other_link.down_bytes < 0.5 * size, (other_link.down_bytes, size)
    for agent in (fresh_id, other_id):
        log = agent_log(out, agent)
        assert "already installed" not in log and "Traceback" not in log, log[-3000:]


def test_a_head_agent_before_1_4_is_sent_no_copy_of_the_release_it_takes_from_the_retained_ones(
        mosquitto, broker_capture):
    """A 1.3 head agent subscribes to the release topics on every connect (PROTOCOL.md §12): the
    broker's retained copy is its download. The coordinator once sent it a copy of its own as
    well whenever it came online: two downloads of the release per reconnect."""
    from edgepfl.config import BrokerConfig
    from edgepfl.protocol import Capabilities, ReleaseRef, StatusMeta, agent_topic

    fleet = MqttFleet("old-head", BrokerConfig(), url=mosquitto.url)
    ref = ReleaseRef(release_id="fedavg-r3-aaaaaaaaaaaa", sequence=7)
    topic = agent_topic("old-head", "pi", "task")
    try:
        fleet.releases.publish(b"a release frame", 3, ref=ref)
        for connection in (1, 2):  # comes online, then again after a reconnect
            fleet.agent_status("pi", StatusMeta(state="online", tier="head", version="1.3", session="a" * 32,
                                                connection=connection, capabilities=Capabilities()),
                               came_online=True)
            fleet.agent_status("pi", StatusMeta(state="offline", tier="head", version="1.3", session="a" * 32,
                                                connection=connection), came_online=False)
        fleet.tell("pi", b"end")  # after anything sent to it, in order on the same topic
        wait_until(lambda: (topic, b"end") in broker_capture.snapshot(), 30, what="the end marker")
    finally:
        fleet.close()
    assert [p for t, p in broker_capture.snapshot() if t == topic] == [b"end"]
