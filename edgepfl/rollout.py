"""Staged rollout of an encoder release: stages, who is in each, and the gate that lets a
release on to the next (docs/ROLLOUT.md).

A release goes to the head agents in stages — by default 5 % of the fleet (the canary),
then 25 %, then everyone — and each stage is judged from the reports of the devices in
it before the next one is admitted:

* **refusals**: a device that did not install the release (a corrupt or mismatched
  encoder, a head that cannot be fitted, inference that fails) counts against
  ``max_refused_share``;
* **accuracy, paired**: each device measures the new release on its own held-out split;
  against the same device's report on the release it had before, the change is what
  counts — the mean over the stage (``max_mean_drop``) and each device
  (``max_device_drop``). Devices differ by tens of points from each other; a paired change
  does not carry that spread. A device's split is small (one image of 20 is 5 points), so
  a drop fails only when it exceeds its limit by ``noise_z`` standard errors of the two
  accuracies it compares: an honest device's noise does not halt a good release;
* **latency**: the encoder's time per sample on the device, new over previous, median of
  the stage (``max_latency_ratio``). A device times both encoders in alternation on the
  same samples when it installs the new one (its report's ``latency_ratio``), so the load
  of the moment falls on both; a report without it (an older agent) is compared
  with its own previous install's time.

Membership is a fixed order of the agent ids (sha256 of the order's salt and the id):
the same devices are the canary for every release, reproducibly, and each stage contains
the stages before it. Only reports from the agents admitted to the stage count; an agent
admitted but offline or silent until the stage's timeout is not judged, and a stage with
fewer than ``min_reports`` reports fails (nothing measured is not a pass).

Pure logic: the coordinator side that sends and collects is :mod:`edgepfl.coordinator.releases.rollout`.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .metrics import HeadReport

__all__ = ["GateSpec", "RolloutEvent", "RolloutSpec", "StageVerdict", "judge_stage", "stage_members"]


class GateSpec(BaseModel):
    """``rollout.gate``: what a stage must show before the release goes on."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    max_mean_drop: float = Field(0.02, ge=0, le=1, description="the largest mean drop of held-out accuracy (0-1), "
                                                               "each device against its own previous release")
    max_device_drop: float = Field(0.10, ge=0, le=1, description="the largest drop of held-out accuracy (0-1) on one "
                                                                 "device against its own previous release")
    max_refused_share: float = Field(0.0, ge=0, le=1, description="the largest share of the stage's reporting devices "
                                                                  "that did not install the release")
    max_latency_ratio: float = Field(2.0, ge=1, description="the largest median ratio of the encoder's time per sample, "
                                                            "new release over previous, on the same devices")
    noise_z: float = Field(2.5, ge=0, description="a drop must exceed its limit by this many standard errors of the "
                                                  "held-out accuracies it is measured on (a device's split of 20 images "
                                                  "moves 5 points per image); 0: the limits as they are")


class RolloutSpec(BaseModel):
    """A run's ``rollout:`` section: how ``edgepfl release publish`` (and, with ``in_runs``, the
    coordinator) rolls a release out."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    stages: list[float] = Field(default_factory=lambda: [0.05, 0.25, 1.0], min_length=1, max_length=20,
                                description="cumulative shares of the head agents online, rising, the last 1.0")
    gate: GateSpec = Field(default_factory=GateSpec, description="what each stage must show")
    stage_timeout_s: float = Field(600.0, gt=0, description="how long a stage waits for its devices' reports")
    min_reports: int = Field(1, ge=1, description="reports a stage needs to be judged at all")
    order_salt: str = Field("", max_length=64, description="orders the fleet for the stages (default: the federation)")
    in_runs: bool = Field(False, description="the coordinator's own releases (release_every, release_at_end) go by "
                                             "these stages too, its round loop waiting for each stage; false: to "
                                             "every head agent at once")

    @field_validator("stages")
    @classmethod
    def _rising_to_one(cls, stages: list[float]) -> list[float]:
        if any(not 0 < s <= 1 for s in stages) or any(b <= a for a, b in zip(stages, stages[1:])):
            raise ValueError(f"stages must rise within (0, 1]: {stages}")
        if stages[-1] != 1.0:
            raise ValueError(f"the last stage must be 1.0 (the whole fleet): {stages}")
        return stages


def stage_members(agents: Iterable[str], share: float, salt: str) -> list[str]:
    """The first ``ceil(share × N)`` (at least one) of ``agents`` in the rollout's order."""
    ordered = sorted(set(agents), key=lambda a: (hashlib.sha256(f"{salt}\0{a}".encode()).hexdigest(), a))
    return ordered[:max(1, math.ceil(share * len(ordered)))] if ordered else []


class StageVerdict(BaseModel):
    """What a stage's reports showed, and whether the release may go on."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    passed: bool
    reasons: list[str] = Field(default_factory=list, description="each gate that failed, in words")
    admitted: int
    reported: int
    refused: int
    paired: int = Field(description="reporting devices with a report on their previous release")
    mean_change: float | None = Field(None, description="mean paired change of held-out accuracy (0-1)")
    worst_change: float | None = None
    latency_ratio: float | None = None


def _per_sample_seconds(report: HeadReport) -> float | None:
    seconds, n = report.values.get("feature_seconds"), report.values.get("num_train", 0) + report.values.get(
        "num_test", 0)
    return seconds / n if seconds is not None and n > 0 and seconds > 0 else None


def _latency_ratio(report: HeadReport, before: HeadReport) -> float | None:
    """The device's own interleaved timing when it reported one, else the ratio of the two
    installs' times per sample."""
    measured = report.values.get("latency_ratio")
    if measured is not None and math.isfinite(measured) and measured > 0:
        return measured
    now_s, then_s = _per_sample_seconds(report), _per_sample_seconds(before)
    return now_s / then_s if now_s is not None and then_s is not None else None


def _standard_error(report: HeadReport) -> float:
    """The standard error of a held-out accuracy of ``correct`` of ``total`` (the Agresti-Coull
    centre, so that 20 of 20 is not taken as certain)."""
    p = (report.correct + 2) / (report.total + 4)
    return math.sqrt(p * (1 - p) / (report.total + 4))


def judge_stage(admitted: Iterable[str], new: Mapping[str, HeadReport], previous: Mapping[str, HeadReport],
                spec: RolloutSpec) -> StageVerdict:
    """Judge a stage: ``new`` are reports on the release rolled out, ``previous`` each
    device's report on the release it had before (by agent id; reports of agents not
    ``admitted`` are ignored)."""
    members = set(admitted)
    reports = {a: r for a, r in new.items() if a in members}
    refused = [a for a, r in reports.items() if r.refused]
    changes, errors, ratios = [], [], []
    gate, reasons = spec.gate, []
    failed_devices = []
    for agent, report in reports.items():
        before = previous.get(agent)
        if report.refused or before is None or before.refused or report.accuracy is None or before.accuracy is None:
            continue
        change, error = report.accuracy - before.accuracy, math.hypot(_standard_error(report), _standard_error(before))
        changes.append(change)
        errors.append(error)
        if -change > gate.max_device_drop + gate.noise_z * error:
            failed_devices.append((change, agent))
        ratio = _latency_ratio(report, before)
        if ratio is not None:
            ratios.append(ratio)
    if len(reports) < spec.min_reports:
        reasons.append(f"{len(reports)} of {len(members)} devices reported (min_reports {spec.min_reports})")
    if reports and len(refused) / len(reports) > gate.max_refused_share:
        reasons.append(f"{len(refused)} of {len(reports)} devices did not install it "
                       f"(max_refused_share {gate.max_refused_share:g})")
    mean = statistics.fmean(changes) if changes else None
    worst = min(changes) if changes else None
    if mean is not None:
        margin = gate.noise_z * math.sqrt(sum(e * e for e in errors)) / len(errors)
        if -mean > gate.max_mean_drop + margin:
            reasons.append(f"mean held-out accuracy {100 * mean:+.1f} points on the same devices "
                           f"(max_mean_drop {100 * gate.max_mean_drop:g} + noise {100 * margin:.1f})")
    if failed_devices:
        change, agent = min(failed_devices)
        reasons.append(f"{len(failed_devices)} device(s) beyond max_device_drop {100 * gate.max_device_drop:g} and "
                       f"their noise, {agent} {100 * change:+.1f} points")
    ratio = statistics.median(ratios) if ratios else None
    if ratio is not None and ratio > gate.max_latency_ratio:
        reasons.append(f"encoder time per sample {ratio:.2f}x the previous release's "
                       f"(max_latency_ratio {gate.max_latency_ratio:g})")
    return StageVerdict(passed=not reasons, reasons=reasons, admitted=len(members), reported=len(reports),
                        refused=len(refused), paired=len(changes), mean_change=mean, worst_change=worst,
                        latency_ratio=ratio)


class RolloutEvent(BaseModel):
    """One line of ``<run>/releases/rollout.jsonl``: a stage judged, or a release promoted,
    halted or rolled back."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    release_id: str
    event: Literal["stage", "held", "promoted", "halted", "rolled_back"]
    stage: int | None = Field(None, description="1-based stage, of len(stages)")
    share: float | None = None
    verdict: StageVerdict | None = None
    agents: list[str] = Field(default_factory=list, description="stage: admitted; rolled_back: sent the restore")
    to_release: str | None = Field(None, description="rolled_back: the release the fleet went back to")
    seconds: float = Field(0.0, description="stage: from admission to verdict; rolled_back: until every head agent "
                                            "online reported on the release gone back to")
    at: float = Field(description="Unix time")
