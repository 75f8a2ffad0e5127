"""What defines FedPAC: statistics, the head-then-body schedule, centroid alignment,
count-weighted centroids and the server's combination weights (QP and prototype)."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgepfl.config import ModelSpec, TrainConfig
from edgepfl.data.client import ClientData
from edgepfl.methods import ClientUpdate, ServerState, UpdateRejected, create_method
from edgepfl.methods.fedpac import (
    CENTROID_COUNTS,
    CENTROIDS,
    alignment_targets,
    collaboration_matrix,
    qp_weights,
    repair_psd,
    solve_simplex_qp,
)
from edgepfl.testing.method_kit import MethodKit, params_of

K, D, SHAPE = 3, 4, (1, 4, 4)
KIT = MethodKit(num_classes=K, input_shape=SHAPE, spec=ModelSpec(arch="mlp", feature_dim=D),
                train=TrainConfig(epochs=1, batch_size=8))


def make_data(seed: int, dominant: int = 0, n: int = 40) -> ClientData:
    """Half the samples in class ``dominant``: skewed class counts, as FedPAC's count-weighted
    centroids need; inputs are N(label, 1)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    y[: n // 2] = dominant
    x = (rng.normal(size=(n,) + SHAPE) + y[:, None, None, None]).astype(np.float32)
    return ClientData(x[:32], y[:32], x[32:], y[32:], K)


def eval_features(model, x) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        f = model.encoder(x).double().numpy()
    model.train()
    return f


def fake_update(agent, rng, *, n=10, counts=None, centroids=None, h=None, v=0.1, head=None, body=None):
    counts = rng.integers(1, 5, K) if counts is None else np.asarray(counts)
    tensors = {f"stat/{k}": val for k, val in {
        "centroids": (rng.normal(size=(K, D)) if centroids is None else centroids).astype(np.float32),
        "counts": counts.astype(np.int64),
        "h": (rng.normal(size=(K, D)) if h is None else h).astype(np.float32),
        "v": np.array([v], np.float32),
    }.items()}
    tensors.update(body or {})
    tensors.update(head or {"head.weight": rng.normal(size=(K, D)).astype(np.float32),
                            "head.bias": rng.normal(size=K).astype(np.float32)})
    return ClientUpdate(agent, n, tensors)


def body_of(state, rng):
    """A random body of the shared parameters (variances kept non-negative, as any honest estimate)."""
    return {k: (np.abs(x) if k.endswith("running_var") else x).astype(v.dtype)
            for k, v in state.shared_params().items() for x in [rng.normal(size=v.shape)]}


# ---------------------------------------------------------------------- server: QP weights
def simplex_grid(step: int) -> np.ndarray:
    pts = [(i, j, step - i - j) for i in range(step + 1) for j in range(step + 1 - i)]
    return np.array(pts, dtype=np.float64) / step


@pytest.mark.parametrize("far", [False, True])
def test_qp_weights_match_brute_force_on_simplex(far):
    rng = np.random.default_rng(3)
    hs = rng.normal(size=(3, K, D)) * 0.3
    vs = np.array([0.4, 0.3, 0.5])
    if far:  # client 2 is very unlike client 0: its weight must be driven to 0
        hs[2] += 5.0
    p = collaboration_matrix(hs, vs, 0)
    # the matrix is diag(v) + D with D_jl = sum_k (h_0[k] - h_j[k]) . (h_0[k] - h_l[k])
    for j, m in itertools.product(range(3), repeat=2):
        want = sum(float((hs[0, k] - hs[j, k]) @ (hs[0, k] - hs[m, k])) for k in range(K)) + (vs[j] if j == m else 0)
        assert p[j, m] == pytest.approx(want, rel=1e-12, abs=1e-12)

    alpha = qp_weights(hs, vs, 0)
    assert alpha is not None and (alpha >= 0).all() and alpha.sum() == pytest.approx(1.0, abs=1e-12)
    grid = simplex_grid(400)
    obj = np.einsum("nj,jl,nl->n", grid, p, grid)
    best = grid[obj.argmin()]
    assert alpha @ p @ alpha <= obj.min() + 1e-9
    np.testing.assert_allclose(alpha, best, atol=0.01)
    if far:
        assert alpha[2] == 0.0
    else:
        assert (alpha > 0.05).all()  # an interior minimiser: the solver did real work


def test_small_weights_are_zeroed_and_renormalised():
    # Two nearly identical clients and one whose minimiser weight is tiny but positive.
    p = np.diag([1.0, 1.0, 1.0]) + 0.0
    p[2, 2] = 2000.0  # its optimal weight ~ 1/2000 * (1 / sum of inverses) < 1e-3
    raw = solve_simplex_qp(p)
    assert 0 < raw[2] < 1e-3
    hs = np.zeros((3, K, D))
    alpha = qp_weights(hs, np.diag(p), 0)
    assert alpha[2] == 0.0 and alpha.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(alpha[:2], [0.5, 0.5], atol=1e-6)


def test_non_psd_matrix_is_repaired_by_dropping_small_eigenvalues():
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    evals = np.array([-0.5, 0.005, 2.0])
    p = (q * evals) @ q.T
    fixed = repair_psd(p, 0.01)
    want = 2.0 * np.outer(q[:, 2], q[:, 2])  # only the eigenvalue >= 0.01 survives
    np.testing.assert_allclose(fixed, want, atol=1e-12)
    assert np.linalg.eigvalsh(fixed).min() > -1e-12
    psd = np.diag([0.3, 0.2, 0.005])  # PSD matrices are used as they are, small eigenvalues included
    np.testing.assert_array_equal(repair_psd(psd, 0.01), psd)
    # nothing above the floor: no repair possible
    assert repair_psd(np.diag([-0.2, 0.005, 0.001]), 0.01) is None


def test_server_repairs_non_psd_and_falls_back_to_local_head():
    method = create_method("fedpac", {})
    state = method.init_server(KIT.model(method))
    rng = np.random.default_rng(1)
    h = rng.normal(size=(K, D))
    # a negative variance statistic makes P indefinite for every client
    ups = [fake_update(a, rng, h=h + 0.1 * i, v=v) for i, (a, v) in enumerate([("a", -1.0), ("b", 0.2), ("c", 0.3)])]
    for u in ups:
        u.tensors.update(body_of(state, rng))
    new = method.server_step(state, ups, 0)
    assert new.extra["kept_local_head"] == []
    for a in "abc":
        alpha = np.array([new.extra["alphas"][a][b] for b in "abc"])
        assert (alpha >= 0).all() and alpha.sum() == pytest.approx(1.0)
        want = sum(al * u.tensors["head.weight"].astype(np.float64) for al, u in zip(alpha, ups))
        np.testing.assert_allclose(new.client_tensors[a]["head.weight"], want, rtol=1e-5, atol=1e-6)

    # P indefinite with no eigenvalue >= 0.01: every client keeps the head it uploaded
    ups = [fake_update(a, rng, h=h, v=v) for a, v in [("a", -1e-3), ("b", 1e-3), ("c", 2e-3)]]
    for u in ups:
        u.tensors.update(body_of(state, rng))
    new = method.server_step(state, ups, 0)
    assert new.extra["kept_local_head"] == ["a", "b", "c"] and new.extra["alphas"] == {}
    for u in ups:
        np.testing.assert_array_equal(new.client_tensors[u.agent_id]["head.bias"], u.tensors["head.bias"])


# ---------------------------------------------------------------------- server: centroids, body
def test_centroids_are_count_weighted_and_body_sample_weighted():
    method = create_method("fedpac", {})
    state = method.init_server(KIT.model(method))
    rng = np.random.default_rng(2)
    counts = [np.array([3, 0, 1]), np.array([1, 0, 4]), np.array([0, 0, 2])]
    ups = [fake_update(a, rng, n=n, counts=c) for a, n, c in zip("abc", (10, 30, 60), counts)]
    for u in ups:
        u.tensors.update(body_of(state, rng))
    new = method.server_step(state, ups, 0)

    cs = [u.tensors["stat/centroids"].astype(np.float64) for u in ups]
    want0 = (3 * cs[0][0] + 1 * cs[1][0]) / 4
    want2 = (1 * cs[0][2] + 4 * cs[1][2] + 2 * cs[2][2]) / 7
    np.testing.assert_allclose(new.global_tensors[CENTROIDS][0], want0, rtol=1e-6)
    np.testing.assert_allclose(new.global_tensors[CENTROIDS][2], want2, rtol=1e-6)
    np.testing.assert_array_equal(new.global_tensors[CENTROID_COUNTS], [4, 0, 7])
    key = next(iter(state.shared_params()))
    want_body = sum(n * u.tensors[key].astype(np.float64) for n, u in zip((10, 30, 60), ups)) / 100
    np.testing.assert_allclose(new.global_tensors[key], want_body, rtol=1e-5, atol=1e-6)
    json.dumps(new.extra)  # checkpointable


# ---------------------------------------------------------------------- server: prototype variant
def test_prototype_weighting_favours_head_that_classifies_client_centroids():
    method = create_method("fedpac", {"weighting": "prototype"})
    state = method.init_server(KIT.model(method))
    rng = np.random.default_rng(4)
    cent = np.zeros((K, D), np.float32)
    cent[np.arange(K), np.arange(K)] = 1.0  # client a's centroid of class k is e_k
    good = np.zeros((K, D), np.float32)
    good[np.arange(K), np.arange(K)] = 4.0  # scores class k highest on e_k
    bad = np.roll(good, 1, axis=0)  # scores the wrong class highest
    flat = np.zeros((K, D), np.float32)  # uniform prediction
    heads = {"a": flat, "b": good, "c": bad}
    ups = [fake_update(a, rng, centroids=cent if a == "a" else None, counts=[2, 3, 1] if a == "a" else None,
                       head={"head.weight": w, "head.bias": np.zeros(K, np.float32)}) for a, w in heads.items()]
    for u in ups:
        u.tensors.update(body_of(state, rng))
    new = method.server_step(state, ups, 0)

    alpha = new.extra["alphas"]["a"]
    assert alpha["b"] > alpha["a"] > alpha["c"]
    assert sum(alpha.values()) == pytest.approx(1.0)
    ce = {k: float(F.cross_entropy(torch.tensor(cent, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T,
                                   torch.arange(K))) for k, w in heads.items()}
    z = sum(np.exp(-c) for c in ce.values())
    for k in heads:
        assert alpha[k] == pytest.approx(np.exp(-ce[k]) / z, rel=1e-9)


# ---------------------------------------------------------------------- agent side
def test_statistics_match_direct_numpy_computation():
    method = create_method("fedpac", {})
    model = KIT.model(method)
    data = make_data(0).to_torch()
    state = method.init_server(model)
    method.receive(model, method.payload_for(state, "a"), KIT.ctx())
    f = eval_features(copy.deepcopy(model), data.x_train)  # the model the statistics must use
    y = data.y_train.numpy()
    res = method.local_update(model, data, KIT.ctx())

    n = len(y)
    h = np.zeros((K, D))
    v = 0.0
    for k in range(K):
        fk = f[y == k]
        if len(fk) == 0:
            continue
        p = len(fk) / n
        mu = fk.mean(0)
        h[k] = p * mu
        v += p * np.mean(np.sum(fk**2, 1)) - p**2 * mu @ mu
    v /= n
    np.testing.assert_allclose(res.upload["stat/h"], h, rtol=1e-5, atol=1e-7)
    assert float(res.upload["stat/v"][0]) == pytest.approx(v, rel=1e-5)
    np.testing.assert_array_equal(res.upload["stat/counts"], np.bincount(y, minlength=K))
    # centroids are taken after training, with the trained body
    f_after = eval_features(model, data.x_train)
    for k in range(K):
        np.testing.assert_allclose(res.upload["stat/centroids"][k], f_after[y == k].mean(0), rtol=1e-5, atol=1e-6)
    method.check_update(state, ClientUpdate("a", n, res.upload))


def test_head_phase_changes_only_head_and_body_phase_only_body():
    method = create_method("fedpac", {})
    model = KIT.model(method)
    data = make_data(1).to_torch()

    before = params_of(model)
    method.head_phase(model, data, KIT.ctx())
    mid = params_of(model)
    for k in before:
        assert torch.equal(before[k], mid[k]) != k.startswith("head."), k
    targets = np.random.default_rng(0).normal(size=(K, D))
    method.body_phase(model, data, KIT.ctx(), targets)
    after = params_of(model)
    for k in before:
        assert torch.equal(mid[k], after[k]) == k.startswith("head."), k
    assert all(p.requires_grad for p in model.parameters())  # the freeze is undone


def _train_with(lam, payload_centroids, seed=0):
    method = create_method("fedpac", {"lam": lam})
    model = KIT.model(method, seed)
    data = make_data(5).to_torch()
    payload = method.payload_for(method.init_server(model), "a")
    if payload_centroids is not None:
        payload[CENTROIDS], payload[CENTROID_COUNTS] = payload_centroids
    method.receive(model, payload, KIT.ctx())
    res = method.local_update(model, data, KIT.ctx(7, epochs=3))
    return model, data, res


def test_centroid_alignment_off_in_round_zero_and_on_afterwards():
    # round 0: the payload has no centroids, so lambda makes no difference at all
    m0, _, r0 = _train_with(0.0, None)
    m1, _, r1 = _train_with(100.0, None)
    assert r0.metrics["aligned"] == r1.metrics["aligned"] == 0.0
    for (k, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        assert torch.equal(a, b), k

    # later rounds: a large lambda pulls the features towards the global centroids
    # (5, not more: with SGD lr 0.01 a far larger weight diverges and kills the ReLUs)
    c = np.random.default_rng(9).uniform(0.5, 1.5, size=(K, D)).astype(np.float32)
    received = (c, np.array([5, 5, 5]))
    dist = {}
    for lam in (0.0, 5.0):
        model, data, res = _train_with(lam, received)
        assert res.metrics["aligned"] == 1.0
        f = eval_features(model, data.x_train)
        dist[lam] = float(np.mean(np.sum((f - c[data.y_train.numpy()]) ** 2, 1)))
    assert dist[5.0] < 0.25 * dist[0.0], dist


def test_class_missing_globally_is_aligned_to_local_centroid():
    local = np.arange(K * D, dtype=np.float64).reshape(K, D)
    glob = -np.ones((K, D), np.float32)
    t = alignment_targets((glob, np.array([4, 0, 2])), local)
    np.testing.assert_array_equal(t[[0, 2]], glob[[0, 2]])
    np.testing.assert_array_equal(t[1], local[1])
    assert alignment_targets(None, local) is None


# ---------------------------------------------------------------------- one federation round trip
def test_two_rounds_deliver_combined_heads_and_centroids():
    method = create_method("fedpac", {})
    models = {a: KIT.model(method, i) for i, a in enumerate("ab")}
    datas = {a: make_data(10 + i, dominant=i).to_torch() for i, a in enumerate("ab")}
    state = method.init_server(models["a"])
    assert CENTROIDS not in method.payload_for(state, "a")
    for rnd in range(2):
        ups = []
        for a in "ab":
            ctx = KIT.ctx(rnd, round=rnd)
            method.receive(models[a], method.payload_for(state, a), ctx)
            res = method.local_update(models[a], datas[a], ctx)
            assert res.metrics["aligned"] == float(rnd > 0)
            u = ClientUpdate(a, datas[a].num_train, res.upload)
            method.check_update(state, u)
            ups.append(u)
        state = method.server_step(state, ups, rnd)
        state = ServerState.from_flat(state.to_flat(), json.loads(json.dumps(state.extra)))  # checkpoint

    payload = method.payload_for(state, "b")
    assert {CENTROIDS, CENTROID_COUNTS, "head.weight", "head.bias"} <= set(payload)
    alpha = state.extra["alphas"]["b"]
    want = sum(alpha[u.agent_id] * u.tensors["head.weight"].astype(np.float64) for u in ups)
    np.testing.assert_allclose(payload["head.weight"], want, rtol=1e-5, atol=1e-6)
    method.receive(models["b"], payload, KIT.ctx())
    np.testing.assert_array_equal(models["b"].head.weight.detach().numpy(), payload["head.weight"])
    # the personal head is uploaded for the server but never part of the averaged body
    assert not any(k.startswith("head.") for k in state.shared_params())

    bad = ClientUpdate("a", 10, {k: v for k, v in ups[0].tensors.items() if k != "head.bias"})
    with pytest.raises(UpdateRejected):
        method.check_update(state, bad)
