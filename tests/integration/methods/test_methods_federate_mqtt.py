"""Every built-in method trains in a real federation over Mosquitto.

Each method runs from its shipped ``configs/<method>.yaml``, shrunk to 2 rounds of 3
agents on tiny data (tests/unit/methods/test_methods_federate.py runs the same in
process); every agent is a separate ``edgepfl agent`` process talking to a real
Mosquitto. The run must produce a finite accuracy in every round, and every agent must
have trained in every round.

A fresh agent process spends 15-25 s of a loaded 2-core box importing torch before it
announces itself; the suite's trainer agents fork from one interpreter that did that once
(tests/warm_cli.py), so a method's run costs its rounds, a few seconds.
"""

from __future__ import annotations

import pytest

from edgepfl.coordinator.simulate import simulate
from edgepfl.methods import METHODS

from tests.unit.methods.test_methods_federate import AGENTS, check_rows, tiny_config

MQTT_METHODS = METHODS


@pytest.mark.parametrize("method", MQTT_METHODS)
def test_method_federates_over_mosquitto(method, mosquitto, tmp_path):
    rows, summary = simulate(tiny_config(method), AGENTS, tmp_path / "run", broker=mosquitto.url, progress=False)
    check_rows(rows, summary)
    assert rows[-2].bytes_up > 0 and rows[-2].bytes_down > 0  # the round really crossed the broker
    for i in range(AGENTS):  # each agent saved its personal state on its own side
        assert list((tmp_path / "run" / "agents" / f"agent-{i:02d}").glob("personal-*.safetensors"))
