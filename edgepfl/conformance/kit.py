"""The kit: plays the coordinator against one agent implementation and records verdicts.

Four scenarios, each with its own federation and agent process, on one real Mosquitto
the kit starts on a loopback port (:class:`edgepfl.testing.MosquittoBroker`; ``--port``
chooses it, ``--broker`` names a broker the kit does not start):

* ``session`` — presence, roll call, train / evaluate tasks and their updates, redelivery,
  two evaluate tasks whose accuracy shows the preprocessing and the class order
  (:mod:`.probes`), chunking both ways, the announced M, unknown fields and types, a
  NACK, tasks the agent must not run (a changed body, wrong data shape, a method it
  cannot run), a clean stop;
* ``reconnect`` — a broker restart (birth again, an answer held over the outage, a task
  after it) and the last will on ``kill -9``;
* ``signatures`` — a pinned coordinator key and an agent key: signed status and update,
  unsigned / foreign-key / wrongly addressed / expired / stale tasks ignored;
* ``head`` — a head agent (its own command, ``--head-agent-cmd``) joining late: releases
  retained whole and in parts, a release sent again on its task topic, seven it must refuse
  (corrupt, rolled back, expired, unsigned, foreign-signed, unsequenced), and the head
  agent's own birth, signatures, reconnect, clean stop and will (``--profile head``
  certifies a head-only device on these alone). The release is a real export (``edgepfl
  export`` run as a command, the core imports no app) of the task model's initial state.

The kit builds tasks with :mod:`edgepfl.protocol` exactly as the coordinator does; the
payload is FedAvg's initial shared parameters of the MLP of docs/MODELS.md, built by
:mod:`edgepfl.methods` (so the kit needs torch: ``edgepfl[train]``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np
import yaml

from edgepfl.codec_stages import CODECS, is_sparse
from edgepfl.protocol import (
    PROTOCOL_VERSION,
    AgentChannel,
    Capabilities,
    CoordinatorMeta,
    DataShape,
    FederationChannel,
    Message,
    MessageType,
    MethodChoice,
    MetricsMeta,
    NackMeta,
    Normalization,
    RefusalMeta,
    ReleaseMeta,
    ReleaseRef,
    RunSpec,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    UplinkSpec,
    agent_topic,
    bounded_json,
    encode,
    federation_topic,
    new_message_id,
    parse_version,
    release_part_topic,
    seed_for,
    split_frame,
)
from edgepfl.protocol.envelope import MAGIC, Body, encode_body
from edgepfl.protocol.evolution import MAJOR
from edgepfl.protocol.manifest import ReleaseManifest, release_tensors
from edgepfl.protocol.signing import Signer, generate_keypair, load_public_key, load_signer, verify
from edgepfl.specs import ModelSpec, TrainConfig
from edgepfl.testing import MosquittoBroker

from .checks import PROFILES, SCENARIOS, Report
from .wire import (
    CLASS_NAMES,
    HEAD_KIND,
    INPUT_SHAPE,
    TEST_FRACTION,
    AgentProcess,
    Frame,
    Wire,
    agent_config,
    read_retained,
    write_dataset,
)

if TYPE_CHECKING:
    from .probes import Probe

log = logging.getLogger("edgepfl.conformance")

#: the M the kit announces first, and the small one that forces the agent to chunk
LARGE_M, SMALL_M = 1_000_000, 16_384
#: methods whose model has a personal head (docs/METHODS.md): a train task of one is the probe
#: that personal parameters never leave the device, in the first of them the agent declares
PERSONALIZED_METHODS = ("fedrep", "fedper", "lgfedavg")
#: how long the agent should train on the task whose answer is held over a broker outage
HOLD_TRAIN_S = 4.0
#: epochs of the task that times the agent's training
TIMING_EPOCHS = 10
#: how long the kit watches an agent after a `done` presence
DONE_WAIT_S = 2.0


@dataclass
class KitOptions:
    """What ``edgepfl conformance`` was asked to do."""

    agent_cmd: str
    #: the head agent's command line for the ``head`` scenario (default: ``agent_cmd``)
    head_agent_cmd: str | None = None
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    #: where agents' inputs, state and logs go (default: a temporary directory, removed after)
    workdir: Path | None = None
    #: seconds the agent may take to answer one task
    answer_timeout_s: float = 60.0
    #: seconds the agent may take from its start to its first status
    start_timeout_s: float = 120.0
    #: after the answer to a later task: how long to keep listening for an answer that must not come
    quiet_s: float = 1.0
    #: the agent's own M in the config the kit writes for edgepfl's agent
    agent_max_message_bytes: int = LARGE_M
    #: what the implementation is certified as (:data:`~.checks.PROFILES`): ``trainer``, ``head`` or ``both``
    profile: str = "both"
    #: the port of the kit's Mosquitto (default: one the OS picks)
    port: int | None = None
    #: a broker the kit does not start (``mqtt://host:port``): the agent must reach it; the
    #: ``reconnect`` scenario, which restarts the broker, cannot run on it
    broker_url: str | None = None
    progress: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))


#: ``signer`` left out: the scenario's coordinator key (None in the unsigned scenarios)
_COORDINATOR_KEY = object()


class ExternalBroker:
    """A broker the kit uses but does not run (``--broker``): nothing to start or stop."""

    def __init__(self, url: str):
        parsed = urlsplit(url)
        if parsed.scheme != "mqtt" or not parsed.hostname:
            raise ValueError(f"--broker {url!r}: expected mqtt://HOST:PORT")
        self.url, self.host, self.port = url, parsed.hostname, parsed.port or 1883

    def start(self) -> str:
        return self.url

    def stop(self) -> None:
        """Not the kit's to stop."""


class ScenarioAborted(Exception):
    """A scenario cannot go on (the agent did not start, or stopped answering)."""


def run_kit(options: KitOptions) -> Report:
    """Run the chosen scenarios against ``options.agent_cmd``; the report of every check."""
    from edgepfl.errors import require

    require("torch", "edgepfl conformance (it builds the tasks' model payload)")
    report = Report(agent_cmd=options.agent_cmd, protocol=PROTOCOL_VERSION, profile=options.profile)
    own_dir = options.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="edgepfl-conformance-")) if own_dir else Path(options.workdir)  # type: ignore[arg-type]
    broker: MosquittoBroker | ExternalBroker = (ExternalBroker(options.broker_url) if options.broker_url
                                                else MosquittoBroker(port=options.port))
    broker.start()
    kit = _Kit(options, report, broker, workdir)
    try:
        if "head" in options.scenarios and "head" in PROFILES[options.profile]:
            kit.start_export()  # beside the first scenarios: it takes seconds
        for name in SCENARIOS:
            if name not in PROFILES[options.profile]:
                report.skip_unrecorded(SCENARIOS[name], f"not in profile {options.profile!r}")
                continue
            if name not in options.scenarios:
                report.skip_unrecorded(SCENARIOS[name], f"scenario {name!r} not run (--skip)")
                continue
            options.progress(f"conformance: scenario {name} …")
            try:
                getattr(kit, f"scenario_{name}")()
            except ScenarioAborted as exc:
                report.skip_unrecorded(SCENARIOS[name], f"scenario {name} aborted: {exc}")
        kit.record_frames()
        for name in options.scenarios:  # every check gets a verdict
            report.skip_unrecorded(SCENARIOS[name], f"scenario {name} did not reach this check")
    finally:
        kit.close()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


class _Kit:
    def __init__(self, options: KitOptions, report: Report, broker: MosquittoBroker | ExternalBroker,
                 workdir: Path):
        self.options = options
        self.report = report
        self.broker = broker
        self.workdir = workdir
        #: the run's epoch (Unix ms), as a coordinator's
        self.epoch = int(time.time() * 1000)
        self.normalization = write_dataset(workdir / "data.npz")
        self.run = self.run_spec(self.normalization)
        self._payloads: dict[str, dict[str, np.ndarray]] = {}
        self.wires: list[Wire] = []
        self.agents: list[AgentProcess] = []
        #: (agent id, federation) of every agent started: frames.valid looks at each one's frames
        self.frame_problems: list[str] = []
        self.frames_checked = 0
        #: the releases' ``edgepfl export`` runs, by run folder: the scenario's, the head probe's
        self._exports: dict[str, subprocess.Popen] = {}

    @staticmethod
    def run_spec(normalization: dict[str, list[float]]) -> RunSpec:
        """Every task's run: fedavg on the MLP of docs/MODELS.md over the kit's data (``write_dataset``)."""
        return RunSpec(
            method=MethodChoice(name="fedavg"),
            model=ModelSpec(arch="mlp", feature_dim=32, norm="batch"),
            train=TrainConfig(epochs=1, batch_size=16, lr=0.05),
            seed=0,
            data=DataShape(input_shape=INPUT_SHAPE, num_classes=len(CLASS_NAMES), class_names=list(CLASS_NAMES),
                           normalization=Normalization(**normalization)),
        )

    # ------------------------------------------------------------------ set-up
    def close(self) -> None:
        for export in self._exports.values():
            if export.poll() is None:
                export.kill()
                export.wait()
        for agent in self.agents:
            agent.stop(grace=5)
        for wire in self.wires:
            wire.stop()
        self.broker.stop()

    def payload(self, run: RunSpec) -> dict[str, np.ndarray]:
        """FedAvg's initial shared parameters for ``run``'s model (the task body)."""
        key = run.model_dump_json(include={"method", "model", "data"})
        if key not in self._payloads:
            method, state = _initial_state(run)
            self._payloads[key] = method.payload_for(state, "conformance")
        return self._payloads[key]

    # ------------------------------------------------------------------ the head scenario's release
    def start_export(self) -> None:
        """Checkpoint the task model's initial state, and the head probe's threshold encoder
        (:func:`.probes.threshold_encoder`), and start ``edgepfl export`` on each."""
        from .probes import threshold_encoder, under_probe_normalization

        _, state = _initial_state(self.run)
        self._start_export("release-run", self.run, state)
        probe_run = under_probe_normalization(self.run)
        _, probe = _initial_state(probe_run)
        threshold_encoder(probe.global_tensors)
        self._start_export("probe-run", probe_run, probe)

    def _start_export(self, name: str, run: RunSpec, state) -> None:
        from edgepfl.config import DataSpec
        from edgepfl.state import CheckpointMeta, save_checkpoint

        run_dir = self.workdir / name
        data = DataSpec(dataset="npz", root=str(self.workdir / "data.npz"), num_clients=1, test_fraction=TEST_FRACTION)
        save_checkpoint(run_dir / "checkpoint", state, CheckpointMeta(round=0, run=run, data_spec=data))
        with open(run_dir / "export.log", "wb") as out:
            self._exports[name] = subprocess.Popen(
                [sys.executable, "-m", "edgepfl", "export", "--run", str(run_dir), "--out", str(run_dir / "export")],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))

    def exported(self, name: str = "release-run") -> tuple[ReleaseManifest, bytes, bytes | None]:
        """An export's manifest, encoder bytes and global heads bytes (waits for the export):
        ``release-run`` the head scenario's release, ``probe-run`` the head preprocessing probe's."""
        run_dir = self.workdir / name
        if name not in self._exports:
            self.start_export()
        try:
            code = self._exports[name].wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise ScenarioAborted("the kit's `edgepfl export` took over 300 s") from None
        if code != 0:
            tail = (run_dir / "export.log").read_text(errors="replace").splitlines()[-3:]
            raise ScenarioAborted(f"the kit's `edgepfl export` failed ({code}): {' '.join(tail)}")
        out = run_dir / "export"
        manifest = ReleaseManifest.model_validate_json((out / "manifest.json").read_text())
        heads = manifest.global_heads
        return (manifest, (out / manifest.encoder.file).read_bytes(),
                (out / heads.file).read_bytes() if heads is not None else None)

    def open(self, name: str, *, signed: bool = False, tier: str = "trainer") -> _Scenario:
        federation = f"conf-{uuid.uuid4().hex[:8]}-{name}"
        agent_id = f"dut-{name}"
        directory = self.workdir / name
        keys = directory / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        for who in ("agent", "coordinator", "foreign"):
            generate_keypair(keys / f"{who}.key", keys / f"{who}.pub")
        values = {
            "python": sys.executable,
            "broker": self.broker.url,
            "host": self.broker.host,
            "port": str(self.broker.port),
            "federation": federation,
            "agent_id": agent_id,
            "data": str(self.workdir / "data.npz"),
            "workdir": str(directory),
            "config": str(directory / "agent.yaml"),
            "state_dir": str(directory / "state"),
            "signing_key": str(keys / "agent.key") if signed else "",
            "coordinator_key": str(keys / "coordinator.pub") if signed else "",
            "tier": tier,
            "head": HEAD_KIND,
        }
        config = agent_config(values, max_message_bytes=self.options.agent_max_message_bytes, signed=signed)
        (directory / "agent.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        coordinator = load_signer(keys / "coordinator.key") if signed else None
        will = encode(MessageType.COORDINATOR, federation=federation, sender="coordinator", round=-1,
                      meta=CoordinatorMeta(state="offline"), signer=coordinator)
        wire = Wire(self.broker.url, federation, will=will).start()
        self.wires.append(wire)
        command = self.options.head_agent_cmd if tier == "head" else None
        agent = AgentProcess(command or self.options.agent_cmd, values, directory)
        self.agents.append(agent)
        return _Scenario(self, wire, agent, federation, agent_id, coordinator,
                         load_public_key(keys / "agent.pub"), load_signer(keys / "foreign.key"), keys)

    def restart_broker(self, down_s: float) -> None:
        """Stop Mosquitto, wait ``down_s`` seconds, start it again on the same port."""
        if isinstance(self.broker, ExternalBroker):
            raise ScenarioAborted(f"the kit cannot restart {self.broker.url}, a broker it did not start (--broker)")
        port = self.broker.port
        self.broker.stop()
        time.sleep(down_s)
        self.broker = MosquittoBroker(port=port)
        self.broker.start()

    def record_frames(self) -> None:
        if not self.frames_checked:
            return
        problems = self.frame_problems
        self.report.record("frames.valid", not problems,
                           f"{self.frames_checked} frames checked" + (f"; {len(problems)} failed: "
                                                                      + "; ".join(problems[:3]) if problems else ""))

    # ------------------------------------------------------------------ scenarios
    def scenario_session(self) -> None:
        s = self.open("session")
        r = self.report
        s.presence(session=uuid.uuid4().hex, m=LARGE_M)
        birth = s.start()
        status = birth.meta_as(StatusMeta)
        r.record("presence.session", bool(status.session), f"session {status.session!r}")
        try:
            major = parse_version(status.version)[0]
        except ValueError:
            major = -1
        r.record("presence.version", major == MAJOR, f"version {status.version!r}")
        # the retained presence published before the start is a roll call too: let its answer pass
        s.wire.wait(lambda f: s.is_status(f, "online") and f is not s.birth_frame, 3.0, s.birth_index + 1)
        mark = s.wire.mark()
        s.presence(session=uuid.uuid4().hex, m=LARGE_M)
        answer = s.wire.wait(lambda f: s.is_status(f, "online"), 15.0, mark)
        r.record("presence.roll_call", answer is not None,
                 "a fresh online status followed the new session" if answer else "no status within 15 s")
        # capabilities may come only once the agent knows the coordinator speaks 1.2 (§16):
        # the birth precedes that, the roll-call answer follows the 1.2 presence
        latest = answer.message.meta_as(StatusMeta) if answer is not None and answer.message else status
        caps = latest.capabilities
        r.record("presence.capabilities", caps is not None and caps.methods is not None,
                 f"capabilities {caps.model_dump(exclude_none=True) if caps else None}")
        r.record("presence.max_payload", caps is not None and caps.max_payload_bytes is not None,
                 f"max_payload_bytes {caps.max_payload_bytes if caps else None}")

        # a train task and its update
        task, meta = s.task(0)
        update = s.ask(task, meta)
        if update is None:
            r.record("task.train", False, f"no update within {self.options.answer_timeout_s:.0f} s; "
                                          f"agent log: {s.agent.log_tail(5)}")
            raise ScenarioAborted("the agent answered no train task")
        s.check_update(update, meta, 0, train=True)
        first = update.message
        assert first is not None

        # redelivery: the same task frame again
        again = s.ask(task, meta)
        r.record("idempotency.redelivery",
                 again is not None and again.message is not None
                 and again.message.header.message_id == first.header.message_id,
                 "no answer to the redelivered task" if again is None or again.message is None else
                 f"message_id {again.message.header.message_id} (first answer {first.header.message_id})")

        task, meta = s.task(1, kind="evaluate")
        update = s.ask(task, meta)
        if update is not None and update.message is not None:
            m = update.message.meta_as(UpdateMeta) if update.message.type == MessageType.UPDATE else None
            ok = m is not None and m.kind == "evaluate" and not update.message.tensors
            r.record("task.evaluate", ok, f"kind {m.kind if m else None!r}, "
                                          f"{len(update.message.tensors)} tensors")
        else:
            r.record("task.evaluate", False, "no answer to an evaluate task")
        self.probe(s)

        task, meta = s.task(2)
        update = s.ask(_with_unknown_fields(task), meta)
        r.record("evolution.unknown_fields", update is not None,
                 "answered" if update else "no answer to a task carrying header, meta, run and run.data keys "
                                           "of a newer minor version")

        # a task on another agent's topic (unsigned: only the topic says whose it is), sent before
        # the next one: an agent that took it would answer it before that one's answer
        foreign, foreign_meta = s.task(2)
        foreign_mark = s.wire.mark()
        s.wire.publish(agent_topic(s.federation, f"{s.agent_id}-neighbour", AgentChannel.TASK), foreign)

        # the chunked task asks for a compressed update where the agent declared a codec (1.6)
        codec = next((c for c in CODECS if c != "none" and caps and c in (caps.codecs or ())), None)
        uplink = UplinkSpec(codec=codec, block=64, keep=0.25 if is_sparse(codec) else None) if codec else None
        task, meta = s.task(3, uplink=uplink)
        update = s.ask(task, meta, chunk_to=SMALL_M)
        taken = s.answer_to(foreign_meta.task_id, foreign_mark)
        r.record("task.own_topic", taken is None, "a task on another agent's topic was not answered" if taken is None
                 else f"answered ({taken.message.type.value if taken.message else 'a broken frame'}) a task sent "
                      "on another agent's topic")
        r.record("chunking.receive", update is not None,
                 f"a {len(task)}-byte task in {math.ceil(len(task) / (SMALL_M - 2048))} chunks of <= {SMALL_M} bytes: "
                 + ("answered" if update else "no answer"))
        if uplink is None:
            r.skip("update.compressed", "the agent declared no codecs (capabilities.codecs)")
        elif update is None or update.message is None or update.message.type != MessageType.UPDATE:
            r.record("update.compressed", False, f"no update to a task asking for {uplink.codec}")
        else:
            r.record("update.compressed", *self.decodes(update.message, meta, uplink))
        last = update or s.last_update

        # a NACK, an unknown message type, then tasks the agent must not run, then a sentinel task
        mark = s.wire.mark()
        nacked = last is not None and last.message is not None and r.required("nack.keeps_going")
        if nacked:
            assert last is not None and last.message is not None
            nack = NackMeta(message_id=last.message.header.message_id, rejected_type="update", reason="out_of_range",
                            detail="conformance kit: a NACK the agent must take in its stride",
                            task_id=last.message.meta_as(UpdateMeta).task_id)
            s.send(encode(MessageType.NACK, federation=s.federation, sender="coordinator", round=3, meta=nack))
        s.send(_retyped(s.task(4)[0], "x_future_type"))
        tampered_task, tampered_meta = s.task(4)
        s.send(_tampered(tampered_task))
        wrong = self.run.model_copy(update={"data": self.run.data.model_copy(update={"input_shape": (1, 9, 9)})})
        shape_task, shape_meta = s.task(5, run=wrong)
        s.send(shape_task)
        refused_methods = set(caps.methods or []) if caps else set()
        method = next(n for n in ("no-such-method", "no-such-method-2") if n not in refused_methods)
        alien = self.run.model_copy(update={"method": MethodChoice(name=method)})
        method_task, method_meta = s.task(6, run=alien, payload=self.run)
        s.send(method_task)
        task, meta = s.task(7)
        sentinel = s.ask(task, meta)
        if sentinel is None:
            raise ScenarioAborted("the agent stopped answering after a NACK, an unknown message type and two tasks "
                                  "it must not run")
        if nacked:
            r.record("nack.keeps_going", True, "the task after the NACK was answered")
        else:
            r.skip("nack.keeps_going", f"no NACK sent: the agent announced {r.agent_version} (§16)"
                   if not r.required("nack.keeps_going") else "no update to NACK")
        r.record("evolution.unknown_type", True, "the task after an `x_future_type` frame was answered")
        time.sleep(self.options.quiet_s)
        answer = s.answer_to(tampered_meta.task_id, mark)
        r.record("frames.body_hash", answer is None,
                 "a task with one body byte changed got no answer; the next task was answered" if answer is None else
                 f"a task with one body byte changed was answered with a "
                 f"{answer.message.type.value if answer.message else 'broken'} frame")
        s.check_refusal(mark, shape_meta, "data_mismatch", "refusal.data_mismatch")
        s.check_refusal(mark, method_meta, "unsupported_method", "refusal.unsupported_method")

        # a coordinator of another major version, then one of major 1 again (§16)
        mark = s.wire.mark()
        s.presence(session=s.session, m=LARGE_M, round=8, version=f"{MAJOR + 1}.0")
        foreign_task, foreign_meta = s.task(8)
        s.send(foreign_task)
        s.presence(session=s.session, m=LARGE_M, round=9)
        task, meta = s.task(9)
        if s.ask(task, meta) is None:
            raise ScenarioAborted(f"the agent answered no task after a presence of major {MAJOR} followed one of "
                                  f"major {MAJOR + 1}")
        time.sleep(self.options.quiet_s)
        answer = s.answer_to(foreign_meta.task_id, mark)
        r.record("version.other_major", answer is None,
                 f"the task sent under a {MAJOR + 1}.0 presence got no answer; the next one, under {PROTOCOL_VERSION}, "
                 "was answered" if answer is None else
                 f"the task sent under a {MAJOR + 1}.0 presence was answered with a "
                 f"{answer.message.type.value if answer.message else 'broken'} frame")

        self.check_personal_parts_stay(s, caps, round=9)

        # the announced M goes down: the next update must come in chunks of at most M
        announced_at = time.monotonic()
        s.presence(session=s.session, m=SMALL_M, round=10)
        time.sleep(0.5)
        task, meta = s.task(10)
        update = s.ask(task, meta)
        if update is None:
            r.record("chunking.send", False, f"no answer after announcing max_message_bytes={SMALL_M}")
        else:
            s.check_chunked(update, 10)
        big = [len(x.payload) for x in s.wire.seen_after(announced_at + 0.2) if f"/agents/{s.agent_id}/" in x.topic]
        r.record("limits.announced_m", bool(big) and max(big) <= SMALL_M,
                 f"{len(big)} MQTT messages after the announcement, largest {max(big, default=0)} bytes (M {SMALL_M})")

        self.run_done(s)
        s.clean_stop()
        s.account_frames()

    def check_personal_parts_stay(self, s: _Scenario, caps: Capabilities | None, round: int) -> None:
        """A train task of a personalized method the agent declares (its head is personal, §6):
        the update carries exactly the task's shared keys — the head never leaves the device."""
        r = self.report
        method = next((m for m in PERSONALIZED_METHODS if caps and m in (caps.methods or ())), None)
        if method is None:
            r.skip("personal.stays", f"the agent declares none of {', '.join(PERSONALIZED_METHODS)}")
            return
        run = self.run.model_copy(update={"method": MethodChoice(name=method)})
        task, meta = s.task(round, run=run)
        update = s.ask(task, meta)
        if update is None or update.message is None or update.message.type != MessageType.UPDATE:
            r.record("personal.stays", False, f"no update to a {method} train task")
            return
        shared, sent = set(self.payload(run)), set(update.message.tensors)
        r.record("personal.stays", sent == shared,
                 f"a {method} update of the task's {len(shared)} shared tensors, nothing personal" if sent == shared
                 else f"a {method} update with {sorted(sent - shared)[:4]} beside the shared keys"
                      f"{f', without {sorted(shared - sent)[:4]}' if shared - sent else ''}")

    def decodes(self, message: Message, task: TaskMeta, uplink: UplinkSpec) -> tuple[bool, str]:
        """Whether an answer to a task asking for ``uplink`` decodes as docs/COMPRESSION.md says."""
        from edgepfl import codecs

        header = message.meta_as(UpdateMeta).codec
        reference = self.payload(task.run)
        if header is None:
            return True, f"answered uncompressed ({len(message.tensors)} tensors), which is accepted"
        if (header.codec, header.block) != (uplink.codec, uplink.block):
            return False, f"encoded {header.codec} block {header.block}; asked {uplink.codec} block {uplink.block}"
        try:
            decoded = codecs.decode(codecs.Encoded.from_arrays(header, message.tensors), reference)
        except codecs.CodecError as exc:
            return False, f"does not decode: {exc}"
        wrong = sorted(k for k in set(reference) | set(decoded)
                       if k not in decoded or k not in reference or decoded[k].shape != reference[k].shape)
        if wrong:
            return False, f"decodes to other tensors than the task's: {wrong[:4]}"
        return True, (f"{header.codec}: {len(header.tensors)} tensors compressed, {len(header.exact)} exact, "
                      f"{sum(v.nbytes for v in message.tensors.values())} body bytes decode onto the task's")

    def probe(self, s: _Scenario) -> None:
        """``task.preprocessing`` and ``task.class_order``: evaluate tasks of a model the kit
        trained, whose held-out accuracy shows what the agent computed (:mod:`.probes`)."""
        from .probes import MIN_ACCURACY, build_probes

        plain, order = build_probes(self.run, self.workdir / "data.npz")
        for check_id, probe, how in (
                ("task.preprocessing", plain, f"normalization {probe_norm(plain.run)} (the data file's is "
                                              f"{probe_norm(self.run)})"),
                ("task.class_order", order, f"class names {order.run.data.class_names} (local "
                                            f"{list(self.run.data.class_names)})")):
            first = self.report.results.get("task.preprocessing")
            if check_id == "task.class_order" and (first is None or first.verdict != "pass"):
                self.report.skip(check_id, "the class order is measured through the accuracy, which needs "
                                           "task.preprocessing to pass first")
                continue
            task, meta = s.task(1, kind="evaluate", run=probe.run, tensors=probe.payload)
            answer = s.ask(task, meta)
            if answer is None or answer.message is None or answer.message.type != MessageType.UPDATE:
                self.report.record(check_id, False, f"no update answered the evaluate task ({how})")
                continue
            u = answer.message.meta_as(UpdateMeta)
            scored = u.eval_correct / u.num_test if u.num_test else 0.0
            self.report.record(check_id, u.num_test > 0 and scored >= MIN_ACCURACY,
                               f"{u.eval_correct}/{u.num_test} held-out correct ({scored:.0%}; at least "
                               f"{MIN_ACCURACY:.0%} required, the kit's model scores 100 % on every sample) with {how}")
        self.train_probes(s, plain, order)

    def train_probes(self, s: _Scenario, plain: Probe, order: Probe) -> None:
        """``train.preprocessing`` and ``train.class_order``: the probes' models sent as train tasks.
        An agent that preprocesses or maps labels right in ``evaluate`` only passes the evaluate
        probes and trains on other inputs or labels; what it sends back shows it: BatchNorm
        statistics of other inputs, or a model that learnt local numbers. Each runs only when
        its evaluate probe passed, so one break is blamed on one check."""
        from .probes import (
            MIN_ACCURACY,
            VARIANCE_RATIO,
            Probe,
            accuracy,
            read_data,
            training_probe,
            variance_ratio,
        )

        pixels, labels, names = read_data(self.workdir / "data.npz")
        low, high = VARIANCE_RATIO
        for check_id, probe, needs in (("train.preprocessing", plain, "task.preprocessing"),
                                       ("train.class_order", order, "task.class_order")):
            first = self.report.results.get(needs)
            if first is None or first.verdict != "pass":
                self.report.skip(check_id, f"measured on the model of {needs}, which did not pass")
                continue
            probe = training_probe(probe)
            task, meta = s.task(1, run=probe.run, tensors=probe.payload)
            answer = s.ask(task, meta)
            if answer is None or answer.message is None or answer.message.type != MessageType.UPDATE:
                self.report.record(check_id, False, f"no update answered the train task of the {needs} model")
                continue
            trained = {k: np.asarray(v) for k, v in answer.message.tensors.items()}
            if check_id == "train.preprocessing":
                ratio = variance_ratio(probe.payload, trained)
                self.report.record(check_id, ratio is not None and low <= ratio <= high,
                                   "the update carries no running variance of the model's first BatchNorm layer"
                                   if ratio is None else
                                   f"first BatchNorm running variance {ratio:.2f} times the model's after "
                                   f"{probe.run.train.epochs} epochs ({low}-{high} required; trained on x / 255 "
                                   f"alone or the file's normalization: about 0.35)")
                continue
            if set(trained) != set(probe.payload):
                self.report.record(check_id, False, f"the update carries {sorted(trained)[:4]}, not the task's "
                                                    f"tensors")
                continue
            scored = accuracy(Probe(probe.run, trained), pixels, labels, names)
            self.report.record(check_id, scored >= MIN_ACCURACY,
                               f"the trained model scores {scored:.0%} held out under the run's class order "
                               f"{probe.run.data.class_names} (at least {MIN_ACCURACY:.0%} required)")

    def outage(self, s: _Scenario, round: int, epochs: int, per_epoch: float, *,
               back_in_round: int) -> tuple[TaskMeta, int, Frame | None]:
        """Send a task of ``round`` that trains about HOLD_TRAIN_S, stop the broker while the
        agent trains, start it again with the kit's presence in ``back_in_round``; records
        ``reconnect.birth``. Returns the task, the mark before it, and its answer if it came
        before the broker stopped (then nothing was held)."""
        long_run = self.run.model_copy(update={"train": self.run.train.model_copy(update={"epochs": epochs})})
        task, meta = s.task(round, run=long_run)
        mark = s.wire.mark()
        s.send(task)
        time.sleep(0.7)
        early = s.answer_to(meta.task_id, mark)
        if back_in_round != round:  # the kit's client publishes it once the broker is back
            s.presence(session=s.session, m=LARGE_M, round=back_in_round, now=False)
        self.restart_broker(down_s=min(epochs * per_epoch, 2 * HOLD_TRAIN_S) + 1.0)
        birth = s.wire.wait(lambda f: s.is_status(f, "online"), 60.0, mark)
        self.report.record("reconnect.birth", birth is not None, "a birth status after the broker restart" if birth
                           else "no status within 60 s of the restart")
        if birth is None:
            raise ScenarioAborted("the agent did not come back after the broker restart")
        connection = birth.message.meta_as(StatusMeta).connection if birth.message else None
        self.report.record("reconnect.connection", connection is not None and connection >= 2,
                           f"the birth after the restart says connection {connection}")
        return meta, mark, early

    def run_done(self, s: _Scenario) -> None:
        """A `done` presence, then a new run's presence and task (§10: the agent stays, SHOULD)."""
        mark = s.wire.mark()
        s.presence(session=s.session, m=SMALL_M, round=10, state="done")
        time.sleep(DONE_WAIT_S)
        offline = s.wire.wait(lambda f: s.is_status(f, "offline"), 0.0, mark)
        retained = read_retained(self.broker.url, s.status_topic)
        kept = _decoded_status(retained) if retained is not None else None
        own = s.status.session if s.status else None
        problems = [p for p, bad in (
            ("the agent exited", not s.agent.running), ("it published `offline`", offline is not None),
            (f"its retained status is {kept.state if kept else None} of session {kept.session if kept else None}",
             kept is None or kept.state != "online" or kept.session != own)) if bad]
        if s.agent.running:
            s.presence(session=uuid.uuid4().hex, m=SMALL_M, round=0)  # a new run of the federation
            task, meta = s.task(0)
            if s.ask(task, meta) is None:
                problems.append("no answer to the next run's task")
        self.report.record("presence.done", not problems, "; ".join(problems) or
                           f"{DONE_WAIT_S:.0f} s after `done` still online (session {own}); the next run's task "
                           "was answered")

    def scenario_reconnect(self) -> None:
        s = self.open("reconnect")
        r = self.report
        s.presence(session=uuid.uuid4().hex, m=LARGE_M, round=0)
        s.start()
        seconds = 0.0
        # the second answer times a warm agent (the first builds the model) over several epochs,
        # so that what a task costs once does not pass for the cost of an epoch
        for epochs in (1, TIMING_EPOCHS):
            timing = self.run.model_copy(update={"train": self.run.train.model_copy(update={"epochs": epochs})})
            task, meta = s.task(0, run=timing)
            first = s.ask(task, meta)
            if first is None or first.message is None:
                raise ScenarioAborted("the agent answered no train task")
            seconds = first.message.meta_as(UpdateMeta).train_seconds
        per_epoch = max(seconds / TIMING_EPOCHS, 0.002)
        epochs = int(min(5000, max(2, math.ceil(HOLD_TRAIN_S / per_epoch))))

        # a long task of round 1; the broker goes away while the agent trains and comes back in round 1
        s.presence(session=s.session, m=LARGE_M, round=1)
        meta, mark, early = self.outage(s, 1, epochs, per_epoch, back_in_round=1)
        if early is not None:
            r.skip("reconnect.held_answer", f"the agent answered before the broker stopped ({epochs} epochs)")
        else:
            held = s.wire.wait(lambda f: s.is_answer(f, meta.task_id), 30.0, mark)
            r.record("reconnect.held_answer", held is not None,
                     f"the round-1 answer ({epochs} epochs) " + ("arrived after the reconnect" if held else
                                                                 "never arrived (presence still says round 1)"))
        s.presence(session=s.session, m=LARGE_M, round=2)
        task, meta = s.task(2)
        update = s.ask(task, meta)
        r.record("reconnect.resubscribe", update is not None,
                 "a task sent after the reconnect was answered" if update else "no answer after the reconnect")
        if update is None:
            raise ScenarioAborted("the agent answered no task after the broker restart")

        # a long task of round 2; the broker comes back with the coordinator in round 3
        meta, mark, early = self.outage(s, 2, epochs, per_epoch, back_in_round=3)
        task, sentinel_meta = s.task(3)
        if s.ask(task, sentinel_meta) is None:
            raise ScenarioAborted("the agent answered no task after the second broker restart")
        time.sleep(self.options.quiet_s)
        if early is not None:
            r.skip("reconnect.held_answer_dropped", f"the agent answered before the broker stopped ({epochs} epochs)")
        else:
            late = s.answer_to(meta.task_id, mark)
            r.record("reconnect.held_answer_dropped", late is None,
                     "the round-2 answer was not published: the presence after the reconnect said round 3"
                     if late is None else "the round-2 answer was published although the presence said round 3")

        s.kill("presence.will")
        s.account_frames()

    def scenario_signatures(self) -> None:
        s = self.open("signatures", signed=True)
        r = self.report
        s.presence(session=uuid.uuid4().hex, m=LARGE_M)
        birth = s.start()
        reason = verify(birth, s.agent_key)
        r.record("signing.status", reason is None, "the birth status verifies with the agent's key" if reason is None
                 else f"birth status: {reason}")
        mark = s.wire.mark()
        bad = {
            # addressed to the agent: only the missing signature may stop it
            "signing.unsigned_task": s.task(1, signer=None, recipient=s.agent_id),
            "signing.foreign_key": s.task(1, signer=s.foreign),
            "signing.wrong_recipient": s.task(1, recipient="someone-else"),
            # past created + 2 x deadline_s + 300 s by an hour
            "signing.expired_task": s.task(1, created=time.time() - 2 * max(60.0, self.options.answer_timeout_s)
                                           - 300 - 3600),
        }
        for frame, _ in bad.values():
            s.send(frame)
        task, meta = s.task(2)
        update = s.ask(task, meta)
        if update is None or update.message is None:
            r.record("signing.update", False, "no answer to a signed task for this agent")
            raise ScenarioAborted("the agent answered no signed task")
        reason = verify(update.message, s.agent_key)
        r.record("signing.update", reason is None, "the update verifies with the agent's key" if reason is None
                 else f"update: {reason}")
        stale_task, stale_meta = s.task(1)
        s.send(stale_task)
        task, meta = s.task(3)
        if s.ask(task, meta) is None:
            raise ScenarioAborted("the agent stopped answering signed tasks")
        time.sleep(self.options.quiet_s)
        for check_id, (_, bad_meta) in {**bad, "signing.stale": (stale_task, stale_meta)}.items():
            answer = s.answer_to(bad_meta.task_id, mark)
            if check_id == "signing.expired_task" and answer is not None and answer.message is not None \
                    and answer.message.type == MessageType.REFUSAL:
                r.record(check_id, True, f"refused: {answer.message.meta_as(RefusalMeta).reason}")
                continue
            r.record(check_id, answer is None, "ignored" if answer is None else
                     f"answered with a {answer.message.type.value if answer.message else 'broken'} frame")
        s.kill("signing.will", signed=True)
        s.account_frames()

    def scenario_head(self) -> None:
        manifest, artifact, global_heads = self.exported()
        s = self.open("head", signed=True, tier="head")
        r = self.report
        sequence, now = int(time.time() * 1000), time.time()

        def release(name: str, *, seq: int | None, expires: float | None = now + 3600, body: bytes | None = None,
                    signer: Signer | None | object = _COORDINATOR_KEY, claims: bytes | None = None,
                    hashed_as: bytes | None = None,
                    of: tuple[ReleaseManifest, bytes, bytes | None] | None = None) -> tuple[bytes, str]:
            """A release of the export (``of``: another one) under its own release id, signed with the
            coordinator's key unless ``signer`` says otherwise; ``body`` the artifact it carries,
            ``claims`` the one its meta and manifest describe (sha256, size; both default to the
            export's), ``hashed_as`` the artifact whose body's sha256 its header carries (None: the
            body's own)."""
            exported, encoder, heads = of if of is not None else (manifest, artifact, global_heads)
            body = encoder if body is None else body
            claims = encoder if claims is None else claims
            release_id = f"conformance-{name}-{exported.encoder.sha256[:12]}"
            digest = hashlib.sha256(claims).hexdigest()
            described = exported.model_copy(update={
                "release_id": release_id, "encoder": exported.encoder.model_copy(update={"sha256": digest})})
            meta = ReleaseMeta(release_id=release_id, manifest=described, sha256=digest, size_bytes=len(claims),
                               sequence=seq, expires=expires)
            key = s.coordinator if signer is _COORDINATOR_KEY else signer
            carried = encode_body(release_tensors(body, heads))
            if hashed_as is not None:
                carried = Body(carried.data, encode_body(release_tensors(hashed_as, heads)).sha256, carried.tensors)
            return encode(MessageType.RELEASE, federation=s.federation, sender="coordinator", round=manifest.round,
                          meta=meta, body=carried, signer=key), release_id  # type: ignore[arg-type]

        release_topic = federation_topic(s.federation, FederationChannel.RELEASE)
        s.presence(session=uuid.uuid4().hex, m=LARGE_M)
        whole, whole_id = release("whole", seq=sequence)
        s.wire.publish(release_topic, whole, retain=True)
        mark = s.wire.mark()
        birth = s.start(birth_check="head.birth")
        got = s.wait_metrics(whole_id, mark, self.options.start_timeout_s)
        r.record("release.install", s.metrics_ok(got, manifest.round), s.metrics_evidence(got, "retained whole", whole_id))
        if got is None or got.message is None:
            raise ScenarioAborted("the head agent installed no release")
        unsigned = [f"{what}: {why}" for what, why in (("status", verify(birth, s.agent_key)),
                                                       ("metrics", verify(got.message, s.agent_key))) if why]
        r.record("head.signing", not unsigned, "; ".join(unsigned) or "its birth status and its metrics verify with "
                                                                       "the agent's key")

        # the installed release again on the task topic, then seven it must refuse and a good one
        # after them: each refusal is its own check, and a release wrongly installed cannot fail
        # another check
        mark = s.wire.mark()
        s.send(whole)
        again = s.wait_metrics(whole_id, mark, self.options.answer_timeout_s)
        r.record("release.task_topic", s.metrics_ok(again, manifest.round),
                 s.metrics_evidence(again, "sent again on the task topic", whole_id))
        if again is None:
            raise ScenarioAborted("the head agent did not answer its installed release sent again")
        corrupt = bytearray(artifact)
        corrupt[len(corrupt) // 2] ^= 0xFF
        # one encoder byte changed, the meta and manifest describing the changed encoder, the
        # header's body_sha256 the honest body's: only the body hash check (§7) stops it
        altered = bytearray(artifact)
        altered[3 * len(altered) // 4] ^= 0x01  # the low bit of a byte deep in the weights: still a valid model
        bad = {"release.sha256": [release("corrupt", seq=sequence + 10, body=bytes(corrupt))],
               "release.body_hash": [release("rehashed", seq=sequence + 50, body=bytes(altered), claims=bytes(altered),
                                             hashed_as=artifact)],
               "release.rollback": [release("rollback", seq=sequence - 1)],
               "release.expired": [release("expired", seq=sequence + 20, expires=now - 3600)],
               "release.signature": [release("unsigned", seq=sequence + 30, signer=None),
                                     release("foreign", seq=sequence + 40, signer=s.foreign)],
               "release.unsequenced": [release("unsequenced", seq=None, expires=None)]}
        sentinel, sentinel_id = release("sentinel", seq=sequence + 60)  # above every bad one: it must be installed
        mark = s.wire.mark()
        for frames in bad.values():
            for frame, _ in frames:
                s.send(frame)
        s.send(sentinel)
        if s.wait_metrics(sentinel_id, mark, self.options.answer_timeout_s) is None:
            raise ScenarioAborted(f"the head agent did not install a good release sent after seven bad ones; agent "
                                  f"log: {s.agent.log_tail(3)}")
        time.sleep(self.options.quiet_s)
        for check_id, frames in bad.items():
            installed = [release_id for _, release_id in frames if s.wait_metrics(release_id, mark, 0.0) is not None]
            r.record(check_id, not installed, "refused: no metrics of it installed" if not installed else
                     f"installed: metrics for {', '.join(installed)}")
        # a forged release (release.signature) is not the coordinator's: dropped, never answered
        # nor is a frame whose body is not the one its header hashes (dropped unread, like any such frame)
        unreported = [release_id for check_id, frames in bad.items()
                      if check_id not in ("release.signature", "release.body_hash")
                      for _, release_id in frames if s.wait_metrics(release_id, mark, 0.0, refused=True) is None]
        r.record("release.refusal_reported", not unreported,
                 "each refused release was reported with `refused`" if not unreported else
                 f"no report of {', '.join(unreported)} refused")

        self.head_reconnect(s, sentinel, sentinel_id, manifest.round)
        s.clean_stop(check_id="head.clean_stop")
        self.head_by_reference(s, ReleaseRef(release_id=sentinel_id, sequence=sequence + 60), manifest.round)
        self.head_reverified(s, ReleaseRef(release_id=sentinel_id, sequence=sequence + 60))
        # a late joiner again, after the coordinator exited: its `done` presence names a release
        # retained in parts of at most the announced M
        parted, parted_id = release("parts", seq=sequence + 100)  # above every release sent before
        s.presence(session=s.session, m=SMALL_M, state="done", release=ReleaseRef(release_id=parted_id,
                                                                                   sequence=sequence + 100))
        parts = split_frame(parted, SMALL_M, federation=s.federation, sender="coordinator", round=manifest.round)
        for index in reversed(range(len(parts))):  # chunk 0 last (§12)
            s.wire.publish(release_part_topic(s.federation, index), parts[index], retain=True)
        s.wire.publish(release_topic, b"", retain=True)
        mark = s.wire.mark()
        s.restart()
        how = f"retained in {len(parts)} parts of <= {SMALL_M} bytes"
        got = s.wait_metrics(parted_id, mark, self.options.answer_timeout_s)
        if got is not None:
            r.record("release.parts", s.metrics_ok(got, manifest.round), s.metrics_evidence(got, how, parted_id))
        else:
            # §10: a report made while the presence shows `done` may be dropped (no coordinator reads
            # it). Then what it installed shows when a coordinator comes back: a release sequenced
            # between the one it had and the parted one is a rollback only for an agent that installed
            # the parted one (§12), which installs nothing of it
            s.presence(session=uuid.uuid4().hex, m=LARGE_M)
            between, between_id = release("between", seq=sequence + 90)
            mark = s.wire.mark()
            s.send(between)
            took = s.wait_metrics(between_id, mark, self.options.answer_timeout_s)
            r.record("release.parts", took is None,
                     f"no report under `done` (§10 allows it); a release sequenced below the one {how} was then "
                     + ("not installed: the parted one was" if took is None else
                        f"installed: the parted one was not; agent log: {s.agent.log_tail(3)}"))
        self.head_preprocessing(s, release("probe", seq=sequence + 110, of=self.exported("probe-run")),
                                manifest.round)
        s.kill("head.will", signed=True)
        s.account_frames()
        self.head_values(s)

    def head_values(self, s: _Scenario) -> None:
        """``head.values``: every metrics report the head agent sent in the scenario keeps its
        ``values`` to the 1.15 bounds (:func:`edgepfl.protocol.unbounded_values`)."""
        from edgepfl.protocol import unbounded_values

        reports = [f.message for f in s.wire.since(0) if f.agent == s.agent_id and f.channel == "metrics"
                   and f.message is not None and f.message.type == MessageType.METRICS]
        problems = [f"{m.meta_as(MetricsMeta).release_id}: {why}" for m in reports
                    if (why := unbounded_values(m.meta_as(MetricsMeta).values)) is not None]
        self.report.record("head.values", bool(reports) and not problems,
                           f"{len(reports)} metrics reports, their values within 32 entries and 64-character names"
                           if reports and not problems else
                           "no metrics report to check" if not reports else
                           f"{len(problems)} of {len(reports)} reports past the bounds, e.g. {problems[0]}")

    def head_preprocessing(self, s: _Scenario, probe: tuple[bytes, str], round: int) -> None:
        """``head.preprocessing``: a release whose encoder passes a pixel on only where the
        manifest's preprocessing makes it bright (:func:`.probes.threshold_encoder`). A head
        agent that feeds it what the manifest says fits a head that tells the kit's four shapes
        apart; one that feeds x / 255 or its file's normalization gets features that are all
        zero, and a head that scores one class's share. A fresh presence first: a report under
        `done` may be dropped (§10)."""
        from .probes import HEAD_THRESHOLD, MIN_ACCURACY, PROBE_NORMALIZATION

        frame, release_id = probe
        s.presence(session=uuid.uuid4().hex, m=LARGE_M)
        mark = s.wire.mark()
        s.send(frame)
        got = s.wait_metrics(release_id, mark, self.options.answer_timeout_s)
        how = (f"normalization mean {PROBE_NORMALIZATION.mean}, std {PROBE_NORMALIZATION.std} (the data file's is "
               f"{probe_norm(self.run)}; the encoder passes on inputs above {HEAD_THRESHOLD})")
        if got is None or got.message is None or not s.metrics_ok(got, round):
            self.report.record("head.preprocessing", False, s.metrics_evidence(got, f"of the probe encoder, {how}",
                                                                                release_id))
            return
        m = got.message.meta_as(MetricsMeta)
        scored = m.eval_correct / m.num_test if m.num_test else 0.0
        self.report.record("head.preprocessing", m.num_test > 0 and scored >= MIN_ACCURACY,
                           f"{m.eval_correct}/{m.num_test} held-out correct ({scored:.0%}; at least {MIN_ACCURACY:.0%} "
                           f"required; all-zero features score 25 %) with the probe release: {how}")

    def head_by_reference(self, s: _Scenario, installed: ReleaseRef, round: int) -> None:
        """``release.by_reference`` (1.4): restarted with its release installed, under a presence
        that names that release, the agent names it in its status and reports its metrics on it
        unasked; the kit sends it nothing. Leaves the agent stopped."""
        mark = s.wire.mark()
        s.presence(session=uuid.uuid4().hex, m=LARGE_M, release=installed)
        s.restart()
        named = s.wire.wait(lambda f: s.is_status(f, "online") and f.message is not None
                            and f.message.meta_as(StatusMeta).release == installed, self.options.answer_timeout_s, mark)
        got = s.wait_metrics(installed.release_id, mark, self.options.answer_timeout_s)
        self.report.record("release.by_reference", named is not None and s.metrics_ok(got, round),
                           "its status names the installed release and it reported on it unasked"
                           if named is not None and got is not None else
                           f"{'no status naming ' + installed.release_id if named is None else 'status names it'}; "
                           f"{'metrics came' if got is not None else 'no metrics'} within "
                           f"{self.options.answer_timeout_s:.0f} s")
        s.clean_stop(record=False)

    def head_reverified(self, s: _Scenario, installed: ReleaseRef) -> None:
        """``release.reverified`` (1.4): restarted with its release installed but another pinned
        coordinator key, one that did not sign that release, under a presence (signed with the
        new key) that names it: the agent re-verifies what it stored (§12) and so has no release
        installed — its status does not name it and it reports nothing on it. An agent that
        trusts its disk would. Leaves the agent stopped, with the scenario's key pinned again."""
        keys = s.keys
        pinned, kept, signer = keys / "coordinator.pub", (keys / "coordinator.pub").read_bytes(), s.coordinator
        pinned.write_bytes((keys / "foreign.pub").read_bytes())  # the rotated key: the kit's foreign one
        s.coordinator = s.foreign
        try:
            mark = s.wire.mark()
            s.presence(session=uuid.uuid4().hex, m=LARGE_M, release=installed)
            s.restart()
            got = s.wait_metrics(installed.release_id, mark, self.options.quiet_s)
            named = s.wire.wait(lambda f: s.is_status(f, "online") and f.message is not None
                                and f.message.meta_as(StatusMeta).release == installed, 0.0, mark)
            self.report.record(
                "release.reverified", got is None and named is None,
                f"with another coordinator key pinned, {installed.release_id} (signed with the old one) was not taken "
                "as installed: no status names it, no report on it" if got is None and named is None else
                f"with another coordinator key pinned, the release signed with the old one was still taken as "
                f"installed: {'its status names it' if named is not None else 'no status names it'}, "
                f"{'it reported on it' if got is not None else 'no report'}; agent log: {s.agent.log_tail(3)}")
            s.clean_stop(record=False)
        finally:
            pinned.write_bytes(kept)
            s.coordinator = signer

    def head_reconnect(self, s: _Scenario, installed: bytes, installed_id: str, round: int) -> None:
        """``head.reconnect``: the broker restarts (its retained messages gone, the kit's presence
        published again); the head agent's birth, then its installed release on its task topic."""
        if isinstance(self.broker, ExternalBroker):
            self.report.skip("head.reconnect", f"the kit cannot restart {self.broker.url}, a broker it did not "
                                               "start (--broker)")
            return
        mark = s.wire.mark()
        s.presence(session=s.session, m=LARGE_M, now=False)
        self.restart_broker(down_s=1.0)
        birth = s.wire.wait(lambda f: s.is_status(f, "online"), 60.0, mark)
        if birth is None:
            self.report.record("head.reconnect", False, "no birth status within 60 s of the broker restart")
            raise ScenarioAborted("the head agent did not come back after the broker restart")
        mark = s.wire.mark()
        s.send(installed)
        again = s.wait_metrics(installed_id, mark, self.options.answer_timeout_s)
        self.report.record("head.reconnect", s.metrics_ok(again, round),
                           s.metrics_evidence(again, "installed, sent again after a broker restart", installed_id))


class _Scenario:
    """One agent process under test, in its own federation, and the kit's side of its wire."""

    def __init__(self, kit: _Kit, wire: Wire, agent: AgentProcess, federation: str, agent_id: str,
                 coordinator: Signer | None, agent_key, foreign: Signer, keys: Path):
        self.kit, self.wire, self.agent = kit, wire, agent
        self.federation, self.agent_id = federation, agent_id
        #: the scenario's key files: the agent reads ``coordinator.pub`` as its pinned key on every start
        self.keys = keys
        self.coordinator, self.agent_key, self.foreign = coordinator, agent_key, foreign
        self.report = kit.report
        self.session = ""
        self.status: StatusMeta | None = None
        self.birth_frame: Frame | None = None
        self.birth_index = 0
        self.last_update: Frame | None = None
        self.status_topic = agent_topic(federation, agent_id, AgentChannel.STATUS)
        self.task_topic = agent_topic(federation, agent_id, AgentChannel.TASK)

    # ------------------------------------------------------------------ frames the kit sends
    def presence(self, *, session: str, m: int, round: int = 0, state: str = "online",
                 version: str = PROTOCOL_VERSION, now: bool = True, release: ReleaseRef | None = None) -> None:
        """The kit's retained presence; ``now`` false: only once the broker is back (a restart);
        ``release``: the current release it names (1.4)."""
        self.session = session
        meta = CoordinatorMeta(state=state, method=self.kit.run.method.name, round=round, version=version,
                               max_message_bytes=m, max_payload_bytes=256 * 2**20, session=session, release=release)
        self.wire.retain(federation_topic(self.federation, FederationChannel.COORDINATOR),
                         encode(MessageType.COORDINATOR, federation=self.federation, sender="coordinator",
                                round=round, meta=meta, signer=self.coordinator), now=now)

    def task(self, round: int, *, kind: str = "train", run: RunSpec | None = None, payload: RunSpec | None = None,
             signer: Signer | None | object = _COORDINATOR_KEY, recipient: str | None = None,
             tensors: dict[str, np.ndarray] | None = None, created: float | None = None,
             uplink: UplinkSpec | None = None) -> tuple[bytes, TaskMeta]:
        """A task frame for this agent (signed with the coordinator's key in the signed scenario);
        its body the initial model of ``payload`` (default ``run``), or ``tensors``; ``created``
        backdates it; ``uplink`` asks for a compressed update."""
        run = run or self.kit.run
        meta = TaskMeta(task_id=new_message_id(), kind=kind, run=run, seed=seed_for(run.seed, round, self.agent_id),
                        deadline_s=max(60.0, self.kit.options.answer_timeout_s), epoch=self.kit.epoch, uplink=uplink)
        key = self.coordinator if signer is _COORDINATOR_KEY else signer
        frame = encode(MessageType.TASK, federation=self.federation, sender="coordinator", round=round, meta=meta,
                       tensors=tensors if tensors is not None else self.kit.payload(payload or run),
                       signer=key,  # type: ignore[arg-type]
                       recipient=(recipient or self.agent_id) if key is not None else recipient, created=created)
        return frame, meta

    def send(self, frame: bytes, chunk_to: int | None = None) -> None:
        self.wire.publish(self.task_topic, frame, chunk_to=chunk_to)

    def ask(self, frame: bytes, meta: TaskMeta, chunk_to: int | None = None) -> Frame | None:
        """Send a task; its update, or None when none came within the answer timeout."""
        mark = self.wire.mark()
        self.send(frame, chunk_to)
        answer = self.wire.wait(lambda f: self.is_answer(f, meta.task_id, MessageType.UPDATE),
                                self.kit.options.answer_timeout_s, mark)
        if answer is not None:
            self.last_update = answer
        return answer

    # ------------------------------------------------------------------ frames the agent sends
    def is_status(self, frame: Frame, state: str) -> bool:
        m = frame.message
        return (frame.agent == self.agent_id and frame.channel == "status" and m is not None
                and m.type == MessageType.STATUS and m.meta_as(StatusMeta).state == state)

    def is_answer(self, frame: Frame, task_id: str, kind: MessageType | None = None) -> bool:
        m = frame.message
        if frame.agent != self.agent_id or frame.channel != "update" or m is None:
            return False
        if m.type not in (MessageType.UPDATE, MessageType.REFUSAL) or (kind is not None and m.type != kind):
            return False
        return getattr(m.meta, "task_id", None) == task_id

    def answer_to(self, task_id: str, since: int) -> Frame | None:
        return next((f for f in self.wire.since(since) if self.is_answer(f, task_id)), None)

    def wait_metrics(self, release_id: str, since: int, timeout: float, refused: bool = False) -> Frame | None:
        """The agent's ``metrics`` frame for ``release_id`` from ``since`` on, or None after
        ``timeout`` s: a report of the release installed, or (``refused``) of it refused (1.5)."""
        def measured(f: Frame) -> bool:
            m = f.message
            return (f.agent == self.agent_id and f.channel == "metrics" and m is not None
                    and m.type == MessageType.METRICS and m.meta_as(MetricsMeta).release_id == release_id
                    and (m.meta_as(MetricsMeta).refused is not None) == refused)

        return self.wire.wait(measured, timeout, since)

    @staticmethod
    def metrics_ok(frame: Frame | None, round: int) -> bool:
        if frame is None or frame.message is None:
            return False
        meta = frame.message.meta_as(MetricsMeta)
        return meta.tier == "head" and frame.message.header.round == round and meta.eval_correct <= meta.num_test

    def metrics_evidence(self, frame: Frame | None, how: str, release_id: str) -> str:
        if frame is None or frame.message is None:
            return f"no metrics for the release {how} ({release_id}); agent log: {self.agent.log_tail(3)}"
        meta = frame.message.meta_as(MetricsMeta)
        return (f"the release {how}: metrics of tier {meta.tier}, head {meta.head}, round {frame.message.header.round}, "
                f"{meta.eval_correct}/{meta.num_test} held-out correct")

    def restart(self) -> None:
        """Start the stopped agent again; waits for its birth (a status of a new session)."""
        mark = self.wire.mark()
        old = self.status.session if self.status else None
        self.agent.start()
        birth = self.wire.wait(lambda f: self.is_status(f, "online") and f.message is not None
                               and f.message.meta_as(StatusMeta).session != old,
                               self.kit.options.start_timeout_s, mark)
        if birth is None or birth.message is None:
            raise ScenarioAborted(f"no birth status after restarting the agent; agent log: {self.agent.log_tail(5)}")
        self.status = birth.message.meta_as(StatusMeta)

    def start(self, birth_check: str = "presence.birth") -> Message:
        """Start the agent; its birth status (recorded as ``birth_check``)."""
        r = self.report
        mark = self.wire.mark()
        try:
            self.agent.start()
        except (OSError, ValueError) as exc:
            r.record(birth_check, False, f"the agent command did not start: {exc}")
            raise ScenarioAborted(str(exc)) from None
        deadline = time.monotonic() + self.kit.options.start_timeout_s
        birth = None
        while birth is None and self.agent.running and time.monotonic() < deadline:  # an agent that exits fails at once
            birth = self.wire.wait(lambda f: self.is_status(f, "online") or (f.agent == self.agent_id and bool(f.error)),
                                   1.0, mark)
        if birth is None or birth.message is None:
            why = f"a broken status: {birth.error}" if birth else f"no status within {self.kit.options.start_timeout_s:.0f} s"
            exited = "" if self.agent.running else f" (the agent exited with {self.agent.proc.returncode if self.agent.proc else '?'})"
            r.record(birth_check, False, f"{why}{exited}; agent log: {self.agent.log_tail(8)}")
            raise ScenarioAborted("no birth status")
        self.birth_frame = birth
        self.birth_index = self.wire.frames.index(birth)
        message = birth.message
        status = self.status = message.meta_as(StatusMeta)
        if not r.agent_version:
            r.agent_version = status.version
        retained = read_retained(self.kit.broker.url, self.status_topic)
        kept = retained is not None and _decoded_status(retained) is not None
        h = message.header
        problems = [p for p, bad in (
            ("not retained", not kept), (f"QoS {birth.parts[0].qos}", birth.parts[0].qos != 1),
            (f"round {h.round}", h.round != -1), ("tensors", bool(message.tensors)),
            (f"tier {status.tier}", birth_check == "head.birth" and status.tier != "head"),
            (f"num_train {status.num_train}", status.num_train <= 0)) if bad]
        r.record(birth_check, not problems,
                 f"online, tier {status.tier}, {status.num_train} train / {status.num_test} test"
                 + (f"; problems: {', '.join(problems)}" if problems else "; retained, QoS 1"))
        return message

    def check_update(self, frame: Frame, task: TaskMeta, round: int, *, train: bool) -> None:
        r, m = self.report, frame.message
        assert m is not None and self.status is not None
        r.record("task.train", frame.parts[0].qos == 1, f"answered with QoS {frame.parts[0].qos}")
        h = m.header
        r.record("update.header", (h.type, h.federation, h.sender, h.round) == (
            MessageType.UPDATE, self.federation, self.agent_id, round),
            f"type {h.type.value}, federation {h.federation}, sender {h.sender}, round {h.round} (task round {round})")
        u = m.meta_as(UpdateMeta)
        problems = [p for p, bad in (
            ("task_id", u.task_id != task.task_id), (f"kind {u.kind}", u.kind != task.kind),
            (f"num_train {u.num_train} not in 1..{self.status.num_train}", not 0 < u.num_train <= self.status.num_train),
            (f"eval_correct {u.eval_correct} > num_test {u.num_test}", u.eval_correct > u.num_test)) if bad]
        r.record("update.meta", not problems, "; ".join(problems) or
                 f"task_id echoed, num_train {u.num_train}, eval_correct {u.eval_correct}/{u.num_test}")
        losses_ok = (u.num_test == 0 or (u.eval_loss is not None and math.isfinite(u.eval_loss) and u.eval_loss >= 0)) \
            and (not train or u.train_loss is not None)
        r.record("update.losses", losses_ok, f"eval_loss {u.eval_loss}, train_loss {u.train_loss}")
        want = {k: (str(v.dtype), list(v.shape)) for k, v in self.kit.payload(task.run).items()}
        got = {k: (str(v.dtype), list(v.shape)) for k, v in m.tensors.items()}
        wrong = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        non_finite = [k for k, v in m.tensors.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        r.record("update.tensors", not wrong and not non_finite,
                 f"{len(got)} tensors, the task's {len(want)} shared keys" if not wrong and not non_finite else
                 f"differ from the task's shared keys: {wrong[:4]}; non-finite: {non_finite[:4]}")

    def check_refusal(self, since: int, task: TaskMeta, reason: str, check_id: str) -> None:
        r = self.report
        answers = [f for f in self.wire.since(since) if self.is_answer(f, task.task_id)]
        updates = [f for f in answers if f.message is not None and f.message.type == MessageType.UPDATE]
        r.record(f"{check_id}.silent", not updates, "no update" if not updates else "answered with an update")
        refusals = [f.message.meta_as(RefusalMeta) for f in answers
                    if f.message is not None and f.message.type == MessageType.REFUSAL]
        if not r.required(check_id):
            r.skip(check_id, f"the agent announced {r.agent_version}")
        else:
            r.record(check_id, any(x.reason == reason for x in refusals),
                     f"refusals: {[x.reason for x in refusals]}" if refusals else "no refusal (silence)")

    def check_chunked(self, frame: Frame, round: int) -> None:
        problems = []
        if not frame.chunked:
            problems.append(f"sent whole ({len(frame.data)} bytes)")
        for part in frame.parts:
            if len(part.payload) > SMALL_M:
                problems.append(f"a {len(part.payload)}-byte chunk")
            if part.topic != frame.topic:
                problems.append(f"a chunk on {part.topic}")
            if part.qos != 1:
                problems.append(f"a chunk with QoS {part.qos}")
        if frame.message is not None:
            h = frame.message.header
            if (h.sender, h.federation, h.round) != (self.agent_id, self.federation, round):
                problems.append(f"the whole frame names {h.sender}/{h.federation}/round {h.round}")
        self.report.record("chunking.send", not problems,
                           "; ".join(problems) or f"a {len(frame.data)}-byte update in {len(frame.parts)} chunks "
                                                  f"of <= {max(len(p.payload) for p in frame.parts)} bytes")

    def clean_stop(self, record: bool = True, check_id: str = "presence.clean_stop") -> None:
        mark = self.wire.mark()
        self.agent.signal(signal.SIGTERM)
        offline = self.wire.wait(lambda f: self.is_status(f, "offline"), 30.0, mark)
        self.agent.wait(15)
        if not record:
            return
        retained = read_retained(self.kit.broker.url, self.status_topic)
        ok, evidence = self.offline_evidence(offline, retained, "clean stop")
        self.report.record(check_id, ok, evidence)

    def kill(self, check_id: str, signed: bool = False) -> None:
        """kill -9 the agent; record whether the broker published its will (retained, same
        session; ``signed``: verifying with the agent's key, as everything it publishes must
        once it has one, §3a — an unsigned will lets anyone's forged `online` outlive a crash)."""
        mark = self.wire.mark()
        self.agent.signal(signal.SIGKILL)
        will = self.wire.wait(lambda f: self.is_status(f, "offline"), 30.0, mark)
        retained = read_retained(self.kit.broker.url, self.status_topic)
        ok, evidence = self.offline_evidence(will, retained, "will")
        if signed and will is not None:
            why = verify(will.message, self.agent_key) if will.message is not None else "not a frame"
            ok, evidence = ok and why is None, f"{evidence}; " + ("signed with the agent's key" if why is None
                                                                  else f"the will does not verify: {why}")
        self.report.record(check_id, ok, evidence)

    def offline_evidence(self, frame: Frame | None, retained: bytes | None, what: str) -> tuple[bool, str]:
        kept = _decoded_status(retained) if retained is not None else None
        own = self.status.session if self.status else None
        if frame is None:
            return False, f"no offline status after the {what}"
        status = frame.message.meta_as(StatusMeta) if frame.message else None
        problems = [p for p, bad in (
            ("not retained", kept is None or kept.state != "offline"),
            (f"session {status.session if status else None} is not the birth's {own}",
             status is None or status.session != own)) if bad]
        return not problems, "; ".join(problems) or f"offline status of session {own}, retained"

    def account_frames(self) -> None:
        """Add this agent's frames to the frames.valid check (decoding, sender, type per channel)."""
        expected = {"status": {MessageType.STATUS}, "update": {MessageType.UPDATE, MessageType.REFUSAL},
                    "metrics": {MessageType.METRICS}}
        for frame in self.wire.since(0):
            if frame.agent != self.agent_id:
                continue
            self.kit.frames_checked += 1
            m = frame.message
            if m is None:
                self.kit.frame_problems.append(f"{frame.channel}: {frame.error}")
            elif m.header.sender != self.agent_id or m.header.federation != self.federation:
                self.kit.frame_problems.append(f"{frame.channel}: sender {m.header.sender} / federation "
                                               f"{m.header.federation}")
            elif m.type not in expected.get(frame.channel, set()):
                self.kit.frame_problems.append(f"a {m.type.value} frame on the {frame.channel} topic")


def _initial_state(run: RunSpec):
    """(method, its initial server state) for ``run``'s model, seeded: the same every time."""
    from edgepfl._torch import torch
    from edgepfl.methods import create_method

    torch.manual_seed(0)
    method = create_method(run.method.name, run.method.options)
    model = method.build_model(run.model, run.data.input_shape, run.data.num_classes)
    return method, method.init_server(model)


def _decoded_status(payload: bytes) -> StatusMeta | None:
    from edgepfl.protocol import ProtocolError, decode

    try:
        return decode(payload).meta_as(StatusMeta)
    except ProtocolError:
        return None


def _split(frame: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack(">I", frame[4:8])
    return bounded_json.loads(frame[8:8 + length]), frame[8 + length:]


def _pack(header: dict, rest: bytes) -> bytes:
    head = json.dumps(header).encode()
    return MAGIC + struct.pack(">I", len(head)) + head + rest


def _with_unknown_fields(frame: bytes) -> bytes:
    """``frame`` (unsigned) with keys a newer minor version might add, in the header, the meta,
    the run spec and its data shape: a 1.2 receiver ignores them (§16)."""
    header, rest = _split(frame)
    header["x_trace"] = "conformance"
    header["meta"]["x_priority"] = 3
    header["meta"]["run"]["x_schedule"] = {"warmup": 1}
    header["meta"]["run"]["data"]["x_augment"] = False
    return _pack(header, rest)


def probe_norm(run: RunSpec) -> str:
    norm = run.data.normalization
    return "null" if norm is None else f"mean {[round(v, 3) for v in norm.mean]}, std {[round(v, 3) for v in norm.std]}"


def _tampered(frame: bytes) -> bytes:
    """``frame`` (unsigned) with its body's last byte changed: the header's ``body_sha256`` no longer matches."""
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


def _retyped(frame: bytes, type_name: str) -> bytes:
    """``frame`` (unsigned) as a message of a type this protocol version does not define."""
    header, rest = _split(frame)
    header["type"] = type_name
    return _pack(header, rest)
