"""Virtual trainer agents that speak the real protocol, thousands per process.

    python benchmarks/loadgen.py --broker mqtt://127.0.0.1:1883 --federation F --agents 1000 \
        --processes 4 --local-work-s 0.1

Each virtual agent is its own MQTT connection (one paho client, clean session,
keepalive, a retained ``online`` status as birth message and an ``offline`` status as
last will) and answers the tasks it gets through edgepfl's own codec
(:mod:`edgepfl.protocol`): a task (reassembled from chunks if it came in several) is
decoded and validated in full, the agent "works" for ``--local-work-s`` (a timer, no
CPU), then publishes an ``update``: for a ``train`` task the task's shared tensors
(``server/`` extras left out), perturbed; for an ``evaluate`` task the meta alone. The
update's size therefore follows the run's model (``model.arch`` / ``feature_dim`` of
the coordinator's config); FedAvg's updates are exactly its shared tensors.

There is no thread per client: each worker process drives all its clients from one
``selectors`` loop through paho's external-loop API (``loop_read`` / ``loop_write`` /
``loop_misc`` and the socket-open/close/register-write callbacks). The perturbed body
of an update is encoded once per task body and process (every agent of a process sends
the same tensors under its own header), so the generator's CPU goes to the protocol,
not to numpy, and the coordinator still decodes, checks and aggregates every update.

Each connection needs a file descriptor here and one in the broker: the workers raise
their soft ``RLIMIT_NOFILE`` to the hard limit, and the broker needs ``ulimit -n`` above
the fleet size (a broker started by this process inherits the raised limit) and
Mosquitto's ``max_connections`` (default -1, unlimited) not below it; its per-client
queue (``max_queued_messages``) must hold a replay of every agent's retained status for
a (re)starting coordinator (see ``docs/BENCHMARKS.md``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import resource
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgepfl.broker import parse_broker_url  # noqa: E402
from edgepfl.protocol import (  # noqa: E402
    AgentChannel,
    Body,
    MessageType,
    ProtocolError,
    Reassembler,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    agent_topic,
    decode,
    encode,
    encode_body,
    split_frame,
)

CONNECT_BATCH = 100  # connections opened before the loop runs again: the broker accepts them in turn
MISC_EVERY_S = 1.0  # keepalive and retry bookkeeping for every client


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def agent_name(index: int) -> str:
    return f"vagent-{index:05d}"


@dataclass
class Stats:
    """What one worker did, printed as one JSON line when it stops."""

    agents: int = 0
    connected: int = 0
    disconnects: int = 0
    tasks: dict[str, int] = field(default_factory=lambda: {"train": 0, "evaluate": 0})
    rejected: int = 0
    answers: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Worker:
    """``count`` virtual agents, ``first`` to ``first + count - 1``, on one event loop."""

    def __init__(self, url: str, federation: str, first: int, count: int, local_work_s: float, num_train: int,
                 num_test: int, max_message_bytes: int, keepalive_s: int, seed: int):
        import paho.mqtt.client as mqtt

        self.mqtt = mqtt
        self.host, self.port, _tls = parse_broker_url(url)
        self.federation = federation
        self.local_work_s = local_work_s
        self.num_train, self.num_test = num_train, num_test
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s
        self.names = [agent_name(i) for i in range(first, first + count)]
        self.rng = np.random.default_rng(seed + first)
        self.stats = Stats(agents=count)
        self.selector = selectors.DefaultSelector()
        self.clients: dict[str, mqtt.Client] = {}
        self.reassembler = Reassembler(max_bytes=256 * 2**20, max_pending=max(64, 2 * count))
        # answers due at the end of their local work: (when, seq, agent, round, update frame)
        self.due: list[tuple[float, int, str, int, bytes]] = []
        self._seq = 0
        self._bodies: dict[str, Body] = {}  # task body sha256 -> this process's perturbed update body
        self._stop = False

    # ---------------------------------------------------------------- clients
    def _client(self, name: str):
        mqtt = self.mqtt
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{self.federation}-{name}",
                             protocol=mqtt.MQTTv311, clean_session=True, userdata=name)
        status = agent_topic(self.federation, name, AgentChannel.STATUS)
        client.will_set(status, self._status(name, "offline"), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_socket_open = lambda c, u, sock: self.selector.register(sock, selectors.EVENT_READ, c)
        client.on_socket_close = lambda c, u, sock: self.selector.unregister(sock)
        client.on_socket_register_write = lambda c, u, sock: self.selector.modify(
            sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
        client.on_socket_unregister_write = lambda c, u, sock: self.selector.modify(sock, selectors.EVENT_READ, c)
        return client

    def _status(self, name: str, state: str) -> bytes:
        meta = StatusMeta(state=state, tier="trainer", device="virtual", num_train=self.num_train,  # type: ignore[arg-type]
                          num_test=self.num_test, platform="loadgen")
        return encode(MessageType.STATUS, federation=self.federation, sender=name, round=-1, meta=meta)

    def _on_connect(self, client, name, flags, reason_code, properties=None) -> None:
        if reason_code.is_failure:
            print(f"loadgen: {name}: broker refused the connection: {reason_code}", file=sys.stderr)
            return
        self.stats.connected += 1
        client.subscribe(agent_topic(self.federation, name, AgentChannel.TASK), qos=1)
        client.publish(agent_topic(self.federation, name, AgentChannel.STATUS), self._status(name, "online"),
                       qos=1, retain=True)

    def _on_disconnect(self, client, name, flags, reason_code, properties=None) -> None:
        if not self._stop:  # leaving at the end is not a lost connection
            self.stats.connected -= 1
            self.stats.disconnects += 1
            print(f"loadgen: {name} lost its connection ({reason_code}); reconnecting", file=sys.stderr)

    # ---------------------------------------------------------------- tasks
    def _on_message(self, client, name, msg) -> None:
        payload = bytes(msg.payload)
        self.stats.bytes_in += len(payload)
        try:
            message = decode(payload, max_bytes=self.max_message_bytes + 65536)
            if message.type == MessageType.CHUNK:
                whole = self.reassembler.add(msg.topic, message)
                if whole is None:
                    return
                message = decode(whole, max_bytes=256 * 2**20)
                payload = whole
            if message.type != MessageType.TASK or message.header.federation != self.federation:
                raise ProtocolError("wrong_type", f"{message.type.value} on a task topic")
        except ProtocolError as exc:
            self.stats.rejected += 1
            print(f"loadgen: {name}: dropped a message: {exc.reason} ({exc.detail})", file=sys.stderr)
            return
        task = message.meta_as(TaskMeta)
        self.stats.tasks[task.kind] += 1
        meta = UpdateMeta(task_id=task.task_id, kind=task.kind, num_train=self.num_train, num_test=self.num_test,
                          eval_correct=int(self.rng.integers(0, self.num_test + 1)), eval_loss=1.0,
                          train_loss=1.0 if task.kind == "train" else None, train_seconds=self.local_work_s)
        body = self._update_body(message.header.body_sha256, message.tensors) if task.kind == "train" else None
        frame = encode(MessageType.UPDATE, federation=self.federation, sender=name, round=message.header.round,
                       meta=meta, body=body)
        self._seq += 1
        heapq.heappush(self.due, (time.monotonic() + self.local_work_s, self._seq, name, message.header.round, frame))

    def _update_body(self, key: str, tensors: dict[str, np.ndarray]) -> Body:
        body = self._bodies.get(key)
        if body is None:
            shared = {}
            for name, value in tensors.items():
                if "/" in name:  # server/ extras are the method's, never sent back
                    continue
                if value.dtype.kind == "f":
                    value = (value + self.rng.normal(0, 1e-3, value.shape)).astype(value.dtype)
                shared[name] = value
            body = encode_body(shared)
            self._bodies = {key: body}  # one round's body at a time
        return body

    def _answer_due(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, _, name, round, frame = heapq.heappop(self.due)
            client = self.clients[name]
            topic = agent_topic(self.federation, name, AgentChannel.UPDATE)
            for part in split_frame(frame, self.max_message_bytes, federation=self.federation, sender=name, round=round):
                client.publish(topic, part, qos=1)
                self.stats.bytes_out += len(part)
            self.stats.answers += 1

    # ---------------------------------------------------------------- loop
    def _poll(self, timeout: float) -> None:
        for key, mask in self.selector.select(timeout):
            client = key.data
            if mask & selectors.EVENT_READ:
                client.loop_read()
            if mask & selectors.EVENT_WRITE:
                client.loop_write()

    def connect_all(self) -> None:
        """Open every connection (in batches, serving the loop between) and wait for every CONNACK."""
        for i, name in enumerate(self.names):
            client = self.clients[name] = self._client(name)
            client.connect(self.host, self.port, keepalive=self.keepalive_s)
            if i % CONNECT_BATCH == CONNECT_BATCH - 1:
                self._poll(0)
        deadline = time.monotonic() + 120
        while self.stats.connected < len(self.names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.stats.connected}/{len(self.names)} virtual agents connected after 120 s")
            self._poll(0.1)
            self._misc()

    def _misc(self) -> None:
        for client in self.clients.values():
            if client.loop_misc() == self.mqtt.MQTT_ERR_NO_CONN and not self._stop:
                try:
                    client.reconnect()
                except OSError:
                    pass  # tried again at the next round of bookkeeping

    def serve(self) -> None:
        """Answer tasks until SIGTERM / SIGINT."""
        last_misc = time.monotonic()
        while not self._stop:
            now = time.monotonic()
            self._answer_due(now)
            wait = min(0.05, max(0.0, self.due[0][0] - now)) if self.due else 0.05
            self._poll(wait)
            if now - last_misc >= MISC_EVERY_S:
                self._misc()
                last_misc = now

    def stop(self, *_args) -> None:
        self._stop = True

    def close(self) -> None:
        """Leave cleanly: a retained offline status, then DISCONNECT, for every agent."""
        for name, client in self.clients.items():
            client.publish(agent_topic(self.federation, name, AgentChannel.STATUS), self._status(name, "offline"),
                           qos=1, retain=True)
            client.disconnect()
        deadline = time.monotonic() + 10
        while self.selector.get_map() and time.monotonic() < deadline:
            self._poll(0.05)


def worker_main(args: argparse.Namespace) -> int:
    limit = raise_fd_limit()
    if limit < args.count + 64:
        print(f"loadgen: RLIMIT_NOFILE is {limit}, too low for {args.count} connections", file=sys.stderr)
        return 2
    worker = Worker(args.broker, args.federation, args.first, args.count, args.local_work_s, args.num_train,
                    args.num_test, args.max_message_bytes, args.keepalive_s, args.seed)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    worker.connect_all()
    print("READY", flush=True)
    worker.serve()
    worker.close()
    print(json.dumps(worker.stats.__dict__), flush=True)
    return 0


class LoadGenerator:
    """``agents`` virtual agents in ``processes`` worker processes; a context manager.

    :meth:`start` returns once every agent is connected and has published its status;
    :meth:`stop` ends the workers and returns their summed :class:`Stats` as a dict.
    """

    def __init__(self, url: str, federation: str, agents: int, *, processes: int = 1, local_work_s: float = 0.1,
                 num_train: int = 100, num_test: int = 20, max_message_bytes: int = 1_000_000,
                 keepalive_s: int = 60, seed: int = 0, log_dir: Path | None = None):
        self.url, self.federation, self.agents = url, federation, agents
        self.processes = max(1, min(processes, agents))
        self.options = ["--local-work-s", str(local_work_s), "--num-train", str(num_train), "--num-test",
                        str(num_test), "--max-message-bytes", str(max_message_bytes), "--keepalive-s",
                        str(keepalive_s), "--seed", str(seed)]
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 300) -> LoadGenerator:
        raise_fd_limit()  # inherited by the workers
        per, extra = divmod(self.agents, self.processes)
        first = 0
        for p in range(self.processes):
            count = per + (1 if p < extra else 0)
            stderr = open(self.log_dir / f"loadgen-{p}.log", "w") if self.log_dir else None  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--broker", self.url, "--federation", self.federation,
                 "--first", str(first), "--count", str(count), *self.options],
                stdout=subprocess.PIPE, stderr=stderr, text=True))
            first += count
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()  # blocks until the worker is ready (or died)
            if line != "READY" or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"a loadgen worker did not come up (said {line!r}, exit {proc.poll()})")
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> dict:
        total: dict = {}
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            for line in (out or "").splitlines():
                if line.startswith("{"):
                    for key, value in json.loads(line).items():
                        if isinstance(value, dict):
                            bucket = total.setdefault(key, {})
                            for k, v in value.items():
                                bucket[k] = bucket.get(k, 0) + v
                        else:
                            total[key] = total.get(key, 0) + value
        self.procs = []
        return total

    def __enter__(self) -> LoadGenerator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker", required=True, help="mqtt://host:port")
    ap.add_argument("--federation", required=True)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--local-work-s", type=float, default=0.1, help="simulated local training / evaluation time")
    ap.add_argument("--num-train", type=int, default=100, help="training samples each agent announces")
    ap.add_argument("--num-test", type=int, default=20)
    ap.add_argument("--max-message-bytes", type=int, default=1_000_000, help="larger updates go in chunks")
    ap.add_argument("--keepalive-s", type=int, default=60)
    ap.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**31))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    gen = LoadGenerator(args.broker, args.federation, args.agents, processes=args.processes,
                        local_work_s=args.local_work_s, num_train=args.num_train, num_test=args.num_test,
                        max_message_bytes=args.max_message_bytes, keepalive_s=args.keepalive_s, seed=args.seed)
    gen.start()
    print(f"{args.agents} virtual agents online in {gen.processes} processes; Ctrl-C to stop", flush=True)
    try:
        while all(p.poll() is None for p in gen.procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    print(json.dumps(gen.stop()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
