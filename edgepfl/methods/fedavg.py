"""FedAvg [McMahan et al. 2017]: every parameter shared, sample-weighted mean on the server."""

from __future__ import annotations

from . import register
from .base import Method


@register
class FedAvg(Method):
    name = "fedavg"
    summary = "everything shared; sample-weighted averaging"
