"""``edgepfl provision``: the files it writes, and a federation that runs on them.

Unit tests read the generated files (modes, certificate chain, SANs, ACL, conf).
The slow tests start a real Mosquitto from the generated ``mosquitto.conf`` (only the
listener moved to a free port), real agent processes from the generated bundles (cwd =
the bundle, so the bundle's relative paths resolve as on a device), and attack the broker
with a plain paho client holding one agent's credentials.
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from edgepfl.broker import parse_broker_url
from edgepfl.config import AgentConfig, RunConfig, parse_config
from edgepfl.mosquitto import broker_sizing, password_line
from edgepfl.provision import main_provision
from edgepfl.testing import MosquittoBroker

from tests.conftest import require_mosquitto
from tests.fleet_helpers import read_rows, run_config, run_in_thread

PATH_FIELDS = ("ca_file", "cert_file", "key_file", "password_file")


def provision(out: Path, *extra: str, agents: str = "pi-01,pi-02", auth: str = "cert", federation: str = "demo") -> Path:
    rc = main_provision(["--federation", federation, "--agents", agents, "--broker-host", "mqtt.example.org",
                         "--out", str(out), "--auth", auth, *extra])
    assert rc == 0
    return out


def conf_settings(text: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


def bundle_broker(folder: Path, yaml_name: str) -> dict:
    """The ``broker:`` section of a bundle's YAML with its relative paths made absolute."""
    broker = yaml.safe_load((folder / yaml_name).read_text())["broker"]
    return {k: str(folder / v) if k in PATH_FIELDS else v for k, v in broker.items()}


# --------------------------------------------------------------------------- files


def test_provision_writes_keys_private_and_everything_else_readable(tmp_path):
    out = provision(tmp_path / "p", auth="both")
    private = {"ca/ca.key", "broker/server.key", "broker/passwd", "coordinator/client.key", "coordinator/password",
               "coordinator/signing.key", "agents/pi-01/client.key", "agents/pi-01/password",
               "agents/pi-01/signing.key", "agents/pi-02/client.key", "agents/pi-02/password",
               "agents/pi-02/signing.key", "operator/client.key", "operator/password"}
    files = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert private <= set(files)
    for name, mode in files.items():
        assert mode == (0o600 if name in private else 0o644), name
    assert (out / "ca").stat().st_mode & 0o777 == 0o700
    assert (out / "agents" / "pi-01").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in (out / "coordinator" / "enrolled").iterdir()) == ["pi-01.pub", "pi-02.pub"]


def test_certificates_chain_to_the_ca_with_the_broker_names_and_agent_identities(tmp_path):
    out = provision(tmp_path / "p")
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = x509.load_pem_x509_certificate((out / "broker" / "server.crt").read_bytes())
    client = x509.load_pem_x509_certificate((out / "agents" / "pi-02" / "client.crt").read_bytes())
    for cert in (server, client):
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        assert cert.issuer == ca.subject
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"mqtt.example.org", "localhost"}
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    cn = client.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
    assert cn == "pi-02"
    # Python's own verifier accepts the chain for the broker's host name (what every agent does)
    context = ssl.create_default_context(cafile=str(out / "agents" / "pi-01" / "ca.crt"))
    assert context.cert_store_stats()["x509_ca"] == 1


def test_acl_confines_agents_to_their_own_topics_and_has_no_wildcard_reads(tmp_path):
    out = provision(tmp_path / "p", federation="plant7")
    lines = [line for line in (out / "broker" / "acl").read_text().splitlines() if line and not line.startswith("#")]
    base = "edgepfl/v1/plant7"
    assert lines == [
        "user coordinator",
        f"topic read {base}/agents/+/status", f"topic read {base}/agents/+/update",
        f"topic read {base}/agents/+/metrics", f"topic write {base}/agents/+/task",
        f"topic write {base}/coordinator", f"topic write {base}/release", f"topic write {base}/release/+",
        f"topic write {base}/view",
        "user operator", f"topic read {base}/view",
        f"pattern write {base}/agents/%u/status", f"pattern write {base}/agents/%u/update",
        f"pattern write {base}/agents/%u/metrics", f"pattern read {base}/agents/%u/task",
        f"pattern read {base}/coordinator", f"pattern read {base}/release", f"pattern read {base}/release/+",
    ]
    assert not any(line.endswith("#") for line in lines)


@pytest.mark.parametrize("auth", ["cert", "password", "both"])
def test_mosquitto_conf_pins_client_ids_to_identities_and_is_sized_to_the_fleet(tmp_path, auth):
    out = tmp_path / "p"
    assert main_provision(["--federation", "f", "--count", "40", "--broker-host", "10.0.0.5", "--out", str(out),
                           "--auth", auth, "--update-mb", "20", "--port", "8884"]) == 0
    text = (out / "broker" / "mosquitto.conf").read_text()
    conf = conf_settings(text)
    sizing = broker_sizing(40, 1_000_000, 20 * 2**20)
    assert conf["listener"] == "8884"
    assert conf["use_username_as_clientid"] == "true"
    assert conf["allow_anonymous"] == "false"
    assert conf["acl_file"] == f"{out}/broker/acl"
    assert conf["cafile"] == f"{out}/broker/ca.crt"
    assert ("require_certificate" in conf) == (auth != "password")
    assert ("use_identity_as_username" in conf) == (auth == "cert")
    assert ("password_file" in conf) == (auth != "cert")
    assert int(conf["max_connections"]) == sizing.max_connections >= 41
    assert int(conf["max_packet_size"]) == 1_000_000 + 65_536
    assert int(conf["max_queued_messages"]) == 2 * 40 * math.ceil(20 * 2**20 / (1_000_000 - 2048)) == sizing.max_queued_messages
    assert f"LimitNOFILE={sizing.open_files}" in text
    assert sorted(p.name for p in (out / "agents").iterdir()) == [f"agent-{i:02d}" for i in range(40)]


def test_bundles_are_valid_configs_with_relative_paths_to_their_own_files(tmp_path):
    out = provision(tmp_path / "p", auth="both")
    agent_dir = out / "agents" / "pi-01"
    agent = parse_config(AgentConfig, yaml.safe_load((agent_dir / "agent.yaml").read_text()), "agent.yaml")
    assert agent.agent_id == "pi-01" and agent.broker.url == "mqtts://mqtt.example.org:8883"
    for rel in (agent.broker.ca_file, agent.broker.cert_file, agent.broker.key_file, agent.broker.password_file,
                agent.security.signing_key, agent.security.coordinator_key):
        assert rel is not None and not os.path.isabs(rel) and (agent_dir / rel).is_file()
    assert (agent_dir / "coordinator.pub").read_bytes() == (out / "coordinator" / "signing.pub").read_bytes()
    assert (out / "coordinator" / "enrolled" / "pi-01.pub").read_bytes() == (agent_dir / "signing.pub").read_bytes()
    coord_dir = out / "coordinator"
    coord = parse_config(RunConfig, yaml.safe_load((coord_dir / "coordinator.yaml").read_text()), "coordinator.yaml")
    assert coord.broker.username == "coordinator" and (coord_dir / str(coord.security.enrolled_dir)).is_dir()
    # the password file holds each client's password, hashed as Mosquitto does
    lines = dict(line.split(":", 1) for line in (out / "broker" / "passwd").read_text().splitlines())
    assert set(lines) == {"coordinator", "operator", "pi-01", "pi-02"}
    salt_b64 = lines["pi-01"].split("$")[3]
    import base64

    assert password_line("pi-01", (agent_dir / "password").read_text().strip(),
                         salt=base64.b64decode(salt_b64)) == f"pi-01:{lines['pi-01']}"


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


def test_refuses_to_overwrite_and_rejects_bad_names_in_one_line(tmp_path, capsys):
    out = provision(tmp_path / "p")
    first_ca = (out / "ca" / "ca.crt").read_bytes()
    args = ["--federation", "demo", "--agents", "pi-01", "--broker-host", "h", "--out", str(out)]
    assert main_provision(args) == 2
    err = capsys.readouterr().err.strip()
    assert "--force" in err and len(err.splitlines()) == 1
    assert (out / "ca" / "ca.crt").read_bytes() == first_ca
    assert main_provision([*args, "--force"]) == 0
    assert (out / "ca" / "ca.crt").read_bytes() != first_ca
    assert not (out / "agents" / "pi-02").exists()
    capsys.readouterr()
    for bad in ("pi/01", "coordinator", "operator", "a,a"):
        assert main_provision(["--federation", "demo", "--agents", bad, "--broker-host", "h",
                               "--out", str(tmp_path / "q")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgepfl provision:") and len(err.splitlines()) == 1


def test_add_extends_the_federation_with_the_same_ca(tmp_path):
    out = provision(tmp_path / "p", auth="password")
    ca = (out / "ca" / "ca.crt").read_bytes()
    server = (out / "broker" / "server.crt").read_bytes()
    old_passwd = (out / "broker" / "passwd").read_text().splitlines()
    old_key = (out / "agents" / "pi-01" / "signing.key").read_bytes()
    assert main_provision(["--out", str(out), "--add", "pi-03"]) == 0
    assert (out / "ca" / "ca.crt").read_bytes() == ca and (out / "broker" / "server.crt").read_bytes() == server
    assert (out / "agents" / "pi-01" / "signing.key").read_bytes() == old_key
    passwd = (out / "broker" / "passwd").read_text().splitlines()
    assert passwd[:-1] == old_passwd and passwd[-1].startswith("pi-03:$7$")
    assert (out / "coordinator" / "enrolled" / "pi-03.pub").is_file()
    assert (out / "agents" / "pi-03" / "ca.crt").read_bytes() == ca
    assert main_provision(["--out", str(out), "--add", "pi-03"]) == 2


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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("auth", ["cert", "password"])
def test_the_operator_bundle_reads_the_fleet_view_and_nothing_else(tmp_path, auth, capsys):
    from edgepfl.coordinator.status import main_status

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


def spawn_bundle_agent(bundle: Path, config: RunConfig, index: int) -> subprocess.Popen:
    """An ``edgepfl agent`` started in its bundle folder, as on a device, with this run's data added."""
    agent = yaml.safe_load((bundle / "agent.yaml").read_text())
    agent.update(data=config.data.model_dump(mode="json"), client_index=index, device="cpu", threads=1)
    (bundle / "agent.yaml").write_text(yaml.safe_dump(agent, sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "agent", "--config", "agent.yaml"], cwd=bundle,
                            env=env, stdout=open(bundle / "agent.log", "ab"), stderr=subprocess.STDOUT)


@pytest.mark.slow
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
            assert row.participants == ["pi-01", "pi-02"] and not row.aborted and row.rejected == {}
        assert fleet.transport.connect_count == 1
        assert (out / "agents" / "pi-01" / "state").is_dir()  # relative state_dir resolved in the bundle
