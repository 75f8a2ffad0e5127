"""A round summed by sites and then centrally is the flat round, bit for bit.

The sites begin the same rule with the same reference and judge their devices against
the records the central round hands them (:meth:`RoundAggregate.for_site`); each returns
its :meth:`~RoundAggregate.site_part`, and the central round folds the parts in
(:meth:`~RoundAggregate.add_site`). The next state, every tensor and the records kept for
the next round's bounds included, must equal the flat round's whatever the grouping and
the order, with bounds firing on some devices. A part that cannot be the sum of its
devices' updates is refused before it counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepfl.aggregation import (
    UPDATE_HISTORY,
    UPDATE_NORM_MEDIAN,
    AggregationRejected,
    AggregationSpec,
    PartialSum,
    SummingRule,
)
from edgepfl.methods import ClientUpdate, DevicePart, ServerState, SitePart, create_method
from edgepfl.specs import ModelSpec

DEVICES = [f"dev-{i:02d}" for i in range(9)]


def _state(method_name: str, seed: int) -> tuple[object, ServerState]:
    import torch

    method = create_method(method_name)
    torch.manual_seed(seed)
    model = method.build_model(ModelSpec(arch="mlp", feature_dim=16, norm="batch"), (1, 8, 8), 5)
    return method, method.init_server(model)


def _updates(state: ServerState, seed: int, sizes: list[float]) -> list[ClientUpdate]:
    """One update per device: the shared parameters moved by noise of each device's size
    (a few far larger than the others, so that the bounds fire); BatchNorm variances kept positive."""
    rng = np.random.default_rng(seed)
    out = []
    for i, size in enumerate(sizes):
        tensors = {}
        for key, ref in state.shared_params().items():
            if ref.dtype.kind != "f":
                tensors[key] = ref.copy()
            elif key.endswith("running_var"):
                tensors[key] = (ref * rng.uniform(0.5, 1.0 + size, ref.shape)).astype(ref.dtype)
            else:
                tensors[key] = (ref + rng.normal(0.0, 0.01 * size, ref.shape)).astype(ref.dtype)
        out.append(ClientUpdate(DEVICES[i], int(rng.integers(20, 400)), tensors))
    return out


def _with_record(method, state: ServerState, seed: int) -> ServerState:
    """The state after one flat round of modest updates: it has the fleet's median and the
    devices' own records, so the next round's bounds are relative to both."""
    rule = AggregationSpec().build()
    aggregate = method.open_round(state, rule)
    for update in _updates(state, seed, [1.0] * 6):
        aggregate.add(update)
    return aggregate.close(0)


def _flat(method, state, updates, order):
    aggregate = method.open_round(state, AggregationSpec().build())
    fired = {}
    for i in order:
        fired[updates[i].agent_id] = aggregate.add(updates[i])
    return aggregate.close(1), fired


def _by_sites(method, state, updates, sites, reverse):
    central = method.open_round(state, AggregationSpec().build())
    fired = {}
    for site in sites:
        records, newcomer = central.for_site(updates[i].agent_id for i in site)
        site_state = ServerState(global_tensors=state.shared_params(),
                                 extra={UPDATE_NORM_MEDIAN: state.extra.get(UPDATE_NORM_MEDIAN),
                                        UPDATE_HISTORY: records})
        local = type(central)(method, site_state, AggregationSpec().build(), newcomer=newcomer)
        for i in reversed(site) if reverse else site:
            local.add(updates[i])
        part = local.site_part()
        fired.update({d.agent_id: d.fired for d in part.devices})
        central.add_site(part)
    return central.close(1), fired


def _same(a: ServerState, b: ServerState) -> None:
    assert a.global_tensors.keys() == b.global_tensors.keys()
    for key in a.global_tensors:
        assert a.global_tensors[key].dtype == b.global_tensors[key].dtype
        assert a.global_tensors[key].tobytes() == b.global_tensors[key].tobytes(), key
    assert a.extra == b.extra


@pytest.mark.parametrize("method_name", ["fedavg", "fedrep"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_grouping_into_sites_gives_the_flat_rounds_state_bit_for_bit(method_name, data):
    seed = data.draw(st.integers(0, 2**16), label="seed")
    method, state = _state(method_name, seed)
    state = _with_record(method, state, seed)
    # devices 0-5 have records; 6-8 are new; two send changes far past the others'
    sizes = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 40.0]), min_size=9, max_size=9), label="sizes")
    updates = _updates(state, seed + 1, sizes)
    order = data.draw(st.permutations(range(9)), label="order")
    labels = data.draw(st.lists(st.integers(0, 3), min_size=9, max_size=9), label="site of each device")
    sites = [[i for i in order if labels[i] == s] for s in range(4)]
    sites = [s for s in sites if s]

    flat, flat_fired = _flat(method, state, updates, order)
    tree, tree_fired = _by_sites(method, state, updates, sites, reverse=data.draw(st.booleans(), label="reverse"))
    _same(flat, tree)
    assert flat_fired == tree_fired


def test_the_bounds_fire_in_the_property_above_so_it_checks_them_too():
    """The sizes above do clip: a device sending 40x the others' change is clipped at its site
    as it is in the flat round, and its record enters the next state's history capped."""
    method, state = _state("fedavg", 3)
    state = _with_record(method, state, 3)
    updates = _updates(state, 4, [1.0, 1.0, 40.0, 1.0, 1.0, 1.0, 40.0, 1.0, 1.0])
    flat, fired = _flat(method, state, updates, range(9))
    tree, tree_fired = _by_sites(method, state, updates, [[0, 1, 2], [3, 4, 5, 6, 7, 8]], reverse=True)
    assert fired["dev-02"] and fired["dev-06"]  # one with a record, one new
    assert not fired["dev-00"]
    assert tree_fired == fired
    _same(flat, tree)


def _site_part(seed: int = 5) -> tuple[object, ServerState, object, SitePart]:
    method, state = _state("fedavg", seed)
    central = method.open_round(state, AggregationSpec().build())
    local = method.open_round(state, AggregationSpec().build())
    for update in _updates(state, seed, [1.0, 1.0, 1.0]):
        local.add(update)
    return method, state, central, local.site_part()


def _forged(part: SitePart, **changes) -> SitePart:
    fields = {**vars(part.sum), **changes.pop("sum", {})}
    return SitePart(PartialSum(**fields), changes.get("devices", part.devices))


@pytest.mark.parametrize("forgery", [
    "a device twice", "fewer devices than the count", "weights that do not add up", "a high word past any sum",
    "a low word out of range", "float words", "a tensor missing", "no updates", "a weight past the cap per update",
    "a record that is not one", "a negative change norm",
])
def test_a_part_that_cannot_be_its_devices_sum_is_refused_before_anything_counts(forgery):
    _, state, central, part = _site_part()
    key = next(iter(part.sum.low))
    d0 = part.devices[0]
    forged = {
        "a device twice": lambda: SitePart(part.sum, (d0, d0, part.devices[2])),
        "fewer devices than the count": lambda: SitePart(part.sum, part.devices[:2]),
        "weights that do not add up": lambda: SitePart(part.sum, (DevicePart(d0.agent_id, d0.weight + 1),
                                                                  *part.devices[1:])),
        "a high word past any sum": lambda: _forged(part, sum={"high": {**part.sum.high, key: np.full_like(
            part.sum.high[key], 2**62)}}),
        "a low word out of range": lambda: _forged(part, sum={"low": {**part.sum.low, key: part.sum.low[key] - 2**41}}),
        "float words": lambda: _forged(part, sum={"low": {**part.sum.low, key: part.sum.low[key].astype(np.float64)}}),
        "a tensor missing": lambda: _forged(part, sum={"low": {k: v for k, v in part.sum.low.items() if k != key}}),
        "no updates": lambda: _forged(part, sum={"count": 0}, devices=()),
        "a weight past the cap per update": lambda: _forged(part, sum={"total_weight": 3 * 2**24 + 1}),
        "a record that is not one": lambda: SitePart(part.sum, (DevicePart(d0.agent_id, d0.weight, record=["x", {}]),
                                                                *part.devices[1:])),
        "a negative change norm": lambda: _forged(part, sum={"change_norms": (-1.0, 0.1, 0.1)}),
    }[forgery]()
    with pytest.raises(AggregationRejected):
        central.add_site(forged)
    assert central.count == 0 and central.rule.count_ == 0 and central.rule.sum_.total_weight == 0
    central.add_site(part)  # the honest part still goes in whole
    assert central.count == 3


def _bounded_site(method, state, updates, spec: AggregationSpec) -> tuple[object, SitePart]:
    """The central round of ``state`` and one site's part of ``updates`` under ``spec`` (the
    site's own rule: a compromised site may bound nothing)."""
    central = method.open_round(state, AggregationSpec().build())
    records, newcomer = central.for_site(u.agent_id for u in updates)
    site_state = ServerState(global_tensors=state.shared_params(),
                             extra={UPDATE_NORM_MEDIAN: state.extra.get(UPDATE_NORM_MEDIAN), UPDATE_HISTORY: records})
    local = type(central)(method, site_state, spec.build(), newcomer=newcomer)
    for update in updates:
        local.add(update)
    return central, local.site_part()


def test_a_site_that_lets_an_update_past_its_bound_or_understates_its_devices_changes_is_refused():
    """The central round judges a site's claims by the records it handed the site: a device's
    change past its bound here (a site that clips nothing, reporting what it measured), or records
    smaller than the site's sum can be made of (to keep a device's bound from noticing, or to
    raise one later from a record the sum does not show), refuse the part before it counts. The
    same updates from an honest site go in (the property above: bit for bit the flat round)."""
    method, state = _state("fedavg", 3)
    state = _with_record(method, state, 3)
    updates = _updates(state, 4, [1.0, 1.0, 40.0])
    central, honest = _bounded_site(method, state, updates, AggregationSpec())
    assert any(d.fired for d in honest.devices)  # the 40x device was clipped at the honest site
    # a site whose bound is a million medians: it clips nothing, and its records say so
    central, unclipped = _bounded_site(method, state, updates, AggregationSpec(max_update_vs_median=1e6))
    assert not any(d.fired for d in unclipped.devices)
    with pytest.raises(AggregationRejected, match="past its bound"):
        central.add_site(unclipped)
    # the honest part with its devices' records understated tenfold and no bound named as fired
    understated = SitePart(honest.sum, tuple(
        DevicePart(d.agent_id, d.weight, d.discount, record=[0.1 * d.record[0], d.record[1]])
        for d in honest.devices))
    with pytest.raises(AggregationRejected, match="more than the changes it reports"):
        central.add_site(understated)
    missing = SitePart(honest.sum, (DevicePart(honest.devices[0].agent_id, honest.devices[0].weight),
                                    *honest.devices[1:]))
    with pytest.raises(AggregationRejected, match="no record"):
        central.add_site(missing)
    assert central.count == 0
    central.add_site(honest)
    assert central.count == 3


def test_a_rule_that_needs_single_updates_makes_no_partial_sums():
    method, state = _state("fedavg", 1)
    for rule in ("median", "trimmed_mean", "multi_krum", "centered_clip"):
        aggregate = method.open_round(state, AggregationSpec(rule=rule).build())
        assert not isinstance(aggregate.rule, SummingRule)
        with pytest.raises(TypeError):
            aggregate.site_part()
    fedpac, fedpac_state = _state("fedpac", 1)
    with pytest.raises(TypeError):  # a server step over every update of the round
        fedpac.open_round(fedpac_state, AggregationSpec(rule="mean").build()).site_part()


# ---------------------------------------------------------------- over the wire (protocol 1.13, §20)
def _over_the_wire(method, state, updates, sites):
    """The same round with the orders and the answers as they travel: the orders as JSON, each
    site's answer as a real update frame, decoded and read back by the central coordinator."""
    from edgepfl.coordinator.result import Evaluation
    from edgepfl.coordinator.sites import answer_of, orders_for, part_of, site_aggregate
    from edgepfl.protocol import MessageType, UpdateMeta, decode, encode
    from edgepfl.protocol.site import SiteOrders

    central = method.open_round(state, AggregationSpec().build())
    for site in sites:
        train = [updates[i].agent_id for i in site]
        orders = SiteOrders.model_validate_json(orders_for(central, AggregationSpec(), train,
                                                           weight_cap=10_000).model_dump_json())
        local = site_aggregate(method, state, AggregationSpec.model_validate(orders.aggregation).build(), orders)
        metas = {}
        for i in site:
            local.add(updates[i])
            metas[updates[i].agent_id] = Evaluation(7, 10, None, 0.5, "train", 1.0)
        answer, tensors = answer_of(local.site_part(), metas)
        frame = encode(MessageType.UPDATE, federation="f", sender="site-a", round=1, tensors=tensors,
                       meta=UpdateMeta(task_id="1" * 32, kind="train", num_train=answer.total_weight, num_test=0,
                                       eval_correct=0, site=answer))
        message = decode(frame)
        got = message.meta_as(UpdateMeta).site
        assert got is not None and [d.eval_correct for d in got.devices] == [7] * len(site)
        part = part_of(got, message.tensors, state.shared_params(), train)
        central.add_site(part)
    return central.close(1)


@pytest.mark.parametrize("method_name", ["fedavg", "fedrep"])
def test_a_round_across_sites_over_real_frames_is_the_flat_round_bit_for_bit(method_name):
    method, state = _state(method_name, 11)
    state = _with_record(method, state, 11)
    updates = _updates(state, 12, [1.0, 2.0, 40.0, 0.5, 1.0, 1.0, 40.0, 2.0, 1.0])
    flat, fired = _flat(method, state, updates, range(9))
    assert any(fired.values())
    _same(flat, _over_the_wire(method, state, updates, [[0, 1, 2, 3], [4, 5, 6, 7, 8]]))


def test_a_site_answer_naming_an_unsampled_device_or_foreign_tensors_is_refused():
    from edgepfl.coordinator.result import Evaluation
    from edgepfl.coordinator.sites import answer_of, part_of

    method, state, _, part = _site_part()
    metas = {d.agent_id: Evaluation(1, 1, None, None, "train", 0.0) for d in part.devices}
    answer, tensors = answer_of(part, metas)
    reference = state.shared_params()
    train = [d.agent_id for d in part.devices]
    assert part_of(answer, tensors, reference, train) is not None
    with pytest.raises(AggregationRejected, match="not sampled"):
        part_of(answer, tensors, reference, train[:2])
    with pytest.raises(AggregationRejected, match="besides its partial sum"):
        part_of(answer, {**tensors, "encoder.extra": np.zeros(1, np.int64)}, reference, train)
    with pytest.raises(AggregationRejected, match="eval_correct"):
        part_of(answer.model_copy(update={"devices": [answer.devices[0].model_copy(update={"eval_correct": 5})]
                                          + answer.devices[1:]}), tensors, reference, train)


@settings(max_examples=60, deadline=None)
@given(high=st.lists(st.integers(-(2**33), 2**33 - 1), min_size=1, max_size=6),
       low=st.lists(st.integers(0, 2**40 - 1), min_size=6, max_size=6))
def test_a_sums_body_gives_back_its_exact_words_in_one_word_where_it_fits_and_two_where_not(high, low):
    from edgepfl.coordinator.sites import sum_tensors, sum_words
    from edgepfl.protocol.site import SUM, SUM_HIGH

    n = len(high)
    words = PartialSum(low={"w": np.array(low[:n], np.int64)}, high={"w": np.array(high, np.int64)},
                       total_weight=1, count=1)
    body = sum_tensors(words)
    fits = all(-(2**23) <= h < 2**23 for h in high)
    assert (SUM + "w" in body) == fits and (SUM_HIGH + "w" in body) != fits
    assert sum(a.nbytes for a in body.values()) == (1 if fits else 2) * 8 * n
    back_low, back_high = sum_words(body, {"w": np.zeros(n, np.float32)})
    assert back_low["w"].tolist() == low[:n] and back_high["w"].tolist() == high


@pytest.mark.parametrize("understated", ["moves", "variances", "a layer left out"])
def test_a_site_that_reports_its_devices_batchnorm_statistics_lower_than_it_summed_is_refused(understated):
    """A device's record keeps its BatchNorm statistics too (the largest move of a running mean,
    the largest running variance): they widen its bound next round. A site whose records say
    less than its sum holds of them (a channel's summed move past the reported moves, weighted,
    or a variance past the reported variances) is refused whole; the honest part goes in."""
    method, state = _state("fedavg", 7)
    state = _with_record(method, state, 7)
    updates = _updates(state, 8, [1.0, 3.0, 1.0, 2.0])
    central, honest = _bounded_site(method, state, updates, AggregationSpec())
    assert all(d.record[1] for d in honest.devices)  # the mlp's BatchNorm layers are measured

    def lowered(stats: dict) -> dict:
        if understated == "a layer left out":
            return dict(list(stats.items())[1:])
        i = 0 if understated == "moves" else 1
        return {layer: tuple(v * (0.05 if j == i else 1.0) for j, v in enumerate(pair)) for layer, pair in stats.items()}

    forged = SitePart(honest.sum, tuple(
        DevicePart(d.agent_id, d.weight, d.discount, record=[d.record[0], lowered(d.record[1])], fired=d.fired)
        for d in honest.devices))
    with pytest.raises(AggregationRejected, match="running_mean|running_var|leaves out"):
        central.add_site(forged)
    assert central.count == 0
    central.add_site(honest)
    assert central.count == 4
