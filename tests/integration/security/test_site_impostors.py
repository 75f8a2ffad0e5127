"""Attacks on a federation of sites (docs/PROTOCOL.md §20, docs/SECURITY.md "Sites"), live:
two honest site aggregators with three agent processes each, a signed central coordinator
with an enrolled dir, and an attacker, a plain MQTT client that has read the protocol:

* with one enrolled **device's** key (``agent-99``) it announces itself as a site that
  speaks for five devices it invented: refused (``not_a_site``), nothing of it is sampled;
* with a compromised **site's** key (``site-c``, one of ``sites.ids``) it lists site-a's
  ``agent-00`` beside two invented devices, and answers its task with a partial sum whose
  devices weigh a million samples each: ``agent-00``, listed by two sites, is behind neither
  (denied while the claim stands, never taken over), and the answer is rejected
  (``malformed``, above the announced counts and the cap) before any of it counts.

The other five honest devices train every round, and no invented device gets a weight.
"""

from __future__ import annotations

import queue
import uuid

import numpy as np
import paho.mqtt.client as mqtt

from edgepfl.aggregation import AggregationSpec
from edgepfl.broker import parse_broker_url
from edgepfl.coordinator.result import Evaluation
from edgepfl.coordinator.simulate import prepare
from edgepfl.coordinator.sites import answer_of, site_aggregate
from edgepfl.methods import ClientUpdate, ServerState, create_method
from edgepfl.protocol import MessageType, StatusMeta, TaskMeta, UpdateMeta, decode, encode
from edgepfl.protocol.signing import load_signer
from edgepfl.protocol.site import SiteDevice, SiteStatus
from edgepfl.state import load_checkpoint

from tests.fleet_helpers import run_config, run_in_thread, wait_until
from tests.integration.rounds.test_sites_live import SITES, central_run, keys_for, sites_running

HONEST = sorted(sum(SITES.values(), []))


class Impostor:
    """A plain client holding one enrolled key: it publishes a signed site status, and answers
    the tasks that come to it with a partial sum of made-up updates weighing ``weight`` each."""

    def __init__(self, url: str, federation: str, agent_id: str, key, devices: list[str], weight: int):
        self.federation, self.agent_id, self.signer, self.weight = federation, agent_id, load_signer(key), weight
        self.base = f"edgepfl/v1/{federation}/agents/{agent_id}"
        self.tasks: queue.Queue[bytes] = queue.Queue()
        host, port, _ = parse_broker_url(url)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"impostor-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.on_message = lambda c, u, msg: self.tasks.put(bytes(msg.payload))
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(f"{self.base}/task", qos=1)
        status = StatusMeta(state="online", tier="site", num_train=200 * len(devices), num_test=50 * len(devices),
                            site=SiteStatus(devices=[SiteDevice(agent=d, num_train=200, num_test=50) for d in devices]))
        frame = encode(MessageType.STATUS, federation=federation, sender=agent_id, round=-1, meta=status,
                       signer=self.signer)
        self.client.publish(f"{self.base}/status", frame, qos=1, retain=True).wait_for_publish(10)
        self.answered = 0

    def answer_tasks(self) -> None:
        """Answer every task received so far (a chunked one is reassembled by nobody: the tasks
        of this test's small model fit one message)."""
        while True:
            try:
                message = decode(self.tasks.get(timeout=0.1))
            except queue.Empty:
                return
            if message.type != MessageType.TASK:  # the NACKs that tell it its answer was rejected
                continue
            meta = message.meta_as(TaskMeta)
            if meta.site is None or not meta.site.train:
                continue
            method = create_method(meta.run.method.name)
            state = ServerState(global_tensors=dict(message.tensors))
            aggregate = site_aggregate(method, state, AggregationSpec.model_validate(meta.site.aggregation).build(),
                                       meta.site)
            rng = np.random.default_rng(0)
            for device in meta.site.train:
                moved = {k: (v + rng.normal(0, 0.05, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                         for k, v in state.shared_params().items()}
                aggregate.add(ClientUpdate(device, self.weight, moved))
            answer, tensors = answer_of(aggregate.site_part(), {d: Evaluation(50, 50, 0.1, 0.1, "train", 1.0)
                                                                for d in meta.site.train})
            reply = UpdateMeta(task_id=meta.task_id, kind="train", num_train=answer.total_weight, num_test=0,
                               eval_correct=0, site=answer)
            frame = encode(MessageType.UPDATE, federation=self.federation, sender=self.agent_id,
                           round=message.header.round, meta=reply, tensors=tensors, signer=self.signer)
            self.client.publish(f"{self.base}/update", frame, qos=1).wait_for_publish(10)
            self.answered += 1

    def close(self) -> None:
        self.client.publish(f"{self.base}/status", b"", qos=1, retain=True).wait_for_publish(10)
        self.client.loop_stop()
        self.client.disconnect()


def test_one_devices_key_makes_no_site_and_a_compromised_site_takes_no_device_and_no_weight(mosquitto,
                                                                                              tmp_path):
    config = prepare(run_config(model={"arch": "mlp", "feature_dim": 16}, rounds=2, seed=4, round_timeout_s=20), 6)
    # round 0 waits for every trainer the central coordinator will count: the five uncontested
    # honest devices and site-c's two ghosts (its claim on agent-00 takes that one out)
    config = config.model_copy(update={"min_agents": 7})
    keys = keys_for(tmp_path, [*SITES, "site-c", "agent-99"])
    out = tmp_path / "tree"
    url = mosquitto.url
    with sites_running(config, url, out, keys=keys):
        device = Impostor(url, config.federation, "agent-99", keys / "agent-99.key",
                          [f"invented-{i}" for i in range(5)], weight=200)
        site_c = Impostor(url, config.federation, "site-c", keys / "site-c.key", ["agent-00", "ghost-1", "ghost-2"],
                          weight=1_000_000)
        try:
            thread, box = run_in_thread(lambda: central_run(config, url, out / "run", keys,
                                                            ids=[*SITES, "site-c"]))
            wait_until(lambda: (site_c.answer_tasks(), not thread.is_alive())[1], timeout=600,
                       what="the central run's end")
            assert "error" not in box, box.get("error")
        finally:
            device.close()
            site_c.close()
    rows = box["result"]
    assert site_c.answered >= 1  # it was sampled (its ghosts are trainers) and it answered
    for row in rows[:-1]:
        # the other five train every round; the ghosts' weighty answer counted for nothing, the
        # contested device was sampled by no one, and a device's key invented no trainer
        assert row.participants == HONEST[1:] and not row.aborted
        assert {"ghost-1", "ghost-2"} <= set(row.sampled) and "agent-00" not in row.sampled
        assert not any("invented" in a for a in row.sampled)
        assert row.rejected.get("malformed", 0) >= 1
    assert set(rows[-1].per_client) == set(HONEST[1:])
    _, meta = load_checkpoint(out / "run" / "checkpoint")
    assert meta.rejected_total.get("not_a_site", 0) >= 1
