"""Staged rollout of a release over MQTT, with halt and rollback (docs/ROLLOUT.md).

:class:`ReleaseService` is the coordinator's side of the fleet without a round loop: a
connection as the coordinator (presence, signed frames), the registry of agents and the
inbox that admits their statuses and reports. ``edgepfl release`` runs one between runs.

:meth:`ReleaseService.roll_out` sends a release stage by stage (:mod:`edgepfl.rollout`
says who is in a stage and judges it): the stage's head agents are sent it on their task
topics — it is neither retained nor named in the presence, so no other device can take
it — and the stage closes when each of them online has reported on it, or at the stage's
timeout. A stage that passes admits the next; after the last, the release is *promoted*:
retained and named in the presence, as a release published by a round loop is. A stage
that fails *halts* the rollout: no one else is sent it, and the release before it is
published again under a new sequence (:func:`.release.rollback_release`), which the
devices that installed the bad one restore from their own kept files and which makes the
bad one refused everywhere it reaches. Every decision is a line of
``<run>/releases/rollout.jsonl`` and of the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgepfl.atomic import write_bytes, write_json
from edgepfl.config import RunConfig
from edgepfl.errors import InputError
from edgepfl.logs import set_log_context
from edgepfl.metrics import HeadReport
from edgepfl.protocol import CoordinatorMeta, ReleaseMeta, decode
from edgepfl.protocol.signing import Signer
from edgepfl.protocol.view import RolloutState, RolloutView
from edgepfl.rollout import RolloutEvent, RolloutSpec, StageVerdict, judge_stage, stage_members

from ..fleet import Fleet
from ..inbox import Inbox
from ..observe import Observer
from ..wiring import wire
from .release import (
    BuiltRelease,
    fleet_current,
    publish_release,
    published_frame,
    resume_release,
    rollback_release,
)

log = logging.getLogger("edgepfl.coordinator.releases.rollout")

ROLLOUT_LOG = "rollout.jsonl"
#: how often a stage checks whether all its devices reported
CHECK_EVERY_S = 0.2
#: how long a release command waits for the release the broker retains (it comes at once when
#: there is one; the wait is spent in full only by a federation's very first release)
RETAINED_WAIT_S = 3.0


#: a held rollout: its whole frame, then its record (written last: the commit)
CANDIDATE_FRAME, CANDIDATE_FILE = "candidate.frame", "candidate.json"

Outcome = Literal["promoted", "halted", "held"]


class HeldRollout(BaseModel):
    """``candidate.json``: a release held between stages, and what its stages measured."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    release_id: str
    stage: int = Field(ge=1, description="the last stage it passed")
    reports: dict[str, HeadReport] = Field(description="the admitted devices' reports on it")
    baseline: dict[str, HeadReport] = Field(description="their reports on the release before it")


def read_held(releases_dir: Path) -> HeldRollout | None:
    """The held rollout of ``releases_dir``, or None."""
    path = Path(releases_dir) / CANDIDATE_FILE
    if not (path.is_file() and (Path(releases_dir) / CANDIDATE_FRAME).is_file()):
        return None
    try:
        return HeldRollout.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise InputError(f"{path} is not a held rollout: {str(exc).splitlines()[0]}") from None


def hold_release(releases_dir: Path, frame: bytes, held: HeldRollout) -> None:
    """Keep ``frame``'s rollout held: the frame, then the record (the commit)."""
    write_bytes(Path(releases_dir) / CANDIDATE_FRAME, frame)
    write_json(Path(releases_dir) / CANDIDATE_FILE, held.model_dump(mode="json"))


def clear_held(releases_dir: Path) -> None:
    """No rollout held any more: the record first, so that no half-held state remains."""
    (Path(releases_dir) / CANDIDATE_FILE).unlink(missing_ok=True)
    (Path(releases_dir) / CANDIDATE_FRAME).unlink(missing_ok=True)


class ReleaseService:
    """The fleet as the coordinator sees it, for releases only: ``fleet`` connected as the
    coordinator of ``config.federation``, releases recorded in ``releases_dir``."""

    def __init__(self, config: RunConfig, fleet: Fleet, releases_dir: Path):
        self.config = config
        self.fleet = fleet
        self.releases_dir = Path(releases_dir)
        self.releases_dir.mkdir(parents=True, exist_ok=True)
        # no task is ever open, so every update is rejected as out of any round, before a method
        # would be needed: none is built (torch stays unimported: `edgepfl release` runs from [agent])
        side = wire(config, fleet, None, watch_presence=False)
        self.signer, self.registry, self.inbox = side.credentials.signer, side.registry, side.inbox
        #: the fleet view (PROTOCOL.md §18) with the rollout's progress: the dashboard and edgepfl status show it
        self.observer = side.observer
        # the presence names the fleet's current release: this folder's, or the one the broker retains
        resume_release(fleet, self.releases_dir, on_current=lambda ref: self.observer.released(ref.release_id))
        fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=-1))
        self.observer.start(None)
        self.observer.enter("releasing", -1)
        self.rollout = StagedRollout(config, fleet, self.inbox, self.observer, self.releases_dir, self.signer)

    def roll_out(self, release: BuiltRelease, hold: bool = False) -> Outcome:
        """:meth:`StagedRollout.roll_out`."""
        return self.rollout.roll_out(release, hold)

    def rollback(self, frame: bytes, rolled_back: list[str]) -> str:
        """:meth:`StagedRollout.rollback`."""
        return self.rollout.rollback(frame, rolled_back)

    def close(self) -> None:
        """The view says ``done``; the connection says goodbye."""
        self.observer.enter("done", -1)
        self.observer.close()
        self.fleet.close()

    def settle(self, heads: int, wait_s: float) -> list[str]:
        """Route traffic until ``heads`` head agents are online and have said what they run
        (at most ``wait_s``; then a quiet moment for the reports on their installed release);
        returns those online."""
        releases = self.fleet.releases
        # the broker sends a retained release at once: a run with no release of its own adopts it first
        self.inbox.pump_until(lambda: not releases.adopting, self.fleet.clock.now() + RETAINED_WAIT_S)
        online = releases.online
        self.inbox.pump_until(lambda: len(online()) >= heads, self.fleet.clock.now() + wait_s)
        current = fleet_current(self.releases_dir)
        if current is not None:  # each head agent on it reports unasked: the paired gate's baseline
            self.inbox.pump_until(self.rollout.all_reported(online(), current.release_id),
                                  self.fleet.clock.now() + min(wait_s, 30.0))
        return online()


class StagedRollout:
    """Rolls releases out by stages over a coordinator's connection (:class:`ReleaseService`'s
    between runs, or the round loop's with ``rollout.in_runs``): its ``inbox`` routes the
    reports, its ``observer`` shows the progress in the fleet view."""

    def __init__(self, config: RunConfig, fleet: Fleet, inbox: Inbox, observer: Observer, releases_dir: Path,
                 signer: Signer | None):
        self.config, self.fleet, self.inbox, self.observer = config, fleet, inbox, observer
        self.releases_dir, self.signer = Path(releases_dir), signer
        self.spec: RolloutSpec = config.rollout
        self.salt = self.spec.order_salt or config.federation
        #: told each step and decision in one line (edgepfl release prints them), besides the log
        self.note: Callable[[str], None] | None = None

    def _say(self, level: int, message: str) -> None:
        log.log(level, "%s", message)
        if self.note is not None:
            self.note(message)

    def _show(self, release: str, stage: int, state: RolloutState, admitted: int = 0, reported: int = 0,
              reasons: list[str] | None = None, to_release: str | None = None,
              measured: StageVerdict | None = None) -> None:
        """The rollout in the fleet view; ``measured``: the verdict of the last stage judged,
        whose measurements the operator sees beside the state."""
        set_log_context(release=release, stage=stage)
        numbers = {} if measured is None else {
            "paired": measured.paired, "mean_change": measured.mean_change, "worst_change": measured.worst_change,
            "latency_ratio": measured.latency_ratio}
        self.observer.rolling_out(RolloutView(release=release, stage=stage, stages=list(self.spec.stages),
                                              state=state, admitted=admitted, reported=reported,
                                              reasons=reasons or [], to_release=to_release, **numbers))

    def all_reported(self, agents: list[str], release_id: str) -> Callable[[], bool]:
        """A condition for :meth:`Inbox.pump_until`: each of ``agents`` still online has reported
        on ``release_id`` (installed or refused). Checked at most every :data:`CHECK_EVERY_S`:
        the inbox asks after every message, and the check is as long as the stage."""
        checked = [float("-inf")]

        def done() -> bool:
            if time.monotonic() - checked[0] < CHECK_EVERY_S:
                return False
            checked[0] = time.monotonic()
            online = set(self.fleet.releases.online())
            reports = self._reports(release_id)
            return all(a in reports and self._status_caught_up(a, reports[a], release_id) for a in agents
                       if a in online)

        return done

    def _status_caught_up(self, agent_id: str, report: HeadReport, release_id: str) -> bool:
        """Whether an agent that reported installing ``release_id`` also says so in its status
        (it publishes the report first): the fleet view counts releases from statuses, and
        the release service's last view is what operators read once it exits. An agent whose
        status never named a release (before protocol 1.4) is taken at its report."""
        info = self.inbox.registry.agents.get(agent_id)
        return report.refused is not None or info is None or info.release in (None, release_id)

    def _reports(self, release_id: str) -> dict[str, HeadReport]:
        return self.inbox.reports_by_release.get(release_id, {})

    def _record(self, event: RolloutEvent) -> None:
        with open(self.releases_dir / ROLLOUT_LOG, "a", encoding="utf-8") as f:
            f.write(event.model_dump_json(exclude_none=True) + "\n")

    def roll_out(self, release: BuiltRelease, hold: bool = False) -> Outcome:
        """Roll ``release`` out by the run's stages: ``promoted``, or ``halted`` (and, where a
        release was current before it, rolled back to that one). With ``hold``, a stage that
        passes (but the last) holds the rollout there: ``held`` until :meth:`promote` (``edgepfl
        release promote``) goes on or :meth:`halt` rolls it back."""
        held = read_held(self.releases_dir)
        if held is not None:
            raise InputError(f"release {held.release_id} is held after stage {held.stage}: promote or halt it first "
                             "(edgepfl release promote / halt)")
        stable = fleet_current(self.releases_dir)
        baseline = dict(self._reports(stable.release_id)) if stable is not None else {}
        return self._stages(release, 1, baseline, hold)

    def promote(self, hold: bool = False) -> Outcome:
        """Go on with the held release from the stage after the one it passed: every stage left,
        or with ``hold`` the next one only."""
        held = self._held()
        frame = (self.releases_dir / CANDIDATE_FRAME).read_bytes()
        self.inbox.reports_by_release.setdefault(held.release_id, {}).update(held.reports)
        clear_held(self.releases_dir)
        return self._stages(BuiltRelease(held.release_id, frame), held.stage + 1, held.baseline, hold)

    def halt(self) -> str | None:
        """Halt the held release (the operator's decision) and roll its devices back; the release
        gone back to, or None when none was current before it."""
        held = self._held()
        verdict = StageVerdict(passed=False, reasons=["halted by the operator"], admitted=0,
                               reported=len(held.reports), refused=0, paired=0)
        clear_held(self.releases_dir)
        self._halt(held.release_id, held.stage, verdict, stable_frame=published_frame(self.releases_dir))
        current = fleet_current(self.releases_dir)
        if current is not None:
            self._show(held.release_id, held.stage, "rolled_back", reasons=verdict.reasons,
                       to_release=current.release_id)
        return current.release_id if current is not None else None

    def _held(self) -> HeldRollout:
        held = read_held(self.releases_dir)
        if held is None:
            raise InputError(f"no release is held in {self.releases_dir} (edgepfl release publish --hold holds one)")
        return held

    def _stages(self, release: BuiltRelease, first: int, baseline: dict[str, HeadReport], hold: bool) -> Outcome:
        message = decode(release.frame)
        meta, round = message.meta_as(ReleaseMeta), message.header.round
        ref, rid = meta.ref(), meta.release_id
        stages = self.spec.stages
        verdict: StageVerdict | None = None
        for k, share in enumerate(stages, 1):
            if k < first:
                continue
            admitted = stage_members(self.fleet.releases.online(), share, self.salt)
            began = time.monotonic()
            self._say(logging.INFO, f"release {rid}, stage {k} of {len(stages)} ({100 * share:.0f} %): "
                                    f"{len(admitted)} head agents")
            self.fleet.releases.stage(release.frame, round, ref, admitted, release.delta)
            self._show(rid, k, "staging", len(admitted))
            self.inbox.pump_until(self.all_reported(admitted, rid), self.fleet.clock.now() + self.spec.stage_timeout_s)
            verdict = judge_stage(admitted, self._reports(rid), baseline, self.spec)
            self._record(RolloutEvent(release_id=rid, event="stage", stage=k, share=share, verdict=verdict,
                                      agents=sorted(admitted), seconds=time.monotonic() - began, at=time.time()))
            self._show(rid, k, "staging", verdict.admitted, verdict.reported, verdict.reasons, measured=verdict)
            if not verdict.passed:
                self._show(rid, k, "halted", verdict.admitted, verdict.reported, verdict.reasons, measured=verdict)
                self._halt(rid, k, verdict, stable_frame=published_frame(self.releases_dir))
                if (current := fleet_current(self.releases_dir)) is not None:
                    self._show(rid, k, "rolled_back", verdict.admitted, verdict.reported, verdict.reasons,
                               to_release=current.release_id, measured=verdict)
                return "halted"
            self._say(logging.INFO, f"release {rid} passed stage {k} in {time.monotonic() - began:.1f} s: "
                                    f"{verdict.reported} reports, mean change {_points(verdict.mean_change)}")
            if hold and k < len(stages):
                hold_release(self.releases_dir, release.frame, HeldRollout(
                    release_id=rid, stage=k, reports=dict(self._reports(rid)), baseline=baseline))
                self._show(rid, k, "held", verdict.admitted, verdict.reported, measured=verdict)
                self._record(RolloutEvent(release_id=rid, event="held", stage=k, share=share, at=time.time()))
                self._say(logging.INFO, f"release {rid} held after stage {k}")
                return "held"
        installed = [a for a, r in self._reports(rid).items() if not r.refused]
        publish_release(self.fleet, release, round, self.releases_dir, have=installed)
        self.observer.released(rid)
        self._show(rid, len(stages), "promoted", len(installed), len(self._reports(rid)), measured=verdict)
        self._record(RolloutEvent(release_id=rid, event="promoted", stage=len(stages), share=1.0, at=time.time()))
        self._say(logging.INFO, f"release {rid} promoted: retained and current for the whole fleet")
        return "promoted"

    def _halt(self, rid: str, stage: int, verdict: StageVerdict, stable_frame: bytes | None) -> None:
        self.fleet.releases.unstage()
        self._say(logging.ERROR, f"release {rid} halted at stage {stage}: {'; '.join(verdict.reasons)}")
        self._record(RolloutEvent(release_id=rid, event="halted", stage=stage, verdict=verdict, at=time.time()))
        if stable_frame is None:
            log.warning("no release was current before %s: nothing to roll back to", rid)
            return
        self.rollback(stable_frame, rolled_back=[rid])

    def rollback(self, frame: bytes, rolled_back: list[str]) -> str:
        """Publish ``frame``'s release again under a new sequence: each head agent online that
        holds it is sent its restore form (no bytes), the others it whole; wait for their
        reports. Returns the release id gone back to."""
        again = rollback_release(frame, self.releases_dir, self.config, self.signer, rolled_back=rolled_back)
        on_bad = [a for a, r in self.fleet.releases.installed.items() if r in rolled_back]
        target = again.ref.release_id
        self.inbox.reports_by_release.pop(target, None)  # wait for reports on it as published now
        began = time.monotonic()
        publish_release(self.fleet, again, again.round, self.releases_dir)
        self.observer.released(again.ref.release_id)
        self.inbox.pump_until(self.all_reported(self.fleet.releases.online(), target),
                              self.fleet.clock.now() + self.spec.stage_timeout_s)
        self._record(RolloutEvent(release_id=", ".join(rolled_back), event="rolled_back", to_release=target,
                                  agents=sorted(on_bad), seconds=time.monotonic() - began, at=time.time()))
        self._say(logging.WARNING, f"rolled back to release {target} (sequence {again.ref.sequence}) in "
                                   f"{time.monotonic() - began:.1f} s: {len(on_bad)} head agents were on "
                                   f"{', '.join(rolled_back)}")
        return target


def _points(change: float | None) -> str:
    return "n/a (no device had a report on its previous release)" if change is None else f"{100 * change:+.1f} points"


def release_to_fleet(release: BuiltRelease, round: int, *, config: RunConfig, fleet: Fleet, inbox: Inbox,
                     observer: Observer, releases_dir: Path, signer: Signer | None) -> bool:
    """A round loop's release: by the run's stages when ``rollout.in_runs`` is set and the
    fleet is behind a broker (its round loop waits, first for ``min_head_agents`` head agents,
    then for the stages), else published to every head agent at once. False when a stage
    halted it (the fleet stays on its current release)."""
    if config.rollout.in_runs and fleet.releases.stages:
        online = fleet.releases.online  # first, up to wait_for_agents_s for min_head_agents: stages are shares
        inbox.pump_until(lambda: len(online()) >= config.min_head_agents, fleet.clock.now() + config.wait_for_agents_s)
        return StagedRollout(config, fleet, inbox, observer, releases_dir, signer).roll_out(release) == "promoted"
    publish_release(fleet, release, round, releases_dir)
    return True
