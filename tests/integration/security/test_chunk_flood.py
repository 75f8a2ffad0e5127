"""Chunk frames of messages that never complete cost nobody their update (live).

Real Mosquitto, real agent processes whose updates travel in chunks (``max_message_bytes``
at its minimum), the coordinator in this process. The attacker is a plain paho client
that knows docs/PROTOCOL.md: it floods one topic with tiny chunk frames of huge messages,
as fast as it can, for the whole run; or it sends eight of them, 128 bytes of chunk data,
each declaring a message as large as the coordinator accepts, on eight strangers' topics.
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
    # "intruder" holds no task: its chunks reserve nothing, each is refused and counted in metrics.jsonl
    refused = sum(r.rejected.get("unexpected", 0) for r in rows)
    assert refused > 0 and all("evicted" not in r.rejected and "over_budget" not in r.rejected for r in rows)
    assert coord.counters.rejected["unexpected"] >= refused
    assert "dropped message on edgepfl/v1/" in caplog.text and "/intruder/update: unexpected" in caplog.text
    assert "/agent-00/update:" not in caplog.text and "/agent-01/update:" not in caplog.text
    # one WARNING per dropped chunk was 8,281 lines in 37 s for the red team: now at most LINES_PER_WINDOW
    # per window begun (an upper bound that a slower run only raises), the rest counted, not logged
    lines = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("dropped message on")
             and ": unexpected" in r.getMessage()]
    assert len(lines) <= LINES_PER_WINDOW * windows, f"{len(lines)} lines for {refused} refused chunks"
    if refused > LINES_PER_WINDOW * windows:
        assert "more unexpected warnings this minute are counted, not logged" in caplog.text


def huge_chunk(federation: str, sender: str, total_bytes: int) -> bytes:
    """The first chunk of a message of ``total_bytes`` that never comes: 16 bytes of data."""
    return encode(MessageType.CHUNK, federation=federation, sender=sender, round=0,
                  meta=ChunkMeta(parent_id=uuid.uuid4().hex, index=0, count=1_000_000, total_bytes=total_bytes,
                                 total_sha256="0" * 64),
                  tensors={"data": np.zeros(16, np.uint8)})


@pytest.mark.timeout(300)
def test_eight_tiny_chunks_on_strangers_topics_reserve_nothing_and_block_no_chunked_update(mosquitto, tmp_path):
    """128 bytes used to block every chunked upload for 300 s: eight chunk frames on unknown
    agents' topics, each declaring a message of max_payload_bytes (256 MiB), filled the 2 GiB
    that partial messages may reserve, and every agent's chunked update was then refused
    ``over_budget``. Only an agent holding a task reserves now, at most about two task frames."""
    config = run_config(rounds=2, round_timeout_s=60, broker={"max_message_bytes": 16_384},
                        model={"arch": "cnn", "feature_dim": 64})
    out = tmp_path / "run"
    host, port = mosquitto.url.removeprefix("mqtt://").rsplit(":", 1)
    with RunningFleet(config, out, mosquitto.url, 2) as fleet:
        cfg = fleet.config
        assert 8 * cfg.broker.max_payload_bytes >= cfg.broker.max_buffered_bytes  # the 128 bytes filled it
        attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"eight-{uuid.uuid4().hex[:6]}")
        attacker.connect(host, int(port))
        attacker.loop_start()
        mfleet = MqttFleet(cfg.federation, cfg.broker, url=mosquitto.url)
        try:
            coord = Coordinator(cfg, mfleet, out, progress=False, **fleet.shape())
            coord.init_or_resume()
            assert sum(v.nbytes for v in coord.state.shared_params().values()) > 10 * 16_384  # updates in chunks

            for i in range(8):  # 128 bytes of chunk data in all, sent once
                stranger = f"stranger-{i}"
                attacker.publish(agent_topic(cfg.federation, stranger, AgentChannel.UPDATE),
                                 huge_chunk(cfg.federation, stranger, cfg.broker.max_payload_bytes),
                                 qos=1).wait_for_publish(10)
            rows = coord.run()
        finally:
            attacker.loop_stop()
            attacker.disconnect()
            mfleet.close()
    training = [r for r in rows if not r.final]
    assert len(training) == 2
    for row in training:
        assert row.participants == ["agent-00", "agent-01"] and row.dropped == [] and not row.aborted
    assert all("over_budget" not in r.rejected for r in rows), [r.rejected for r in rows]
    assert coord.counters.rejected["unexpected"] == 8  # each chunk refused and counted
    assert mfleet.transport.reassembler.reserved_bytes == 0  # the strangers' hold nothing
