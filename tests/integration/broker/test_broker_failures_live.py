"""A first connection that fails says why, within seconds.

Real failures, one per cause: a port nobody listens on, a host name that cannot resolve
(``.invalid`` is reserved, RFC 2606), a Mosquitto TLS listener whose CA the client does
not trust, and a wrong password. Before, all four were "could not reach MQTT broker"
after 60-120 s of silence. (Causes and retry policies in process:
tests/unit/core/test_broker_errors.py.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from edgepfl.broker import free_port
from edgepfl.protocol.connection import (
    BrokerLogin,
    BrokerUnreachable,
    FailureCause,
)
from edgepfl.protocol.transport import MqttTransport
from edgepfl.provision import main_provision
from edgepfl.testing import MosquittoBroker

from tests.conftest import require_mosquitto

# --------------------------------------------------------------------------- real failures


def _transport(url: str, login: BrokerLogin | None = None) -> MqttTransport:
    return MqttTransport(url, client_id=f"probe-{os.getpid()}", federation="probe", sender="probe",
                         subscriptions=[], login=login)


def _fails(transport: MqttTransport, timeout: float) -> tuple[BrokerUnreachable, float]:
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable) as err:
        transport.start(timeout=timeout)
    return err.value, time.monotonic() - started


def test_nothing_listening_is_retried_with_its_cause_logged_then_named(caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="edgepfl.protocol.transport"):
        err, took = _fails(_transport(f"mqtt://127.0.0.1:{port}"), timeout=4)
    assert err.cause is FailureCause.REFUSED
    assert f"127.0.0.1:{port} within 4s" in str(err) and "refused: nothing listens there" in str(err)
    assert 3.5 < took < 8
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) >= 2 and all("refused" in m for m in retries)


def test_unresolvable_host_names_dns():
    err, took = _fails(_transport("mqtt://nonexistent.invalid:1883"), timeout=3)
    assert err.cause is FailureCause.DNS
    assert "cannot resolve the broker's host name 'nonexistent.invalid'" in str(err)
    assert took < 15


def _provisioned(tmp_path: Path, name: str, auth: str) -> Path:
    out = tmp_path / name
    assert main_provision(["--federation", "probe", "--agents", "pi-01", "--broker-host", "localhost",
                           "--out", str(out), "--auth", auth]) == 0
    return out


def test_untrusted_broker_certificate_fails_at_once_naming_tls(tmp_path):
    require_mosquitto()
    ours, theirs = _provisioned(tmp_path, "ours", "password"), _provisioned(tmp_path, "theirs", "password")
    with MosquittoBroker(conf=theirs / "broker" / "mosquitto.conf") as broker:
        # our CA, their broker: the broker's certificate does not chain to what we trust
        login = BrokerLogin(username="pi-01", password="x", ca_file=str(ours / "ca" / "ca.crt"))
        err, took = _fails(_transport(broker.url, login), timeout=60)
        assert err.cause is FailureCause.TLS and "TLS verification" in str(err) and "broker.ca_file" in str(err)
        assert took < 5
        # and without a CA file: the system store does not know a private CA either
        err, took = _fails(_transport(broker.url, BrokerLogin(username="pi-01", password="x")), timeout=60)
        assert err.cause is FailureCause.TLS and took < 5


def test_wrong_password_fails_at_once_naming_the_user(tmp_path):
    require_mosquitto()
    out = _provisioned(tmp_path, "p", "password")
    ca = str(out / "ca" / "ca.crt")
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        err, took = _fails(_transport(broker.url, BrokerLogin("pi-01", "wrong", ca_file=ca)), timeout=60)
        assert err.cause is FailureCause.AUTH and "refused user 'pi-01'" in str(err)
        assert took < 5
        right = (out / "agents" / "pi-01" / "password").read_text().strip()
        transport = _transport(broker.url, BrokerLogin("pi-01", right, ca_file=ca)).start(timeout=10)
        transport.stop()


def test_missing_client_certificate_fails_naming_it(tmp_path):
    require_mosquitto()
    out = _provisioned(tmp_path, "p", "cert")
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        login = BrokerLogin("pi-01", ca_file=str(out / "ca" / "ca.crt"))
        err, took = _fails(_transport(broker.url, login), timeout=4)
        # TLS 1.3: the broker's alert may arrive after the handshake, or only as a closed socket
        assert err.cause in (FailureCause.TLS_CLIENT, FailureCause.CLOSED)
        assert "no TLS certificate" in str(err) or "rejected this client's TLS certificate" in str(err)
        assert took < 10


def test_agent_process_prints_one_line_naming_the_cause(tmp_path):
    """What an operator sees: ``edgepfl agent`` against a broker whose CA it does not trust."""
    require_mosquitto()
    ours, theirs = _provisioned(tmp_path, "ours", "cert"), _provisioned(tmp_path, "theirs", "cert")
    with MosquittoBroker(conf=theirs / "broker" / "mosquitto.conf") as broker:
        bundle = ours / "agents" / "pi-01"
        agent = yaml.safe_load((bundle / "agent.yaml").read_text())
        agent["broker"]["url"] = broker.url
        agent["data"] = {"dataset": "auto", "samples_per_client": 50, "num_clients": 2}
        (bundle / "agent.yaml").write_text(yaml.safe_dump(agent))
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "edgepfl.cli", "--log-level", "error", "agent", "--config",
                               "agent.yaml"], cwd=bundle, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        took = time.monotonic() - started
    assert proc.returncode == 4, proc.stderr[-2000:]  # the broker exit code (docs/OPERATING.md, exit codes)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgepfl: TLS verification of MQTT broker"), proc.stderr[-2000:]
    assert took < 40  # data loading and imports included; the connection itself fails at once


@pytest.mark.timeout(300)
def test_an_agent_that_finds_its_broker_full_says_so_keeps_trying_and_gets_in_once_there_is_room(tmp_path):
    """The red team filled a provisioned broker's ``max_connections`` with idle TCP sockets (no
    credentials) and started an agent: it exited 4 blaming its client certificate. Here the
    same, live: a Mosquitto from ``provision``'s ``mosquitto.conf`` (20 connections for one
    device), one idle socket more than that from this host, then ``edgepfl agent`` from its
    bundle. It must say the broker may be full, keep running, and connect once the idle
    sockets are gone. (What keeps them out in the first place: test_idle_sockets.py.)"""
    import re
    import socket

    require_mosquitto()
    out = _provisioned(tmp_path, "full", "cert")
    limit = int(re.search(r"^max_connections (\d+)", (out / "broker" / "mosquitto.conf").read_text(), re.M).group(1))
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        idle = [socket.create_connection(("127.0.0.1", broker.port), timeout=10) for _ in range(limit + 1)]
        proc = None
        log = tmp_path / "agent.log"
        try:
            bundle = out / "agents" / "pi-01"
            agent = yaml.safe_load((bundle / "agent.yaml").read_text())
            agent["broker"]["url"] = broker.url
            agent["data"] = {"dataset": "auto", "samples_per_client": 50, "num_clients": 2}
            (bundle / "agent.yaml").write_text(yaml.safe_dump(agent))
            with open(log, "wb") as sink:
                proc = subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "--log-level", "info", "agent",
                                         "--config", "agent.yaml"], cwd=bundle, stdout=sink, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
            # no deadline of ours: run by hand, the agent gives up after 120 s (an exit the loops catch)
            while "may be full (max_connections)" not in log.read_text(errors="replace"):
                assert proc.poll() is None, f"the agent exited {proc.returncode}:\n{log.read_text()[-2000:]}"
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()[-2000:]  # retrying, not exit 4
            assert "rejected this client's TLS certificate" not in log.read_text(errors="replace")
            for sock in idle:
                sock.close()
            idle = []
            while "(trainer tier) online" not in log.read_text(errors="replace"):
                assert proc.poll() is None, f"the agent exited {proc.returncode}:\n{log.read_text()[-2000:]}"
                time.sleep(0.2)
        finally:
            for sock in idle:
                sock.close()
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


# --------------------------------------------------------------------------- a broker that stops


def test_a_broker_stopped_mid_publish_is_not_taken_for_a_size_limit(caplog):
    """Mosquitto dies with a message unacknowledged (nothing was acknowledged yet): the
    transport says the connection was lost with it unacknowledged, never that the broker
    refuses its size; the broker back on its port acknowledges the re-sent message."""
    import signal

    require_mosquitto()
    broker = MosquittoBroker()
    broker.start()
    port = broker.port
    t = MqttTransport(broker.url, client_id="edgepfl-stopped-broker", federation="stopped", sender="a1",
                      subscriptions=[], max_message_bytes=4_000_000)
    t.start(timeout=30)
    try:
        with caplog.at_level(logging.INFO, "edgepfl.protocol.transport"):
            os.kill(broker.pid, signal.SIGSTOP)  # frozen: it reads nothing more, so it acknowledges nothing
            t.publish("edgepfl/v1/stopped/agents/a1/update", b"z" * 3_000_000)
            time.sleep(0.5)
            os.kill(broker.pid, signal.SIGKILL)  # the broker dies mid-publish
            broker.stop()
            def lost_lines() -> list[str]:
                return [r.getMessage() for r in caplog.records if "lost connection" in r.getMessage()]

            # the network thread marks the connection down, then logs why: wait for both
            deadline = time.monotonic() + 30
            while (t.connected.is_set() or not lost_lines()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not t.connected.is_set()
            lost = lost_lines()
            assert lost and "1 message(s) of 3" in lost[0] and "unacknowledged" in lost[0], lost

            broker = MosquittoBroker(port=port)
            broker.start()
            deadline = time.monotonic() + 60  # paho's reconnect backoff
            while t.unacked_bytes and time.monotonic() < deadline:
                time.sleep(0.2)
            assert t.unacked_bytes == 0  # re-sent after the reconnect and acknowledged
    finally:
        t.stop()
        broker.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert not any("max_message_bytes" in r.getMessage() for r in caplog.records)
