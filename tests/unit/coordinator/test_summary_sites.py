"""Summary sites (``sites.mode: summary``; docs/PROTOCOL.md §20.5): a site that names no
device on the uplink. Its sum goes into the central round as one participant and is held to
what it shows (its largest change within the bounds that need no device's record, its sum
within its weight times that change); it draws its own devices from the run's seed; and it
keeps its devices' records as the central close would have, only for rounds adopted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepfl.aggregation import UPDATE_NORM_MEDIAN, AggregationRejected, AggregationSpec, OwnRecord
from edgepfl.coordinator.result import Evaluation
from edgepfl.coordinator.site_records import RECORDS_FILE, SiteRecords
from edgepfl.coordinator.sites import draw_site, summary_answer_of, summary_part_of
from edgepfl.methods import DevicePart, SitePart
from edgepfl.protocol import MessageType, UpdateMeta, decode, encode
from edgepfl.protocol.site import MAX_SUMMARY_NORMS, SiteSample

from tests.unit.methods.test_site_parts import _state, _updates, _with_record

SITE = "site-a"


def _site_round(spec: AggregationSpec | None = None, sizes=(1.0, 2.0, 1.0, 0.5)):
    """A central round after one recorded round, and one summary site's answer of ``sizes``
    updates, through a real frame; the flat round of the same updates beside it."""
    spec = spec or AggregationSpec()
    method, state = _state("fedavg", 21)
    state = _with_record(method, state, 21)
    updates = _updates(state, 22, list(sizes))
    flat = method.open_round(state, spec.build())
    local = method.open_round(state, spec.build())
    for update in updates:
        flat.add(update)
        local.add(update)
    evaluations = {u.agent_id: Evaluation(7, 10, None, 0.5, "train", 1.0) for u in updates}
    answer, tensors = summary_answer_of(local.site_part(), evaluations, sampled=len(updates),
                                        max_weight_ratio=None)
    frame = encode(MessageType.UPDATE, federation="f", sender=SITE, round=1, tensors=tensors,
                   meta=UpdateMeta(task_id="1" * 32, kind="train", num_train=answer.total_weight, num_test=40,
                                   eval_correct=28, site=answer))
    message = decode(frame)
    got = message.meta_as(UpdateMeta).site
    assert got is not None
    return method, state, spec, flat, got, message.tensors


def test_a_summary_sites_sum_is_one_participant_and_moves_the_model_as_its_devices_updates_would():
    method, state, spec, flat, answer, tensors = _site_round()
    assert answer.devices == [] and answer.dropped == [] and answer.totals is not None
    assert (answer.totals.sampled, answer.totals.trained, answer.totals.evaluated) == (4, 4, 4)
    assert answer.totals.eval_total == 40 and answer.totals.eval_correct == 28
    central = method.open_round(state, spec.build())
    part = summary_part_of(SITE, answer, tensors, state.shared_params())
    assert part is not None
    central.add_site(part)
    assert central.participants == [SITE] and central.shares() == {SITE: 1.0}
    # the shared model: the flat round's bit for bit (the records stay at the site)
    a, b = flat.close(1), central.close(1)
    for key, value in a.global_tensors.items():
        assert value.tobytes() == b.global_tensors[key].tobytes(), key
    assert a.extra[UPDATE_NORM_MEDIAN] == b.extra[UPDATE_NORM_MEDIAN]  # four norms: all reported
    with pytest.raises(AggregationRejected, match="already has a sum"):
        fresh = method.open_round(state, spec.build())
        fresh.add_site(part)
        fresh.add_site(part)


def test_a_summary_site_claiming_a_smaller_change_than_its_sum_shows_or_one_past_the_models_bound_is_refused():
    method, state, spec, _, answer, tensors = _site_round(sizes=(1.0, 1.0, 30.0))
    reference = state.shared_params()
    totals = answer.totals
    assert totals is not None and totals.largest_change is not None
    smaller = answer.model_copy(update={
        "totals": totals.model_copy(update={"largest_change": totals.largest_change / 10}),
        "change_norms": [n / 10 for n in answer.change_norms]})
    central = method.open_round(state, spec.build())
    with pytest.raises(AggregationRejected, match="more than its weight times its largest change"):
        central.add_site(summary_part_of(SITE, smaller, tensors, reference))
    hidden = answer.model_copy(update={"totals": totals.model_copy(update={"largest_change": min(answer.change_norms)})})
    with pytest.raises(AggregationRejected, match="a change above its largest"):
        central.add_site(summary_part_of(SITE, hidden, tensors, reference))
    # a central run whose model bound is tighter than the site's largest change
    tight = method.open_round(state, AggregationSpec(max_update_ratio=1e-4).build())
    with pytest.raises(AggregationRejected, match="past the bound"):
        tight.add_site(summary_part_of(SITE, answer, tensors, reference))
    assert central.count == tight.count == 0
    central.add_site(summary_part_of(SITE, answer, tensors, reference))
    assert central.count == 1


def test_a_summary_answer_that_names_devices_or_miscounts_is_refused():
    _, state, _, _, answer, tensors = _site_round()
    reference = state.shared_params()
    totals = answer.totals
    assert totals is not None
    with pytest.raises(AggregationRejected, match="names devices"):
        summary_part_of(SITE, answer.model_copy(update={"dropped": ["dev-00"]}), tensors, reference)
    with pytest.raises(AggregationRejected, match="more updates than it sampled"):
        summary_part_of(SITE, answer.model_copy(update={"totals": totals.model_copy(update={"sampled": 2})}),
                        tensors, reference)
    with pytest.raises(AggregationRejected, match="without updates carries a sum"):
        summary_part_of(SITE, answer.model_copy(update={"totals": totals.model_copy(update={"trained": 0})}),
                        tensors, reference)
    with pytest.raises(AggregationRejected, match="clipped"):
        summary_part_of(SITE, answer.model_copy(update={"clipped": 9}), tensors, reference)


def test_a_large_sites_change_norms_are_sixteen_quantiles_from_its_smallest_to_its_largest():
    method, state = _state("fedavg", 3)
    state = _with_record(method, state, 3)
    local = method.open_round(state, AggregationSpec().build())
    updates = _updates(state, 4, [0.5 + 0.1 * i for i in range(9)]) + _updates(state, 5, [1.0] * 9)
    for i, update in enumerate(updates):
        local.add(type(update)(f"d{i:02d}", update.num_samples, update.tensors))
    part = local.site_part()
    answer, _ = summary_answer_of(part, {}, sampled=18, max_weight_ratio=None)
    norms = sorted(part.sum.change_norms)
    assert len(answer.change_norms) == MAX_SUMMARY_NORMS
    assert answer.change_norms[0] == norms[0] and answer.change_norms[-1] == norms[-1]
    assert answer.totals is not None and answer.totals.largest_change == norms[-1]


def test_a_site_draws_its_own_share_of_devices_the_same_way_every_time_and_apart_from_other_sites():
    online = [f"dev-{i:02d}" for i in range(10)]
    sample = SiteSample(train_fraction=0.3, evaluate_share=0.5, seed=4)
    train, evaluate = draw_site(SITE, online, sample, 2)
    assert len(train) == 3 and len(evaluate) == 2 and not set(train) & set(evaluate)
    assert draw_site(SITE, online, sample, 2) == (train, evaluate)
    draws = {tuple(draw_site(site, online, sample, r)[0]) for site in ("site-a", "site-b") for r in range(6)}
    assert len(draws) > 6
    assert draw_site(SITE, online, SiteSample(train_fraction=0.0, evaluate_share=1.0, seed=4), 9) == ([], online)
    assert draw_site(SITE, online, SiteSample(train_fraction=1.0, seed=4), 0) == (online, [])


def _part(records: dict[str, float], newcomers=()) -> SitePart:
    from edgepfl.aggregation import PartialSum

    total = PartialSum(low={}, high={}, total_weight=len(records), count=len(records))
    return SitePart(total, tuple(DevicePart(a, 1, record=[change, {}], clipped_newcomer=a in newcomers)
                                 for a, change in records.items()))


def test_a_sites_records_are_kept_only_for_rounds_adopted_capped_as_the_central_close_caps_and_survive_a_restart(
        tmp_path):
    book = SiteRecords(tmp_path)
    # round 0 was judged without the fleet's median (vs_median 4): its records are capped at 4x the
    # adopted round's median, a clipped newcomer's at the median itself
    book.hold(0, _part({"a": 10.0, "b": 1.0, "c": 3.0}, newcomers=["c"]), first_vs_median=4.0)
    book.settle(kept=0, typical=2.0)
    assert book.history == {"a": [[8.0, {}]], "b": [[1.0, {}]], "c": [[2.0, {}]]}
    book.hold(1, _part({"a": 5.0}), first_vs_median=None)
    book.settle(kept=0, typical=2.0)  # round 1 not adopted: nothing of it kept
    assert book.history["a"] == [[8.0, {}]] and book.pending is None
    for r in (2, 3, 4):
        book.hold(r, _part({"a": float(r)}), first_vs_median=None)
    restarted = SiteRecords(tmp_path)  # round 4 pending on disk
    restarted.settle(kept=4, typical=2.0)
    assert restarted.history["a"] == [[8.0, {}], [4.0, {}]]  # 2 and 3 were never adopted
    records, newcomer = restarted.for_round(["a", "z"])
    assert list(records) == ["a"] and newcomer == OwnRecord(8.0, {})  # a's typical record: the larger of 8 and 4
    assert json.loads((tmp_path / RECORDS_FILE).read_text())["history"]["a"] == [[8.0, {}], [4.0, {}]]


def test_an_unreadable_book_is_set_aside_and_the_site_starts_without_records(tmp_path, caplog):
    (tmp_path / RECORDS_FILE).write_text('{"history": {"a": [[-1, {}]]}}')
    book = SiteRecords(tmp_path)
    assert book.history == {} and (tmp_path / "records.unreadable").exists()
    assert "cannot be read" in caplog.text


def test_a_sites_evaluation_cuts_each_devices_count_as_the_central_round_does():
    answers = {"a": Evaluation(10, 10, None, None, "evaluate", 0.0), "b": Evaluation(0, 10, None, None, "evaluate", 0.0),
               "c": Evaluation(500, 1000, None, None, "evaluate", 0.0)}
    answer, tensors = summary_answer_of(None, answers, sampled=0, max_weight_ratio=2.0)
    assert tensors == {} and answer.totals is not None
    # c's 1,000 samples weigh 2 x the median (10): 20 samples, half of them correct
    assert (answer.totals.eval_total, answer.totals.eval_correct, answer.totals.evaluated) == (40, 20, 3)
    assert np.isclose(answer.totals.eval_correct / answer.totals.eval_total, 0.5)


def test_a_summary_sum_of_an_earlier_state_moves_the_model_as_its_updates_would_have_late():
    """A buffered run: a site's sum over state v-1's parameters, folded into state v with its
    discount, does what its devices' updates would have done as late updates (to the grid's
    rounding), and its claims are checked over the parameters it was summed on."""
    method, old = _state("fedavg", 31)
    old = _with_record(method, old, 31)
    newer = _with_record(method, old, 32)  # the state moved on meanwhile
    updates = _updates(old, 33, [1.0, 2.0, 0.5])
    site = method.open_round(old, AggregationSpec().build())
    for update in updates:
        site.add(update)
    answer, tensors = summary_answer_of(site.site_part(), {}, sampled=3, max_weight_ratio=None)
    base = old.shared_params()
    part = summary_part_of(SITE, answer, tensors, base)
    assert part is not None
    by_device = method.open_round(newer, AggregationSpec(max_update_vs_median=None).build())
    by_site = method.open_round(newer, AggregationSpec(max_update_vs_median=None).build())
    for update in updates:
        by_device.add(update, base, 0.5)
    by_site.add_site(part, base, 0.5)
    assert by_site.participants == [SITE] and by_site.weights == {SITE: 0.5 * answer.total_weight}
    a, b = by_device.close(2).global_tensors, by_site.close(2).global_tensors
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # over the state it was summed on, a claim its sum does not bear out is refused as on time
    understated = answer.model_copy(update={
        "totals": answer.totals.model_copy(update={"largest_change": answer.totals.largest_change / 10}),
        "change_norms": [n / 10 for n in answer.change_norms]})
    with pytest.raises(AggregationRejected, match="more than its weight times its largest change"):
        method.open_round(newer, AggregationSpec().build()).add_site(
            summary_part_of(SITE, understated, tensors, base), base, 0.5)


def test_the_rounds_median_change_weighs_a_large_sites_quantiles_by_the_updates_they_stand_for():
    """A site of 160 updates reports 16 quantiles and one of 8 reports its 8 norms: the round's
    median change (the next round's typical_change) is the median of the 168 updates, not of
    the 24 numbers, which would give each of the small site's updates ten times its say."""
    from edgepfl.aggregation import Mean, PartialSum

    reference = {"w": np.zeros(4, np.float32)}
    zero = {"w": np.zeros(4, np.int64)}
    quantiles = tuple(float(q) for q in np.linspace(1.0, 2.0, 16))
    large = PartialSum(low=zero, high=zero, total_weight=160, count=160, change_norms=quantiles, norm_weight=10.0)
    small = PartialSum(low=zero, high=zero, total_weight=8, count=8, change_norms=(10.0,) * 8)
    rule = Mean()
    rule.begin(reference)
    rule.add_partial(large)
    rule.add_partial(small)
    assert rule.median_change() == quantiles[8]  # 9 quantiles x 10 updates: past half of 168
    assert sorted(quantiles + small.change_norms)[(24 - 1) // 2] == quantiles[11]  # the 24 numbers alone
    # a site whose norms are all its updates' weighs each once: the plain lower median
    plain = Mean()
    plain.begin(reference)
    plain.add_partial(PartialSum(low=zero, high=zero, total_weight=3, count=3, change_norms=(5.0, 6.0, 7.0)))
    assert plain.median_change() == 6.0
