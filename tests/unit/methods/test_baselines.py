"""What defines each baseline: the one property that makes it that method and not another.

FedRoD, FedBN, LG-FedAvg, FedProx, FedRep, FedPer, FedAvg-FT and Local, each run for
real on tiny synthetic clients (1x28x28 images, 4 classes, SmallCNN with 16 features).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgepfl.config import TrainConfig
from edgepfl.methods import ClientUpdate, create_method
from edgepfl.methods import fedrep as fedrep_module
from edgepfl.methods.fedrod import RoDHead, balanced_softmax_loss, log_prior, rod_losses
from edgepfl.methods.training import make_optimizer
from edgepfl.testing.method_kit import MethodKit, bn_keys, params_of, same, snapshot

KIT = MethodKit()  # 4 classes of 1x28x28 images, SmallCNN with 16 features, 1 epoch of batches of 16
CLIENT = KIT.gaussian_client(1, 40, [0, 1, 2, 3])


# --------------------------------------------------------------------------- FedRoD


def test_fedrod_personal_loss_reaches_only_the_personal_head():
    method = create_method("fedrod")
    model = KIT.model(method)
    data = KIT.gaussian_client(3, 32, [0, 2]).to_torch()
    generic, personal = rod_losses(model, data.x_train, data.y_train, log_prior(data.class_counts()))
    personal.backward(retain_graph=True)
    for name, p in [*model.encoder.named_parameters(), *model.head.named_parameters()]:
        assert p.grad is None or not p.grad.any(), f"personal loss put a gradient into {name}"
    assert all(p.grad is not None and p.grad.any() for p in model.personal_head.parameters())

    # the personal step alone, with the optimizer local training uses, moves only h_P
    model.zero_grad(set_to_none=True)
    # parameters only: the forward pass in train mode still updates BN running stats
    body_and_generic = params_of(model.encoder) | {f"head.{k}": v for k, v in params_of(model.head).items()}
    personal_before = params_of(model.personal_head)
    opt = make_optimizer(model.parameters(), KIT.ctx())
    _, personal = rod_losses(model, data.x_train, data.y_train, log_prior(data.class_counts()))
    personal.backward()
    opt.step()
    assert same(params_of(model.encoder) | {f"head.{k}": v for k, v in params_of(model.head).items()}, body_and_generic)
    assert not same(params_of(model.personal_head), personal_before)

    # and the generic loss never reaches the personal head
    model.zero_grad(set_to_none=True)
    generic, _ = rod_losses(model, data.x_train, data.y_train, log_prior(data.class_counts()))
    generic.backward()
    assert all(p.grad is None for p in model.personal_head.parameters())


def test_balanced_softmax_gives_absent_classes_probability_zero():
    counts = torch.tensor([5, 0, 3, 0])
    prior = log_prior(counts)
    assert torch.isneginf(prior[[1, 3]]).all() and torch.isfinite(prior[[0, 2]]).all()
    z = torch.tensor([[0.3, 4.0, -1.0, 2.0], [1.0, -2.0, 0.5, 7.0]], requires_grad=True)
    y = torch.tensor([0, 2])
    probs = torch.softmax(z + prior, dim=1)
    assert (probs[:, [1, 3]] == 0).all()
    torch.testing.assert_close(probs.sum(1), torch.ones(2))

    loss = balanced_softmax_loss(z, y, prior)
    # direct evaluation: CE over the present classes only, logits shifted by log n_c
    zz = z.detach()
    present = [0, 2]
    shifted = zz[:, present] + torch.log(torch.tensor([5.0, 3.0]))
    want = -torch.log_softmax(shifted, 1)[torch.arange(2), torch.tensor([0, 1])].mean()
    torch.testing.assert_close(loss.detach(), want)
    assert not torch.isclose(loss.detach(), F.cross_entropy(zz, y))  # the prior matters
    loss.backward()
    assert torch.isfinite(z.grad).all() and (z.grad[:, [1, 3]] == 0).all()


def test_fedrod_local_update_equals_two_steps_per_batch():
    """local_update does, batch for batch, PFLlib's (f, h_G) step then h_P step."""
    method = create_method("fedrod")
    data = KIT.gaussian_client(4, 40, [0, 2, 3]).to_torch()  # class 1 absent: -inf in the prior
    model = KIT.model(method, 5)
    reference = copy.deepcopy(model)
    method.local_update(model, data, KIT.ctx(7))

    ctx = KIT.ctx(7)
    prior = torch.log(data.class_counts().float())
    opt_g = make_optimizer([*reference.encoder.parameters(), *reference.head.parameters()], ctx)
    opt_p = make_optimizer(reference.personal_head.parameters(), ctx)
    reference.train()
    for idx in ctx.batches(data.num_train):
        x, y = data.x_train[idx], data.y_train[idx]
        rep = reference.encoder(x)
        out_g = reference.head(rep)
        opt_g.zero_grad()
        F.cross_entropy(out_g + prior, y).backward()
        opt_g.step()
        out_p = reference.personal_head(rep.detach())
        opt_p.zero_grad()
        F.cross_entropy(out_g.detach() + out_p, y).backward()
        opt_p.step()
    got, want = model.state_dict(), reference.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    assert not same(snapshot(model.personal_head), snapshot(KIT.model(method, 5).personal_head))


def test_fedrod_shares_body_and_generic_head_and_infers_with_both_heads():
    method = create_method("fedrod")
    model = KIT.model(method)
    shared = set(method.shared_keys(model))
    assert not any(k.startswith("personal_head.") for k in shared)
    assert {"head.weight", "head.bias"} <= shared and any(k.startswith("encoder.") for k in shared)
    assert {"personal_head.weight", "personal_head.bias"} <= set(method.personal_state(model))

    method.local_update(model, CLIENT.to_torch(), KIT.ctx())  # heads now differ
    model.eval()
    x = torch.from_numpy(CLIENT.x_test)
    with torch.no_grad():
        f = model.encoder(x)
        want = model.head(f) + model.personal_head(f)
        torch.testing.assert_close(method.logits(model, x), want)
        head = method.device_head(model)
        assert isinstance(head, RoDHead) and head.personal_head is model.personal_head
        torch.testing.assert_close(head(f), want)
    # a model FedRoD did not build has no personal head: refused by name, not an AttributeError
    with pytest.raises(TypeError, match="RoDModel"):
        method.device_head(KIT.model(create_method("fedavg")))


# --------------------------------------------------------------------------- FedBN


def test_fedbn_keeps_every_batchnorm_tensor_local_and_stats_diverge():
    method = create_method("fedbn")
    server_model = KIT.model(method)
    bn = bn_keys(server_model)
    assert bn, "the test model must have BatchNorm layers"
    shared = set(method.shared_keys(server_model))
    assert not shared & bn
    assert shared == {k for k in server_model.state_dict() if k not in bn}  # everything else is shared

    state = method.init_server(server_model)
    clients = {"a": KIT.gaussian_client(1, 40, [0, 1, 2, 3]), "b": KIT.gaussian_client(2, 40, [1, 2], shift=1.5)}
    models, updates = {}, []
    for i, (agent, data) in enumerate(clients.items()):
        model = KIT.model(method, 10 + i)
        method.receive(model, method.payload_for(state, agent), KIT.ctx(i))
        upload = method.local_update(model, data.to_torch(), KIT.ctx(i)).upload
        assert not set(upload) & bn
        models[agent] = model
        updates.append(ClientUpdate(agent, data.num_train, upload))
    kept_bn = {a: {k: v for k, v in snapshot(m).items() if k in bn} for a, m in models.items()}
    state = method.server_step(state, updates, 0)
    for agent, model in models.items():
        method.receive(model, method.payload_for(state, agent), KIT.ctx(5))
    sa, sb = snapshot(models["a"]), snapshot(models["b"])
    assert all(torch.equal(sa[k], sb[k]) for k in shared)  # shared part: one global value
    for a, m in models.items():
        assert same({k: v for k, v in snapshot(m).items() if k in bn}, kept_bn[a])  # receive left BN alone
    stats = [k for k in bn if k.endswith(("running_mean", "running_var"))]
    assert stats and all(not torch.allclose(sa[k], sb[k]) for k in stats)


# --------------------------------------------------------------------------- LG-FedAvg


def test_lgfedavg_shares_only_the_classifier():
    method = create_method("lgfedavg")
    model = KIT.model(method)
    assert set(method.shared_keys(model)) == {"head.weight", "head.bias"}
    encoder_before = snapshot(model.encoder)
    upload = method.local_update(model, CLIENT.to_torch(), KIT.ctx()).upload
    assert set(upload) == {"head.weight", "head.bias"}
    assert not same(snapshot(model.encoder), encoder_before)  # the personal encoder trains

    trained_encoder = snapshot(model.encoder)
    other = KIT.model(method, 3)
    payload = method.payload_for(method.init_server(other), "x")
    method.receive(model, payload, KIT.ctx())
    assert same(snapshot(model.encoder), trained_encoder)
    assert torch.equal(model.head.weight, other.head.weight)


# --------------------------------------------------------------------------- FedProx


def _distance(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> float:
    return float(sum(((p.detach() - anchor[k]) ** 2).sum() for k, p in model.named_parameters()) ** 0.5)


def test_fedprox_proximal_term_keeps_local_weights_near_the_global_model():
    # no momentum: with lr * mu < 1 each step then contracts w - w_global, without overshoot
    train = TrainConfig(epochs=3, batch_size=16, lr=0.05, momentum=0.0)
    data = CLIENT.to_torch()
    dist, uploads = {}, {}
    for mu in (0.0, 1.0, 10.0):
        method = create_method("fedprox", {"mu": mu})
        attrs = dict(vars(method))
        model = KIT.model(method, 1)
        anchor = params_of(model)
        uploads[mu] = method.local_update(model, data, KIT.ctx(2, train=train)).upload
        dist[mu] = _distance(model, anchor)
        assert vars(method) == attrs  # the round's w_global is not kept on the shared instance
    assert dist[0.0] > dist[1.0] > dist[10.0] and dist[10.0] < 0.6 * dist[0.0], dist

    # with mu = 0 it is exactly FedAvg
    fedavg = create_method("fedavg")
    model = KIT.model(fedavg, 1)
    plain = fedavg.local_update(model, data, KIT.ctx(2, train=train)).upload
    assert all(np.array_equal(plain[k], uploads[0.0][k]) for k in plain)
    assert create_method("fedprox").config.mu == 0.01


def test_fedprox_anchor_is_the_model_as_received_this_round():
    """Round 2's proximal pull is toward round 2's global model, not round 1's."""
    train = TrainConfig(epochs=2, batch_size=16, lr=0.05)
    method = create_method("fedprox", {"mu": 5.0})
    model = KIT.model(method, 1)
    method.local_update(model, CLIENT.to_torch(), KIT.ctx(2, train=train))  # round 1
    fresh = KIT.model(method, 8)
    method.receive(model, method.shared_params(fresh), KIT.ctx(3, train=train))  # round 2's global model
    method.local_update(model, CLIENT.to_torch(), KIT.ctx(4, train=train))
    method.local_update(fresh, CLIENT.to_torch(), KIT.ctx(4, train=train))
    # same starting weights and batches: any memory of round 1 would make them differ
    fresh_params = dict(fresh.named_parameters())
    assert all(torch.equal(p, fresh_params[k]) for k, p in model.named_parameters())


# --------------------------------------------------------------------------- FedRep


def test_fedrep_head_phase_keeps_encoder_and_body_phase_keeps_head(monkeypatch):
    method = create_method("fedrep", {"head_epochs": 2})
    model = KIT.model(method)
    phases = []
    real_fit = fedrep_module.fit

    def recording_fit(m, *args, **kwargs):
        before = (params_of(m.encoder), params_of(m.head))
        out = real_fit(m, *args, **kwargs)
        phases.append((before, (params_of(m.encoder), params_of(m.head))))
        return out

    monkeypatch.setattr(fedrep_module, "fit", recording_fit)
    method.local_update(model, CLIENT.to_torch(), KIT.ctx())
    assert len(phases) == 2
    (enc0, head0), (enc1, head1) = phases[0]
    assert same(enc0, enc1) and not same(head0, head1), "head phase must train only the head"
    (enc1, head1), (enc2, head2) = phases[1]
    assert same(head1, head2) and not same(enc1, enc2), "body phase must train only the encoder"


# --------------------------------------------------------------------------- FedPer


def test_fedper_shares_exactly_the_encoder_and_trains_the_head_jointly():
    method = create_method("fedper")
    model = KIT.model(method)
    want = {f"encoder.{k}" for k in model.encoder.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(method.shared_keys(model)) == want
    head_before = params_of(model.head)
    encoder_before = params_of(model.encoder)
    upload = method.local_update(model, CLIENT.to_torch(), KIT.ctx()).upload
    assert set(upload) == want
    assert not same(params_of(model.head), head_before) and not same(params_of(model.encoder), encoder_before)


# --------------------------------------------------------------------------- FedAvg-FT


def test_fedavg_ft_fine_tunes_for_evaluation_without_touching_the_model():
    method = create_method("fedavg_ft", {"ft_epochs": 5})
    model = KIT.model(method)
    create_method("fedavg").local_update(model, CLIENT.to_torch(), KIT.ctx())
    before = snapshot(model)
    tuned = method.evaluate(model, CLIENT.to_torch(), KIT.ctx(1))
    assert same(snapshot(model), before)
    plain = create_method("fedavg").evaluate(model, CLIENT.to_torch(), KIT.ctx(1))
    assert tuned.loss < plain.loss  # the evaluation really used a fine-tuned classifier


# --------------------------------------------------------------------------- Local


def test_local_shares_nothing_and_its_server_step_is_a_no_op():
    method = create_method("local")
    model = KIT.model(method)
    assert method.shared_keys(model) == []
    assert set(method.personal_state(model)) == set(model.state_dict())
    before = snapshot(model)
    upload = method.local_update(model, CLIENT.to_torch(), KIT.ctx()).upload
    assert upload == {}
    assert not same(snapshot(model), before)  # it still trains locally

    state = method.init_server(KIT.model(method, 2))
    assert state.global_tensors == {}
    updates = [ClientUpdate("a", 40, {}), ClientUpdate("b", 24, {})]
    after = method.server_step(state, updates, 0)
    assert after.global_tensors == {} and after.client_tensors == state.client_tensors and after.extra == state.extra
    trained = snapshot(model)
    method.receive(model, method.payload_for(after, "a"), KIT.ctx())
    assert same(snapshot(model), trained)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedbn", "fedrod", "fedper", "fedrep", "lgfedavg"])
def test_shared_parameters_are_a_strict_subset_where_the_method_says_so(name):
    """Sanity across the family: only FedAvg and FedProx share every tensor."""
    method = create_method(name)
    model = KIT.model(method)
    everything = {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    full = set(method.shared_keys(model)) == everything
    assert full == (name in ("fedavg", "fedprox"))
