"""Moving a device's normalized data to the preprocessing a run says (numpy only).

Every edgepfl loader normalizes per channel, ``x[c] = (p[c] * PIXEL_SCALE - mean[c]) / std[c]``
with ``p`` the raw 8-bit pixel (:class:`edgepfl.data.ClientData` records ``mean`` and
``std``). A run's :class:`~edgepfl.protocol.DataShape` says which ``pixel_scale``,
``mean`` and ``std`` its model is trained on. Both are affine in ``p``, so one per-channel
multiply-add turns local inputs into the run's exactly; the trainer tier applies it to
every task's data and the head tier to an encoder release's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..protocol.run import PIXEL_SCALE, DataShape

#: the image files a folder of images may hold (an image-folder data set, ``edgepfl predict``):
#: what Pillow reads on every platform we install on
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")

__all__ = ["ChannelAffine", "conversion"]


@dataclass(frozen=True)
class ChannelAffine:
    """``x * scale[c] + shift[c]`` per channel of (N, C, H, W) inputs."""

    scale: np.ndarray
    shift: np.ndarray

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The converted inputs, float32 (a new array)."""
        out = np.asarray(x, np.float32) * self.scale.reshape(1, -1, 1, 1)
        out += self.shift.reshape(1, -1, 1, 1)
        return out


def conversion(local: Mapping[str, Sequence[float]], target: DataShape) -> ChannelAffine | None:
    """The per-channel affine map from inputs normalized with ``local`` (``{"mean", "std"}``,
    from 8-bit pixels scaled by :data:`PIXEL_SCALE`) to the inputs ``target`` describes;
    ``None`` when they already agree (to float32 precision).

    With p the raw pixel: ``x_local = (p/255 - m_l) / s_l`` and the run wants
    ``x = (p * k - m) / s``, ``k = target.pixel_scale``, so
    ``x = x_local * (r s_l / s) + (r m_l - m) / s`` with ``r = k / PIXEL_SCALE``.
    Raises ``ValueError`` when ``target`` has no normalization or the channel counts differ.
    """
    if target.normalization is None:
        raise ValueError("the run does not say how its inputs are normalized")
    m_l, s_l = np.asarray(local["mean"], np.float64), np.asarray(local["std"], np.float64)
    m, s = np.asarray(target.normalization.mean, np.float64), np.asarray(target.normalization.std, np.float64)
    if m_l.shape != m.shape or s_l.shape != s.shape:
        raise ValueError(f"local data has {m_l.size} normalized channels, the run {m.size}")
    r = target.pixel_scale / PIXEL_SCALE
    scale, shift = r * s_l / s, (r * m_l - m) / s
    eps = np.finfo(np.float32).eps
    if np.all(np.abs(scale - 1) <= 4 * eps) and np.all(np.abs(shift) <= 4 * eps):
        return None
    return ChannelAffine(scale.astype(np.float32), shift.astype(np.float32))
