"""What the kit plays with: the coordinator's side of the wire, the agent process, its inputs.

* :class:`Wire` — an MQTT client with the coordinator's client id and last will, subscribed
  to every agent channel of one federation. It records each MQTT message the agents
  publish (size, QoS, retain flag) and decodes it as the coordinator would (chunks
  reassembled, :func:`edgepfl.protocol.decode`), keeping the parts of a chunked frame.
* :class:`AgentProcess` — the agent under test, started from the ``--agent-cmd`` template.
* :func:`write_inputs` — its data set (an ``npz`` file edgepfl's ``data.dataset: npz``
  reads) and, for edgepfl's own agent, a config.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.broker import parse_broker_url
from edgepfl.protocol import (
    AgentChannel,
    ChunkMeta,
    Message,
    MessageType,
    ProtocolError,
    Reassembler,
    agent_wildcard,
    decode,
    split_frame,
)
from edgepfl.protocol.envelope import peek_header

#: the placeholders an ``--agent-cmd`` template may use (docs/CONFORMANCE.md)
PLACEHOLDERS = ("python", "broker", "host", "port", "federation", "agent_id", "data", "workdir", "config",
                "state_dir", "signing_key", "coordinator_key", "tier", "head")


@dataclass
class Seen:
    """One MQTT message as the broker delivered it to the kit."""

    topic: str
    payload: bytes
    retain: bool
    qos: int
    at: float


@dataclass
class Frame:
    """One whole frame an agent published: its MQTT parts (one, or its §8 chunks) and the decoding."""

    topic: str
    agent: str
    channel: str
    data: bytes
    parts: list[Seen]
    at: float
    message: Message | None = None
    #: ``reason: detail`` when the frame (or one of its chunks) failed the receiver's checks
    error: str | None = None

    @property
    def chunked(self) -> bool:
        return len(self.parts) > 1 or (self.message is not None and self.message.type == MessageType.CHUNK)


class Wire:
    """The coordinator's MQTT client for one federation, recording what the agents publish.

    What :meth:`retain` published is published again after every reconnection, as a
    coordinator does with its presence: a restarted broker without persistence forgot it.
    """

    def __init__(self, url: str, federation: str, *, will: bytes):
        self.url = url
        self.federation = federation
        self.host, self.port, _ = parse_broker_url(url)
        self.will = will
        #: topic -> frame the kit keeps retained (its presence): published again on every reconnect
        self.retained: dict[str, bytes] = {}
        self.seen: list[Seen] = []
        self.frames: list[Frame] = []
        self._parts: dict[str, list[Seen]] = {}
        self._reassembler = Reassembler()
        self._cond = threading.Condition()
        self._client: Any = None
        self.connected = threading.Event()

    def start(self, timeout: float = 10.0) -> Wire:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-{self.federation}-coordinator",
                             protocol=mqtt.MQTTv311, clean_session=True)
        client.will_set(f"edgepfl/v1/{self.federation}/coordinator", self.will, qos=1, retain=True)
        client.reconnect_delay_set(1, 2)
        client.on_connect = self._on_connect
        client.on_disconnect = lambda *a, **k: self.connected.clear()
        client.on_message = self._on_message
        client.connect(self.host, self.port, keepalive=30)
        client.loop_start()
        self._client = client
        if not self.connected.wait(timeout):
            raise ConnectionError(f"the kit could not connect to its broker {self.url}")
        return self

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        if reason_code.is_failure:
            return
        for channel in (AgentChannel.STATUS, AgentChannel.UPDATE, AgentChannel.METRICS):
            client.subscribe(agent_wildcard(self.federation, channel), qos=1)
        for topic, frame in self.retained.items():
            client.publish(topic, frame, qos=1, retain=True)  # no waiting on paho's own thread
        self.connected.set()

    def _on_message(self, client, userdata, msg) -> None:
        seen = Seen(msg.topic, bytes(msg.payload), bool(msg.retain), int(msg.qos), time.monotonic())
        with self._cond:
            self.seen.append(seen)
            frame = self._frame(seen)
            if frame is not None:
                self.frames.append(frame)
            self._cond.notify_all()

    def _frame(self, seen: Seen) -> Frame | None:
        parts = seen.topic.split("/")
        agent, channel = (parts[4], parts[5]) if len(parts) == 6 else ("", "")
        if not seen.payload:
            return None  # a cleared retained message is no frame
        header = peek_header(seen.payload)
        if header is None or header.get("type") != MessageType.CHUNK.value:
            frame = Frame(seen.topic, agent, channel, seen.payload, [seen], seen.at)
        else:
            try:
                chunk = decode(seen.payload)
                parent = chunk.meta_as(ChunkMeta).parent_id
                self._parts.setdefault(parent, []).append(seen)
                whole = self._reassembler.add(seen.topic, chunk)
            except ProtocolError as exc:
                return Frame(seen.topic, agent, channel, seen.payload, [seen], seen.at, error=str(exc))
            if whole is None:
                return None
            frame = Frame(seen.topic, agent, channel, whole, self._parts.pop(parent), seen.at)
        try:
            frame.message = decode(frame.data)
        except ProtocolError as exc:
            frame.error = str(exc)
        return frame

    # ------------------------------------------------------------------ sending
    def publish(self, topic: str, frame: bytes, *, retain: bool = False, chunk_to: int | None = None) -> None:
        """Publish ``frame`` with QoS 1, split into §8 chunks of at most ``chunk_to`` bytes when given."""
        parts = [frame] if chunk_to is None else split_frame(frame, chunk_to, federation=self.federation,
                                                              sender="coordinator", round=_round_of(frame))
        for part in parts:
            info = self._client.publish(topic, part, qos=1, retain=retain)
            if self.connected.is_set():
                info.wait_for_publish(timeout=10)

    def retain(self, topic: str, frame: bytes, *, now: bool = True) -> None:
        """Publish ``frame`` retained on ``topic`` now (unless ``now`` is false: only once the
        broker is back) and after every reconnection."""
        self.retained[topic] = frame
        if now:
            self.publish(topic, frame, retain=True)

    # ------------------------------------------------------------------ waiting
    def mark(self) -> int:
        """A cursor: frames recorded so far (pass it to :meth:`wait` as ``since``)."""
        with self._cond:
            return len(self.frames)

    def wait(self, predicate: Callable[[Frame], bool], timeout: float, since: int = 0) -> Frame | None:
        """The first frame from ``since`` on that satisfies ``predicate``, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for frame in self.frames[since:]:
                    if predicate(frame):
                        return frame
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))

    def since(self, start: int) -> list[Frame]:
        with self._cond:
            return list(self.frames[start:])

    def seen_after(self, at: float) -> list[Seen]:
        with self._cond:
            return [s for s in self.seen if s.at >= at]


def _round_of(frame: bytes) -> int:
    header = peek_header(frame) or {}
    value = header.get("round", -1)
    return value if isinstance(value, int) else -1


def read_retained(url: str, topic: str, timeout: float = 3.0) -> bytes | None:
    """The message retained on ``topic`` as a fresh subscriber receives it, or None."""
    import paho.mqtt.client as mqtt

    host, port, _ = parse_broker_url(url)
    got: list[bytes] = []
    done = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-conformance-{uuid.uuid4().hex[:12]}")

    def on_message(c, userdata, msg):
        if msg.retain:
            got.append(bytes(msg.payload))
            done.set()

    client.on_connect = lambda c, *a: c.subscribe(topic, qos=1)
    client.on_message = on_message
    client.connect(host, port, keepalive=30)
    client.loop_start()
    try:
        done.wait(timeout)
    finally:
        client.disconnect()
        client.loop_stop()
    return got[0] if got else None


# --------------------------------------------------------------------------- the agent process


@dataclass
class AgentProcess:
    """The agent under test: the ``--agent-cmd`` template filled with ``values``, run without a shell.

    It runs in its own process group (a wrapper script's children stop with it); its
    output goes to ``workdir/agent.log``.
    """

    template: str
    values: dict[str, str]
    workdir: Path
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> None:
        try:
            argv = shlex.split(self.template.format_map(self.values))
        except KeyError as exc:
            raise ValueError(f"--agent-cmd names an unknown placeholder {exc}; known: "
                             f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def log_path(self) -> Path:
        return self.workdir / "agent.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the agent's process group (the command and anything it started)."""
        if self.running:
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (idempotent)."""
        self.signal(signal.SIGTERM)
        if self.wait(grace) is None:
            self.signal(signal.SIGKILL)
            self.wait(5)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# --------------------------------------------------------------------------- inputs

#: the data set's shape: small enough for a loaded CI box, large enough to learn something
INPUT_SHAPE = (1, 8, 8)
CLASS_NAMES = ("ring", "bar", "cross", "dot")
SAMPLES_PER_CLASS = 24
TEST_FRACTION = 0.25
#: the head kind a head agent under test fits (every method's releases offer it)
HEAD_KIND = "lr"


def write_dataset(path: Path, seed: int = 0) -> dict[str, list[float]]:
    """Write the agent's data set (``x`` uint8 N×1×8×8, ``y``, ``class_names``, ``mean``,
    ``std``): a class-specific pattern plus noise. Returns its normalization."""
    rng = np.random.default_rng(seed)
    c, h, w = INPUT_SHAPE
    patterns = rng.integers(0, 256, size=(len(CLASS_NAMES), c, h, w))
    x = np.concatenate([np.clip(p + rng.normal(0, 40, size=(SAMPLES_PER_CLASS, c, h, w)), 0, 255)
                        for p in patterns]).astype(np.uint8)
    y = np.repeat(np.arange(len(CLASS_NAMES), dtype=np.int64), SAMPLES_PER_CLASS)
    scaled = x.astype(np.float64) / 255
    norm = {"mean": [float(scaled[:, i].mean()) for i in range(c)],
            "std": [float(scaled[:, i].std()) for i in range(c)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=x, y=y, class_names=np.array(CLASS_NAMES), mean=np.array(norm["mean"]),
             std=np.array(norm["std"]))
    return norm


def agent_config(values: dict[str, str], *, max_message_bytes: int, signed: bool) -> dict[str, Any]:
    """The config edgepfl's own agent runs with (``{config}``): the kit's broker, data and keys."""
    config: dict[str, Any] = {
        "agent_id": values["agent_id"],
        "federation": values["federation"],
        "tier": values["tier"],
        "broker": {"url": values["broker"], "max_message_bytes": max_message_bytes, "keepalive_s": 10},
        "data": {"dataset": "npz", "root": values["data"], "num_clients": 1, "test_fraction": TEST_FRACTION},
        "state_dir": values["state_dir"],
        "device": "cpu",
        "threads": 1,
    }
    if values["tier"] == "head":
        config["head"] = values["head"]
    if signed:
        config["security"] = {"signing_key": values["signing_key"], "coordinator_key": values["coordinator_key"]}
    return config
