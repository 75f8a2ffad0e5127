"""Moving a device's normalized data to the preprocessing a run says (numpy only).

Every edgepfl loader normalizes per channel (axis 1), ``x[c] = (p[c] * k - mean[c]) / std[c]``
with ``p`` the raw value and ``k`` its scale: :data:`PIXEL_SCALE` for an image's 8-bit
pixels, 1 for a series' or vector's values (:class:`edgepfl.data.ClientData` records
``mean`` and ``std``). A run's :class:`~edgepfl.protocol.DataShape` says which ``pixel_scale``,
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

__all__ = ["ChannelAffine", "channel_order", "conversion", "local_scale", "normalize"]


def local_scale(data: DataShape) -> float:
    """The scale edgepfl's loaders apply to raw values of ``data``'s kind before normalizing:
    :data:`PIXEL_SCALE` for images (8-bit pixels), 1 for series and vectors."""
    return PIXEL_SCALE if data.input_kind == "image" else 1.0


def channel_order(local: Sequence[str] | None, run: Sequence[str] | None) -> np.ndarray | None:
    """The indices that put local channels (axis 1) in the run's order, by name; ``None``
    when no reordering is needed: the same order, or either side names none (then position
    is all there is to go by). Raises ``ValueError`` (one line, both lists) when the names
    differ: a column the run was trained on is missing, or one it never saw is there."""
    if local is None or run is None or list(local) == list(run):
        return None
    if sorted(local) != sorted(run):
        missing, extra = sorted(set(run) - set(local)), sorted(set(local) - set(run))
        raise ValueError(f"the run's channels are {list(run)}, the local data's {list(local)}"
                         + (f" (missing {missing})" if missing else "") + (f" (not in the run: {extra})" if extra else ""))
    at = {name: i for i, name in enumerate(local)}
    return np.array([at[name] for name in run], dtype=np.int64)


def normalize(raw: np.ndarray, data: DataShape) -> np.ndarray:
    """Raw samples (N, *data.input_shape) as the model takes them: ``(p * pixel_scale - mean[c]) / std[c]``
    per channel, float32 (a new array). Image pixels are raw 8-bit values (an image array of
    floats is taken as already in [0, 1] and not scaled again); without a normalization in
    ``data`` the values are only scaled. Raises ``ValueError`` for another sample shape."""
    raw = np.asarray(raw)
    if raw.ndim != len(data.input_shape) + 1 or tuple(raw.shape[1:]) != tuple(data.input_shape):
        raise ValueError(f"{data.input_kind} inputs must be (N, {', '.join(map(str, data.input_shape))}), "
                         f"got {raw.shape}")
    scale = data.pixel_scale if data.input_kind != "image" or not np.issubdtype(raw.dtype, np.floating) else 1.0
    x = raw.astype(np.float64) * scale
    if data.normalization is not None:
        per_channel = (1, -1) + (1,) * (raw.ndim - 2)
        x -= np.asarray(data.normalization.mean, np.float64).reshape(per_channel)
        x /= np.asarray(data.normalization.std, np.float64).reshape(per_channel)
    return x.astype(np.float32)


@dataclass(frozen=True)
class ChannelAffine:
    """``x * scale[c] + shift[c]`` per channel (axis 1) of (N, C, ...) inputs."""

    scale: np.ndarray
    shift: np.ndarray

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The converted inputs, float32 (a new array)."""
        out = np.asarray(x, np.float32)
        per_channel = (1, -1) + (1,) * (out.ndim - 2)
        out = out * self.scale.reshape(per_channel)
        out += self.shift.reshape(per_channel)
        return out


def conversion(local: Mapping[str, Sequence[float]], target: DataShape) -> ChannelAffine | None:
    """The per-channel affine map from inputs normalized with ``local`` (``{"mean", "std"}``,
    from raw values scaled by :func:`local_scale`: 8-bit pixels by :data:`PIXEL_SCALE`, a
    series' or vector's values by 1) to the inputs ``target`` describes; ``None`` when they
    already agree (to float32 precision).

    With p the raw value: ``x_local = (p * k_l - m_l) / s_l`` and the run wants
    ``x = (p * k - m) / s``, ``k = target.pixel_scale``, so
    ``x = x_local * (r s_l / s) + (r m_l - m) / s`` with ``r = k / k_l``.
    Raises ``ValueError`` when ``target`` has no normalization or the channel counts differ.
    """
    if target.normalization is None:
        raise ValueError("the run does not say how its inputs are normalized")
    m_l, s_l = np.asarray(local["mean"], np.float64), np.asarray(local["std"], np.float64)
    m, s = np.asarray(target.normalization.mean, np.float64), np.asarray(target.normalization.std, np.float64)
    if m_l.shape != m.shape or s_l.shape != s.shape:
        raise ValueError(f"local data has {m_l.size} normalized channels, the run {m.size}")
    r = target.pixel_scale / local_scale(target)
    scale, shift = r * s_l / s, (r * m_l - m) / s
    eps = np.finfo(np.float32).eps
    if np.all(np.abs(scale - 1) <= 4 * eps) and np.all(np.abs(shift) <= 4 * eps):
        return None
    return ChannelAffine(scale.astype(np.float32), shift.astype(np.float32))
