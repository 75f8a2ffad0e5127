"""End-to-end federations: real Mosquitto, real agent processes, real FMNIST.

These are the proofs for the foundation issue: learning over MQTT, personal
parameters never crossing the broker, MQTT == in-process for the same seed.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.atomic import read_tensors
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.protocol import decode

from tests.fleet_helpers import checkpoint_tensors, run_config


def test_fedper_over_mosquitto_learns_and_personal_heads_never_cross_the_broker(mosquitto, broker_capture, tmp_path):
    config = run_config(method={"name": "fedper"}, rounds=3)
    rows, summary = simulate(config, 4, tmp_path / "run", broker=mosquitto.url, progress=False)

    accuracies = [r.accuracy for r in rows]
    assert [r.round for r in rows] == [0, 1, 2, 3] and rows[-1].final
    assert all(len(r.participants) == 4 for r in rows[:-1])
    assert max(accuracies[1:]) > accuracies[0] + 0.2, accuracies  # round 0 is the untrained model
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 10_000
    assert summary["final_accuracy"] == accuracies[-1]

    updates = [decode(p) for t, p in broker_capture.snapshot() if t.endswith("/update")]
    assert len(updates) == 4 * 3 + 4  # 3 training rounds + the final evaluation
    uploaded_names = {name for u in updates for name in u.tensors}
    assert uploaded_names and all(name.startswith("encoder.") for name in uploaded_names)

    # The strongest form: the bytes of every agent's personal head appear nowhere on the wire.
    wire = b"".join(p for _, p in broker_capture.snapshot())
    for agent in ("agent-00", "agent-01", "agent-02", "agent-03"):
        personal = read_tensors(next((tmp_path / "run" / "agents" / agent).glob("personal-*.safetensors")))
        head = personal["head.weight"]
        assert head.size > 0 and np.abs(head).sum() > 0
        assert head.tobytes() not in wire
        assert head[0].tobytes() not in wire  # not even one row


def test_mqtt_run_equals_in_process_run_for_the_same_seed(mosquitto, tmp_path):
    config = run_config(method={"name": "fedavg"}, rounds=2, seed=7)
    # one thread everywhere, so that agents' training is the same arithmetic in both runs
    mqtt_rows, _ = simulate(config, 4, tmp_path / "mqtt", broker=mosquitto.url, progress=False, threads=1)
    local_rows, _ = simulate(config, 4, tmp_path / "local", in_process=local_trainers, progress=False, threads=1)

    assert [r.round for r in mqtt_rows] == [r.round for r in local_rows]
    for a, b in zip(mqtt_rows, local_rows):
        assert a.accuracy == pytest.approx(b.accuracy, abs=1e-9)
        assert a.per_client == pytest.approx(b.per_client, abs=1e-9)
        # same frames; only the JSON header's timestamp digits may differ by a few bytes
        assert a.bytes_up == pytest.approx(b.bytes_up, abs=64 * 8)
        assert a.bytes_down == pytest.approx(b.bytes_down, abs=64 * 8)
    g_mqtt = checkpoint_tensors(tmp_path / "mqtt" / "checkpoint")
    g_local = checkpoint_tensors(tmp_path / "local" / "checkpoint")
    assert g_mqtt.keys() == g_local.keys()
    for key in g_mqtt:
        # bit for bit: updates arrive over MQTT in any order, and the exact fixed-point
        # mean (edgepfl.aggregation) folds them in as they come to the same sums
        assert g_mqtt[key].tobytes() == g_local[key].tobytes(), key
