"""What defines FedPick: straight-through binary mask, noise-free evaluation, entropy
maximisation of the irrelevant classifier, personal BatchNorm, the ensemble rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.nn.modules.batchnorm import _BatchNorm

from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.data.client import ClientTensors
from edgepfl.methods import LocalContext, create_method
from edgepfl.methods.fedpick import FedPickConfig, deterministic_mask, fedpick_loss

SHAPE = (1, 16, 16)
CLASSES = 4


def make_data(n=64, seed=0) -> ClientTensors:
    """Each class lights up its own quadrant, plus noise: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % CLASSES
    x = 0.3 * torch.randn(n, *SHAPE, generator=g)
    for k in range(CLASSES):
        r, c = divmod(k, 2)
        x[y == k, :, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] += 1.5
    return ClientTensors(x_train=x, y_train=y, x_test=x.clone(), y_test=y.clone(), num_classes=CLASSES)


def make_ctx(seed=0, epochs=1) -> LocalContext:
    return LocalContext(train=TrainConfig(epochs=epochs, batch_size=16, lr=0.05), device="cpu", round=0,
                        seed=seed, num_classes=CLASSES, generator=torch.Generator().manual_seed(seed))


def build(options=None, seed=0):
    torch.manual_seed(seed)
    method = create_method("fedpick", options)
    return method, method.build_model(ModelSpec(arch="cnn", feature_dim=16), SHAPE, CLASSES)


def test_training_mask_is_binary_and_pfsm_gets_gradient_through_sigmoid():
    method, model = build()
    model.train()
    x, y = make_data().x_train[:32], make_data().y_train[:32]
    parts = model.parts(x, torch.Generator().manual_seed(1))
    mask = parts["mask"]
    assert set(torch.unique(mask.detach()).tolist()) <= {0.0, 1.0}
    assert 0 < float(mask.detach().mean()) < 1  # a real selection, not all-or-nothing
    # the forward value is the hard mask of the (noisy) soft mask
    assert torch.equal(mask.detach(), (parts["mask_soft"] > 0.5).float())
    fedpick_loss(parts, y, method.config)["total"].backward()
    for name, p in model.pfsm.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


def test_straight_through_gradient_is_the_sigmoid_derivative():
    _, model = build({"temperature": 2.0})
    model.eval()  # no noise: s is exactly pfsm(v)
    v = torch.randn(8, 16)
    s = model.pfsm(v).detach().requires_grad_(True)
    model.pfsm = torch.nn.Sequential(torch.nn.Identity())  # feed s directly
    m, soft = model.mask(s)
    m.sum().backward()
    expected = soft * (1 - soft) / 2.0
    assert torch.allclose(s.grad, expected.detach(), atol=1e-6)


def test_evaluation_mask_is_deterministic_and_training_masks_are_random():
    _, model = build()
    x = make_data().x_test[:32]
    model.eval()
    a, b = model.parts(x), model.parts(x)
    assert torch.equal(a["mask"], b["mask"]) and torch.equal(model(x), model(x))
    assert torch.equal(a["mask"], deterministic_mask(model.pfsm(a["v"]), 1.0, 0.5))

    model.train()
    g = torch.Generator().manual_seed(3)
    first, second = model.parts(x, g)["mask"], model.parts(x, g)["mask"]
    assert not torch.equal(first, second)
    # the same seed reproduces the same draw
    again = model.parts(x, torch.Generator().manual_seed(3))["mask"]
    assert torch.equal(first, again)


def test_entropy_term_is_maximised():
    cfg = FedPickConfig(lam_g=0, lam_p=0, lam_kd=0, lam_ent=1.0)
    _, model = build()
    data = make_data()
    with torch.no_grad():
        model.irrelevant_head.weight.mul_(20)  # start from confident predictions
    opt = torch.optim.SGD(model.irrelevant_head.parameters(), lr=0.5)
    model.eval()

    def entropy_now():
        with torch.no_grad():
            z = model.parts(data.x_train)["z_ir"]
        p = F.softmax(z, 1)
        return float(-(p * p.log()).sum(1).mean())

    before = entropy_now()
    for _ in range(5):
        opt.zero_grad()
        terms = fedpick_loss(model.parts(data.x_train), data.y_train, cfg)
        assert torch.allclose(terms["total"], -terms["entropy"])
        terms["total"].backward()
        opt.step()
    assert entropy_now() > before + 1e-3
    assert entropy_now() <= np.log(CLASSES) + 1e-6


def test_cyclic_distillation_is_symmetric_kl_with_stop_gradient():
    z_g = torch.randn(6, CLASSES, requires_grad=True)
    z_p = torch.randn(6, CLASSES, requires_grad=True)
    parts = {"z_g": z_g, "z_p": z_p, "z_ir": torch.zeros(6, CLASSES)}
    terms = fedpick_loss(parts, torch.zeros(6, dtype=torch.long), FedPickConfig(lam_g=0, lam_p=0, lam_ent=0))
    p, q = F.softmax(z_g, 1), F.softmax(z_p, 1)
    by_hand = ((p * (p / q).log()).sum(1) + (q * (q / p).log()).sum(1)).mean()
    assert torch.allclose(terms["kd"], by_hand)
    terms["total"].backward()
    # each side is only the student of the other: z_g's gradient is that of
    # KL(fixed p_p || p_g) alone, z_p's that of KL(fixed p_g || p_p) alone
    for student, teacher, grad in ((z_g, q, z_g.grad), (z_p, p, z_p.grad)):
        s = student.detach().clone().requires_grad_(True)
        t = teacher.detach()
        (t * (t / F.softmax(s, 1)).log()).sum(1).mean().backward()
        assert float(grad.abs().sum()) > 0
        assert torch.allclose(grad, s.grad, atol=1e-6)


def test_batchnorm_and_personal_modules_never_shared():
    method, model = build()
    shared = set(method.shared_keys(model))
    bn = {n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    assert bn, "the test needs an encoder with BatchNorm"
    for key in model.state_dict():
        module = key.rpartition(".")[0]
        if module in bn or key.split(".")[0] in ("pfsm", "personal_head", "irrelevant_head"):
            assert key not in shared, key
    assert {"head.weight", "head.bias"} <= shared
    assert any(k.startswith("encoder.") for k in shared)
    assert set(method.personal_state(model)).isdisjoint(shared)


def test_inference_is_logit_sum_and_device_head_matches():
    method, model = build()
    model.eval()
    x = make_data().x_test[:16]
    v = model.encoder(x)
    m = deterministic_mask(model.pfsm(v), 1.0, 0.5)
    expected = model.head(v) + model.personal_head(m * v)
    assert torch.allclose(method.logits(model, x), expected, atol=1e-6)
    head = method.device_head(model)
    assert torch.allclose(head(v), expected, atol=1e-6)
    assert "fedpick" in method.head_kinds


def test_pfsm_hidden_sets_the_bottleneck_and_the_mask_keeps_one_entry_per_feature():
    _, default = build()
    assert [tuple(layer.weight.shape) for layer in default.pfsm[::2]] == [(16, 16), (16, 16)]
    method, model = build({"pfsm_hidden": 5})
    assert [tuple(layer.weight.shape) for layer in model.pfsm[::2]] == [(5, 16), (16, 5)]
    model.eval()
    v = model.encoder(make_data().x_test[:8])
    assert model.mask(v)[0].shape == v.shape
    assert torch.allclose(method.device_head(model)(v), method.logits(model, make_data().x_test[:8]), atol=1e-6)


def test_softmax_ensemble_option_averages_probabilities():
    method, model = build({"ensemble": "softmax"})
    model.eval()
    x = make_data().x_test[:16]
    p = model.parts(x)
    avg = (F.softmax(p["z_g"], 1) + F.softmax(p["z_p"], 1)) / 2
    assert torch.allclose(method.logits(model, x).exp(), avg, atol=1e-6)
    assert torch.allclose(method.device_head(model)(p["v"]).exp(), avg, atol=1e-6)


def test_personal_inference_option_is_the_personal_classifier_alone_and_trains_the_same():
    """``ensemble: personal`` changes what is evaluated (and what a device runs), not what
    is trained: the upload is bit-identical to the default's."""
    data = make_data()
    uploads = []
    for ensemble in ("personal", "logits"):
        method, model = build({"ensemble": ensemble})
        uploads.append(method.local_update(model, data, make_ctx(seed=3)).upload)
        if ensemble == "personal":
            model.eval()
            p = model.parts(data.x_test[:16])
            assert torch.equal(method.logits(model, data.x_test[:16]), p["z_p"])
            assert torch.allclose(method.device_head(model)(p["v"]), p["z_p"], atol=1e-6)
            assert not torch.allclose(p["z_p"], p["z_g"] + p["z_p"])
    for key in uploads[0]:
        np.testing.assert_array_equal(uploads[0][key], uploads[1][key])


def test_local_update_uploads_shared_only_is_reproducible_and_learns():
    data = make_data()
    method, model = build()
    _, twin = build()
    before = method.evaluate(model, data, make_ctx()).accuracy
    res = method.local_update(model, data, make_ctx(seed=5, epochs=4))
    res_twin = method.local_update(twin, data, make_ctx(seed=5, epochs=4))
    assert set(res.upload) == set(method.shared_keys(model))
    for k in res.upload:
        np.testing.assert_array_equal(res.upload[k], res_twin.upload[k])
    assert 0.0 <= res.metrics["mask_ratio"] <= 1.0
    after = method.evaluate(model, data, make_ctx()).accuracy
    assert after > max(before, 0.6)


@pytest.mark.parametrize("bad", [{"temperature": 0}, {"lam_ent": -1}, {"ensemble": "vote"}, {"typo": 1}])
def test_config_rejects_bad_options(bad):
    with pytest.raises(ValidationError):
        create_method("fedpick", bad)
