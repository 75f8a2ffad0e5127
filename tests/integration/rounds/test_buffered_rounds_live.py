"""Buffered asynchronous rounds (FedBuff) on the in-process virtual clock: no
device waits for another, each accepted update is folded into the open state's buffer
discounted by its staleness, and every ``buffer_size`` updates make the next state.

Eight devices, two of them ten times slower than the rest; a state every four updates;
then the same over Mosquitto with agent processes. (The config check alone:
tests/unit/core/test_buffered.py.)
"""

from __future__ import annotations

import signal

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.protocol import AgentChannel, agent_topic, decode
from edgepfl.simulation import FleetTiming

from tests.fleet_helpers import RunningFleet, read_rows, run_in_thread, wait_until


def _config(**overrides) -> RunConfig:
    base = dict(federation="buffered", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "num_clients": 8}, rounds=10,
                device="cpu", seed=5, round_timeout_s=30.0, asynchrony={"mode": "buffered", "buffer_size": 4},
                simulation={"devices": [{"name": "fast", "share": 6},
                                        {"name": "slow", "share": 2, "seconds_per_sample": 0.01}]})
    base.update(overrides)
    return RunConfig.model_validate(base)


def _slow(config: RunConfig) -> set[str]:
    timing = FleetTiming(config.simulation, [f"agent-{i:02d}" for i in range(8)], config.seed)
    return {a for a, d in timing.devices.items() if d.profile.name == "slow"}


def test_every_state_folds_a_full_buffer_and_slow_devices_count_discounted(tmp_path):
    config = _config()
    rows, _ = simulate(config, 8, tmp_path / "a", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    assert len(training) == 10 and not any(row.aborted for row in training)
    for row in training:
        folded = row.participants + row.late
        assert len(folded) == 4 == len(set(folded)) == sum(row.staleness.values()), row  # one update per device
        assert row.rejected == {} and row.dropped == []
        # the state each late update was trained on, and the distribution it makes
        assert set(row.trained_on) == set(row.late) and all(v < row.round for v in row.trained_on.values())
        behind = [row.round - v for v in row.trained_on.values()]
        assert {str(k): behind.count(k) for k in set(behind)} == {k: n for k, n in row.staleness.items() if k != "0"}
    slow = _slow(config)
    contributed = {a for row in training for a in row.participants + row.late}
    assert slow <= contributed  # ten times slower, and still in the model
    assert max(int(k) for row in training for k in row.staleness) >= 3  # ... with the staleness it has
    # a state's time is the time its buffer took to fill, far less than a slow device's task
    sync, _ = simulate(_config(asynchrony={"mode": "sync"}), 8, tmp_path / "sync", in_process=local_trainers,
                       progress=False)
    assert sum(r.seconds for r in training) < sum(r.seconds for r in sync if not r.final) / 3
    again, _ = simulate(config, 8, tmp_path / "b", in_process=local_trainers, progress=False)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()


def test_an_update_staler_than_the_bound_is_rejected_and_its_device_gets_a_fresh_task(tmp_path):
    config = _config(stragglers={"max_staleness": 2}, rounds=12)
    rows, _ = simulate(config, 8, tmp_path / "run", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    assert sum(row.rejected.get("stale", 0) for row in training) >= 1
    assert all(int(k) <= 2 for row in training for k in row.staleness)
    slow = _slow(config)
    handed = [a for row in training for a in row.sampled]
    assert all(handed.count(a) >= 2 for a in slow)  # re-tasked after each stale answer, never shut out of tasks


def test_by_default_no_device_is_too_slow_to_count(tmp_path):
    """With no staleness bound (the buffered default) a device twenty times slower than the
    rest still has every update folded in, however many states late, discounted; the states
    kept for it are only those it still holds a task of."""
    devices = [{"name": "fast", "share": 7}, {"name": "crawler", "share": 1, "seconds_per_sample": 0.02}]
    config = _config(rounds=80, simulation={"devices": devices}, asynchrony={"mode": "buffered", "buffer_size": 2})
    assert config.staleness_limit is None
    rows, _ = simulate(config, 8, tmp_path / "run", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    timing = FleetTiming(config.simulation, [f"agent-{i:02d}" for i in range(8)], config.seed)
    crawler = next(a for a, d in timing.devices.items() if d.profile.name == "crawler")
    assert all(row.rejected == {} for row in training)
    folded = [row.round - row.trained_on[crawler] for row in training if crawler in row.trained_on]
    assert folded and min(folded) > 16  # more than the old default bound (16) allowed, and counted


def test_a_task_interval_bounds_each_devices_traffic_and_raises_the_slow_devices_share(tmp_path):
    """``asynchrony.min_task_interval_s``: the operator's budget on a metered link. Over the
    same virtual time, each device is sent at most one task per interval (FedBuff sends a
    fast device one the moment it answers), the fleet's bytes per second fall, and the slow
    devices' share of the model's change (the rows' update_share) rises: a fast device no
    longer outvotes a slow one by its number of updates."""
    runs = {}
    for name, interval in (("fedbuff", 0.0), ("budget", 2.0)):
        config = _config(rounds=12, asynchrony={"mode": "buffered", "buffer_size": 4, "min_task_interval_s": interval})
        rows, _ = simulate(config, 8, tmp_path / name, in_process=local_trainers, progress=False)
        runs[name] = [row for row in rows if not row.final]
    slow = _slow(_config())

    def per_second(rows, what) -> float:
        return sum(what(row) for row in rows) / sum(row.seconds for row in rows)

    def tasks(rows, agent) -> int:
        return sum(agent in row.sampled for row in rows)

    budget, fedbuff = runs["budget"], runs["fedbuff"]
    elapsed = sum(row.seconds for row in budget)
    # one task per 2 s at most, whatever the device's speed
    assert all(tasks(budget, f"agent-{i:02d}") <= elapsed / 2.0 + 1 for i in range(8))
    assert max(tasks(fedbuff, f"agent-{i:02d}") for i in range(8)) > sum(r.seconds for r in fedbuff) / 2.0 + 1
    assert per_second(budget, lambda r: r.bytes_up + r.bytes_down) < 0.7 * per_second(
        fedbuff, lambda r: r.bytes_up + r.bytes_down)

    def slow_share(rows) -> float:
        return sum(v for row in rows for a, v in row.update_share.items() if a in slow) / len(rows)

    # shares of each state's change: the updates folded in, each discounted by its staleness
    assert all(set(row.update_share) == {*row.participants, *row.late} for row in budget)
    assert all(0 < sum(row.update_share.values()) <= 1 + 1e-6 for row in budget)
    assert slow_share(budget) > 1.5 * slow_share(fedbuff), (slow_share(budget), slow_share(fedbuff))


def test_a_buffered_federation_over_mosquitto_with_agent_processes(mosquitto, tmp_path):
    """Real agent processes over a real broker: every state folds a full buffer of updates
    from distinct devices, tasks never cross (no ``unexpected`` answer), and the only
    rejections are the answers still outstanding when the synchronous final round opens."""
    config = _config(federation="buffered-mqtt", rounds=5, simulation={}, round_timeout_s=60.0,
                     data={"dataset": "digits", "num_clients": 4}, asynchrony={"mode": "buffered", "buffer_size": 3})
    rows, _ = simulate(config, 4, tmp_path / "run", broker=mosquitto.url, progress=False, threads=1)
    training = [row for row in rows if not row.final]
    assert len(training) == 5 and not any(row.aborted for row in training)
    for row in training:
        folded = row.participants + row.late
        assert len(folded) == 3 == len(set(folded)) == sum(row.staleness.values()), row
        assert row.rejected == {}, row.rejected
    assert set(rows[-1].rejected) <= {"stale"} and rows[-1].evaluated == 4


def test_paced_agent_processes_keep_their_device_profiles_over_mosquitto(mosquitto, tmp_path):
    """simulation.pace_processes: the MQTT path runs the in-process path's profiles on real
    agent processes. The fast devices answer no sooner than every ~1 s, the slow one every
    ~10 s: twelve states take longer than one slow task, so the slow device's updates come
    in, and stale (the fast ones filled the buffers meanwhile), discounted, and folded in —
    as on the virtual clock (the first test above)."""
    simulation = {"pace_processes": True,
                  "devices": [{"name": "fast", "share": 3, "seconds_per_sample": 0.003},
                              {"name": "slow", "share": 1, "seconds_per_sample": 0.03}]}
    config = _config(federation="buffered-paced", rounds=12, simulation=simulation, round_timeout_s=120.0,
                     data={"dataset": "digits", "num_clients": 4}, asynchrony={"mode": "buffered", "buffer_size": 3})
    timing = FleetTiming(config.simulation, [f"agent-{i:02d}" for i in range(4)], config.seed)
    slow = {a for a, d in timing.devices.items() if d.profile.name == "slow"}
    assert len(slow) == 1
    rows, _ = simulate(config, 4, tmp_path / "run", broker=mosquitto.url, progress=False, threads=1)
    training = [row for row in rows if not row.final]
    assert len(training) == 12 and not any(row.aborted for row in training)
    slow_on_time = [a for row in training for a in row.participants if a in slow]
    slow_late = [a for row in training for a in row.late if a in slow]
    assert slow_late and not slow_on_time  # every one of its updates came in after its state had moved on
    assert all(row.rejected.keys() <= {"stale"} for row in training), [row.rejected for row in training]
    paced = (tmp_path / "run" / "agents" / f"{next(iter(slow))}.yaml").read_text()
    assert "seconds_per_sample: 0.03" in paced


def test_a_device_that_restarts_mid_task_is_sent_a_fresh_one(mosquitto, broker_capture, tmp_path):
    """Its task died with the old process: a new session frees the device at once (with
    no staleness bound, the old task's window would otherwise wait for it forever)."""
    simulation = {"pace_processes": True,
                  "devices": [{"name": "fast", "share": 2, "seconds_per_sample": 0.002},
                              {"name": "slow", "share": 1, "seconds_per_sample": 0.01}]}
    config = _config(federation="buffered-restart", rounds=20, simulation=simulation, round_timeout_s=120.0,
                     data={"dataset": "digits", "num_clients": 3}, asynchrony={"mode": "buffered", "buffer_size": 2})
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 3) as fleet:
        timing = FleetTiming(fleet.config.simulation, fleet.ids, fleet.config.seed)
        victim = next(a for a, d in timing.devices.items() if d.profile.name == "slow")  # holds each task ~6 s
        coordinator = Coordinator(fleet.config, MqttFleet(config.federation, config.broker, url=mosquitto.url), out,
                                  progress=False, **fleet.shape())
        thread, box = run_in_thread(coordinator.run)
        task_topic = agent_topic(config.federation, victim, AgentChannel.TASK)
        wait_until(lambda: any(t == task_topic for t, _ in broker_capture.snapshot()), 240, what="the victim's task")
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait()
        wait_until(lambda: len(read_rows(out)) >= 3, 240, what="three states without it")
        # The fast devices wait while the victim restarts: on a busy host its start (torch's
        # import) outlasts the 17 states they would make meanwhile, and the run would end first.
        fast = [fleet.procs[a] for a in fleet.ids if a != victim]
        for proc in fast:
            proc.send_signal(signal.SIGSTOP)
        restarted_after = len(read_rows(out))
        status_topic = agent_topic(config.federation, victim, AgentChannel.STATUS)

        def sessions() -> set[str | None]:
            return {decode(p).meta.session for t, p in broker_capture.snapshot()
                    if t == status_topic and decode(p).meta.state == "online"}

        before = sessions()
        fleet.start_agent(fleet.ids.index(victim))
        wait_until(lambda: sessions() - before, 240, what="the restarted victim's birth")
        for proc in fast:
            proc.send_signal(signal.SIGCONT)
        thread.join(timeout=900)
        coordinator.fleet.close()
        assert not thread.is_alive() and "error" not in box, box.get("error")
    rows = [row for row in read_rows(out) if not row.final]
    assert len(rows) == 20
    assert any(victim in row.sampled for row in rows[restarted_after:]), "the restarted device got no task again"
