"""A trainer's first task waits for its capabilities (#54: round 0 went out uncompressed).

An agent of protocol 1.2 or later announces itself once before it read the coordinator's
presence, without capabilities, and again with them. A task sent between the two cannot ask
for what the capabilities decide (an uplink codec, a frame limit): the registry does not
offer the trainer for tasks until it declared them, or until ``CAPABILITIES_WAIT_S`` passed
(an agent may leave them out: then it is taken as declaring none). The live round 0 with a
real trainer process: tests/integration/rounds/test_compressed_uplink.py.
"""

from __future__ import annotations

import logging

from edgepfl.coordinator.clock import VirtualClock
from edgepfl.coordinator.registry import CAPABILITIES_WAIT_S, Registry
from edgepfl.protocol import Capabilities, StatusMeta

CODECS = Capabilities(codecs=["q8"])


def birth(session: str, version: str = "1.6", capabilities: Capabilities | None = None,
          tier: str = "trainer") -> StatusMeta:
    return StatusMeta(state="online", tier=tier, num_train=10, version=version, session=session,
                      capabilities=capabilities)


def test_a_trainer_is_offered_for_tasks_once_its_status_declares_capabilities():
    clock = VirtualClock(100.0)
    registry = Registry(clock)
    registry.update("a", birth("a" * 32))  # before it read the presence
    assert registry.eligible() == [] and registry.count_eligible() == 0
    clock.advance_to(101.0)
    registry.update("a", birth("a" * 32, capabilities=CODECS))
    assert registry.eligible() == ["a"]
    assert registry.agents["a"].capabilities == CODECS


def test_a_trainer_that_never_declares_is_offered_after_the_wait_as_declaring_none(caplog):
    clock = VirtualClock(100.0)
    registry = Registry(clock)
    registry.update("a", birth("a" * 32))
    registry.update("a", birth("a" * 32))  # the same process again: the wait runs from its first birth
    clock.advance_to(100.0 + CAPABILITIES_WAIT_S - 0.01)
    assert registry.count_eligible() == 0
    with caplog.at_level(logging.INFO, "edgepfl.coordinator"):
        clock.advance_to(100.0 + CAPABILITIES_WAIT_S)
        assert registry.eligible() == ["a"]
    assert "agent a declared no capabilities" in caplog.text


def test_a_restarted_trainer_waits_again_and_agents_before_1_2_never_wait():
    clock = VirtualClock(0.0)
    registry = Registry(clock)
    registry.update("a", birth("a" * 32, capabilities=CODECS))
    registry.update("old", birth("b" * 32, version="1.1"))  # it has no capabilities to declare
    assert registry.eligible() == ["a", "old"]
    clock.advance_to(50.0)
    registry.update("a", birth("c" * 32))  # a new process, before it read the presence
    assert registry.eligible() == ["old"]
    clock.advance_to(50.5)
    registry.update("a", birth("c" * 32, capabilities=CODECS))
    assert registry.eligible() == ["a", "old"]


def test_the_wait_ends_for_each_trainer_in_the_order_they_came():
    clock = VirtualClock(0.0)
    registry = Registry(clock)
    for i in range(5):
        clock.advance_to(float(i))
        registry.update(f"a{i}", birth(f"{i}" * 32))
    registry.update("a1", birth("1" * 32, capabilities=CODECS))  # declared: out of the queue
    clock.advance_to(2.0 + CAPABILITIES_WAIT_S)
    assert registry.eligible() == ["a0", "a1", "a2"]
    registry.forget("a3")
    clock.advance_to(10.0 + CAPABILITIES_WAIT_S)
    assert registry.eligible() == ["a0", "a1", "a2", "a4"]
