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
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgepfl.protocol import RELEASE_REFS, ReleaseRef, StatusMeta, supports

log = logging.getLogger("edgepfl.coordinator")

#: how many times one release is sent to one session of a head agent (once per connection it
#: reports lacking it on): a broker that restarts twice, not a forger's flood of statuses
MAX_RELEASE_COPIES = 3


class HeadReleases:
    """The rule above. ``deliver(agent_id, frame, round)`` sends a frame on the agent's task
    topic (chunked to what it accepts; None when it takes no frame that large)."""

    def __init__(self, deliver: Callable[[str, bytes, int], int | None]):
        self.deliver = deliver
        #: the current release: its frame, the round it was exported after, and its name
        self.current: tuple[bytes, int, ReleaseRef] | None = None
        self._heads: dict[str, StatusMeta] = {}  # head agents online that speak 1.4: their last status
        # agent id -> (release id, session, connection, copies) of what was last sent to it
        self._sent: dict[str, tuple[str, str | None, int | None, int]] = {}
        self._taking_retained: set[str] = set()

    @property
    def ref(self) -> ReleaseRef | None:
        return self.current[2] if self.current is not None else None

    def published(self, frame: bytes, round: int, ref: ReleaseRef) -> None:
        """A new release (retained, and named in the presence): sent to every 1.4 head agent online that lacks it."""
        self.current = (frame, round, ref)
        for agent_id, status in list(self._heads.items()):
            if agent_id not in self._taking_retained:
                self._offer(agent_id, status)
        self._taking_retained.clear()  # the presence names a release now: they drop those subscriptions

    def resumed(self, frame: bytes, round: int, ref: ReleaseRef) -> None:
        """The run's release as published before this coordinator restarted (still retained)."""
        self.current = (frame, round, ref)

    def status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        """Told of every status the coordinator accepted; ``came_online``: the agent was offline or unknown."""
        if status.tier != "head" or status.state != "online":
            self._heads.pop(agent_id, None)
            self._sent.pop(agent_id, None)
            self._taking_retained.discard(agent_id)
        elif supports(status.version, RELEASE_REFS):
            self._heads[agent_id] = status
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
        log.info("sending release %s to head agent %s (it has %s)", ref.release_id, agent_id,
                 status.release.release_id if status.release else "none")
        self.deliver(agent_id, frame, round)
