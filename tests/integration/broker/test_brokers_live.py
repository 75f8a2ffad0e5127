"""Both brokers against real paho-mqtt 2.x clients: QoS 1, retained presence, last will,
large messages, persistent sessions, traffic capture, and the helpers around them (those
that need no broker: tests/unit/core/test_broker.py)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgepfl.broker import BrokerError, EmbeddedBroker, parse_broker_url, wait_for_port
from edgepfl.protocol import MessageType, UpdateMeta, decode, encode, new_message_id
from edgepfl.testing import MosquittoBroker, TrafficCapture, find_mosquitto

from tests.conftest import require_mosquitto

MB = 1024 * 1024


# --------------------------------------------------------------------------- a tiny synchronous paho client


class Peer:
    """A paho client with blocking helpers, as agents and coordinators use it (QoS 1, MQTT 3.1.1)."""

    def __init__(self, url, client_id=None, *, clean_session=True, will=None, username=None, password=None):
        host, port, _ = parse_broker_url(url)
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self._acks: queue.Queue[int] = queue.Queue()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id or f"peer-{uuid.uuid4().hex[:10]}",
            protocol=mqtt.MQTTv311,
            clean_session=clean_session,
        )
        if will:
            self.client.will_set(*will, qos=1, retain=True)
        if username:
            self.client.username_pw_set(username, password)
        self._connected, self._disconnected = threading.Event(), threading.Event()
        self.connack = None

        def on_connect(c, u, f, rc, p):
            self.connack = rc
            self._connected.set()

        self.client.on_connect = on_connect
        self.client.on_disconnect = lambda c, u, f, rc, p: self._disconnected.set()
        self.client.on_message = lambda c, u, m: self.inbox.put(m)
        self.client.on_subscribe = lambda c, u, mid, rc, p: self._acks.put(mid)
        self.client.connect(host, port, keepalive=10)
        self.client.loop_start()
        assert self._connected.wait(10), "no CONNACK"
        if self.connack.is_failure:
            self.client.loop_stop()
            raise ConnectionRefusedError(str(self.connack))

    def subscribe(self, topic, qos=1):
        _, mid = self.client.subscribe(topic, qos)
        while self._acks.get(timeout=10) != mid:
            pass
        return self

    def publish(self, topic, payload, *, qos=1, retain=False):
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(timeout=30)
        assert info.is_published()

    def get(self, timeout=10.0) -> mqtt.MQTTMessage:
        return self.inbox.get(timeout=timeout)

    def nothing(self, wait=0.3) -> bool:
        try:
            self.inbox.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self):
        # Wait for paho to have sent DISCONNECT before stopping its thread: otherwise the
        # broker may see a dropped socket and (rightly) publish the last will.
        self.client.disconnect()
        self._disconnected.wait(5)
        self.client.loop_stop()


@pytest.fixture(scope="module")
def amqtt_broker():
    broker = EmbeddedBroker()
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(params=["mosquitto", "amqtt"])
def url(request):
    """The URL of each broker in turn."""
    if request.param == "mosquitto":
        return request.getfixturevalue("mosquitto").url
    return request.getfixturevalue("amqtt_broker").url


@pytest.fixture
def topic():
    """A topic prefix unique to the test, so retained messages don't leak between tests."""
    return f"test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def peers():
    made = []

    def make(*args, **kw):
        p = Peer(*args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


# --------------------------------------------------------------------------- both brokers


def test_qos1_round_trip(url, topic, peers):
    sub = peers(url).subscribe(f"{topic}/agents/+/update")
    pub = peers(url)
    payload = os.urandom(2048)
    pub.publish(f"{topic}/agents/a1/update", payload)
    msg = sub.get()
    assert (msg.topic, msg.payload, msg.qos, msg.retain) == (f"{topic}/agents/a1/update", payload, 1, False)
    assert sub.nothing()  # delivered once


def test_retained_status_reaches_late_subscribers_and_can_be_cleared(url, topic, peers):
    pub = peers(url)
    pub.publish(f"{topic}/status", b"online-v1", retain=True)
    pub.publish(f"{topic}/status", b"online-v2", retain=True)  # replaces, not appends
    late = peers(url).subscribe(f"{topic}/#")
    msg = late.get()
    assert (msg.payload, msg.retain) == (b"online-v2", True)
    assert late.nothing()
    pub.publish(f"{topic}/status", b"", retain=True)  # an empty retained message clears it
    assert late.get().payload == b""
    assert peers(url).subscribe(f"{topic}/#").nothing()


def test_new_client_gets_only_retained_messages_of_its_own_subscriptions(url, topic, peers):
    """Regression: amqtt 0.12 replays retained messages matching *other* clients' filters
    to every client that connects; EmbeddedBroker patches that out."""
    peers(url).publish(f"{topic}/agents/a1/status", b"a1-online", retain=True)
    coordinator = peers(url).subscribe(f"{topic}/agents/+/status")
    assert coordinator.get().payload == b"a1-online"
    agent = peers(url).subscribe(f"{topic}/agents/a2/task")
    assert agent.nothing(wait=0.5)
    # and a fresh client that subscribes to nothing gets nothing
    assert peers(url).nothing(wait=0.3)


WILL_CLIENT = textwrap.dedent(
    """
    import sys, time
    import paho.mqtt.client as mqtt
    host, port, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dying-agent", protocol=mqtt.MQTTv311)
    c.will_set(topic, b"offline", qos=1, retain=True)
    c.connect(host, port, keepalive=30)
    c.loop_start()
    c.publish(topic, b"online", qos=1, retain=True).wait_for_publish(10)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_last_will_is_delivered_and_retained_when_a_client_dies(url, topic, peers):
    status = f"{topic}/agents/dying/status"
    watcher = peers(url).subscribe(status)
    host, port, _ = parse_broker_url(url)
    proc = subprocess.Popen(
        [sys.executable, "-c", WILL_CLIENT, host, str(port), status], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert watcher.get().payload == b"online"
        proc.send_signal(signal.SIGKILL)  # no DISCONNECT packet: the broker must publish the will
        proc.wait(10)
        msg = watcher.get(timeout=15)
        assert msg.payload == b"offline"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # presence: a coordinator that starts later still learns the agent is offline
    late = peers(url).subscribe(status).get()
    assert (late.payload, late.retain) == (b"offline", True)


def test_clean_disconnect_does_not_fire_the_will(url, topic, peers):
    status = f"{topic}/status"
    watcher = peers(url).subscribe(status)
    p = Peer(url, will=(status, b"offline"))
    p.close()
    assert watcher.nothing(wait=0.5)


def test_sixteen_megabyte_message(url, topic, peers):
    sub = peers(url).subscribe(f"{topic}/big")
    payload = np.random.default_rng(1).integers(0, 256, 16 * MB, dtype=np.uint8).tobytes()
    peers(url).publish(f"{topic}/big", payload)
    assert sub.get(timeout=60).payload == payload


def test_persistent_session_receives_qos1_messages_sent_while_offline(url, topic, peers):
    """Both brokers queue QoS 1 messages for a disconnected persistent session (Mosquitto's
    behaviour; amqtt only does so because EmbeddedBroker does not mark clients anonymous)."""
    cid = f"persist-{uuid.uuid4().hex[:8]}"
    first = Peer(url, cid, clean_session=False).subscribe(f"{topic}/task")
    first.close()
    peers(url).publish(f"{topic}/task", b"task-while-away")
    back = peers(url, cid, clean_session=False)
    assert back.get().payload == b"task-while-away"


# --------------------------------------------------------------------------- amqtt specifics


def test_five_megabyte_edgepfl_frame_through_amqtt(amqtt_broker, topic, peers):
    url = amqtt_broker.url
    tensors = {"encoder.weight": np.random.default_rng(2).standard_normal(1_310_000).astype(np.float32)}
    meta = UpdateMeta(task_id=new_message_id(), kind="train", num_train=100, num_test=20, eval_correct=15)
    frame = encode(MessageType.UPDATE, federation="f", sender="a1", round=1, meta=meta, tensors=tensors)
    assert len(frame) > 5_000_000
    sub = peers(url).subscribe(f"{topic}/update")
    peers(url).publish(f"{topic}/update", frame)
    got = decode(sub.get(timeout=60).payload)
    assert got.tensors["encoder.weight"].tobytes() == tensors["encoder.weight"].tobytes()


def test_embedded_broker_lifecycle_and_fixed_port():
    broker = EmbeddedBroker()
    url = broker.start()
    host, port, tls = parse_broker_url(url)
    assert (host, tls) == ("127.0.0.1", False) and broker.running
    assert broker.start() == url  # idempotent
    broker.stop()
    assert not broker.running
    assert not wait_for_port(host, port, timeout=0.3)
    broker.stop()  # idempotent
    # the same port can be served again right away (a restarted demo keeps its URL)
    with EmbeddedBroker(port=port) as again:
        assert again == url
        p = Peer(again)
        p.close()


def test_embedded_broker_on_a_taken_port_fails_clearly(amqtt_broker):
    _, port, _ = parse_broker_url(amqtt_broker.url)
    with pytest.raises(BrokerError):
        EmbeddedBroker(port=port, start_timeout=5).start()


# --------------------------------------------------------------------------- Mosquitto specifics


def test_mosquitto_capture_records_exact_bytes(mosquitto, broker_capture, topic, peers):
    payload = os.urandom(100_000)
    peers(mosquitto.url).publish(f"{topic}/agents/a1/update", payload)
    peers(mosquitto.url).publish(f"{topic}/agents/a2/update", b"second")
    got = broker_capture.wait_for(lambda ms: len([t for t, _ in ms if t.startswith(topic)]) >= 2)
    mine = [(t, p) for t, p in got if t.startswith(topic)]
    assert mine == [(f"{topic}/agents/a1/update", payload), (f"{topic}/agents/a2/update", b"second")]
    assert payload in broker_capture.payloads("a1/update")


def test_capture_skips_retained_replays_of_earlier_traffic(mosquitto, topic, peers):
    peers(mosquitto.url).publish(f"{topic}/status", b"old", retain=True)
    with TrafficCapture(mosquitto.url, f"{topic}/#") as cap:
        peers(mosquitto.url).publish(f"{topic}/status", b"new", retain=True)
        assert cap.wait_for(lambda ms: len(ms) >= 1) == [(f"{topic}/status", b"new")]
    with TrafficCapture(mosquitto.url, f"{topic}/#", include_retained=True) as cap:
        assert cap.wait_for(lambda ms: len(ms) >= 1) == [(f"{topic}/status", b"new")]


def test_mosquitto_broker_with_capture_option():
    require_mosquitto()
    with MosquittoBroker(capture=True) as broker:
        Peer(broker.url).publish("x/y", b"seen")
        assert broker.capture.wait_for(lambda ms: ("x/y", b"seen") in ms)
        proc_port = parse_broker_url(broker.url)[1]
    assert broker.capture is None and not broker.running
    assert not wait_for_port("127.0.0.1", proc_port, timeout=0.3)


def test_mosquitto_enforces_a_configured_packet_limit(topic):
    """A small max_packet_bytes is real (this is how tests emulate EMQX's 1 MB limit)."""
    require_mosquitto()
    with MosquittoBroker(max_packet_bytes=64 * 1024) as broker:
        sub = Peer(broker.url).subscribe(f"{topic}/#")
        try:
            small = Peer(broker.url)
            small.publish(f"{topic}/ok", b"x" * 1000)
            assert sub.get().payload == b"x" * 1000
            big = Peer(broker.url)
            big.client.publish(f"{topic}/big", b"x" * (128 * 1024), qos=1)
            assert sub.nothing(wait=1.0)  # dropped: the broker disconnects the offender
            small.close()
            big.close()
        finally:
            sub.close()
        assert "max_packet_size" in (broker.log_path.parent / "mosquitto.conf").read_text()


def test_missing_mosquitto_executable_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPFL_MOSQUITTO", str(tmp_path / "no-such-mosquitto"))
    assert find_mosquitto() is None
    with pytest.raises(BrokerError, match="apt-get install mosquitto"):
        MosquittoBroker().start()


# --------------------------------------------------------------------------- docs/PROTOCOL.md conformance

DOC = Path(__file__).resolve().parents[3] / "docs" / "PROTOCOL.md"


def doc_block(name: str) -> str:
    inner = DOC.read_text().split(f"<!-- {name}-begin -->", 1)[1].split(f"<!-- {name}-end -->", 1)[0]
    lines = inner.strip().splitlines()
    return "\n".join(lines[1:-1]) + "\n"


@pytest.fixture
def acl_broker(tmp_path):
    """Mosquitto with the doc's ACL verbatim, password authentication, anonymous refused."""
    require_mosquitto()
    acl = tmp_path / "acl"
    acl.write_text(doc_block("acl"))
    passwd = tmp_path / "passwd"
    tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not os.access(tool, os.X_OK):
        pytest.skip("mosquitto_passwd not installed")
    for i, user in enumerate(["coordinator", "pi-07", "pi-08", "operator"]):
        subprocess.run([tool, "-b"] + (["-c"] if i == 0 else []) + [str(passwd), user, f"pw-{user}"],
                       check=True, capture_output=True)
    passwd.chmod(0o600)
    acl.chmod(0o600)
    with MosquittoBroker(allow_anonymous=False, extra_config=f"password_file {passwd}\nacl_file {acl}") as broker:
        yield broker


def test_acl_from_the_doc_confines_each_agent_to_its_own_topics(acl_broker, peers):
    url = acl_broker.url
    base = "edgepfl/v1/demo"

    def login(user):
        return peers(url, username=user, password=f"pw-{user}")

    coord = login("coordinator").subscribe(f"{base}/agents/+/update")
    pi7, pi8 = login("pi-07"), login("pi-08")
    pi7.subscribe(f"{base}/agents/pi-07/task").subscribe(f"{base}/agents/pi-08/task").subscribe(f"{base}/release")
    pi7.subscribe(f"{base}/release/0")
    pi8.subscribe(f"{base}/agents/pi-08/task")
    # tasks reach their own agent only
    coord.publish(f"{base}/agents/pi-08/task", b"task-for-8")
    assert pi8.get().payload == b"task-for-8"
    assert pi7.nothing()
    coord.publish(f"{base}/agents/pi-07/task", b"task-for-7")
    assert pi7.get().payload == b"task-for-7"
    # an agent can publish its own update, not another agent's, and no release
    pi7.publish(f"{base}/agents/pi-07/update", b"from-7")
    pi7.publish(f"{base}/agents/pi-08/update", b"forged-by-7")
    pi7.publish(f"{base}/release", b"fake-release", retain=True)
    pi7.publish(f"{base}/release/0", b"fake-part", retain=True)
    got = coord.get()
    assert (got.topic, got.payload) == (f"{base}/agents/pi-07/update", b"from-7")
    assert coord.nothing(wait=0.5) and pi7.nothing()
    # the coordinator's release reaches agents
    coord.publish(f"{base}/release", b"real-release", retain=True)
    assert pi7.get().payload == b"real-release"
    coord.publish(f"{base}/release/0", b"real-part", retain=True)  # a release in parts (PROTOCOL §12)
    assert pi7.get().payload == b"real-part"
    # the fleet view: the coordinator writes it, an operator reads it, an agent can neither forge nor read it
    operator = login("operator").subscribe(f"{base}/view")
    pi8.subscribe(f"{base}/view")
    pi7.publish(f"{base}/view", b'{"forged": true}', retain=True)
    assert operator.nothing(wait=0.5)
    coord.publish(f"{base}/view", b'{"phase": "training"}', retain=True)
    assert operator.get().payload == b'{"phase": "training"}'
    operator.publish(f"{base}/release", b"operator-release", retain=True)
    assert pi7.nothing(wait=0.5) and pi8.nothing()
    # no anonymous clients, no wrong passwords
    with pytest.raises(ConnectionRefusedError):
        Peer(url)
    with pytest.raises(ConnectionRefusedError):
        Peer(url, username="pi-07", password="wrong")


def test_two_agents_written_from_the_doc_alone_complete_rounds_with_the_real_coordinator(mosquitto, tmp_path):
    """The doc's reference codec + agent, run as separate processes, against edgepfl's coordinator."""
    from edgepfl.config import RunConfig
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.rounds import Coordinator

    script = tmp_path / "doc_agent.py"
    script.write_text(doc_block("reference-codec") + doc_block("reference-agent") + textwrap.dedent(
        """
        import sys
        def answer(header, task, tensors):
            # A protocol-level agent: report 2 of 5 correct and send the global tensors back unchanged.
            return {"num_train": 10, "num_test": 5, "eval_correct": 2}, dict(tensors)
        run_agent(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], answer, 10, 5)
        """))
    fed = f"doc{uuid.uuid4().hex[:8]}"
    host, port, _ = parse_broker_url(mosquitto.url)
    agents = [subprocess.Popen([sys.executable, str(script), host, str(port), fed, f"doc-{i}"]) for i in (1, 2)]
    try:
        config = RunConfig(
            federation=fed, method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 8, "norm": "none"},
            rounds=2, min_agents=2, round_timeout_s=30, wait_for_agents_s=60, input_shape=[1, 4, 4], num_classes=3,
            normalization={"mean": [0.5], "std": [0.5]},
            broker={"url": mosquitto.url}, device="cpu",
        )
        fleet = MqttFleet(fed, config.broker)
        try:
            rows = Coordinator(config, fleet, tmp_path / "run", progress=False).run()
        finally:
            fleet.close()
    finally:
        for p in agents:
            p.kill()
            p.wait()
    assert [r.round for r in rows] == [0, 1, 2] and rows[-1].final
    for row in rows[:-1]:
        assert row.participants == ["doc-1", "doc-2"]
        assert row.rejected == {} and not row.aborted
        assert row.accuracy == pytest.approx(0.4)
        assert row.bytes_up > 0 and row.bytes_down > 0
    assert rows[-1].evaluated == 2 and rows[-1].accuracy == pytest.approx(0.4)
