"""A staged rollout's stages and gate (edgepfl/rollout.py): who is in a stage, and what halts a release."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from edgepfl.metrics import HeadReport
from edgepfl.rollout import GateSpec, RolloutSpec, judge_stage, stage_members

FLEET = [f"pi-{i:03d}" for i in range(200)]


def report(correct: int, total: int = 20, seconds: float = 0.1, refused: str | None = None,
           latency_ratio: float | None = None) -> HeadReport:
    values = {"feature_seconds": seconds, "num_train": 60, "num_test": total}
    if latency_ratio is not None:
        values["latency_ratio"] = latency_ratio
    return HeadReport(tier="head", release_id="r", correct=0 if refused else correct, total=0 if refused else total,
                      values=values, refused=refused)


def test_stages_are_reproducible_nested_and_never_empty():
    canary, quarter, everyone = (stage_members(FLEET, share, "fed") for share in (0.05, 0.25, 1.0))
    assert len(canary) == 10 and len(quarter) == 50 and sorted(everyone) == sorted(FLEET)
    assert set(canary) <= set(quarter) <= set(everyone)
    assert stage_members(list(reversed(FLEET)) + FLEET[:5], 0.05, "fed") == canary  # order and repeats do not matter
    assert stage_members(FLEET, 0.05, "another salt") != canary
    assert stage_members(FLEET[:3], 0.05, "fed") == stage_members(FLEET[:3], 0.01, "fed") and \
        len(stage_members(FLEET[:3], 0.05, "fed")) == 1  # a small fleet still has a canary
    assert stage_members([], 0.5, "fed") == []


def test_the_stages_must_rise_to_the_whole_fleet():
    for bad in ([0.5, 0.25, 1.0], [0.05, 0.5], [0.0, 1.0], [0.5, 0.5, 1.0], [1.5]):
        with pytest.raises(ValidationError):
            RolloutSpec(stages=bad)
    assert RolloutSpec(stages=[1.0]).stages == [1.0]


def stages_halted(spec: RolloutSpec, rng, devices: int, true_before, true_after, stages: int) -> float:
    """The share of ``stages`` stages of ``devices`` devices (20 held-out images each) halted,
    true accuracies drawn by ``true_before(rng, n)`` and mapped by ``true_after``."""
    halted = 0
    names = [f"d{i}" for i in range(devices)]
    for _ in range(stages):
        truth = true_before(rng, devices)
        before = {d: report(int(rng.binomial(20, p))) for d, p in zip(names, truth)}
        after = {d: report(int(rng.binomial(20, p))) for d, p in zip(names, true_after(truth))}
        halted += not judge_stage(names, after, before, spec).passed
    return halted / stages


def test_honest_noise_on_small_held_out_splits_rarely_halts_a_good_release_and_a_bad_canary_is_caught():
    """20 held-out images per device (one image is 5 points). With the default gate a release
    as good as the previous one is halted in under 2 % of 10-device stages, while one that
    halves the devices' accuracy is caught at a 2-device canary in over 95 % of draws and at
    a 4-device one in over 99 %; without the noise margin the same limits halt good releases often."""
    rng = np.random.default_rng(0)
    spec = RolloutSpec()
    assert stages_halted(spec, rng, 10, lambda r, n: r.uniform(0.6, 0.95, n), lambda t: t, 1000) < 0.02
    assert stages_halted(spec, rng, 2, lambda r, n: np.full(n, 0.9), lambda t: t / 2, 500) > 0.95
    assert stages_halted(spec, rng, 4, lambda r, n: np.full(n, 0.9), lambda t: t / 2, 500) > 0.99
    strict = RolloutSpec(gate=GateSpec(noise_z=0))
    assert stages_halted(strict, rng, 10, lambda r, n: r.uniform(0.6, 0.95, n), lambda t: t, 200) > 0.2


def test_a_release_that_costs_the_devices_accuracy_is_halted_even_at_a_two_device_canary():
    before = {"a": report(18), "b": report(19)}
    after = {"a": report(9), "b": report(10)}
    verdict = judge_stage(["a", "b"], after, before, RolloutSpec())
    assert not verdict.passed and verdict.paired == 2 and verdict.mean_change == pytest.approx(-0.45)
    assert any("mean held-out accuracy" in r for r in verdict.reasons)
    # one device collapsing among many that gained is caught by the per-device limit alone
    devices = [f"d{i}" for i in range(20)]
    before = {d: report(17) for d in devices}
    after = {d: report(19) for d in devices} | {"d7": report(2)}
    verdict = judge_stage(devices, after, before, RolloutSpec())
    assert not verdict.passed and verdict.mean_change > 0 and "d7" in verdict.reasons[0]


def test_refusals_latency_and_silence_halt_and_only_admitted_devices_count():
    spec = RolloutSpec()
    before = {d: report(18) for d in "abcd"}
    refused = {"a": report(0, refused="encoder produced NaN"), "b": report(18), "c": report(18), "d": report(18)}
    assert "did not install" in judge_stage("abcd", refused, before, spec).reasons[0]
    tolerant = RolloutSpec(gate=GateSpec(max_refused_share=0.25))
    assert judge_stage("abcd", refused, before, tolerant).passed
    slow = {d: report(18, seconds=0.35) for d in "abcd"}
    verdict = judge_stage("abcd", slow, before, spec)
    assert not verdict.passed and verdict.latency_ratio == pytest.approx(3.5) and "time per sample" in verdict.reasons[0]
    # a device's own interleaved timing wins over its two installs' times, taken minutes apart
    # under whatever load each met: a busy install of a good release does not halt it ...
    busy = {d: report(18, seconds=0.35, latency_ratio=1.1) for d in "abcd"}
    verdict = judge_stage("abcd", busy, before, spec)
    assert verdict.passed and verdict.latency_ratio == pytest.approx(1.1)
    # ... and a quiet install of a slow one does not pass it
    quiet = {d: report(18, seconds=0.1, latency_ratio=3.0) for d in "abcd"}
    assert "time per sample 3.00x" in judge_stage("abcd", quiet, before, spec).reasons[0]
    # a device outside the stage (not admitted, or not enrolled) cannot sink or carry it
    outsider = {"a": report(18), "zz": report(0, refused="forged")}
    verdict = judge_stage("a", outsider, before, spec)
    assert verdict.passed and verdict.reported == 1
    silent = judge_stage("ab", {}, before, RolloutSpec(min_reports=1))
    assert not silent.passed and "0 of 2 devices reported" in silent.reasons[0]
    # the first release of a fleet has no previous reports: judged on refusals alone
    assert judge_stage("ab", {"a": report(3), "b": report(4)}, {}, spec).passed
