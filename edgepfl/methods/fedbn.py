"""FedBN [Li et al. 2021]: everything shared except BatchNorm layers.

Every BatchNorm layer's affine parameters and running statistics stay on the device
(``bn_policy = "local"``); all other parameters are averaged by sample count. The
agent evaluates right after loading the averaged convolutions, under which the stored
statistics (estimated under its own last local model) are stale: ``bn_recalibrate``
(:class:`~edgepfl.methods.base.PersonalBatchNormConfig`) re-estimates them first.
"""

from __future__ import annotations

from . import register
from .base import Method, PersonalBatchNormConfig


@register
class FedBN(Method):
    name = "fedbn"
    summary = "everything shared except BatchNorm layers (parameters and statistics)"
    config_class = PersonalBatchNormConfig
    bn_policy = "local"
