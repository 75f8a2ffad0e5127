"""Contract suite: every registered method, present and future, through the same checks.

Each method runs one real round the way the runtime drives it (coordinator
``init_server`` / ``payload_for``; agents ``receive`` / ``evaluate`` /
``local_update``; coordinator ``check_update`` / ``server_step``) on two tiny
synthetic clients with different data, and the checks below are made on that round:
what is uploaded (finite, shared keys only, no personal leak), what the server keeps
(shapes, dtypes, numpy-only, checkpointable), what travels on the wire (bit-exact
envelope round trip), what the agent keeps (personal state survives a safetensors
save/load), and what inference does (deterministic in eval mode, reproduced by the
exported encoder + device head).
"""

from __future__ import annotations

import copy
import functools
import json
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.numpy import load_file, save_file

from edgepfl.aggregation import AggregationSpec, Mean
from edgepfl.methods import (
    ClientUpdate,
    Method,
    ServerState,
    UpdateRejected,
    available_methods,
    create_method,
    get_method,
)
from edgepfl.methods.aggregate import weighted_mean
from edgepfl.methods.base import STAT, TRAIN_OVERRIDES, PersonalBatchNormConfig, load_tensors, method_optimizer
from edgepfl.protocol.envelope import decode, encode
from edgepfl.protocol.messages import MessageType, TaskMeta, UpdateMeta

from tests.method_kit import MethodKit, bn_inputs, eval_logits
from tests.wire_samples import sample_run_spec

KIT = MethodKit()  # 4 classes of 1x28x28 images, SmallCNN with 16 features, 1 epoch of batches of 16
AGENTS = ("agent-a", "agent-b")
METHODS = available_methods()

# Two clients that differ in size (so sample weighting matters), label set and inputs.
CLIENTS = {
    "agent-a": KIT.gaussian_client(1, 40, [0, 1, 2, 3], shift=0.0, n_test=20),
    "agent-b": KIT.gaussian_client(2, 24, [1, 2], shift=0.7, n_test=20),
}


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


@functools.cache
def run_round(name: str) -> RoundRun:
    """Run (once per method, cached) the round every check below inspects. Don't mutate the result."""
    method = create_method(name)
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
    # check_update has its own test, so a bad upload fails there with a clear message
    updates = [ClientUpdate(a, CLIENTS[a].num_train, uploads[a]) for a in AGENTS]
    state1 = method.server_step(state0, updates, 0)
    return RoundRun(method, state0, payloads, models, uploads, correct, updates, state1)


def personal_keys(method: Method, model: torch.nn.Module) -> set[str]:
    return set(model.state_dict()) - set(method.shared_keys(model))


def uploaded_personal_ok(method: Method, key: str) -> bool:
    return any(key.startswith(p + ".") for p in method.upload_personal)


def x_eval(agent: str = "agent-a") -> torch.Tensor:
    return torch.from_numpy(CLIENTS[agent].x_test)


# --------------------------------------------------------------------------- config


def test_registry_holds_the_baselines():
    assert {"fedavg", "fedavg_ft", "fedbn", "fedper", "fedprox", "fedrep", "fedrod", "lgfedavg", "local"} <= set(METHODS)


def test_the_method_table_names_exactly_the_modules_that_register_a_method():
    """A method module left out of METHODS would never be offered; a name without its module never loads."""
    import re
    from pathlib import Path

    import edgepfl.methods as package

    folder = Path(package.__file__).parent
    registering = {p.stem for p in folder.glob("*.py") if re.search(r"^@register\b", p.read_text(), re.MULTILINE)}
    assert set(package.METHODS) == registering
    assert all(get_method(name).name == name for name in package.METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_config_rejects_unknown_option(name):
    cls = type(create_method(name))
    assert cls.name == name
    with pytest.raises(ValidationError):
        cls.config_class.model_validate({"no_such_option_anywhere": 1})
    with pytest.raises(ValidationError):
        create_method(name, {"no_such_option_anywhere": 1})


#: options named after a train field that cannot be None, and why
OVERRIDES_WITHOUT_NONE = {
    ("fedrir", "optimizer"): "whether the model holds Adam moments is settled when it is built, before any task",
}


@pytest.mark.parametrize("name", METHODS)
def test_an_option_named_after_a_train_field_follows_the_one_override_rule(name):
    """``optimizer``, ``lr``, ``momentum``, ``weight_decay``, ``batch_size`` in a method's
    options replace the run's ``train.<field>``, and None is the run's (base.train_override)."""
    config_class = create_method(name).config_class
    for field in TRAIN_OVERRIDES:
        info = config_class.model_fields.get(field)
        if info is None or (name, field) in OVERRIDES_WITHOUT_NONE:
            continue
        assert (info.description or "").endswith(f"None: the run's train.{field}"), (name, field, info.description)
        assert getattr(config_class.model_validate({field: None}), field) is None


def test_method_optimizer_takes_each_override_with_a_value_and_the_runs_field_for_none():
    ctx = KIT.ctx(optimizer="sgd", lr=0.07, momentum=0.3, weight_decay=0.002)
    params = [torch.nn.Parameter(torch.zeros(2))]

    def built(name: str, options: dict, **fixed) -> tuple[type, dict]:
        opt = method_optimizer(create_method(name, options).config, params, ctx, **fixed)
        group = opt.param_groups[0]
        return type(opt), {k: group[k] for k in ("lr", "weight_decay", "momentum") if k in group}

    run = {"lr": 0.07, "weight_decay": 0.002, "momentum": 0.3}
    assert built("dualfed", {"weight_decay": None}) == (torch.optim.SGD, run)
    assert built("dualfed", {"optimizer": "adam", "lr": 0.5, "weight_decay": 0.1}) == (
        torch.optim.Adam, {"lr": 0.5, "weight_decay": 0.1})
    assert built("repper", {"optimizer": "sgd", "lr": None, "weight_decay": None}) == (torch.optim.SGD, run)
    # FedPAC fixes SGD and each phase's lr; its momentum and weight decay are overrides
    assert built("fedpac", {}, optimizer="sgd", lr=0.2) == (torch.optim.SGD, {"lr": 0.2, "weight_decay": 5e-4,
                                                                               "momentum": 0.5})
    assert built("fedpac", {"momentum": None, "weight_decay": None}, optimizer="sgd", lr=0.2) == (
        torch.optim.SGD, {**run, "lr": 0.2})
    # an override a method does not declare (FedRIR has no momentum) is the run's
    assert built("fedrir", {"optimizer": "sgd", "lr": None, "weight_decay": None}) == (torch.optim.SGD, run)


# --------------------------------------------------------------------------- agent side


@pytest.mark.parametrize("name", METHODS)
def test_local_update_uploads_finite_numpy_tensors_that_changed(name):
    run = run_round(name)
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


@pytest.mark.parametrize("name", METHODS)
def test_uploads_and_trained_weights_keep_the_default_memory_layout(name):
    """Channels-last is an activation layout of the CPU forward (``ConvTrunk``), never a
    weight layout: what is uploaded, kept and saved stays C-ordered, as the wire expects."""
    run = run_round(name)
    for agent in AGENTS:
        for key, value in run.uploads[agent].items():
            assert value.flags.c_contiguous, f"{name}: uploaded {key} is not C-ordered"
        for key, tensor in run.models[agent].state_dict().items():
            assert tensor.is_contiguous(), f"{name}: {key} left the default layout after a local update"


@pytest.mark.parametrize("name", METHODS)
def test_upload_is_shared_keys_plus_stats_and_no_personal_key(name):
    run = run_round(name)
    for agent in AGENTS:
        model, method = run.models[agent], run.method
        upload = run.uploads[agent]
        params = {k for k in upload if "/" not in k}
        others = set(upload) - params
        assert all(k.startswith(STAT) for k in others), f"{name}: non-stat namespaced keys {others}"
        assert params <= set(model.state_dict()), f"{name}: uploads keys that are not model tensors"
        allowed_personal = {k for k in params if uploaded_personal_ok(method, k)}
        assert params - allowed_personal == set(method.shared_keys(model))
        leaked = (params & personal_keys(method, model)) - allowed_personal
        assert not leaked, f"{name}: personal tensors leaked into the upload: {sorted(leaked)[:5]}"


@pytest.mark.parametrize("name", METHODS)
def test_upload_passes_check_update_and_tampering_is_rejected(name):
    run = run_round(name)
    method, update = run.method, run.updates[0]
    method.check_update(run.state0, update)  # as the coordinator does; must not raise
    shared = sorted(run.state0.shared_params())
    if shared:
        missing = {k: v for k, v in update.tensors.items() if k != shared[0]}
        with pytest.raises(UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, missing))
        wrong = dict(update.tensors)
        wrong[shared[0]] = np.zeros(update.tensors[shared[0]].shape + (2,), dtype=np.float32)
        with pytest.raises(UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, wrong))
    model = run.models[update.agent_id]
    leakable = sorted(k for k in personal_keys(method, model) if not uploaded_personal_ok(method, k))
    if leakable:
        leak = dict(update.tensors)
        leak[leakable[0]] = method.personal_state(model)[leakable[0]]
        with pytest.raises(UpdateRejected):
            method.check_update(run.state0, ClientUpdate(update.agent_id, update.num_samples, leak))


@pytest.mark.parametrize("name", METHODS)
def test_personal_state_survives_safetensors_save_load(name, tmp_path):
    run = run_round(name)
    method, model = run.method, run.models["agent-a"]
    personal = method.personal_state(model)
    shared = method.shared_params(model)
    assert set(personal).isdisjoint(shared)
    assert set(personal) | set(shared) == set(model.state_dict()), f"{name}: state neither shared nor personal"
    path = tmp_path / "personal.safetensors"
    save_file(personal, str(path))

    fresh = KIT.model(method, 999)
    x = x_eval()
    trained = model.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())  # the test can fail
    load_tensors(fresh, load_file(str(path)))
    load_tensors(fresh, shared)
    assert torch.equal(eval_logits(method, fresh, x), eval_logits(method, model, x)), \
        f"{name}: a model rebuilt from saved personal state + shared params predicts differently"


@pytest.mark.parametrize("name", METHODS)
def test_a_payload_tensor_of_another_shape_is_refused_not_broadcast(name):
    """A (1, …, 1) tensor would broadcast into any weight through ``copy_``: the model
    would silently train on values nobody sent. Loading refuses it, and changes nothing."""
    model = run_round(name).models["agent-a"]
    key, value = max(model.state_dict().items(), key=lambda kv: kv[1].numel())
    value = value.numpy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tiny = np.ones((1,) * np.asarray(value).ndim, dtype=np.asarray(value).dtype)
    with pytest.raises(ValueError, match="another shape"):
        load_tensors(model, {key: tiny})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", METHODS)
def test_inference_is_deterministic_in_eval_mode(name):
    run = run_round(name)
    model = copy.deepcopy(run.models["agent-a"])
    x = x_eval()
    first = eval_logits(run.method, model, x)
    second = eval_logits(run.method, model, x)
    assert first.shape == (len(x), KIT.num_classes)
    assert torch.equal(first, second)


@pytest.mark.parametrize("name", METHODS)
def test_evaluate_keeps_shared_params_and_repeats_exactly(name):
    """Evaluation may refit personal parts on training data (RepPer's stage 2 does),
    but must not touch what is uploaded, and evaluating twice gives the same answer."""
    run = run_round(name)
    method = run.method
    model = copy.deepcopy(run.models["agent-b"])
    shared_before = method.shared_params(model)
    data = CLIENTS["agent-b"].to_torch()
    first = method.evaluate(model, data, KIT.ctx(5, round=1))
    assert first.total == CLIENTS["agent-b"].num_test and 0 <= first.correct <= first.total
    assert np.isfinite(first.loss)
    shared_after = method.shared_params(model)
    assert all(np.array_equal(shared_before[k], shared_after[k]) for k in shared_before), \
        f"{name}: evaluate changed shared parameters"
    second = method.evaluate(model, data, KIT.ctx(5, round=1))
    assert (second.correct, second.loss) == (first.correct, first.loss)


@pytest.mark.parametrize("name", METHODS)
def test_exported_encoder_and_device_head_reproduce_logits(name):
    run = run_round(name)
    method, model = run.method, copy.deepcopy(run.models["agent-a"])
    head = method.device_head(model)
    if head is None:
        pytest.skip(f"{name} has no torch device head")
    x = x_eval()
    model.eval()
    with torch.no_grad():
        exported = head(method.encoder_module(model)(x))
    torch.testing.assert_close(exported, eval_logits(method, model, x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- server side


@pytest.mark.parametrize("name", METHODS)
def test_server_step_keeps_shapes_dtypes_and_is_checkpointable(name):
    run = run_round(name)
    before, after = run.state0, run.state1
    assert set(after.shared_params()) == set(before.shared_params())
    for key, ref in before.global_tensors.items():
        if key in after.global_tensors:
            got = after.global_tensors[key]
            assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {key} changed shape or dtype"
    tensors = [*after.global_tensors.values(), *(v for t in after.client_tensors.values() for v in t.values())]
    assert all(isinstance(v, np.ndarray) for v in tensors), f"{name}: server state must be numpy only"
    assert all(np.isfinite(v).all() for v in tensors if v.dtype.kind == "f")
    json.dumps(after.extra)  # checkpointed as JSON
    restored = ServerState.from_flat(after.to_flat(), after.extra)
    assert set(restored.global_tensors) == set(after.global_tensors)
    assert {a: set(t) for a, t in restored.client_tensors.items()} == {a: set(t) for a, t in after.client_tensors.items()}


@pytest.mark.parametrize("name", METHODS)
def test_server_step_averages_the_shared_parameters_weighted_by_the_methods_update_weight(name):
    """Every method's shared parameters go through the run's rule (here the default mean),
    weighted by ``update_weight``: the sample count, or 1 for DualFed's plain mean."""
    run = run_round(name)
    n = np.array([run.method.update_weight(u) for u in run.updates], dtype=np.float64)
    for key, got in run.state1.shared_params().items():
        want = sum(ni * u.tensors[key].astype(np.float64) for ni, u in zip(n, run.updates)) / n.sum()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{name}: {key}")


def test_fedavg_aggregates_every_parameter_by_sample_count():
    run = run_round("fedavg")
    na, nb = CLIENTS["agent-a"].num_train, CLIENTS["agent-b"].num_train
    assert na != nb
    ua, ub = run.uploads["agent-a"], run.uploads["agent-b"]
    assert set(run.state1.shared_params()) == set(run.method.shared_keys(run.models["agent-a"]))
    plain = weighted_mean([ua, ub])
    differs_from_plain_mean = False
    for key, got in run.state1.shared_params().items():
        want = (na * ua[key].astype(np.float64) + nb * ub[key].astype(np.float64)) / (na + nb)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=key)
        differs_from_plain_mean |= not np.allclose(got, plain[key], rtol=1e-6, atol=1e-7)
    assert differs_from_plain_mean  # weights really are the sample counts, not uniform


# --------------------------------------------------------------------------- aggregation


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
    flat = {k: np.ascontiguousarray(v).tobytes() for k, v in state.to_flat().items()}
    flat["extra"] = json.dumps(state.extra, sort_keys=True).encode()
    return flat


@pytest.mark.parametrize("rule", ["mean", "clipped_mean"])
@pytest.mark.parametrize("name", METHODS)
def test_any_arrival_order_gives_the_same_next_state_bit_for_bit(name, rule):
    """Over MQTT updates arrive in any order; the next state must not depend on it. Checked
    for every method through the interface the coordinator uses (open_round, add on arrival,
    close), in 24 random orders of 9 updates, with each streaming rule."""
    run = run_round(name)
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


@pytest.mark.parametrize("codec", ["q4", "topk+q8"])
@pytest.mark.parametrize("name", METHODS)
def test_compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order(name, codec):
    """Compressed uplinks (docs/COMPRESSION.md): each update encoded against the payload its
    agent was sent, as a trainer does, and decoded as the coordinator's gate does. The decoded
    update passes the method's checks, keeps what must stay exact bit for bit, and 24 arrival
    orders of 9 of them give the same next state, bit for bit."""
    from edgepfl import codecs

    run = run_round(name)
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


@pytest.mark.parametrize("codec", ["q8", "q4"])
@pytest.mark.parametrize("name", METHODS)
def test_a_task_delta_decodes_on_the_agent_to_the_payload_it_would_be_sent_whole(name, codec):
    """Task deltas (protocol 1.7, coordinator/downlink.py): the round's next state rounded onto
    the grid of its change, and each agent's task as that change plus its own tensors, decoded
    as a trainer does onto the payload it was sent before: the payload the agent would be sent
    whole, bit for bit, with the digest the task carries; then a fresh model takes it."""
    from edgepfl import codecs
    from edgepfl.config import RunConfig
    from edgepfl.coordinator.downlink import DownlinkChain, delta_body
    from edgepfl.coordinator.registry import AgentInfo
    from edgepfl.coordinator.result import Evaluation, RoundResult
    from edgepfl.coordinator.round_tasks import RoundTasks, Task
    from edgepfl.protocol import Capabilities
    from edgepfl.protocol.codec import tensors_digest

    run = run_round(name)
    chain = DownlinkChain(RunConfig(compression={"downlink": codec, "block": 64}), run.method)
    tasks, result = RoundTasks(0), RoundResult(round=0)
    for agent in AGENTS:
        tasks.add(Task(agent, f"task-{agent}", "train", None, session="5e" * 16))
        result.evaluations[agent] = Evaluation(correct=1, total=2, loss=None, train_loss=None, kind="train", train_seconds=0.0)
    adopted = chain.step(run.state1, run.state0, tasks, result)
    for agent in AGENTS:
        info = AgentInfo(agent, "trainer", "cpu", 10, 5, True, "1.7", session="5e" * 16,
                         capabilities=Capabilities(codecs=[codec]))
        delta = chain.delta_for(adopted, 1, info)
        assert delta is not None, f"{name}: no delta for {agent}"
        whole = run.method.payload_for(adopted, agent)
        meta, body = delta_body(delta, whole)
        received = codecs.decode(codecs.Encoded.from_arrays(meta.codec, body), run.method.payload_for(run.state0, agent))
        assert_bit_exact(received, whole)
        assert tensors_digest(received) == meta.digest
        run.method.receive(KIT.model(run.method, 7), received, KIT.ctx(7))


@pytest.mark.parametrize("rule", ["mean", "clipped_mean", "median", "trimmed_mean", "multi_krum"])
@pytest.mark.parametrize("name", METHODS)
def test_every_rule_runs_for_every_method_that_averages_and_gives_a_finite_state(name, rule):
    """One round, 3 clients, each rule: the shared parameters are the rule's result (so a
    robust rule applies to every method, FedPAC and DualFed included), the state is finite."""
    run = run_round(name)
    if not run.state0.shared_params():
        pytest.skip(f"{name} shares nothing: there is nothing to average")
    updates = synthetic_updates(run, 3, seed=1)
    spec = AggregationSpec(rule=rule)  # multi_krum: f = 1, so it averages 2 of the 3
    new = run.method.server_step(run.state0, updates, 0, rule=spec.build())
    tensors = [*new.global_tensors.values(), *(v for t in new.client_tensors.values() for v in t.values())]
    assert all(np.isfinite(v).all() for v in tensors if v.dtype.kind == "f")
    assert set(new.shared_params()) == set(run.state0.shared_params())
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
                                   rtol=1e-6)


@pytest.mark.parametrize("name", METHODS)
def test_payload_loads_with_receive_into_a_fresh_model(name):
    run = run_round(name)
    method = run.method
    for agent in (*AGENTS, "agent-new"):  # a newly joined agent gets a payload too
        payload = method.payload_for(run.state1, agent)
        fresh = KIT.model(method, 7)
        method.receive(fresh, payload, KIT.ctx(3, round=1))
        sd = fresh.state_dict()
        for key, value in payload.items():
            if "/" not in key:
                assert np.array_equal(sd[key].cpu().numpy(), value), f"{name}: {key} not loaded as sent"
        assert torch.isfinite(eval_logits(method, fresh, x_eval())).all()


# --------------------------------------------------------------------------- wire


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        arr = np.asarray(value)
        assert got[key].dtype == arr.dtype and got[key].shape == arr.shape, key
        assert got[key].tobytes() == np.ascontiguousarray(arr).tobytes(), key


@pytest.mark.parametrize("name", METHODS)
def test_task_and_update_messages_round_trip_bit_exactly(name):
    run = run_round(name)
    agent = "agent-a"
    task_id = uuid.uuid4().hex
    payload = run.method.payload_for(run.state1, agent)
    task_meta = TaskMeta(task_id=task_id, kind="train", run=sample_run_spec(name), seed=3, deadline_s=60.0)
    task = decode(encode(MessageType.TASK, federation="contract", sender="coordinator", round=1,
                         meta=task_meta, tensors=payload))
    assert task.type == MessageType.TASK and task.meta == task_meta
    assert_bit_exact(task.tensors, payload)

    upload = run.uploads[agent]
    meta = UpdateMeta(task_id=task_id, kind="train", num_train=CLIENTS[agent].num_train,
                      num_test=CLIENTS[agent].num_test, eval_correct=run.eval_correct[agent])
    update = decode(encode(MessageType.UPDATE, federation="contract", sender=agent, round=0, meta=meta, tensors=upload))
    assert update.type == MessageType.UPDATE and update.meta == meta
    assert_bit_exact(update.tensors, upload)
    # what the coordinator decodes is still a valid update for the server state
    run.method.check_update(run.state0, ClientUpdate(agent, meta.num_train, update.tensors))


# --------------------------------------------------------------------------- personal BatchNorm statistics
PERSONAL_BN = [m for m in METHODS if create_method(m).bn_policy != "shared"]


@pytest.mark.parametrize("name", METHODS)
def test_a_method_with_personal_batchnorm_statistics_has_the_option_to_re_estimate_them(name):
    """Personal statistics under aggregated layers go stale when the aggregate arrives:
    every such method offers ``bn_recalibrate``, and no other method does."""
    method = create_method(name)
    assert (method.bn_policy != "shared") == isinstance(method.config, PersonalBatchNormConfig)


def _received(name: str, recalibrate: bool) -> tuple[Method, torch.nn.Module, object]:
    """A client after one local round that has just received another model's shared part,
    as an agent is when it evaluates: its stored statistics describe its own older model."""
    method, model = KIT.build(name, {"bn_recalibrate": recalibrate})
    data = CLIENTS["agent-a"].to_torch()
    method.local_update(model, data, KIT.ctx())
    method.receive(model, method.payload_for(method.init_server(KIT.model(method, 5)), "agent-a"), KIT.ctx())
    return method, model, data


def _running_stats(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}


@pytest.mark.parametrize("name", PERSONAL_BN)
def test_re_estimated_statistics_change_what_is_evaluated_not_what_is_trained(name):
    """Training normalizes with batch statistics, so the next upload is the same bit for bit
    whichever statistics the evaluation before it used; no parameter moves."""
    stats, uploads = [], []
    for recalibrate in (False, True):
        method, model, data = _received(name, recalibrate)
        params = {k: v.clone() for k, v in model.named_parameters()}
        method.evaluate(model, data, KIT.ctx())
        assert all(torch.equal(params[k], v) for k, v in model.named_parameters()), name
        stats.append(_running_stats(model))
        uploads.append(method.local_update(model, data, KIT.ctx(1)).upload)
    assert any(not torch.equal(stats[0][k], stats[1][k]) for k in stats[0]), f"{name}: bn_recalibrate changed nothing"
    assert_bit_exact(uploads[1], uploads[0])


@pytest.mark.parametrize("name", [m for m in PERSONAL_BN if type(create_method(m)).recalibrate is Method.recalibrate])
def test_the_default_re_estimation_is_the_encoders_statistics_on_the_training_images(name):
    """Every BatchNorm layer of the encoder gets the mean and (unbiased) variance of what it
    sees in a training-mode pass over the client's training images; layers outside the
    encoder (FedRIR's personal CSFE) keep theirs, and momenta and train/eval modes are back."""
    method, model, data = _received(name, False)
    encoder = method.encoder_module(model)
    expected = bn_inputs(encoder, encoder, data.x_train)
    before = _running_stats(model)
    layers = dict(encoder.named_modules())
    momenta = {layer: layers[layer].momentum for layer in expected}
    modes = [m.training for m in model.modules()]
    assert expected and method.recalibrate(model, data) == len(data.x_train)
    for layer, inputs in expected.items():
        per_channel = inputs.transpose(0, 1).flatten(1)
        torch.testing.assert_close(layers[layer].running_mean, per_channel.mean(1))
        torch.testing.assert_close(layers[layer].running_var, per_channel.var(1, unbiased=True))
        assert layers[layer].momentum == momenta[layer], f"{name}: {layer}'s training momentum is not back"
    assert [m.training for m in model.modules()] == modes, f"{name}: train/eval modes not restored"
    prefix = next(n for n, m in model.named_modules() if m is encoder) + "."
    after = _running_stats(model)
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith(prefix))


@pytest.mark.parametrize("name", METHODS)
def test_a_server_learning_rate_moves_the_shared_parameters_that_share_of_the_way(name):
    """``aggregation.server_lr``: the next state's shared parameters move ``server_lr`` of the
    way from the state the tasks carried to the rule's aggregate (BatchNorm statistics
    mixed the same way); 1 is the plain aggregate, for every method."""
    run = run_round(name)
    if not run.state0.shared_params():
        pytest.skip(f"{name} shares nothing: there is nothing to average")
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
    assert moved, f"{name}: the round moved no shared parameter, so the test shows nothing"
