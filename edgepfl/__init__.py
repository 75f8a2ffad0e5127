"""edgepfl: personalized federated learning for edge and IoT fleets over MQTT.

The shared core imported by both roles:

- :mod:`edgepfl.protocol` — topics, typed messages and the binary envelope;
- :mod:`edgepfl.methods` — one module per federated method and a registry;
- :mod:`edgepfl.models` — encoders and heads (torch, imported lazily);
- :mod:`edgepfl.data` — datasets from local files, partitioners, client splits.
"""

__version__ = "0.1.0"
