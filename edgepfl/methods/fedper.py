"""FedPer [Arivazhagan et al. 2019]: shared encoder, personal classifier, trained jointly."""

from __future__ import annotations

from . import register
from .base import Method


@register
class FedPer(Method):
    name = "fedper"
    summary = "encoder shared, classifier personal, trained jointly"
    shared_parts = ("encoder",)
