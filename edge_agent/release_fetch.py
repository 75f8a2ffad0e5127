"""When a head agent takes a release from the broker's retained copies (PROTOCOL.md §12,
"Releases by reference", since 1.4).

A retained release is delivered in full to every subscriber, on every connection: a
head agent that subscribed to the release topics on each connect downloaded the whole
release again after every restart and every broker reconnect, although it had it
installed. So a 1.4 head agent subscribes to them only when it needs them, decided on
each connection by the coordinator's presence, which names the current release:

* a coordinator of 1.4 or later **online** that names a release: never. It sends its
  current release on the agent's task topic when the agent's status names another (or
  none), and every new release to each head agent online; taking the retained copy too
  would download it twice. One that names none (it has published none yet): only when the
  agent has no release at all (an earlier run's may be retained); the coordinator does
  not send its first release to an agent that told it so, which takes the retained copy;
* a **done** presence that names a release: only when it is not the installed one;
* otherwise (the coordinator's last will, an older coordinator, a presence without a
  release, or none within :data:`PRESENCE_WAIT_S` of connecting): unless the release
  installed is the one the last presence of this process named.

Once subscribed on a connection the agent stays subscribed until it reconnects, or until
an ``online`` presence of 1.4 or later names a release (that coordinator then sends what
the agent lacks). Subscribed under an ``online`` presence that names none, it takes one
release: the first whole release frame from the retained topics ends the subscription
before the agent installs it. That coordinator sends every later release itself, and the
presence that names this one is read only after the install: an agent whose installs are
slower than the rounds downloaded every release published meanwhile a second time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from edgepfl.protocol import RELEASE_REFS, CoordinatorMeta, ReleaseRef, supports
from edgepfl.protocol.transport import MqttTransport

log = logging.getLogger("edgepfl.agent")

#: how long after connecting a head agent waits for the coordinator's presence before it
#: falls back to the retained release (a broker that delivers no retained presence)
PRESENCE_WAIT_S = 10.0


def wants_retained(presence: CoordinatorMeta | None, installed: ReleaseRef | None,
                   known: ReleaseRef | None) -> bool:
    """Whether to take the retained release now (the module's rules). ``presence``: the
    coordinator's latest (None: none came); ``installed``: the agent's release; ``known``:
    the release the last presence of this process named."""
    if presence is not None and supports(presence.version, RELEASE_REFS):
        if presence.state == "online":
            return presence.release is None and installed is None
        if presence.release is not None:
            return presence.release != installed
    return installed is None or installed != known


class RetainedReleases:
    """Subscribes a head agent's transport to the retained release ``topics`` on a
    connection where :func:`wants_retained` says so; told of every presence and ticked by
    the agent loop. ``installed`` reads the agent's installed release."""

    def __init__(self, topics: list[str], installed: Callable[[], ReleaseRef | None]):
        self.topics = topics
        self.installed = installed
        #: the release the last presence of a 1.4 coordinator named
        self.known: ReleaseRef | None = None
        self._connection = 0  # the transport connection the state below is about
        self._since = 0.0
        self._heard = False  # a presence arrived on this connection
        self._subscribed = False
        self._said = False
        self._one_release = False  # subscribed under an online presence that named none

    def on_presence(self, transport: MqttTransport, presence: CoordinatorMeta) -> None:
        self._track(transport)
        self._heard = True
        if supports(presence.version, RELEASE_REFS) and presence.release is not None:
            self.known = presence.release
        self._decide(transport, presence)

    def tick(self, transport: MqttTransport) -> None:
        self._track(transport)
        if not self._heard and transport.connected.is_set() and time.monotonic() - self._since >= PRESENCE_WAIT_S:
            self._heard = True  # decided once for this connection
            log.info("no coordinator presence within %.0fs of connecting", PRESENCE_WAIT_S)
            self._decide(transport, None)

    def _track(self, transport: MqttTransport) -> None:
        if transport.connect_count != self._connection:
            self._connection, self._since = transport.connect_count, time.monotonic()
            self._heard = self._subscribed = self._said = self._one_release = False

    def took_release(self, transport: MqttTransport) -> None:
        """A release from the retained topics (a whole frame, the coordinator's signature checked
        where a key is pinned, not yet installed): under an online coordinator that named none,
        the only one this connection takes from there (module docstring)."""
        self._track(transport)
        if self._subscribed and self._one_release:
            self._subscribed = self._one_release = False
            transport.drop_connection_subscriptions()
            log.info("took the coordinator's first release from the retained copies: it sends the next ones itself")

    def _decide(self, transport: MqttTransport, presence: CoordinatorMeta | None) -> None:
        installed = self.installed()
        if wants_retained(presence, installed, self.known):
            if not self._subscribed:
                self._subscribed = True
                self._one_release = presence is not None and presence.state == "online" and \
                    supports(presence.version, RELEASE_REFS)
                log.info("taking the retained release (installed: %s)", _name(installed))
                transport.subscribe(self.topics)
            return
        if self._subscribed and presence is not None and presence.state == "online" and presence.release is not None:
            # subscribed before this coordinator came online (a head agent that started first):
            # it sends what this agent lacks, so the retained copies would come twice
            self._subscribed = False
            transport.drop_connection_subscriptions()
            log.info("the coordinator is online and sends releases itself: not taking the retained ones")
        elif presence is not None and installed is not None and presence.release == installed and not self._said:
            self._said = True  # once per connection, not at every presence
            log.info("release %s is installed and current: nothing to download", _name(installed))


def _name(ref: ReleaseRef | None) -> str:
    return "none" if ref is None else f"{ref.release_id} (sequence {ref.sequence})"
