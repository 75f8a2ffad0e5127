"""A live view of the fleet: the retained JSON view, ``edgepfl status`` and Prometheus ``/metrics``.

The view's logic: rate limit, size bound, table, totals across a restart (a running
federation's view, read the way an operator's tools read it:
tests/integration/operator/test_liveview_live.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import Fleet
from edgepfl.coordinator.observe import Observer
from edgepfl.coordinator.ops.status import format_view
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.result import RunCounters
from edgepfl.protocol import StatusMeta
from edgepfl.protocol.view import AgentView, FleetView, encode_view, parse_view

from tests.fleet_helpers import run_config


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


def test_the_view_counts_the_open_rounds_updates_and_a_buffered_runs_buffer():
    from edgepfl.coordinator.result import RoundResult

    config = RunConfig(federation="viewtest", rounds=5, observe={"view_interval_s": 0.001},
                       asynchrony={"mode": "buffered", "buffer_size": 4})
    fleet = RecordingFleet()
    obs = Observer(config, fleet, Registry(), RunCounters())
    obs.start(resumed_from=None)
    result = RoundResult(round=2)
    obs.collecting(result)
    obs.enter("training", 2)
    assert (parse_view(fleet.views[-1]).updates, parse_view(fleet.views[-1]).buffer_size) == (0, 4)
    result.participants.append("pi-1")
    result.late.append("pi-2")
    result.staleness.update({0: 1, 3: 1})
    time.sleep(0.01)
    obs.tick()
    view = parse_view(fleet.views[-1])
    assert view.updates == 2 and view.staleness == {"0": 1, "3": 1}
    assert "updates    2 of 4 in the open state's buffer (staleness 0: 1, 3: 1)" in format_view(view)


def test_a_view_from_a_newer_coordinator_still_reads():
    view = FleetView(federation="f", method="fedavg", updated=2.0, started=1.0, phase="training", round=3, rounds=10,
                     rounds_completed=3)
    newer = dict(json.loads(view.model_dump_json()), a_field_of_view_2=[1, 2])
    assert parse_view(json.dumps(newer)) == view


def test_the_final_evaluation_is_not_shown_as_one_round_more():
    """A 4-round run's final evaluation evaluates round 3's state: the table said "round 4 of
    0..3" and "accuracy 78.33% (round 4)"; it names the final evaluation instead."""
    view = FleetView(federation="demo", method="fedavg", updated=100.0, started=10.0, phase="evaluating", round=4,
                     rounds=4, rounds_completed=4, last_accuracy=0.7833, last_accuracy_round=4,
                     last_accuracy_final=True)
    table = format_view(view, now=100.0)
    assert "phase      evaluating, after the last training round (3) of 0..3 (4 completed)" in table
    assert "78.33% (final evaluation)" in table and "round 4" not in table
    done = format_view(view.model_copy(update={"phase": "done"}), now=100.0)
    assert "phase      done, after the last training round (3)" in done


def test_a_view_left_by_a_stopped_coordinator_does_not_call_its_agents_online():
    """After the coordinator exits its retained view stays: `edgepfl status` showed agents stopped
    54 minutes before as online. A finished run's view, or one not republished for three of its
    heartbeats, says the states are as of then."""
    agent = AgentView(id="jetson-01", tier="trainer", online=True, last_seen=100.0, device="cuda", num_train=600)
    running = FleetView(federation="demo", method="fedavg", updated=100.0, started=10.0, phase="training", round=2,
                        rounds=4, rounds_completed=2, heartbeat_s=30.0, agents=[agent])
    assert "note" not in format_view(running, now=110.0)
    assert next(line for line in format_view(running, now=110.0).splitlines()
                if line.startswith("jetson-01")).split()[2] == "online"
    for view, now, why in ((running, 100.0 + 3300, "the coordinator stopped updating this view"),
                           (running.model_copy(update={"phase": "done"}), 110.0, "the run is over")):
        table = format_view(view, now=now)
        assert why in table and "agent states are as of" in table
        row = next(line for line in table.splitlines() if line.startswith("jetson-01"))
        assert "was online" in row


def test_the_rollout_line_tells_a_held_release_from_a_halted_one():
    """A held release (it passed its stages so far and waits for ``release promote``) was
    printed as halted, like every state but staging and promoted."""
    from edgepfl.protocol.view import RolloutView

    def line(**rollout) -> str:
        view = FleetView(federation="demo", method="fedavg", updated=100.0, started=10.0, phase="training", round=2,
                         rounds=4, rounds_completed=2,
                         rollout=RolloutView(release="fedavg-r9-aaaa", stage=1, stages=[0.2, 0.5, 1.0], admitted=5,
                                             reported=5, **rollout))
        return next(row for row in format_view(view, now=100.0).splitlines() if "fedavg-r9-aaaa" in row)

    held = line(state="held")
    assert "held after stage 1 of 3" in held and "halted" not in held and "rolled back" not in held
    halted = line(state="rolled_back", reasons=["accuracy -63.9 points"], to_release="fedavg-r4-bbbb")
    assert "halted at stage 1 of 3" in halted and "rolled back to fedavg-r4-bbbb" in halted
    assert line(state="promoted").endswith("fedavg-r9-aaaa promoted to the whole fleet")


def test_the_operator_reads_what_the_last_stage_measured():
    """Issue 53: the view said where a rollout stood, not what its stages measured."""
    from edgepfl.protocol.view import RolloutView

    def shown(**measured) -> str:
        view = FleetView(federation="demo", method="fedavg", updated=100.0, started=10.0, phase="releasing",
                         round=-1, rounds=4, rounds_completed=4,
                         rollout=RolloutView(release="fedavg-r9-aaaa", stage=1, stages=[0.2, 1.0], state="halted",
                                             admitted=4, reported=4, reasons=["mean held-out accuracy"],
                                             **measured))
        return format_view(view, now=100.0)

    text = shown(paired=4, mean_change=-0.358, worst_change=-0.41, latency_ratio=1.03)
    assert "stage 1 measured: held-out accuracy -35.8 points on average over 4 devices, worst -41.0; " \
           "encoder time 1.03x the release before" in text
    assert "no accuracy compared (no device had a report on the release before it)" in shown(paired=0)
    assert "measured" not in shown()  # before a verdict there is nothing to say


def test_prometheus_shows_the_current_release_the_head_agents_on_each_and_the_rollout():
    """Scraped over HTTP as Prometheus would: the release series, which it had none of."""
    import urllib.request

    from edgepfl.coordinator.observe import PrometheusMetrics
    from edgepfl.protocol.view import RolloutView

    metrics = PrometheusMetrics("127.0.0.1", 0, "demo")
    try:
        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10).read().decode()

        assert "edgepfl_rollout_state{" not in scrape()  # no rollout yet: no state, not "staging"

        def view(release: str, releases: dict, rollout: RolloutView) -> FleetView:
            return FleetView(federation="demo", method="fedavg", updated=100.0, started=10.0, phase="done", round=3,
                             rounds=4, rounds_completed=4, release=release, releases=releases, rollout=rollout)

        metrics.observe_view(view("r1", {"r1": 16, "r2": 4}, RolloutView(
            release="r2", stage=1, stages=[0.2, 0.5, 1.0], state="held", admitted=4, reported=4)))
        text = scrape()
        assert 'edgepfl_release_info{release="r1"} 1.0' in text
        assert 'edgepfl_head_agents_on_release{release="r1"} 16.0' in text
        assert 'edgepfl_head_agents_on_release{release="r2"} 4.0' in text
        assert 'edgepfl_rollout_info{release="r2"} 1.0' in text and "edgepfl_rollout_stage 1.0" in text
        assert 'edgepfl_rollout_state{state="held"} 1.0' in text
        assert 'edgepfl_rollout_head_agents{kind="reported"} 4.0' in text
        # promoted: the old release's series go, not left at their last value
        metrics.observe_view(view("r2", {"r2": 20}, RolloutView(
            release="r2", stage=3, stages=[0.2, 0.5, 1.0], state="promoted", admitted=20, reported=20)))
        text = scrape()
        assert 'edgepfl_release_info{release="r2"} 1.0' in text and 'release="r1"' not in text
        assert 'edgepfl_rollout_state{state="promoted"} 1.0' in text
        assert 'edgepfl_rollout_state{state="held"} 0.0' in text
    finally:
        metrics.close()


def test_the_views_release_counts_follow_the_head_agents_reports_not_only_their_statuses():
    """The last view of a run showed {r3: 2, none: 2} with 4 of 4 installed: two head agents'
    statuses re-published after the install came after it. Their reports (installed) count."""
    from edgepfl.protocol import ReleaseRef

    obs, registry, _, _ = _observer()
    for i in range(4):
        registry.update(f"pi-{i}", StatusMeta(state="online", tier="head"))
    registry.update("pi-0", StatusMeta(state="online", tier="head", release=ReleaseRef(release_id="r3")))
    assert obs.view().releases == {"none": 3, "r3": 1}
    for i in range(1, 4):
        registry.release_report(f"pi-{i}", "r3", None)  # what the inbox does with an installed report
    registry.release_report("pi-3", "r4", "sha256 mismatch")  # a refusal changes what it runs: nothing
    assert obs.view().releases == {"r3": 4}


def test_the_dashboards_curve_survives_a_release_command_and_starts_again_with_a_new_run():
    """Any `edgepfl release` command (a view of its own, phase releasing) emptied the curve."""
    from edgepfl.coordinator.ops.dashboard import LatestView

    def view(started: float, phase: str, round: int, accuracy: float | None) -> FleetView:
        return FleetView(federation="demo", method="fedavg", updated=started + round + 1, started=started,
                         phase=phase, round=round, rounds=10, rounds_completed=max(0, round),
                         last_accuracy=accuracy, last_accuracy_round=None if accuracy is None else round)

    latest = LatestView()
    for r in range(3):
        latest.update(view(100.0, "training", r, 0.5 + r / 10))
    latest.update(view(500.0, "releasing", -1, None))  # edgepfl release publish, between runs
    assert [point[0] for point in json.loads(latest.body())["history"]] == [0, 1, 2]
    latest.update(view(900.0, "training", 0, 0.3))  # another run
    assert json.loads(latest.body())["history"] == [[0, 0.3, False]]
