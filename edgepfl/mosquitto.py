"""Mosquitto files for one federation: password file, ACL, and a sized ``mosquitto.conf``.

Written by ``edgepfl provision`` and read by Mosquitto 2.x, so the formats are Mosquitto's:

* :func:`password_line` — ``user:$7$ITERATIONS$SALT$HASH``, PBKDF2-HMAC-SHA512 with a
  12-byte salt and a 64-byte hash, base64 — what ``mosquitto_passwd`` writes, produced
  with hashlib so provisioning needs no Mosquitto installed;
* :func:`acl_text` — the pattern ACL of docs/PROTOCOL.md §17, tightened: each agent
  writes its own status/update/metrics and reads its own task, the coordinator presence
  and the release (whole or its retained parts ``release/+``); the coordinator reads the
  agents' side and writes tasks, its presence and the release; nothing reads ``#``;
* :func:`broker_sizing` and :func:`mosquitto_conf` — the listener and its limits, sized
  to the fleet and the message size, every number with a comment saying why;
* :func:`firewall_nft` — the nftables rules that cap connections per source address,
  the one limit Mosquitto 2.x lacks.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .protocol.topics import check_segment

AuthMode = Literal["cert", "password", "both"]

#: The user name (and client certificate CN) of the coordinator; no agent may take it.
COORDINATOR_USER = "coordinator"
#: The user name of operators' tools (``edgepfl status``, dashboards): they may read the fleet view only.
OPERATOR_USER = "operator"
#: mosquitto_passwd's iteration count. The passwords provision makes are 192-bit random
#: tokens, so the hash's work factor adds nothing against guessing; keep Mosquitto's default.
PBKDF2_ITERATIONS = 101
#: Bytes a chunk frame carries besides its slice (docs/PROTOCOL.md §8, ``step = M − 2048``).
CHUNK_OVERHEAD = 2048
#: Room above ``max_message_bytes`` for the MQTT fixed header and topic (receivers accept +64 KiB, §15).
PACKET_HEADROOM = 65_536
#: The client's in-flight QoS 1 window (MqttTransport: ``max_inflight_messages_set(100)``).
CLIENT_INFLIGHT = 100
#: Source addresses whose idle sockets ``max_connections`` leaves room for by default, each at
#: its ``firewall.nft`` limit (``provision --idle-addresses``); about 46 kB of broker memory per
#: socket (Mosquitto 2.0, TLS listener), so 128 addresses at 4 connections cost about 24 MB
IDLE_ADDRESSES = 128


def password_line(username: str, password: str, *, salt: bytes | None = None,
                  iterations: int = PBKDF2_ITERATIONS) -> str:
    """One line of a Mosquitto 2.x password file (``$7$``: PBKDF2-HMAC-SHA512)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, dklen=64)
    return f"{username}:$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


#: what each role may read and write, as topic filters under ``edgepfl/v1/<federation>/``
#: (``<id>``: the agent's own id); docs/SECURITY.md states the same table, and
#: tests/integration/security/test_provisioned_federation.py asserts it against a live Mosquitto
AGENT_READS = ("agents/<id>/task", "coordinator", "release", "release/+")
AGENT_WRITES = ("agents/<id>/status", "agents/<id>/update", "agents/<id>/metrics")
COORDINATOR_READS = ("agents/+/status", "agents/+/update", "agents/+/metrics")
COORDINATOR_WRITES = ("agents/+/task", "coordinator", "release", "release/+", "view")
OPERATOR_READS = ("view",)


def acl_text(federation: str) -> str:
    """The ``acl_file`` confining every client of ``federation`` to its own side of each topic.

    Mosquitto applies ``pattern`` lines to every user, the coordinator and the operator
    included: their sections deny, topic by topic, what the agents' patterns would give
    them beyond their role (exact topics or ``+``: a ``deny`` ending in ``#`` does not
    hold in Mosquitto 2.0). The coordinator keeps reading what it writes itself (its
    presence and the release).
    """
    check_segment(federation, "federation")
    base = f"edgepfl/v1/{federation}"

    def own(user: str) -> list[str]:  # the agents' patterns, with the user name for %u
        return [f"{base}/{t.replace('<id>', user)}" for t in (*AGENT_WRITES, *AGENT_READS)]

    coordinator_own = [t for t in own(COORDINATOR_USER) if "/agents/" in t]
    return "\n".join([
        f"# edgepfl federation {federation}: who may read and write which topic (docs/PROTOCOL.md §2, §17;",
        "# docs/SECURITY.md, 'Who reaches which topic'). The MQTT user name is the agent id (password file)",
        "# or the client certificate's CN (use_identity_as_username), so one pattern (%u) covers every agent,",
        "# present and future.",
        "",
        "# The coordinator: reads every agent's status/update/metrics; writes tasks, its presence, the release",
        "# and the operators' fleet view; the agents' patterns below give it nothing of an agent's own.",
        f"user {COORDINATOR_USER}",
        *(f"topic read {base}/{t}" for t in COORDINATOR_READS),
        *(f"topic write {base}/{t}" for t in COORDINATOR_WRITES),
        *(f"topic deny {t}" for t in coordinator_own),
        "",
        "# Operators' tools (edgepfl status, dashboards): the fleet view only.",
        f"user {OPERATOR_USER}",
        *(f"topic read {base}/{t}" for t in OPERATOR_READS),
        *(f"topic deny {t}" for t in own(OPERATOR_USER)),
        "",
        "# Every agent: writes only its own status/update/metrics, reads only its own task,",
        "# the coordinator's presence and the release (whole, or its retained parts release/<i>).",
        "# Nothing else, and no '#'.",
        *(f"pattern write {base}/{t.replace('<id>', '%u')}" for t in AGENT_WRITES),
        *(f"pattern read {base}/{t.replace('<id>', '%u')}" for t in AGENT_READS),
        "",
    ])


@dataclass(frozen=True)
class BrokerSizing:
    """Mosquitto's limits for a fleet (see :func:`broker_sizing`)."""

    clients: int
    max_connections: int
    max_packet_size: int
    max_inflight_messages: int
    max_queued_messages: int
    chunks_per_update: int
    open_files: int  # LimitNOFILE the broker's host must allow
    #: the connections of max_connections left for idle sockets (per_address x idle_addresses)
    idle_room: int = 0


def broker_sizing(agents: int, max_message_bytes: int, update_bytes: int, *, per_address: int = 4,
                  idle_addresses: int = IDLE_ADDRESSES) -> BrokerSizing:
    """Limits for ``agents`` devices plus the coordinator, messages of ``max_message_bytes``
    and model updates of about ``update_bytes``.

    * connections: every client, plus a quarter (a device that reconnects before the
      broker noticed its old connection dead holds two for up to 1.5 keepalives), 16
      for operators' tools, and room for ``idle_addresses`` source addresses holding
      ``per_address`` sockets each (the firewall's limit): Mosquitto counts a socket that
      never sends a word against ``max_connections``, so without that room a few
      addresses lock every reconnecting device out;
    * packet size: one MQTT message of ``max_message_bytes`` plus topic and header room;
    * in-flight: the clients' own QoS 1 window, so chunked frames stream without stalls;
    * queue: the coordinator's session receives every sampled agent's update at once,
      each ``chunks_per_update`` messages; twice that, and never under Mosquitto's 1000.
    """
    clients = agents + 1
    max_connections = clients + math.ceil(clients / 4) + 16 + per_address * idle_addresses
    chunks = max(1, math.ceil(update_bytes / (max_message_bytes - CHUNK_OVERHEAD)))
    return BrokerSizing(
        clients=clients,
        max_connections=max_connections,
        max_packet_size=max_message_bytes + PACKET_HEADROOM,
        max_inflight_messages=CLIENT_INFLIGHT,
        max_queued_messages=max(1000, 2 * agents * chunks),
        chunks_per_update=chunks,
        open_files=max_connections + 64,
        idle_room=per_address * idle_addresses,
    )


def mosquitto_conf(*, federation: str, port: int, broker_dir: str, auth: AuthMode, sizing: BrokerSizing,
                   max_message_bytes: int, bind: str = "127.0.0.1") -> str:
    """``mosquitto.conf`` for the federation: one TLS listener, authentication, the ACL and the limits.

    ``broker_dir`` is where ``ca.crt``, ``server.crt``, ``server.key``, ``passwd`` and
    ``acl`` lie on the broker host (Mosquitto resolves relative paths against its
    working directory, not the config's, so the paths are absolute).
    """
    d = broker_dir.rstrip("/")
    s = sizing
    lines = [
        f"# Mosquitto 2.x configuration for edgepfl federation {federation!r}, written by edgepfl provision.",
        f"# Sized for {s.clients - 1} agents + the coordinator and MQTT messages of {max_message_bytes} bytes.",
        f"# The broker needs {s.open_files} open files: with systemd, `systemctl edit mosquitto` and set",
        f"#   [Service]\n#   LimitNOFILE={s.open_files}",
        "# Started as root, Mosquitto switches to the user 'mosquitto', which must be able to read",
        f"# {d}/ (server.key, acl, passwd): chown them to it, or start it as their owner.",
        "",
        f"# Listens on {bind} only (edgepfl provision --bind): never on an interface nobody chose.",
        f"listener {port} {bind}",
        "# TLS with the federation's private CA; clients verify server.crt against ca.crt and the host name.",
        f"cafile {d}/ca.crt",
        f"certfile {d}/server.crt",
        f"keyfile {d}/server.key",
        "tls_version tlsv1.2",
    ]
    if auth in ("cert", "both"):
        lines += ["# Every client presents a certificate signed by the CA.", "require_certificate true"]
    if auth == "cert":
        lines += ["# ... and its CN (the agent id, or 'coordinator') is its user name, which the ACL's %u matches.",
                  "use_identity_as_username true"]
    lines += [
        "# The client id is the user name: a device's credentials can never take over another client's id",
        "# (without this, a device connecting with the coordinator's client id kicks the coordinator off).",
        "use_username_as_clientid true",
        f"# {s.clients} clients + reconnect overlap + operators' tools + room for {s.idle_room} idle sockets: a TCP",
        "# connection counts from the moment it opens, CONNECT or not (one that never sends CONNECT is closed",
        "# after about 90 s); with firewall.nft loaded, filling that room takes that many sockets / the",
        "# per-address limit source addresses at once (edgepfl provision --idle-addresses).",
        f"max_connections {s.max_connections}",
        "",
        "allow_anonymous false",
    ]
    if auth in ("password", "both"):
        lines += ["# Hashed (PBKDF2-SHA512) passwords; add a device with edgepfl provision --add, then SIGHUP mosquitto.",
                  f"password_file {d}/passwd"]
    lines += [
        "# Each agent reads and writes only its own topics; the coordinator only its side.",
        f"acl_file {d}/acl",
        "",
        f"# One MQTT message of broker.max_message_bytes ({max_message_bytes}) + topic and header room;",
        "# larger frames travel in chunks. Keep broker.max_message_bytes in every config at or below it.",
        f"max_packet_size {s.max_packet_size}",
        "# edgepfl clients keep 100 QoS 1 messages in flight; let the broker do the same towards them.",
        f"max_inflight_messages {s.max_inflight_messages}",
        f"# All sampled agents' updates ({s.chunks_per_update} message(s) each) reach the coordinator at once: queue",
        "# them rather than drop them. Worst-case memory is max_queued_messages x max_packet_size per client.",
        f"max_queued_messages {s.max_queued_messages}",
        "max_queued_bytes 0",
        "",
        "# Retained status, presence and the release survive a broker restart only with persistence:",
        "#   persistence true",
        "#   persistence_location /var/lib/mosquitto/",
        "",
    ]
    return "\n".join(lines)


def firewall_nft(*, federation: str, port: int, per_address: int) -> str:
    """nftables rules for the broker host: at most ``per_address`` TCP connections to ``port``
    from any one source address; one more is reset before it reaches Mosquitto.

    Mosquitto counts every open TCP connection against ``max_connections``, handshake done
    or not, and has no limit per address: without these rules a few dozen idle sockets from
    one host, no credentials needed, fill the broker and every (re)connecting device is
    refused. The file reloads idempotently (``nft -f``) and touches only its own table.
    """
    table = "edgepfl_" + re.sub(r"[^A-Za-z0-9_]", "_", federation)  # an nft identifier
    rule = "tcp dport {port} ct state new add @{set} {{ {family} saddr ct count over {n} }} reject with tcp reset"
    return "\n".join([
        "#!/usr/sbin/nft -f",
        f"# nftables rules for edgepfl federation {federation!r}, written by edgepfl provision.",
        f"# At most {per_address} connections to port {port} from one address (edgepfl provision",
        "# --connections-per-address): a device needs one, two while a reconnect overlaps; devices",
        "# behind one NAT address share the limit. Mosquitto has no such limit of its own, and a",
        "# socket that never finishes its TLS handshake holds one of its max_connections.",
        f"# Load as root: nft -f firewall.nft (reloading replaces table inet {table} only);",
        "# to keep it across reboots, include it from /etc/nftables.conf.",
        f"table inet {table}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        "\tset per_address_v4 {\n\t\ttype ipv4_addr\n\t\tflags dynamic\n\t}",
        "\tset per_address_v6 {\n\t\ttype ipv6_addr\n\t\tflags dynamic\n\t}",
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        "\t\t" + rule.format(port=port, set="per_address_v4", family="ip", n=per_address),
        "\t\t" + rule.format(port=port, set="per_address_v6", family="ip6", n=per_address),
        "\t}",
        "}",
        "",
    ])


def check_agent_ids(agent_ids: list[str]) -> None:
    """Agent ids must be topic segments, unique, and never the coordinator's or the operators' user name."""
    seen: set[str] = set()
    for agent_id in agent_ids:
        check_segment(agent_id, "agent id")
        if agent_id in (COORDINATOR_USER, OPERATOR_USER):
            raise ValueError(f"agent id {agent_id!r} is the {agent_id}'s user name; choose another")
        if agent_id in seen:
            raise ValueError(f"agent id {agent_id!r} given twice")
        seen.add(agent_id)


def read_password_users(path: Path) -> dict[str, str]:
    """The lines of an existing password file, by user (to keep them when agents are added)."""
    users: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if ":" in line:
                users[line.split(":", 1)[0]] = line
    return users
