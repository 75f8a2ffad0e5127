"""Support for testing edgepfl and code built on it: real brokers and traffic capture."""

from .brokers import MosquittoBroker, TrafficCapture, find_mosquitto

__all__ = ["MosquittoBroker", "TrafficCapture", "find_mosquitto"]
