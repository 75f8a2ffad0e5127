"""Site aggregators, live (docs/PROTOCOL.md §20): two site brokers, two ``edgepfl aggregator``
processes and six agent processes over Mosquitto give the same global state, bit for bit,
as the same six agents on one broker with no sites, and the central coordinator's uplink
carries one answer per site and round instead of one per device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from edgepfl.atomic import write_bytes
from edgepfl.config import SecuritySpec, SitesSpec
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.ops.status import fetch_view
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, simulate, spawn_agent, stop_agents
from edgepfl.failpoints import ENV
from edgepfl.protocol import ProtocolError, StatusMeta, decode
from edgepfl.protocol.envelope import peek_header
from edgepfl.protocol.signing import generate_keypair
from edgepfl.state import load_checkpoint
from edgepfl.testing.brokers import MosquittoBroker, TrafficCapture

from tests.attack_kit import Attacker
from tests.fleet_helpers import checkpoint_tensors, read_rows, run_config, run_in_thread, wait_until

#: bytes that are no frame, published on a site device's topic
GARBAGE = b"not a frame of any protocol version"


def _rejection_reason(payload: bytes) -> str:
    """The reason a receiver rejects ``payload`` with (§7)."""
    try:
        decode(payload)
    except ProtocolError as exc:
        return exc.reason
    raise AssertionError("the garbage decoded")


def _flood(attacker: Attacker, stop: threading.Event) -> None:
    while not stop.wait(0.25):
        attacker.publish("agents/agent-00/update", GARBAGE)


SITES = {"site-a": ["agent-00", "agent-01", "agent-02"], "site-b": ["agent-03", "agent-04", "agent-05"]}


def keys_for(folder: Path, signers: list[str]) -> Path:
    """A key pair per signer (``<name>.key``, ``<name>.pub``) and the central coordinator's
    enrolled dir of every signer but itself (``enrolled/``)."""
    for name in ["central", *signers]:
        generate_keypair(folder / f"{name}.key", folder / f"{name}.pub")
        if name != "central":
            (folder / "enrolled").mkdir(exist_ok=True)
            shutil.copy(folder / f"{name}.pub", folder / "enrolled" / f"{name}.pub")
    return folder


def _aggregator(config, site_id: str, site_url: str, central_url: str, out: Path,
                env: dict | None = None, keys: Path | None = None, mode: str = "exact") -> subprocess.Popen:
    """An ``edgepfl aggregator`` process for ``site_id``: its site's federation on its own broker;
    with ``keys`` (:func:`keys_for`) it signs with its own key and pins the central coordinator's;
    in ``mode`` summary it keeps its devices' records in ``<out>/<site_id>-state``."""
    site = config.model_copy(update={"federation": f"{config.federation}-{site_id}"})
    security = {"signing_key": str(keys / f"{site_id}.key"), "coordinator_key": str(keys / "central.pub")} \
        if keys is not None else {}
    summary = {"mode": "summary", "state_dir": f"{site_id}-state"} if mode == "summary" else {}
    doc = {"site_id": site_id, **summary,
           "central": {"federation": config.federation, "broker": {"url": central_url}, "security": security},
           "site": {**site.model_dump(mode="json", exclude={"broker"}), "broker": {"url": site_url}}}
    path = out / f"{site_id}.yaml"
    write_bytes(path, yaml.safe_dump(doc, sort_keys=False).encode())
    log = open(out / f"{site_id}.log", "ab")  # noqa: SIM115 (the process writes it until it stops)
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "--log-level", "info", "aggregator", "--config",
                             str(path)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


@contextmanager
def sites_running(config, central_url: str, out: Path, env: dict[str, dict] | None = None,
                  keys: Path | None = None, mode: str = "exact") -> Iterator[dict]:
    """Two site brokers, their aggregators (``env``: per site, extra environment) and three agent
    processes each; yields the aggregator processes by site, stops everything on exit."""
    out.mkdir(parents=True)
    brokers = {site: MosquittoBroker() for site in SITES}
    aggregators: dict[str, subprocess.Popen] = {}
    agents: list[subprocess.Popen] = []
    try:
        index = 0
        for site, devices in SITES.items():
            brokers[site].start()
            site_config = config.model_copy(update={"federation": f"{config.federation}-{site}"})
            aggregators[site] = _aggregator(config, site, brokers[site].url, central_url, out, (env or {}).get(site),
                                            keys, mode)
            for agent in devices:
                agents.append(spawn_agent(site_config, out, brokers[site].url, agent, index))
                index += 1
        yield {"aggregators": aggregators, "brokers": brokers}
    finally:
        stop_agents(agents + list(aggregators.values()))
        for broker in brokers.values():
            broker.stop()


def central_run(config, central_url: str, out: Path, keys: Path | None = None, ids: list[str] | None = None,
                mode: str = "exact") -> list:
    """The central coordinator of ``config`` with sites (``ids``, default :data:`SITES`; ``mode``
    theirs), run to its end; its rows. With ``keys`` it signs with ``central.key`` and takes
    only enrolled senders."""
    central = config.model_copy(update={"sites": SitesSpec(enabled=True, ids=ids or list(SITES), mode=mode)})
    if mode == "summary":  # the sites are the trainers
        central = central.model_copy(update={"min_agents": len(ids or SITES)})
    if keys is not None:
        central = central.model_copy(update={"security": SecuritySpec(signing_key=str(keys / "central.key"),
                                                                      enrolled_dir=str(keys / "enrolled"))})
    fleet = MqttFleet(central.federation, central.broker, url=central_url, security=central.security)
    try:
        return Coordinator(central, fleet, out, progress=False, **data_shape(config)).run()
    finally:
        fleet.close()


def _hierarchical(config, central_url: str, out: Path, mode: str = "exact") -> tuple[list, list[tuple[str, bytes]]]:
    """The same run through two sites; the rows, and what crossed the central broker."""
    capture = TrafficCapture(central_url)
    capture.start()
    capture.clear()
    try:
        with sites_running(config, central_url, out, mode=mode):
            if mode == "summary":  # every device online at its site before round 0, as the flat run waits for
                wait_until(lambda: _site_counts(capture.snapshot()) == {s: len(d) for s, d in SITES.items()},
                           timeout=180, what="each site announcing its three devices")
            return central_run(config, central_url, out / "run", mode=mode), capture.snapshot()
    finally:
        capture.stop()


def _site_counts(traffic: list[tuple[str, bytes]]) -> dict[str, int]:
    """The device count of each summary site's last status in ``traffic``."""
    counts = {}
    for topic, payload in traffic:
        if topic.endswith("/status") and topic.split("/")[-2] in SITES:
            status = decode(payload).meta_as(StatusMeta)
            counts[topic.split("/")[-2]] = status.site.count if status.site is not None else None
    return counts


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

    # the fleet view names the sites: their devices and the last round summed; each device its site
    view = fetch_view(mosquitto.url, config.federation)
    by_id = {a.id: a for a in view.agents}
    for site, devices in SITES.items():
        assert by_id[site].tier == "site" and by_id[site].last_sum == 1
        assert all(by_id[d].tier == "trainer" and by_id[d].site == site for d in devices)


def test_a_site_killed_mid_round_costs_its_devices_that_round_and_rejoins_when_restarted(mosquitto, tmp_path):
    """site-b's aggregator dies (SIGKILL) after sending its devices round 1's tasks: the round
    closes with site-a's three updates (quorum), site-b's devices dropped; restarted, it lists
    its devices again (from their retained statuses on its broker) and they train round 2."""
    config = prepare(run_config(rounds=3, seed=3, round_timeout_s=30), 6)
    out, keys = tmp_path / "tree", keys_for(tmp_path, list(SITES))  # signed: sites and central pin each other
    with sites_running(config, mosquitto.url, out, env={"site-b": {ENV: "site.tasks_sent:2"}}, keys=keys) as sites:
        thread, box = run_in_thread(lambda: central_run(config, mosquitto.url, out / "run", keys))
        # all along, garbage on a site-a device's update topic, which only site-a's aggregator reads
        garbage = Attacker(sites["brokers"]["site-a"].url, f"{config.federation}-site-a")
        stop = threading.Event()
        threading.Thread(target=_flood, args=(garbage, stop), daemon=True).start()
        killed = sites["aggregators"]["site-b"]
        wait_until(lambda: killed.poll() is not None, timeout=300, what="site-b's aggregator killed in round 1")
        assert killed.returncode == -9
        sites["aggregators"]["site-b"] = _aggregator(config, "site-b", sites["brokers"]["site-b"].url, mosquitto.url,
                                                     out, keys=keys)
        thread.join(timeout=600)
        stop.set()
        garbage.close()
        assert not thread.is_alive() and "error" not in box, box.get("error")
    rows = box["result"]
    # what site-a rejected reached the central rows and the run's totals (the central broker saw none of it)
    reason = _rejection_reason(GARBAGE)
    assert sum(r.rejected.get(reason, 0) for r in rows) >= 1
    loaded = load_checkpoint(out / "run" / "checkpoint")
    assert loaded is not None and loaded[1].rejected_total.get(reason, 0) >= 1
    site_a, site_b = SITES["site-a"], SITES["site-b"]
    assert rows[0].participants == sorted(site_a + site_b)
    assert rows[1].participants == site_a and not rows[1].aborted
    assert set(site_b) <= set(rows[1].dropped)
    assert rows[2].participants == sorted(site_a + site_b)  # rejoined
    assert rows[3].final and set(rows[3].per_client) == set(site_a + site_b)


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_summary_sites_draw_their_own_devices_and_name_none_on_the_uplink_with_the_flat_fleets_state(
        method, mosquitto, tmp_path):
    """``sites.mode: summary``: each site announces how many devices it has, draws them itself
    (fraction 1: all three), keeps their records in its state_dir and answers with its sum and
    totals. No device id crosses the central broker, the central round's participants are the
    sites, and with every device drawn the state is still the flat fleet's bit for bit: the
    sites' records give the bounds the central records would have."""
    config = prepare(run_config(method={"name": method}, rounds=3, seed=7), 6)
    flat_rows, _ = simulate(config, 6, tmp_path / "flat", broker=mosquitto.url, progress=False, threads=1)
    out = tmp_path / "tree"
    # a federation of its own: the flat run's agents left their retained statuses in the first one
    tree = config.model_copy(update={"federation": f"{config.federation}-summary"})
    rows, traffic = _hierarchical(tree, mosquitto.url, out, mode="summary")

    assert [r.round for r in rows] == [0, 1, 2, 3] and not any(r.aborted for r in rows)
    for row in rows[:-1]:
        assert row.participants == sorted(SITES)
        assert {s: (r.sampled, r.trained, r.dropped) for s, r in row.sites.items()} == {s: (3, 3, 0) for s in SITES}
    assert rows[-1].final and set(rows[-1].per_client) == set(SITES) and rows[-1].sites["site-a"].evaluated == 3
    flat_state = checkpoint_tensors(tmp_path / "flat" / "checkpoint")
    tree_state = checkpoint_tensors(out / "run" / "checkpoint")
    for key in flat_state:
        assert flat_state[key].tobytes() == tree_state[key].tobytes(), key
    # the central broker carried no device's name: not in a status, a task or an answer
    devices = [d.encode() for d in sum(SITES.values(), [])]
    assert traffic and not [topic for topic, payload in traffic if any(d in payload for d in devices)]
    # each site kept its devices' records of the adopted rounds (3 at most each), on disk
    for site, members in SITES.items():
        book = json.loads((out / f"{site}-state" / "records.json").read_text())
        assert sorted(book["history"]) == members and all(len(r) == 3 for r in book["history"].values())
    view = fetch_view(mosquitto.url, tree.federation)
    by_id = {a.id: a for a in view.agents}
    assert {s: (by_id[s].tier, by_id[s].devices) for s in SITES} == {s: ("site", 3) for s in SITES}
    assert not set(by_id) & set(sum(SITES.values(), []))


def test_a_summary_site_killed_mid_round_costs_that_round_and_judges_its_devices_by_its_records_when_restarted(
        mosquitto, tmp_path):
    """A summary site keeps its devices' records in its state_dir: site-b's aggregator dies
    (SIGKILL) after sending its devices round 1's tasks, which it did after keeping round 0's
    records; the round closes with site-a alone, and restarted, site-b's book still holds round
    0's records, to which round 2's are added (two each; a book lost with the process would
    hold one)."""
    config = prepare(run_config(rounds=3, seed=3, round_timeout_s=30), 6)
    out = tmp_path / "tree"
    config = config.model_copy(update={"federation": f"{config.federation}-summary"})
    capture = TrafficCapture(mosquitto.url).start()
    with sites_running(config, mosquitto.url, out, env={"site-b": {ENV: "site.tasks_sent:2"}}, mode="summary") as sites:
        wait_until(lambda: _site_counts(capture.snapshot()) == {s: len(d) for s, d in SITES.items()}, timeout=180,
                   what="each site announcing its three devices")
        capture.stop()
        thread, box = run_in_thread(lambda: central_run(config, mosquitto.url, out / "run", mode="summary"))
        killed = sites["aggregators"]["site-b"]
        wait_until(lambda: killed.poll() is not None, timeout=300, what="site-b's aggregator killed in round 1")
        assert killed.returncode == -9
        sites["aggregators"]["site-b"] = _aggregator(config, "site-b", sites["brokers"]["site-b"].url, mosquitto.url,
                                                     out, mode="summary")
        thread.join(timeout=600)
        assert not thread.is_alive() and "error" not in box, box.get("error")
    rows = box["result"]
    assert rows[0].participants == ["site-a", "site-b"]
    assert rows[1].participants == ["site-a"] and rows[1].dropped == ["site-b"] and not rows[1].aborted
    assert rows[2].participants == ["site-a", "site-b"]  # rejoined
    assert rows[3].final and set(rows[3].per_client) == set(SITES)
    books = {site: json.loads((out / f"{site}-state" / "records.json").read_text())["history"] for site in SITES}
    assert {a: len(r) for a, r in books["site-a"].items()} == {a: 3 for a in SITES["site-a"]}
    assert {a: len(r) for a, r in books["site-b"].items()} == {a: 2 for a in SITES["site-b"]}


def test_buffered_states_across_summary_sites_fold_a_sum_of_an_earlier_state_late_and_count_every_site(
        mosquitto, tmp_path):
    """Buffered rounds across summary sites: a state is adopted on the first site's sum (buffer
    of one), so the other site's sum of that state arrives after it and is folded into the next
    one, discounted (``late``, ``trained_on``); every site's devices count, and each site keeps
    the records of its sums that went into adopted states."""
    config = prepare(run_config(rounds=4, seed=9, asynchrony={"mode": "buffered", "buffer_size": 1}), 6)
    tree = config.model_copy(update={"federation": f"{config.federation}-buffered"})
    out = tmp_path / "tree"
    rows, _ = _hierarchical(tree, mosquitto.url, out, mode="summary")

    training = [r for r in rows if not r.final]
    assert len(training) == 4 and not any(r.aborted for r in training)
    late = [(r.round, site, r.trained_on[site]) for r in training for site in r.late]
    assert late and all(on < r for r, _, on in late), late  # a sum of an earlier state, folded in later
    assert all(sum(int(k) * n for k, n in r.staleness.items()) > 0 for r in training if r.late)
    assert {s for r in training for s in r.participants + r.late} == set(SITES)
    assert rows[-1].final and set(rows[-1].per_client) == set(SITES)
    for site, members in SITES.items():
        book = json.loads((out / f"{site}-state" / "records.json").read_text())
        assert sorted(book["history"]) == members
