"""``edgepfl release``: releases as a fleet object, between runs (docs/ROLLOUT.md).

::

    edgepfl release publish  --config run.yaml [--run DIR] [--export DIR] [--heads N] [--hold]
    edgepfl release promote  --config run.yaml [--run DIR] [--hold]
    edgepfl release halt     --config run.yaml [--run DIR]
    edgepfl release rollback --config run.yaml [--run DIR]
    edgepfl release status   --run DIR [--json]

``publish`` releases the run's last checkpoint (or an encoder exported before, ``--export``)
by the stages of the config's ``rollout:`` section, halting and rolling back on a failed
gate; with ``--hold`` it stops after each stage that passes, for ``promote`` to go on or
``halt`` to roll it back; ``rollback`` publishes the release before the current one again,
which head agents restore from their own files; ``status`` prints the rollout's record. The first two connect
as the federation's coordinator (its broker login and signing key), so they refuse to run
while the coordinator of the federation is online.
"""

from __future__ import annotations

import json
import logging
import queue
from pathlib import Path
from typing import TYPE_CHECKING

from edgepfl.config import ConfigError, RunConfig
from edgepfl.errors import InputError
from edgepfl.protocol import CoordinatorMeta, FederationChannel, ProtocolError, decode, federation_topic
from edgepfl.protocol.connection import BrokerLogin
from edgepfl.rollout import RolloutEvent

if TYPE_CHECKING:
    from edgepfl.methods import ServerState
    from edgepfl.state import CheckpointMeta

log = logging.getLogger("edgepfl.coordinator.releases.rollout")

#: how long ``publish`` and ``rollback`` look for the coordinator's retained presence
PRESENCE_WAIT_S = 3.0


class RolloutHalted(RuntimeError):
    """A staged rollout stopped at a failed gate (exit code 7)."""


def coordinator_state(url: str, federation: str, login: BrokerLogin, timeout: float = PRESENCE_WAIT_S) -> str | None:
    """The state (``online``, ``done``, ``offline``) of the federation's retained coordinator
    presence, or None when there is none."""
    from ..ops.subscribe import subscribe

    client, got = subscribe(url, federation_topic(federation, FederationChannel.COORDINATOR), login)
    try:
        payload = got.get(timeout=timeout)
    except queue.Empty:
        return None
    finally:
        client.disconnect()
        client.loop_stop()
    if isinstance(payload, Exception):
        raise payload
    if not payload:
        return None
    try:
        return decode(payload).meta_as(CoordinatorMeta).state
    except (ProtocolError, ValueError):
        return None


def _service(config: RunConfig, run: Path, url: str):
    """Connect as the coordinator for releases (after checking that none is online)."""
    from ..fleet import MqttFleet
    from .rollout import ReleaseService

    login = BrokerLogin.from_config(config.broker)
    if coordinator_state(url, config.federation, login) == "online":
        raise ConfigError(f"the coordinator of {config.federation} is online: it publishes releases itself; run "
                          "'edgepfl release' when it is done")
    fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
    service = ReleaseService(config, fleet, run / "releases")
    service.rollout.note = lambda line: print(line, flush=True)  # minutes per stage: each step as it happens
    return service


def publish(config: RunConfig, run: Path, url: str, export: Path | None, heads: int, wait_s: float,
            hold: bool = False) -> int:
    """Roll out the run's checkpoint (or ``export``) by ``config.rollout``; 0 when promoted (or,
    with ``hold``, held after a stage that passed)."""
    from .release import build_release, release_of_export

    source = export if export is not None else _checkpoint(run)
    service = _service(config, run, url)
    try:
        # first: the fleet's current release is known (adopted from the broker in a new run folder),
        # so that the new one is a delta against it, paired with its reports and rolled back to
        online = service.settle(heads, wait_s)
        if isinstance(source, Path):
            release = release_of_export(source, service.releases_dir, config, service.signer)
        else:
            state, meta = source
            release = build_release(state, meta, service.releases_dir, config, signer=service.signer)
        print(f"release {release.release_id} ({release.sizes()}): {len(online)} head agents online; stages "
              f"{', '.join(f'{100 * s:g} %' for s in config.rollout.stages)}", flush=True)
        outcome = service.roll_out(release, hold)
    finally:
        service.close()
    return _finish(run, release.release_id, outcome)


def _checkpoint(run: Path) -> tuple[ServerState, CheckpointMeta]:
    """The run's last checkpoint (state, meta); InputError (exit 3) when it has none."""
    from edgepfl.state import load_checkpoint

    found = load_checkpoint(run / "checkpoint")
    if found is None:
        raise InputError(f"{run / 'checkpoint'} holds no checkpoint: train first, or give --export DIR")
    return found


def promote(config: RunConfig, run: Path, url: str, heads: int, wait_s: float, hold: bool = False) -> int:
    """Go on with the held release (every stage left, or with ``hold`` the next one)."""
    held = _held(run)
    service = _service(config, run, url)
    try:
        service.settle(heads, wait_s)
        outcome = service.rollout.promote(hold)
    finally:
        service.close()
    return _finish(run, held.release_id, outcome)


def halt(config: RunConfig, run: Path, url: str, heads: int, wait_s: float) -> int:
    """Halt the held release and roll its devices back."""
    held = _held(run)
    service = _service(config, run, url)
    try:
        service.settle(heads, wait_s)
        target = service.rollout.halt()
    finally:
        service.close()
    print(f"release {held.release_id} halted" + (f"; the fleet is back on {target}" if target else ""), flush=True)
    print(format_events(read_events(run)), flush=True)
    return 0


def _held(run: Path):
    """The run's held rollout; InputError (exit 3) when none is held."""
    from .rollout import read_held

    held = read_held(run / "releases")
    if held is None:
        raise InputError(f"no release is held in {run / 'releases'} (edgepfl release publish --hold holds one)")
    return held


def _finish(run: Path, release_id: str, outcome: str) -> int:
    print(format_events(read_events(run)), flush=True)
    if outcome == "halted":
        raise RolloutHalted(f"release {release_id} halted at a gate and rolled back; "
                            f"see 'edgepfl release status --run {run}'")
    if outcome == "held":
        print(f"release {release_id} is held: 'edgepfl release promote' goes on, 'edgepfl release halt' rolls it "
              "back", flush=True)
    return 0


def rollback(config: RunConfig, run: Path, url: str, heads: int, wait_s: float) -> int:
    """Publish the release before the current one again; 0 when done."""
    from .release import fleet_current, published_frame

    releases = run / "releases"
    previous = published_frame(releases, previous=True)
    current = fleet_current(releases)
    if previous is None or current is None:
        raise InputError(f"{releases} records no release before the current one: nothing to roll back to")
    service = _service(config, run, url)
    try:
        service.settle(heads, wait_s)
        target = service.rollback(previous, rolled_back=[current.release_id])
    finally:
        service.close()
    print(f"rolled back from release {current.release_id} to {target}", flush=True)
    print(format_events(read_events(run)), flush=True)
    return 0


def read_events(run: Path) -> list[RolloutEvent]:
    """The rollout record of a run directory (a torn last line, from a crash, is left out)."""
    from .rollout import ROLLOUT_LOG

    path = Path(run) / "releases" / ROLLOUT_LOG
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    events = []
    for i, line in enumerate(lines):
        try:
            events.append(RolloutEvent.model_validate_json(line))
        except ValueError:
            if i == len(lines) - 1:
                continue
            raise InputError(f"{path}:{i + 1} is not a rollout record") from None
    return events


def format_events(events: list[RolloutEvent]) -> str:
    """The rollout record as a table."""
    if not events:
        return "no rollout recorded"
    rows = [("release", "event", "stage", "devices", "reported", "refused", "mean change", "worst", "seconds", "why")]
    for e in events:
        v = e.verdict
        stage = f"{e.stage} ({100 * e.share:g} %)" if e.stage is not None and e.share is not None else \
            (str(e.stage) if e.stage is not None else "")
        why = "; ".join(v.reasons) if v is not None and v.reasons else (f"to {e.to_release}" if e.to_release else "")
        rows.append((e.release_id, e.event, stage, str(len(e.agents)) if e.agents else "",
                     str(v.reported) if v else "", str(v.refused) if v else "",
                     _pts(v.mean_change) if v else "", _pts(v.worst_change) if v else "",
                     f"{e.seconds:.1f}" if e.event in ("stage", "rolled_back") else "", why))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows).rstrip()


def status(run: Path, as_json: bool) -> int:
    events = read_events(run)
    if as_json:
        print(json.dumps([e.model_dump(mode="json", exclude_none=True) for e in events], indent=2))
    else:
        print(format_events(events))
    return 0


def _pts(change: float | None) -> str:
    return "" if change is None else f"{100 * change:+.1f}"
