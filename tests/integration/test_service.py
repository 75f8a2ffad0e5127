"""Service hygiene against live processes: systemd readiness and watchdog through a real
NOTIFY_SOCKET, and a SIGTERM to ``simulate`` that leaves no agent process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from tests.fleet_helpers import wait_until


def _children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


def test_agent_tells_systemd_it_is_ready_and_alive(mosquitto, tmp_path):
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "agent_id": "pi-notify", "federation": f"n{uuid.uuid4().hex[:8]}", "tier": "head",
        "broker": {"url": mosquitto.url}, "data": {"dataset": "digits", "num_clients": 4}, "state_dir": "state",
    }))
    notify = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(notify)
        sock.settimeout(120)
        env = dict(os.environ, NOTIFY_SOCKET=notify, WATCHDOG_USEC="1000000", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "edgepfl", "agent", "--config", str(config)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            first = sock.recv(512).decode()
            # supervised, the agent is ready at once, saying it waits for its broker, then says connected
            assert first.startswith("READY=1") and "waiting for the broker" in first
            while "connected to" not in (message := sock.recv(512).decode()):
                assert message == "WATCHDOG=1", message
            assert message.startswith("READY=1")
            assert sock.recv(64).decode() == "WATCHDOG=1"
            started = time.monotonic()
            assert sock.recv(64).decode() == "WATCHDOG=1"
            assert 0.2 < time.monotonic() - started < 5  # paced at half of WATCHDOG_USEC, not every loop turn
            proc.send_signal(signal.SIGTERM)
            messages = []
            while "STOPPING=1" not in messages:
                messages.append(sock.recv(64).decode())
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_sigterm_to_simulate_stops_its_agent_processes(mosquitto, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "federation": f"s{uuid.uuid4().hex[:8]}", "method": {"name": "fedavg"}, "model": {"arch": "mlp", "feature_dim": 16},
        "data": {"dataset": "digits", "num_clients": 2, "samples_per_client": 100}, "rounds": 500,
        "round_timeout_s": 60,
    }))
    sim = subprocess.Popen([sys.executable, "-m", "edgepfl", "simulate", "--config", str(config), "--broker",
                            mosquitto.url, "--out", str(tmp_path / "run")],
                           env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    agents: set[int] = set()
    try:
        wait_until(lambda: len(_children(sim.pid)) >= 2, timeout=120, what="two agent processes")
        agents = _children(sim.pid)
        # let the federation get going: the agents are connected and training
        wait_until(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), timeout=180, what="a first round")
        sim.send_signal(signal.SIGTERM)
        _, err = sim.communicate(timeout=60)
        assert sim.returncode == 143, err[-2000:]
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "edgepfl: terminated (SIGTERM)"
        assert not [pid for pid in agents if _alive(pid)], "agent processes outlived simulate"
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
        for pid in agents:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _agent_config(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "agent_id": "pi-boot", "federation": f"b{uuid.uuid4().hex[:8]}", "tier": "head",
        "broker": {"url": url}, "data": {"dataset": "digits", "num_clients": 4}, "state_dir": "state",
    }))
    return config


def test_an_agent_whose_broker_is_down_stops_at_sigterm_while_it_retries(tmp_path):
    """Run by hand with its broker down, the agent retries; SIGTERM ends the retries and the
    process (exit 0), instead of being ignored until the 120 s connection timeout."""
    from edgepfl.broker import free_port

    config = _agent_config(tmp_path, f"mqtt://127.0.0.1:{free_port()}")
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgepfl", "agent", "--config", str(config)],
                                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "retrying in" in log.read_text(), timeout=120, what="the agent retrying its broker")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
        assert "stopped before its broker connection was up" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_supervised_agent_waits_for_its_broker_and_comes_online_when_it_appears(tmp_path):
    """Under systemd (a real NOTIFY_SOCKET) a board that boots before its broker is up: the
    agent is ready, waiting, pings the watchdog while it retries, connects by itself when a
    broker appears on its port, and stops cleanly."""
    from edgepfl.broker import free_port
    from edgepfl.testing import MosquittoBroker

    from tests.conftest import require_mosquitto

    require_mosquitto()
    port = free_port(restartable=True)  # a broker starts on it later
    config = _agent_config(tmp_path, f"mqtt://127.0.0.1:{port}")
    notify = str(tmp_path / "notify.sock")
    broker = MosquittoBroker(port=port)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(notify)
        sock.settimeout(120)
        env = dict(os.environ, NOTIFY_SOCKET=notify, WATCHDOG_USEC="2000000", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "edgepfl", "agent", "--config", str(config)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            first = sock.recv(512).decode()
            assert first.startswith("READY=1") and "waiting for the broker" in first
            assert sock.recv(64).decode() == "WATCHDOG=1"  # alive while it retries
            broker.start()
            while "connected to" not in (message := sock.recv(512).decode()):
                assert message == "WATCHDOG=1", message
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in sock.recv(64).decode():
                pass
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            broker.stop()
