"""The roll call: presence that does not depend on the broker's retained messages.

Presence is retained (``docs/PROTOCOL.md`` §11), and on most brokers a coordinator that
subscribes learns every agent's status from the broker. Some brokers do not deliver it:
RabbitMQ keeps retained messages per cluster node and never sends them on a wildcard
subscription, so a coordinator there would see only agents that connect after it. So the
coordinator's presence carries a ``session`` id, fresh on each of its connections, and an
agent answers each new session once by re-publishing its status: a live message, which
every broker routes, across bridges and cluster nodes alike.
"""

from __future__ import annotations

from .messages import CoordinatorMeta


class RollCall:
    """An agent's side of the roll call: which coordinator presences ask it to re-announce."""

    def __init__(self) -> None:
        self._answered = ""

    def due(self, presence: CoordinatorMeta) -> bool:
        """Whether to re-publish the status now; true once per ``online`` coordinator session.

        A presence without a session (an older coordinator) or not ``online`` asks nothing;
        the per-round presences of one session ask only the first time.
        """
        if presence.state != "online" or not presence.session or presence.session == self._answered:
            return False
        self._answered = presence.session
        return True
