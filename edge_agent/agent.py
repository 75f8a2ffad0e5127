"""The agent loop, written once for both tiers.

Connects to the broker (backoff, resubscribe on reconnect), announces itself with a
retained status (tier, device, sample counts, version) and a last will, then
serves messages from its own task topic and the federation's release topic on the
main thread while paho's network thread only queues bytes:

* trainer tier: task -> :class:`edgepfl.edge_agent.trainer.TrainerRuntime` -> update;
* head tier: release -> :class:`edgepfl.edge_agent.head_tier.HeadRuntime` -> metrics.

Handlers are idempotent on task id: a re-delivered task is answered with the
cached update instead of training twice.
"""

from __future__ import annotations

import logging
import platform
import signal
import threading
from collections import OrderedDict

from edgepfl import __version__
from edgepfl.config import AgentConfig
from edgepfl.protocol import (
    AgentChannel,
    FederationChannel,
    Message,
    MessageType,
    MetricsMeta,
    ProtocolError,
    StatusMeta,
    agent_topic,
    decode,
    encode,
    federation_topic,
)
from edgepfl.protocol.transport import MqttTransport

log = logging.getLogger("edgepfl.agent")


class Agent:
    """One edge agent process. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self._stop = threading.Event()
        self._answered: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self.runtime = None
        self.transport: MqttTransport | None = None
        self.data = None

    # ---------------------------------------------------------------- frames
    def _status_frame(self, state: str) -> bytes:
        c = self.config
        meta = StatusMeta(
            state=state,
            tier=c.tier,
            device=self._device_name(),
            num_train=self.data.num_train if self.data is not None else 0,
            num_test=self.data.num_test if self.data is not None else 0,
            software=f"edgepfl {__version__}",
            platform=f"{platform.system()} {platform.machine()} py{platform.python_version()}",
        )
        return encode(MessageType.STATUS, federation=c.federation, sender=c.agent_id, round=-1, meta=meta)

    def _device_name(self) -> str:
        if self.config.tier == "head":
            return "cpu-onnxruntime"
        device = getattr(self.runtime, "device", None)
        return str(device) if device is not None else self.config.device

    def _topic(self, channel: AgentChannel) -> str:
        return agent_topic(self.config.federation, self.config.agent_id, channel)

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Load local data and build the tier's runtime (before connecting)."""
        from edgepfl.data import load_client_data

        c = self.config
        self.data = load_client_data(c.data, c.client_index)
        if c.tier == "trainer":
            from .trainer import TrainerRuntime  # torch only on this path

            self.runtime = TrainerRuntime(c.agent_id, self.data, c.state_dir, c.device, threads=c.threads)
        else:
            from .head_tier import HeadRuntime

            self.runtime = HeadRuntime(c.state_dir, c.head, self.data, threads=c.threads)
            try:
                self.runtime.load()
            except Exception as exc:  # nothing saved yet, or unusable: wait for a release
                log.info("no usable saved head yet (%s)", exc)

    def run(self) -> None:
        if self.runtime is None:
            self.setup()
        c = self.config
        status_topic = self._topic(AgentChannel.STATUS)
        subscriptions = [self._topic(AgentChannel.TASK)]
        if c.tier == "head":
            subscriptions.append(federation_topic(c.federation, FederationChannel.RELEASE))
        self.transport = MqttTransport(
            c.broker.url,
            client_id=f"edgepfl-{c.federation}-{c.agent_id}",
            federation=c.federation,
            sender=c.agent_id,
            subscriptions=subscriptions,
            username=c.broker.username,
            password=c.broker.password,
            will=(status_topic, self._status_frame("offline")),
            birth=lambda: (status_topic, self._status_frame("online"), True),
            max_message_bytes=c.broker.max_message_bytes,
            max_payload_bytes=c.broker.max_payload_bytes,
            keepalive_s=c.broker.keepalive_s,
        )
        self.transport.start(timeout=120)
        log.info("agent %s (%s tier) online: %d train / %d test samples", c.agent_id, c.tier,
                 self.data.num_train, self.data.num_test)
        try:
            while not self._stop.is_set():
                inbound = self.transport.receive(timeout=0.5)
                if inbound is None:
                    continue
                try:
                    message = decode(inbound.frame, max_bytes=self.transport.max_payload_bytes)
                except ProtocolError as exc:
                    log.warning("dropped message on %s: %s", inbound.topic, exc)
                    continue
                self._dispatch(message)
        finally:
            self.transport.stop(final=(status_topic, self._status_frame("offline")))

    def stop(self, *_args) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- handlers
    def _dispatch(self, message: Message) -> None:
        if message.header.federation != self.config.federation:
            log.warning("ignored %s for federation %s", message.type.value, message.header.federation)
        elif message.type == MessageType.TASK and self.config.tier == "trainer":
            self._on_task(message)
        elif message.type == MessageType.RELEASE and self.config.tier == "head":
            self._on_release(message)
        else:
            log.warning("ignored unexpected %s message from %s", message.type.value, message.header.sender)

    def _on_task(self, task: Message) -> None:
        task_id = task.meta.task_id
        cached = self._answered.get(task_id)
        if cached is not None:  # QoS 1 may deliver twice: answer again, don't retrain
            self.transport.publish(self._topic(AgentChannel.UPDATE), cached[0], round=cached[1])
            return
        try:
            frame = self.runtime.answer(task)
        except Exception:
            log.exception("task %s (round %d) failed", task_id, task.header.round)
            return
        self.transport.publish(self._topic(AgentChannel.UPDATE), frame, round=task.header.round)
        self._answered[task_id] = (frame, task.header.round)
        while len(self._answered) > 4:
            self._answered.popitem(last=False)
        log.info("round %d: %s task answered", task.header.round, task.meta.kind)

    def _on_release(self, release: Message) -> None:
        meta = release.meta
        artifact = release.tensors.get("artifact")
        if artifact is None:
            log.error("release %s carries no artifact; refused", meta.release_id)
            return
        try:
            result = self.runtime.install_release(meta.manifest, artifact.tobytes(), meta.sha256)
        except Exception as exc:
            log.error("release %s refused: %s", meta.release_id, exc)
            return
        metrics = MetricsMeta(
            tier="head",
            release_id=meta.release_id,
            head=str(result.get("head", self.config.head)),
            num_train=int(result.get("num_train", 0)),
            num_test=int(result.get("num_test", 0)),
            eval_correct=int(result.get("eval_correct", round(result.get("accuracy", 0.0) * result.get("num_test", 0)))),
            values={k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        )
        frame = encode(MessageType.METRICS, federation=self.config.federation, sender=self.config.agent_id,
                       round=release.header.round, meta=metrics)
        self.transport.publish(self._topic(AgentChannel.METRICS), frame, round=release.header.round)


def run_agent(config: AgentConfig) -> None:
    """Run an agent until SIGINT / SIGTERM."""
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.setup()
    agent.run()
