"""Support for testing edgepfl and code built on it: real brokers, broker topologies and traffic capture,
and the method and head contracts as public checks (:func:`check_method`, :func:`method_checks`,
:func:`check_method_heads`: imported on first use, as they need torch)."""

from typing import Any

from .brokers import MosquittoBridge, MosquittoBroker, TrafficCapture, bridge_config, find_mosquitto
from .rabbitmq import RabbitMQCluster, find_rabbitmq

#: the public method checks, loaded with torch when first named (edgepfl.testing.method_contract)
_METHOD_CHECKS = ("MethodCheck", "NotApplicable", "check_method", "method_checks")
#: the public head check, loaded when first named (edgepfl.testing.head_contract)
_HEAD_CHECKS = ("check_method_heads",)


def __getattr__(name: str) -> Any:
    if name in _METHOD_CHECKS:
        from . import method_contract

        return getattr(method_contract, name)
    if name in _HEAD_CHECKS:
        from . import head_contract

        return getattr(head_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MethodCheck", "MosquittoBridge", "MosquittoBroker", "NotApplicable", "RabbitMQCluster", "TrafficCapture",
           "bridge_config", "check_method", "check_method_heads", "find_mosquitto", "find_rabbitmq", "method_checks"]
