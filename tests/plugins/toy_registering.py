"""A third party's method module that registers its class itself (entry point ``toy_registered = toy_registering``)."""

from __future__ import annotations

from edgepfl.methods import Method, register


@register
class ToyRegistered(Method):
    """Plain FedAvg under a plugin's name."""

    name = "toy_registered"
    summary = "a plugin module that registers its method"
