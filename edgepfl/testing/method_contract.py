"""The method contract, as checks anyone can run: edgepfl's own suite and a plugin's tests.

Each check takes one real round of a method, run the way the runtime drives it
(coordinator ``init_server`` / ``payload_for``; agents ``receive`` / ``evaluate`` /
``local_update``; coordinator ``check_update`` / ``server_step``) on two tiny synthetic
clients with different data (:func:`round_of`), and raises ``AssertionError`` naming the
method when the method breaks the contract: what is uploaded (finite, shared keys only,
no personal leak), what the server keeps (shapes, dtypes, numpy-only, checkpointable, the
rule's average in any arrival order, compressed or not), what the agent keeps (personal
state survives a safetensors save/load) and what inference does (deterministic in eval
mode, reproduced by the exported encoder + device head).

A third-party method runs them from its own tests, as scikit-learn's
``check_estimator`` / ``parametrize_with_checks`` do for an estimator::

    from edgepfl.testing import check_method, method_checks

    def test_my_method_keeps_the_contract():
        check_method(MyMethod)

    @pytest.mark.parametrize("check", method_checks(MyMethod), ids=str)
    def test_my_method(check):
        check()

tests/contract/test_method_contract.py runs the same checks over every registered method.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from safetensors.numpy import load_file, save_file

from ..aggregation import AggregationSpec, Mean
from ..methods import ClientUpdate, Method, ServerState, UpdateRejected, get_method
from ..methods.base import STAT, load_tensors
from .method_kit import MethodKit, eval_logits

KIT = MethodKit()  # 4 classes of 1x28x28 images, SmallCNN with 16 features, 1 epoch of batches of 16
AGENTS = ("agent-a", "agent-b")

# Two clients that differ in size (so sample weighting matters), label set and inputs.
CLIENTS = {
    "agent-a": KIT.gaussian_client(1, 40, [0, 1, 2, 3], shift=0.0, n_test=20),
    "agent-b": KIT.gaussian_client(2, 24, [1, 2], shift=0.7, n_test=20),
}


class NotApplicable(Exception):
    """A check that does not apply to this method (it has no device head, it shares nothing)."""


@dataclass
class RoundRun:
    """One round of one method: server state before/after, each agent's model and upload."""

    method: Method
    state0: ServerState
    payloads: dict[str, dict[str, np.ndarray]]
    models: dict[str, torch.nn.Module]
    uploads: dict[str, dict[str, np.ndarray]]
    eval_correct: dict[str, int]
    updates: list[ClientUpdate]
    state1: ServerState

    @property
    def name(self) -> str:
        return self.method.name


def method_class(method: type[Method] | str) -> type[Method]:
    """A method class, given as itself or by its registered name."""
    cls = get_method(method) if isinstance(method, str) else method
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"{method!r} is not a Method subclass")
    return cls


def new_method(method: type[Method] | str, options: Mapping[str, Any] | None = None) -> Method:
    """An instance of ``method`` with validated options, registered or not."""
    cls = method_class(method)
    return cls(cls.config_class.model_validate(dict(options or {})))


def round_of(method: type[Method] | str, options: Mapping[str, Any] | None = None) -> RoundRun:
    """The round every check inspects (run once per method and options, cached). Don't mutate it."""
    cls, key = method_class(method), json.dumps(dict(options or {}), sort_keys=True)
    if (cls, key) not in _ROUNDS:
        _ROUNDS[cls, key] = _round(cls, dict(options or {}))
    return _ROUNDS[cls, key]


#: each method's round, by class and options (as JSON), run once
_ROUNDS: dict[tuple[type[Method], str], RoundRun] = {}


def _round(cls: type[Method], options: Mapping[str, Any]) -> RoundRun:
    method = new_method(cls, options)
    state0 = method.init_server(KIT.model(method, 0))
    payloads, models, uploads, correct = {}, {}, {}, {}
    for i, agent in enumerate(AGENTS):
        model = KIT.model(method, 100 + i)  # each agent builds its own model, as on a device
        ctx = KIT.ctx(10 + i)
        payloads[agent] = method.payload_for(state0, agent)
        method.receive(model, payloads[agent], ctx)
        data = CLIENTS[agent].to_torch()
        correct[agent] = method.evaluate(model, data, ctx).correct
        uploads[agent] = method.local_update(model, data, ctx).upload
        models[agent] = model
    # check_update has its own check, so a bad upload fails there with a clear message
    updates = [ClientUpdate(a, CLIENTS[a].num_train, uploads[a]) for a in AGENTS]
    state1 = method.server_step(state0, updates, 0)
    return RoundRun(method, state0, payloads, models, uploads, correct, updates, state1)


def personal_keys(method: Method, model: torch.nn.Module) -> set[str]:
    """The model's tensors this method keeps on the device."""
    return set(model.state_dict()) - set(method.shared_keys(model))


def uploaded_personal_ok(method: Method, key: str) -> bool:
    """Whether ``key`` is a personal tensor this method declares it uploads (``upload_personal``)."""
    return any(key.startswith(p + ".") for p in method.upload_personal)


def x_eval(agent: str = "agent-a") -> torch.Tensor:
    """The test inputs of one of the two clients."""
    return torch.from_numpy(CLIENTS[agent].x_test)


@contextlib.contextmanager
def refused(what: str, error: type[BaseException], match: str | None = None) -> Iterator[None]:
    """The block must raise ``error`` (whose message matches ``match``); else ``what`` is the failure."""
    try:
        yield
    except error as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{what}: {type(exc).__name__} {str(exc)!r} does not match {match!r}") from exc
        return
    raise AssertionError(f"{what}: no {error.__name__} raised")


def synthetic_updates(run: RoundRun, n: int, seed: int = 0) -> list[ClientUpdate]:
    """``n`` updates like the round's real ones: each a real upload with its float tensors
    moved by a little noise (statistics too), and its own sample count."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = run.updates[i % len(run.updates)]
        tensors = {}
        for key, value in base.tensors.items():
            if value.dtype.kind == "f":
                noise = rng.normal(0, 0.02 * (float(np.std(value)) or 1.0), value.shape)
                value = (value + noise).astype(value.dtype)
            tensors[key] = value
        out.append(ClientUpdate(f"agent-{i:02d}", int(rng.integers(5, 500)), tensors))
    return out


def state_bytes(state: ServerState) -> dict[str, bytes]:
    """A server state as bytes, for a bit-for-bit comparison."""
    flat = {k: np.ascontiguousarray(v).tobytes() for k, v in state.to_flat().items()}
    flat["extra"] = json.dumps(state.extra, sort_keys=True).encode()
    return flat


# --------------------------------------------------------------------------- config


def check_config_rejects_unknown_option(run: RoundRun) -> None:
    """The method's options are a closed set: an unknown option is a validation error."""
    cls = type(run.method)
    with refused(f"{run.name}: an unknown option", ValidationError):
        cls.config_class.model_validate({"no_such_option_anywhere": 1})


# --------------------------------------------------------------------------- agent side


def check_local_update_uploads_finite_numpy_tensors_that_changed(run: RoundRun) -> None:
    name = run.name
    for agent in AGENTS:
        upload = run.uploads[agent]
        assert all(isinstance(v, np.ndarray) for v in upload.values()), name
        for key, value in upload.items():
            if value.dtype.kind == "f":
                assert np.isfinite(value).all(), f"{name}: {key} not finite"
        shared = run.method.shared_keys(run.models[agent])
        if shared:
            changed = [k for k in shared if not np.array_equal(upload[k], run.payloads[agent][k])]
            assert changed, f"{name}: local update left every shared tensor as received"


def check_uploads_and_trained_weights_keep_the_default_memory_layout(run: RoundRun) -> None:
    """Channels-last is an activation layout of the CPU forward (``ConvTrunk``), never a
    weight layout: what is uploaded, kept and saved stays C-ordered, as the wire expects."""
    name = run.name
    for agent in AGENTS:
        for key, value in run.uploads[agent].items():
            assert value.flags.c_contiguous, f"{name}: uploaded {key} is not C-ordered"
        for key, tensor in run.models[agent].state_dict().items():
            assert tensor.is_contiguous(), f"{name}: {key} left the default layout after a local update"


def check_upload_is_shared_keys_plus_stats_and_no_personal_key(run: RoundRun) -> None:
    name = run.name
    for agent in AGENTS:
        model, method = run.models[agent], run.method
        upload = run.uploads[agent]
        params = {k for k in upload if "/" not in k}
        others = set(upload) - params
        assert all(k.startswith(STAT) for k in others), f"{name}: non-stat namespaced keys {others}"
        assert params <= set(model.state_dict()), f"{name}: uploads keys that are not model tensors"
        allowed_personal = {k for k in params if uploaded_personal_ok(method, k)}
        # a leak first: it is the likelier mistake, and its message names the tensors
        leaked = (params & personal_keys(method, model)) - allowed_personal
        assert not leaked, f"{name}: personal tensors leaked into the upload: {sorted(leaked)[:5]}"
        got, want = params - allowed_personal, set(method.shared_keys(model))
        assert got == want, f"{name}: the upload's model tensors are not the shared keys (missing " \
                            f"{sorted(want - got)[:5]}, not shared {sorted(got - want)[:5]})"


def check_upload_passes_check_update_and_tampering_is_rejected(run: RoundRun) -> None:
    method, update, name = run.method, run.updates[0], run.name
    method.check_update(run.state0, update)  # as the coordinator does; must not raise
    shared = sorted(run.state0.shared_params())
    if shared:
        missing = {k: v for k, v in update.tensors.items() if k != shared[0]}
        with refused(f"{name}: an update without {shared[0]}", UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, missing))
        wrong = dict(update.tensors)
        wrong[shared[0]] = np.zeros(update.tensors[shared[0]].shape + (2,), dtype=np.float32)
        with refused(f"{name}: an update with {shared[0]} of another shape", UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, wrong))
    model = run.models[update.agent_id]
    leakable = sorted(k for k in personal_keys(method, model) if not uploaded_personal_ok(method, k))
    if leakable:
        leak = dict(update.tensors)
        leak[leakable[0]] = method.personal_state(model)[leakable[0]]
        with refused(f"{name}: an update carrying personal {leakable[0]}", UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, leak))


def check_personal_state_survives_safetensors_save_load(run: RoundRun) -> None:
    method, model, name = run.method, run.models["agent-a"], run.name
    personal = method.personal_state(model)
    shared = method.shared_params(model)
    assert set(personal).isdisjoint(shared), f"{name}: a tensor is both personal and shared"
    assert set(personal) | set(shared) == set(model.state_dict()), f"{name}: state neither shared nor personal"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "personal.safetensors"
        save_file(personal, str(path))
        saved = load_file(str(path))

    fresh = KIT.model(method, 999)
    x = x_eval()
    trained = model.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in fresh.state_dict().items()), \
        f"{name}: a model built from another seed equals the trained one, so the check shows nothing"
    load_tensors(fresh, saved)
    load_tensors(fresh, shared)
    assert torch.equal(eval_logits(method, fresh, x), eval_logits(method, model, x)), \
        f"{name}: a model rebuilt from saved personal state + shared params predicts differently"


def check_a_payload_tensor_of_another_shape_is_refused_not_broadcast(run: RoundRun) -> None:
    """A (1, …, 1) tensor would broadcast into any weight through ``copy_``: the model
    would silently train on values nobody sent. Loading refuses it, and changes nothing."""
    model = run.models["agent-a"]
    key, value = max(model.state_dict().items(), key=lambda kv: kv[1].numel())
    value = value.numpy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tiny = np.ones((1,) * np.asarray(value).ndim, dtype=np.asarray(value).dtype)
    with refused(f"{run.name}: a (1, …, 1) {key}", ValueError, match="another shape"):
        load_tensors(model, {key: tiny})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), \
        f"{run.name}: a refused payload changed the model"


def check_inference_is_deterministic_in_eval_mode(run: RoundRun) -> None:
    model = copy.deepcopy(run.models["agent-a"])
    x = x_eval()
    first = eval_logits(run.method, model, x)
    second = eval_logits(run.method, model, x)
    assert first.shape == (len(x), KIT.num_classes), \
        f"{run.name}: logits of shape {tuple(first.shape)}, not {(len(x), KIT.num_classes)}"
    assert torch.equal(first, second), f"{run.name}: two eval-mode passes give different logits"


def check_evaluate_keeps_shared_params_and_repeats_exactly(run: RoundRun) -> None:
    """Evaluation may refit personal parts on training data (RepPer's stage 2 does),
    but must not touch what is uploaded, and evaluating twice gives the same answer."""
    method, name = run.method, run.name
    model = copy.deepcopy(run.models["agent-b"])
    shared_before = method.shared_params(model)
    data = CLIENTS["agent-b"].to_torch()
    first = method.evaluate(model, data, KIT.ctx(5, round=1))
    assert first.total == CLIENTS["agent-b"].num_test and 0 <= first.correct <= first.total, \
        f"{name}: evaluate counted {first.correct} of {first.total}, on {CLIENTS['agent-b'].num_test} test samples"
    assert np.isfinite(first.loss), f"{name}: evaluation loss {first.loss}"
    shared_after = method.shared_params(model)
    assert all(np.array_equal(shared_before[k], shared_after[k]) for k in shared_before), \
        f"{name}: evaluate changed shared parameters"
    second = method.evaluate(model, data, KIT.ctx(5, round=1))
    assert (second.correct, second.loss) == (first.correct, first.loss), f"{name}: evaluating twice differs"


def check_exported_encoder_and_device_head_reproduce_logits(run: RoundRun) -> None:
    method, model = run.method, copy.deepcopy(run.models["agent-a"])
    head = method.device_head(model)
    if head is None:
        raise NotApplicable(f"{run.name} has no torch device head")
    x = x_eval()
    model.eval()
    with torch.no_grad():
        exported = head(method.encoder_module(model)(x))
    torch.testing.assert_close(exported, eval_logits(method, model, x), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{run.name}: encoder + device head differ from the model: {m}")


def check_payload_loads_with_receive_into_a_fresh_model(run: RoundRun) -> None:
    method, name = run.method, run.name
    for agent in (*AGENTS, "agent-new"):  # a newly joined agent gets a payload too
        payload = method.payload_for(run.state1, agent)
        fresh = KIT.model(method, 7)
        method.receive(fresh, payload, KIT.ctx(3, round=1))
        sd = fresh.state_dict()
        for key, value in payload.items():
            if "/" not in key:
                assert np.array_equal(sd[key].cpu().numpy(), value), f"{name}: {key} not loaded as sent"
        assert torch.isfinite(eval_logits(method, fresh, x_eval())).all(), f"{name}: logits not finite"


# --------------------------------------------------------------------------- server side


def check_server_step_keeps_shapes_dtypes_and_is_checkpointable(run: RoundRun) -> None:
    before, after, name = run.state0, run.state1, run.name
    assert set(after.shared_params()) == set(before.shared_params()), f"{name}: the server step changed the shared keys"
    for key, ref in before.global_tensors.items():
        if key in after.global_tensors:
            got = after.global_tensors[key]
            assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {key} changed shape or dtype"
    tensors = [*after.global_tensors.values(), *(v for t in after.client_tensors.values() for v in t.values())]
    assert all(isinstance(v, np.ndarray) for v in tensors), f"{name}: server state must be numpy only"
    assert all(np.isfinite(v).all() for v in tensors if v.dtype.kind == "f"), f"{name}: server state not finite"
    json.dumps(after.extra)  # checkpointed as JSON
    restored = ServerState.from_flat(after.to_flat(), after.extra)
    assert set(restored.global_tensors) == set(after.global_tensors), f"{name}: a checkpoint loses global tensors"
    assert {a: set(t) for a, t in restored.client_tensors.items()} == {a: set(t) for a, t in after.client_tensors.items()}, \
        f"{name}: a checkpoint loses client tensors"


def check_server_step_averages_the_shared_parameters_weighted_by_the_methods_update_weight(run: RoundRun) -> None:
    """Every method's shared parameters go through the run's rule (here the default mean),
    weighted by ``update_weight``: the sample count, or 1 for DualFed's plain mean."""
    n = np.array([run.method.update_weight(u) for u in run.updates], dtype=np.float64)
    for key, got in run.state1.shared_params().items():
        want = sum(ni * u.tensors[key].astype(np.float64) for ni, u in zip(n, run.updates)) / n.sum()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{run.name}: {key}")


def check_any_arrival_order_gives_the_same_next_state_bit_for_bit(run: RoundRun, rule: str) -> None:
    """Over MQTT updates arrive in any order; the next state must not depend on it. Checked
    through the interface the coordinator uses (open_round, add on arrival, close), in 24
    random orders of 9 updates, with each streaming rule."""
    name = run.name
    for u in synthetic_updates(run, 3):
        run.method.check_update(run.state0, u)
    updates = synthetic_updates(run, 9)
    spec = AggregationSpec(rule=rule, clip_ratio=0.01)  # tight enough that clipping happens
    want = None
    for seed in range(24):
        order = np.random.default_rng(seed).permutation(len(updates))
        aggregate = run.method.open_round(run.state0, spec.build())
        for i in order:
            aggregate.add(updates[i])
        if run.method.streaming:
            assert aggregate.updates == [], f"{name} streams: it must not keep the updates"
        got = state_bytes(aggregate.close(0))
        if want is None:
            want = got
        assert got == want, f"{name}/{rule}: arrival order {order.tolist()} changed the next state"


def check_compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order(
        run: RoundRun, codec: str) -> None:
    """Compressed uplinks (docs/COMPRESSION.md): each update encoded against the payload its
    agent was sent, as a trainer does, and decoded as the coordinator's gate does. The decoded
    update passes the method's checks, keeps what must stay exact bit for bit, and 24 arrival
    orders of 9 of them give the same next state, bit for bit."""
    from .. import codecs

    name = run.name
    updates = synthetic_updates(run, 9)
    spec = codecs.CodecSpec.from_name(codec, block=64, keep=0.25)
    exact_prefixes = type(run.method).exact_uploads
    decoded = []
    for i, u in enumerate(updates):
        reference = run.method.payload_for(run.state0, u.agent_id)
        marked = [k for k in u.tensors if any(k == p or k.startswith(p + ".") for p in exact_prefixes)]
        encoded = codecs.encode(u.tensors, reference, spec, np.random.default_rng(i), exact=marked)
        arrays = encoded.arrays()  # what crosses the wire, rebuilt by the receiver
        tensors = codecs.decode(codecs.Encoded.from_arrays(encoded.header_fields(), arrays), reference)
        assert set(tensors) == set(u.tensors), f"{name}: decoding changed the update's tensors"
        for key in codecs.exact_names(u.tensors, reference, marked):
            assert tensors[key].tobytes() == np.asarray(u.tensors[key]).tobytes(), f"{name}: {key} not exact"
        update = ClientUpdate(u.agent_id, u.num_samples, tensors)
        run.method.check_update(run.state0, update)
        decoded.append(update)
    want = None
    for seed in range(24):
        order = np.random.default_rng(seed).permutation(len(decoded))
        aggregate = run.method.open_round(run.state0, AggregationSpec().build())
        for i in order:
            aggregate.add(decoded[i])
        got = state_bytes(aggregate.close(0))
        if want is None:
            want = got
        assert got == want, f"{name}/{codec}: arrival order {order.tolist()} changed the next state"


def check_every_rule_runs_and_gives_a_finite_state(run: RoundRun, rule: str) -> None:
    """One round, 3 clients, each rule: the shared parameters are the rule's result (so a
    robust rule applies to every method that averages), the state is finite."""
    name = run.name
    if not run.state0.shared_params():
        raise NotApplicable(f"{name} shares nothing: there is nothing to average")
    updates = synthetic_updates(run, 3, seed=1)
    spec = AggregationSpec(rule=rule)  # multi_krum: f = 1, so it averages 2 of the 3
    new = run.method.server_step(run.state0, updates, 0, rule=spec.build())
    tensors = [*new.global_tensors.values(), *(v for t in new.client_tensors.values() for v in t.values())]
    assert all(np.isfinite(v).all() for v in tensors if v.dtype.kind == "f"), f"{name}/{rule}: state not finite"
    assert set(new.shared_params()) == set(run.state0.shared_params()), f"{name}/{rule}: the shared keys changed"
    # the same rule on the shared tensors alone gives the same shared parameters
    rule_alone = spec.build()
    rule_alone.begin(run.state0.shared_params())
    for u in sorted(updates, key=lambda u: u.agent_id):
        rule_alone.add({k: u.tensors[k] for k in run.state0.shared_params()}, run.method.update_weight(u))
    want = rule_alone.result()
    for key, value in new.shared_params().items():
        assert value.tobytes() == want[key].tobytes(), f"{name}/{rule}: {key} is not the rule's result"
    if rule == "median":  # the coordinate median of the updates as sent, with no bound on them
        unbounded = AggregationSpec(rule=rule, max_update_ratio=None, max_update_vs_median=None, max_mean_shift=None,
                                    max_variance_growth=None)
        new = run.method.server_step(run.state0, updates, 0, rule=unbounded.build())
        key = next(k for k, v in run.state0.shared_params().items() if v.dtype.kind == "f")
        np.testing.assert_allclose(new.global_tensors[key], np.median([u.tensors[key] for u in updates], axis=0),
                                   rtol=1e-6, err_msg=f"{name}/median: {key}")


def check_a_server_learning_rate_moves_the_shared_parameters_that_share_of_the_way(run: RoundRun) -> None:
    """``aggregation.server_lr``: the next state's shared parameters move ``server_lr`` of the
    way from the state the tasks carried to the rule's aggregate (BatchNorm statistics
    mixed the same way); 1 is the plain aggregate, for every method."""
    name = run.name
    if not run.state0.shared_params():
        raise NotApplicable(f"{name} shares nothing: there is nothing to average")
    updates = synthetic_updates(run, 3, seed=2)
    full = run.method.server_step(run.state0, updates, 0)
    aggregate = run.method.open_round(run.state0, Mean(), server_lr=0.25)
    for update in sorted(updates, key=lambda u: u.agent_id):
        aggregate.add(update)
    quarter = aggregate.close(0)
    reference, moved = run.state0.shared_params(), 0
    for key, ref in reference.items():
        if ref.dtype.kind != "f":
            continue
        want = ref.astype(np.float64) + 0.25 * (full.shared_params()[key].astype(np.float64) - ref)
        np.testing.assert_allclose(quarter.shared_params()[key], want, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
        moved += int(not np.array_equal(full.shared_params()[key], ref))
    assert moved, f"{name}: the round moved no shared parameter, so the check shows nothing"


# --------------------------------------------------------------------------- the public entry points
#: the rules whose arrival-order independence is checked (the streaming ones)
STREAMING_RULES = ("mean", "clipped_mean")
#: the uplink codecs a method's updates are checked through
UPLINK_CODECS = ("q4", "topk+q8")
#: every aggregation rule a method that averages must run under
RULES = ("mean", "clipped_mean", "median", "trimmed_mean", "multi_krum")

#: every check, with the parameter values it runs for (none: it runs once)
CHECKS: tuple[tuple[Callable[..., None], tuple[str, ...]], ...] = (
    (check_config_rejects_unknown_option, ()),
    (check_local_update_uploads_finite_numpy_tensors_that_changed, ()),
    (check_uploads_and_trained_weights_keep_the_default_memory_layout, ()),
    (check_upload_is_shared_keys_plus_stats_and_no_personal_key, ()),
    (check_upload_passes_check_update_and_tampering_is_rejected, ()),
    (check_personal_state_survives_safetensors_save_load, ()),
    (check_a_payload_tensor_of_another_shape_is_refused_not_broadcast, ()),
    (check_inference_is_deterministic_in_eval_mode, ()),
    (check_evaluate_keeps_shared_params_and_repeats_exactly, ()),
    (check_exported_encoder_and_device_head_reproduce_logits, ()),
    (check_server_step_keeps_shapes_dtypes_and_is_checkpointable, ()),
    (check_server_step_averages_the_shared_parameters_weighted_by_the_methods_update_weight, ()),
    (check_any_arrival_order_gives_the_same_next_state_bit_for_bit, STREAMING_RULES),
    (check_compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order, UPLINK_CODECS),
    (check_every_rule_runs_and_gives_a_finite_state, RULES),
    (check_a_server_learning_rate_moves_the_shared_parameters_that_share_of_the_way, ()),
    (check_payload_loads_with_receive_into_a_fresh_model, ()),
)


@dataclass(frozen=True)
class MethodCheck:
    """One check of one method, callable with no argument; ``str`` is its test id.

    Called under pytest, a check that does not apply skips; elsewhere it returns."""

    method: type[Method]
    check: Callable[..., None]
    param: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        name = self.check.__name__.removeprefix("check_")
        return f"{self.method.name}-{name}" + (f"[{self.param}]" if self.param else "")

    def run(self) -> None:
        """Run the check; raises ``AssertionError`` (or the method's own error) when it fails,
        :class:`NotApplicable` when it does not apply."""
        run = round_of(self.method, dict(self.options))
        if self.param is None:
            self.check(run)
        else:
            self.check(run, self.param)

    def __call__(self) -> None:
        try:
            self.run()
        except NotApplicable as why:
            if "pytest" in sys.modules:
                import pytest

                pytest.skip(str(why))


def method_checks(method: type[Method] | str, options: Mapping[str, Any] | None = None) -> list[MethodCheck]:
    """Every contract check of ``method`` (a class, registered or not, or a registered name)
    with ``options``, one :class:`MethodCheck` each, to parametrize a test with
    (``@pytest.mark.parametrize("check", method_checks(MyMethod), ids=str)``)."""
    cls = method_class(method)
    frozen = tuple(sorted(dict(options or {}).items()))
    return [MethodCheck(cls, check, param, frozen) for check, params in CHECKS for param in (params or (None,))]


def check_method(method: type[Method] | str, options: Mapping[str, Any] | None = None) -> list[str]:
    """Run every contract check of ``method``; raise ``AssertionError`` naming the method and
    the first check it fails. Returns the checks that did not apply, with why."""
    skipped = []
    for check in method_checks(method, options):
        try:
            check.run()
        except NotApplicable as why:
            skipped.append(f"{check}: {why}")
        except AssertionError as exc:
            raise AssertionError(f"{check} failed: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{check} failed: the method raised {type(exc).__name__}: {exc}") from exc
    return skipped
