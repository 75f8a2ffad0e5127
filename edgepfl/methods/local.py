"""Local ("SingleSet", "Local-only"): nothing shared, each client trains alone."""

from __future__ import annotations

from . import register
from .base import Method


@register
class Local(Method):
    name = "local"
    summary = "no collaboration: every parameter personal"
    shared_parts = ()
