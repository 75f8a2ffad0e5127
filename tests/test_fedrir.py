"""What defines FedRIR: 4x4 patch masking at ratio 0.6, the vCLUB upper bound, the
two-stage schedule touching disjoint parts, only the GFE's parameters shared."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.methods import create_method
from edgepfl.methods.fedrir import InfoDistillation, information_term, mask_patches, q_nll, vclub

from method_kit import MethodKit, changed, generator, snapshot

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


@pytest.mark.parametrize("mi", ["vclub", "code"])
def test_stages_train_disjoint_parts(mi):
    method, model = KIT.build("fedrir", {"mi": mi})
    data = KIT.quadrant_data()
    before = snapshot(model)
    method.train_stage1(model, data, KIT.ctx())
    for part in ("encoder.", "head.", "q."):
        assert not changed(before, snapshot(model), part), part  # BN running stats included
    for part in ("csfe.", "generator."):
        assert changed(before, snapshot(model), part), part

    before = snapshot(model)
    method.train_stage2(model, data, KIT.ctx())
    for part in ("csfe.", "generator."):
        assert not changed(before, snapshot(model), part), part
    for part in ("encoder.", "head.", "q."):
        assert changed(before, snapshot(model), part), part


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


@pytest.mark.parametrize("mi, flag", [("vclub", 1.0), ("code", 0.0)])
def test_local_update_records_mi_mode_reproduces_and_learns(mi, flag):
    data = KIT.quadrant_data()
    method, model = KIT.build("fedrir", {"mi": mi})
    _, twin = KIT.build("fedrir", {"mi": mi})
    before = method.evaluate(model, data, KIT.ctx()).accuracy
    res = method.local_update(model, data, KIT.ctx(3, epochs=3))
    res_twin = method.local_update(twin, data, KIT.ctx(3, epochs=3))
    assert res.metrics["mi_mode_vclub"] == flag
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
