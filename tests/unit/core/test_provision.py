"""``edgepfl provision``: the files it writes (modes, certificate chain, SANs, ACL, conf).
A federation that runs on them: tests/integration/security/test_provisioned_federation.py.
"""

from __future__ import annotations

import json
import math
import os
import ssl
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from edgepfl.config import AgentConfig, RunConfig, parse_config
from edgepfl.mosquitto import broker_sizing, password_line
from edgepfl.provision import main_provision


def provision(out: Path, *extra: str, agents: str = "pi-01,pi-02", auth: str = "cert", federation: str = "demo") -> Path:
    rc = main_provision(["--federation", federation, "--agents", agents, "--broker-host", "mqtt.example.org",
                         "--out", str(out), "--auth", auth, *extra])
    assert rc == 0
    return out


def conf_settings(text: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


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
    """The lines' shape; what each role really reaches is asserted against a live Mosquitto
    (tests/integration/security/test_provisioned_federation.py, the table of SECURITY.md)."""
    out = provision(tmp_path / "p", federation="plant7")
    lines = [line for line in (out / "broker" / "acl").read_text().splitlines() if line and not line.startswith("#")]
    base = "edgepfl/v1/plant7"
    assert lines.index("user coordinator") < lines.index("user operator") < lines.index(
        f"pattern write {base}/agents/%u/status")
    assert [line for line in lines if line.startswith("pattern")] == [
        f"pattern write {base}/agents/%u/status", f"pattern write {base}/agents/%u/update",
        f"pattern write {base}/agents/%u/metrics", f"pattern read {base}/agents/%u/task",
        f"pattern read {base}/coordinator", f"pattern read {base}/release", f"pattern read {base}/release/+",
    ]
    # no '#': neither a grant that reaches everything nor a deny (Mosquitto 2.0 does not hold those)
    assert not any("#" in line for line in lines)
    assert all(line.split()[-1].startswith(f"{base}/") for line in lines if not line.startswith("user"))


@pytest.mark.parametrize("auth", ["cert", "password", "both"])
def test_mosquitto_conf_pins_client_ids_to_identities_and_is_sized_to_the_fleet(tmp_path, auth):
    out = tmp_path / "p"
    assert main_provision(["--federation", "f", "--count", "40", "--broker-host", "10.0.0.5", "--out", str(out),
                           "--auth", auth, "--update-mb", "20", "--port", "8884"]) == 0
    text = (out / "broker" / "mosquitto.conf").read_text()
    conf = conf_settings(text)
    sizing = broker_sizing(40, 1_000_000, 20 * 2**20)
    assert conf["listener"] == "8884 127.0.0.1"  # this host only, unless --bind says otherwise
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
    # secure rounds (protocol 1.14): the CA certifies the agent's signing key, and both ends hold the CA
    from cryptography.hazmat.primitives.serialization import Encoding

    from edgepfl.pki import certified_signing_key, load_certificate
    from edgepfl.protocol.signing import load_public_key

    assert agent.security.certificate and agent.security.peer_ca and coord.security.peer_ca
    ca = load_certificate(agent_dir / agent.security.peer_ca)
    assert load_certificate(coord_dir / coord.security.peer_ca) == ca == load_certificate(out / "ca" / "ca.crt")
    certified = certified_signing_key(ca, load_certificate(agent_dir / agent.security.certificate).public_bytes(
        Encoding.DER), "pi-01")
    assert certified.public_bytes_raw() == load_public_key(agent_dir / "signing.pub").public_bytes_raw()
    # the password file holds each client's password, hashed as Mosquitto does
    lines = dict(line.split(":", 1) for line in (out / "broker" / "passwd").read_text().splitlines())
    assert set(lines) == {"coordinator", "operator", "pi-01", "pi-02"}
    salt_b64 = lines["pi-01"].split("$")[3]
    import base64

    assert password_line("pi-01", (agent_dir / "password").read_text().strip(),
                         salt=base64.b64decode(salt_b64)) == f"pi-01:{lines['pi-01']}"


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


def test_the_broker_listens_where_the_operator_says_and_the_first_start_is_spelled_out(tmp_path, capsys):
    base = ["--federation", "f", "--agents", "pi-01", "--broker-host", "mqtt.example.org", "--port", "8884"]
    assert main_provision([*base, "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out
    assert "listens on 127.0.0.1:8884" in said and "--bind ADDRESS" in said
    # as root Mosquitto drops to its own user, which must read the key: the one command that makes it so
    assert f"chown -R mosquitto: {tmp_path / 'a' / 'broker'}" in said
    assert main_provision([*base, "--bind", "10.0.0.2", "--out", str(tmp_path / "b")]) == 0
    assert conf_settings((tmp_path / "b" / "broker" / "mosquitto.conf").read_text())["listener"] == "8884 10.0.0.2"
    assert "--bind ADDRESS" not in capsys.readouterr().out
    for bad in ("0.0.0.0\nallow_anonymous true", "eth0", ""):  # it is written into the listener line
        assert main_provision([*base, "--bind", bad, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgepfl provision:") and "--bind" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "c" / "broker" / "mosquitto.conf").exists()


def test_add_keeps_loopback_for_a_record_written_before_the_bind_field_and_moves_only_when_told(tmp_path, capsys):
    """A provision.json of an earlier edgepfl has no ``bind``: ``--add`` must not open the broker
    to every interface nobody chose (it did: 0.0.0.0); ``--add --bind`` moves it, and the record keeps that."""
    out = provision(tmp_path / "p", "--port", "8884")
    record = json.loads((out / "provision.json").read_text())
    del record["bind"]
    (out / "provision.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main_provision(["--add", "pi-03", "--out", str(out)]) == 0
    assert conf_settings((out / "broker" / "mosquitto.conf").read_text())["listener"] == "8884 127.0.0.1"
    assert "listens on 127.0.0.1:8884" in capsys.readouterr().out
    assert main_provision(["--add", "pi-04", "--bind", "10.0.0.2", "--out", str(out)]) == 0
    assert conf_settings((out / "broker" / "mosquitto.conf").read_text())["listener"] == "8884 10.0.0.2"
    assert main_provision(["--add", "pi-05", "--out", str(out)]) == 0  # the record keeps the address chosen
    assert json.loads((out / "provision.json").read_text())["bind"] == "10.0.0.2"
    assert main_provision(["--add", "pi-06", "--bind", "eth0", "--out", str(out)]) == 2
    assert "--bind" in capsys.readouterr().err
    assert json.loads((out / "provision.json").read_text())["agents"][-1] == "pi-05"  # nothing written


def test_firewall_rules_cap_connections_per_address_on_the_brokers_port(tmp_path, capsys):
    out = provision(tmp_path / "p", "--port", "8884", "--connections-per-address", "6", federation="lab-2")
    rules = (out / "broker" / "firewall.nft").read_text()
    # loaded by the live test (tests/integration/security/test_idle_sockets.py); here: what it says
    for family in ("ip", "ip6"):
        assert f"tcp dport 8884 ct state new add @per_address_v{4 if family == 'ip' else 6} " \
               f"{{ {family} saddr ct count over 6 }} reject with tcp reset" in rules
    assert "delete table inet edgepfl_lab_2" in rules  # reloading replaces only its own table
    assert "nft -f" in capsys.readouterr().out
    assert main_provision(["--add", "pi-03", "--out", str(out)]) == 0  # the record keeps the limit
    assert "ct count over 6 }" in (out / "broker" / "firewall.nft").read_text()
    capsys.readouterr()
    assert main_provision(["--federation", "f", "--agents", "a", "--broker-host", "h", "--out", str(tmp_path / "q"),
                           "--connections-per-address", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--connections-per-address" in err and len(err.splitlines()) == 1


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


def test_sites_are_agents_of_the_federation_each_a_federation_of_its_own_joined_by_its_aggregator_yaml(tmp_path,
                                                                                                       capsys):
    from edgepfl.site_config import load_aggregator_config

    out = provision(tmp_path / "p", "--site", "gw-a:cam-1,cam-2", "--site", "gw-b:cam-3", "--site-host",
                    "gw-a=gate-a.lan", agents="pi-01")
    central = parse_config(RunConfig, yaml.safe_load((out / "coordinator" / "coordinator.yaml").read_text()), "c")
    assert central.sites.enabled and central.sites.ids == ["gw-a", "gw-b"]
    assert sorted(p.name for p in (out / "coordinator" / "enrolled").iterdir()) == ["gw-a.pub", "gw-b.pub", "pi-01.pub"]
    for site, devices, host in (("gw-a", ["cam-1", "cam-2"], "gate-a.lan"), ("gw-b", ["cam-3"], "gw-b")):
        folder = out / "sites" / site
        aggregator = load_aggregator_config(folder / "aggregator.yaml")
        assert aggregator.site_id == site and aggregator.central.federation == "demo"
        assert aggregator.site.federation == f"demo-{site}" and aggregator.site.broker.url == f"mqtts://{host}:8883"
        # the aggregator signs as the site's agent of the federation, and as its site's coordinator
        assert Path(aggregator.central.security.signing_key).read_bytes() == \
            (out / "agents" / site / "signing.key").read_bytes()
        assert Path(aggregator.site.security.signing_key).read_bytes() == \
            (folder / "coordinator" / "signing.key").read_bytes()
        assert sorted(p.stem for p in Path(aggregator.site.security.enrolled_dir).iterdir()) == devices
        for device in devices:  # each device pins the site's coordinator key: the aggregator's
            assert (folder / "agents" / device / "coordinator.pub").read_bytes() == \
                (folder / "coordinator" / "signing.pub").read_bytes()
    capsys.readouterr()
    for bad in ("gw-a", "gw-a:", "gw-a:cam-1,cam-1", "gw/a:cam-1"):
        assert main_provision(["--federation", "demo", "--site", bad, "--broker-host", "h",
                               "--out", str(tmp_path / "q")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgepfl provision:") and len(err.splitlines()) == 1, err


def test_summary_sites_are_provisioned_with_the_mode_on_both_ends_and_a_state_dir_beside_each_aggregator(tmp_path):
    from edgepfl.site_config import load_aggregator_config

    out = provision(tmp_path / "p", "--site", "gw-a:cam-1,cam-2,cam-3", "--site", "gw-b:cam-4", "--site-mode",
                    "summary", agents="gw-a")
    central = parse_config(RunConfig, yaml.safe_load((out / "coordinator" / "coordinator.yaml").read_text()), "c")
    # the sites are the trainers: two of them, not four devices
    assert central.sites.mode == "summary" and central.min_agents == 2
    for site in ("gw-a", "gw-b"):
        aggregator = load_aggregator_config(out / "sites" / site / "aggregator.yaml")
        assert aggregator.mode == "summary" and aggregator.state_dir == str(out / "sites" / site / "state")
    exact = provision(tmp_path / "q", "--site", "gw-a:cam-1", agents="gw-a")
    assert parse_config(RunConfig, yaml.safe_load((exact / "coordinator" / "coordinator.yaml").read_text()),
                        "c").sites.mode == "exact"
    assert load_aggregator_config(exact / "sites" / "gw-a" / "aggregator.yaml").state_dir is None
