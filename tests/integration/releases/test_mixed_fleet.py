"""A mixed fleet over Mosquitto: trainer agents train, the coordinator releases the
frozen encoder, head-tier agents (torch-free) fit their heads and report."""

from __future__ import annotations

import json

from edgepfl.coordinator.fleet import SENDER as COORDINATOR
from edgepfl.coordinator.simulate import simulate
from edgepfl.protocol import AgentChannel, FederationChannel, MessageType, decode, parse_topic

from tests.fleet_helpers import run_config


def test_mixed_fleet_reports_both_tiers(mosquitto, broker_capture, tmp_path):
    config = run_config(method={"name": "fedavg"}, rounds=3, data={"samples_per_client": 300})
    out = tmp_path / "run"
    rows, summary = simulate(config, 3, out, broker=mosquitto.url, head_agents=2, head="lr", progress=False)

    # trainer tier: the usual per-round personalized accuracy
    assert rows[-1].final and set(rows[-1].per_client) == {"agent-00", "agent-01", "agent-02"}
    # head tier: both devices installed the release, fitted a head on their own data and reported
    by_release = json.loads((out / "head_metrics.json").read_text())
    assert len(by_release) == 1  # one release, its reports keyed by its id
    (release_id, entry), = by_release.items()
    heads = entry["reports"]
    assert set(heads) == {"device-00", "device-01"} and entry["round"] == config.rounds - 1
    for report in heads.values():
        assert report["tier"] == "head" and report["head"] == "lr" and report["total"] > 0
        assert report["accuracy"] > 0.3  # 10 classes: far above chance on data no trainer saw
    assert summary["head_tier"]["agents"] == heads and summary["head_tier"]["release"] == release_id
    releases = [decode(p) for t, p in broker_capture.snapshot() if t.endswith("/release")]
    assert len(releases) == 1 and releases[0].meta.release_id == next(iter(heads.values()))["release_id"]
    assert_every_channel_has_one_direction(broker_capture.snapshot(), config.federation)
    # the head agents' torch-free path: nothing in their logs came from the trainer runtime
    for device in ("device-00", "device-01"):
        log = (out / "agents" / f"{device}.log").read_text()
        assert "edgepfl.edge_agent.trainer" not in log and "Traceback" not in log
    assert f"head-tier agents, release {release_id}" in (out / "results.txt").read_text()


def assert_every_channel_has_one_direction(frames: list[tuple[str, bytes]], federation: str) -> None:
    """docs/PROTOCOL.md, Channels: nobody but agent A publishes on its status, update and
    metrics topics; nobody but the coordinator on task, coordinator and release (and the
    release's part topics). Each frame's type is its channel's (or a chunk of a frame too
    big for one message; on a release part topic, exactly that part's chunk)."""
    seen = set()
    for topic, payload in frames:
        if not topic.startswith(f"edgepfl/v1/{federation}/") or not payload:  # other traffic; a cleared retained topic
            continue
        parsed = parse_topic(topic)
        seen.add(parsed.channel)
        if parsed.channel == FederationChannel.VIEW:  # the operators' JSON mirror, not a frame (PROTOCOL §18)
            assert json.loads(payload)["federation"] == federation
            continue
        message = decode(payload)
        header = message.header
        from_agent = parsed.channel in (AgentChannel.STATUS, AgentChannel.UPDATE, AgentChannel.METRICS)
        assert header.sender == (parsed.agent if from_agent else COORDINATOR), (topic, header.sender)
        if parsed.part is not None:  # a release in parts: release/<i> carries chunk i, nothing else (PROTOCOL §12)
            assert header.type == MessageType.CHUNK and message.meta.index == parsed.part, (topic, header.type)
        # a late head agent gets the current release on its task topic (PROTOCOL.md §12), and
        # an agent a NACK of a rejected frame of its own (§7)
        allowed = {MessageType(parsed.channel.value), MessageType.CHUNK}
        if parsed.channel == AgentChannel.TASK:
            allowed |= {MessageType.RELEASE, MessageType.NACK}
        if parsed.channel == AgentChannel.UPDATE:  # an agent that will not run a task says so (§5)
            allowed.add(MessageType.REFUSAL)
        assert header.type in allowed, (topic, header.type)
    # this run exercised every channel, so the check above covered both directions of each
    assert seen == {*AgentChannel, *FederationChannel}


def test_a_head_agent_that_cannot_install_the_release_tells_the_coordinator_why(mosquitto, tmp_path, caplog):
    """A FedAvg federation whose head agent is set up for FedPick's own head. It
    refuses every FedAvg release ("no fedpick head"), and says so to the coordinator
    (protocol 1.5): the refusal is that agent's report on the release, in head_metrics.json,
    the results table and the coordinator's log, instead of a report that never comes."""
    config = run_config(method={"name": "fedavg"}, rounds=1, data={"samples_per_client": 200})
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        simulate(config, 2, out, broker=mosquitto.url, head_agents=1, head="fedpick", progress=False)
    (release_id, entry), = json.loads((out / "head_metrics.json").read_text()).items()
    report = entry["reports"]["device-00"]
    assert report["refused"].startswith(f"release {release_id} refused: no fedpick head for this fedavg release")
    assert report["total"] == 0 and report["accuracy"] is None
    assert f"device-00 did not install release {release_id}: " in (out / "results.txt").read_text()
    assert f"head agent device-00 did not install release {release_id}" in caplog.text
