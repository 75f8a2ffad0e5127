"""The shipped agent unit (examples/edgepfl-agent.service) under a real systemd.

A container boots this machine's own OS with ``systemd-nspawn --volatile=yes`` (a fresh,
empty /etc and /var on a tmpfs, /usr read-only from the host: no image to build), sharing
the host's network. The unit goes in as shipped, hardening included; a drop-in adapts only
where the interpreter is. Mosquitto runs on the host, on a port nothing listens on at first:

* started with its broker down, the unit is active (waiting); ``systemctl stop`` stops it
  within 10 s, with a clean result and exit status 0;
* started again with the broker down, it comes online by itself when the broker appears
  (its retained status says ``online``, ``systemctl is-active`` says active), installs a
  release sent to it, and a stop leaves its retained status ``offline``;
* its journal has only JSON lines (``--log-format json``): nothing that onnxruntime or
  anything else printed outside the logger.

Needs root and systemd-nspawn (Debian: systemd-container); without them it skips, and under
CI (``CI=true``) it fails. About 30-60 s, most of it the two agent starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import yaml

from tests.conftest import require_mosquitto, require_nspawn
from tests.fleet_helpers import release_frame, retained_state, wait_until

REPO = Path(__file__).resolve().parents[3]
UNIT = "edgepfl-agent.service"
AGENT = "pi-boot"
FEDERATION = f"sd{uuid.uuid4().hex[:8]}"
#: the shipped unit, its broker down, stops on `systemctl stop` within this
STOP_WITHIN_S = 10.0


def _container_tree(tmp: Path, broker_url: str) -> tuple[list[str], str]:
    """Files for the container and the nspawn binds that place them: the unit and its drop-in,
    the agent's config, a venv at the unit's /opt/edgepfl/venv made of this interpreter, this
    checkout and the packages it imports (all read-only). Returns (bind options, unit text)."""
    binds = [f"--bind-ro={REPO}:/opt/edgepfl/src"]
    etc = tmp / "etc"
    (etc / "edgepfl").mkdir(parents=True)
    # not a first boot: no presets (which would enable every service installed on the host)
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    (etc / "sysusers.d").mkdir()
    (etc / "sysusers.d" / "edgepfl.conf").write_text('u edgepfl - "edgepfl agent" /var/lib/edgepfl\n')
    (etc / "edgepfl" / "agent.yaml").write_text(yaml.safe_dump({
        "agent_id": AGENT, "federation": FEDERATION, "tier": "head", "broker": {"url": broker_url},
        "data": {"dataset": "digits", "num_clients": 4}, "state_dir": "/var/lib/edgepfl/state"}))
    unit = (REPO / "examples" / UNIT).read_text()
    system = etc / "systemd" / "system"
    (system / f"{UNIT}.d").mkdir(parents=True)
    (system / UNIT).write_text(unit)
    # The interpreter: where it is not under /usr (pyenv, say, under /root, which the unit's
    # ProtectHome= hides) its prefix is bound at /opt/edgepfl/python.
    base = Path(sys.base_prefix)
    if base.parts[1:2] == ("usr",):
        home = base / "bin"
    else:
        binds.append(f"--bind-ro={base}:/opt/edgepfl/python")
        home = Path("/opt/edgepfl/python/bin")
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (system / f"{UNIT}.d" / "test.conf").write_text(
        "[Service]\n"
        # libpython where the interpreter was built to find it elsewhere (pyenv's RUNPATH)
        f"Environment=LD_LIBRARY_PATH={home.parent / 'lib'}\n")
    # the installed layout of edgepfl (pyproject: coordinator/ is edgepfl.coordinator, ...) as
    # links into the bound checkout; the venv's other packages as plain path entries, so that
    # no editable-install finder maps edgepfl to a path outside the container
    app = tmp / "app" / "edgepfl"
    app.mkdir(parents=True)
    for entry in sorted((REPO / "edgepfl").iterdir()):
        if entry.name != "__pycache__":
            (app / entry.name).symlink_to(f"/opt/edgepfl/src/edgepfl/{entry.name}")
    for name in ("coordinator", "edge_agent", "export"):
        (app / name).symlink_to(f"/opt/edgepfl/src/{name}")
    binds.append(f"--bind-ro={tmp / 'app'}:/opt/edgepfl/app")
    sites = []
    for i, site in enumerate(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))):
        binds.append(f"--bind-ro={site}:/opt/edgepfl/site{i}")
        sites.append(f"/opt/edgepfl/site{i}")
    venv = tmp / "venv"
    packages = venv / "lib" / python / "site-packages"
    packages.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to(home / python)
    (packages / "edgepfl-under-test.pth").write_text("\n".join(["/opt/edgepfl/app", *sites]) + "\n")
    script = venv / "bin" / "edgepfl"
    script.write_text("#!/opt/edgepfl/venv/bin/python\nimport sys\nfrom edgepfl.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    binds.append(f"--bind-ro={venv}:/opt/edgepfl/venv")
    for path in sorted(p for p in etc.rglob("*") if p.is_file()):
        binds.append(f"--bind-ro={path}:/{path.relative_to(tmp)}")
    return binds, unit


class Container:
    """This machine's OS booted under systemd-nspawn; commands run inside with nsenter."""

    def __init__(self, nspawn: str, binds: list[str], log: Path):
        self.machine = f"edgepfl-{uuid.uuid4().hex[:8]}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [nspawn, "--directory=/", "--volatile=yes", "--boot", f"--machine={self.machine}", "--register=no", "--keep-unit",
             "--settings=no", "--console=pipe", "--link-journal=no", "--resolv-conf=off", "--timezone=off", *binds],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log
        self.leader: int | None = None

    def boot(self, timeout: float) -> None:
        def leader() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            self.leader = int(children[0]) if children else None
            return self.leader is not None
        wait_until(leader, timeout=timeout, what="the container's init")
        wait_until(lambda: self.run("systemctl", "is-system-running", check=False).stdout.strip()
                   in ("running", "degraded"), timeout=timeout, interval=0.5, what="the container booted")

    def run(self, *command: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *command], capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {proc.returncode}: {proc.stdout[-1000:]}"
                                 f"{proc.stderr[-1000:]}")
        return proc

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> list[str]:
        """What the unit's own processes wrote (systemd's lines about the unit excluded)."""
        return self.run("journalctl", f"_SYSTEMD_UNIT={unit}", "--output=cat", "--no-pager").stdout.splitlines()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.leader is not None:
                self.run("systemctl", "poweroff", check=False, timeout=30)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()  # init of a PID namespace: its processes go with it
                self.proc.wait()
            self._log.close()
            # nspawn leaves its mount-propagation directory when it cannot remove it itself
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.machine}", ignore_errors=True)


def test_the_agent_unit_stops_at_once_and_comes_online_by_itself_under_systemd(tmp_path):
    import paho.mqtt.publish as publish

    from edgepfl.broker import free_port
    from edgepfl.protocol import AgentChannel, agent_topic
    from edgepfl.testing import MosquittoBroker

    from tests.export_fixtures import export_dir

    nspawn = require_nspawn()
    require_mosquitto()
    began = time.monotonic()
    exported = export_dir(tmp_path / "release", "fedavg", rounds=1)
    release = release_frame(FEDERATION, exported, 1)
    release_id = json.loads((exported / "manifest.json").read_text())["release_id"]
    status = agent_topic(FEDERATION, AGENT, AgentChannel.STATUS)
    port = free_port(restartable=True)  # nothing listens there until the broker starts
    broker = MosquittoBroker(port=port)
    binds, unit_text = _container_tree(tmp_path / "tree", f"mqtt://127.0.0.1:{port}")
    # the shipped hardening is what runs here: the drop-in only says where libpython is
    assert "ProtectSystem=strict" in unit_text and "PrivateUsers=true" in unit_text
    container = Container(nspawn, binds, tmp_path / "container.log")
    try:
        container.boot(timeout=120)

        def retrying(since: int) -> bool:
            return any("retrying in" in line for line in container.journal(UNIT)[since:])

        # 1. started with its broker down: ready (it waits), then stopped within 10 s, cleanly
        container.run("systemctl", "start", UNIT, timeout=330)
        assert container.run("systemctl", "is-active", UNIT, check=False).stdout.strip() == "active"
        wait_until(lambda: retrying(0), timeout=60, interval=0.5, what="the agent retrying its broker")
        stopping = time.monotonic()
        container.run("systemctl", "stop", UNIT, timeout=60)
        took = time.monotonic() - stopping
        state = container.show(UNIT, "ActiveState", "Result", "ExecMainStatus")
        assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, state
        assert took < STOP_WITHIN_S, f"systemctl stop took {took:.1f} s"
        # the agent's own way out, not a kill: it said so, and systemd saw it exit
        assert any("stopped before its broker connection was up" in line for line in container.journal(UNIT))
        manager = container.run("journalctl", "-u", UNIT, "--output=cat", "--no-pager").stdout
        assert "code=killed" not in manager and "timed out" not in manager, manager[-2000:]

        # 2. started again with its broker down; the broker appears: online by itself
        seen = len(container.journal(UNIT))
        container.run("systemctl", "start", UNIT, timeout=330)
        wait_until(lambda: retrying(seen), timeout=60, interval=0.5, what="the agent retrying its broker again")
        broker.start()
        wait_until(lambda: retained_state(broker.url, status) == "online", timeout=90, interval=1,
                   what="the agent's retained status online")
        assert container.run("systemctl", "is-active", UNIT, check=False).stdout.strip() == "active"
        assert "connected to" in container.show(UNIT, "StatusText")["StatusText"]
        # a release installs under the shipped hardening (onnxruntime, the head fit, the state
        # directory), and its log lines are JSON too (checked below)
        publish.single(agent_topic(FEDERATION, AGENT, AgentChannel.TASK), release, qos=1, hostname=broker.host,
                       port=broker.port)
        wait_until(lambda: any(f"release {release_id} installed" in line for line in container.journal(UNIT)),
                   timeout=120, interval=1, what="the release installed")
        container.run("systemctl", "stop", UNIT, timeout=60)
        assert container.show(UNIT, "Result")["Result"] == "success"
        assert retained_state(broker.url, status) == "offline"

        # 3. JSON logs: every line the unit's processes wrote is one JSON object
        lines = container.journal(UNIT)
        assert lines
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                raise AssertionError(f"a non-JSON line in the unit's journal: {line!r}") from None
            assert isinstance(record, dict) and "message" in record, line
            if record.get("logger", "").startswith("edgepfl."):  # ours: each says which agent, of which federation
                assert (record.get("agent"), record.get("federation")) == (AGENT, FEDERATION), line
    finally:
        container.close()
        broker.stop()
    print(f"systemd unit test: {time.monotonic() - began:.0f} s; systemctl stop with the broker down: {took:.2f} s")
