"""Idle sockets cannot lock devices out of a provisioned broker (docs/SECURITY.md, "Broker sizing").

Three network namespaces stand for three hosts: the broker host, running a real Mosquitto
from ``edgepfl provision``'s ``mosquitto.conf``; an attacker's host, which opens TCP
connections to the TLS port and never says a word (no credentials needed); and a device's
host, which connects with its bundle's certificate. First without ``firewall.nft``, to show
the attack works (the device is refused), then with it loaded by ``nft -f`` as the provision
summary says: the attacker holds at most ``--connections-per-address`` sockets, and the
device, reconnecting with an overlap as a real one does, gets in. Then from many addresses:
eight hold 32 sockets and the device still gets in (``max_connections`` leaves room for
``--idle-addresses`` of them); the residual — as many addresses as that room takes — locks
it out, which is what docs/SECURITY.md states.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import _require, require_mosquitto
from tests.unit.core.test_provision import provision

BROKER_IP, ATTACKER_IP, DEVICE_IP = "10.77.1.1", "10.77.1.2", "10.77.2.2"
PORT = 8883

#: opens ``count`` connections to the broker, waits, and says how each one fared; holds
#: the open ones until its stdin closes
IDLE_SOCKETS = r"""
import json, socket, sys, time
host, port, count, sources = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] or [None]
held, refused = [], 0
for source in sources:  # count connections from each source address (default: the host's own)
    for _ in range(count):
        s = socket.socket()
        s.settimeout(5)
        try:
            if source:
                s.bind((source, 0))
            s.connect((host, port))
            held.append(s)
        except OSError:
            refused += 1
time.sleep(1.5)  # a broker over max_connections accepts, then closes
open_ = 0
for s in held:
    s.setblocking(False)
    try:
        open_ += s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        open_ += 1  # nothing to read and not closed: the socket holds a slot
    except OSError:
        pass
print(json.dumps({"open": open_, "closed_by_broker": len(held) - open_, "refused": refused}), flush=True)
sys.stdin.read()
"""

#: connects ``count`` times with the device's certificate, the connections overlapping
#: (a device that reconnects before the broker noticed its old connection dead), and prints
#: each CONNACK's reason code, or null when none came
DEVICE = r"""
import json, sys, threading
import paho.mqtt.client as mqtt
host, port, bundle, client_id, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
codes, clients = [], []
for _ in range(count):
    got = threading.Event()
    code = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
    c.tls_set(ca_certs=f"{bundle}/ca.crt", certfile=f"{bundle}/client.crt", keyfile=f"{bundle}/client.key")
    c.on_connect = lambda cl, u, f, rc, p, code=code, got=got: (code.append(rc.value), got.set())
    try:
        c.connect(host, port, keepalive=30)
        c.loop_start()
        got.wait(10)
    except OSError:
        pass
    codes.append(code[0] if code else None)
    clients.append(c)
print(json.dumps(codes), flush=True)
for c in clients:
    c.loop_stop()
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Hosts:
    """Network namespaces ``broker``, ``attacker`` and ``device``; the broker's is the router."""

    def __init__(self) -> None:
        tag = f"epfl{os.getpid() % 100000}"
        self.ns = {role: f"{tag}-{role[0]}" for role in ("broker", "attacker", "device")}
        self.tag = tag
        self._added: set[str] = set()

    def up(self) -> Hosts:
        b = self.ns["broker"]
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for role, net, ip in (("attacker", "10.77.1", ATTACKER_IP), ("device", "10.77.2", DEVICE_IP)):
            ns, there, here = self.ns[role], f"{self.tag}{role[0]}", f"{self.tag}{role[0]}b"
            sh("ip", "link", "add", there, "netns", ns, "type", "veth", "peer", "name", here, "netns", b)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", there)
            sh("ip", "-n", b, "addr", "add", f"{net}.1/24", "dev", here)
            sh("ip", "-n", ns, "link", "set", there, "up")
            sh("ip", "-n", b, "link", "set", here, "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
        return self

    def attacker_addresses(self, count: int) -> list[str]:
        """``count`` addresses of the attacker's host (its own, then more on the same link)."""
        there = f"{self.tag}a"
        extra = [f"10.77.1.{i}" for i in range(3, count + 2)]
        for ip in extra:
            if ip not in self._added:
                sh("ip", "-n", self.ns["attacker"], "addr", "add", f"{ip}/24", "dev", there)
                self._added.add(ip)
        return [ATTACKER_IP, *extra]

    def run(self, role: str, *argv: str, **popen) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[role], *argv], **popen)

    def down(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def hosts():
    _require(shutil.which("nft") or shutil.which("/usr/sbin/nft"), "nftables is not installed: apt-get install nftables")
    if os.geteuid() != 0 or not shutil.which("ip"):
        _require(None, "network namespaces need root and iproute2")
    h = Hosts()
    try:
        h.up()
    except subprocess.CalledProcessError as exc:
        h.down()
        _require(None, f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    yield h
    h.down()


class Broker:
    """provision's mosquitto.conf, run on the broker host as its summary says (as root: ``user root``)."""

    def __init__(self, hosts: Hosts, conf: Path) -> None:
        self.log = conf.parent / "mosquitto.log"
        run_conf = conf.parent / "run.conf"
        run_conf.write_text(conf.read_text() + f"\nuser root\nlog_dest file {self.log}\nconnection_messages true\n")
        self.proc = hosts.run("broker", require_mosquitto(), "-c", str(run_conf),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if self.log.exists() and f"listen socket on port {PORT}" in self.log.read_text():
                return
            assert self.proc.poll() is None, self.log.read_text() if self.log.exists() else "mosquitto exited"
            time.sleep(0.05)
        raise AssertionError("mosquitto did not open its listener")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def idle_sockets(hosts: Hosts, count: int, sources: list[str] = ()) -> tuple[subprocess.Popen, dict]:
    """``count`` idle connections from each of ``sources`` (default: one, the attacker's address)."""
    proc = hosts.run("attacker", sys.executable, "-c", IDLE_SOCKETS, BROKER_IP, str(PORT), str(count), *sources,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def device_connects(hosts: Hosts, bundle: Path, overlapping: int) -> list[int | None]:
    done = hosts.run("device", sys.executable, "-c", DEVICE, BROKER_IP, str(PORT), str(bundle),
                     "edgepfl-demo-pi-01", str(overlapping), stdout=subprocess.PIPE, text=True)
    out, _ = done.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def release(attacker: subprocess.Popen) -> None:
    attacker.kill()
    attacker.wait()


def max_connections(out: Path) -> int:
    conf = (out / "broker" / "mosquitto.conf").read_text()
    return int(next(line.split()[1] for line in conf.splitlines() if line.startswith("max_connections")))


def load_firewall(hosts: Hosts, out: Path) -> None:
    """provision's firewall.nft, loaded on the broker host as its summary says."""
    subprocess.run(["ip", "netns", "exec", hosts.ns["broker"], "nft", "-f", str(out / "broker" / "firewall.nft")],
                   check=True, capture_output=True)


def test_idle_sockets_from_one_address_cannot_lock_a_device_out(tmp_path, hosts):
    # room for 16 idle addresses, not the default 128: twice max_connections stays within one process's files
    out = provision(tmp_path / "p", "--broker-host", BROKER_IP, "--bind", "0.0.0.0", "--idle-addresses", "16",
                    agents="pi-01,pi-02")
    limit = max_connections(out)
    bundle = out / "agents" / "pi-01"
    broker = Broker(hosts, out / "broker" / "mosquitto.conf")
    try:
        # without the rules: twice max_connections idle sockets, and the device is refused
        attacker, fared = idle_sockets(hosts, 2 * limit)
        assert fared["open"] >= limit - 1 and fared["refused"] == 0, fared
        assert device_connects(hosts, bundle, overlapping=1) == [None]
        release(attacker)

        load_firewall(hosts, out)
        attacker, fared = idle_sockets(hosts, 2 * limit)
        try:
            assert fared == {"open": 4, "closed_by_broker": 0, "refused": 2 * limit - 4}
            # an honest device reconnecting before the broker dropped its old connection holds two: both get in
            assert device_connects(hosts, bundle, overlapping=2) == [0, 0]
        finally:
            release(attacker)
        assert f"New client connected from {DEVICE_IP}" in broker.log.read_text()
    finally:
        broker.stop()


def test_idle_sockets_from_eight_addresses_leave_devices_room_and_the_residual_is_as_many_as_the_room_takes(
        tmp_path, hosts):
    """The red team's 32 idle sockets from 8 addresses filled max_connections with the rules
    loaded (they allow 4 per address). max_connections now leaves room for --idle-addresses
    addresses at the per-address limit: 8 leave the device room; the documented residual,
    about max_connections / 4 addresses at once (22 here, no client connected), locks it out."""
    out = provision(tmp_path / "p", "--broker-host", BROKER_IP, "--bind", "0.0.0.0", "--idle-addresses", "16",
                    agents="pi-01,pi-02")
    limit = max_connections(out)
    assert limit == 3 + 1 + 16 + 4 * 16  # clients, reconnect overlap, operators' tools, the room
    bundle = out / "agents" / "pi-01"
    broker = Broker(hosts, out / "broker" / "mosquitto.conf")
    load_firewall(hosts, out)
    held: list[subprocess.Popen] = []
    try:
        eight = hosts.attacker_addresses(8)
        attacker, fared = idle_sockets(hosts, 8, eight)  # twice the limit from each
        held.append(attacker)
        assert fared == {"open": 32, "closed_by_broker": 0, "refused": 32}, fared
        assert device_connects(hosts, bundle, overlapping=2) == [0, 0]

        # the residual: addresses enough to hold every connection the broker takes (Mosquitto 2.0.11
        # takes max_connections + 2, so max_connections / 4 + 1 of them at 4 each)
        needed = limit // 4 + 1
        attacker, fared = idle_sockets(hosts, 4, hosts.attacker_addresses(needed)[8:])
        held.append(attacker)
        assert fared["refused"] == 0 and 32 + fared["open"] >= limit, fared
        assert device_connects(hosts, bundle, overlapping=1) == [None]
        for proc in held:
            release(proc)
        held = []
        assert device_connects(hosts, bundle, overlapping=1) == [0]  # gone with the sockets
    finally:
        for proc in held:
            release(proc)
        broker.stop()
