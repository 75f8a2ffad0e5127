"""A plain MQTT subscription for the operator's commands (``edgepfl status``, ``dashboard``,
``release``): they read retained topics and never join the federation as a client of it."""

from __future__ import annotations

import queue
from typing import Any

from edgepfl.broker import parse_broker_url
from edgepfl.protocol.connection import BrokerLogin, classify_socket_error


def subscribe(url: str, topic: str, login: BrokerLogin) -> tuple[Any, queue.Queue[bytes | Exception]]:
    """A plain MQTT client subscribed to ``topic`` (its network loop started): each non-empty
    payload, the retained one first, comes on the queue, or the broker's refusal as a
    ConnectionError. The caller disconnects it. ConnectionError when it cannot connect."""
    import paho.mqtt.client as mqtt

    host, port, tls = parse_broker_url(url)
    got: queue.Queue[bytes | Exception] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311, clean_session=True)
    if login.username:
        client.username_pw_set(login.username, login.password)
    if tls:
        client.tls_set_context(login.tls_context())

    def on_connect(c, userdata, flags, reason_code, properties=None):
        if reason_code.is_failure:
            got.put(ConnectionError(f"broker {url} refused the connection: {reason_code}"))
        else:
            c.subscribe(topic, qos=1)

    client.on_connect = on_connect
    client.on_message = lambda c, u, msg: got.put(bytes(msg.payload)) if msg.payload else None
    try:
        client.connect(host, port, keepalive=30)
    except OSError as exc:  # refused, unresolvable, or TLS: the message says which and what to do
        raise ConnectionError(classify_socket_error(exc, host, port).message) from None
    client.loop_start()
    return client, got
