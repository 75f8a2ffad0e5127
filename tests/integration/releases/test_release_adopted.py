"""A coordinator that starts in a new run folder takes the fleet's current release from the
broker's retained copy (an earlier run's), instead of naming none while every head agent
runs it. Real Mosquitto, real coordinators' fleets, a real exported encoder; the attacker
is a plain MQTT client.

What depends on it: the view's current release, the presence (what head agents read), the
next release's delta base, a staged rollout's paired baseline and what a halt rolls back to
(tests/integration/releases/test_rollout_live.py walks those with a new folder)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import paho.mqtt.publish as publish

from edgepfl.config import BrokerConfig, SecuritySpec
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.releases.release import (
    CURRENT_FILE,
    PUBLISHED_FILE,
    publish_release,
    release_of_export,
    resume_release,
)
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import CoordinatorMeta, FederationChannel, decode, federation_topic
from edgepfl.protocol.signing import generate_keypair, load_signer
from edgepfl.testing import TrafficCapture

from tests.export_fixtures import export_dir
from tests.fleet_helpers import data_shape, run_config, wait_until

M = 16_384  # the smallest message size: the encoder is retained in parts, followed from chunk 0


def _presence_release(url: str, federation: str) -> str | None:
    """The release the coordinator's retained presence names (None: none)."""
    with TrafficCapture(url, federation_topic(federation, FederationChannel.COORDINATOR), include_retained=True) as cap:
        frames = wait_until(lambda: cap.snapshot(), 10, what="the retained presence")
        meta = decode(frames[-1][1]).meta_as(CoordinatorMeta)
    return meta.release.release_id if meta.release is not None else None


def _signed_config(tmp_path: Path, name: str = "coordinator"):
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    generate_keypair(keys / f"{name}.key", keys / f"{name}.pub")
    security = SecuritySpec(signing_key=str(keys / f"{name}.key"))
    return run_config(security=security, broker={"max_message_bytes": M}), security


def test_a_round_loop_in_a_new_run_folder_adopts_the_retained_release_and_names_it(mosquitto, tmp_path):
    config, security = _signed_config(tmp_path)
    export = export_dir(tmp_path / "export", "fedavg", rounds=1)
    earlier = tmp_path / "earlier-run" / "releases"
    fleet = MqttFleet(config.federation, BrokerConfig(max_message_bytes=M), url=mosquitto.url, security=security)
    try:
        built = release_of_export(export, earlier, config, fleet.signer)
        parts = publish_release(fleet, built, 1, earlier)
    finally:
        fleet.close()  # the earlier run is over: only the broker's retained copy is left
    assert parts >= 3  # in parts: the new coordinator follows chunk 0 to the others

    fleet = MqttFleet(config.federation, BrokerConfig(max_message_bytes=M), url=mosquitto.url, security=security)
    try:
        coordinator = Coordinator(config, fleet, tmp_path / "new-run", progress=False, **data_shape(config))
        coordinator.init_or_resume()
        coordinator.inbox.pump_until(lambda: coordinator.observer.release is not None, fleet.clock.now() + 20)
        assert coordinator.observer.release == built.release_id  # the view's current release
        assert _presence_release(mosquitto.url, config.federation) == built.release_id
        releases = tmp_path / "new-run" / "releases"
        # recorded as if this run had published it: resumed after a restart, rolled back to, the next delta's base
        assert (releases / CURRENT_FILE).read_bytes() == built.frame
        assert json.loads((releases / PUBLISHED_FILE).read_text())["parts"] == parts
        assert not fleet.releases.adopting and fleet.transport.connection_subscriptions == []
    finally:
        fleet.close()


def test_a_retained_release_not_signed_by_the_coordinators_key_is_not_adopted(mosquitto, tmp_path, caplog):
    config, security = _signed_config(tmp_path)
    export = export_dir(tmp_path / "export", "fedavg", rounds=1)
    generate_keypair(tmp_path / "keys" / "attacker.key", tmp_path / "keys" / "attacker.pub")
    attacker = load_signer(tmp_path / "keys" / "attacker.key")
    forged = release_of_export(export, tmp_path / "attacker", config, attacker)
    # whole on the release topic, retained: a plain client with write access to it (an unprovisioned broker)
    publish.single(federation_topic(config.federation, FederationChannel.RELEASE), forged.frame, qos=1, retain=True,
                   hostname=mosquitto.host, port=mosquitto.port)

    fleet = MqttFleet(config.federation, BrokerConfig(), url=mosquitto.url, security=security)
    try:
        seen: list[str] = []
        with caplog.at_level(logging.WARNING, logger="edgepfl.coordinator"):
            assert resume_release(fleet, tmp_path / "run" / "releases", on_current=lambda r: seen.append(r.release_id)) \
                is None
            wait_until(lambda: (fleet.poll(0.2), "is not adopted" in caplog.text)[1], 20, interval=0,
                       what="the forged release refused")
        assert "bad_signature" in caplog.text and seen == []
        assert not (tmp_path / "run" / "releases" / CURRENT_FILE).exists()
        assert not fleet.releases.adopting  # read once: nothing more arrives on the release topics
        assert fleet.transport.connection_subscriptions == []
    finally:
        fleet.close()


def test_a_coordinators_own_first_release_ends_the_wait_for_a_retained_one(mosquitto, tmp_path):
    config = run_config()
    export = export_dir(tmp_path / "export", "fedavg", rounds=1)
    releases = tmp_path / "run" / "releases"
    fleet = MqttFleet(config.federation, BrokerConfig(), url=mosquitto.url)
    try:
        assert resume_release(fleet, releases) is None
        assert fleet.releases.adopting  # nothing retained: nothing comes, nothing waits for it
        built = release_of_export(export, releases, config)
        publish_release(fleet, built, 1, releases)
        assert not fleet.releases.adopting and fleet.transport.connection_subscriptions == []
        # its own retained release does not come back to it as an earlier run's
        foreign = os.urandom(64)
        publish.single(federation_topic(config.federation, FederationChannel.RELEASE), foreign, qos=1,
                       hostname=mosquitto.host, port=mosquitto.port)
        for _ in range(10):
            fleet.poll(0.1)
        assert (releases / CURRENT_FILE).read_bytes() == built.frame
        assert fleet.transport.bytes_received.get(FederationChannel.RELEASE.value, 0) == 0
    finally:
        fleet.close()
