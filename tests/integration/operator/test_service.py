"""Service hygiene against live processes: systemd readiness and watchdog through a real
NOTIFY_SOCKET, and a SIGTERM to ``simulate`` that leaves no agent process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from tests.fleet_helpers import release_frame, retained_state, wait_until


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


def _big_digits(path: Path, samples: int) -> Path:
    """An npz of ``samples`` noisy digits (8x8): a device with that much data of its own,
    which makes a head fit on it take tens of seconds, as a release install on a slow board does."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(digits.images), samples)
    x = np.clip(digits.images[idx] * 15 + rng.integers(0, 16, (samples, 8, 8)), 0, 255).astype(np.uint8)
    np.savez(path, x=x, y=digits.target[idx])
    return path


def test_sigterm_during_a_release_install_stops_at_once_and_keeps_the_installed_release(mosquitto, tmp_path):
    """A head agent with much data of its own installs a new release (minutes on a Pi, tens of
    seconds here); SIGTERM in the middle ends the install and the process at once (exit 0,
    the retained status 'offline'), the release installed before stays installed (never half of
    the new one), and on restart the agent restores it, drops what the cut install left, and
    comes online."""
    import paho.mqtt.publish as publish

    from edgepfl.config import DataSpec
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.head_tier import STATE_FILE, HeadRuntime
    from edgepfl.export.onnx_export import read_release
    from edgepfl.protocol import AgentChannel, agent_topic

    from tests.export_fixtures import export_dir

    first, second = export_dir(tmp_path / "a", "fedavg", rounds=1), export_dir(tmp_path / "b", "fedavg", rounds=2)
    data = _big_digits(tmp_path / "device.npz", 100_000)
    state = tmp_path / "state"
    # the release installed before: fitted on a slice of the device's data, quickly
    spec = DataSpec(dataset="npz", root=str(data), num_clients=40)
    manifest, artifact = read_release(first)
    old = HeadRuntime(state, "lr", load_client_data(spec, 0)).install_release(manifest, artifact,
                                                                               manifest.encoder.sha256)
    federation = f"t{uuid.uuid4().hex[:8]}"
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "agent_id": "pi-slow", "federation": federation, "tier": "head", "head": "lr",
        "broker": {"url": mosquitto.url}, "data": {"dataset": "npz", "root": str(data), "num_clients": 1},
        "state_dir": str(state),
    }))
    status = agent_topic(federation, "pi-slow", AgentChannel.STATUS)
    log = tmp_path / "agent.log"

    def start(**env: str) -> subprocess.Popen:
        with open(log, "a") as out:
            return subprocess.Popen([sys.executable, "-m", "edgepfl", "agent", "--config", str(config)],
                                    env=dict(os.environ, OMP_NUM_THREADS="1", **env), stdout=out,
                                    stderr=subprocess.STDOUT)

    # supervised as by systemd with WatchdogSec=2: the install, longer than that, must keep it fed
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    proc = start(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="2000000")
    try:
        wait_until(lambda: "online" in log.read_text(), timeout=120, what="the agent online")
        assert f"restored release {old.release_id}" in log.read_text()
        new_id = read_release(second)[0].release_id
        publish.single(agent_topic(federation, "pi-slow", AgentChannel.TASK), release_frame(federation, second, 2),
                       qos=1, hostname=mosquitto.host, port=mosquitto.port)
        wait_until(lambda: f"installing release {new_id}" in log.read_text(), timeout=60, what="the install begun")
        notify.setblocking(False)
        while True:  # what the message loop sent before the install
            try:
                notify.recv(512)
            except BlockingIOError:
                break
        notify.settimeout(30)
        # three pings (each due after a second) from inside the install: its feature steps, its fit
        assert [notify.recv(512) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        assert f"release {new_id} installed" not in log.read_text()  # still installing: it was fed
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        print(f"SIGTERM during a release install: exited after {time.monotonic() - stopping:.2f} s")
        text = log.read_text()
        assert "stopped during the release of round 2" in text, text[-3000:]
        assert f"release {new_id} installed" not in text
        assert retained_state(mosquitto.url, status) == "offline"
        # the switch was never made: the old release is the installed one, whole
        record = json.loads((state / STATE_FILE).read_text())
        assert record["release_id"] == old.release_id

        proc = start()
        wait_until(lambda: text.count("online") < log.read_text().count("online"), timeout=120,
                   what="the restarted agent online")
        again = log.read_text()[len(text):]
        assert f"restored release {old.release_id}" in again, again
        assert sorted(p.name for p in state.iterdir() if p.name.startswith(("encoder-", "head-"))) == \
            sorted([record["encoder_file"], record["head_file"]])
        wait_until(lambda: retained_state(mosquitto.url, status) == "online", timeout=30, what="status online")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
