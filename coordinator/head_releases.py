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
* to an agent before 1.4 whenever it comes online (one that has it just reports again).

A head agent of 1.7 or later that has the release the current one was made a delta against
— its status named it, or its last report was on it (an agent publishes a status only when
it connects, and reports on each release it installs) — and which decodes the delta's codec
(``capabilities.release_codecs``), is sent the delta instead of the whole release
(docs/COMPRESSION.md, "Release deltas"). If it refuses that release, it is sent the whole
one, once; the retained copies are always whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from edgepfl.protocol import RELEASE_DELTAS, RELEASE_REFS, ReleaseRef, StatusMeta, supports

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


class HeadReleases:
    """The rule above. ``deliver(agent_id, frame, round)`` sends a frame on the agent's task
    topic (chunked to what it accepts; None when it takes no frame that large)."""

    def __init__(self, deliver: Callable[[str, bytes, int], int | None]):
        self.deliver = deliver
        #: the current release: its frame, the round it was exported after, and its name
        self.current: tuple[bytes, int, ReleaseRef] | None = None
        #: the current release as a delta against the previous one (None: sent whole to all)
        self.delta: DeltaRelease | None = None
        self._sent_delta: set[str] = set()  # agents sent the current release as a delta
        self._installed: dict[str, str] = {}  # agent id -> the release id its last status or report named
        self._whole_only: set[str] = set()  # agents that refused it as a delta: sent it whole
        self._heads: dict[str, StatusMeta] = {}  # head agents online that speak 1.4: their last status
        # agent id -> (release id, session, connection, copies) of what was last sent to it
        self._sent: dict[str, tuple[str, str | None, int | None, int]] = {}
        self._taking_retained: set[str] = set()

    @property
    def ref(self) -> ReleaseRef | None:
        return self.current[2] if self.current is not None else None

    def published(self, frame: bytes, round: int, ref: ReleaseRef, delta: DeltaRelease | None = None) -> None:
        """A new release (retained, and named in the presence): sent to every 1.4 head agent
        online that lacks it, as ``delta`` to those that can take it."""
        self.current, self.delta = (frame, round, ref), delta
        self._sent_delta.clear()
        self._whole_only.clear()
        for agent_id, status in list(self._heads.items()):
            if agent_id not in self._taking_retained:
                self._offer(agent_id, status)
        self._taking_retained.clear()  # the presence names a release now: they drop those subscriptions

    def resumed(self, frame: bytes, round: int, ref: ReleaseRef) -> None:
        """The run's release as published before this coordinator restarted (still retained);
        sent whole (its delta was not kept)."""
        self.current, self.delta = (frame, round, ref), None

    def status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        """Told of every status the coordinator accepted; ``came_online``: the agent was offline or unknown."""
        if status.tier != "head" or status.state != "online":
            self._heads.pop(agent_id, None)
            self._sent.pop(agent_id, None)
            self._installed.pop(agent_id, None)
            self._taking_retained.discard(agent_id)
        elif supports(status.version, RELEASE_REFS):
            self._heads[agent_id] = status
            if status.release is not None:
                self._installed[agent_id] = status.release.release_id
            else:
                self._installed.pop(agent_id, None)
            if status.capabilities is not None and status.release is None and self.current is None:
                self._taking_retained.add(agent_id)
            else:
                self._taking_retained.discard(agent_id)
            self._offer(agent_id, status)
        elif came_online and self.current is not None:
            frame, round, _ = self.current
            self.deliver(agent_id, frame, round)

    def _offer(self, agent_id: str, status: StatusMeta) -> None:
        if self.current is None or status.capabilities is None:
            return
        frame, round, ref = self.current
        if status.release == ref:
            return
        earlier = self._sent.get(agent_id)
        same = earlier is not None and earlier[:2] == (ref.release_id, status.session)
        if earlier is not None and same:
            if earlier[2] == status.connection:
                return  # it has it on the way, or is installing it
            if earlier[3] >= MAX_RELEASE_COPIES:
                log.warning("not sending release %s to %s again: sent %d times to this session already",
                            ref.release_id, agent_id, earlier[3])
                return
        self._sent[agent_id] = (ref.release_id, status.session, status.connection,
                                earlier[3] + 1 if earlier is not None and same else 1)
        delta = self._delta_for(agent_id, status)
        log.info("sending release %s to head agent %s (it has %s)%s", ref.release_id, agent_id,
                 status.release.release_id if status.release else "none", " as a delta" if delta else "")
        if delta is not None:
            self._sent_delta.add(agent_id)
            self.deliver(agent_id, delta.frame, round)
        else:
            self.deliver(agent_id, frame, round)

    def reported(self, agent_id: str, release_id: str | None, refused: bool) -> None:
        """A head agent's report on ``release_id``: it has that release installed, or, when
        ``refused``, it did not install it. A refusal of the current release sent as a delta
        gets the agent the whole release now, and from then on (its installed release was
        not the delta's base, or the result did not hash right)."""
        if not refused:
            if release_id is not None and agent_id in self._heads:
                self._installed[agent_id] = release_id
            return
        if self.current is None or release_id != self.current[2].release_id or agent_id not in self._sent_delta:
            return
        self._sent_delta.discard(agent_id)
        self._whole_only.add(agent_id)
        frame, round, ref = self.current
        log.info("head agent %s refused release %s as a delta: sending it whole", agent_id, ref.release_id)
        self.deliver(agent_id, frame, round)

    def _delta_for(self, agent_id: str, status: StatusMeta) -> DeltaRelease | None:
        delta = self.delta
        if delta is None or agent_id in self._whole_only or self._installed.get(agent_id) != delta.base.release_id:
            return None
        codecs = status.capabilities.release_codecs if status.capabilities is not None else None
        if not supports(status.version, RELEASE_DELTAS) or codecs is None or delta.codec not in codecs:
            return None
        return delta
