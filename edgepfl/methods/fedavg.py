"""FedAvg [McMahan et al. 2017]: every parameter shared, sample-weighted mean on the server."""

from __future__ import annotations

from .base import Method
from . import register


@register
class FedAvg(Method):
    name = "fedavg"
    summary = "everything shared; sample-weighted averaging"
