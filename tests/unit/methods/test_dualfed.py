"""DualFed: what defines it — dual classifiers around a personal projector, stage-wise training,
unweighted server mean, local BN statistics, logit-sum inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.data.client import ClientTensors
from edgepfl.methods import create_method
from edgepfl.methods.base import ClientUpdate, LocalContext
from edgepfl.methods.dualfed import DualFedHead
from edgepfl.testing.method_kit import bn_inputs

C = 3
SPEC = ModelSpec(arch="mlp", feature_dim=6)
SHAPE = (1, 6, 6)


def make_data(seed: int = 0, n: int = 48) -> ClientTensors:
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(C, *SHAPE, generator=g)
    y = torch.arange(n) % C
    x = templates[y] + 0.5 * torch.randn(n, *SHAPE, generator=g)
    return ClientTensors(x, y, x[:12].clone(), y[:12].clone(), C)


def make_ctx(seed: int = 1) -> LocalContext:
    return LocalContext(train=TrainConfig(epochs=1, batch_size=16), device="cpu", round=0, seed=0, num_classes=C,
                        generator=torch.Generator().manual_seed(seed))


def build(options=None, seed: int = 0):
    method = create_method("dualfed", options or {})
    torch.manual_seed(seed)
    return method, method.build_model(SPEC, SHAPE, C)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def changed(before: dict[str, torch.Tensor], module: nn.Module) -> set[str]:
    return {k for k, v in module.named_parameters() if not torch.equal(v, before[k])}


def test_defaults_and_architecture():
    method, model = build()
    cfg = method.config
    assert (cfg.con_lambda, cfg.tau, cfg.schedule, cfg.ensemble) == (40.0, 0.2, "stagewise", "logits")
    g = model.head.projector
    k = SPEC.feature_dim
    assert [type(m) for m in g] == [nn.Linear, nn.ReLU, nn.BatchNorm1d, nn.Linear, nn.BatchNorm1d]
    assert (g[0].in_features, g[0].out_features, g[2].num_features, g[3].out_features, g[4].num_features) == (
        k, 256, 256, k, k)
    assert model.head.personal_classifier.in_features == k and model.head.global_classifier.in_features == k
    assert method.encoder_module(model) is model.encoder
    assert method.head_kinds == ("dualfed", "lr", "svm", "mlp")


def test_shared_keys_bn_affine_in_running_stats_out():
    method, model = build()
    shared = set(method.shared_keys(model))
    enc_bn = [n for n, m in model.encoder.named_modules() if isinstance(m, nn.BatchNorm1d)]
    assert enc_bn, "the test encoder must contain BatchNorm"
    for name in enc_bn:
        assert {f"encoder.{name}.weight", f"encoder.{name}.bias"} <= shared
        assert not {f"encoder.{name}.running_mean", f"encoder.{name}.running_var"} & shared
    assert {"head.global_classifier.weight", "head.global_classifier.bias"} <= shared
    assert not any(k.startswith(("head.projector.", "head.personal_classifier.")) for k in shared)
    personal = method.personal_state(model)
    assert all(f"encoder.{n}.running_mean" in personal for n in enc_bn)
    assert "head.projector.0.weight" in personal and "head.personal_classifier.weight" in personal


def test_global_classifier_sees_only_pre_projection_features_and_inference_is_logit_sum():
    method, model = build()
    model.eval()
    x = make_data().x_test
    z = model.encoder(x)
    u = model.head.projector(z)
    expected = model.head.personal_classifier(u) + model.head.global_classifier(z)
    assert torch.allclose(method.logits(model, x), expected, atol=1e-6)
    # perturbing the projector moves the personal logits only
    _, p0, s0 = model.head.parts(z)
    with torch.no_grad():
        model.head.projector[0].weight.add_(1.0)
    _, p1, s1 = model.head.parts(z)
    assert torch.equal(s0, s1) and not torch.allclose(p0, p1)
    # the device head computes the same ensemble from z
    assert torch.allclose(method.device_head(model)(z), method.logits(model, x), atol=1e-6)


def test_softmax_ensemble_option():
    method, model = build({"ensemble": "softmax"})
    model.eval()
    x = make_data().x_test
    z = model.encoder(x)
    _, p, s = model.head.parts(z)
    expected = torch.log((F.softmax(p, 1) + F.softmax(s, 1)) / 2)
    assert torch.allclose(method.logits(model, x), expected, atol=1e-6)
    assert torch.allclose(method.logits(model, x).exp().sum(1), torch.ones(len(x)), atol=1e-5)


def test_stage_a_leaves_global_classifier_and_trains_the_main_branch():
    method, model = build()
    before = params_of(model)
    method.train_stage_a(model, make_data(), make_ctx())
    diff = changed(before, model)
    assert not any(k.startswith("head.global_classifier.") for k in diff)
    assert any(k.startswith("encoder.") for k in diff)
    assert any(k.startswith("head.projector.") for k in diff)
    assert any(k.startswith("head.personal_classifier.") for k in diff)


def test_stage_b_changes_only_the_global_classifier():
    method, model = build()
    before = params_of(model)
    method.train_stage_b(model, make_data(), make_ctx())
    assert changed(before, model) == {"head.global_classifier.weight", "head.global_classifier.bias"}
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("head.global_classifier."))


def test_stage_b_result_does_not_depend_on_the_projector():
    # two clients identical but for their projector and personal classifier train the
    # same global classifier: stage B reads pre-projection features only
    method = create_method("dualfed")
    data = make_data()
    results = []
    for bump in (0.0, 3.0):
        model = build()[1]
        with torch.no_grad():
            model.head.projector[3].weight.add_(bump)
            model.head.personal_classifier.weight.mul_(-2.0)
        method.train_stage_b(model, data, make_ctx(seed=9))
        results.append(params_of(model.head.global_classifier))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    assert not torch.equal(results[0]["weight"], params_of(build()[1].head.global_classifier)["weight"])


def test_local_update_uploads_shared_only_and_improves_accuracy():
    method, model = build()
    data, ctx = make_data(), make_ctx()
    acc0 = method.evaluate(model, data, ctx).accuracy
    for _ in range(3):
        res = method.local_update(model, data, ctx)
    assert set(res.upload) == set(method.shared_keys(model))
    assert not any("running_" in k or k.startswith(("head.projector.", "head.personal_classifier.")) for k in res.upload)
    assert set(res.metrics) == {"loss_stage_a", "loss_stage_b"}
    assert method.evaluate(model, data, ctx).accuracy > max(acc0, 0.6)


def test_simultaneous_variant_trains_every_part():
    method, model = build({"schedule": "simultaneous"})
    before = params_of(model)
    res = method.local_update(model, make_data(), make_ctx())
    diff = changed(before, model)
    for prefix in ("encoder.", "head.projector.", "head.personal_classifier.", "head.global_classifier."):
        assert any(k.startswith(prefix) for k in diff), prefix
    assert np.isfinite(res.train_loss)


def test_server_mean_is_unweighted():
    method, model = build()
    state = method.init_server(model)
    keys = list(state.shared_params())
    a = {k: np.full_like(v, 1.0) for k, v in state.shared_params().items()}
    b = {k: np.full_like(v, 3.0) for k, v in state.shared_params().items()}
    updates = [ClientUpdate("a", 1, a), ClientUpdate("b", 1000, b)]
    for u in updates:
        method.check_update(state, u)
    new = method.server_step(state, updates, 0)
    for k in keys:
        np.testing.assert_allclose(new.global_tensors[k], 2.0)


def test_receive_keeps_local_bn_statistics():
    method, model = build()
    method.local_update(model, make_data(), make_ctx())
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    _, other = build(seed=5)
    payload = method.init_server(other).global_tensors
    method.receive(model, payload, make_ctx())
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in stats.items())
    assert all(torch.equal(sd[k], torch.from_numpy(v)) for k, v in payload.items())


def test_dualfed_head_standalone():
    head = DualFedHead(5, 4, hidden=7).eval()
    z = torch.randn(3, 5)
    _, p, s = head.parts(z)
    assert torch.allclose(head(z), p + s)
    with pytest.raises(ValueError):
        create_method("dualfed", {"schedule": "alternating"})


def test_evaluation_recalibrates_personal_bn_statistics_to_the_received_encoder():
    import copy

    method, model = build()
    assert method.config.bn_recalibrate
    data = make_data()
    method.local_update(model, data, make_ctx())
    _, other = build(seed=5)
    method.receive(model, method.init_server(other).global_tensors, make_ctx())
    # what the received encoder (and the personal projector on its features) produce on
    # the client's training images, from a copy so the reference pass leaves the model alone
    ref = copy.deepcopy(model)
    expected = bn_inputs(ref, ref.parts_forward, data.x_train, nn.BatchNorm1d)
    stale = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}

    method.evaluate(model, data, make_ctx())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)}
    assert set(layers) == set(expected) and any(n.startswith("encoder") for n in layers)
    for name, bn in layers.items():
        torch.testing.assert_close(bn.running_mean, expected[name].mean(0))
        torch.testing.assert_close(bn.running_var, expected[name].var(0, unbiased=True))
        assert bn.momentum == 0.1  # the training momentum is back
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in stale.items())
    # recalibration is evaluation-side only: no parameter moved
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_without_recalibration_evaluation_keeps_the_stored_statistics():
    method, model = build({"bn_recalibrate": False})
    data = make_data()
    method.local_update(model, data, make_ctx())
    _, other = build(seed=5)
    method.receive(model, method.init_server(other).global_tensors, make_ctx())
    stale = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    method.evaluate(model, data, make_ctx())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stale.items())
