"""How a release reaches a fleet's head agents: the fleet's release channel.

A :class:`~..fleet.Fleet` sends tasks and receives answers; its ``releases`` channel is
everything a release needs on the way: publishing it retained (whole or in parts, clearing
what an earlier one left), naming it in the coordinator's presence, sending it to each head
agent that lacks it, staging it to some head agents only, and hearing which head agents are
online and what they installed. The base class is a fleet's without head agents (in
process, where every agent is a trainer): nothing is published and nobody is online.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar

from edgepfl.protocol import (
    FederationChannel,
    Message,
    MessageType,
    ProtocolError,
    ReleaseMeta,
    ReleaseRef,
    StatusMeta,
    decode,
    federation_topic,
    parse_topic,
    release_part_topic,
)
from edgepfl.protocol.signing import verify
from edgepfl.protocol.transport import MqttTransport

from .head_releases import DeltaRelease, HeadReleases, RestoreRelease

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

#: ``adopt(frame, message, parts)``: the release a broker retains, decoded, and the part topics it occupies (0: whole)
Adopt = Callable[[bytes, Message, int], None]

log = logging.getLogger("edgepfl.coordinator")


class ReleaseChannel:
    """Releases to the head agents of a fleet that has none: every call is a no-op."""

    #: whether a release can go to some head agents only (a staged rollout's stages)
    stages: ClassVar[bool] = False

    def sent_bytes(self, take: bool = False) -> dict[str, int]:
        """Bytes of release frames sent to head agents on their task topics since the last
        ``take``, by form (whole, delta, restore); the broker's retained copy is not counted."""
        return {}

    def release_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of each release's frames this process sent since it started, by release id and
        form: on head agents' task topics ``whole``, ``delta``, ``restore``; ``retained``, its
        retained copy published (the broker sends that copy on to each agent that takes it)."""
        return {}

    def publish(self, frame: bytes, round: int, earlier_parts: int = 0, ref: ReleaseRef | None = None,
                delta: DeltaRelease | None = None, restore: RestoreRelease | None = None,
                have: Iterable[str] = ()) -> int:
        """Make an encoder release available to head-tier agents, late joiners included.

        ``earlier_parts``: how many retained part topics an earlier release left (0: it was
        whole or there was none), so those this one does not overwrite are cleared; ``ref``:
        the release by reference, announced in the presence; ``delta``: the release as a
        delta against the previous one, for the head agents that have that one; ``restore``:
        its form without bytes, for those that hold it (a rollback); ``have``: agents that
        installed it already (a staged rollout's). Returns the part topics now holding this
        release (0: it is retained whole, or not at all).
        """
        return 0

    def resume(self, frame: bytes, round: int, ref: ReleaseRef, announce: bool = False) -> None:
        """A resumed coordinator's current release, published before it restarted (and still
        retained): named in its presence from now on (with ``announce``, said so at once) and
        sent to head agents that lack it."""

    def adopt_retained(self, adopt: Adopt) -> None:
        """Hand the release retained for the federation, if any, to ``adopt`` once, unless this
        coordinator publishes or resumes one first (a fleet without a broker retains none)."""

    @property
    def adopting(self) -> bool:
        """Whether a retained release may still come to :meth:`adopt_retained`."""
        return False

    def stage(self, frame: bytes, round: int, ref: ReleaseRef, admitted: Iterable[str],
              delta: DeltaRelease | None = None) -> None:
        """A staged rollout's release to the ``admitted`` head agents only (:attr:`stages`)."""
        raise RuntimeError("this fleet has no head agents to stage a release to")

    def unstage(self) -> None:
        """A staged rollout halted: its release goes to no one any more."""

    def online(self) -> list[str]:
        """The head agents online now."""
        return []

    @property
    def installed(self) -> Mapping[str, str]:
        """Head agent -> the release it last said it installed."""
        return {}

    def status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        """Every status the coordinator accepted (a head agent that lacks the current release is sent it)."""

    def reported(self, agent_id: str, release_id: str | None, refused: bool) -> None:
        """Every head agent's report on a release: installed, or ``refused``."""


class BrokerReleaseChannel(ReleaseChannel):
    """Releases over an MQTT broker (PROTOCOL.md §12): retained on the release topic, named
    in the presence, and sent to each head agent that lacks it on its task topic
    (:class:`~.head_releases.HeadReleases`)."""

    stages = True

    def __init__(self, federation: str, transport: MqttTransport, deliver: Callable[[str, bytes, int], int | None],
                 name_release: Callable[[ReleaseRef, bool], None], coordinator_key: Ed25519PublicKey | None = None,
                 on_reject: Callable[[str, str, str], None] | None = None):
        """``deliver`` sends a frame on one agent's task topic; ``name_release(ref, announce)``
        puts a release in the coordinator's presence (and, with ``announce``, publishes it);
        ``coordinator_key``: the key this coordinator signs with, the only one whose retained
        release it adopts (None: an unsigned fleet's coordinator adopts any well-formed one);
        ``on_reject(topic, reason, detail)`` is told of a retained release it refuses, as the
        transport tells of the frames it drops."""
        self.federation = federation
        self.coordinator_key = coordinator_key
        self.on_reject = on_reject
        self._adopt: Adopt | None = None  # set while reading the retained release (adopt_retained)
        self.transport = transport
        self.name_release = name_release
        #: who is sent the current release on their task topic
        self.head_releases = HeadReleases(deliver)
        self._taken: dict[str, int] = {}  # head_releases.sent_bytes at the last sent_bytes(take=True)
        #: release id -> bytes of its retained copies published (once per publish; the broker
        #: then sends that copy to every head agent that takes it, which no one here counts)
        self._retained: dict[str, int] = {}

    def sent_bytes(self, take: bool = False) -> dict[str, int]:
        total = self.head_releases.sent_bytes
        since = {form: n - self._taken.get(form, 0) for form, n in total.items()}
        if take:
            self._taken = dict(total)
        return since

    def release_bytes(self) -> dict[str, dict[str, int]]:
        out = {rid: dict(forms) for rid, forms in self.head_releases.sent_by_release.items()}
        for rid, n in self._retained.items():
            out.setdefault(rid, {})["retained"] = n
        return out

    def publish(self, frame: bytes, round: int, earlier_parts: int = 0, ref: ReleaseRef | None = None,
                delta: DeltaRelease | None = None, restore: RestoreRelease | None = None,
                have: Iterable[str] = ()) -> int:
        """Retained on the release topic when it fits one MQTT message, else as retained parts
        on ``release/<i>``, so a head agent that joins after this coordinator exited still
        gets it; clears what an earlier release left retained and this one does not
        overwrite. Then the presence names it (``ref``), and each head agent of 1.4 or later
        online that lacks it is sent it on its task topic; without ``ref`` it is only retained."""
        self._stop_adopting()  # its own release is current now, and would only come back to it
        topic = federation_topic(self.federation, FederationChannel.RELEASE)
        if len(frame) <= self.transport.max_message_bytes:
            self.transport.publish(topic, frame, retain=True, round=round, wait=True)
            parts = 0
        else:
            _, parts = self.transport.publish_parts(frame, lambda i: release_part_topic(self.federation, i),
                                                    round=round)
            self.transport.clear_retained([topic])
            log.info("release of %d bytes exceeds max_message_bytes: retained in %d parts", len(frame), parts)
        if ref is not None:
            self._retained[ref.release_id] = self._retained.get(ref.release_id, 0) + len(frame)
        stale = range(parts, earlier_parts)
        if stale:
            self.transport.clear_retained(release_part_topic(self.federation, i) for i in stale)
        if ref is not None:
            self.name_release(ref, True)
            self.head_releases.published(frame, round, ref, delta, restore, have)
        return parts

    def resume(self, frame: bytes, round: int, ref: ReleaseRef, announce: bool = False) -> None:
        self._stop_adopting()
        self.name_release(ref, announce)
        self.head_releases.resumed(frame, round, ref)

    def adopt_retained(self, adopt: Adopt) -> None:
        """Subscribe to the release topic and part 0 on this connection (the transport follows
        the other parts): the broker sends what it retains at once, and the fleet hands each
        frame of that channel to :meth:`heard`. Nothing waits here: a broker that retains no
        release sends nothing, and the subscription ends with this coordinator's first release."""
        self._adopt = adopt
        self.transport.subscribe([federation_topic(self.federation, FederationChannel.RELEASE),
                                  release_part_topic(self.federation, 0)])

    @property
    def adopting(self) -> bool:
        return self._adopt is not None

    def heard(self, frame: bytes) -> None:
        """A whole frame of the release channel (its parts reassembled): while :meth:`adopt_retained`
        waits, the retained release, adopted if it is a release of this federation signed by
        this coordinator's key (an unsigned fleet: any); every other frame is ignored."""
        adopt = self._adopt
        followed = self._stop_adopting()
        if adopt is None:
            return
        try:
            message = decode(frame, max_bytes=len(frame))
            if message.header.type is not MessageType.RELEASE or message.header.federation != self.federation:
                raise ProtocolError("malformed", f"a {message.header.type.value} frame of federation "
                                                 f"{message.header.federation} on the release topic")
            meta = message.meta_as(ReleaseMeta)
            if self.coordinator_key is not None and (why := verify(message, self.coordinator_key)) is not None:
                raise ProtocolError(why, "not signed by this coordinator's key")
        except ProtocolError as exc:
            log.warning("the release the broker retains is not adopted (%s: %s): this run names none until it "
                        "publishes one", exc.reason, exc.detail)
            if self.on_reject is not None:  # one rejection, like any frame refused
                self.on_reject(federation_topic(self.federation, FederationChannel.RELEASE), exc.reason, exc.detail)
            return
        parts = [p for t in followed if (p := parse_topic(t).part)]
        adopt(frame, message, max(parts) + 1 if parts else 0)
        log.info("adopted release %s, retained at the broker from an earlier run: current until this run publishes "
                 "one", meta.release_id)

    def _stop_adopting(self) -> list[str]:
        """No retained release to adopt any more: the release subscriptions end. Returns them."""
        if self._adopt is None:
            return []
        self._adopt = None
        return self.transport.drop_connection_subscriptions()

    def stage(self, frame: bytes, round: int, ref: ReleaseRef, admitted: Iterable[str],
              delta: DeltaRelease | None = None) -> None:
        """Neither retained nor named in the presence (:meth:`HeadReleases.stage`)."""
        self.head_releases.stage(frame, round, ref, admitted, delta)

    def unstage(self) -> None:
        self.head_releases.unstage()

    def online(self) -> list[str]:
        return self.head_releases.online()

    @property
    def installed(self) -> Mapping[str, str]:
        return self.head_releases.installed

    def status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        self.head_releases.status(agent_id, status, came_online)

    def reported(self, agent_id: str, release_id: str | None, refused: bool) -> None:
        self.head_releases.reported(agent_id, release_id, refused)
