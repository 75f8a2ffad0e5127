"""A head agent that has the previous release downloads the next one as a delta (protocol 1.7;
docs/COMPRESSION.md, "Release deltas").

Real Mosquitto, real trainer and head agent processes, a real signing coordinator, releases
after each of two rounds of training (``release_every: 1``). Each head agent reaches the
broker through its own :class:`~edgepfl.testing.relay.CountingRelay`, so every byte on its
link is counted. The coordinator waits, after each release, for both head agents' reports
on it, so that what each has installed is known before the next release (as it is in a run
whose rounds take longer than an install):

* the first release goes whole to both;
* the second reaches the agent that has the first in under a quarter of the whole release's
  bytes, and what it installs hashes to the sha256 the coordinator signed; restarted, it
  re-verifies that release against the signature;
* the other agent's installed encoder was changed on disk before the second release: it
  refuses the delta (its base is not what it holds) and the coordinator sends it the whole
  release, which it installs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from edgepfl.config import SecuritySpec
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.releases.release import CURRENT_FILE
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import ReleaseMeta, decode
from edgepfl.protocol.signing import generate_keypair, load_public_key, verify
from edgepfl.testing.relay import CountingRelay

from tests.fleet_helpers import run_config, wait_until

TRAINERS = 2
KEEPS, LOSES = "device-02", "device-03"  # keeps its installed release intact; has its encoder changed on disk


def agent_log(out: Path, agent: str) -> str:
    path = out / "agents" / f"{agent}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def installed_record(out: Path, agent: str) -> dict:
    return json.loads((out / "agents" / agent / "release.json").read_text())


def test_the_next_release_travels_as_a_delta_to_a_head_agent_that_has_the_previous_one(mosquitto, tmp_path, request,
                                                                                       caplog):
    keys = tmp_path / "keys"
    keys.mkdir()
    generate_keypair(keys / "coordinator.key", keys / "coordinator.pub")
    config = prepare(run_config(rounds=2, release_every=1,
                                security=SecuritySpec(signing_key=str(keys / "coordinator.key"))),
                     TRAINERS, head_agents=2)
    assert config.compression.release_delta == "q4"  # the default
    pinned = SecuritySpec(coordinator_key=str(keys / "coordinator.pub"))
    out, url = tmp_path / "run", mosquitto.url
    links = {agent: CountingRelay(mosquitto.host, mosquitto.port) for agent in (KEEPS, LOSES)}
    downloaded: dict[str, list[int]] = {KEEPS: [], LOSES: []}
    whole_sizes: list[int] = []

    spawned: list = []
    request.addfinalizer(lambda: stop_agents(spawned))  # whatever fails, no agent outlives the test

    def head(agent: str):
        spawned.append(spawn_agent(config, out, links[agent].url, agent, TRAINERS + (agent == LOSES), tier="head",
                                   security=pinned))
        return spawned[-1]

    class ReleasesOneAtATime(Coordinator):
        def release(self, round: int) -> str | None:
            if self.releases:  # before the second release: LOSES no longer holds what it installed
                path = out / "agents" / LOSES / installed_record(out, LOSES)["encoder_file"]
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            for link in links.values():
                link.reset()
            release_id = super().release(round)
            assert release_id is not None
            reports = self.inbox.reports_by_release

            def installed_by_both() -> bool:
                got = reports.get(release_id, {})
                return all(agent in got and got[agent].refused is None for agent in links)

            assert self.inbox.pump_until(installed_by_both, self.clock.now() + 240), reports.get(release_id)
            for agent, link in links.items():
                downloaded[agent].append(link.down_bytes)
            whole_sizes.append(len((out / "releases" / CURRENT_FILE).read_bytes()))
            return release_id

    trainers = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(TRAINERS)]
    spawned.extend(trainers)
    with links[KEEPS], links[LOSES]:
        heads = {agent: head(agent) for agent in links}
        fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
        try:
            coordinator = ReleasesOneAtATime(config, fleet, out, progress=False, **data_shape(config))
            with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
                coordinator.run()
        finally:
            fleet.close()
            stop_agents(trainers)
        first, second = list(coordinator.releases)
        # two releases past the rollout's gate (rollout.in_runs unset): said once, at the start
        unstaged = [r for r in caplog.records if "measured by no canary" in r.getMessage()]
        assert len(unstaged) == 1 and "rollout.in_runs: true" in unstaged[0].getMessage()
        assert coordinator.releases[first] == 0 and coordinator.releases[second] == 1  # a round of training apart

        # the first release: whole to both
        for agent in links:
            assert downloaded[agent][0] >= whole_sizes[0], (agent, downloaded, whole_sizes)
        # the second: a quarter of the whole release or less to the agent that had the first ...
        assert downloaded[KEEPS][1] < 0.25 * whole_sizes[1], (downloaded, whole_sizes)
        # ... and what it installed is the artifact the coordinator signed
        release = decode((out / "releases" / CURRENT_FILE).read_bytes())
        assert verify(release, load_public_key(keys / "coordinator.pub")) is None
        signed = release.meta_as(ReleaseMeta)
        assert signed.release_id == second and signed.delta is None  # the retained copy is whole
        record = installed_record(out, KEEPS)
        encoder = (out / "agents" / KEEPS / record["encoder_file"]).read_bytes()
        assert record["release_id"] == second
        assert hashlib.sha256(encoder).hexdigest() == record["encoder_sha256"] == signed.sha256
        # the other refused the delta against an encoder it no longer holds, then got the release whole
        assert downloaded[LOSES][1] > whole_sizes[1], (downloaded, whole_sizes)
        assert installed_record(out, LOSES)["encoder_sha256"] == signed.sha256
        assert "is not the installed release; the coordinator sends it whole" in agent_log(out, LOSES)

        # restarted, the agent that installed from the delta re-verifies it against the signature
        stop_agents([heads[KEEPS]])
        before = len(agent_log(out, KEEPS))
        heads[KEEPS] = head(KEEPS)
        try:
            wait_until(lambda: f"restored release {second}" in agent_log(out, KEEPS)[before:], 120, interval=0.5,
                       what="the restarted head agent restoring the release it rebuilt")
        finally:
            stop_agents(list(heads.values()))
    log = agent_log(out, KEEPS)
    assert "refused" not in log and "Traceback" not in log, log[-3000:]
    assert "Traceback" not in agent_log(out, LOSES)
