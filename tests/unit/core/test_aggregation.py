"""Aggregation rules: exact order independence for streaming rules, robustness for the
robust ones, and refusal of updates no rule should average (the hostile-fleet attacks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepfl.aggregation import (
    DEFAULT_MAX_VARIANCE_GROWTH,
    DEFAULT_MAX_WEIGHT_RATIO,
    VARIANCE_RANGE,
    AggregationRejected,
    AggregationSpec,
    CenteredClip,
    CoordinateMedian,
    Mean,
    MultiKrum,
    NormClippedMean,
    OwnRecord,
    TrimmedMean,
    UpdateBound,
    capped_accuracy,
    change_range,
    variance_keys,
    weight_cap,
)

RULES = ["mean", "clipped_mean", "median", "trimmed_mean", "multi_krum", "centered_clip"]


def reference(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "encoder.conv.weight": rng.normal(0, 0.1, (8, 1, 3, 3)).astype(np.float32),
        "encoder.bn.running_mean": rng.normal(0, 1.0, 8).astype(np.float32),
        "encoder.bn.running_var": rng.uniform(0.5, 2.0, 8).astype(np.float32),
        "head.bias": np.zeros(10, np.float32),
        # float64 keeps the last bits that a float32 cast would round away: an
        # order-dependent float sum shows up here
        "head.scale": rng.normal(0, 1.0, 64),
    }


def honest(ref, rng, n: int, spread: float = 0.01) -> list[dict[str, np.ndarray]]:
    """``n`` updates around ``ref``; a variance stays a variance (>= 0), as any honest estimate."""
    def noisy(key, value):
        moved = value + rng.normal(0, spread, value.shape)
        return (np.abs(moved) if key.endswith("running_var") else moved).astype(value.dtype)

    return [{k: noisy(k, v) for k, v in ref.items()} for _ in range(n)]


def aggregate(rule, ref, updates, weights):
    rule.begin(ref)
    for u, w in zip(updates, weights):
        rule.add(u, w)
    return rule.result()


@pytest.mark.parametrize("name", RULES)
def test_twenty_five_arrival_orders_give_identical_bits(name):
    rng = np.random.default_rng(1)
    ref = reference(rng)
    updates = honest(ref, rng, 12, spread=0.05)
    weights = rng.integers(1, 5000, len(updates)).tolist()
    want = aggregate(AggregationSpec(rule=name).build(), ref, updates, weights)
    for seed in range(25):
        order = np.random.default_rng(seed).permutation(len(updates))
        got = aggregate(AggregationSpec(rule=name).build(), ref, [updates[i] for i in order],
                        [weights[i] for i in order])
        for key in ref:
            assert got[key].tobytes() == want[key].tobytes(), (name, seed, key)
            assert got[key].dtype == ref[key].dtype


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), scale=st.floats(1e-4, 10.0))
def test_the_mean_is_exact_to_float32_and_order_free(seed, n, scale):
    rng = np.random.default_rng(seed)
    ref = {k: (v * scale).astype(np.float32) for k, v in reference(rng).items()}
    updates = honest(ref, rng, n, spread=0.3 * scale)
    weights = rng.integers(1, 60_000, n).tolist()
    got = aggregate(Mean(), ref, updates, weights)
    back = aggregate(Mean(), ref, updates[::-1], weights[::-1])
    w = np.asarray(weights, np.float64) / sum(weights)
    for key in ref:
        want = sum(wi * u[key].astype(np.float64) for wi, u in zip(w, updates))
        # float32 tensors to their own precision; float64 ones to the fixed-point grid (~1e-10)
        np.testing.assert_allclose(got[key], want, rtol=2e-7, atol=1e-9 * max(1.0, 5 * scale))
        assert got[key].tobytes() == back[key].tobytes()


def test_mean_of_identical_updates_is_that_update():
    rng = np.random.default_rng(2)
    ref = reference(rng)
    update = honest(ref, rng, 1)[0]
    got = aggregate(Mean(), ref, [update] * 5, [3, 1, 4, 1, 5])
    for key in ref:
        if ref[key].dtype == np.float32:
            np.testing.assert_array_equal(got[key], update[key])
        else:
            np.testing.assert_allclose(got[key], update[key], rtol=0, atol=1e-9)


@pytest.mark.parametrize("attack", ["scaled_1e6", "nan", "inf"])
def test_an_update_no_rule_should_average_is_refused_with_a_reason(attack):
    rng = np.random.default_rng(3)
    ref = reference(rng)
    bad = honest(ref, rng, 1)[0]
    if attack == "scaled_1e6":
        bad = {k: v * 1e6 for k, v in bad.items()}
        reason = "out_of_range"
    else:
        bad["head.bias"][0] = np.nan if attack == "nan" else np.inf
        reason = "non_finite"
    for name in RULES:
        rule = AggregationSpec(rule=name).build()  # the default update bound refuses x1e6 whatever the rule
        rule.begin(ref)
        with pytest.raises(AggregationRejected) as err:
            rule.add(bad, 1)
        assert err.value.reason == reason
        rule.add(honest(ref, rng, 1)[0], 1)  # and the round goes on
        assert all(np.isfinite(v).all() for v in rule.result().values())


def test_weights_must_be_positive_integers_and_bounded():
    rng = np.random.default_rng(4)
    ref = reference(rng)
    rule = Mean()
    rule.begin(ref)
    for weight in (0, -3, 2.5, 10**300):
        with pytest.raises(AggregationRejected):
            rule.add(honest(ref, rng, 1)[0], weight)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["clipped_mean", "median", "trimmed_mean", "multi_krum"])
@pytest.mark.parametrize("attack", ["sign_flip_x10", "random"])
def test_two_attackers_of_eight_barely_move_a_robust_rule(name, attack):
    rng = np.random.default_rng(5)
    ref = reference(rng)
    good = honest(ref, rng, 6, spread=0.01)
    target = aggregate(Mean(), ref, good, [1] * 6)
    if attack == "sign_flip_x10":
        bad = [{k: (ref[k] - 10 * (target[k] - ref[k]) - 0.5).astype(ref[k].dtype) for k in ref} for _ in range(2)]
    else:
        # noise, with variances an attacker keeps positive (a negative one is refused outright)
        bad = [{k: np.abs(x) if k.endswith("running_var") else x
                for k, x in ((k, rng.normal(0, 3, v.shape).astype(v.dtype)) for k, v in ref.items())} for _ in range(2)]
    spec = AggregationSpec(rule=name, clip_ratio=0.05, trim_fraction=0.25, krum_byzantine=2)  # sized for f = 2
    robust = aggregate(spec.build(), ref, good + bad, [1] * 8)
    plain = aggregate(Mean(), ref, good + bad, [1] * 8)
    err_robust = sum(float(np.abs(robust[k] - target[k]).max()) for k in ref)
    err_plain = sum(float(np.abs(plain[k] - target[k]).max()) for k in ref)
    assert err_robust < 0.25 * err_plain, (err_robust, err_plain)


def test_clipped_mean_equals_mean_when_nothing_is_clipped_and_bounds_one_update():
    rng = np.random.default_rng(6)
    ref = reference(rng)
    updates = honest(ref, rng, 4, spread=1e-3)
    loose = NormClippedMean(clip_ratio=100.0)
    got = aggregate(loose, ref, updates, [5, 6, 7, 8])
    want = aggregate(Mean(), ref, updates, [5, 6, 7, 8])
    assert loose.clipped_ == 0
    for key in ref:
        assert got[key].tobytes() == want[key].tobytes()
    huge = {k: (v + 50.0).astype(v.dtype) for k, v in ref.items()}
    tight = NormClippedMean(clip_ratio=0.1)
    out = aggregate(tight, ref, [huge], [1])
    moved = np.sqrt(sum(float(np.sum((out[k].astype(np.float64) - ref[k]) ** 2)) for k in ref))
    bound = 0.1 * np.sqrt(sum(float(np.sum(ref[k].astype(np.float64) ** 2)) for k in ref))
    assert tight.clipped_ == 1 and moved == pytest.approx(bound, rel=1e-5)


def test_trimmed_mean_always_trims_and_median_of_three_is_the_middle():
    rng = np.random.default_rng(7)
    ref = reference(rng)
    updates = honest(ref, rng, 4)
    # 0.2 of 4 is no whole update: the rule still cuts one from each end (the red team's
    # trimmed mean at 0.2 trimmed nothing with fewer than 5 updates)
    got = aggregate(TrimmedMean(0.2), ref, updates, [1] * 4)
    for key in ref:
        middle = np.sort(np.stack([u[key].astype(np.float64) for u in updates]), axis=0)[1:3].mean(axis=0)
        np.testing.assert_allclose(got[key], middle.astype(ref[key].dtype), rtol=1e-6)
    with pytest.raises(ValueError):
        AggregationSpec(rule="trimmed_mean", trim_fraction=0.0)
    with pytest.raises(ValueError):
        AggregationSpec(rule="multi_krum", krum_byzantine=0)
    a, b, c = ({k: np.full_like(v, x) for k, v in ref.items()} for x in (1.0, 2.0, 7.0))
    med = aggregate(CoordinateMedian(), ref, [c, a, b], [1, 1, 1])
    assert all((v == 2.0).all() for v in med.values())


def test_multi_krum_drops_the_outlier():
    rng = np.random.default_rng(8)
    ref = reference(rng)
    good = honest(ref, rng, 5, spread=0.01)
    outlier = {k: (v + 5.0).astype(v.dtype) for k, v in ref.items()}
    got = aggregate(MultiKrum(byzantine=1, select=4), ref, good + [outlier], [1] * 6)
    assert all(float(np.abs(got[k] - ref[k]).max()) < 0.1 for k in ref)


def test_result_without_updates_is_an_error_not_a_silent_reference():
    rule = Mean()
    rule.begin(reference(np.random.default_rng(9)))
    with pytest.raises(RuntimeError):
        rule.result()


def test_a_round_may_carry_more_total_weight_than_one_update_and_stays_exact_and_order_free():
    """The refusal of a heavy update depends on that update alone (its own weight), never on
    how much weight arrived before it: a thousand devices of 60,000 samples each fit one round."""
    from edgepfl.aggregation import MAX_UPDATE_WEIGHT

    rng = np.random.default_rng(10)
    ref = reference(rng)
    updates = honest(ref, rng, 8, spread=0.5)
    weights = [MAX_UPDATE_WEIGHT - i for i in range(8)]  # ~2**27 in all, far past one word's headroom
    want = aggregate(Mean(), ref, updates, weights)
    w = np.asarray(weights, np.float64) / sum(weights)
    for key in ref:
        exact = sum(wi * u[key].astype(np.float64) for wi, u in zip(w, updates))
        np.testing.assert_allclose(want[key], exact, rtol=2e-7, atol=1e-9)
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(8)
        got = aggregate(Mean(), ref, [updates[i] for i in order], [weights[i] for i in order])
        assert all(got[k].tobytes() == want[k].tobytes() for k in ref)
    rule = Mean()
    rule.begin(ref)
    with pytest.raises(AggregationRejected) as err:
        rule.add(updates[0], MAX_UPDATE_WEIGHT + 1)
    assert err.value.reason == "malformed"


# --------------------------------------------------------------------------- the bound on one update


def _change_norm(params, ref, keys) -> float:
    return float(np.sqrt(sum(np.sum((params[k].astype(np.float64) - ref[k]) ** 2) for k in keys)))


def _norm_of(ref, keys) -> float:
    return float(np.sqrt(sum(np.sum(ref[k].astype(np.float64) ** 2) for k in keys)))


PARAMETERS = ["encoder.conv.weight", "head.bias", "head.scale"]


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("action", ["clip", "reject"])
def test_the_update_bound_keeps_arrival_order_free_with_attackers_clipped_or_refused(name, action):
    rng = np.random.default_rng(11)
    ref = reference(rng)
    updates = honest(ref, rng, 9, spread=0.05)
    # attackers: three honest changes x121 (a variance grown 40-fold instead: it must stay positive)
    updates += [{k: (v * 40 if k.endswith("running_var") else v + 3.0 * (v - ref[k]) * 40).astype(v.dtype)
                 for k, v in u.items()} for u in updates[:3]]
    weights = rng.integers(1, 5000, len(updates)).tolist()
    spec = AggregationSpec(rule=name, max_update_ratio=0.3, max_variance_growth=20, on_large_update=action)

    def run(order):
        rule = spec.build()
        rule.begin(ref)
        refused = 0
        for i in order:
            try:
                rule.add(updates[i], weights[i])
            except AggregationRejected as exc:
                assert exc.reason == "out_of_range"
                refused += 1
        return rule, refused, rule.result()

    first, refused, want = run(range(len(updates)))
    assert (first.bound_clipped_, refused) == ((3, 0) if action == "clip" else (0, 3))
    for seed in range(25):
        _, _, got = run(np.random.default_rng(seed).permutation(len(updates)))
        for key in ref:
            assert got[key].tobytes() == want[key].tobytes(), (name, action, seed, key)


def test_a_change_past_the_fleet_multiple_is_clipped_onto_it_never_refused_and_the_median_is_the_adopted_one():
    rng = np.random.default_rng(21)
    ref = reference(rng)
    updates = honest(ref, rng, 5, spread=0.01)
    norms = sorted(_change_norm(u, ref, PARAMETERS) for u in updates)
    typical = norms[2]
    # an attacker: an honest change x100, far inside the model-relative bound (ratio 10)
    attacker = {k: (v if k in STATISTICS else ref[k] + 100 * (v - ref[k])).astype(v.dtype)
                for k, v in updates[0].items()}
    assert _change_norm(attacker, ref, PARAMETERS) < 10 * max(1.0, _norm_of(ref, PARAMETERS))
    for action in ("reject", "clip"):
        rule = AggregationSpec(on_large_update=action, max_update_vs_median=3).build()
        rule.begin(ref, typical)
        assert [rule.add(u, 100) for u in updates] == [()] * 5  # honest changes: within 3 x their median
        assert rule.add(attacker, 100) == ("max_update_vs_median",)  # clipped (naming its bound), not refused
        assert rule.change_norms_[-1] == pytest.approx(3 * typical, rel=1e-12)
        assert max(rule.change_norms_[:5]) < 3 * typical
        # the median of what was adopted: the attacker, one of six, cannot move it past the honest ones
        assert norms[2] <= rule.median_change() <= norms[3]
        result = rule.result()
        moved = _change_norm(result, ref, PARAMETERS)
        assert moved <= (5 * norms[-1] + 3 * typical) / 6 + 1e-9


def test_a_late_updates_change_is_judged_and_recorded_as_trained_not_as_discounted():
    """Buffered rounds fold most updates in late, their changes discounted by staleness. The
    relative bound judges and records the change as the device trained it: recorded
    discounted, a state's median was a fraction of any device's training, and every fresh
    update of a fast device was clipped as a jump (6-7 % of honest FedRep updates, #52)."""
    rng = np.random.default_rng(22)
    ref = reference(rng)
    updates = honest(ref, rng, 5, spread=0.01)
    typical = sorted(_change_norm(u, ref, PARAMETERS) for u in updates)[2]
    discount = 0.2  # (1 + 24) ** -0.5: 24 states late

    def discounted(u):
        return {k: (v if k in STATISTICS else ref[k] + discount * (v - ref[k])).astype(v.dtype) for k, v in u.items()}

    rule = AggregationSpec(max_update_vs_median=3).build()
    rule.begin(ref, typical)
    # late updates: within the bound as trained, recorded as trained
    assert [rule.add(discounted(u), 100, discount=discount) for u in updates[:4]] == [()] * 4
    assert rule.change_norms_ == pytest.approx([_change_norm(u, ref, PARAMETERS) for u in updates[:4]], rel=1e-6)
    # the next state's median is the fleet's training, so a fresh update is not a jump
    median = rule.median_change()
    assert median == pytest.approx(sorted(_change_norm(u, ref, PARAMETERS) for u in updates[:4])[1], rel=1e-6)
    rule.begin(ref, median)
    assert rule.add(updates[4], 100) == ()
    # a late update past the bound as trained is clipped onto it, discounted: it moves the
    # model by discount x 3 x the median, and is recorded as 3 x the median
    jump = {k: (v if k in STATISTICS else ref[k] + 50 * (v - ref[k])).astype(v.dtype) for k, v in updates[0].items()}
    assert rule.add(discounted(jump), 100, discount=discount) == ("max_update_vs_median",)
    assert rule.change_norms_[-1] == pytest.approx(3 * median, rel=1e-9)


def test_without_a_record_the_first_ratio_bounds_the_change_and_a_zero_median_bounds_nothing():
    rng = np.random.default_rng(22)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=0.05)[0]
    change = _change_norm(update, ref, PARAMETERS)
    for typical, first_ratio in ((None, None), (0.0, 0.01)):
        bound = UpdateBound(None, vs_median=2.0, first_ratio=first_ratio)
        bound.begin(ref, typical)
        out, clipped, (adopted, *_) = bound.apply(update)
        assert out is update and not clipped and adopted == pytest.approx(change)
    first = 0.5 * change / max(1.0, _norm_of(ref, PARAMETERS))  # half the change, as a ratio of the model's norm
    bound = UpdateBound(None, vs_median=2.0, first_ratio=first)
    bound.begin(ref, None)
    out, clipped, (adopted, *_) = bound.apply(update)
    assert clipped and adopted == pytest.approx(change / 2) == _change_norm(out, ref, PARAMETERS)
    bound = UpdateBound(None, vs_median=2.0)
    bound.begin(ref, change / 4)
    out, clipped, (adopted, *_) = bound.apply(update)
    assert clipped and adopted == pytest.approx(change / 2) == _change_norm(out, ref, PARAMETERS)


def test_an_update_a_rule_refuses_adds_no_norm_to_the_median():
    rng = np.random.default_rng(23)
    ref = reference(rng)
    good = honest(ref, rng, 1)[0]
    rule = AggregationSpec().build()
    rule.begin(ref, None)
    with pytest.raises(AggregationRejected):
        rule.add(good, 2**30)  # over MAX_UPDATE_WEIGHT: refused by the exact sum, after the bound
    assert rule.change_norms_ == [] and rule.median_change() is None
    rule.add(good, 1)
    assert rule.median_change() == pytest.approx(_change_norm(good, ref, PARAMETERS))


STATISTICS = ["encoder.bn.running_mean", "encoder.bn.running_var"]


def test_a_clipped_update_moves_the_parameters_onto_their_bound_and_honest_ones_pass_untouched():
    rng = np.random.default_rng(12)
    ref = reference(rng)
    bound = UpdateBound(0.5, "clip")
    bound.begin(ref)
    calm = honest(ref, rng, 1, spread=1e-3)[0]
    same, clipped, _ = bound.apply(calm)
    assert same is calm and not clipped
    huge = {k: (ref[k] + 1e6 * (v - ref[k])).astype(v.dtype) for k, v in calm.items()}
    out, clipped, _ = bound.apply(huge)
    assert clipped
    limit = 0.5 * max(1.0, _norm_of(ref, PARAMETERS))
    assert _change_norm(out, ref, PARAMETERS) == pytest.approx(limit, rel=1e-5)
    # the direction of the change is kept: the clipped change is parallel to the sent one
    sent = np.concatenate([(huge[k].astype(np.float64) - ref[k]).ravel() for k in PARAMETERS])
    kept = np.concatenate([(out[k].astype(np.float64) - ref[k]).ravel() for k in PARAMETERS])
    assert float(sent @ kept) / (np.linalg.norm(sent) * np.linalg.norm(kept)) == pytest.approx(1.0, abs=1e-6)


def _skewed_statistics(ref) -> dict[str, np.ndarray]:
    """What a device whose data is unlike the fleet's reports: channels its data never
    lights (variance ~0), channels moved by several standard deviations, a variance
    fifty times the fleet's. Far over a norm ratio of the global statistics."""
    mean, var = ref["encoder.bn.running_mean"].astype(np.float64), ref["encoder.bn.running_var"].astype(np.float64)
    new_mean = mean + 6.0 * np.sqrt(var) * np.where(np.arange(8) % 2, 1, -1)
    new_var = np.where(np.arange(8) < 4, var * 1e-6, var * 50.0)
    return {"encoder.bn.running_mean": new_mean.astype(np.float32), "encoder.bn.running_var": new_var.astype(np.float32)}


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_running_statistics_of_a_skewed_honest_device_pass_untouched(action):
    rng = np.random.default_rng(13)
    ref = reference(rng)
    update = {**honest(ref, rng, 1, spread=1e-3)[0], **_skewed_statistics(ref)}
    old_measure = _change_norm(update, ref, STATISTICS) / max(1.0, _norm_of(ref, STATISTICS))
    assert old_measure > 10  # the earlier global norm ratio refused this device
    bound = AggregationSpec(on_large_update=action).build().bound
    assert bound is not None
    bound.begin(ref)
    assert bound.apply(update)[:2] == (update, ())


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_a_running_mean_moved_past_its_bound_is_clamped_per_channel_never_refused(action):
    rng = np.random.default_rng(14)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=1e-3)[0]
    var = ref["encoder.bn.running_var"].astype(np.float64)
    scale = np.sqrt(var + np.median(var))  # the layer's median variance is the floor
    moved = ref["encoder.bn.running_mean"].astype(np.float64) + np.where(np.arange(8) == 3, -50.0, 1.0) * scale
    update["encoder.bn.running_mean"] = moved.astype(np.float32)
    bound = UpdateBound(10.0, action, mean_shift=20.0)
    bound.begin(ref)
    out, clipped, _ = bound.apply(update)
    assert clipped
    shift = (out["encoder.bn.running_mean"].astype(np.float64) - ref["encoder.bn.running_mean"]) / scale
    np.testing.assert_allclose(shift, np.where(np.arange(8) == 3, -20.0, 1.0), rtol=1e-5)
    assert all(out[k].tobytes() == update[k].tobytes() for k in ref if k != "encoder.bn.running_mean")


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_a_running_variance_grown_past_its_bound_is_clamped_and_shrinking_is_free(action):
    rng = np.random.default_rng(15)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=1e-3)[0]
    var = ref["encoder.bn.running_var"].astype(np.float64)
    limit = 20.0 * (var + np.median(var))
    assert (limit < var + 64 * var.max()).all()  # the bound, not the exact sums' range, is what holds here
    update["encoder.bn.running_var"] = np.where(np.arange(8) == 5, 2 * limit, var * 1e-9).astype(np.float32)
    bound = UpdateBound(10.0, action, variance_growth=20.0)
    bound.begin(ref)
    out, clipped, _ = bound.apply(update)
    assert clipped
    np.testing.assert_allclose(out["encoder.bn.running_var"], np.where(np.arange(8) == 5, limit, var * 1e-9), rtol=1e-6)
    assert all(out[k].tobytes() == update[k].tobytes() for k in ref if k != "encoder.bn.running_var")


def test_a_statistic_is_clamped_inside_the_range_the_exact_sums_take_so_a_streaming_rule_never_refuses_it():
    rng = np.random.default_rng(18)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=1e-3)[0]
    var = ref["encoder.bn.running_var"].astype(np.float64)
    span = VARIANCE_RANGE * max(1.0, var.max())  # a variance's range (PROTOCOL.md §19.3), 2**15 x the largest
    update["encoder.bn.running_var"] = (var + 4 * span).astype(np.float32)
    update["encoder.bn.running_mean"] = (ref["encoder.bn.running_mean"] + 1e4).astype(np.float32)
    for action in ("reject", "clip"):
        rule = AggregationSpec(rule="mean", on_large_update=action, max_mean_shift=1e6, max_variance_growth=1e8).build()
        rule.begin(ref)
        assert rule.add(update, 3) == ("max_mean_shift", "max_variance_growth")  # clamped, not refused
        moved = rule.result()["encoder.bn.running_var"].astype(np.float64) - var
        assert (moved <= span).all() and (moved > (1 - 2**-10) * span).all()


def test_a_running_variance_far_past_the_layers_largest_is_summed_as_it_came_not_clamped_or_refused():
    """An honest skewed device lights a channel the others barely do: measured at 364 against
    the layer's largest 5.6 (digits, Dirichlet 0.5, buffered, seed 0; benchmarks/results/
    honest_fleets.md). Within the default growth bound, such a variance is summed exactly as it
    came, with every bound and with none; the ranges of the other tensors stay 64 x theirs."""
    rng = np.random.default_rng(19)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=1e-3)[0]
    var = ref["encoder.bn.running_var"].astype(np.float64)
    high = 100 * max(1.0, var.max())  # past the 64 x that was the range before protocol 1.17
    update["encoder.bn.running_var"] = np.where(np.arange(var.size) == 3, high, var).astype(np.float32)
    assert high < DEFAULT_MAX_VARIANCE_GROWTH * (var[3] + np.median(var))  # what the default bound keeps
    for spec in (AggregationSpec(rule="mean"), AggregationSpec(rule="mean", max_update_ratio=None,
                                                               max_update_vs_median=None, max_mean_shift=None,
                                                               max_variance_growth=None)):
        rule = spec.build()
        rule.begin(ref)
        assert rule.add(update, 1) == ()  # nothing fired
        np.testing.assert_allclose(rule.result()["encoder.bn.running_var"], update["encoder.bn.running_var"],
                                   rtol=1e-6)
    weight = next(k for k in PARAMETERS if ref[k].ndim > 1)
    assert change_range(ref[weight]) == 64 * max(1.0, float(np.abs(ref[weight]).max()))
    assert variance_keys(ref) == {"encoder.bn.running_var"}
    moved = {**honest(ref, rng, 1, spread=1e-3)[0]}
    moved[weight] = (ref[weight] + 65 * max(1.0, float(np.abs(ref[weight]).max()))).astype(ref[weight].dtype)
    rule = AggregationSpec(rule="mean", max_update_ratio=None, max_update_vs_median=None).build()
    rule.begin(ref)
    with pytest.raises(AggregationRejected, match="more than") as err:  # a weight past its range: refused as before
        rule.add(moved, 1)
    assert err.value.reason == "out_of_range"


def test_a_negative_variance_is_refused_by_every_rule_even_without_a_bound():
    rng = np.random.default_rng(16)
    ref = reference(rng)
    update = honest(ref, rng, 1, spread=1e-3)[0]
    update["encoder.bn.running_var"][2] = -1e-3
    for name in RULES:
        rule = AggregationSpec(rule=name, max_update_ratio=None, max_update_vs_median=None, max_mean_shift=None,
                               max_variance_growth=None).build()
        assert rule.bound is None
        rule.begin(ref)
        with pytest.raises(AggregationRejected, match="negative variance") as err:
            rule.add(update, 1)
        assert err.value.reason == "out_of_range"


def test_the_bound_stops_the_attacks_it_is_for_on_statistics_too():
    """x1e6 of an honest update, and an honest update x10 that pushes a variance below zero
    or a mean tens of deviations away, are refused by the default bound."""
    rng = np.random.default_rng(17)
    ref = reference(rng)
    update = {**honest(ref, rng, 1, spread=1e-3)[0], **_skewed_statistics(ref)}
    rule = AggregationSpec().build()
    for factor in (10.0, 1e6):
        attacked = {k: (ref[k] + factor * (v.astype(np.float64) - ref[k])).astype(v.dtype) for k, v in update.items()}
        rule.begin(ref)
        with pytest.raises(AggregationRejected) as err:
            rule.add(attacked, 1)
        assert err.value.reason == "out_of_range", factor


def test_integer_tensors_are_neither_measured_nor_scaled():
    rng = np.random.default_rng(14)
    ref = {**reference(rng), "encoder.bn.num_batches_tracked": np.array(7, np.int64)}
    bound = UpdateBound(0.1, "clip")
    bound.begin(ref)
    update = {k: (v * 1e3).astype(v.dtype) if v.dtype.kind == "f" else np.array(10**9, np.int64) for k, v in ref.items()}
    out, clipped, _ = bound.apply(update)
    assert clipped and int(out["encoder.bn.num_batches_tracked"]) == 10**9


def test_without_a_bound_the_robust_rules_take_a_huge_update_in_and_out_vote_it():
    rng = np.random.default_rng(15)
    ref = reference(rng)
    good = honest(ref, rng, 6, spread=0.01)
    huge = {k: (v * 1e6).astype(v.dtype) for k, v in good[0].items()}
    for name in ("median", "trimmed_mean", "multi_krum"):
        rule = AggregationSpec(rule=name, max_update_ratio=None, max_update_vs_median=None, max_mean_shift=None,
                               max_variance_growth=None).build()
        out = aggregate(rule, ref, good + [huge], [1] * 7)
        assert all(float(np.abs(out[k] - ref[k]).max()) < 0.1 for k in ref), name


def test_no_device_outweighs_ratio_times_the_lower_median_count():
    honest = [600, 540, 700]
    assert weight_cap([*honest, 2**24], 2.0) == 2 * 600  # one of four: the median stays honest
    assert weight_cap([600, 2**24], 2.0) == 1200  # one of two: the lower median is the honest one
    assert weight_cap([600, 2**24, 2**24], 2.0) == 2 * 2**24  # a majority moves it: nothing to be done
    assert weight_cap(honest, None) is None and weight_cap([], 2.0) is None
    assert weight_cap([0, 0, 1], 2.0) == 1  # never 0: every honest update keeps a weight
    # an honest device with 3x the data of most keeps the default cap's worth (cut, never refused)
    assert weight_cap([100, 100, 100, 300], DEFAULT_MAX_WEIGHT_RATIO) == DEFAULT_MAX_WEIGHT_RATIO * 100


def test_a_device_reporting_2_to_the_53_correct_answers_cannot_set_the_federations_accuracy():
    honest = [(45, 100), (50, 100), (55, 100)]
    inflated = [*honest, (2**53, 2**53)]
    uncapped = sum(c for c, _ in inflated) / sum(t for _, t in inflated)
    assert uncapped == pytest.approx(1.0)  # what the red team saw: 100.0 %
    capped = capped_accuracy(inflated, DEFAULT_MAX_WEIGHT_RATIO)
    cap = DEFAULT_MAX_WEIGHT_RATIO  # the liar weighs this many honest devices
    assert capped == pytest.approx((45 + 50 + 55 + cap * 100) / (300 + cap * 100))
    assert capped_accuracy(honest, DEFAULT_MAX_WEIGHT_RATIO) == pytest.approx(0.5)
    assert capped_accuracy(honest, None) == pytest.approx(0.5)
    assert capped_accuracy([(0, 0)], 2.0) is None


def test_a_device_is_judged_against_its_own_record_too_parameters_and_statistics_in_their_own_units():
    """Different is not hostile: a device whose own record shows large changes and large
    statistics is not clipped for repeating them; past vs_median times its record (and the
    fleet's median, and the defaults) it is, naming each bound; without a record the fleet
    alone judges it."""
    rng = np.random.default_rng(31)
    ref = reference(rng)
    base = honest(ref, rng, 1, spread=1e-3)[0]
    typical = 0.01
    update = {k: (ref[k] + 20 * typical / np.sqrt(ref[k].size * len(PARAMETERS)) * np.sign(v - ref[k] + 1e-12)
                  if k in PARAMETERS else v).astype(v.dtype) for k, v in base.items()}
    var = ref["encoder.bn.running_var"].astype(np.float64)
    scale = var + np.median(var)
    inside = var + (1 - 2**-16) * change_range(var, variance=True)  # the exact sums' range, a hard limit
    update["encoder.bn.running_var"] = np.full(8, 120.0, np.float32)  # past 50 x scale on some channels
    assert (120 > 50 * scale).any() and (120 < inside).all()
    change = _change_norm(update, ref, PARAMETERS)
    assert 15 * typical < change < 25 * typical  # far past 5 medians

    bound = AggregationSpec(max_variance_growth=50).build().bound  # a tighter clamp than the default's
    assert bound is not None
    bound.begin(ref, typical)
    out, fired, record = bound.apply(update)  # no record: the fleet alone
    assert fired == ("max_update_vs_median", "max_variance_growth")
    assert record.change == pytest.approx(5 * typical)
    assert record.statistics["encoder.bn."][1] == pytest.approx(float(np.max(np.minimum(120, 50 * scale))), rel=1e-6)

    own = OwnRecord(change, {"encoder.bn.": (0.0, 120.0)})  # it did this before
    out, fired, record = bound.apply(update, own)
    assert out is update and fired == () and record.change == pytest.approx(change)
    jumped = {**update, "encoder.bn.running_var": np.full(8, 1000.0, np.float32)}
    jumped.update({k: (ref[k] + 10 * (update[k] - ref[k])).astype(ref[k].dtype) for k in PARAMETERS})
    out, fired, record = bound.apply(jumped, own)  # ten times its own record: clipped onto 5 x it
    assert fired == ("max_update_vs_median", "max_variance_growth")
    assert record.change == pytest.approx(5 * change)
    np.testing.assert_allclose(out["encoder.bn.running_var"], np.minimum(np.maximum(50 * scale, 600), inside),
                               rtol=1e-6)


def test_a_record_is_kept_as_json_and_its_typical_value_is_the_largest_change_and_each_statistics_lower_median():
    records = [OwnRecord(3.0, {"bn.": (1.0, 9.0)}), OwnRecord(1.0, {"bn.": (5.0, 2.0)}),
               OwnRecord(2.0, {"bn.": (3.0, 4.0), "bn2.": (1.0, 1.0)})]
    kept = json.loads(json.dumps([r.to_json() for r in records]))
    assert OwnRecord.typical(kept) == OwnRecord(3.0, {"bn.": (3.0, 4.0), "bn2.": (1.0, 1.0)})
    # statistics: the lower of two, which one cannot raise; the change: the larger, so that a device
    # alternating small and large changes is judged by its large one
    assert OwnRecord.typical(kept[:2]) == OwnRecord(3.0, {"bn.": (1.0, 2.0)})
    assert OwnRecord.typical(kept[1:]) == OwnRecord(2.0, {"bn.": (3.0, 2.0), "bn2.": (1.0, 1.0)})
    assert OwnRecord.largest(records) == OwnRecord(3.0, {"bn.": (5.0, 9.0), "bn2.": (1.0, 1.0)})
    assert OwnRecord.typical([]) is None and OwnRecord.largest([]) is None


def test_centered_clip_takes_honest_updates_whole_and_lets_one_reversed_update_pull_a_bounded_way():
    """Three honest updates around a common change g and one that reverses it (-g): the
    coordinate-wise median is the centre, the reversed update is cut to one median distance
    from it, so the result moves from the honest mean by at most that distance over four;
    the mean goes a long way towards -g. Updates that are equally far from the median count
    whole: the result is their mean."""
    rng = np.random.default_rng(3)
    ref = {"w": np.zeros(400), "bn.running_mean": np.zeros(4), "bn.running_var": np.ones(4)}
    g = rng.normal(0, 1, 400)
    honest_updates = [{"w": g + rng.normal(0, 0.2, 400), "bn.running_mean": rng.normal(0, 0.1, 4),
                       "bn.running_var": np.ones(4)} for _ in range(3)]
    reversed_update = {"w": -g, "bn.running_mean": np.zeros(4), "bn.running_var": np.ones(4)}

    def close(rule, updates):
        rule.begin(ref)
        for u in updates:
            rule.add(u)
        return rule.result()

    everyone = honest_updates + [reversed_update]
    clipped, plain = close(CenteredClip(1.0), everyone), close(Mean(), everyone)
    honest_mean = np.mean([u["w"] for u in honest_updates], axis=0)
    centre = np.median(np.stack([u["w"] for u in everyone]), axis=0)
    typical = sorted(np.linalg.norm(u["w"] - centre) for u in everyone)[1]  # the lower median of four
    assert np.linalg.norm(clipped["w"] - centre) <= typical + 1e-9
    assert np.linalg.norm(clipped["w"] - honest_mean) < 0.3 * np.linalg.norm(plain["w"] - honest_mean)
    assert np.dot(clipped["w"], g) > 0.5 * np.dot(honest_mean, g) > 0  # still the honest direction
    np.testing.assert_array_equal(clipped["bn.running_mean"],
                                  np.median(np.stack([u["bn.running_mean"] for u in everyone]), axis=0))
    # four updates at one distance from their median (pairs mirrored around it): the mean
    mirrored = [{"w": g * s, "bn.running_mean": np.zeros(4), "bn.running_var": np.ones(4)} for s in (1, -1, 1, -1)]
    np.testing.assert_allclose(close(CenteredClip(1.0), mirrored)["w"], close(Mean(), mirrored)["w"], atol=1e-12)
