"""Parse-safe input: every decoder of untrusted bytes refuses the poison classes with its own
one-line error, and fuzzed input never raises anything else (the red team's 638 escapes in
71,054 calls were all RecursionError from ``[[[[…`` headers).

One fuzz target per decoder, each seeded with the poison corpus below: a frame header, the
coordinator's status / metrics / update gates, the fleet view (``edgepfl status``), a
release manifest (``predict``, ``fit-head``, the head agent), the head agent's installed
record, the trainer's task order, metrics files, YAML configs and ``--set`` values.
"""

from __future__ import annotations

import json
import struct

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepfl.config import ConfigError, apply_overrides, load_yaml, load_yaml_bounded
from edgepfl.coordinator.gate import Presence, Rejection, admit_metrics, admit_presence, attribute_raw
from edgepfl.edge_agent.task_guard import TaskGuard
from edgepfl.metrics import MetricsError, read_head_metrics, read_metrics
from edgepfl.protocol import MetricsMeta, ProtocolError, decode
from edgepfl.protocol.bounded_json import MAX_DEPTH, BoundedJSONError, loads
from edgepfl.protocol.envelope import peek_header
from edgepfl.protocol.manifest import ManifestError, read_manifest
from edgepfl.protocol.view import parse_view

#: JSON texts that crashed or could crash a reader: deep nesting of both kinds (the
#: red team's frame was 200,000 levels), nesting hidden after a valid prefix, an integer
#: past Python's 4,300-digit limit, the non-JSON constants, a float overflow, bad UTF-8
POISON_JSON: list[bytes] = [
    b"[" * 200_000,
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b'{"type": "update", "meta": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    b'{"round": ' + b"9" * 5_000 + b"}",
    b'{"created": NaN}',
    b'{"created": Infinity}',
    b'{"created": 1e999}',
    b'{"sender": "\xff\xfe"}',
    b'{"sender": "\\ud800',
    b"",
]


def frame_with_header(head: bytes, body: bytes = b"") -> bytes:
    return b"EPF1" + struct.pack(">I", len(head)) + head + body


POISON_FRAMES = [frame_with_header(h) for h in POISON_JSON]

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
shallow_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=30)


# ------------------------------------------------------------------ the parser itself
@pytest.mark.parametrize("text", POISON_JSON, ids=range(len(POISON_JSON)))
def test_poison_is_one_bounded_json_error_of_one_line(text):
    with pytest.raises(BoundedJSONError) as caught:
        loads(text, what="header")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("header")


def test_nesting_up_to_the_limit_parses_and_one_more_level_does_not():
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(BoundedJSONError, match=f"more than {MAX_DEPTH} levels"):
        loads("{\"a\": " * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1))
    assert loads('{"s": "' + "[" * 10_000 + '"}') == {"s": "[" * 10_000}  # brackets in a string are text


@settings(max_examples=300, deadline=None)
@given(shallow_json)
def test_loads_reads_what_json_reads_within_the_bounds(value):
    text = json.dumps(value)
    assert loads(text) == json.loads(text)
    assert loads(text.encode()) == json.loads(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.sampled_from(POISON_JSON).flatmap(
    lambda p: st.integers(0, max(0, len(p) - 1)).map(lambda cut: p[:cut] + p[cut + 1:])))
def test_loads_raises_nothing_but_its_own_error(data):
    try:
        loads(data)
    except BoundedJSONError:
        pass


# ------------------------------------------------------------------ one target per decoder
def _valid_frames() -> list[bytes]:
    """A status, a metrics report and an update with tensors, as an agent sends them."""
    import numpy as np

    from edgepfl.protocol import MessageType, MetricsMeta, StatusMeta, UpdateMeta, encode

    common = {"federation": "fed", "sender": "agent-00", "round": 0}
    return [
        encode(MessageType.STATUS, meta=StatusMeta(state="online", num_train=100, num_test=20), round=-1,
               federation="fed", sender="agent-00"),
        encode(MessageType.METRICS, meta=MetricsMeta(tier="head", release_id="r1", num_test=20, eval_correct=9),
               **common),
        encode(MessageType.UPDATE, meta=UpdateMeta(task_id="0" * 32, kind="train", num_train=100, num_test=20,
                                                   eval_correct=9), tensors={"w": np.ones((3, 2), np.float32)},
               **common),
    ]


def _fuzzed_frames():
    """The poison frames, then arbitrary bytes, and valid frames with one byte replaced
    (header, body or signature): what a fuzzer sends a frame decoder."""
    valid = _valid_frames()
    return st.sampled_from(POISON_FRAMES) | st.binary(max_size=200) | st.sampled_from(valid).flatmap(
        lambda f: st.tuples(st.integers(0, len(f)), st.integers(0, 255)).map(
            lambda cut_byte: f[:cut_byte[0]] + bytes([cut_byte[1]]) + f[cut_byte[0] + 1:]))


def _decode(frame):
    try:
        decode(frame)
    except ProtocolError as exc:
        assert "\n" not in str(exc)


def _peek(frame):
    assert peek_header(frame) is None or isinstance(peek_header(frame), dict)


def _status(frame):
    assert isinstance(admit_presence("agent-00", frame), (Rejection, Presence))


def _metrics(frame):
    assert isinstance(admit_metrics("agent-00", frame), (Rejection, MetricsMeta))


def _attribute(frame):
    attribute_raw("agent-00", frame, None)


FRAME_DECODERS = {"decode": _decode, "peek_header": _peek, "admit_presence": _status, "admit_metrics": _metrics,
                  "attribute_raw": _attribute}


@pytest.mark.parametrize("frame", POISON_FRAMES, ids=range(len(POISON_FRAMES)))
def test_the_frame_decoders_refuse_each_poison_frame_as_malformed(frame):
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert caught.value.reason == "malformed"
    assert peek_header(frame) is None
    for admit in (admit_presence, admit_metrics):
        verdict = admit("agent-00", frame)
        assert isinstance(verdict, Rejection) and verdict.reason == "malformed", verdict


@pytest.mark.parametrize("target", sorted(FRAME_DECODERS))
def test_fuzz_frame_decoder(target):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_fuzzed_frames())
    def run(frame):
        FRAME_DECODERS[target](frame)

    run()


@pytest.mark.parametrize("text", POISON_JSON, ids=range(len(POISON_JSON)))
def test_the_fleet_view_refuses_poison_in_one_line(text):
    with pytest.raises(ValueError, match="not an edgepfl fleet view") as caught:
        parse_view(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text", POISON_JSON, ids=range(len(POISON_JSON)))
def test_files_the_tools_read_refuse_poison_with_their_own_error(tmp_path, text):
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(text)
    with pytest.raises(ManifestError):
        read_manifest(manifest)
    rows = tmp_path / "metrics.jsonl"
    rows.write_bytes(text + b"\n")
    if text.strip():
        with pytest.raises(MetricsError):
            read_metrics(rows)
    head = tmp_path / "head_metrics.json"
    head.write_bytes(text)
    with pytest.raises(MetricsError):
        read_head_metrics(head)


@pytest.mark.parametrize("text", POISON_JSON, ids=range(len(POISON_JSON)))
def test_an_agents_task_order_file_of_poison_starts_afresh(tmp_path, text, caplog):
    from edgepfl.edge_agent.task_guard import ORDER_FILE

    (tmp_path / ORDER_FILE).write_bytes(text)
    guard = TaskGuard("agent-00", tmp_path, strict=False)
    assert guard._newest == {}
    assert "unreadable" in caplog.text


POISON_YAML = [
    "a: " + "[" * 100_000 + "]" * 100_000,
    "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 2_000)) + "  " * 2_000 + "x: 1\n",
    # a billion laughs: nine levels of ten aliases each
    "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" for i in range(1, 9)),
]


@pytest.mark.parametrize("text", POISON_YAML, ids=["flow", "block", "aliases"])
def test_a_poison_config_is_one_config_error(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_yaml(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError):
        apply_overrides({}, [f"train.lr={text}"])


def test_a_config_with_a_few_aliases_still_loads():
    assert load_yaml_bounded("base: &b {lr: 0.1}\nmore: *b\n") == {"base": {"lr": 0.1}, "more": {"lr": 0.1}}
    with pytest.raises(yaml.YAMLError):
        load_yaml_bounded("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
