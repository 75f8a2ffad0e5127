"""Buffered asynchronous rounds (FedBuff): a method whose server step needs a
synchronous round says so when the config is validated. The rounds themselves, on the
in-process virtual clock and over Mosquitto: tests/integration/rounds/test_buffered_rounds_live.py."""

from __future__ import annotations

import pytest

from edgepfl.config import ConfigError, RunConfig, parse_config


def test_a_method_whose_server_step_needs_a_synchronous_round_says_so_at_validation():
    with pytest.raises(ConfigError, match="fedpac's server step needs every update of a synchronous round"):
        parse_config(RunConfig, {"method": {"name": "fedpac"}, "asynchrony": {"mode": "buffered"}}, "test")
    assert parse_config(RunConfig, {"method": {"name": "fedavg"}, "asynchrony": {"mode": "buffered"}}, "test")
