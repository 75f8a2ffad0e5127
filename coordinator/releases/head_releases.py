"""Which head agents the coordinator sends its current release to, on their own task topic
(PROTOCOL.md §12, "Releases by reference", since 1.4).

The retained copies cannot be relied on to reach a late joiner (RabbitMQ keeps retained
messages on one cluster node only), and a head agent of 1.4 takes none while a coordinator
of 1.4 is online, so the coordinator sends the release itself:

* to a head agent of 1.4 or later whose status names another release or none — not to one
  that names the current release (it downloads nothing), and not to one whose status
  came before it read the presence (no ``capabilities``: it says nothing yet of what it
  has); once per connection of its session, at most :data:`MAX_RELEASE_COPIES` times, so
  statuses forged with ever higher connection numbers cannot make it publish the release
  again and again;
* each new release to every such agent online, except those that said they have none
  while this coordinator named none: they took the retained copies, where the first
  release reaches them;
* never to an agent before 1.4: it subscribes to the retained copies on every connect, so a
  copy sent on its task topic too was a second download of the same release on every
  reconnect (1.49 MB instead of 745 kB for the default CNN). Such an agent takes the
  retained copy (on a RabbitMQ cluster only on the node that holds it: head agents there
  must speak 1.4).

**One release in flight per head agent** (of 1.5 or later, which reports refusals too). A
release sent to a head agent (or taken by it from the retained copies) is *in flight* until
the agent reports on it, installed or refused, or names it in a status, or reconnects. A newer release published meanwhile is
not sent at once: the agent could not install it before the one it is fitting, and every
release published while it fits would cost it a whole download (the delta's base is the
release before, which it does not have yet). When the agent reports, it is sent the
release current then, once. So a head agent whose installs are slower than the rounds
downloads at most one release per install, and skips those it could never have run.

A head agent of 1.7 or later that has the release the current one was made a delta against
— its status named it, or its last report was on it (an agent publishes a status only when
it connects, and reports on each release it installs) — and which decodes the delta's codec
(``capabilities.release_codecs``), is sent the delta instead of the whole release
(docs/COMPRESSION.md, "Release deltas"). If it refuses that release, it is sent the whole
one, once; the retained copies are always whole.

Under a staged rollout (:mod:`.rollout`, since 1.8) a release is first a *candidate*: sent,
by the same rules, only to the head agents admitted to the rollout's stages so far; the
others keep being offered the current release. Promoted, it becomes the current release.
A rollback publishes the release rolled back to again under a new sequence, and sends a
head agent of 1.8 that holds it (installed, or kept as the release before the candidate)
the release's *restore* form, which carries no bytes (PROTOCOL.md §12, "Rollbacks"); one
that refuses it is sent the whole release, once, as after a refused delta.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edgepfl.protocol import (
    RELEASE_DELTAS,
    RELEASE_REFS,
    RELEASE_REFUSALS,
    RELEASE_RESTORE,
    ReleaseRef,
    StatusMeta,
    supports,
)

log = logging.getLogger("edgepfl.coordinator")

#: how many times one release is sent to one session of a head agent (once per connection it
#: reports lacking it on): a broker that restarts twice, not a forger's flood of statuses
MAX_RELEASE_COPIES = 3


@dataclass(frozen=True)
class DeltaRelease:
    """A release as a delta: for head agents that have ``base`` installed and decode ``codec``."""

    base: ReleaseRef
    frame: bytes
    codec: str


@dataclass(frozen=True)
class RestoreRelease:
    """A release in its restore form (no bytes): for head agents of 1.8 or later whose last
    status or report named one of ``holders`` (release ids whose holders keep this release:
    itself, and the candidate installed after it)."""

    frame: bytes
    holders: frozenset[str]


@dataclass(frozen=True)
class _Release:
    frame: bytes
    round: int
    ref: ReleaseRef
    delta: DeltaRelease | None = None
    restore: RestoreRelease | None = None


class HeadReleases:
    """The rule above. ``deliver(agent_id, frame, round)`` sends a frame on the agent's task
    topic (chunked to what it accepts; None when it takes no frame that large)."""

    def __init__(self, deliver: Callable[[str, bytes, int], int | None]):
        self.deliver = deliver
        self._current: _Release | None = None
        #: a staged rollout's release and the agents admitted to it so far
        self._candidate: _Release | None = None
        self.admitted: frozenset[str] = frozenset()
        self._sent_smaller: set[str] = set()  # agents sent a release as a delta or restore: whole if refused
        self._installed: dict[str, str] = {}  # agent id -> the release id its last status or report named
        self._whole_only: set[str] = set()  # agents that refused a smaller form: sent it whole
        self._heads: dict[str, StatusMeta] = {}  # head agents online that speak 1.4: their last status
        # agent id -> (release, session, connection, copies) of what was last sent to it
        self._sent: dict[str, tuple[ReleaseRef, str | None, int | None, int]] = {}
        self._taking_retained: set[str] = set()
        # agent id -> (release id, session, connection) of the release on its way to it or being
        # installed: nothing newer is sent to it on that connection until it reports on it
        self._in_flight: dict[str, tuple[str, str | None, int | None]] = {}
        #: bytes of release frames sent to head agents on their task topics since this process
        #: started, by form: whole, delta, restore (the retained copy is the broker's to send)
        self.sent_bytes: dict[str, int] = {"whole": 0, "delta": 0, "restore": 0}
        #: the same by release id: what each release cost the fleet's links (head_metrics.json)
        self.sent_by_release: dict[str, dict[str, int]] = {}

    def _send(self, agent_id: str, release: _Release, frame: bytes, form: str) -> None:
        if self.deliver(agent_id, frame, release.round) is not None:
            self.sent_bytes[form] += len(frame)
            by_form = self.sent_by_release.setdefault(release.ref.release_id, {"whole": 0, "delta": 0, "restore": 0})
            by_form[form] += len(frame)

    @property
    def current(self) -> tuple[bytes, int, ReleaseRef] | None:
        """The current release: its frame, the round it was exported after, and its name."""
        c = self._current
        return (c.frame, c.round, c.ref) if c is not None else None

    @property
    def ref(self) -> ReleaseRef | None:
        return self._current.ref if self._current is not None else None

    @property
    def installed(self) -> dict[str, str]:
        """Head agents online (1.4 or later) -> the release id their last status or report named."""
        return {a: r for a, r in self._installed.items() if a in self._heads}

    def online(self) -> list[str]:
        """The head agents online that speak 1.4 or later, and have said what they can run."""
        return [a for a, s in self._heads.items() if s.capabilities is not None]

    def published(self, frame: bytes, round: int, ref: ReleaseRef, delta: DeltaRelease | None = None,
                  restore: RestoreRelease | None = None, have: Iterable[str] = ()) -> None:
        """A new release (retained, and named in the presence): sent to every 1.4 head agent
        online that lacks it, as ``delta`` or ``restore`` to those that can take it. ``have``:
        agents known to have it installed already (a promoted candidate's stages)."""
        self._current, self._candidate, self.admitted = _Release(frame, round, ref, delta, restore), None, frozenset()
        self._sent_smaller.clear()
        self._whole_only.clear()
        have = set(have)
        for agent_id in have:
            self._installed[agent_id] = ref.release_id
        for agent_id, status in list(self._heads.items()):
            if agent_id in have and (session := status.session) is not None:
                self._sent[agent_id] = (ref, session, status.connection, 1)  # not sent again
                self._in_flight.pop(agent_id, None)
            elif agent_id in self._taking_retained:  # the retained copies bring it this one
                self._fly(agent_id, ref.release_id, status)
            else:
                self._offer(agent_id, status)
        self._taking_retained.clear()  # the presence names a release now: they drop those subscriptions

    def resumed(self, frame: bytes, round: int, ref: ReleaseRef) -> None:
        """The run's release as published before this coordinator restarted (still retained);
        sent whole (its delta was not kept)."""
        self._current = _Release(frame, round, ref)

    def stage(self, frame: bytes, round: int, ref: ReleaseRef, admitted: Iterable[str],
              delta: DeltaRelease | None = None) -> None:
        """A staged rollout's release, sent to the ``admitted`` agents (those admitted before
        included; an agent online gets it now, one that comes online later when it does)."""
        if self._candidate is None or self._candidate.ref != ref:
            self._candidate = _Release(frame, round, ref, delta)
            self._sent_smaller.clear()
            self._whole_only.clear()
        added = frozenset(admitted) - self.admitted
        self.admitted |= added
        for agent_id in sorted(added):
            if (status := self._heads.get(agent_id)) is not None:
                self._offer(agent_id, status)

    def unstage(self) -> None:
        """The candidate is halted: no agent is sent it any more."""
        self._candidate, self.admitted = None, frozenset()

    def status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        """Told of every status the coordinator accepted; ``came_online``: the agent was offline or unknown."""
        if status.tier != "head" or status.state != "online":
            self._heads.pop(agent_id, None)
            self._sent.pop(agent_id, None)
            self._installed.pop(agent_id, None)
            self._in_flight.pop(agent_id, None)
            self._taking_retained.discard(agent_id)
        elif supports(status.version, RELEASE_REFS):
            self._heads[agent_id] = status
            flight = self._in_flight.get(agent_id)
            if flight is not None and (flight[1:] != (status.session, status.connection) or (
                    status.release is not None and status.release.release_id == flight[0])):
                del self._in_flight[agent_id]  # reconnected (it decides afresh), or it has it now
            if status.release is not None:
                self._installed[agent_id] = status.release.release_id
            else:
                self._installed.pop(agent_id, None)
            if status.capabilities is not None and status.release is None and self._current is None:
                self._taking_retained.add(agent_id)
            else:
                self._taking_retained.discard(agent_id)
            self._offer(agent_id, status)
        elif came_online and self._current is not None:
            log.info("head agent %s speaks protocol %s: it takes the retained release on each connect, so it is "
                     "sent no copy of its own", agent_id, status.version)

    def _release_for(self, agent_id: str) -> _Release | None:
        if self._candidate is not None and agent_id in self.admitted:
            return self._candidate
        return self._current

    def _offer(self, agent_id: str, status: StatusMeta) -> None:
        release = self._release_for(agent_id)
        if release is None or status.capabilities is None:
            return
        ref = release.ref
        if status.release == ref:
            return
        earlier = self._sent.get(agent_id)
        same = earlier is not None and earlier[:2] == (ref, status.session)  # a rollback's sequence is new
        flight = self._in_flight.get(agent_id)
        if flight is not None and flight[0] != ref.release_id:
            log.debug("release %s waits until head agent %s has reported on %s", ref.release_id, agent_id, flight[0])
            return
        if earlier is not None and same:
            if earlier[2] == status.connection:
                return  # it has it on the way, or is installing it
            if earlier[3] >= MAX_RELEASE_COPIES:
                log.warning("not sending release %s to %s again: sent %d times to this session already",
                            ref.release_id, agent_id, earlier[3])
                return
        self._sent[agent_id] = (ref, status.session, status.connection,
                                earlier[3] + 1 if earlier is not None and same else 1)
        self._fly(agent_id, ref.release_id, status)
        smaller, form = self._smaller_for(agent_id, status, release)
        log.info("sending release %s to head agent %s (it has %s)%s", ref.release_id, agent_id,
                 self._installed.get(agent_id, "none"), form)
        if smaller is not None:
            self._sent_smaller.add(agent_id)
            restore = release.restore
            self._send(agent_id, release, smaller,
                       "restore" if restore is not None and smaller is restore.frame else "delta")
        else:
            self._send(agent_id, release, release.frame, "whole")

    def _fly(self, agent_id: str, release_id: str, status: StatusMeta) -> None:
        """``release_id`` is on its way to the agent, or being installed, on its connection: nothing
        newer goes to it there until it reports. Only an agent of 1.5 or later, which reports a
        release it does not install too (a 1.4 one never reports a refusal, and could wait forever)."""
        if supports(status.version, RELEASE_REFUSALS):
            self._in_flight[agent_id] = (release_id, status.session, status.connection)

    def reported(self, agent_id: str, release_id: str | None, refused: bool) -> None:
        """A head agent's report on ``release_id``: it has that release installed, or, when
        ``refused``, it did not install it. A refusal of a release sent in a smaller form (a
        delta or a restore) gets the agent the whole release now, and from then on (it did not
        hold what the smaller form needs, or the result did not hash right)."""
        flight = self._in_flight.get(agent_id)
        settled = flight is not None and release_id == flight[0]
        if settled:
            del self._in_flight[agent_id]
        release = self._release_for(agent_id)
        if not refused:
            if release_id is not None and agent_id in self._heads:
                self._installed[agent_id] = release_id
        elif release is not None and release_id == release.ref.release_id and agent_id in self._sent_smaller:
            self._sent_smaller.discard(agent_id)
            self._whole_only.add(agent_id)
            log.info("head agent %s refused release %s in a smaller form: sending it whole", agent_id, release_id)
            if (status := self._heads.get(agent_id)) is not None:
                self._fly(agent_id, release_id, status)
            self._send(agent_id, release, release.frame, "whole")
            return
        if settled and release is not None and release_id != release.ref.release_id and agent_id in self._heads:
            self._offer(agent_id, self._heads[agent_id])  # what was published while it installed

    def _smaller_for(self, agent_id: str, status: StatusMeta, release: _Release) -> tuple[bytes | None, str]:
        """The frame of ``release`` in a smaller form this agent can take, and a note for the log."""
        if agent_id in self._whole_only:
            return None, ""
        installed = self._installed.get(agent_id)
        restore = release.restore
        if restore is not None and installed in restore.holders and supports(status.version, RELEASE_RESTORE):
            return restore.frame, " to restore from its own files"
        delta = release.delta
        if delta is None:
            return None, ""
        if installed != delta.base.release_id:  # said, so that a fleet that outpaces its installs shows why
            return None, f" whole: its delta is against {delta.base.release_id}"
        codecs = status.capabilities.release_codecs if status.capabilities is not None else None
        if not supports(status.version, RELEASE_DELTAS) or codecs is None or delta.codec not in codecs:
            return None, ""
        return delta.frame, " as a delta"
