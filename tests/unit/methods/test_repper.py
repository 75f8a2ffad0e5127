"""RepPer: what defines it — SupCon stage 1 on two views, encoder-only upload, personal sklearn heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.data.client import ClientTensors
from edgepfl.heads import LRHead, MLPHead, SVMHead
from edgepfl.methods import create_method
from edgepfl.methods.base import LocalContext, load_tensors
from edgepfl.methods.repper import RepPerHead, augment

C = 4
SPEC = ModelSpec(arch="mlp", feature_dim=8)
SHAPE = (1, 8, 8)


def make_data(seed: int = 0, signal: float = 0.3, n_train: int = 120, n_test: int = 80, classes=range(C)):
    """Class templates buried in stronger per-sample noise: an untrained encoder is far from perfect.

    Templates are smooth and mirror-symmetric so that the default augmentations
    (crop, flip) keep an image's class recognisable.
    """
    g = torch.Generator().manual_seed(seed)
    t = F.interpolate(torch.randn(C, *SHAPE[:1], 4, 4, generator=g), size=SHAPE[1:], mode="bilinear",
                      align_corners=False)
    t = t + t.flip(-1)
    templates = t / t.std()
    classes = torch.tensor(list(classes))

    def split(n):
        y = classes[torch.arange(n) % len(classes)]
        return signal * templates[y] + torch.randn(n, *SHAPE, generator=g), y

    (xt, yt), (xs, ys) = split(n_train), split(n_test)
    return ClientTensors(xt, yt, xs, ys, C)


def make_ctx(seed: int = 1, epochs: int = 1, batch_size: int = 40) -> LocalContext:
    return LocalContext(train=TrainConfig(epochs=epochs, batch_size=batch_size), device="cpu", round=0, seed=0,
                        num_classes=C, generator=torch.Generator().manual_seed(seed))


def build(options=None, seed: int = 0):
    method = create_method("repper", options or {})
    torch.manual_seed(seed)
    return method, method.build_model(SPEC, SHAPE, C)


def test_defaults_follow_the_paper():
    cfg = create_method("repper").config
    assert (cfg.tau, cfg.optimizer, cfg.lr, cfg.weight_decay) == (0.1, "adam", 1e-3, 1e-4)
    assert cfg.supcon_form == "out"  # the paper's eq. 5 ('in') measured worse
    # stage 2 (measured): L2-normalized features, C chosen per client by cross-validation
    assert cfg.projection_dim is None and cfg.head == "lr" and cfg.head_normalize and cfg.head_C is None


def test_two_augmentations_of_an_image_differ_and_are_reproducible():
    x = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    v1 = augment(x, torch.Generator().manual_seed(3))
    v2 = augment(x, torch.Generator().manual_seed(4))
    assert v1.shape == x.shape
    assert all((v1[i] - v2[i]).abs().max() > 1e-3 for i in range(len(x)))
    assert torch.equal(v1, augment(x, torch.Generator().manual_seed(3)))

    method, _ = build()
    views = method.views(x, torch.Generator().manual_seed(5))
    assert views.shape == (12, 1, 16, 16)
    assert all((views[i] - views[6 + i]).abs().max() > 1e-3 for i in range(6))


def test_augment_without_crop_flip_noise_is_identity_and_flip_mirrors():
    x = torch.randn(3, 2, 10, 12, generator=torch.Generator().manual_seed(0))
    same = augment(x, torch.Generator().manual_seed(0), crop_scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False,
                   noise_std=0.0)
    assert torch.allclose(same, x, atol=1e-5)
    # with crop and noise off, each image is either itself or its horizontal mirror
    flipped = augment(x, torch.Generator().manual_seed(0), crop_scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=True,
                      noise_std=0.0)
    for i in range(3):
        assert torch.allclose(flipped[i], x[i], atol=1e-5) or torch.allclose(flipped[i], x[i].flip(-1), atol=1e-5)


def test_a_series_is_augmented_as_an_image_one_row_high_and_a_vector_gets_noise_alone():
    x = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(0))
    view = augment(x, torch.Generator().manual_seed(3))
    assert view.shape == x.shape and (view - x).abs().max() > 1e-3
    assert torch.equal(view, augment(x.unsqueeze(2), torch.Generator().manual_seed(3)).squeeze(2))
    reversed_or_not = augment(x, torch.Generator().manual_seed(1), crop_scale=(1.0, 1.0), ratio=(1.0, 1.0), noise_std=0.0)
    for i in range(4):  # with crop and noise off, each window is itself or itself reversed in time
        assert torch.allclose(reversed_or_not[i], x[i], atol=1e-5) or torch.allclose(reversed_or_not[i], x[i].flip(-1),
                                                                                      atol=1e-5)
    vectors = torch.randn(4, 24, generator=torch.Generator().manual_seed(0))
    noisy = augment(vectors, torch.Generator().manual_seed(2), noise_std=0.1)
    assert torch.allclose(noisy, vectors + 0.1 * torch.randn(4, 24, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(augment(vectors, noise_std=0.0), vectors)


def test_stage_one_uploads_only_the_encoder_and_never_trains_a_classifier():
    method, model = build()
    head_before = {k: v.clone() for k, v in model.head.state_dict().items()}
    enc_before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    res = method.local_update(model, make_data(), make_ctx())
    assert set(res.upload) == {f"encoder.{k}" for k in model.encoder.state_dict() if not k.endswith("num_batches_tracked")}
    assert all(torch.equal(v, head_before[k]) for k, v in model.head.state_dict().items())
    assert all(p.grad is None for p in model.head.parameters())
    assert any(not torch.equal(v, enc_before[k]) for k, v in model.encoder.state_dict().items())
    assert np.isfinite(res.train_loss)


def test_stage_one_loss_ignores_the_head_and_uses_labels_only_as_positives():
    # the loss is a function of encoder features and label *equality*: renaming the
    # classes leaves it unchanged, as no classifier is involved
    method, model = build()
    data = make_data()
    x, y = data.x_train[:20], data.y_train[:20]
    a = method.contrastive_loss(model, x, y, torch.Generator().manual_seed(7))
    b = method.contrastive_loss(model, x, (y + 1) % C, torch.Generator().manual_seed(7))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_projection_head_is_shared_and_the_head_still_reads_encoder_features():
    method, model = build({"projection_dim": 6})
    res = method.local_update(model, make_data(), make_ctx())
    assert any(k.startswith("projector.") for k in res.upload)
    assert all(k.startswith(("encoder.", "projector.")) for k in res.upload)
    method.fit_head(model, make_data().x_train, make_data().y_train)
    assert model.head.net[0].in_features == SPEC.feature_dim


def test_stage_two_head_on_trained_encoder_beats_chance():
    method, model = build()
    data, ctx = make_data(), make_ctx(epochs=5)
    before = method.evaluate(model, data, ctx).accuracy
    losses = [method.local_update(model, data, ctx).train_loss for _ in range(4)]
    after = method.evaluate(model, data, ctx).accuracy
    assert losses[-1] < losses[0]
    assert after >= 0.6, f"chance is 0.25, got {after}"
    assert after > before + 0.2, (before, after)


@pytest.mark.parametrize("kind", ["lr", "svm", "mlp"])
def test_torch_head_reproduces_the_sklearn_head(kind):
    method, model = build({"head": kind})
    data = make_data(n_train=60, n_test=40)
    pipe = method.fit_head(model, data.x_train, data.y_train)
    feats = model.encoder.eval()(data.x_test).detach()
    logits = model.head(feats).detach().numpy()
    np.testing.assert_array_equal(logits.argmax(1), pipe.predict(feats.numpy()))
    if kind == "svm":
        np.testing.assert_allclose(logits, pipe.decision_function(feats.numpy()), rtol=1e-4, atol=1e-4)
    else:
        probs = torch.softmax(torch.as_tensor(logits), 1).numpy()
        np.testing.assert_allclose(probs, pipe.predict_proba(feats.numpy()), atol=1e-5)


@pytest.mark.parametrize("kind", ["lr", "svm", "mlp"])
def test_binary_client_maps_onto_full_class_range(kind):
    # sklearn keeps one output row for two classes; classes 1 and 3 of 4 here
    method, model = build({"head": kind})
    data = make_data(classes=[1, 3], n_train=40, n_test=20)
    pipe = method.fit_head(model, data.x_train, data.y_train)
    feats = model.encoder.eval()(data.x_test).detach()
    logits = model.head(feats).detach()
    np.testing.assert_array_equal(logits.argmax(1).numpy(), pipe.predict(feats.numpy()))
    probs = torch.softmax(logits, 1)
    np.testing.assert_allclose(probs[:, [1, 3]].numpy(), pipe.predict_proba(feats.numpy()), atol=1e-5)
    assert probs[:, [0, 2]].max() < 1e-6


def test_single_class_client_predicts_its_class():
    method, model = build()
    data = make_data(classes=[2], n_train=10, n_test=5)
    assert method.fit_head(model, data.x_train, data.y_train) is None
    assert method.evaluate(model, data, make_ctx()).accuracy == 1.0


def test_fitted_head_is_personal_state_and_survives_save_load():
    method, model = build()
    data, ctx = make_data(), make_ctx()
    method.evaluate(model, data, ctx)
    personal = method.personal_state(model)
    assert any(k.startswith("head.") for k in personal)
    assert not any(k.startswith("head.") for k in method.shared_keys(model))

    _, fresh = build(seed=123)
    load_tensors(fresh, {**method.shared_params(model), **personal})
    model.eval(), fresh.eval()
    assert torch.equal(model(data.x_test), fresh(data.x_test))
    assert torch.equal(method.device_head(model)(model.encoder(data.x_test)), model(data.x_test))


def test_heads_carry_the_methods_head_options():
    """Stage-2 heads are the generic family with RepPer's options as their parameters."""
    method = create_method("repper", {"head_C": 0.5, "head_hidden": 16, "head_max_iter": 50, "head_normalize": False})
    lr, svm, mlp = (method.make_head(k) for k in ("lr", "svm", "mlp"))
    assert isinstance(lr, LRHead) and isinstance(svm, SVMHead) and isinstance(mlp, MLPHead)
    assert (lr.C, lr.max_iter, lr.normalize) == (0.5, 50, False)
    assert (svm.C, svm.max_iter, svm.normalize) == (0.5, 50, False)
    assert (mlp.hidden_layer_sizes, mlp.max_iter, mlp.normalize) == ((16,), 50, False)
    # the defaults are the generic heads' own: one set of values for federation and device
    default = create_method("repper")
    for kind, cls in (("lr", LRHead), ("svm", SVMHead), ("mlp", MLPHead)):
        assert default.make_head(kind).get_params() == cls().get_params()
    data = make_data(n_train=40, n_test=8)
    fitted = method.make_head("lr").fit(data.x_train.flatten(1).numpy(), data.y_train.numpy())
    assert [name for name, _ in fitted.pipeline_.steps] == ["clf"]  # normalize=False: no L2 step
    with pytest.raises(ValueError, match="does not fit a repper encoder"):
        method.make_head("forest")
    assert isinstance(RepPerHead(4, 3, "lr").net[0], torch.nn.Linear)


def test_stage_two_and_a_head_tier_device_choose_the_same_C_on_the_same_features(tmp_path):
    """C is chosen inside the estimator's fit, so RepPer's stage 2 and a head-tier device
    (which builds its head from the release's method options) make one choice."""
    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.heads import HeadRelease
    from edgepfl.methods.training import encoder_features

    from tests.export_fixtures import client_data

    method, model = build()
    data = make_data(n_train=90, n_test=8)
    stage2 = method.fit_head(model, data.x_train, data.y_train, seed=0)
    feats = encoder_features(model, data.x_train).numpy()

    release = HeadRelease("repper", method.config.model_dump())
    device = HeadRuntime(tmp_path / "state", "lr", client_data(0)).new_head(release)
    device.set_params(random_state=0).fit(feats, data.y_train.numpy())

    assert stage2 is not None and stage2.C is None and device.C is None
    assert stage2.C_ == device.C_ and np.array_equal(stage2.cv_scores_, device.cv_scores_)
    np.testing.assert_array_equal(stage2.predict(feats), device.predict(feats))
    # the torch twin that the federation evaluates carries the chosen head
    model.eval()
    assert np.array_equal(model.head(torch.from_numpy(feats)).argmax(1).numpy(), stage2.predict(feats))
