"""The broker helpers that need no broker: finding Mosquitto, parsing broker URLs (both
brokers against real paho-mqtt clients: tests/integration/broker/test_brokers_live.py)."""

from __future__ import annotations

import os

import pytest

from edgepfl.broker import BrokerError, parse_broker_url

from tests.conftest import require_mosquitto


def test_find_mosquitto_finds_the_installed_one():
    path = require_mosquitto()
    assert os.access(path, os.X_OK) and os.path.basename(path) == "mosquitto"


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url,expected",
    [
        ("mqtt://127.0.0.1:1884", ("127.0.0.1", 1884, False)),
        ("mqtt://broker.example.org", ("broker.example.org", 1883, False)),
        ("mqtts://broker.example.org", ("broker.example.org", 8883, True)),
        ("MQTTS://b:9000/", ("b", 9000, True)),
        ("mqtt://[::1]:1883", ("::1", 1883, False)),
    ],
)
def test_parse_broker_url(url, expected):
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize(
    "url,needle",
    [
        ("", "empty"),
        ("127.0.0.1:1883", "scheme"),
        ("http://host:1883", "scheme"),
        ("ws://host", "scheme"),
        ("mqtt://", "no host"),
        ("mqtt://host:notaport", "port"),
        ("mqtt://host:70000", "port"),
        ("mqtt://user:secret@host", "credentials"),
        ("mqtt://host/path", "path"),
        ("mqtt://host?x=1", "path"),
    ],
)
def test_parse_broker_url_rejects(url, needle):
    with pytest.raises(BrokerError, match=needle):
        parse_broker_url(url)
