"""Signed frames, keys, enrollment and the replay rules, unit by unit (no broker).

The live attacks against running processes are in ``tests/integration/security/test_hostile_fleet.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepfl.broker import exposure_warning
from edgepfl.coordinator.gate import Presence, Rejection, admit_metrics, admit_presence
from edgepfl.coordinator.registry import Registry
from edgepfl.edge_agent.head_tier import HeadRuntime
from edgepfl.edge_agent.task_guard import MAX_CLOCK_SKEW_S, TaskGuard
from edgepfl.protocol import (
    MessageType,
    MetricsMeta,
    ProtocolError,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    decode,
    encode,
)
from edgepfl.protocol.signing import (
    SIGNATURE_CONTEXT,
    KeyFileError,
    Keyring,
    Signer,
    generate_keypair,
    key_id,
    load_public_key,
    load_signer,
    verify,
)

from tests.wire_samples import sample_run_spec as sample_run

REPO = Path(__file__).resolve().parents[3]
FED = "demo"


def signer_from_seed(seed: bytes) -> Signer:
    return Signer.from_private(Ed25519PrivateKey.from_private_bytes(seed))


ALICE = signer_from_seed(bytes(range(32)))
MALLORY = signer_from_seed(bytes(range(1, 33)))


def status(agent: str, state: str = "online", *, signer: Signer | None = None, session: str = "a" * 32) -> bytes:
    return encode(MessageType.STATUS, federation=FED, sender=agent, round=-1, signer=signer,
                  meta=StatusMeta(state=state, num_train=10, num_test=5, session=session))


def task(recipient: str | None, round: int = 3, epoch: int = 1, signer: Signer | None = ALICE,
         deadline_s: float = 60.0) -> bytes:
    meta = TaskMeta(task_id="f" * 32, kind="train", run=sample_run(), seed=1, deadline_s=deadline_s, epoch=epoch)
    return encode(MessageType.TASK, federation=FED, sender="coordinator", round=round, meta=meta, signer=signer,
                  recipient=recipient, tensors={"w": np.ones(3, np.float32)})


# ------------------------------------------------------------------ keys

def test_generated_keys_have_the_contract_modes_formats_and_id(tmp_path):
    kid = generate_keypair(tmp_path / "k" / "agent.key", tmp_path / "k" / "agent.pub")
    assert stat.S_IMODE(os.stat(tmp_path / "k" / "agent.key").st_mode) == 0o600
    pem = (tmp_path / "k" / "agent.key").read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    assert (tmp_path / "k" / "agent.pub").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SPKI
    signer, public = load_signer(tmp_path / "k" / "agent.key"), load_public_key(tmp_path / "k" / "agent.pub")
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert kid == signer.key_id == key_id(public) == hashlib.sha256(raw).hexdigest()[:16]


def test_a_private_key_readable_by_others_or_of_another_kind_is_refused(tmp_path):
    generate_keypair(tmp_path / "a.key", tmp_path / "a.pub")
    os.chmod(tmp_path / "a.key", 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_signer(tmp_path / "a.key")
    os.chmod(tmp_path / "a.pub", 0o600)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        load_signer(tmp_path / "a.pub")
    with pytest.raises(KeyFileError):
        load_signer(tmp_path / "missing.key")


# ------------------------------------------------------------------ frames

def test_a_signed_frame_is_the_unsigned_layout_plus_signer_recipient_and_64_bytes():
    frame = task("pi-07")
    message = decode(frame)
    head_len = int.from_bytes(frame[4:8], "big")
    assert len(frame) == 8 + head_len + message.header.body_bytes + 64
    assert message.header.signer == ALICE.key_id and message.header.recipient == "pi-07"
    assert message.signed_part == frame[: 8 + head_len] and message.signature == frame[-64:]
    assert verify(message, ALICE.public) is None
    # the signature is over the context string + prefix + header, nothing else
    ALICE.public.verify(frame[-64:], SIGNATURE_CONTEXT + frame[: 8 + head_len])


def test_unsigned_frames_carry_no_new_keys_and_no_trailer():
    frame = task(None, signer=None)
    head_len = int.from_bytes(frame[4:8], "big")
    header = json.loads(frame[8 : 8 + head_len])
    assert "signer" not in header and "recipient" not in header
    assert len(frame) == 8 + head_len + header["body_bytes"]
    assert verify(decode(frame), ALICE.public) == "unsigned"


@pytest.mark.parametrize("cut", [1, 63, 64])
def test_truncated_signature_is_malformed(cut):
    with pytest.raises(ProtocolError, match="signature bytes") as exc:
        decode(task("pi-07")[:-cut])
    assert exc.value.reason == "malformed"


def test_extra_bytes_after_the_signature_are_malformed():
    with pytest.raises(ProtocolError, match="signature bytes") as exc:
        decode(task("pi-07") + b"\0")
    assert exc.value.reason == "malformed"


def test_any_changed_header_byte_or_another_key_fails_verification():
    frame = task("pi-07", round=3)
    forged = frame.replace(b'"round":3', b'"round":4')  # same length, still a valid header
    assert verify(decode(forged), ALICE.public) == "bad_signature"
    readdressed = frame.replace(b'"recipient":"pi-07"', b'"recipient":"pi-08"')
    assert verify(decode(readdressed), ALICE.public) == "bad_signature"
    assert verify(decode(task("pi-07", signer=MALLORY)), ALICE.public) == "bad_signature"
    # a flipped signature bit
    assert verify(decode(frame[:-1] + bytes([frame[-1] ^ 1])), ALICE.public) == "bad_signature"


def test_the_body_is_bound_through_its_sha256():
    frame = bytearray(task("pi-07"))
    frame[-65] ^= 0xFF  # last body byte: the header's body_sha256 no longer matches
    with pytest.raises(ProtocolError) as exc:
        decode(bytes(frame))
    assert exc.value.reason == "corrupt"


def test_chunks_are_not_signed():
    from edgepfl.protocol import ChunkMeta

    with pytest.raises(ValueError, match="chunk"):
        encode(MessageType.CHUNK, federation=FED, sender="x", round=0, signer=ALICE,
               meta=ChunkMeta(parent_id="a" * 32, index=0, count=1, total_bytes=1, total_sha256="b" * 64),
               tensors={"data": np.zeros(1, np.uint8)})


def test_signed_worked_example_in_the_doc_verifies_and_matches_the_encoder(monkeypatch):
    from tests.unit.protocol.test_protocol import doc_block

    frame = b"".join(bytes.fromhex("".join(line.split(":", 1)[1][:40].split()))
                     for line in doc_block("signed-example-frame").splitlines())
    key = signer_from_seed(bytes(range(32)))  # the doc's test key: seed 00 01 02 … 1f
    message = decode(frame)
    assert message.header.signer == key.key_id and verify(message, key.public) is None
    assert message.header.sender == "pi-07" and message.type == MessageType.STATUS
    import edgepfl.protocol.clock as clock

    monkeypatch.setattr(clock, "_wall", lambda: message.header.created)  # the frame's time stamp, as in the doc
    again = encode(MessageType.STATUS, federation="demo", sender="pi-07", round=-1, meta=message.meta,
                   message_id=message.header.message_id, signer=key)
    assert again == frame  # Ed25519 signatures are deterministic: the doc cannot drift from the code


# ------------------------------------------------------------------ the coordinator's admission

@pytest.fixture
def keyring(tmp_path):
    enrolled = tmp_path / "enrolled"
    enrolled.mkdir()
    from edgepfl.protocol.signing import write_public_key

    write_public_key(ALICE.public, enrolled / "alice.pub")
    return Keyring(enrolled)


def reason(verdict) -> str | None:
    return verdict.reason if isinstance(verdict, Rejection) else None


def test_statuses_must_be_signed_by_the_enrolled_key(keyring):
    assert isinstance(admit_presence("alice", status("alice", signer=ALICE), keyring), Presence)
    assert reason(admit_presence("alice", status("alice"), keyring)) == "unsigned"
    assert reason(admit_presence("alice", status("alice", signer=MALLORY), keyring)) == "bad_signature"
    assert reason(admit_presence("sybil-1", status("sybil-1", signer=MALLORY), keyring)) == "not_enrolled"
    # a Sybil id is looked up once per negative_ttl_s, not per frame
    assert keyring.get("sybil-1") is None and "sybil-1" in keyring._absent


def test_an_agent_enrolled_while_the_coordinator_runs_is_accepted(keyring):
    keyring.negative_ttl_s = 0
    assert keyring.get("bob") is None
    from edgepfl.protocol.signing import write_public_key

    write_public_key(MALLORY.public, keyring.directory / "bob.pub")
    assert isinstance(admit_presence("bob", status("bob", signer=MALLORY), keyring), Presence)


def _with_created(frame: bytes, created: float) -> bytes:
    """An unsigned frame with its header's ``created`` changed (header length prefix kept right)."""
    (head_len,) = struct.unpack(">I", frame[4:8])
    header = json.loads(frame[8:8 + head_len])
    header["created"] = created
    head = json.dumps(header, separators=(",", ":")).encode()
    return frame[:4] + struct.pack(">I", len(head)) + head + frame[8 + head_len:]


def test_a_replayed_offline_of_an_old_session_cannot_take_an_agent_offline(keyring):
    # a replay is a genuine status sent again: only signatures tell one from a forgery (unsigned,
    # anyone may write any status, and the agent's own birth is always heard: the test above)
    registry = Registry()
    old_will = status("alice", "offline", session="1" * 32, signer=ALICE)  # recorded from the agent's previous process
    time.sleep(0.01)
    birth = status("alice", "online", session="2" * 32, signer=ALICE)
    accepted = admit_presence("alice", birth, keyring, registry=registry)
    registry.update("alice", accepted.meta, accepted.created)
    assert reason(admit_presence("alice", old_will, keyring, registry=registry)) == "stale_status"
    # the current birth again while it holds (a broker re-delivers retained statuses on every
    # subscribe): nothing new, nothing stale
    assert isinstance(admit_presence("alice", birth, keyring, registry=registry), Presence)
    assert registry.is_online("alice")
    # its own session's will (made before its births) is taken
    own_will = decode(birth).meta.model_copy(update={"state": "offline"})
    will = encode(MessageType.STATUS, federation=FED, sender="alice", round=-1, meta=own_will, signer=ALICE,
                  created=decode(birth).header.created - 1)
    admitted = admit_presence("alice", will, keyring, registry=registry)
    assert isinstance(admitted, Presence)
    registry.update("alice", admitted.meta, admitted.created)
    assert not registry.is_online("alice")
    # replayed online after its will
    assert reason(admit_presence("alice", birth, keyring, registry=registry)) == "stale_status"


def test_metrics_only_from_known_agents_with_consistent_counts(keyring):
    registry = Registry()
    good = MetricsMeta(tier="head", num_test=10, eval_correct=7, values={"accuracy": 0.99})
    frame = encode(MessageType.METRICS, federation=FED, sender="alice", round=0, meta=good, signer=ALICE)
    assert reason(admit_metrics("alice", frame, keyring, registry)) == "unknown_agent"
    registry.update("alice", StatusMeta(state="online", tier="head"))
    assert isinstance(admit_metrics("alice", frame, keyring, registry), MetricsMeta)
    ghost = encode(MessageType.METRICS, federation=FED, sender="ghost", round=0, meta=good)
    assert reason(admit_metrics("ghost", ghost, keyring, registry)) == "unsigned"
    inflated = encode(MessageType.METRICS, federation=FED, sender="alice", round=0, signer=ALICE,
                      meta=good.model_copy(update={"eval_correct": 11}))
    assert reason(admit_metrics("alice", inflated, keyring, registry)) == "malformed"


def test_an_update_forged_on_an_agents_topic_is_rejected_before_it_can_answer_the_task(keyring):
    from edgepfl.coordinator.gate import UpdateGate
    from edgepfl.coordinator.round_tasks import RoundTasks, Task
    from edgepfl.methods import create_method

    registry = Registry()
    registry.update("alice", StatusMeta(state="online", num_train=10))
    gate = UpdateGate(FED, create_method("fedavg", {}), registry, max_bytes=2**20, keyring=keyring)
    tasks = RoundTasks(0)
    tasks.add(Task("alice", "c" * 32, "evaluate"))
    meta = UpdateMeta(task_id="c" * 32, kind="evaluate", num_train=10, num_test=5, eval_correct=5)
    forged = encode(MessageType.UPDATE, federation=FED, sender="alice", round=0, meta=meta)
    assert reason(gate.admit("alice", forged, tasks, None)) == "unsigned"
    assert "alice" in tasks.waiting  # the task still waits for the real answer
    real = encode(MessageType.UPDATE, federation=FED, sender="alice", round=0, meta=meta, signer=ALICE)
    assert not isinstance(gate.admit("alice", real, tasks, None), Rejection)
    assert reason(gate.admit("alice", real, tasks, None)) == "duplicate"  # replayed


def test_only_the_agents_own_signed_frame_ends_its_wait_when_its_meta_does_not_decode(keyring):
    from edgepfl.coordinator.gate import UpdateGate
    from edgepfl.coordinator.round_tasks import RoundTasks, Task
    from edgepfl.methods import create_method

    registry = Registry()
    registry.update("alice", StatusMeta(state="online", num_train=10))
    gate = UpdateGate(FED, create_method("fedavg", {}), registry, max_bytes=2**20, keyring=keyring)
    tasks = RoundTasks(0)
    tasks.add(Task("alice", "c" * 32, "evaluate"))

    def unreadable(signer=None) -> bytes:  # an update whose meta fails validation, signed or not
        header = {"schema_version": 1, "type": "update", "federation": FED, "sender": "alice", "round": 0,
                  "message_id": os.urandom(16).hex(), "created": time.time(),
                  "body_sha256": hashlib.sha256(b"").hexdigest(), "body_bytes": 0, "tensors": [],
                  "meta": {"task_id": "c" * 32, "kind": "evaluate", "num_train": -1}}
        if signer is not None:
            header["signer"] = signer.key_id
        head = json.dumps(header).encode()
        signed = b"EPF1" + struct.pack(">I", len(head)) + head
        return signed + (signer.sign(signed) if signer is not None else b"")

    for forged in (unreadable(), unreadable(MALLORY)):
        verdict = gate.admit("alice", forged, tasks, None)
        assert reason(verdict) == "malformed" and verdict.attributed is None
    assert "alice" in tasks.waiting  # a forgery does not answer alice's task
    verdict = gate.admit("alice", unreadable(ALICE), tasks, None)
    assert reason(verdict) == "malformed" and verdict.attributed.task_id == "c" * 32
    assert "alice" not in tasks.waiting  # alice's own frame does


# ------------------------------------------------------------------ the agent's task rules

def test_task_guard_recipient_order_and_deadline(tmp_path):
    guard = TaskGuard("pi-07", tmp_path, strict=True)
    assert guard.refusal(decode(task("pi-08")))[0] == "wrong_recipient"
    assert guard.refusal(decode(task(None)))[0] == "wrong_recipient"
    current = decode(task("pi-07", round=5, epoch=2))
    assert guard.refusal(current) is None
    guard.accept(current)
    # a restarted agent still knows the newest task: older rounds and older runs are refused
    again = TaskGuard("pi-07", tmp_path, strict=True)
    assert again.refusal(decode(task("pi-07", round=4, epoch=2)))[0] == "stale"
    assert again.refusal(decode(task("pi-07", round=9, epoch=1)))[0] == "stale"
    assert again.refusal(decode(task("pi-07", round=5, epoch=2))) is None  # same round: a re-send
    assert again.refusal(decode(task("pi-07", round=0, epoch=3))) is None  # a fresh run
    late = decode(task("pi-07", round=6, epoch=2, deadline_s=10))
    assert again.refusal(late, now=late.header.created + 20 + MAX_CLOCK_SKEW_S - 1) is None
    assert again.refusal(late, now=late.header.created + 20 + MAX_CLOCK_SKEW_S + 1)[0] == "expired"


def test_unsigned_mode_only_refuses_a_task_addressed_to_someone_else(tmp_path):
    guard = TaskGuard("pi-07", tmp_path, strict=False)
    assert guard.refusal(decode(task(None, signer=None, round=0))) is None
    assert guard.refusal(decode(task("pi-08", signer=None)))[0] == "wrong_recipient"


# ------------------------------------------------------------------ releases on a head agent

def test_release_rollback_expiry_and_unsequenced_refusals(tmp_path):
    runtime = HeadRuntime(tmp_path, "lr", data=None, coordinator_key=ALICE.public)  # type: ignore[arg-type]
    now = time.time()
    assert "unsequenced" in runtime._release_refusal(None, now + 60, "d" * 64)
    assert "expired" in runtime._release_refusal(5, now - 3600, "d" * 64)
    assert runtime._release_refusal(5, now + 60, "d" * 64) is None
    runtime.record = SimpleNamespace(sequence=5, encoder_sha256="d" * 64)  # type: ignore[assignment]
    assert "rollback" in runtime._release_refusal(4, now + 60, "e" * 64)
    assert "rollback" in runtime._release_refusal(5, now + 60, "e" * 64)
    assert runtime._release_refusal(5, now + 60, "d" * 64) is None  # the installed one, re-sent
    assert runtime._release_refusal(6, now + 60, "e" * 64) is None


def test_release_sequence_is_monotonic_across_restarts_and_a_clock_set_back(tmp_path):
    from edgepfl.coordinator.releases.release import next_sequence

    first = next_sequence(tmp_path, now=1000.0)
    assert first == 1_000_000
    assert next_sequence(tmp_path, now=999.0) == first + 1  # the clock went back: still above
    assert next_sequence(tmp_path, now=2000.0) == 2_000_000
    assert next_sequence(tmp_path / "fresh-run", now=2001.0) > 2_000_000  # a fresh run dir: the clock


# ------------------------------------------------------------------ the start-up warning

def test_exposure_warning_only_off_this_machine_without_tls_or_signatures():
    assert exposure_warning("mqtt://127.0.0.1:1883", "agent", signed=False) is None
    assert exposure_warning("mqtt://localhost", "agent", signed=False) is None
    assert exposure_warning("mqtts://broker.example:8883", "agent", signed=True) is None
    unsigned = exposure_warning("mqtts://broker.example:8883", "coordinator", signed=False)
    assert unsigned and "signatures" in unsigned and "TLS" not in unsigned
    plain = exposure_warning("mqtt://10.0.0.5", "agent", signed=True)
    assert plain and "TLS" in plain and "signatures" not in plain


def test_a_flood_of_rejections_is_counted_in_full_but_logged_a_few_times(caplog):
    from edgepfl.coordinator.inbox import Inbox
    from edgepfl.coordinator.result import RunCounters
    from edgepfl.logs import LINES_PER_WINDOW

    counters = RunCounters()
    inbox = Inbox(None, Registry(), None, counters)  # type: ignore[arg-type]  # only the rejection path is used
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        for i in range(1000):
            inbox._reject(Rejection(f"sybil-{i}", "not_enrolled", "status not signed by its enrolled key"))
        inbox._reject(Rejection("alice", "malformed", "bad"))
    assert counters.rejected == {"not_enrolled": 1000, "malformed": 1}
    lines = caplog.text.splitlines()
    assert sum("not_enrolled" in line for line in lines) == LINES_PER_WINDOW + 1  # + "counted, not logged"
    assert "rejected message from alice: malformed (bad)" in caplog.text


def test_reports_naming_a_fresh_release_each_time_leave_the_coordinators_memory_flat():
    """The red team's +1,444 MB: a head agent signing 1,500 metrics reports, each with a new
    release_id. The coordinator keeps an agent's reports on its last few releases only."""
    import tracemalloc

    from edgepfl.coordinator.fleet import AgentFrame, LocalFleet
    from edgepfl.coordinator.inbox import REPORTS_KEPT_PER_AGENT, Inbox
    from edgepfl.coordinator.result import RunCounters
    from edgepfl.protocol import AgentChannel, MessageType, MetricsMeta, StatusMeta, encode

    registry = Registry()
    registry.update("pi-1", StatusMeta(state="online", tier="head", num_train=10, num_test=10))
    registry.update("pi-2", StatusMeta(state="online", tier="head", num_train=10, num_test=10))
    # only the metrics path is used: no gate; the fleet is told which release each head agent has
    inbox = Inbox(LocalFleet({}, "f"), registry, None, RunCounters())  # type: ignore[arg-type]

    def report(agent_id: str, release_id: str) -> None:
        frame = encode(MessageType.METRICS, federation="f", sender=agent_id, round=-1,
                       meta=MetricsMeta(tier="head", release_id=release_id, head="lr", num_test=10, eval_correct=7,
                                        values={"fit_seconds": 0.1}))
        inbox._route(AgentFrame(agent_id, AgentChannel.METRICS, frame, len(frame)))

    report("pi-2", "r-honest")
    for i in range(100):
        report("pi-1", f"fresh-{i:06d}")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(100, 1500):
        report("pi-1", f"fresh-{i:06d}")
    # pydantic-core's string cache once held every id a report carried: keys only now
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    kept = [r for r, reports in inbox.reports_by_release.items() if "pi-1" in reports]
    assert kept == [f"fresh-{i:06d}" for i in range(1500 - REPORTS_KEPT_PER_AGENT, 1500)]
    assert inbox.reports_by_release["r-honest"]["pi-2"].correct == 7  # another agent's report is untouched
    assert grown < 16 * 1024, f"{grown} bytes kept for 1,400 reports"


def test_a_device_clock_a_day_ahead_then_corrected_is_ordered_again_within_the_tolerated_skew(monkeypatch):
    """The red team's lockout: statuses made with a clock a day (or ten years) ahead were
    accepted and set the order, so once the clock was corrected every status was "older":
    refused `stale_status` for the rest of the run. The order mark now stays within the
    tolerated skew of the coordinator's clock: the corrected device is heard again once that
    much time has passed, while a replay of its older statuses still is not."""
    from edgepfl.coordinator import registry as registry_module

    now = [1_800_000_000.0]
    monkeypatch.setattr(registry_module, "wall_time", lambda: now[0])
    registry = Registry()
    skew = registry_module.MAX_CLOCK_SKEW_S
    for ahead, (ahead_session, corrected_session) in ((86_400.0, "34"), (10 * 365 * 86_400.0, "78")):
        # each process has its own session (an earlier process's status again is a replay)
        first = _with_created(status("alice", "online", session=ahead_session * 32), now[0] + ahead)
        accepted = admit_presence("alice", first, registry=registry)
        assert isinstance(accepted, Presence)
        registry.update("alice", accepted.meta, accepted.created)
        assert registry.clock_ahead("alice") == pytest.approx(ahead)  # the operator sees it (fleet view)
        replay = _with_created(status("alice", "offline", session="9" * 32), now[0] - 60)
        now[0] += skew + 1  # the clock was corrected meanwhile; the device reconnects
        corrected = _with_created(status("alice", "online", session=corrected_session * 32), now[0])
        admitted = admit_presence("alice", corrected, registry=registry)
        assert isinstance(admitted, Presence), f"{ahead} s ahead: {admitted}"
        registry.update("alice", admitted.meta, admitted.created)
        assert registry.clock_ahead("alice") is None
        assert reason(admit_presence("alice", replay, registry=registry)) == "stale_status"


def test_on_an_unsigned_deployment_one_forged_status_or_refusal_cannot_keep_an_agent_out(keyring):
    """The red team's default-deployment lockouts, with no key at all: a status
    in alice's name of a session she never had, ``offline`` and dated ten years ahead, made
    her real births "an earlier process" (stale) for the rest of the run; a refusal
    ``unsupported_method`` naming her task (read off the task topic) excluded her until she
    restarted. Unsigned, anyone could have written either: her own birth is heard again and
    a refusal costs her the one task, never the run. Signed, both rules hold as before."""
    from edgepfl.coordinator.gate import Refused, UpdateGate
    from edgepfl.coordinator.round_tasks import RoundTasks, Task
    from edgepfl.methods import create_method
    from edgepfl.protocol.envelope import refusal_frame

    def status_at(state: str, session: str, created: float, signer: Signer | None = None) -> bytes:
        return encode(MessageType.STATUS, federation=FED, sender="alice", round=-1, signer=signer, created=created,
                      meta=StatusMeta(state=state, num_train=10, num_test=5, session=session))

    def feed(registry: Registry, frame: bytes, ring: Keyring | None) -> str | None:
        verdict = admit_presence("alice", frame, ring, registry=registry)
        if isinstance(verdict, Presence):
            registry.update("alice", verdict.meta, verdict.created)
        return reason(verdict)

    now = time.time()
    for ring, signer in ((None, None), (keyring, ALICE)):
        registry = Registry()
        assert feed(registry, status_at("online", "a" * 32, now, signer), ring) is None
        # the forger's status: unsigned it gets in (anyone's), signed only a key holder's would
        forged = feed(registry, status_at("offline", "f" * 32, now + 10 * 365 * 86_400.0), ring)
        if ring is None:
            assert forged is None and not registry.is_online("alice")
            # her answer to the foreign status: heard, she is back
            assert feed(registry, status_at("online", "a" * 32, now + 1), ring) is None
            assert registry.is_online("alice")
        else:
            assert forged == "unsigned" and registry.is_online("alice")

    for ring, signer, excludes in ((None, None, False), (keyring, ALICE, True)):
        registry = Registry()
        registry.update("alice", StatusMeta(state="online", num_train=10))
        gate = UpdateGate(FED, create_method("fedavg", {}), registry, max_bytes=2**20, keyring=ring)
        tasks = RoundTasks(0)
        tasks.add(Task("alice", "c" * 32, "train"))
        refusal = refusal_frame(FED, 0, "c" * 32, sender="alice", reason="unsupported_method", detail="", signer=signer)
        verdict = gate.admit("alice", refusal, tasks, None)
        assert isinstance(verdict, Refused) and verdict.may_exclude is excludes


def test_a_device_whose_clock_was_corrected_and_that_reconnected_at_once_is_heard_at_once(monkeypatch, keyring):
    """The tolerated skew bounds the order mark (the test above), but a device whose clock was
    corrected and whose connection dropped within that window announced itself only then:
    its will (offline, its own session) was taken, its birth on the new connection was "older"
    than the mark, and nothing made it announce itself again: offline for the rest of the run.
    A birth on a later broker connection of the same process (protocol 1.3's ``connection``)
    is newer whatever the clock says; a replayed birth is not."""
    from edgepfl.coordinator import registry as registry_module

    def status_at(state: str, created: float, connection: int | None) -> bytes:
        return encode(MessageType.STATUS, federation=FED, sender="alice", round=-1, signer=ALICE, created=created,
                      meta=StatusMeta(state=state, num_train=10, num_test=5, session="d" * 32, connection=connection))

    def feed(frame: bytes) -> str | None:
        verdict = admit_presence("alice", frame, keyring, registry=registry)
        if isinstance(verdict, Presence):
            registry.update("alice", verdict.meta, verdict.created)
        return reason(verdict)

    now = [1_800_000_000.0]
    monkeypatch.setattr(registry_module, "wall_time", lambda: now[0])
    registry = Registry()
    will = status_at("offline", now[0] + 86_400 - 5, None)  # made at its start, before its births
    first_birth = status_at("online", now[0] + 86_400, 1)  # a day ahead
    assert feed(first_birth) is None
    now[0] += 60  # the clock is corrected; the connection drops with it
    assert feed(will) is None and not registry.is_online("alice")  # its own session's will
    second_birth = status_at("online", now[0], 2)
    assert feed(second_birth) is None  # the birth on connection 2: heard
    assert registry.is_online("alice")
    assert feed(status_at("offline", now[0] + 1, None)) is None  # its will again (connection 2 lost)
    assert feed(second_birth) == "stale_status"  # replayed: no later connection, not newer


def test_a_device_restarted_with_its_clock_20_minutes_behind_is_heard_and_a_replay_is_not(monkeypatch, keyring):
    """Its new process's birth is older, by its clock, than the statuses its last process sent.
    It was refused `stale_status` and the device was never sampled again; a session the run
    has not heard is a new process and is heard, and its later statuses are ordered by its own
    clock. A replay of the old process's birth (a session already heard) stays stale (signed:
    unsigned, a replay cannot be told from a forgery, see the test above)."""
    from edgepfl.coordinator import registry as registry_module

    def birth_at(session: str, created: float) -> bytes:
        return encode(MessageType.STATUS, federation=FED, sender="alice", round=-1, signer=ALICE, created=created,
                      meta=StatusMeta(state="online", num_train=10, num_test=5, session=session))

    now = [1_800_000_000.0]
    monkeypatch.setattr(registry_module, "wall_time", lambda: now[0])
    registry = Registry()
    old_birth = birth_at("5" * 32, now[0])
    registry.update("alice", admit_presence("alice", old_birth, keyring, registry=registry).meta, now[0])
    now[0] += 60  # the device restarts with its clock set 20 minutes back
    behind = now[0] - 1200
    admitted = admit_presence("alice", birth_at("6" * 32, behind), keyring, registry=registry)
    assert isinstance(admitted, Presence), admitted
    registry.update("alice", admitted.meta, admitted.created)
    assert registry.is_online("alice")
    later = birth_at("6" * 32, behind + 30)  # a roll-call answer
    assert isinstance(admit_presence("alice", later, keyring, registry=registry), Presence)
    assert reason(admit_presence("alice", old_birth, keyring, registry=registry)) == "stale_status"


def test_every_test_security_md_names_exists():
    """docs/SECURITY.md sends readers to the test that holds each claim (the threat model, the
    red team's findings): a test renamed or removed must not leave the doc pointing nowhere."""
    import re

    text = (REPO / "docs" / "SECURITY.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", text)
    assert len(named) > 30, named
    for path, test in named:
        source = REPO / path
        assert source.is_file(), f"SECURITY.md names {path}, which does not exist"
        if test:
            assert re.search(rf"^def {test}\(", source.read_text(), re.M), f"SECURITY.md names {path}::{test}"
