"""The aggregation contract, over every rule: each row of ``RULES`` (what a config may name)
and the two rules a round may put in its place (``GaussianMean``, ``SecureMean``).

A new row of ``RULES`` is in every test here without a line of this file; what a rule does
beyond the contract (robustness, privacy, exactness at scale) is its own unit test's.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from edgepfl.aggregation import (
    RULES,
    AggregationRejected,
    AggregationSpec,
    Aggregator,
    CenteredClip,
    GaussianMean,
    Mean,
    MultiKrum,
    SecureMean,
    grid_contribution,
    ring_vector,
    round_rule,
)
from edgepfl.config import ConfigError, RunConfig, parse_config
from edgepfl.privacy import PrivacySpec
from edgepfl.protocol.secagg import MASKED_TENSOR

Tensors = dict[str, np.ndarray]


def reference() -> Tensors:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.normal(0, 0.1, (4, 1, 3, 3)).astype(np.float32),
        "bn.running_mean": rng.normal(0, 1.0, 4).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 2.0, 4).astype(np.float32),
        "bn.num_batches_tracked": np.array(7, np.int64),
        "head.scale": rng.normal(0, 1.0, 16),  # float64: the last bits an order-dependent sum would change
    }


def updates(ref: Tensors, n: int, seed: int = 1) -> list[Tensors]:
    """``n`` honest updates around ``ref`` (a variance stays a variance; the count grows)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        update = {}
        for key, value in ref.items():
            if value.dtype.kind != "f":
                update[key] = value + 3
                continue
            moved = value + rng.normal(0, 0.01, value.shape)
            update[key] = (np.abs(moved) if key.endswith("running_var") else moved).astype(value.dtype)
        out.append(update)
    return out


@dataclass
class Case:
    """How the contract drives one rule: a fresh rule for a round of ``n`` updates, what one
    update is as the rule takes it, and how a round is closed."""

    make: Callable[[int], Aggregator]
    #: integer tensors keep the reference's value (a mean of counts is not private)
    keeps_integers: bool = False

    def add(self, rule: Aggregator, update: Tensors, weight: int = 1) -> None:
        rule.add(update, weight)

    def close(self, rule: Aggregator) -> Tensors:
        return rule.result()


class SecureCase(Case):
    """A secure round: each update is masked on the exact grid (as an agent does) with a mask
    of its own, and the masks are taken off the round's sum before it closes (as the
    survivors' reveals let the coordinator do)."""

    def __init__(self) -> None:
        super().__init__(lambda n: SecureMean())
        self.masks: np.ndarray | np.uint64 = np.uint64(0)  # the sum of the round's masks, modulo 2**64

    def add(self, rule: Aggregator, update: Tensors, weight: int = 1) -> None:
        vector = ring_vector(grid_contribution(update, rule.reference_, weight), rule.reference_)
        mask = np.random.default_rng(rule.count_).integers(0, 2**64, vector.size, dtype=np.uint64, endpoint=False)
        rule.add({MASKED_TENSOR: (vector + mask).view(np.int64)}, weight)
        self.masks = self.masks + mask

    def close(self, rule: Aggregator) -> Tensors:
        assert isinstance(rule, SecureMean)
        rule.unmask(rule.masked_sum_ - self.masks)
        self.masks = np.uint64(0)
        return rule.result()


def cases() -> dict[str, Callable[[], Case]]:
    # each config rule as the config builds it (its default update bound included)
    table: dict[str, Callable[[], Case]] = {
        name: (lambda name=name: Case(lambda n: AggregationSpec(rule=name).build())) for name in RULES}
    # central DP with a clip no honest change reaches and no noise: the plain unweighted mean
    table["gaussian_mean"] = lambda: Case(lambda n: GaussianMean(1e6, 0.0, n, 0), keeps_integers=True)
    table["secure_mean"] = SecureCase
    return table


CASES = cases()


@pytest.fixture(params=sorted(CASES))
def case(request) -> Case:
    return CASES[request.param]()


def run(case: Case, updates_: list[Tensors], weights: list[int] | None = None) -> Tensors:
    ref = reference()
    rule = case.make(len(updates_))
    rule.begin(ref)
    for update, weight in zip(updates_, weights or [1] * len(updates_)):
        case.add(rule, update, weight)
    return case.close(rule)


def same_bits(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def test_the_rules_a_config_accepts_are_the_rows_of_the_table():
    assert typing.get_args(AggregationSpec.model_fields["rule"].annotation) == (*RULES, "auto")
    for name, row in RULES.items():
        config = parse_config(RunConfig, {"aggregation": {"rule": name}}, "x.yaml")
        assert type(config.aggregation.build()) is row.build
        assert set(row.options) <= set(AggregationSpec.model_fields)
    with pytest.raises(ConfigError, match="aggregation.rule"):
        parse_config(RunConfig, {"aggregation": {"rule": "no_such_rule"}}, "x.yaml")


def test_a_round_closes_with_finite_tensors_of_the_references_keys_shapes_and_dtypes(case):
    ref = reference()
    got = run(case, updates(ref, 5))
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        assert np.isfinite(got[key]).all(), key


def test_identical_updates_aggregate_to_that_update(case):
    ref = reference()
    update = updates(ref, 1)[0]
    got = run(case, [update] * 5, [3, 1, 4, 1, 5])
    for key, value in ref.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(got[key], update[key], rtol=0, atol=1e-6, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value if case.keeps_integers else update[key], err_msg=key)


def test_weights_weigh_in_a_weighted_rule_and_nowhere_else(case):
    ref = reference()
    a, b = updates(ref, 2)
    rule = case.make(2)
    got = run(case, [a, b], [3, 1])
    if rule.weighted:
        for key, value in ref.items():
            if value.dtype.kind == "f":
                expected = (3 * a[key].astype(np.float64) + b[key]) / 4
                np.testing.assert_allclose(got[key], expected, rtol=0, atol=1e-6, err_msg=key)
    else:
        assert same_bits(got, run(case, [a, b], [1, 1]))


def test_the_result_is_the_same_bits_in_any_order_of_arrival(case):
    ref = reference()
    batch = updates(ref, 6)
    weights = [1, 2, 3, 1, 2, 3]
    first = run(case, batch, weights)
    for seed in range(3):
        order = np.random.default_rng(seed).permutation(len(batch))
        assert same_bits(first, run(case, [batch[i] for i in order], [weights[i] for i in order]))


def refused(case: Case) -> list[Tensors]:
    """Updates the rule must refuse: not finite (in the clear), or not the round's shape."""
    ref = reference()
    if isinstance(case, SecureCase):
        size = sum(v.size for v in ref.values())
        return [{MASKED_TENSOR: np.full(size, np.nan)}, {MASKED_TENSOR: np.zeros(size - 1, np.int64)},
                {k: v for k, v in ref.items()}]
    nan, inf = updates(ref, 2, seed=3)
    nan["conv.weight"][0, 0, 0, 0] = np.nan
    inf["head.scale"][3] = -np.inf
    return [nan, inf, {k: v for k, v in ref.items() if k != "head.scale"}]


def test_a_refused_update_is_refused_with_a_reason_and_leaves_the_round_as_it_was(case):
    ref = reference()
    a, b = updates(ref, 2)
    clean = run(case, [a, b], [2, 1])
    rule = case.make(2)
    rule.begin(ref)
    case.add(rule, a, 2)
    for bad in refused(case):
        with pytest.raises(AggregationRejected) as err:
            rule.add(bad, 1)
        assert err.value.reason in {"non_finite", "wrong_shape", "wrong_tensors"}
        assert rule.count_ == 1
    case.add(rule, b, 1)
    assert rule.count_ == 2
    assert same_bits(case.close(rule), clean)


def test_a_rule_begun_again_forgets_the_last_round(case):
    ref = reference()
    earlier, later = updates(ref, 3, seed=5), updates(ref, 3, seed=6)
    rule = case.make(3)
    for batch in (earlier, later):
        rule.begin(ref)
        for update in batch:
            case.add(rule, update, 2)
        assert rule.count_ == 3
        got = case.close(rule)
    assert same_bits(got, run(case, later, [2, 2, 2]))


def test_a_round_without_updates_has_no_result(case):
    rule = case.make(1)
    rule.begin(reference())
    with pytest.raises((RuntimeError, AggregationRejected)):
        case.close(rule)


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_round_in_the_clear_without_privacy_gets_the_configured_rule(name):
    rule = round_rule(AggregationSpec(rule=name), PrivacySpec(), secure=False, sampled=4, clip=1.0, noise_seed=0)
    assert type(rule) is RULES[name].build and rule.bound is not None


def test_the_default_rule_is_robust_for_an_enrolled_fleets_small_rounds_and_the_mean_otherwise():
    """``aggregation.rule: auto``: one enrolled device is one vote, so an enrolled fleet's
    rounds of 3 to 64 updates get the centered clip; an unsigned
    fleet (anyone may send as any device), a round of one or two, a large round, secure
    aggregation and differential privacy get the mean (or their own rule); a named rule is kept."""
    auto = AggregationSpec()
    assert auto.rule == "auto"

    def chosen(spec=auto, privacy=None, secure=False, **kw):
        return type(round_rule(spec, privacy or PrivacySpec(), secure=secure, sampled=kw.pop("sampled", 4), clip=1.0, noise_seed=0,
                               **kw))

    assert chosen(enrolled=True) is CenteredClip and chosen(enrolled=True, sampled=64) is CenteredClip
    assert chosen(enrolled=True, sampled=200, updates=10) is CenteredClip  # a buffered state of 10 updates
    assert chosen() is Mean and chosen(enrolled=True, sampled=2) is Mean and chosen(enrolled=True, sampled=65) is Mean
    assert chosen(enrolled=True, secure=True) is SecureMean
    assert chosen(privacy=PrivacySpec(mechanism="central", clip_norm=0.5), enrolled=True) is GaussianMean
    assert chosen(AggregationSpec(rule="mean"), enrolled=True) is Mean
    assert chosen(AggregationSpec(rule="multi_krum"), enrolled=False) is MultiKrum


def test_privacy_and_secure_aggregation_put_their_rule_in_the_rounds_place():
    mean = AggregationSpec()
    central = round_rule(mean, PrivacySpec(mechanism="central", clip_norm=0.5), secure=False, sampled=9, clip=0.25,
                         noise_seed=[3])
    assert isinstance(central, GaussianMean) and (central.clip_norm, central.denominator) == (0.25, 9)
    assert central.bound is not None and central.bound.ratio is None and central.bound.vs_median is None
    clear_secure = round_rule(mean, PrivacySpec(), secure=True, sampled=9, clip=1.0, noise_seed=0)
    assert isinstance(clear_secure, SecureMean) and clear_secure.denominator is None
    distributed = round_rule(mean, PrivacySpec(mechanism="distributed"), secure=True, sampled=9, clip=1.0,
                             noise_seed=0)
    assert isinstance(distributed, SecureMean) and distributed.denominator == 9
    assert not isinstance(round_rule(mean, PrivacySpec(), secure=False, sampled=9, clip=1.0, noise_seed=0),
                          (GaussianMean, SecureMean))
    assert type(round_rule(mean, PrivacySpec(), secure=False, sampled=9, clip=1.0, noise_seed=0)) is Mean
