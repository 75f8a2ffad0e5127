"""FedBN [Li et al. 2021]: everything shared except BatchNorm layers.

Every BatchNorm layer's affine parameters and running statistics stay on the device
(``bn_policy = "local"``); all other parameters are averaged by sample count.
"""

from __future__ import annotations

from . import register
from .base import Method


@register
class FedBN(Method):
    name = "fedbn"
    summary = "everything shared except BatchNorm layers (parameters and statistics)"
    bn_policy = "local"
