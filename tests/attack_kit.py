"""What the hostile-fleet tests attack with: a bare MQTT client and a signed fleet's keys.

The attacker knows only docs/PROTOCOL.md (its frames come from the ``ref`` fixture's
reference codec, or are replays of what it recorded off the wire) and holds no key.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterable
from pathlib import Path

import paho.mqtt.client as mqtt

from edgepfl.broker import parse_broker_url
from edgepfl.config import SecuritySpec
from edgepfl.protocol.signing import generate_keypair


class Attacker:
    """A bare paho client: records what it sees, publishes what it likes."""

    def __init__(self, url: str, federation: str):
        host, port, _ = parse_broker_url(url)
        self.base = f"edgepfl/v1/{federation}"
        self.seen: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.log: list[tuple[str, bytes]] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.on_message = lambda c, u, msg: self.seen.put((msg.topic, bytes(msg.payload)))
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(f"{self.base}/#", qos=1)

    def publish(self, suffix: str, frame: bytes, retain: bool = False) -> None:
        self.client.publish(f"{self.base}/{suffix}", frame, qos=1, retain=retain).wait_for_publish(10)

    def drain(self) -> list[tuple[str, bytes]]:
        while True:
            try:
                self.log.append(self.seen.get_nowait())
            except queue.Empty:
                return self.log

    def frames(self, suffix: str) -> list[bytes]:
        return [p for t, p in self.drain() if t == f"{self.base}/{suffix}" and p]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def signed_fleet(root: Path, agents: Iterable[str]) -> tuple[SecuritySpec, dict[str, SecuritySpec]]:
    """Keys for a signed, enrolled fleet under ``root``: the coordinator's security settings
    (its signing key, the enrolled dir of every agent's public key) and each agent's."""
    (root / "enrolled").mkdir(parents=True)
    generate_keypair(root / "coordinator.key", root / "coordinator.pub")
    settings = {}
    for agent in agents:
        generate_keypair(root / f"{agent}.key", root / "enrolled" / f"{agent}.pub")
        settings[agent] = SecuritySpec(signing_key=str(root / f"{agent}.key"),
                                       coordinator_key=str(root / "coordinator.pub"))
    coordinator = SecuritySpec(signing_key=str(root / "coordinator.key"), enrolled_dir=str(root / "enrolled"))
    return coordinator, settings
