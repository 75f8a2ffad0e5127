"""The update gate, without a broker: every rejection reason, from real encoded frames.

Each test builds the frame a device would publish (``edgepfl.protocol.encode``) and
checks the verdict the coordinator would reach on it, reason tag included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgepfl.config import ModelSpec
from edgepfl.coordinator.gate import (
    MAX_SAMPLES,
    Accepted,
    Attribution,
    Presence,
    Refused,
    Rejection,
    UpdateGate,
    admit_metrics,
    admit_presence,
    admit_state,
)
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.round_tasks import RoundTasks, Task
from edgepfl.methods import ClientUpdate, ServerState, UpdateRejected, create_method
from edgepfl.protocol import (
    MessageType,
    MetricsMeta,
    RefusalMeta,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    encode,
    new_message_id,
)

from tests.wire_samples import sample_run_spec

FED = "gatefed"
ROUND = 3
ANNOUNCED = 100


@pytest.fixture(scope="module")
def method_and_state():
    method = create_method("fedavg")
    torch.manual_seed(0)
    model = method.build_model(ModelSpec(arch="mlp", feature_dim=8, norm="none"), (1, 4, 4), 3)
    return method, method.init_server(model)


class Round:
    """A gate, a registry with two known agents and one round's tasks: what a coordinator holds."""

    def __init__(self, method, state, max_bytes: int = 1 << 20):
        self.method, self.state = method, state
        self.registry = Registry()
        for agent in ("alice", "bob"):
            self.registry.update(agent, StatusMeta(state="online", num_train=ANNOUNCED, num_test=20))
        self.gate = UpdateGate(FED, method, self.registry, max_bytes=max_bytes)
        self.tasks = RoundTasks(ROUND)
        self.tasks.add(Task("alice", new_message_id(), "train"))
        self.tasks.add(Task("bob", new_message_id(), "evaluate"))

    def tensors(self) -> dict[str, np.ndarray]:
        return self.method.payload_for(self.state, "alice")

    def frame(self, agent="alice", *, type=MessageType.UPDATE, sender=None, federation=FED, round=ROUND,
              task_id=None, kind=None, tensors=None, message_id=None, **meta) -> bytes:
        task = self.tasks.get(agent)
        kind = kind or (task.kind if task else "train")
        fields = dict(task_id=task_id or (task.task_id if task else new_message_id()), kind=kind,
                      num_train=ANNOUNCED, num_test=20, eval_correct=5)
        fields.update(meta)
        if tensors is None:
            tensors = self.tensors() if kind == "train" else {}
        return encode(type, federation=federation, sender=sender or agent, round=round, meta=UpdateMeta(**fields),
                      tensors=tensors, message_id=message_id)

    def admit(self, frame: bytes, agent="alice"):
        return self.gate.admit(agent, frame, self.tasks, self.state)

    def reopen(self, agent="alice", kind="train") -> None:
        """A fresh task for ``agent``, as if it was sent now: for trying another answer after
        a rejected one (which answered the task it named)."""
        self.tasks.add(Task(agent, new_message_id(), kind))


@pytest.fixture
def rnd(method_and_state):
    return Round(*method_and_state)


def reason(verdict) -> str:
    assert isinstance(verdict, Rejection), verdict
    return verdict.reason


def test_a_valid_train_update_is_accepted_with_its_weight_and_tensors(rnd):
    verdict = rnd.admit(rnd.frame())
    assert isinstance(verdict, Accepted) and verdict.agent_id == "alice"
    assert verdict.meta.eval_correct == 5 and verdict.update.num_samples == ANNOUNCED
    assert set(verdict.update.tensors) == set(rnd.tensors())
    assert rnd.tasks.waiting == {"bob"}


def test_a_valid_evaluate_answer_is_accepted_without_an_update(rnd):
    verdict = rnd.admit(rnd.frame("bob"), "bob")
    assert isinstance(verdict, Accepted) and verdict.update is None and verdict.meta.kind == "evaluate"
    assert rnd.tasks.waiting == {"alice"}


@pytest.mark.parametrize("frame, want", [
    (b"\x00garbage\xff" * 10, "malformed"),
    (b"EPF1" + b"\x00" * 64, "malformed"),
])
def test_bytes_that_are_no_frame_are_rejected_with_the_decoder_reason(rnd, frame, want):
    assert reason(rnd.admit(frame)) == want


def test_a_truncated_frame_is_malformed(rnd):
    frame = rnd.frame()
    assert reason(rnd.admit(frame[: len(frame) // 2])) == "malformed"


def test_a_flipped_body_byte_is_corrupt(rnd):
    frame = bytearray(rnd.frame())
    frame[-1] ^= 0xFF
    assert reason(rnd.admit(bytes(frame))) == "corrupt"


def test_a_frame_over_the_payload_limit_is_oversized(method_and_state):
    small = Round(*method_and_state, max_bytes=256)
    assert reason(small.admit(small.frame())) == "oversized"


def test_non_finite_tensors_are_rejected(rnd):
    tensors = rnd.tensors()
    key = next(iter(tensors))
    tensors[key] = np.full_like(tensors[key], np.nan)
    assert reason(rnd.admit(rnd.frame(tensors=tensors))) == "non_finite"


def test_a_status_on_the_update_topic_is_the_wrong_type(rnd):
    frame = encode(MessageType.STATUS, federation=FED, sender="alice", round=-1, meta=StatusMeta(state="online"))
    assert reason(rnd.admit(frame)) == "wrong_type"


def test_an_update_signed_by_another_agent_is_rejected(rnd):
    assert reason(rnd.admit(rnd.frame(sender="bob"))) == "wrong_sender"


def test_an_update_for_another_federation_is_rejected(rnd):
    assert reason(rnd.admit(rnd.frame(federation="other"))) == "wrong_federation"


def test_the_same_message_twice_is_a_duplicate_and_counted_once(rnd):
    frame = rnd.frame()
    assert isinstance(rnd.admit(frame), Accepted)
    verdict = rnd.admit(frame)
    assert reason(verdict) == "duplicate" and "message" in verdict.detail


def test_a_second_answer_to_an_answered_task_is_a_duplicate(rnd):
    assert isinstance(rnd.admit(rnd.frame()), Accepted)
    verdict = rnd.admit(rnd.frame())  # new message id, same task
    assert reason(verdict) == "duplicate" and "already answered" in verdict.detail


def test_a_rejected_answer_to_the_open_task_is_attributed_for_its_nack_but_unsigned_answers_nothing(rnd):
    # signed, it would answer the task (test_signing); unsigned, anyone could have written it
    message_id = new_message_id()
    verdict = rnd.admit(rnd.frame(eval_correct=99, message_id=message_id))
    assert reason(verdict) == "malformed" and rnd.tasks.waiting == {"alice", "bob"}
    task_id = rnd.tasks.get("alice").task_id
    assert verdict.attributed == Attribution(message_id, "update", ROUND, task_id, verified=False)
    assert isinstance(rnd.admit(rnd.frame()), Accepted)


def test_a_rejected_message_that_answers_no_open_task_leaves_no_trace(rnd):
    # neither its id nor the task is used up: a resend under the same id is accepted
    message_id = new_message_id()
    assert reason(rnd.admit(rnd.frame(round=ROUND - 1, message_id=message_id))) == "stale"
    assert reason(rnd.admit(rnd.frame(task_id=new_message_id(), message_id=message_id))) == "unexpected"
    assert rnd.tasks.waiting == {"alice", "bob"}
    assert isinstance(rnd.admit(rnd.frame(message_id=message_id)), Accepted)


def test_on_an_unsigned_deployment_no_rejected_frame_answers_a_task(rnd):
    """Anyone can write a header naming alice: a garbage frame ahead of her real update
    must not burn her task (the red team silenced any device this way)."""
    forged = rnd.frame(num_train=ANNOUNCED + 1)  # her task id, her round, a count she did not announce
    verdict = rnd.admit(forged)
    assert reason(verdict) == "malformed" and verdict.attributed is not None and not verdict.attributed.verified
    assert rnd.tasks.waiting == {"alice", "bob"}  # still open for the real answer
    assert isinstance(rnd.admit(rnd.frame()), Accepted)


def test_a_frame_whose_meta_does_not_decode_is_attributed_when_sender_and_round_are_the_agents(rnd):
    def raw(meta: dict, sender="alice", round=ROUND) -> bytes:
        frame = rnd.frame("bob")  # a valid evaluate answer: empty body; its meta is swapped for ``meta``
        head_len = int.from_bytes(frame[4:8], "big")
        header = json.loads(frame[8:8 + head_len])
        header.update(meta=meta, sender=sender, round=round)
        head = json.dumps(header).encode()
        return b"EPF1" + len(head).to_bytes(4, "big") + head

    unreadable = {"task_id": "not-an-id", "kind": "train"}
    assert reason(rnd.admit(raw(unreadable, sender="mallory"))) == "malformed"  # not alice's frame
    assert reason(rnd.admit(raw(unreadable, round=ROUND - 1))) == "malformed"  # not this round's
    assert reason(rnd.admit(raw({**unreadable, "task_id": new_message_id()}))) == "malformed"  # another task
    assert rnd.tasks.waiting == {"alice", "bob"}
    verdict = rnd.admit(raw(unreadable))
    assert reason(verdict) == "malformed" and verdict.attributed.task_id is None  # alice's (for a NACK)
    assert rnd.tasks.waiting == {"alice", "bob"}  # unsigned: it answers nothing (test_signing: signed, it does)


def test_a_refusal_answers_the_task_with_its_reason_and_an_unknown_reason_is_error(rnd):
    def refusal(agent: str, reason: str, **header) -> bytes:
        task = rnd.tasks.get(agent)
        return encode(MessageType.REFUSAL, federation=FED, sender=agent, round=header.get("round", ROUND),
                      meta=RefusalMeta(task_id=header.get("task_id", task.task_id), reason=reason, detail="no"))

    assert reason(rnd.admit(refusal("alice", "unsupported_method", task_id=new_message_id()))) == "unexpected"
    assert reason(rnd.admit(refusal("alice", "unsupported_method", round=ROUND - 1))) == "stale"
    verdict = rnd.admit(refusal("alice", "unsupported_method"))
    assert isinstance(verdict, Refused) and verdict.reason == "unsupported_method" and rnd.tasks.waiting == {"bob"}
    assert reason(rnd.admit(rnd.frame())) == "duplicate"  # refused is answered
    verdict = rnd.admit(refusal("bob", "out_of_cheese"), "bob")
    assert isinstance(verdict, Refused) and verdict.reason == "error" and not rnd.tasks.waiting


def test_an_agent_that_never_sent_a_status_is_unknown(rnd):
    assert reason(rnd.admit(rnd.frame("ghost"), "ghost")) == "unknown_agent"


def test_an_update_for_another_round_is_stale(rnd):
    assert reason(rnd.admit(rnd.frame(round=ROUND - 1))) == "stale"
    assert reason(rnd.admit(rnd.frame(round=ROUND + 5))) == "stale"


def test_an_update_for_a_round_that_stopped_collecting_is_stale(rnd):
    rnd.tasks.close()  # its aggregate is closed: nothing may be added to it any more
    assert reason(rnd.admit(rnd.frame())) == "stale"
    assert rnd.tasks.waiting == {"alice", "bob"}


def test_an_answer_to_a_task_never_sent_is_unexpected(rnd):
    assert reason(rnd.admit(rnd.frame(task_id=new_message_id()))) == "unexpected"
    rnd.registry.update("carol", StatusMeta(state="online", num_train=10))
    assert reason(rnd.admit(rnd.frame("carol"), "carol")) == "unexpected"  # known, but got no task


@pytest.mark.parametrize("agent, change, detail", [
    ("alice", {"kind": "evaluate", "tensors": {}}, "answered a train task with evaluate"),
    ("alice", {"eval_correct": 21}, "eval_correct exceeds num_test"),
    ("alice", {"num_train": 0}, "num_train = 0"),
    ("bob", {"tensors": {"x": np.zeros(2, np.float32)}}, "evaluate answer carries tensors"),
])
def test_answers_that_contradict_their_task_are_malformed(rnd, agent, change, detail):
    verdict = rnd.admit(rnd.frame(agent, **change), agent)
    assert reason(verdict) == "malformed" and detail in verdict.detail


@pytest.mark.parametrize("num_train", [ANNOUNCED + 1, 10**300, 10**400])
def test_a_train_update_may_not_claim_more_samples_than_its_status_announced(rnd, num_train):
    # 10**400 used to crash the coordinator (OverflowError in the weighted mean) and
    # 10**300 made one agent the whole model: the weight is capped by the status.
    verdict = rnd.admit(rnd.frame(num_train=num_train))
    assert reason(verdict) == "malformed" and f"the {ANNOUNCED} samples its status announced" in verdict.detail
    assert len(verdict.detail) < 200
    rnd.reopen()
    assert isinstance(rnd.admit(rnd.frame(num_train=ANNOUNCED // 2)), Accepted)  # fewer is fine


def test_the_announced_count_is_the_latest_status(rnd):
    rnd.registry.update("alice", StatusMeta(state="online", num_train=10))
    assert reason(rnd.admit(rnd.frame(num_train=11))) == "malformed"
    rnd.reopen()
    assert isinstance(rnd.admit(rnd.frame(num_train=10)), Accepted)


def test_tensors_that_do_not_fit_the_server_state_carry_the_method_reason(rnd):
    tensors = rnd.tensors()
    key = next(k for k, v in tensors.items() if v.ndim == 2)
    missing = {k: v for k, v in tensors.items() if k != key}
    extra = dict(tensors, **{"intruder.weight": np.zeros(3, np.float32)})
    for wrong, want in [(missing, "wrong_tensors"), (extra, "wrong_tensors"),
                        (dict(tensors, **{key: tensors[key][:, :-1]}), "wrong_shape"),
                        (dict(tensors, **{key: tensors[key].astype(np.float64)}), "wrong_shape")]:
        rnd.reopen()
        verdict = rnd.admit(rnd.frame(tensors=wrong))
        assert reason(verdict) == want and verdict.attributed is not None
    assert rnd.tasks.waiting == {"alice", "bob"}  # unsigned: her rejected answers leave her task open


def test_a_method_may_reject_with_its_own_reason(method_and_state):
    method, state = method_and_state

    class Picky(type(method)):
        def check_update(self, state, update: ClientUpdate) -> None:
            raise UpdateRejected("too_picky", "never good enough")

    rnd = Round(Picky(), state)
    verdict = rnd.admit(rnd.frame())
    assert reason(verdict) == "too_picky" and "never good enough" in verdict.detail


def test_the_checks_run_in_the_documented_order(rnd):
    # wrong sender AND wrong federation AND stale: the first in PROTOCOL.md §7's table wins
    assert reason(rnd.admit(rnd.frame(sender="bob", federation="other", round=0))) == "wrong_sender"
    # unknown agent AND stale
    assert reason(rnd.admit(rnd.frame("ghost", round=0), "ghost")) == "unknown_agent"


# ---------------------------------------------------------------- status and metrics


def status(agent: str, **meta) -> bytes:
    return encode(MessageType.STATUS, federation=FED, sender=agent, round=-1,
                  meta=StatusMeta(**{"state": "online", **meta}))


def test_a_status_is_admitted_with_its_meta():
    presence = admit_presence("alice", status("alice", tier="head", num_train=7))
    assert isinstance(presence, Presence)
    assert presence.meta.tier == "head" and presence.meta.num_train == 7


def test_a_status_of_another_major_version_is_refused_and_any_minor_of_ours_is_admitted():
    verdict = admit_presence("alice", status("alice", version="2.0"))
    assert reason(verdict) == "unsupported_version" and "2.0" in verdict.detail
    assert verdict.attributed is not None and verdict.attributed.type == "status"  # the agent is told
    for version in ("1.0", "1.1", "1.2", "1.9"):
        assert isinstance(admit_presence("alice", status("alice", version=version)), Presence)


def test_a_status_from_another_agent_or_of_another_type_is_the_wrong_sender():
    assert reason(admit_presence("alice", status("bob"))) == "wrong_sender"
    task = encode(MessageType.TASK, federation=FED, sender="alice", round=0,
                  meta=TaskMeta(task_id=new_message_id(), kind="train", run=sample_run_spec(), seed=0, deadline_s=1))
    assert reason(admit_presence("alice", task)) == "wrong_sender"


def test_a_status_that_is_no_frame_is_rejected_with_the_decoder_reason():
    verdict = admit_presence("alice", b"junk")
    assert reason(verdict) == "malformed" and verdict.detail.startswith("status:")


@pytest.mark.parametrize("field", ["num_train", "num_test"])
def test_a_status_announcing_absurd_sample_counts_is_malformed(field):
    assert reason(admit_presence("alice", status("alice", **{field: MAX_SAMPLES + 1}))) == "malformed"
    assert reason(admit_presence("alice", status("alice", **{field: 10**400}))) == "malformed"
    assert isinstance(admit_presence("alice", status("alice", **{field: MAX_SAMPLES})), Presence)


def test_metrics_from_the_agent_of_the_topic_are_admitted():
    frame = encode(MessageType.METRICS, federation=FED, sender="pi", round=2,
                   meta=MetricsMeta(tier="head", head="lr", num_test=10, eval_correct=7))
    meta = admit_metrics("pi", frame)
    assert isinstance(meta, MetricsMeta) and meta.eval_correct == 7
    assert reason(admit_metrics("other", frame)) == "malformed"
    assert reason(admit_metrics("pi", status("pi"))) == "malformed"
    assert reason(admit_metrics("pi", b"EPF1")) == "malformed"


# --------------------------------------------------------------------------- a round's closed aggregate


def moved(state: ServerState, by: float, **client_tensors) -> ServerState:
    return ServerState({k: (v + by).astype(v.dtype) for k, v in state.global_tensors.items()},
                       client_tensors=client_tensors)


def test_an_aggregate_is_adopted_when_finite_and_within_the_change_bound(method_and_state):
    _, state = method_and_state
    assert admit_state(state, moved(state, 0.001), 10.0) is None
    assert admit_state(state, moved(state, 1e6), None) is None  # no bound: only finiteness


def test_a_non_finite_aggregate_is_refused_wherever_the_nan_is(method_and_state):
    _, state = method_and_state
    bad = moved(state, 0.0)
    key = next(iter(bad.global_tensors))
    bad.global_tensors[key] = bad.global_tensors[key].copy()
    bad.global_tensors[key].flat[0] = np.nan
    verdict = admit_state(state, bad, None)
    assert isinstance(verdict, Rejection) and verdict.reason == "non_finite" and key in verdict.detail
    head = {"head.weight": np.array([[np.inf]], np.float32)}
    verdict = admit_state(state, moved(state, 0.0, a=head), None)  # a per-client tensor (FedPAC's heads)
    assert isinstance(verdict, Rejection) and verdict.reason == "non_finite"


def test_an_aggregate_that_moves_more_than_the_ratio_of_the_norm_is_diverged(method_and_state):
    _, state = method_and_state
    shared = state.shared_params()
    norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in shared.values())))
    size = sum(v.size for v in shared.values())
    by = 2.0 * max(norm, 1.0) / np.sqrt(size)  # a change of norm 2 x max(norm, 1)
    assert admit_state(state, moved(state, by), 2.5) is None
    verdict = admit_state(state, moved(state, by), 1.5)
    assert isinstance(verdict, Rejection) and verdict.reason == "diverged" and verdict.agent_id is None
    zero = ServerState({k: np.zeros_like(v) for k, v in shared.items()})
    assert admit_state(zero, moved(zero, 0.5 / np.sqrt(size)), 1.0) is None  # a zero state may still move


def test_the_gate_keeps_message_ids_of_the_current_round_only_and_a_replay_stays_rejected(rnd):
    frame = rnd.frame()
    assert isinstance(rnd.admit(frame), Accepted)
    assert len(rnd.gate._seen) == 1
    # the next round: a replay of the last round's accepted message is still refused
    rnd.tasks = RoundTasks(ROUND + 1)
    rnd.tasks.add(Task("alice", new_message_id(), "train"))
    assert reason(rnd.admit(frame)) == "stale"
    assert len(rnd.gate._seen) == 0  # a long run does not grow the set round after round
    assert isinstance(rnd.admit(rnd.frame(round=ROUND + 1)), Accepted)
    assert len(rnd.gate._seen) == 1


def test_an_update_weighs_at_most_the_rounds_cap_and_what_was_announced_when_its_task_was_sent(rnd):
    rnd.tasks = RoundTasks(ROUND, weight_cap=60)
    rnd.tasks.add(Task("alice", new_message_id(), "train", announced=ANNOUNCED))
    verdict = rnd.admit(rnd.frame(num_train=ANNOUNCED))
    assert isinstance(verdict, Accepted) and verdict.update.num_samples == 60  # cut to the cap, not refused
    assert verdict.meta.num_train == ANNOUNCED  # the report itself is kept as sent
    rnd.reopen()
    assert rnd.admit(rnd.frame(num_train=40)).update.num_samples == 40  # under the cap: as reported

    # announcing more after the task was sent buys nothing: the task's count holds
    rnd.registry.update("alice", StatusMeta(state="online", num_train=2**24, num_test=20))
    rnd.tasks.add(Task("alice", new_message_id(), "train", announced=ANNOUNCED))
    verdict = rnd.admit(rnd.frame(num_train=2**24))
    assert reason(verdict) == "malformed" and f"the {ANNOUNCED} samples" in verdict.detail


# --------------------------------------------------------------------------- compressed updates (1.6)
def _compressed_round(method_and_state, codec="q8"):
    from edgepfl.protocol import UplinkSpec

    rnd = Round(*method_and_state)
    uplink = UplinkSpec(codec=codec, block=16, keep=0.5 if codec.startswith("topk+") else None)
    rnd.tasks.add(Task("alice", new_message_id(), "train", uplink=uplink))
    return rnd, uplink


def _encoded(rnd, uplink, *, shift=0.01, seed=0):
    from edgepfl import codecs

    reference = rnd.tensors()
    update = {k: (v + np.float32(shift)).astype(v.dtype) if v.dtype == np.float32 else v for k, v in reference.items()}
    encoded = codecs.encode(update, reference, codecs.CodecSpec.from_uplink(uplink), np.random.default_rng(seed))
    return update, encoded


@pytest.mark.parametrize("codec", ["q8", "q4", "topk+q8"])
def test_a_compressed_update_is_decoded_onto_its_tasks_payload(method_and_state, codec):
    rnd, uplink = _compressed_round(method_and_state, codec)
    update, encoded = _encoded(rnd, uplink)
    verdict = rnd.admit(rnd.frame(tensors=encoded.arrays(), codec=encoded.header))
    assert isinstance(verdict, Accepted), verdict
    got = verdict.update.tensors
    assert set(got) == set(update)
    worst = max(float(np.abs(got[k] - update[k]).max()) for k in update)
    assert worst <= 0.011  # within one quantization step of the change (top-k: the change itself)


def test_a_codec_its_task_did_not_ask_for_is_rejected(method_and_state):
    rnd, uplink = _compressed_round(method_and_state, "q8")
    _, encoded = _encoded(rnd, uplink.model_copy(update={"codec": "q4"}))
    assert reason(rnd.admit(rnd.frame(tensors=encoded.arrays(), codec=encoded.header))) == "malformed"
    plain = Round(*method_and_state)  # a task that asked for none
    _, encoded = _encoded(plain, uplink)
    verdict = plain.admit(plain.frame(tensors=encoded.arrays(), codec=encoded.header))
    assert reason(verdict) == "malformed" and "asked for no codec" in verdict.detail


def test_an_uncompressed_answer_to_a_compressing_task_is_accepted(method_and_state):
    """The codec saves bytes; an agent that sends the plain update loses nothing by it."""
    rnd, _ = _compressed_round(method_and_state)
    assert isinstance(rnd.admit(rnd.frame()), Accepted)


def test_compressed_frames_that_do_not_add_up_are_rejected_with_their_reason(method_and_state):
    from edgepfl.codecs import PAYLOAD, SCALES

    rnd, uplink = _compressed_round(method_and_state)
    _, encoded = _encoded(rnd, uplink)
    arrays = encoded.arrays()
    cases = {
        "payload cut short": ({**arrays, PAYLOAD: arrays[PAYLOAD][:-3]}, encoded.header, "malformed"),
        "scales of another dtype": ({**arrays, SCALES: arrays[SCALES].astype(np.float64)}, encoded.header,
                                    "malformed"),
        "a stream missing": ({k: v for k, v in arrays.items() if k != SCALES}, encoded.header, "malformed"),
        "a shape the payload has not": (arrays, encoded.header.model_copy(update={"tensors": tuple(
            t.model_copy(update={"shape": (t.shape[0] + 1, *t.shape[1:])}) if i == 0 else t
            for i, t in enumerate(encoded.header.tensors))}), "wrong_shape"),
        "a tensor the payload has not": (arrays, encoded.header.model_copy(update={"tensors": tuple(
            t.model_copy(update={"name": "ghost.weight"}) if i == 0 else t
            for i, t in enumerate(encoded.header.tensors))}), "wrong_tensors"),
        "a step past float32": ({**arrays, SCALES: np.full_like(arrays[SCALES], 3e38)}, encoded.header,
                                "non_finite"),
    }
    for case, (tensors, header, want) in cases.items():
        rnd.reopen()
        rnd.tasks.add(Task("alice", rnd.tasks.get("alice").task_id, "train", uplink=uplink))
        verdict = rnd.admit(rnd.frame(tensors=tensors, codec=header))
        assert isinstance(verdict, Rejection) and verdict.reason == want, (case, verdict)


def test_a_tensor_the_method_keeps_exact_may_not_come_compressed(method_and_state):
    rnd, uplink = _compressed_round(method_and_state)
    first = next(iter(rnd.tensors()))
    exact_uplink = uplink.model_copy(update={"exact": (first.split(".")[0],)})
    rnd.tasks.add(Task("alice", rnd.tasks.get("alice").task_id, "train", uplink=exact_uplink))
    _, encoded = _encoded(rnd, uplink)  # compressed everything, the exact prefix too
    verdict = rnd.admit(rnd.frame(tensors=encoded.arrays(), codec=encoded.header))
    assert reason(verdict) == "malformed" and "keeps exact" in verdict.detail


def test_a_secagg_step_goes_through_the_same_sender_checks_as_an_update(method_and_state, tmp_path):
    """A secure round's steps arrive on the update topic: signed by the agent's enrolled key
    they are handed to the round (they answer no task); unsigned, signed by another key, in
    another agent's name or from an unknown agent they are rejected before anyone reads them."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from edgepfl.coordinator.gate import StepAnswer
    from edgepfl.protocol.secagg import PeerKeys, SecAggMeta
    from edgepfl.protocol.signing import Keyring, Signer, write_public_key

    alice, mallory = (Signer.from_private(Ed25519PrivateKey.generate()) for _ in range(2))
    enrolled = tmp_path / "enrolled"
    enrolled.mkdir()
    write_public_key(alice.public, enrolled / "alice.pub")
    r = Round(*method_and_state)
    r.gate.keyring = Keyring(enrolled)
    key = "A" * 43 + "="
    meta = SecAggMeta(session="5e" * 16, step="keys", keys=PeerKeys(agent="alice", mask_public=key, share_public=key))

    def step(sender: str, signer, topic_agent: str = "alice"):
        frame = encode(MessageType.SECAGG, federation=FED, sender=sender, round=ROUND, meta=meta, signer=signer)
        return r.gate.admit(topic_agent, frame, r.tasks, r.state)

    assert step("alice", None).reason == "unsigned"
    assert step("alice", mallory).reason == "bad_signature"
    assert step("alice", alice, topic_agent="bob").reason == "wrong_sender"
    assert step("mallory", mallory, topic_agent="mallory").reason == "not_enrolled"
    taken = step("alice", alice)
    assert isinstance(taken, StepAnswer) and taken.meta.keys == meta.keys
    assert "alice" in r.tasks.waiting  # a step answers no task
