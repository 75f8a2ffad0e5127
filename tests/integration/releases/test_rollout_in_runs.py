"""A coordinator whose own releases go by stages (``rollout.in_runs``; docs/ROLLOUT.md).

Real Mosquitto, two trainer and five head agent processes, a signing coordinator that
releases after each of two training rounds: each release reaches the 40 % canary first
(two devices, the same two both times), is judged on their reports, then goes to the whole
fleet and is promoted; the round loop goes on after each, and the run ends with every head
agent on the last release, and the stages recorded.
"""

from __future__ import annotations

import json

from edgepfl.config import SecuritySpec
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol.signing import generate_keypair
from edgepfl.rollout import stage_members

from tests.fleet_helpers import run_config

TRAINERS, HEADS = 2, 5


def test_the_coordinators_releases_go_by_stages_and_the_run_goes_on(mosquitto, tmp_path, request):
    keys = tmp_path / "keys"
    keys.mkdir()
    generate_keypair(keys / "coordinator.key", keys / "coordinator.pub")
    config = prepare(run_config(rounds=2, release_every=1, security=SecuritySpec(signing_key=str(keys / "coordinator.key")),
                                rollout={"in_runs": True, "stages": [0.4, 1.0], "stage_timeout_s": 240}),
                     TRAINERS, head_agents=HEADS)
    # the stages wait for all five (prepare leaves min_head_agents at 0: without it the first
    # release went out as soon as the trainers, quicker to start, had trained a round)
    config = config.model_copy(update={"min_head_agents": HEADS})
    out, url = tmp_path / "run", mosquitto.url
    pinned = SecuritySpec(coordinator_key=str(keys / "coordinator.pub"))
    heads = [f"pi-{i}" for i in range(HEADS)]
    procs = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(TRAINERS)]
    procs += [spawn_agent(config, out, url, a, TRAINERS + i, tier="head", security=pinned) for i, a in enumerate(heads)]
    request.addfinalizer(lambda: stop_agents(procs))
    fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
    finally:
        fleet.close()
    assert [r.round for r in rows] == [0, 1, 2] and rows[-1].final
    events = [json.loads(line) for line in (out / "releases" / "rollout.jsonl").read_text().splitlines()]
    releases = list(coordinator.releases)
    assert len(releases) == 2
    canary = sorted(stage_members(heads, 0.4, config.federation))
    for release in releases:
        stages = [e for e in events if e["release_id"] == release and e["event"] == "stage"]
        # the canary: the same two devices for every release; then everyone who was online
        assert [sorted(e["agents"]) for e in stages][0] == canary and len(stages[1]["agents"]) == HEADS, stages
        assert all(e["verdict"]["passed"] for e in stages)
        assert [e["event"] for e in events if e["release_id"] == release][-1] == "promoted"
    for agent in heads:
        record = json.loads((out / "agents" / agent / "release.json").read_text())
        assert record["release_id"] == releases[-1], agent
