"""Support for testing edgepfl and code built on it: real brokers, broker topologies and traffic capture,
and the method contract as public checks (:func:`check_method`, :func:`method_checks`: imported on first
use, as they need torch; the head contract's check drives the head exporter, so it is
:func:`edgepfl.export.head_contract.check_method_heads`)."""

from typing import Any

from .brokers import MosquittoBridge, MosquittoBroker, TrafficCapture, bridge_config, find_mosquitto
from .rabbitmq import RabbitMQCluster, find_rabbitmq

#: the public method checks, loaded with torch when first named (edgepfl.testing.method_contract)
_METHOD_CHECKS = ("MethodCheck", "NotApplicable", "check_method", "method_checks")


def __getattr__(name: str) -> Any:
    if name in _METHOD_CHECKS:
        from . import method_contract

        return getattr(method_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MethodCheck", "MosquittoBridge", "MosquittoBroker", "NotApplicable", "RabbitMQCluster", "TrafficCapture",
           "bridge_config", "check_method", "find_mosquitto", "find_rabbitmq", "method_checks"]
