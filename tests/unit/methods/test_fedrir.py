"""What defines FedRIR: 4x4 patch masking at ratio 0.6, the vCLUB upper bound in its three
forms (literal, conditional CLUB, the authors' code), the two-stage schedule touching
disjoint parts, Adam state kept across rounds and agent restarts, only the GFE's
parameters shared."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgepfl.atomic import read_tensors, write_tensors
from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.methods import create_method
from edgepfl.methods.base import load_tensors
from edgepfl.methods.fedrir import (
    MI_MODES,
    InfoDistillation,
    fit_q,
    information_term,
    mask_patches,
    q_nll,
    vclub,
)
from edgepfl.testing.method_kit import MethodKit, changed, generator, same, snapshot

SHAPE = (1, 28, 28)
CLASSES = 4
SMALL = {"embed_dim": 32, "q_hidden": 16, "batch_size": 16}
# every KIT.build("fedrir", ...) gets the SMALL options; the data, KIT.quadrant_data(), has
# 48 images in which each class brightens its own quadrant, plus noise
KIT = MethodKit(num_classes=CLASSES, input_shape=SHAPE, spec=ModelSpec(), train=TrainConfig(epochs=1),
                method_options=SMALL)


def patch_zero_fraction(x: torch.Tensor, masked: torch.Tensor, patch=4) -> torch.Tensor:
    """Per sample, the share of patches zeroed; fails if a patch is only partly zeroed."""
    n, c, h, w = x.shape

    def tiles(t):
        t = t.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
        return t.reshape(n, -1, c * patch * patch)
    zero = (tiles(masked) == 0).all(-1)
    kept = (tiles(masked) == tiles(x)).all(-1)
    assert bool((zero | kept).all()), "a patch was neither fully zeroed nor intact"
    return zero.float().mean(1)


def test_masking_zeroes_sixty_percent_of_4x4_patches_over_all_channels():
    x = torch.rand(64, 3, 28, 28) + 0.5  # no pixel is zero before masking
    masked = mask_patches(x, 0.6, 4, generator(0))
    frac = patch_zero_fraction(x, masked)
    assert torch.allclose(frac, torch.full_like(frac, math.floor(0.6 * 49) / 49))
    assert abs(float(frac.mean()) - 0.6) < 0.01
    # a fresh draw per sample, not one mask for the batch
    assert len({tuple((masked[i] == 0).flatten().tolist()) for i in range(8)}) == 8
    quarter = patch_zero_fraction(x, mask_patches(x, 0.25, 4, generator(0)))
    assert torch.allclose(quarter, torch.full_like(quarter, 12 / 49))


def test_stage_one_feeds_the_csfe_masked_images():
    method, model = KIT.build("fedrir")
    seen = []
    model.csfe.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    data = KIT.quadrant_data()
    method.train_stage1(model, data, KIT.ctx())
    fractions = [float((x.reshape(len(x), 1, 7, 4, 7, 4) == 0).all(5).all(3).float().mean()) for x in seen]
    assert fractions and all(abs(f - 29 / 49) < 1e-6 for f in fractions)


def _fit_q(x, y, steps=400):
    torch.manual_seed(0)
    q = InfoDistillation(x.shape[1], 64)
    opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    for step in range(steps):
        idx = torch.randint(0, len(x), (256,), generator=generator(step))
        opt.zero_grad()
        q_nll(*q(x[idx]), y[idx]).backward()
        opt.step()
    return q


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.7])
def test_vclub_upper_bounds_the_mutual_information_of_correlated_gaussians(rho):
    d = 3
    g = generator(1)
    x = torch.randn(8192, d, generator=g)
    y = rho * x + math.sqrt(1 - rho**2) * torch.randn(8192, d, generator=g)
    q = _fit_q(x[:4096], y[:4096])
    with torch.no_grad():
        estimate = float(vclub(*q(x[4096:]), y[4096:]))
    true_mi = -0.5 * math.log(1 - rho**2) * d
    # with q equal to the true conditional N(rho x, 1 - rho^2), vCLUB = rho^2 / (1 - rho^2) per dim
    clubs_value = rho**2 / (1 - rho**2) * d
    assert estimate >= true_mi - 0.03
    assert abs(estimate - clubs_value) < 0.1 + 0.1 * clubs_value


def test_vclub_matches_the_all_pairs_definition():
    g = generator(2)
    mu, t = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    logvar = torch.randn(5, 3, generator=g).tanh()

    def log_q(tj, i):  # Gaussian log-density of t_j under q(.|c_i)
        var = logvar[i].exp()
        return float((-(tj - mu[i]) ** 2 / (2 * var) - 0.5 * logvar[i] - 0.5 * math.log(2 * math.pi)).sum())

    positive = np.mean([log_q(t[i], i) for i in range(5)])
    negative = np.mean([log_q(t[j], i) for i in range(5) for j in range(5)])
    assert float(vclub(mu, logvar, t)) == pytest.approx(positive - negative, abs=1e-5)


def test_information_term_routes_gradients_as_the_paper_says():
    q = InfoDistillation(4, 8)
    f_cs = torch.randn(16, 4)
    f_g = torch.randn(16, 4, requires_grad=True)
    _, nll, mi = information_term(q, f_g, f_cs, "vclub")
    # q's likelihood does not train the GFE; the bound does not train q
    assert torch.autograd.grad(nll, f_g, allow_unused=True)[0] is None
    assert all(g is None for g in torch.autograd.grad(mi, list(q.parameters()), allow_unused=True))
    assert float(torch.autograd.grad(mi, f_g)[0].abs().sum()) > 0
    # the authors' code: q conditioned on f_g, its NLL reaches the GFE through q's input
    info, nll, _ = information_term(q, f_g, f_cs, "code")
    assert info is nll
    assert float(torch.autograd.grad(info, f_g)[0].abs().sum()) > 0
    # conditional CLUB: the bound reaches the GFE through q's input, q stays out of it
    info, _, mi = information_term(q, f_g, f_cs, "club_conditional")
    assert info is mi
    assert all(p.requires_grad for p in q.parameters())  # unfrozen again after the bound
    assert all(g is None for g in torch.autograd.grad(info, list(q.parameters()), allow_unused=True))
    assert float(torch.autograd.grad(info, f_g)[0].abs().sum()) > 0


def _linear_q(a: torch.Tensor, logvar: float) -> InfoDistillation:
    """q(target | c) = N(a @ c, exp(tanh(logvar))): ReLU(c) - ReLU(-c) = c through the MLP."""
    d = a.shape[0]
    q = InfoDistillation(d, 2 * d)
    with torch.no_grad():
        q.mu[0].weight.copy_(torch.cat([torch.eye(d), -torch.eye(d)]))
        q.mu[0].bias.zero_()
        q.mu[2].weight.copy_(torch.cat([a, -a], 1))
        q.mu[2].bias.zero_()
        q.logvar[2].weight.zero_()
        q.logvar[2].bias.fill_(logvar)
    return q


@pytest.mark.parametrize("mode", ["vclub", "club_conditional"])
def test_bound_value_and_gradient_on_a_known_q(mode):
    """Against the all-pairs definition of vCLUB with q's conditioning as the mode says:
    vclub  q(f_g | f_cs), the gradient reaches f_g as the target;
    club_conditional  q(f_cs | f_g), the gradient reaches f_g through mu(f_g)."""
    g = generator(3)
    a = torch.randn(3, 3, generator=g)  # not symmetric: the two conditionings differ
    q = _linear_q(a, 0.4)
    f_g = torch.randn(6, 3, generator=g, requires_grad=True)
    f_cs = torch.randn(6, 3, generator=g)
    var = math.exp(math.tanh(0.4))

    def reference(f_g):
        cond, target = (f_cs, f_g) if mode == "vclub" else (f_g, f_cs)
        mu = cond @ a.T
        log_q = -((target[None, :, :] - mu[:, None, :]) ** 2).sum(2) / (2 * var)  # [i, j]: log q(t_j | c_i) + const
        return log_q.diagonal().mean() - log_q.mean()

    value = information_term(q, f_g, f_cs, mode)[2]
    assert float(value.detach()) == pytest.approx(float(reference(f_g).detach()), abs=1e-5)
    (grad,) = torch.autograd.grad(value, f_g)
    (expected,) = torch.autograd.grad(reference(f_g), f_g)
    torch.testing.assert_close(grad, expected)
    # closed forms: vclub (mu_k - mean mu)/(B var), mu = a f_cs; conditional a^T (f_cs_k - mean f_cs)/(B var)
    centred = f_cs - f_cs.mean(0)
    closed = centred @ a.T if mode == "vclub" else centred @ a
    torch.testing.assert_close(grad, closed / (len(f_cs) * var))


@pytest.mark.parametrize("mode", ["vclub", "club_conditional"])
def test_clamped_bound_gives_no_gradient_below_zero_and_the_same_above(mode):
    """Mutual information is never negative: with ``clamp`` a batch whose estimate is below
    zero (q misfits it) does not push the GFE, one above zero pushes it as without clamp.
    (In ``vclub`` q's own likelihood is in the loss too, but it takes no gradient to f_g.)"""
    g = generator(5)
    a = torch.randn(3, 3, generator=g)
    f_cs = torch.randn(8, 3, generator=g)
    # the target follows the condition through a; q predicts it (estimate > 0) or its opposite (< 0)
    f_g = (f_cs @ a.T if mode == "vclub" else f_cs @ torch.linalg.pinv(a).T).requires_grad_(True)
    for sign in (1.0, -1.0):
        q = _linear_q(sign * a, 0.0)
        loss, nll, estimate = information_term(q, f_g, f_cs, mode, clamp=True)
        plain = information_term(q, f_g, f_cs, mode)[0]
        (grad,) = torch.autograd.grad(loss, f_g, allow_unused=True)
        (plain_grad,) = torch.autograd.grad(plain, f_g)
        bound_part = float((loss - nll).detach()) if mode == "vclub" else float(loss.detach())
        if sign > 0:
            assert float(estimate.detach()) > 0 and bound_part == pytest.approx(float(estimate.detach()))
            torch.testing.assert_close(grad, plain_grad)
        else:
            assert float(estimate.detach()) < 0 and bound_part == 0
            assert grad is None or float(grad.abs().sum()) == 0
            assert float(plain_grad.abs().sum()) > 0


def test_fit_q_moves_only_q_towards_the_conditional_of_the_mode():
    g = generator(4)
    f_g, f_cs = torch.randn(64, 4, generator=g), torch.randn(64, 4, generator=g)
    enc = torch.nn.Linear(4, 4)
    q = InfoDistillation(4, 16)
    opt = torch.optim.Adam([*enc.parameters(), *q.parameters()], lr=1e-2)
    f_enc = enc(f_g)
    before_enc, before_q = snapshot(enc), snapshot(q)
    with torch.no_grad():
        nll_before = float(q_nll(*q(f_enc.detach()), f_cs))
    fit_q(q, opt, f_enc, f_cs, "club_conditional", 5)
    assert same(before_enc, snapshot(enc)) and changed(before_q, snapshot(q))
    assert float(q_nll(*q(f_enc.detach()), f_cs).detach()) < nll_before
    assert all(p.grad is None for p in [*enc.parameters(), *q.parameters()])


@pytest.mark.parametrize("mi", MI_MODES)
def test_stages_train_disjoint_parts(mi):
    method, model = KIT.build("fedrir", {"mi": mi})
    data = KIT.quadrant_data()
    before = snapshot(model)
    method.train_stage1(model, data, KIT.ctx())
    for part in ("encoder.", "head.", "q."):
        assert not changed(before, snapshot(model), part), part  # BN running stats included
    for part in ("csfe.", "generator."):
        assert changed(before, snapshot(model), part), part

    modes = []
    model.csfe.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    before = snapshot(model)
    method.train_stage2(model, data, KIT.ctx())
    assert not changed(before, snapshot(model), "generator.")
    # CSFE parameters frozen; in training mode as in the authors' code, so only its
    # BatchNorm statistics move (towards the unmasked images')
    moved = changed(before, snapshot(model), "csfe.")
    assert moved and all(k.endswith(("running_mean", "running_var")) for k in moved)
    assert modes and all(modes)
    for part in ("encoder.", "head.", "q."):
        assert changed(before, snapshot(model), part), part


def test_csfe_train_mode_off_keeps_the_frozen_csfe_in_eval_mode_and_its_statistics_unmoved():
    method, model = KIT.build("fedrir", {"csfe_train_mode": False})
    data = KIT.quadrant_data()
    method.train_stage1(model, data, KIT.ctx())
    modes = []
    model.csfe.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    before = snapshot(model)
    method.train_stage2(model, data, KIT.ctx())
    assert modes and not any(modes)
    assert not changed(before, snapshot(model), "csfe.")
    for part in ("encoder.", "head.", "q."):
        assert changed(before, snapshot(model), part), part


def test_adam_state_survives_a_restart_and_is_used(tmp_path):
    """Round 2 after saving and reloading the personal state (what the agent does) equals
    round 2 without a restart; with the kept state reset it differs."""
    data = KIT.quadrant_data()
    method, model = KIT.build("fedrir")
    method.local_update(model, data, KIT.ctx(0))
    adam = {k: v for k, v in method.personal_state(model).items() if k.startswith("adam.")}
    assert adam and float(adam["adam.encoder__fc__weight__step"]) == 3  # 48 samples, batch 16
    assert float(adam["adam.csfe__fc__weight__step"]) == 3 and np.abs(adam["adam.q__mu__0__weight__exp_avg"]).sum() > 0

    def restarted(path, reset):
        _, fresh = KIT.build("fedrir", seed=1)
        write_tensors(path, method.personal_state(model))
        saved = read_tensors(path)
        if reset:
            saved = {k: np.zeros_like(v) if k.startswith("adam.") else v for k, v in saved.items()}
        load_tensors(fresh, {**saved, **method.shared_params(model)})
        return fresh

    resumed = restarted(tmp_path / "personal.safetensors", reset=False)
    reset = restarted(tmp_path / "reset.safetensors", reset=True)
    uploads = [method.local_update(m, data, KIT.ctx(1)).upload for m in (model, resumed, reset)]
    key = "encoder.fc.weight"
    np.testing.assert_array_equal(uploads[0][key], uploads[1][key])
    assert not np.array_equal(uploads[0][key], uploads[2][key])


def test_sgd_or_keep_optimizer_state_off_adds_no_state():
    for options in ({"keep_optimizer_state": False}, {"optimizer": "sgd"}):
        method, model = KIT.build("fedrir", options)
        assert model.adam is None
        assert not any(k.startswith("adam.") for k in method.personal_state(model))


def test_only_gfe_parameters_are_shared():
    method, model = KIT.build("fedrir")
    shared = set(method.shared_keys(model))
    assert shared and all(k.startswith("encoder.") for k in shared)
    assert {n for n, _ in model.encoder.named_parameters()} == {k[len("encoder."):] for k in shared}
    assert not any(k.endswith(("running_mean", "running_var")) for k in shared)
    personal = method.personal_state(model)
    for prefix in ("csfe.", "generator.", "q.", "head."):
        assert any(k.startswith(prefix) for k in personal)
    res = method.local_update(model, KIT.quadrant_data(), KIT.ctx())
    assert set(res.upload) == shared
    assert method.encoder_module(model) is model.encoder and method.device_head(model) is None


@pytest.mark.parametrize("mi, flag", [("code", 0.0), ("vclub", 1.0), ("club_conditional", 2.0)])
def test_local_update_records_mi_mode_reproduces_and_learns(mi, flag):
    data = KIT.quadrant_data()
    method, model = KIT.build("fedrir", {"mi": mi})
    _, twin = KIT.build("fedrir", {"mi": mi})
    before = method.evaluate(model, data, KIT.ctx()).accuracy
    res = method.local_update(model, data, KIT.ctx(3, epochs=3))
    res_twin = method.local_update(twin, data, KIT.ctx(3, epochs=3))
    assert res.metrics["mi_mode"] == flag
    assert all(math.isfinite(res.metrics[k]) for k in ("recon_mse", "recon_kl", "cls_ce", "q_nll", "mi_vclub"))
    for k in res.upload:
        np.testing.assert_array_equal(res.upload[k], res_twin.upload[k])
    after = method.evaluate(model, data, KIT.ctx()).accuracy
    assert after > max(before, 0.6)


def test_inference_uses_gfe_and_csfe_mean_on_the_unmasked_image():
    method, model = KIT.build("fedrir")
    model.eval()
    x = KIT.quadrant_data().x_test[:8]
    with torch.no_grad():
        expected = model.head(torch.cat([model.encoder(x), model.csfe(x)[0]], 1))
        assert torch.equal(method.logits(model, x), expected)
        assert torch.equal(method.logits(model, x), method.logits(model, x))


def test_generator_reconstructs_at_image_size():
    for shape in [(1, 28, 28), (3, 32, 32), (1, 17, 30)]:
        model = create_method("fedrir", SMALL).build_model(ModelSpec(), shape, CLASSES)
        mean, _ = model.csfe(torch.zeros(2, *shape))
        assert model.generator(mean).shape == (2, *shape)
    with pytest.raises(ValueError, match="16 px"):
        create_method("fedrir", SMALL).build_model(ModelSpec(), (1, 8, 8), CLASSES)


def _received(options=None):
    """A client after one local round that has just loaded another model's GFE, as an agent
    does before evaluating: its stored GFE statistics describe its own, older GFE."""
    data = KIT.quadrant_data()
    method, model = KIT.build("fedrir", options)
    method.local_update(model, data, KIT.ctx())
    _, other = KIT.build("fedrir", options, seed=5)
    method.receive(model, method.init_server(other).global_tensors, KIT.ctx())
    return method, model, data


def test_evaluation_re_estimates_the_gfe_statistics_and_leaves_the_csfe_alone():
    """FedRIR's shared part is the GFE; the CSFE's weights are personal, so its statistics
    already describe them. (The values, parameters and the next upload: the contract suite.)"""
    method, model, data = _received({"bn_recalibrate": True})
    assert method.encoder_module(model) is model.encoder
    before = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    assert sum(k.startswith("encoder.") for k in before) == 4  # two GFE BatchNorm layers, mean and var

    method.evaluate(model, data, KIT.ctx())
    after = model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("encoder."))
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("csfe."))
    assert any(k.startswith("csfe.") for k in before)


def test_without_recalibration_evaluation_keeps_the_stored_statistics():
    method, model, data = _received({"bn_recalibrate": False})
    before = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    method.evaluate(model, data, KIT.ctx())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
