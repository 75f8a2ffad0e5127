"""Client-level differential privacy (edgepfl/privacy.py, aggregation.GaussianMean):
the noised mean bounds one device's influence by the clip, adds the noise it says in any
arrival order, and the accountant's ε is dp-accounting's for the mechanism as run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgepfl.aggregation import GaussianMean
from edgepfl.config import ConfigError, RunConfig, parse_config
from edgepfl.privacy import PrivacyAccountant, PrivacySpec

REFERENCE = {"w": np.linspace(-1, 1, 4000, dtype=np.float32).reshape(40, 100), "b": np.zeros(7, np.float32),
             "bn.num_batches_tracked": np.array(5, np.int64)}


def updates(n: int, scale: float = 0.05, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": (REFERENCE["w"] + rng.normal(0, scale, REFERENCE["w"].shape)).astype(np.float32),
             "b": rng.normal(0, scale, 7).astype(np.float32),
             "bn.num_batches_tracked": np.array(5 + i, np.int64)} for i in range(n)]


def aggregate(ups: list[dict], clip: float, sigma: float, denominator: int, seed: int = 1,
              weights: list[int] | None = None) -> dict[str, np.ndarray]:
    rule = GaussianMean(clip, sigma, denominator, [seed])
    rule.begin(REFERENCE)
    for i, u in enumerate(ups):
        rule.add(u, (weights or [1] * len(ups))[i])
    return rule.result()


def flat(tensors: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([tensors["w"].ravel(), tensors["b"]]).astype(np.float64)


def test_one_device_moves_the_noiseless_mean_by_at_most_the_clip_over_the_sample_whatever_it_sends():
    honest = updates(9)
    without = aggregate(honest[:8], clip=0.5, sigma=0.0, denominator=9)
    for attack in (1e3, -1e6):  # a device that sends anything at all, with any sample count
        evil = {"w": np.full_like(REFERENCE["w"], attack), "b": np.full(7, attack, np.float32),
                "bn.num_batches_tracked": np.array(10**6, np.int64)}
        with_it = aggregate([*honest[:8], evil], clip=0.5, sigma=0.0, denominator=9, weights=[1] * 8 + [2**20])
        assert np.linalg.norm(flat(with_it) - flat(without)) <= 0.5 / 9 * (1 + 1e-6)
        # integers are not averaged: the reference's counter stays
        assert with_it["bn.num_batches_tracked"] == REFERENCE["bn.num_batches_tracked"]


def test_the_noise_is_the_gaussian_it_says_drawn_once_the_same_in_any_order():
    ups = updates(6)
    quiet = flat(aggregate(ups, clip=0.1, sigma=0.0, denominator=6))
    noisy = [aggregate([ups[i] for i in np.random.default_rng(k).permutation(6)], clip=0.1, sigma=2.0, denominator=6)
             for k in range(24)]
    assert all(flat(n).tobytes() == flat(noisy[0]).tobytes() for n in noisy)  # any arrival order, bit for bit
    noise = (flat(noisy[0]) - quiet) * 6  # back to the sum's scale
    assert noise.std() == pytest.approx(2.0 * 0.1, rel=0.05)  # 4,007 draws: a 5 % band is about 3 standard errors
    assert abs(noise.mean()) < 4 * 0.2 / math.sqrt(noise.size)
    other = flat(aggregate(ups, clip=0.1, sigma=2.0, denominator=6, seed=2))
    assert not np.array_equal(other, flat(noisy[0]))  # another round's seed, other noise


def test_epsilon_is_dp_accountings_for_sampling_without_replacement_and_grows_with_rounds():
    import dp_accounting
    from dp_accounting import rdp

    spec = PrivacySpec(mechanism="central", noise_multiplier=1.1, delta=1e-5)
    accountant = PrivacyAccountant(spec)
    spent = [accountant.spend(50, 10) for _ in range(5)]
    assert spent == sorted(spent) and spent[0] > 0
    direct = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_accounting.SampledWithoutReplacementDpEvent(50, 10, dp_accounting.GaussianDpEvent(0.55)), 5)
    assert spent[-1] == pytest.approx(direct.get_epsilon(1e-5))
    # every device every round costs more than a tenth of them
    assert PrivacyAccountant(spec, [(50, 50)] * 5).epsilon() > spent[-1]
    # the budget: a round is allowed only while it keeps ε within it
    capped = PrivacyAccountant(spec.model_copy(update={"epsilon_budget": spent[2] + 1e-9}), [(50, 10)] * 2)
    assert capped.allows(50, 10)
    capped.spend(50, 10)
    assert not capped.allows(50, 10)
    assert PrivacyAccountant(spec.model_copy(update={"noise_multiplier": 0.0})).spend(5, 5) == math.inf


@pytest.mark.parametrize("bad, says", [({"aggregation": {"rule": "median"}}, "aggregation.rule must be mean"),
                                       ({"asynchrony": {"mode": "buffered"}}, "asynchrony.mode must be sync"),
                                       ({"method": {"name": "fedpac"}}, "fedpac shares statistics")])
def test_central_privacy_refuses_what_would_weaken_it(bad, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(RunConfig, {"privacy": {"mechanism": "central"}, **bad}, "x.yaml")


def test_under_central_privacy_no_late_update_is_folded_into_another_round():
    assert RunConfig(privacy={"mechanism": "central"}).staleness_limit == 0
    assert RunConfig().staleness_limit == 2


def test_the_noise_multiplier_for_a_budget_is_the_smallest_that_keeps_it(capsys):
    from edgepfl.cli import main
    from edgepfl.privacy import noise_multiplier_for

    multiplier = noise_multiplier_for(3.0, rounds=20, population=200, sampled=20)

    def spent(m: float) -> float:
        return PrivacyAccountant(PrivacySpec(mechanism="central", noise_multiplier=m), [(200, 20)] * 20).epsilon()

    assert spent(multiplier) <= 3.0 < spent(multiplier * 0.99)
    assert main(["privacy", "--epsilon", "3", "--rounds", "20", "--devices", "200", "--fraction", "0.1"]) == 0
    assert f"noise_multiplier: {multiplier:.4g}" in capsys.readouterr().out
    assert main(["privacy", "--epsilon", "-1", "--rounds", "20", "--devices", "200"]) == 2


@pytest.mark.parametrize("bad, says", [
    ({"aggregation": {"rule": "trimmed_mean"}}, "trimmed_mean needs every update; use mean"),
    ({"asynchrony": {"mode": "buffered"}}, "asynchrony.mode must be sync"),
    ({"method": {"name": "fedpac"}}, "fedpac's server step needs every update"),
    ({"privacy": {"mechanism": "central"}}, "clips each update at the coordinator; use distributed"),
    ({"compression": {"uplink": "q8"}}, "cannot be compressed"),
    ({"aggregation": {"max_update_vs_median": 3.0}}, r"per-update bounds cannot apply \(max_update_vs_median\)"),
    ({"min_agents": 2}, "min_agents must be at least 3"),
])
def test_secure_aggregation_refuses_what_needs_the_coordinator_to_see_one_update(bad, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(RunConfig, {"secure_aggregation": {"enabled": True}, "min_agents": 4, **bad}, "x.yaml")


def test_secure_aggregation_takes_the_defaults_and_bounds_set_to_null():
    """The per-update bounds' defaults do not stop a secure run (they cannot apply: the round's
    rule has none); set to null they are accepted, and no late update joins another round.
    ``max_update_ratio`` may be set: it judges each unmasked sum, and reaches the round's rule."""
    from edgepfl.aggregation import round_rule

    config = parse_config(RunConfig, {"secure_aggregation": {"enabled": True}, "min_agents": 4,
                                      "aggregation": {"max_update_ratio": 3.0, "max_change_ratio": 5.0}}, "x.yaml")
    rule = round_rule(config.aggregation, config.privacy, secure=True, sampled=4, clip=1.0, noise_seed=0)
    assert rule.max_update_ratio == 3.0
    config = parse_config(RunConfig, {"secure_aggregation": {"enabled": True}, "min_agents": 4,
                                      "aggregation": {"max_update_ratio": None, "max_change_ratio": 5.0}}, "x.yaml")
    assert config.staleness_limit == 0
    assert config.secure_aggregation.degree_for(6) == 5  # everyone, below default_degree's size
    assert config.secure_aggregation.degree_for(1000) == 198


def test_distributed_privacy_needs_secure_aggregation():
    with pytest.raises(ConfigError, match="distributed adds the noise on the devices.*secure_aggregation.enabled"):
        parse_config(RunConfig, {"privacy": {"mechanism": "distributed"}}, "x.yaml")
    parse_config(RunConfig, {"privacy": {"mechanism": "distributed"}, "secure_aggregation": {"enabled": True},
                             "min_agents": 4}, "x.yaml")


@pytest.mark.parametrize("z, share", [(1.0, 0.1), (0.7, 0.3), (4.0, 0.05)])
def test_adaptive_clipping_spends_what_one_gaussian_event_of_the_runs_multiplier_does(z, share):
    from edgepfl.privacy import AdaptiveClipSpec

    z_sum, count_noise = AdaptiveClipSpec(budget_share=share).noise(z)
    assert (z_sum / 2) ** -2 + count_noise ** -2 == pytest.approx((z / 2) ** -2)
    assert z_sum > z  # the sum pays for the count with a little more noise
    # Poisson rounds (add-or-remove): the sum's sensitivity is one clip, the count's still 1
    z_sum, count_noise = AdaptiveClipSpec(budget_share=share).noise(z, add_or_remove=True)
    assert z_sum ** -2 + count_noise ** -2 == pytest.approx(z ** -2)


def test_the_adaptive_clip_moves_towards_the_target_quantile_of_the_changes():
    """All changes within the clip: it shrinks by exp(-rate (1 - target)); all beyond: it
    grows by exp(rate target). The count's noise is drawn after the sum's, from the seed."""
    from edgepfl.aggregation import AdaptiveClip

    reference = {"w": np.zeros(16, np.float32)}

    def next_clip(norm: float, count_noise: float = 0.0) -> float:
        told: list[float] = []
        rule = GaussianMean(1.0, 0.0, 20, 7, AdaptiveClip(0.5, 0.2, count_noise), on_next_clip=told.append)
        rule.begin(reference)
        for i in range(20):
            rule.add({"w": np.full(16, norm / 4, np.float32) * (1 if i % 2 else -1)}, 1)
        rule.result()
        assert told == [rule.next_clip_]
        return rule.next_clip_

    assert next_clip(0.5) == pytest.approx(math.exp(-0.2 * 0.5))
    assert next_clip(2.0) == pytest.approx(math.exp(0.2 * 0.5))
    noisy = next_clip(0.5, count_noise=3.0)
    assert noisy != pytest.approx(math.exp(-0.1)) and noisy == next_clip(0.5, count_noise=3.0)
    plain = GaussianMean(1.0, 0.0, 20, 7)
    plain.begin(reference)
    plain.add({"w": np.ones(16, np.float32)}, 1)
    plain.result()
    assert plain.next_clip_ is None


def test_adaptive_clipping_is_refused_with_distributed_privacy():
    with pytest.raises(ConfigError, match="adaptive_clipping counts"):
        parse_config(RunConfig, {"privacy": {"mechanism": "distributed", "adaptive_clipping": {}},
                                 "secure_aggregation": {"enabled": True}, "min_agents": 4}, "x.yaml")


def test_poisson_rounds_are_counted_under_add_or_remove_and_need_far_less_noise_than_fixed_size_ones():
    """PoissonSampledDpEvent under add-or-remove (the sum's sensitivity is one clip), against
    fixed-size rounds under replace-one (two clips): the issue's claim, that the first needs a
    fraction of the second's noise multiplier for the same ε, measured here."""
    import dp_accounting
    from dp_accounting import rdp

    from edgepfl.privacy import noise_multiplier_for

    spec = PrivacySpec(mechanism="central", noise_multiplier=1.1, delta=1e-5, sampling="poisson")
    accountant = PrivacyAccountant(spec)
    spent = [accountant.spend(500, n, 0.02) for n in (9, 12, 10)]  # the realized sizes do not count, the rate does
    direct = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 3)
    assert spent == sorted(spent) and spent[-1] == pytest.approx(direct.get_epsilon(1e-5))
    with pytest.raises(ValueError, match="all fixed-size or all Poisson"):
        PrivacyAccountant(spec, [(500, 10), (500, 10, 0.02)]).epsilon()
    poisson = noise_multiplier_for(3.0, rounds=100, population=500, sampled=10, sampling="poisson")
    fixed = noise_multiplier_for(3.0, rounds=100, population=500, sampled=10)
    assert poisson < 0.6 * fixed


@pytest.mark.parametrize("bad, says", [
    ({"privacy": {"mechanism": "none", "sampling": "poisson"}}, "needs privacy.mechanism central"),
    ({"privacy": {"mechanism": "distributed", "sampling": "poisson"}, "secure_aggregation": {"enabled": True},
      "min_agents": 4}, "needs privacy.mechanism central"),
])
def test_poisson_sampling_is_refused_where_its_accounting_would_not_hold(bad, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(RunConfig, bad, "x.yaml")


def test_a_poisson_sample_draws_each_device_on_its_own():
    from edgepfl.coordinator.sampling import poisson_sample

    fleet = [f"d{i:04d}" for i in range(4000)]
    sample = poisson_sample(fleet, 0.05, seed=3, round=7)
    assert sample == poisson_sample(fleet, 0.05, seed=3, round=7) == sorted(sample)  # deterministic per round
    assert 140 < len(sample) < 260  # binomial(4000, 0.05): mean 200, sd 14
    assert sample != poisson_sample(fleet, 0.05, seed=3, round=8)
    # one device's draw does not depend on who else is online
    half = fleet[::2]
    assert poisson_sample(half, 0.05, seed=3, round=7) == [a for a in sample if a in set(half)]
