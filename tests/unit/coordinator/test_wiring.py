"""The composition root takes its keys from the run's own ``security`` section: a fleet that
was built without it (an embedding program, a test) must not leave the tasks unsigned."""

from __future__ import annotations

from edgepfl.config import RunConfig
from edgepfl.coordinator.credentials import Credentials
from edgepfl.coordinator.wiring import wire
from edgepfl.protocol.signing import generate_keypair
from edgepfl.specs import SecuritySpec

from tests.unit.coordinator.test_round_loop import ScriptedFleet


def _keys(tmp_path):
    generate_keypair(tmp_path / "coordinator.key", tmp_path / "coordinator.pub")
    (tmp_path / "enrolled").mkdir()
    return SecuritySpec(signing_key=str(tmp_path / "coordinator.key"), enrolled_dir=str(tmp_path / "enrolled"))


def test_a_fleet_loaded_without_the_runs_keys_does_not_unsign_the_run(tmp_path):
    security = _keys(tmp_path)
    fleet = ScriptedFleet({})
    fleet.credentials = Credentials.load(SecuritySpec())  # what an MqttFleet built with no security holds
    side = wire(RunConfig(security=security), fleet, None)
    assert side.credentials.signer is not None and side.credentials.keyring is not None


def test_a_fleet_loaded_from_the_runs_own_keys_is_not_read_twice(tmp_path):
    security = _keys(tmp_path)
    fleet = ScriptedFleet({})
    fleet.credentials = Credentials.load(security)
    assert wire(RunConfig(security=security), fleet, None).credentials is fleet.credentials
