"""Contract suite: every built-in method, present and future, through the same checks.

The generic checks are public (:mod:`edgepfl.testing.method_contract`), so a third-party
method runs exactly these from its own tests (``edgepfl.testing.check_method``). Each
method runs one real round the way the runtime drives it (coordinator ``init_server`` /
``payload_for``; agents ``receive`` / ``evaluate`` / ``local_update``; coordinator
``check_update`` / ``server_step``) on two tiny synthetic clients with different data,
and the checks are made on that round: what is uploaded (finite, shared keys only, no
personal leak), what the server keeps (shapes, dtypes, numpy-only, checkpointable), what
travels on the wire (bit-exact envelope round trip), what the agent keeps (personal
state survives a safetensors save/load), and what inference does (deterministic in eval
mode, reproduced by the exported encoder + device head). The checks here beyond the
public ones use this repository's own fixtures (the coordinator's downlink, the wire
samples) or name built-in methods. A plugin method installed here is not edgepfl's to check: its
own tests run the public checks (tests/integration/methods/test_plugin_package.py), and one
that cannot load changes nothing here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from edgepfl.methods import METHODS as BUILT_IN_METHODS
from edgepfl.methods import ClientUpdate, Method, create_method, get_method
from edgepfl.methods.aggregate import weighted_mean
from edgepfl.methods.base import TRAIN_OVERRIDES, PersonalBatchNormConfig, method_optimizer
from edgepfl.protocol.envelope import decode, encode
from edgepfl.protocol.messages import MessageType, TaskMeta, UpdateMeta
from edgepfl.testing import method_contract as checks
from edgepfl.testing.method_contract import AGENTS, CLIENTS, KIT, NotApplicable, RoundRun
from edgepfl.testing.method_kit import bn_inputs

from tests.wire_samples import sample_run_spec

METHODS = sorted(BUILT_IN_METHODS)


def run_round(name: str) -> RoundRun:
    """The round (run once per method, cached) the public checks inspect. Don't mutate it."""
    return checks.round_of(name)


def run_check(check: Callable[..., None], name: str, *params: str) -> None:
    """One public check on method ``name``'s round; a check that does not apply skips."""
    try:
        check(run_round(name), *params)
    except NotApplicable as why:
        pytest.skip(str(why))


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
    run_check(checks.check_config_rejects_unknown_option, name)
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
    run_check(checks.check_local_update_uploads_finite_numpy_tensors_that_changed, name)


@pytest.mark.parametrize("name", METHODS)
def test_uploads_and_trained_weights_keep_the_default_memory_layout(name):
    """Channels-last is an activation layout of the CPU forward (``ConvTrunk``), never a
    weight layout: what is uploaded, kept and saved stays C-ordered, as the wire expects."""
    run_check(checks.check_uploads_and_trained_weights_keep_the_default_memory_layout, name)


@pytest.mark.parametrize("name", METHODS)
def test_upload_is_shared_keys_plus_stats_and_no_personal_key(name):
    run_check(checks.check_upload_is_shared_keys_plus_stats_and_no_personal_key, name)


@pytest.mark.parametrize("name", METHODS)
def test_upload_passes_check_update_and_tampering_is_rejected(name):
    run_check(checks.check_upload_passes_check_update_and_tampering_is_rejected, name)


@pytest.mark.parametrize("name", METHODS)
def test_personal_state_survives_safetensors_save_load(name):
    run_check(checks.check_personal_state_survives_safetensors_save_load, name)


@pytest.mark.parametrize("name", METHODS)
def test_a_payload_tensor_of_another_shape_is_refused_not_broadcast(name):
    """A (1, …, 1) tensor would broadcast into any weight through ``copy_``: the model
    would silently train on values nobody sent. Loading refuses it, and changes nothing."""
    run_check(checks.check_a_payload_tensor_of_another_shape_is_refused_not_broadcast, name)


@pytest.mark.parametrize("name", METHODS)
def test_inference_is_deterministic_in_eval_mode(name):
    run_check(checks.check_inference_is_deterministic_in_eval_mode, name)


@pytest.mark.parametrize("name", METHODS)
def test_evaluate_keeps_shared_params_and_repeats_exactly(name):
    """Evaluation may refit personal parts on training data (RepPer's stage 2 does),
    but must not touch what is uploaded, and evaluating twice gives the same answer."""
    run_check(checks.check_evaluate_keeps_shared_params_and_repeats_exactly, name)


@pytest.mark.parametrize("name", METHODS)
def test_exported_encoder_and_device_head_reproduce_logits(name):
    run_check(checks.check_exported_encoder_and_device_head_reproduce_logits, name)


# --------------------------------------------------------------------------- server side


@pytest.mark.parametrize("name", METHODS)
def test_server_step_keeps_shapes_dtypes_and_is_checkpointable(name):
    run_check(checks.check_server_step_keeps_shapes_dtypes_and_is_checkpointable, name)


@pytest.mark.parametrize("name", METHODS)
def test_server_step_averages_the_shared_parameters_weighted_by_the_methods_update_weight(name):
    """Every method's shared parameters go through the run's rule (here the default mean),
    weighted by ``update_weight``: the sample count, or 1 for DualFed's plain mean."""
    run_check(checks.check_server_step_averages_the_shared_parameters_weighted_by_the_methods_update_weight, name)


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


@pytest.mark.parametrize("rule", ["mean", "clipped_mean"])
@pytest.mark.parametrize("name", METHODS)
def test_any_arrival_order_gives_the_same_next_state_bit_for_bit(name, rule):
    """Over MQTT updates arrive in any order; the next state must not depend on it. Checked
    for every method through the interface the coordinator uses (open_round, add on arrival,
    close), in 24 random orders of 9 updates, with each streaming rule."""
    run_check(checks.check_any_arrival_order_gives_the_same_next_state_bit_for_bit, name, rule)


@pytest.mark.parametrize("codec", ["q4", "topk+q8"])
@pytest.mark.parametrize("name", METHODS)
def test_compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order(name, codec):
    """Compressed uplinks (docs/COMPRESSION.md): each update encoded against the payload its
    agent was sent, as a trainer does, and decoded as the coordinator's gate does. The decoded
    update passes the method's checks, keeps what must stay exact bit for bit, and 24 arrival
    orders of 9 of them give the same next state, bit for bit."""
    run_check(checks.check_compressed_updates_decode_to_updates_the_method_accepts_and_sum_alike_in_any_order, name, codec)


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
    run_check(checks.check_every_rule_runs_and_gives_a_finite_state, name, rule)


@pytest.mark.parametrize("name", METHODS)
def test_payload_loads_with_receive_into_a_fresh_model(name):
    run_check(checks.check_payload_loads_with_receive_into_a_fresh_model, name)


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
    run_check(checks.check_a_server_learning_rate_moves_the_shared_parameters_that_share_of_the_way, name)

