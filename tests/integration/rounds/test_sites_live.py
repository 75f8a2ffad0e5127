"""Site aggregators, live (docs/PROTOCOL.md §20): two site brokers, two ``edgepfl aggregator``
processes and six agent processes over Mosquitto give the same global state, bit for bit,
as the same six agents on one broker with no sites, and the central coordinator's uplink
carries one answer per site and round instead of one per device."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from edgepfl.atomic import write_bytes
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, simulate, spawn_agent, stop_agents
from edgepfl.protocol.envelope import peek_header
from edgepfl.testing.brokers import MosquittoBroker, TrafficCapture

from tests.fleet_helpers import checkpoint_tensors, read_rows, run_config

SITES = {"site-a": ["agent-00", "agent-01", "agent-02"], "site-b": ["agent-03", "agent-04", "agent-05"]}


def _aggregator(config, site_id: str, site_url: str, central_url: str, out: Path) -> subprocess.Popen:
    """An ``edgepfl aggregator`` process for ``site_id``: its site's federation on its own broker."""
    site = config.model_copy(update={"federation": f"{config.federation}-{site_id}"})
    doc = {"site_id": site_id,
           "central": {"federation": config.federation, "broker": {"url": central_url}},
           "site": {**site.model_dump(mode="json", exclude={"broker"}), "broker": {"url": site_url}}}
    path = out / f"{site_id}.yaml"
    write_bytes(path, yaml.safe_dump(doc, sort_keys=False).encode())
    log = open(out / f"{site_id}.log", "ab")  # noqa: SIM115 (the process writes it until it stops)
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "--log-level", "info", "aggregator", "--config",
                             str(path)], stdout=log, stderr=subprocess.STDOUT)


def _hierarchical(config, central_url: str, out: Path) -> tuple[list, list[tuple[str, bytes]]]:
    """The same run through two sites; the rows, and what crossed the central broker."""
    out.mkdir(parents=True)
    brokers = {site: MosquittoBroker() for site in SITES}
    procs: list[subprocess.Popen] = []
    capture = TrafficCapture(central_url)
    fleet = None
    try:
        for broker in brokers.values():
            broker.start()
        capture.start()
        capture.clear()
        index = 0
        for site, agents in SITES.items():
            site_config = config.model_copy(update={"federation": f"{config.federation}-{site}"})
            procs.append(_aggregator(config, site, brokers[site].url, central_url, out))
            for agent in agents:
                procs.append(spawn_agent(site_config, out, brokers[site].url, agent, index))
                index += 1
        central = config.model_copy(update={"sites": config.sites.model_copy(update={"enabled": True})})
        fleet = MqttFleet(central.federation, central.broker, url=central_url, security=central.security)
        rows = Coordinator(central, fleet, out / "run", progress=False, **data_shape(config)).run()
        return rows, capture.snapshot()
    finally:
        if fleet is not None:
            fleet.close()
        stop_agents(procs)
        capture.stop()
        for broker in brokers.values():
            broker.stop()


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_two_sites_give_the_flat_fleets_state_bit_for_bit_with_one_answer_per_site(method, mosquitto, tmp_path):
    config = prepare(run_config(method={"name": method}, rounds=2, seed=5), 6)
    flat_rows, _ = simulate(config, 6, tmp_path / "flat", broker=mosquitto.url, progress=False, threads=1)
    rows, traffic = _hierarchical(config, mosquitto.url, tmp_path / "tree")

    assert [r.round for r in rows] == [r.round for r in flat_rows] == [0, 1, 2]
    for flat, tree in zip(flat_rows, rows):
        assert tree.participants == flat.participants == (sorted(sum(SITES.values(), [])) if not tree.final else [])
        assert tree.per_client == flat.per_client  # every device's held-out counts, through its site
        assert tree.accuracy == flat.accuracy
    assert not any(r.aborted for r in rows)
    flat_state = checkpoint_tensors(tmp_path / "flat" / "checkpoint")
    tree_state = checkpoint_tensors(tmp_path / "tree" / "run" / "checkpoint")
    assert flat_state.keys() == tree_state.keys()
    for key in flat_state:
        assert flat_state[key].tobytes() == tree_state[key].tobytes(), key

    # the central uplink: one answer per site and round (two training rounds and the final
    # evaluation), none from a device; the devices' own updates never reach the central broker
    answers = Counter()
    for topic, payload in traffic:
        if topic.endswith("/update"):
            header = peek_header(payload)
            answers[topic.split("/")[-2]] += header is not None and header.get("type") != "chunk"
    assert answers == {site: 3 for site in SITES}
    # and its bytes: each site's sum (one int64 a parameter) against three devices' float32 updates
    for flat, tree in zip(flat_rows[:-1], rows[:-1]):
        assert tree.update_bytes == {"site": tree.bytes_up}
        assert tree.bytes_up < flat.bytes_up * 3 / 4, (tree.bytes_up, flat.bytes_up)
    assert read_rows(tmp_path / "tree" / "run")[-1].final
