"""docs/schemas/*.json: JSON Schemas of the header, every message meta, the run spec and
the release manifest, generated from the pydantic models. The committed files must be
exactly what the generator writes now, and what the real encoder puts on the wire must
validate against them (and what the decoder refuses, they refuse too)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgepfl.protocol import (
    Capabilities,
    ChunkMeta,
    CoordinatorMeta,
    MessageType,
    MetricsMeta,
    NackMeta,
    ProtocolError,
    RefusalMeta,
    ReleaseMeta,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    decode,
    encode,
    split_frame,
)
from edgepfl.protocol.messages import META_TYPES
from edgepfl.protocol.schemas import main, render, schema_documents, write_schemas
from edgepfl.protocol.secagg import PeerKeys, RevealedShare, SealedShare, SecAggMeta, SecAggTask

from tests.wire_samples import sample_manifest, sample_run_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schemas"
REGENERATE = "run: python -m edgepfl.protocol.schemas --out docs/schemas"


def test_committed_schemas_are_what_the_models_generate(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in DOCS.glob("*.json")}
    assert sorted(committed) == sorted(generated), REGENERATE
    for name, text in generated.items():
        assert committed[name] == text, f"docs/schemas/{name} is out of date; {REGENERATE}"
    # one file per message type, plus header, run spec and manifest
    assert set(generated) == {"header.json", "run-spec.json", "release-manifest.json",
                              *(f"meta-{t.value}.json" for t in META_TYPES)}


def test_a_stale_schema_file_is_removed_on_regeneration(tmp_path):
    (tmp_path / "meta-gone.json").write_text("{}")
    write_schemas(tmp_path)
    assert not (tmp_path / "meta-gone.json").exists()
    assert json.loads((tmp_path / "header.json").read_text()) == schema_documents()["header.json"]
    assert render({"a": 1}).endswith("}\n")


def _frames() -> list[bytes]:
    run = sample_run_spec("fedrep", head_epochs=2)
    kw = dict(federation="demo", round=3)
    frames = [
        encode(MessageType.STATUS, sender="pi-1", meta=StatusMeta(state="online", num_train=5, num_test=2), **kw),
        encode(MessageType.TASK, sender="coordinator", tensors={"encoder.net.1.weight": np.ones((64, 128), np.float32)},  # > 1 chunk
               meta=TaskMeta(task_id="a" * 32, kind="train", run=run, seed=9, deadline_s=60), **kw),
        encode(MessageType.UPDATE, sender="pi-1", tensors={"head.bias": np.zeros(3, np.float32)},
               meta=UpdateMeta(task_id="a" * 32, kind="train", num_train=5, num_test=2, eval_correct=1,
                               eval_loss=0.5, train_loss=0.4, extra={"mask_ratio": 0.5}), **kw),
        encode(MessageType.METRICS, sender="pi-1", meta=MetricsMeta(tier="head", head="lr", values={"x": 1.0}), **kw),
        encode(MessageType.COORDINATOR, sender="coordinator",
               meta=CoordinatorMeta(state="online", round=3, max_message_bytes=40_000, max_payload_bytes=2**20), **kw),
        encode(MessageType.RELEASE, sender="coordinator", tensors={"artifact": np.arange(8, dtype=np.uint8)},
               meta=ReleaseMeta(release_id="fedavg-r1-0123456789ab", manifest=sample_manifest(run),
                                sha256="e" * 64, size_bytes=8), **kw),
        encode(MessageType.NACK, sender="coordinator",
               meta=NackMeta(message_id="b" * 32, rejected_type="update", reason="wrong_shape", task_id="a" * 32), **kw),
        encode(MessageType.REFUSAL, sender="pi-1", meta=RefusalMeta(task_id="a" * 32, reason="busy"), **kw),
        encode(MessageType.STATUS, sender="pi-2", meta=StatusMeta(
            state="online", capabilities=Capabilities(methods=["fedavg"], archs=["cnn"], max_message_bytes=65_536)),
            **kw),
        encode(MessageType.SECAGG, sender="coordinator", meta=SecAggMeta(
            session="c" * 32, step="roster", threshold=2,
            neighbours=[PeerKeys(agent=a, mask_public="A" * 43 + "=", share_public="B" * 43 + "=") for a in "xyz"]),
            **kw),
        encode(MessageType.SECAGG, sender="pi-1", meta=SecAggMeta(
            session="c" * 32, step="reveal", seeds=[RevealedShare(agent="x", index=1, share="A" * 22 + "==")],
            mask_keys=[RevealedShare(agent="y", index=2, share="B" * 43 + "=")]), **kw),
        encode(MessageType.TASK, sender="coordinator", meta=TaskMeta(
            task_id="d" * 32, kind="train", run=run, seed=9, deadline_s=60, secagg=SecAggTask(
                session="c" * 32, weight_cap=50, shares=[SealedShare(peer="x", ciphertext="QUJD")],
                clip_norm=1.0, noise_std=0.5)), **kw),
    ]
    frames += split_frame(frames[1], 16_384 + 2048, federation="demo", sender="coordinator", round=3)[:1]
    return frames


def test_every_frame_the_encoder_writes_validates_against_the_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    docs = schema_documents()
    header_schema = jsonschema.Draft202012Validator(docs["header.json"])
    seen = set()
    for frame in _frames():
        message = decode(frame)
        header = json.loads(message.header.model_dump_json())
        header_schema.validate(header)
        jsonschema.Draft202012Validator(docs[f"meta-{message.type.value}.json"]).validate(header["meta"])
        seen.add(message.type)
        if message.type == MessageType.TASK:
            jsonschema.Draft202012Validator(docs["run-spec.json"]).validate(header["meta"]["run"])
        if message.type == MessageType.RELEASE:
            jsonschema.Draft202012Validator(docs["release-manifest.json"]).validate(header["meta"]["manifest"])
    assert seen == set(META_TYPES)  # chunk included


@pytest.mark.parametrize("type_, meta, why", [
    (MessageType.TASK, {"task_id": "A" * 32, "kind": "train", "run": None, "seed": 1, "deadline_s": 1}, "pattern"),
    (MessageType.UPDATE, {"task_id": "a" * 32, "kind": "train", "num_train": -1, "num_test": 1, "eval_correct": 0,
                          "surprise": 1}, "negative count beside an unknown field"),
    (MessageType.STATUS, {"state": "online", "version": "one"}, "version not major.minor"),
    (MessageType.COORDINATOR, {"state": "online", "max_message_bytes": 100}, "below 16 KiB"),
    (MessageType.CHUNK, {"parent_id": "b" * 32, "index": 0, "count": 0, "total_bytes": 1,
                         "total_sha256": "c" * 64}, "count 0"),
])
def test_what_the_decoder_refuses_the_schemas_refuse(type_, meta, why):
    jsonschema = pytest.importorskip("jsonschema")
    if type_ == MessageType.TASK:
        meta = {**meta, "run": json.loads(sample_run_spec().model_dump_json())}
    validator = jsonschema.Draft202012Validator(schema_documents()[f"meta-{type_.value}.json"])
    assert not validator.is_valid(meta), why
    frame = encode(MessageType.STATUS, federation="demo", sender="pi-1", round=-1, meta=StatusMeta(state="online"))
    # the same meta under a real header: the decoder's verdict agrees
    head_len = int.from_bytes(frame[4:8], "big")
    header = json.loads(frame[8:8 + head_len])
    header.update(type=type_.value, meta=meta)
    head = json.dumps(header).encode()
    with pytest.raises(ProtocolError, match="malformed"):
        decode(frame[:4] + len(head).to_bytes(4, "big") + head)
    assert ChunkMeta.model_fields["count"].metadata  # (the bound the schema carries comes from the model)


def test_schemas_accept_what_a_newer_minor_version_adds_as_the_decoder_does():
    """§16: receivers ignore unknown keys, so the published schemas do too (an implementer
    validating incoming frames with them must not refuse a 1.3 coordinator's task)."""
    jsonschema = pytest.importorskip("jsonschema")
    docs = schema_documents()
    run = json.loads(sample_run_spec().model_dump_json())
    run["data"]["colour_space"] = "srgb"
    meta = {"task_id": "a" * 32, "kind": "train", "run": run, "seed": 1, "deadline_s": 5, "priority": 2}
    jsonschema.Draft202012Validator(docs["meta-task.json"]).validate(meta)
    frame = encode(MessageType.STATUS, federation="demo", sender="pi-1", round=-1, meta=StatusMeta(state="online"))
    head_len = int.from_bytes(frame[4:8], "big")
    header = dict(json.loads(frame[8:8 + head_len]), type="task", meta=meta)
    head = json.dumps(header).encode()
    message = decode(frame[:4] + len(head).to_bytes(4, "big") + head)
    assert set(message.unknown_fields) == {"meta.priority", "meta.run.data.colour_space"}
    assert '"additionalProperties": false' not in render(docs["meta-task.json"])
