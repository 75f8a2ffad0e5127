"""LG-FedAvg [Liang et al. 2020]: personal encoder, shared classifier.

The opposite split to FedPer: each client keeps its own representation and the
federation averages only the linear classifier on top of it. Encoder and head are
trained jointly each local epoch.
"""

from __future__ import annotations

from . import register
from .base import Method


@register
class LGFedAvg(Method):
    name = "lgfedavg"
    summary = "encoder personal, classifier shared"
    shared_parts = ("head",)
