"""A flood of chunk frames on one topic costs nobody else their update (live).

Real Mosquitto, real agent processes whose updates travel in chunks (``max_message_bytes``
at its minimum), the coordinator in this process. The attacker is a plain paho client
that knows docs/PROTOCOL.md and one device's topic: it floods that topic with tiny
chunk frames of huge messages that never complete, as fast as it can, for the whole run.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.logs import LINES_PER_WINDOW, WINDOW_S
from edgepfl.protocol import AgentChannel, ChunkMeta, MessageType, agent_topic, encode

from tests.fleet_helpers import RunningFleet, run_config


class ChunkFlood:
    """A paho client publishing tiny chunk frames on ``topic`` until stopped."""

    def __init__(self, url: str, federation: str, topic: str):
        host, port = url.removeprefix("mqtt://").rsplit(":", 1)
        self.topic = topic
        self.sent = 0
        self._stop = threading.Event()
        # distinct parent ids: every frame opens a new partial message on the receiver
        self.frames = [encode(MessageType.CHUNK, federation=federation, sender="intruder", round=0,
                              meta=ChunkMeta(parent_id=uuid.uuid4().hex, index=0, count=5000, total_bytes=10_000_000,
                                             total_sha256="0" * 64),
                              tensors={"data": np.zeros(8, np.uint8)}) for _ in range(2000)]
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:6]}")
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for frame in self.frames:
                if self._stop.is_set():
                    return
                self.client.publish(self.topic, frame, qos=0)
                self.sent += 1
                if self.sent % 25 == 0:
                    self._stop.wait(0.05)  # a few hundred a second: the coordinator of a loaded 2-core box keeps up

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.client.loop_stop()
        self.client.disconnect()


@pytest.mark.timeout(400)
def test_a_chunk_flood_on_one_topic_evicts_no_other_agents_update(mosquitto, tmp_path, caplog):
    config = run_config(rounds=3, round_timeout_s=60, broker={"max_message_bytes": 16_384},
                        model={"arch": "cnn", "feature_dim": 64})
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 2) as fleet:
        cfg = fleet.config
        flood = ChunkFlood(mosquitto.url, cfg.federation, agent_topic(cfg.federation, "intruder", AgentChannel.UPDATE))
        mfleet = MqttFleet(cfg.federation, cfg.broker, url=mosquitto.url)
        try:
            coord = Coordinator(cfg, mfleet, out, progress=False, **fleet.shape())
            coord.init_or_resume()
            shared = sum(v.nbytes for v in coord.state.shared_params().values())
            assert shared > 10 * 16_384  # every update travels in ten chunks or more
            with caplog.at_level(logging.WARNING):
                started = time.monotonic()
                rows = coord.run()
                windows = int((time.monotonic() - started) // WINDOW_S) + 1  # the log limiter's windows begun
        finally:
            flood.close()
            mfleet.close()

    assert flood.sent > 200
    training = [r for r in rows if not r.final]
    assert len(training) == 3
    for row in training:
        # both agents' chunked updates arrived and were aggregated, every round, without waiting out a timeout
        assert row.participants == ["agent-00", "agent-01"] and row.dropped == [] and not row.aborted
    evicted = sum(r.rejected.get("evicted", 0) for r in rows)
    assert evicted > 0  # the flood is counted, by reason, in metrics.jsonl
    assert coord.counters.rejected["evicted"] >= evicted
    assert "dropped message on edgepfl/v1/" in caplog.text and "/intruder/update: evicted" in caplog.text
    assert "/agent-00/update: evicted" not in caplog.text and "/agent-01/update: evicted" not in caplog.text
    # one WARNING per eviction was 8,281 lines in 37 s for the red team: now at most LINES_PER_WINDOW
    # per window begun (an upper bound that a slower run only raises), the rest counted, not logged
    lines = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("dropped message on")
             and ": evicted" in r.getMessage()]
    assert len(lines) <= LINES_PER_WINDOW * windows, f"{len(lines)} eviction lines for {evicted} evictions"
    if evicted > LINES_PER_WINDOW * windows:
        assert "more evicted warnings this minute are counted, not logged" in caplog.text
