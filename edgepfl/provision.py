"""``edgepfl provision``: everything a secure federation needs, in one folder of bundles.

    edgepfl provision --federation F --agents pi-01,pi-02 --broker-host mqtt.example.org --out DIR
    edgepfl provision --out DIR --add pi-03            (more agents, same CA)

Writes (private keys and secrets 0600, everything else 0644, folders 0755)::

    DIR/provision.json          what was provisioned (read by --add)
    DIR/ca/ca.crt, ca.key       the federation's private CA (keep ca.key offline)
    DIR/broker/                 mosquitto.conf, ca.crt, server.crt/.key, acl[, passwd]
    DIR/coordinator/            coordinator.yaml, ca.crt, client cert/key or password,
                                signing.key/.pub, enrolled/<agent>.pub
    DIR/agents/<id>/            agent.yaml, ca.crt, client cert/key or password,
                                signing.key/.pub, signing.crt (the CA's certificate of
                                signing.pub: secure rounds), coordinator.pub — copy onto the device
    DIR/operator/               operator.yaml, ca.crt, client cert/key or password: read-only
                                access to the fleet view (edgepfl status --config)

Paths inside the YAML files are relative to the file's own folder (a bundle can be
copied anywhere), unless ``--absolute-paths``. The YAML files hold the identity,
``broker:`` and ``security:`` sections; add ``data:`` (agents) and the method and
rounds (coordinator) before running.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import pki
from .atomic import make_dirs
from .errors import ExitCode
from .mosquitto import (
    COORDINATOR_USER,
    IDLE_ADDRESSES,
    OPERATOR_USER,
    AuthMode,
    BrokerSizing,
    acl_text,
    broker_sizing,
    check_agent_ids,
    firewall_nft,
    mosquitto_conf,
    password_line,
    read_password_users,
)
from .protocol.signing import generate_keypair, load_public_key
from .protocol.topics import check_segment


class ProvisionRecord(BaseModel):
    """What a provision run produced; ``--add`` reads it to extend the federation with the same CA."""

    model_config = ConfigDict(defer_build=True, extra="forbid")
    federation: str
    broker_hosts: list[str] = Field(min_length=1)
    port: int = Field(ge=1, lt=65536)
    auth: AuthMode
    agents: list[str]
    max_message_bytes: int
    update_bytes: int
    broker_dir: str
    absolute_paths: bool = False
    #: the address the broker listens on; a record written before this field reads as loopback (this
    #: host only): ``--add`` never opens a broker to every interface that nobody chose (``--add --bind`` does)
    bind: str = "127.0.0.1"
    #: TCP connections one source address may hold to the broker (broker/firewall.nft)
    connections_per_address: int = 4
    #: source addresses at that limit whose idle sockets max_connections leaves room for
    idle_addresses: int = Field(IDLE_ADDRESSES, ge=0)
    #: site aggregator id -> its site's devices (docs/OPERATING.md, "Sites"): each site aggregator is an
    #: agent of this federation, and its site a federation of its own under ``sites/<id>/``
    sites: dict[str, list[str]] = Field(default_factory=dict)
    #: site aggregator id -> the host name its site's devices reach the site's broker at
    site_hosts: dict[str, str] = Field(default_factory=dict)
    #: how the sites speak to the centre (``sites.mode``): exact, or summary (each aggregator
    #: then keeps its devices' records in ``state/`` beside its aggregator.yaml)
    site_mode: Literal["exact", "summary"] = "exact"

    @field_validator("connections_per_address")
    @classmethod
    def _room_for_a_reconnect(cls, value: int) -> int:
        if value < 2:
            raise ValueError("--connections-per-address must be at least 2 (a device holds two while it reconnects)")
        return value

    @field_validator("bind")
    @classmethod
    def _an_address(cls, value: str) -> str:
        try:  # it goes into mosquitto.conf's listener line: an address, nothing else
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(f"--bind {value!r} is not an IP address (127.0.0.1, 10.0.0.2, 0.0.0.0, ::)") from None

    @property
    def url(self) -> str:
        return f"mqtts://{self.broker_hosts[0]}:{self.port}"


class ProvisionError(ValueError):
    """Provisioning cannot go on; the message says why and what to do."""


# --------------------------------------------------------------------------- bundles


def _mkdir(path: Path) -> Path:
    make_dirs(path)
    path.chmod(0o755)
    return path


def _ref(record: ProvisionRecord, folder: Path, name: str) -> str:
    return str((folder / name).resolve()) if record.absolute_paths else name


def _client_credentials(record: ProvisionRecord, folder: Path, user: str, ca: pki.CA) -> tuple[dict, str | None]:
    """Write a client's certificate and/or password into ``folder``; returns its ``broker:`` section and password."""
    ca_key, ca_cert = ca
    pki.write_certificate(folder / "ca.crt", ca_cert)
    broker: dict = {"url": record.url, "username": user, "ca_file": _ref(record, folder, "ca.crt")}
    password = None
    if record.auth in ("cert", "both"):
        key, cert = pki.issue(ca_key, ca_cert, user)
        pki.write_private_key(folder / "client.key", key)
        pki.write_certificate(folder / "client.crt", cert)
        broker |= {"cert_file": _ref(record, folder, "client.crt"), "key_file": _ref(record, folder, "client.key")}
    if record.auth in ("password", "both"):
        password = secrets.token_urlsafe(24)
        pki.write_secret(folder / "password", (password + "\n").encode())
        broker["password_file"] = _ref(record, folder, "password")
    broker["max_message_bytes"] = record.max_message_bytes
    return broker, password


def _write_yaml(path: Path, header: str, body: dict) -> None:
    pki.write_public(path, (header + yaml.safe_dump(body, sort_keys=False)).encode())


def _signing_keys(folder: Path) -> None:
    """``signing.key`` / ``signing.pub`` in the one format agents and coordinator read (edgepfl.protocol.signing)."""
    generate_keypair(folder / "signing.key", folder / "signing.pub")


def _agent_bundle(record: ProvisionRecord, out: Path, agent_id: str, ca: pki.CA) -> str | None:
    folder = _mkdir(out / "agents" / agent_id)
    broker, password = _client_credentials(record, folder, agent_id, ca)
    _signing_keys(folder)
    pki.write_public(out / "coordinator" / "enrolled" / f"{agent_id}.pub", (folder / "signing.pub").read_bytes())
    pki.write_public(folder / "coordinator.pub", (out / "coordinator" / "signing.pub").read_bytes())
    # the CA's word that signing.pub is this agent's: its neighbours in a secure round check its keys with it
    pki.write_certificate(folder / "signing.crt", pki.issue_signing_certificate(
        ca[0], ca[1], agent_id, load_public_key(folder / "signing.pub")))
    body = {
        "agent_id": agent_id, "federation": record.federation, "broker": broker,
        "security": {"signing_key": _ref(record, folder, "signing.key"),
                     "coordinator_key": _ref(record, folder, "coordinator.pub"),
                     "certificate": _ref(record, folder, "signing.crt"),
                     "peer_ca": _ref(record, folder, "ca.crt")},
        "state_dir": _ref(record, folder, "state"),
    }
    _write_yaml(folder / "agent.yaml", (
        f"# edgepfl agent {agent_id} of federation {record.federation}, written by edgepfl provision.\n"
        "# Paths are relative to this file's folder. Add this device's data: (and tier:, device:) and run\n"
        "#   edgepfl agent --config agent.yaml\n"), body)
    return password


def _coordinator_bundle(record: ProvisionRecord, out: Path, ca: pki.CA) -> str | None:
    folder = _mkdir(out / "coordinator")
    _mkdir(folder / "enrolled")
    broker, password = _client_credentials(record, folder, COORDINATOR_USER, ca)
    _signing_keys(folder)
    body = {
        "federation": record.federation, "broker": broker,
        "security": {"signing_key": _ref(record, folder, "signing.key"),
                     "enrolled_dir": _ref(record, folder, "enrolled"),
                     "peer_ca": _ref(record, folder, "ca.crt")},
        # the trainers: the direct agents and every site's devices, or in summary the sites themselves
        "min_agents": min(2, max(1, len(record.agents) if record.site_mode == "summary" else
                                 len(record.agents) + sum(map(len, record.sites.values())) - len(record.sites))),
    }
    if record.sites:
        body["sites"] = {"enabled": True, "ids": sorted(record.sites), "mode": record.site_mode}
    _write_yaml(folder / "coordinator.yaml", (
        f"# edgepfl coordinator of federation {record.federation}, written by edgepfl provision.\n"
        "# Paths are relative to this file's folder. Add method:, model:, data:, rounds: and run\n"
        "#   edgepfl coordinator --config coordinator.yaml\n"), body)
    return password


def _operator_bundle(record: ProvisionRecord, out: Path, ca: pki.CA) -> str | None:
    """Credentials that the ACL lets read the fleet view and nothing else: for ``edgepfl status`` and dashboards."""
    folder = _mkdir(out / "operator")
    broker, password = _client_credentials(record, folder, OPERATOR_USER, ca)
    _write_yaml(folder / "operator.yaml", (
        f"# edgepfl operator's access to federation {record.federation}, written by edgepfl provision.\n"
        "# Read-only: the broker's ACL lets this user read the fleet view (docs/PROTOCOL.md §18) only.\n"
        "# Paths are relative to this file's folder.\n"
        "#   edgepfl status --config operator.yaml [--json]\n"), {"federation": record.federation, "broker": broker})
    return password


def _sizing(record: ProvisionRecord) -> BrokerSizing:
    return broker_sizing(len(record.agents), record.max_message_bytes, record.update_bytes,
                         per_address=record.connections_per_address, idle_addresses=record.idle_addresses)


def _broker_files(record: ProvisionRecord, out: Path, ca: pki.CA, passwords: dict[str, str], new_server_cert: bool) -> None:
    folder = _mkdir(out / "broker")
    ca_key, ca_cert = ca
    pki.write_certificate(folder / "ca.crt", ca_cert)
    if new_server_cert:
        names = [*record.broker_hosts, "localhost", "127.0.0.1", "::1"]
        key, cert = pki.issue(ca_key, ca_cert, record.broker_hosts[0], server_names=names)
        pki.write_private_key(folder / "server.key", key)
        pki.write_certificate(folder / "server.crt", cert)
    pki.write_public(folder / "acl", acl_text(record.federation).encode())
    if record.auth in ("password", "both"):
        users = read_password_users(folder / "passwd")
        users.update({user: password_line(user, pw) for user, pw in passwords.items()})
        pki.write_secret(folder / "passwd", ("\n".join(users.values()) + "\n").encode())
    sizing = _sizing(record)
    conf = mosquitto_conf(federation=record.federation, port=record.port, bind=record.bind,
                          broker_dir=record.broker_dir,
                          auth=record.auth, sizing=sizing, max_message_bytes=record.max_message_bytes)
    pki.write_public(folder / "mosquitto.conf", conf.encode())
    rules = firewall_nft(federation=record.federation, port=record.port, per_address=record.connections_per_address)
    pki.write_public(folder / "firewall.nft", rules.encode())


#: the keys of a bundle's ``broker:`` and ``security:`` sections that name a file of the bundle
_FILE_KEYS = ("ca_file", "cert_file", "key_file", "password_file", "signing_key", "coordinator_key", "enrolled_dir",
              "certificate", "peer_ca")


def _rebased(section: dict, bundle: Path, folder: Path, absolute: bool) -> dict:
    """A bundle's ``broker:`` or ``security:`` section, its file paths (relative to ``bundle``)
    made relative to ``folder`` (or absolute)."""
    out = dict(section)
    for key in _FILE_KEYS:
        if isinstance(out.get(key), str):
            path = (bundle / out[key]).resolve()
            out[key] = str(path) if absolute else os.path.relpath(path, folder.resolve())
    return out


def _site(record: ProvisionRecord, out: Path, site_id: str) -> None:
    """A site of the federation: its own federation under ``sites/<site_id>/`` (CA, broker, the
    coordinator side its aggregator runs, one bundle per device) and the aggregator's config,
    which joins that coordinator side to the site's bundle as an agent of the central federation."""
    folder = out / "sites" / site_id
    host = record.site_hosts.get(site_id, site_id)
    site = ProvisionRecord(
        federation=f"{record.federation}-{site_id}", broker_hosts=[host], port=record.port, auth=record.auth,
        agents=record.sites[site_id], max_message_bytes=record.max_message_bytes, update_bytes=record.update_bytes,
        broker_dir=str(folder / "broker"), absolute_paths=record.absolute_paths, bind=record.bind,
        connections_per_address=record.connections_per_address, idle_addresses=record.idle_addresses)
    provision(site, folder)
    central = yaml.safe_load((out / "agents" / site_id / "agent.yaml").read_text())
    coordinator = yaml.safe_load((folder / "coordinator" / "coordinator.yaml").read_text())
    absolute = record.absolute_paths
    body = {
        "site_id": site_id,
        **({"mode": "summary", "state_dir": "state"} if record.site_mode == "summary" else {}),
        "central": {"federation": record.federation,
                    "broker": _rebased(central["broker"], out / "agents" / site_id, folder, absolute),
                    "security": _rebased(central["security"], out / "agents" / site_id, folder, absolute)},
        "site": {"federation": site.federation,
                 "broker": _rebased(coordinator["broker"], folder / "coordinator", folder, absolute),
                 "security": _rebased(coordinator["security"], folder / "coordinator", folder, absolute)},
    }
    _write_yaml(folder / "aggregator.yaml", (
        f"# edgepfl site aggregator {site_id} of federation {record.federation}, written by edgepfl provision.\n"
        "# Paths are relative to this file's folder. Add site: method: and model: (the central run's) and run\n"
        "#   edgepfl aggregator --config aggregator.yaml\n"), body)


# --------------------------------------------------------------------------- commands


def provision(record: ProvisionRecord, out: Path) -> None:
    """A new federation in ``out``: CA, broker files, the coordinator's bundle and one per agent."""
    check_segment(record.federation, "federation")
    check_agent_ids(record.agents)
    _mkdir(out)
    ca_dir = out / "ca"
    ca_dir.mkdir(parents=True, exist_ok=True)
    ca_dir.chmod(0o700)  # the CA key signs anything: only its owner may even list it
    ca = pki.new_ca(f"edgepfl {record.federation}")
    pki.write_private_key(ca_dir / "ca.key", ca[0])
    pki.write_certificate(ca_dir / "ca.crt", ca[1])
    passwords: dict[str, str] = {}
    for user, password in [(COORDINATOR_USER, _coordinator_bundle(record, out, ca)),
                           (OPERATOR_USER, _operator_bundle(record, out, ca))] + [
            (agent_id, _agent_bundle(record, out, agent_id, ca)) for agent_id in record.agents]:
        if password is not None:
            passwords[user] = password
    _broker_files(record, out, ca, passwords, new_server_cert=True)
    pki.write_public(out / "provision.json", record.model_dump_json(indent=2).encode())
    for site_id in sorted(record.sites):
        _site(record, out, site_id)


def add_agents(out: Path, new_agents: list[str], bind: str | None = None) -> ProvisionRecord:
    """Bundles for ``new_agents`` signed by the existing CA; the broker's files are updated for the larger fleet.
    ``bind``: the address the broker listens on from now on (None: the record's)."""
    try:
        record = ProvisionRecord.model_validate_json((out / "provision.json").read_text())
    except FileNotFoundError:
        raise ProvisionError(f"{out} holds no provision.json: provision it first (without --add)") from None
    taken = set(record.agents) & set(new_agents)
    if taken:
        raise ProvisionError(f"already provisioned: {', '.join(sorted(taken))}")
    update: dict[str, object] = {"agents": [*record.agents, *new_agents]}
    if bind is not None:
        update["bind"] = bind
    record = ProvisionRecord.model_validate({**record.model_dump(), **update})  # validated: bind is checked
    check_agent_ids(record.agents)
    ca = pki.load_ca(out / "ca" / "ca.key", out / "ca" / "ca.crt")
    passwords = {a: pw for a in new_agents if (pw := _agent_bundle(record, out, a, ca)) is not None}
    _broker_files(record, out, ca, passwords, new_server_cert=False)
    pki.write_public(out / "provision.json", record.model_dump_json(indent=2).encode())
    return record


#: addresses only this host reaches
LOOPBACK = ("127.0.0.1", "::1")


def _summary(record: ProvisionRecord, out: Path, added: list[str] | None = None) -> str:
    agents = added or record.agents
    first = agents[0] if agents else "AGENT"
    sizing = _sizing(record)
    return "\n".join([
        f"edgepfl provision: federation {record.federation}, {len(record.agents)} agents"
        + (f" ({len(added)} added)" if added else "") + f", auth {record.auth}, broker {record.url}",
        f"  {out}/ca/            the CA; keep ca.key offline (needed only for --add)",
        f"  {out}/broker/        mosquitto.conf, firewall.nft, acl, certificates{', passwd' if record.auth != 'cert' else ''}"
        f" -> the broker host, at {record.broker_dir} (LimitNOFILE={sizing.open_files})",
        f"  {out}/coordinator/   coordinator.yaml, credentials, signing key, enrolled/ ({len(record.agents)} agents)",
        f"  {out}/agents/<id>/   one bundle per device: " + ", ".join(agents[:5]) + (" ..." if len(agents) > 5 else ""),
        f"  {out}/operator/      read-only access to the fleet view, for edgepfl status and dashboards",
        f"  the broker listens on {record.bind}:{record.port}"
        + ("   (this host only: --bind ADDRESS for devices on other hosts)" if record.bind in LOOPBACK else ""),
        "next:",
        f"  chown -R mosquitto: {record.broker_dir}   (as root: Mosquitto drops to its user 'mosquitto', which "
        "must read server.key, acl" + (", passwd)" if record.auth != "cert" else ")"),
        f"  nft -f {record.broker_dir}/firewall.nft   (as root on the broker host: at most "
        f"{record.connections_per_address} connections per address; without it one host's idle sockets can fill the broker)",
        f"  mosquitto -c {record.broker_dir}/mosquitto.conf"
        + ("   (already running: kill -HUP it to reload passwd)" if added else ""),
        f"  cd {out}/coordinator && edgepfl coordinator --config coordinator.yaml   (after adding method, data, rounds)",
        f"  copy {out}/agents/{first}/ to the device, then there: edgepfl agent --config agent.yaml   (after adding data)",
        f"  edgepfl status --config {out}/operator/operator.yaml   (while it runs)",
        *([f"  sites ({', '.join(sorted(record.sites))}): each {out}/sites/<site>/ is a federation of its own "
           "(broker/, coordinator/, agents/); on the site's gateway: its broker, then",
           f"  cd {out}/sites/<site> && edgepfl aggregator --config aggregator.yaml   (after adding site: method: "
           "and model:)"] if record.sites else []),
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgepfl provision", description=(
        "Create a federation's CA, broker configuration (TLS, passwords, ACL, limits), coordinator bundle and "
        "one bundle per agent."))
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--federation", help="federation name")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--agents", help="comma-separated agent ids")
    who.add_argument("--count", type=int, help="N agents named agent-00 ... agent-<N-1>")
    who.add_argument("--add", help="comma-separated agent ids to add to an existing --out (same CA)")
    p.add_argument("--broker-host", action="append", default=[],
                   help="host name or IP the agents connect to (repeat or comma-separate for more names; "
                        "localhost and 127.0.0.1 are always in the certificate)")
    p.add_argument("--port", type=int, default=8883)
    p.add_argument("--bind", default=None,
                   help="the address the broker listens on (default 127.0.0.1: this host only; the address devices "
                        "reach it on, or 0.0.0.0 for every interface); with --add, where it listens from now on "
                        "(default: where it did)")
    p.add_argument("--connections-per-address", type=int, default=4,
                   help="TCP connections one address may hold to the broker, in broker/firewall.nft (default 4: "
                        "a device needs two while a reconnect overlaps; raise it for devices behind one NAT)")
    p.add_argument("--idle-addresses", type=int, default=IDLE_ADDRESSES,
                   help=f"room in max_connections for this many source addresses holding --connections-per-address "
                        f"idle sockets each (default {IDLE_ADDRESSES}; about 46 kB of broker memory a socket): with "
                        "firewall.nft loaded, locking devices out takes more addresses than that")
    p.add_argument("--auth", choices=["cert", "password", "both"], default="cert",
                   help="client certificates (default), passwords, or both")
    p.add_argument("--max-message-bytes", type=int, default=1_000_000, help="broker.max_message_bytes (MQTT message)")
    p.add_argument("--update-mb", type=float, default=5.0,
                   help="approximate size of one model update, to size the broker's queues (default 5)")
    p.add_argument("--broker-dir", default=None,
                   help="where the broker's files will be on the broker host (default: OUT/broker, absolute)")
    p.add_argument("--absolute-paths", action="store_true",
                   help="write absolute paths into the YAML files (default: relative to each file's folder)")
    p.add_argument("--force", action="store_true", help="replace an existing provisioned --out")
    p.add_argument("--site", action="append", default=[], metavar="SITE:DEVICE,DEVICE",
                   help="a site aggregator and its site's devices (repeat per site): the aggregator is an agent of "
                        "this federation, its site a federation of its own under OUT/sites/SITE/ with its broker, "
                        "and OUT/sites/SITE/aggregator.yaml joins the two (docs/OPERATING.md, Sites)")
    p.add_argument("--site-mode", choices=("exact", "summary"), default="exact",
                   help="how the sites speak to the coordinator (sites.mode): exact (every device through it, the flat "
                        "fleet's state bit for bit) or summary (counts and totals: its work per round does not grow "
                        "with the devices; docs/OPERATING.md, Sites)")
    p.add_argument("--site-host", action="append", default=[], metavar="SITE=HOST",
                   help="the host name a site's devices reach its broker at (default: the site's id)")
    return p


def _names(values: str | list[str] | None) -> list[str]:
    items = values if isinstance(values, list) else [values or ""]
    return [n.strip() for v in items for n in v.split(",") if n.strip()]


def _sites(values: list[str]) -> dict[str, list[str]]:
    """``--site SITE:DEVICE,DEVICE`` values as site id -> devices; ProvisionError for a malformed one."""
    sites: dict[str, list[str]] = {}
    for value in values:
        site, colon, devices = value.partition(":")
        names = _names(devices)
        if not colon or not site.strip() or not names:
            raise ProvisionError(f"--site {value!r}: write SITE:DEVICE,DEVICE (the site aggregator's id, then its "
                                 "devices)")
        check_agent_ids([site.strip(), *names])
        sites[site.strip()] = names
    named = [site for site in sites] + [d for devices in sites.values() for d in devices]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:
        raise ProvisionError(f"--site: {twice[0]} is named twice (a device is in one site, and no device is a site)")
    return sites


def main_provision(argv: list[str]) -> int:
    """``edgepfl provision ...``; returns the exit code (2 and one line on bad input)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()
    try:
        if args.add:
            record = add_agents(out, _names(args.add), bind=args.bind)
            print(_summary(record, out, added=_names(args.add)))
            return 0
        if not args.federation or not args.broker_host:
            raise ProvisionError("--federation and --broker-host are required (or --add to extend an existing --out)")
        sites = _sites(args.site)
        agents = [f"agent-{i:02d}" for i in range(args.count)] if args.count else _names(args.agents)
        agents += [site for site in sites if site not in agents]
        if not agents:
            raise ProvisionError("name the agents: --agents a1,a2 or --count N (or the sites: --site SITE:DEVICE,...)")
        if out.exists() and any(out.iterdir()):
            if not args.force:
                raise ProvisionError(f"{out} exists and is not empty: pass --force to replace it, or --add to extend it")
            if (out / "provision.json").exists():
                shutil.rmtree(out)
        if args.max_message_bytes < 16_384:
            raise ProvisionError("--max-message-bytes must be at least 16384")
        record = ProvisionRecord(
            federation=args.federation, broker_hosts=_names(args.broker_host), port=args.port, auth=args.auth,
            agents=agents, max_message_bytes=args.max_message_bytes, update_bytes=int(args.update_mb * 2**20),
            broker_dir=args.broker_dir or str(out / "broker"), absolute_paths=args.absolute_paths,
            bind="127.0.0.1" if args.bind is None else args.bind, connections_per_address=args.connections_per_address,
            idle_addresses=args.idle_addresses, sites=sites, site_mode=args.site_mode,
            site_hosts=dict(item.split("=", 1) for item in _names(args.site_host) if "=" in item))
        provision(record, out)
        print(_summary(record, out))
        return 0
    except ValidationError as exc:  # the first problem, named by the option it came from
        problem = exc.errors()[0]
        field = str(problem["loc"][0]) if problem.get("loc") else ""
        option = _OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-")) if field else ""
        message = problem["msg"].removeprefix("Value error, ")
        print(f"edgepfl provision: {option + ': ' if option else ''}{message}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except ValueError as exc:  # ProvisionError, bad names (TopicError)
        print(f"edgepfl provision: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except OSError as exc:  # a file or folder it cannot read or write
        name = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"edgepfl provision: cannot use{name}: {exc.strerror or exc}", file=sys.stderr)
        return int(ExitCode.DATA)


#: ProvisionRecord fields whose command-line option is not ``--`` + the field's name
_OPTION_OF_FIELD = {"broker_hosts": "--broker-host", "update_bytes": "--update-mb", "agents": "--agents or --count",
                    "broker_dir": "--broker-dir"}
