"""A device that inflates its counts writes no more of the model, and no more of the
federation's accuracy, than one honest device (a red team's finding, docs/SECURITY.md).

Three honest agent processes and Mallory: a plain paho client built from PROTOCOL.md's
reference codec, on the default (unsigned) deployment, which announces 2^24 training
samples, answers its task with the round's parameters moved along a direction of its own
choosing, ``D``, claiming all 2^24 of them, and answers every evaluation with
``num_test = eval_correct = 2^53``. After the round, the share of ``D`` in the global
model's change is Mallory's effective weight: the red team's attack made it ~1 (the
model is Mallory's); with the default ``max_weight_ratio`` of 1 it is 1 / (3 + 1), and
with a cap of 2, 2 / (3 + 2).
The same federation with ``max_weight_ratio: null`` shows the measurement can see it.
"""

from __future__ import annotations

import queue
import threading
import uuid

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgepfl.aggregation import DEFAULT_MAX_WEIGHT_RATIO, STATISTIC_LEAVES
from edgepfl.broker import parse_broker_url
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.state import load_checkpoint

from tests.fleet_helpers import read_rows, run_config, run_in_thread
from tests.integration.security.test_hostile_fleet import agent_log

HONEST = ("agent-00", "agent-01", "agent-02")
MALLORY = "mallory"
ANNOUNCED = 2**24
CLAIMED_TEST = 2**53




def _learned(name: str, value: np.ndarray) -> bool:
    return value.dtype.kind == "f" and not name.endswith(STATISTIC_LEAVES)


class Mallory:
    """An enrolled-looking device that lies about its counts and pushes the model along ``D``."""

    def __init__(self, url: str, federation: str, ref: dict):
        self.ref, self.federation = ref, federation
        self.base = f"edgepfl/v1/{federation}/agents/{MALLORY}"
        self.reference: dict[str, np.ndarray] | None = None  # round 0's global parameters
        self.direction: dict[str, np.ndarray] = {}
        self.inbox: queue.Queue[bytes] = queue.Queue()
        host, port, _ = parse_broker_url(url)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.on_message = lambda c, u, msg: self.inbox.put(bytes(msg.payload))
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(f"{self.base}/task", qos=1)
        status = ref["encode_frame"]("status", federation, MALLORY, -1,
                                     {"state": "online", "num_train": ANNOUNCED, "num_test": 10})
        self.client.publish(f"{self.base}/status", status, qos=1, retain=True).wait_for_publish(10)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._answer_tasks, daemon=True)
        self.thread.start()

    def _answer_tasks(self) -> None:
        rng = np.random.default_rng(0)
        while not self._stop.is_set():
            try:
                header, tensors = self.ref["decode_frame"](self.inbox.get(timeout=0.2))
            except queue.Empty:
                continue
            task = header["meta"]
            meta = {"task_id": task["task_id"], "kind": task["kind"], "num_train": ANNOUNCED,
                    "num_test": CLAIMED_TEST, "eval_correct": CLAIMED_TEST}
            upload = {}
            if task["kind"] == "train":
                if self.reference is None:
                    self.reference = tensors
                    learned = {k: v for k, v in tensors.items() if _learned(k, v)}
                    scale = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in learned.values()))
                    noise = {k: rng.standard_normal(v.shape) for k, v in learned.items()}
                    norm = np.sqrt(sum(float(np.sum(n ** 2)) for n in noise.values()))
                    # half the reference's norm: far inside the update bound (10x), so only weight decides
                    self.direction = {k: n * (0.5 * scale / norm) for k, n in noise.items()}
                upload = {k: (v + self.direction[k]).astype(v.dtype) if k in self.direction else v
                          for k, v in tensors.items()}
            frame = self.ref["encode_frame"]("update", self.federation, MALLORY, header["round"], meta, upload)
            self.client.publish(f"{self.base}/update", frame, qos=1)

    def share_of_direction(self, after: dict[str, np.ndarray]) -> float:
        """How much of ``D`` the global model took: <after - reference, D> / |D|^2."""
        assert self.reference is not None
        dot = sum(float(np.sum((after[k].astype(np.float64) - self.reference[k]) * d)) for k, d in self.direction.items())
        return dot / sum(float(np.sum(d ** 2)) for d in self.direction.values())

    def close(self) -> None:
        self._stop.set()
        self.client.publish(f"{self.base}/status", b"", qos=1, retain=True).wait_for_publish(10)
        self.client.loop_stop()
        self.client.disconnect()


@pytest.mark.parametrize("max_weight_ratio", [DEFAULT_MAX_WEIGHT_RATIO, 2.0, None],
                         ids=["default-cap", "cap-2", "no-cap"])
def test_a_device_announcing_2_to_the_24_samples_writes_no_more_than_the_cap_in_honest_devices(
        mosquitto, tmp_path, ref, max_weight_ratio):
    config = run_config(rounds=1, round_timeout_s=120, aggregation={"max_weight_ratio": max_weight_ratio})
    config = prepare(config, len(HONEST))
    config = config.model_copy(update={"min_agents": len(HONEST) + 1})  # Mallory is sampled from round 0
    out = tmp_path / "run"
    procs = [spawn_agent(config, out, mosquitto.url, agent, i) for i, agent in enumerate(HONEST)]
    mallory = Mallory(mosquitto.url, config.federation, ref)
    fleet = MqttFleet(config.federation, config.broker, url=mosquitto.url)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        thread, box = run_in_thread(coordinator.run)
        thread.join(timeout=600)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        rows = read_rows(out)
        assert set(rows[0].participants) == {*HONEST, MALLORY}  # nobody refused, honest or not

        loaded = load_checkpoint(coordinator.run_dir.checkpoint_dir)
        assert loaded is not None
        share = mallory.share_of_direction(loaded[0].global_tensors)
        final = rows[-1]
        honest_acc = [final.per_client[a] for a in HONEST]
        if max_weight_ratio is None:  # what the red team measured: the model is Mallory's
            assert share > 0.99, share
            assert final.accuracy > 0.999, final.accuracy
        else:
            # every agent announced the same count but Mallory: the cap is max_weight_ratio honest devices
            cap = max_weight_ratio
            assert share == pytest.approx(cap / (len(HONEST) + cap), abs=0.03), share
            assert final.accuracy == pytest.approx((sum(honest_acc) + cap * 1.0) / (len(HONEST) + cap), abs=1e-9)
    finally:
        mallory.close()
        fleet.close()
        stop_agents(procs)
        for agent in HONEST:
            print(agent_log(out, agent)[-500:])
