"""Round drivers: every row of the table a config is checked against loads a driver class,
a pair without a driver is refused by the config, and a new round mode is one driver over
the RoundContext plus its row (a tiny driver below runs a whole federation)."""

from __future__ import annotations

import pytest

from edgepfl import config as config_module
from edgepfl.config import NO_ROUND_DRIVER, ROUND_DRIVERS, ConfigError, RunConfig, round_driver
from edgepfl.coordinator.drivers import BufferedRounds, RoundContext, SecureRounds, SyncRounds, load_driver
from edgepfl.metrics import RoundMetrics

from tests.unit.coordinator.test_round_loop import ScriptedFleet, coordinator, honest


def test_every_pair_the_config_accepts_loads_its_driver_class():
    loaded = {pair: load_driver(path) for pair, path in ROUND_DRIVERS.items()}
    assert loaded == {("sync", False): SyncRounds, ("buffered", False): BufferedRounds, ("sync", True): SecureRounds}
    assert not set(NO_ROUND_DRIVER) & set(ROUND_DRIVERS)


@pytest.mark.parametrize("path, says", [("edgepfl.coordinator.drivers.nowhere:Rounds", "No module"),
                                        ("edgepfl.coordinator.drivers.sync:Nothing", "Nothing"),
                                        ("edgepfl.coordinator.drivers.base:RoundContext", "no run_round")])
def test_a_row_that_names_no_driver_is_one_config_error_naming_it(path, says):
    with pytest.raises(ConfigError, match=f"round driver {path}.*{says}"):
        load_driver(path)


@pytest.mark.parametrize("mode, secure", [("sync", False), ("buffered", False), ("sync", True), ("buffered", True)])
def test_the_config_takes_exactly_the_pairs_of_the_table(mode, secure):
    raw = {"asynchrony": {"mode": mode}, "secure_aggregation": {"enabled": secure}, "min_agents": 3,
           "aggregation": {"max_update_vs_median": None} if secure else {}}
    if (mode, secure) in ROUND_DRIVERS:
        assert round_driver(RunConfig(**raw)) == ROUND_DRIVERS[(mode, secure)]
    else:
        with pytest.raises(ValueError, match="asynchrony.mode must be sync"):
            RunConfig(**raw)


class OneAtATime:
    """A round mode for this test only: each round trains one agent, in turn, through the
    context alone (no coordinator internals)."""

    waits_between_rounds = True

    def __init__(self, context: RoundContext):
        self.context = context

    def run_round(self, r: int) -> RoundMetrics:
        co = self.context
        started = co.clock.now()
        online, _ = co.sample(r, final=False)
        chosen = [sorted(online)[r % len(online)]]
        tasks, result, _ = co.open_round(r, chosen, late=False)
        co.send_task(tasks, result, chosen[0], "train")
        co.collect(tasks, result, started)
        return co.close_round(tasks, result, started, final=False, quorum=1)


def test_a_new_round_mode_is_one_driver_and_its_row(tmp_path, monkeypatch):
    monkeypatch.setitem(config_module.ROUND_DRIVERS, ("sync", False), f"{__name__}:OneAtATime")
    fleet = ScriptedFleet({a: honest(a) for a in ("a", "b", "c")})
    rows = coordinator(fleet, tmp_path, rounds=4).run()
    assert [row.participants for row in rows[:-1]] == [["a"], ["b"], ["c"], ["a"]]
    assert rows[-1].final and rows[-1].evaluated == 3  # the final evaluation stays a synchronous round
