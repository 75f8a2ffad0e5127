"""``edgepfl provision``: a federation that runs on the files it writes (the files
themselves: tests/unit/core/test_provision.py).

The password file's hash against ``mosquitto_passwd``; then a real Mosquitto from the
generated ``mosquitto.conf`` (only the listener moved to a free port), real agent
processes from the generated bundles (cwd = the bundle, so the bundle's relative paths
resolve as on a device), and a plain paho client holding one agent's credentials attacking
the broker.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml

from edgepfl.broker import parse_broker_url
from edgepfl.config import RunConfig
from edgepfl.mosquitto import password_line
from edgepfl.testing import MosquittoBroker

from tests.conftest import require_mosquitto
from tests.fleet_helpers import read_rows, run_config, run_in_thread
from tests.unit.core.test_provision import provision

PATH_FIELDS = ("ca_file", "cert_file", "key_file", "password_file")


def bundle_broker(folder: Path, yaml_name: str) -> dict:
    """The ``broker:`` section of a bundle's YAML with its relative paths made absolute."""
    broker = yaml.safe_load((folder / yaml_name).read_text())["broker"]
    return {k: str(folder / v) if k in PATH_FIELDS else v for k, v in broker.items()}


def test_password_hash_matches_mosquitto_passwd(tmp_path):
    tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not os.access(tool, os.X_OK):
        pytest.skip("mosquitto_passwd not installed")
    path = tmp_path / "passwd"
    subprocess.run([tool, "-b", "-c", str(path), "pi-07", "s3cret"], check=True, capture_output=True)
    theirs = path.read_text().strip()
    import base64

    salt = base64.b64decode(theirs.split("$")[3])
    assert password_line("pi-07", "s3cret", salt=salt) == theirs


# --------------------------------------------------------------------------- against a real Mosquitto


class Attacker:
    """A plain paho client that knows docs/PROTOCOL.md and holds one agent's credentials."""

    def __init__(self, url: str, broker: dict, client_id: str):
        host, port, _ = parse_broker_url(url)
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        self.client.tls_set(ca_certs=broker["ca_file"], certfile=broker.get("cert_file"),
                            keyfile=broker.get("key_file"))
        if "password_file" in broker:
            self.client.username_pw_set(broker["username"], Path(broker["password_file"]).read_text().strip())
        connected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: connected.set()
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload)))
        self.client.connect(host, port, keepalive=10)
        self.client.loop_start()
        assert connected.wait(10), "attacker got no CONNACK"

    def subscribe(self, topic: str) -> Attacker:
        self.client.subscribe(topic, qos=1)
        time.sleep(0.3)
        return self

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def received(self, wait: float = 1.0) -> list[tuple[str, bytes]]:
        time.sleep(wait)
        got = []
        while not self.inbox.empty():
            got.append(self.inbox.get())
        return got

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("auth", ["cert", "password"])
def test_one_agents_credentials_reach_nothing_but_its_own_topics(tmp_path, auth):
    require_mosquitto()
    out = provision(tmp_path / "p", agents="pi-01,pi-02", auth=auth)
    base = "edgepfl/v1/demo"
    creds = {who: bundle_broker(out / "agents" / who, "agent.yaml") for who in ("pi-01", "pi-02")}
    creds["coordinator"] = bundle_broker(out / "coordinator", "coordinator.yaml")
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        coord = Attacker(broker.url, creds["coordinator"], "edgepfl-demo-coordinator").subscribe(f"{base}/agents/+/+")
        victim = Attacker(broker.url, creds["pi-02"], "edgepfl-demo-pi-02")
        victim.subscribe(f"{base}/agents/pi-02/task").subscribe(f"{base}/coordinator").subscribe(f"{base}/release")
        victim.subscribe(f"{base}/release/0")
        thief = Attacker(broker.url, creds["pi-01"], "edgepfl-demo-pi-01").subscribe("#")
        thief.subscribe(f"{base}/agents/pi-02/task").subscribe(f"{base}/agents/+/update")
        try:
            for channel in ("update", "status", "metrics"):
                thief.publish(f"{base}/agents/pi-02/{channel}", b"forged")
            thief.publish(f"{base}/agents/pi-02/task", b"forged-task")
            thief.publish(f"{base}/coordinator", b"forged-presence", retain=True)
            thief.publish(f"{base}/release", b"forged-release", retain=True)
            thief.publish(f"{base}/release/0", b"forged-part", retain=True)
            thief.publish(f"{base}/agents/pi-01/update", b"own-update")  # allowed: the control
            coord.publish(f"{base}/agents/pi-02/task", b"task-2")
            victim.publish(f"{base}/agents/pi-02/update", b"update-2")
            assert sorted(coord.received()) == [(f"{base}/agents/pi-01/update", b"own-update"),
                                                (f"{base}/agents/pi-02/update", b"update-2")]
            assert victim.received() == [(f"{base}/agents/pi-02/task", b"task-2")]
            assert thief.received() == []  # neither '#', nor another agent's task or update
            # a device's credentials with the coordinator's client id do not take over the coordinator's session
            hijack = Attacker(broker.url, creds["pi-01"], "edgepfl-demo-coordinator")
            hijack.close()
            victim.publish(f"{base}/agents/pi-02/update", b"still-there")
            assert coord.received() == [(f"{base}/agents/pi-02/update", b"still-there")]
            assert "as coordinator" in broker.log_text() and "as edgepfl-demo-coordinator" not in broker.log_text()
        finally:
            for client in (coord, victim, thief):
                client.close()


@pytest.mark.parametrize("auth", ["cert", "password"])
def test_the_operator_bundle_reads_the_fleet_view_and_nothing_else(tmp_path, auth, capsys):
    from edgepfl.coordinator.ops.status import main_status

    require_mosquitto()
    out = provision(tmp_path / "p", agents="pi-01", auth=auth)
    base = "edgepfl/v1/demo"
    operator_creds = bundle_broker(out / "operator", "operator.yaml")
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        coord = Attacker(broker.url, bundle_broker(out / "coordinator", "coordinator.yaml"), "c")
        agent = Attacker(broker.url, bundle_broker(out / "agents" / "pi-01", "agent.yaml"), "a")
        operator = Attacker(broker.url, operator_creds, "o").subscribe("#")
        try:
            view = b'{"not": "checked by the broker"}'
            coord.publish(f"{base}/view", view, retain=True)
            agent.publish(f"{base}/agents/pi-01/update", b"update")
            coord.publish(f"{base}/agents/pi-01/task", b"task")
            operator.publish(f"{base}/view", b"forged-view", retain=True)
            operator.publish(f"{base}/agents/pi-01/task", b"forged-task")
            assert operator.received() == [(f"{base}/view", view)]
            fresh = Attacker(broker.url, operator_creds, "o2").subscribe(f"{base}/view")
            assert fresh.received() == [(f"{base}/view", view)]  # the retained view is still the coordinator's
            fresh.close()
        finally:
            for client in (coord, agent, operator):
                client.close()
        # edgepfl status takes URL, TLS files and credentials from the bundle; the URL only moves to the test's port
        yaml_path = out / "operator" / "operator.yaml"
        bundle = yaml.safe_load(yaml_path.read_text())
        bundle["broker"]["url"] = broker.url
        yaml_path.write_text(yaml.safe_dump(bundle))
        capsys.readouterr()
        assert main_status(["--config", str(yaml_path), "--timeout", "3"]) == 1
        assert "not an edgepfl fleet view" in capsys.readouterr().err  # it connected and read the retained payload


def reach_table() -> dict[str, dict[str, list[str]]]:
    """SECURITY.md's "Who reaches which topic": role -> {"reads": filters, "writes": filters}."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "SECURITY.md").read_text()
    section = text.split("### Who reaches which topic", 1)[1]
    table: dict[str, dict[str, list[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in ("coordinator", "agent", "operator"):
            table[cells[0]] = {kind: [f.strip().strip("`") for f in cell.split(",") if f.strip() not in ("", "—")]
                               for kind, cell in zip(("reads", "writes"), cells[1:])}
    assert set(table) == {"coordinator", "agent", "operator"}, table
    return table


def _matches(topic: str, filters: list[str], agent_id: str) -> bool:
    for pattern in filters:
        parts, levels = pattern.replace("<id>", agent_id).split("/"), topic.split("/")
        if len(parts) == len(levels) and all(p in ("+", t) for p, t in zip(parts, levels)):
            return True
    return False


@pytest.mark.parametrize("auth", ["cert", "password"])
def test_each_roles_reach_is_exactly_the_table_of_security_md(tmp_path, auth):
    """Every role of a provisioned federation, with its own credentials, tries to read and to
    write each topic of the protocol (two agents' own topics, the reserved user names'
    agent topics, the coordinator's presence, the release and a release part, the view):
    what reaches is exactly what SECURITY.md's table says, no more, no less."""
    require_mosquitto()
    out = provision(tmp_path / "p", agents="pi-01,pi-02", auth=auth)
    base = "edgepfl/v1/demo"
    table = reach_table()
    roles = {"coordinator": ("coordinator", out / "coordinator", "coordinator.yaml"),
             "pi-01": ("agent", out / "agents" / "pi-01", "agent.yaml"),
             "pi-02": ("agent", out / "agents" / "pi-02", "agent.yaml"),
             "operator": ("operator", out / "operator", "operator.yaml")}
    topics = [f"agents/{a}/{c}" for a in ("pi-01", "pi-02", "coordinator", "operator")
              for c in ("status", "update", "metrics", "task")] + ["coordinator", "release", "release/0", "view"]

    def may(role: str, kind: str, topic: str) -> bool:
        return _matches(topic, table[roles[role][0]][kind], role)

    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        clients = {role: Attacker(broker.url, bundle_broker(folder, name), f"reach-{role}")
                   for role, (_, folder, name) in roles.items()}
        try:
            for client in clients.values():
                for topic in topics:
                    client.client.subscribe(f"{base}/{topic}", qos=1)
            time.sleep(0.5)
            for role, client in clients.items():
                for topic in topics:
                    client.publish(f"{base}/{topic}", f"{role}>{topic}".encode())
            expected = {(reader, f"{writer}>{topic}") for writer in roles for topic in topics
                        if may(writer, "writes", topic) for reader in roles if may(reader, "reads", topic)}
            got: set[tuple[str, str]] = set()
            deadline = time.monotonic() + 60  # generous: a loaded box delivers late, never wrongly
            while not expected <= got and time.monotonic() < deadline:
                for reader, client in clients.items():
                    got |= {(reader, payload.decode()) for _, payload in client.received(0.2)}
            for reader, client in clients.items():  # anything a denied write or read let through comes by now
                got |= {(reader, payload.decode()) for _, payload in client.received(0.5)}
        finally:
            for client in clients.values():
                client.close()
    assert not expected - got, f"denied what the table allows: {sorted(expected - got)}"
    assert not got - expected, f"reached beyond the table: {sorted(got - expected)}"
    # the probe exercised every role as a reader and every role with a grant as a writer
    assert {reader for reader, _ in expected} == set(roles)
    assert {payload.split(">")[0] for _, payload in expected} == {"coordinator", "pi-01", "pi-02"}


def spawn_bundle_agent(bundle: Path, config: RunConfig, index: int) -> subprocess.Popen:
    """An ``edgepfl agent`` started in its bundle folder, as on a device, with this run's data added."""
    agent = yaml.safe_load((bundle / "agent.yaml").read_text())
    agent.update(data=config.data.model_dump(mode="json"), client_index=index, device="cpu", threads=1)
    (bundle / "agent.yaml").write_text(yaml.safe_dump(agent, sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "agent", "--config", "agent.yaml"], cwd=bundle,
                            env=env, stdout=open(bundle / "agent.log", "ab"), stderr=subprocess.STDOUT)


@pytest.mark.parametrize("auth", ["cert", "password"])
def test_federation_runs_over_mqtts_from_the_bundles_and_a_client_id_hijack_changes_nothing(tmp_path, auth):
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import data_shape, prepare, stop_agents

    require_mosquitto()
    federation = f"p{uuid.uuid4().hex[:8]}"
    out = provision(tmp_path / "p", agents="pi-01,pi-02,pi-03", auth=auth, federation=federation)
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        coord_broker = dict(bundle_broker(out / "coordinator", "coordinator.yaml"), url=broker.url)
        # the bundle's signing key and enrolled agents too: its agents pin the coordinator's key
        # and drop whatever it does not sign
        security = {"signing_key": str(out / "coordinator" / "signing.key"),
                    "enrolled_dir": str(out / "coordinator" / "enrolled")}
        config = prepare(run_config(federation, rounds=2, broker=coord_broker, security=security, device="cpu"), 2)
        for bundle in ("pi-01", "pi-02"):
            path = out / "agents" / bundle / "agent.yaml"
            agent = yaml.safe_load(path.read_text())
            agent["broker"]["url"] = broker.url
            path.write_text(yaml.safe_dump(agent, sort_keys=False))
        procs = [spawn_bundle_agent(out / "agents" / a, config, i) for i, a in enumerate(("pi-01", "pi-02"))]
        fleet = MqttFleet(federation, config.broker)
        try:
            coordinator = Coordinator(config, fleet, tmp_path / "run", progress=False, **data_shape(config))
            thread, box = run_in_thread(coordinator.run)
            # pi-03 was provisioned but never started: an attacker holding its credentials
            # keeps connecting with the coordinator's client id while the rounds run
            stolen = bundle_broker(out / "agents" / "pi-03", "agent.yaml")
            while thread.is_alive():
                Attacker(broker.url, stolen, f"edgepfl-{federation}-coordinator").close()
                thread.join(1.0)
            assert "error" not in box, box.get("error")
        finally:
            fleet.close()
            stop_agents(procs)
        rows = read_rows(tmp_path / "run")
        logs = "".join((out / "agents" / a / "agent.log").read_text(errors="replace") for a in ("pi-01", "pi-02"))
        assert [r.round for r in rows] == [0, 1, 2] and rows[-1].final, logs[-3000:]
        for row in rows[:-1]:
            assert row.participants == ["pi-01", "pi-02"] and not row.aborted and row.rejected == {}, logs[-4000:]
        assert fleet.transport.connect_count == 1
        assert (out / "agents" / "pi-01" / "state").is_dir()  # relative state_dir resolved in the bundle


def _listening(port: int) -> list[str]:
    """The local addresses (kernel hex, e.g. ``0100007F`` for 127.0.0.1) with a TCP socket
    listening on ``port``, IPv4 and IPv6, as /proc/net/tcp{,6} show them."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the first start as root needs root")
def test_the_printed_first_start_works_as_root_and_listens_on_loopback_only(capsys):
    """The red team, as root, ran the command ``provision`` printed (``mosquitto -c …``):
    Mosquitto dropped to its user and could not read ``server.key``; and the generated
    ``listener <port>`` bound every interface. Here the summary's own ``chown`` and
    ``mosquitto`` lines are run as printed (the test fixture's ``user root`` is not used), the
    broker must listen on 127.0.0.1 only (the kernel's listening sockets), and a device's
    bundle must connect over TLS with its certificate."""
    import shlex
    import tempfile

    from edgepfl.broker import free_port
    from edgepfl.testing.brokers import find_mosquitto

    require_mosquitto()
    try:
        import pwd

        pwd.getpwnam("mosquitto")
    except KeyError:
        pytest.skip("no 'mosquitto' user to drop to")
    port = free_port()
    # the broker host's directory: its parents must be traversable by 'mosquitto' (pytest's tmp_path is not)
    root = Path(tempfile.mkdtemp(prefix="edgepfl-first-start-"))
    proc = None
    try:
        root.chmod(0o755)
        out, broker_dir = root / "out", root / "etc"
        provision(out, "--broker-dir", str(broker_dir), "--port", str(port), agents="pi-01")
        said = capsys.readouterr().out
        shutil.copytree(out / "broker", broker_dir)  # step 2: the broker files to the broker host
        steps = [line.split("   (")[0].strip() for line in said.split("next:", 1)[1].splitlines()]
        chown = next(s for s in steps if s.startswith("chown "))
        start = next(s for s in steps if s.startswith("mosquitto "))
        subprocess.run(shlex.split(chown), check=True, timeout=30)
        command = shlex.split(start)
        proc = subprocess.Popen([find_mosquitto(), *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while not _listening(port):
            assert proc.poll() is None, f"{start} exited {proc.returncode}: {proc.stdout.read().decode()[-2000:]}"
            time.sleep(0.1)
        assert _listening(port) == ["0100007F"], _listening(port)  # 127.0.0.1, no wildcard, no IPv6
        bundle = out / "agents" / "pi-01"
        device = Attacker(f"mqtts://localhost:{port}", bundle_broker(bundle, "agent.yaml"), client_id="pi-01")
        try:
            assert device.client.is_connected(), "the device's CONNACK was a refusal"
        finally:
            device.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
