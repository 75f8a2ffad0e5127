"""Support for testing edgepfl and code built on it: real brokers, broker topologies and traffic capture."""

from .brokers import MosquittoBridge, MosquittoBroker, TrafficCapture, bridge_config, find_mosquitto
from .rabbitmq import RabbitMQCluster, find_rabbitmq

__all__ = ["MosquittoBridge", "MosquittoBroker", "RabbitMQCluster", "TrafficCapture", "bridge_config", "find_mosquitto",
           "find_rabbitmq"]
