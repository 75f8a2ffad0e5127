"""Transforms that turn IID clients into distinct "domains" for cross-domain runs.

Each transform maps a batch of *normalized* images ``(N, C, H, W)`` float32 to a batch
of the same shape; ``noise`` and ``gain`` (a sensor's own per-channel gain and offset,
the device shift of a sensor fleet) take series ``(N, C, T)`` and vectors ``(N, D)``
too. Inversion, blur and gain need the raw scale, so every transform gets the dataset's
per-channel normalization; noise draws from the generator it is given, so a client's
noisy domain is the same every time it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

#: signature of a domain transform: (x, rng, mean, std) -> x'
DomainFn = Callable[[np.ndarray, np.random.Generator, np.ndarray, np.ndarray], np.ndarray]

#: standard deviation of the "noise" domain, in units of raw pixels ([0, 1] scale)
NOISE_SIGMA = 0.3


def _channel(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float32).reshape(1, -1, 1, 1)


def _identity(x, rng, mean, std):
    return x


def _square(x: np.ndarray, name: str) -> None:
    if x.shape[2] != x.shape[3]:
        raise ValueError(f"domain {name!r} needs square images, got {x.shape[2]}x{x.shape[3]}")


def _rot90(x, rng, mean, std):
    _square(x, "rot90")
    return np.ascontiguousarray(np.rot90(x, k=1, axes=(2, 3)))


def _rot180(x, rng, mean, std):
    return np.ascontiguousarray(x[:, :, ::-1, ::-1])


def _hflip(x, rng, mean, std):
    return np.ascontiguousarray(x[:, :, :, ::-1])


def _invert(x, rng, mean, std):
    # raw' = 1 - raw, rewritten in normalized units: (1 - 2*mean)/std - x
    m, s = _channel(mean), _channel(std)
    return ((1.0 - 2.0 * m) / s - x).astype(np.float32)


def _noise(x, rng, mean, std):
    # sigma is given in raw-pixel units so the corruption is equally strong for every dataset
    sigma = NOISE_SIGMA / np.asarray(std, dtype=np.float32).reshape((1, -1) + (1,) * (x.ndim - 2))
    return (x + rng.standard_normal(x.shape, dtype=np.float32) * sigma).astype(np.float32)


#: ``gain``: a channel's gain is drawn log-uniformly in [1/GAIN_RANGE, GAIN_RANGE] ...
GAIN_RANGE = 1.5
#: ... and its offset from a normal distribution of this many of the channel's standard deviations
OFFSET_SIGMA = 0.5


def _gain(x, rng, mean, std):
    # raw' = g * raw + b * s per channel, in normalized units x' = g x + (g - 1) m / s + b. The
    # draw comes from the generator's seed, not its position, so a device's train and test
    # splits (transformed one after the other) get the same gain and offset
    bits = rng.bit_generator
    seed = getattr(bits, "seed_seq", None) or bits._seed_seq  # public from numpy 1.25
    own = np.random.default_rng(np.random.SeedSequence(seed.entropy, spawn_key=(*seed.spawn_key, 1)))
    channels = x.shape[1]
    g = np.exp(own.uniform(-np.log(GAIN_RANGE), np.log(GAIN_RANGE), channels))
    b = own.normal(0.0, OFFSET_SIGMA, channels)
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    m, s = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    scale = g.astype(np.float32).reshape(per_channel)
    shift = ((g - 1) * m / s + b).astype(np.float32).reshape(per_channel)
    return (x * scale + shift).astype(np.float32)


def _blur(x, rng, mean, std):
    # separable binomial 1-4-6-4-1 kernel: a 5x5 near-gaussian (sigma ~ 1 px), edges replicated
    k = np.array([1.0, 4.0, 6.0, 4.0, 1.0], dtype=np.float32) / 16.0
    out = x
    for axis in (2, 3):
        pad = [(0, 0)] * 4
        pad[axis] = (2, 2)
        p = np.pad(out, pad, mode="edge")
        n = out.shape[axis]
        acc = np.zeros_like(out)
        for i, w in enumerate(k):
            acc += w * np.take(p, np.arange(i, i + n), axis=axis)
        out = acc
    return out.astype(np.float32)


DOMAINS: dict[str, DomainFn] = {
    "identity": _identity,
    "rot90": _rot90,
    "rot180": _rot180,
    "hflip": _hflip,
    "invert": _invert,
    "noise": _noise,
    "blur": _blur,
    "gain": _gain,
}
#: the transforms that take any input kind; the others need images
ANY_KIND = frozenset({"identity", "noise", "gain"})


def check_domains(names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the known transforms if any name is unknown."""
    if not names:
        raise ValueError("partition.domains is empty: give at least one domain transform")
    unknown = [n for n in names if n not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain transform(s) {unknown}; known: {sorted(DOMAINS)}")


def apply_domain(
    name: str,
    x: np.ndarray,
    rng: np.random.Generator,
    mean: Sequence[float],
    std: Sequence[float],
) -> np.ndarray:
    """Apply domain transform ``name`` to normalized inputs ``x`` float32: images (N, C, H, W);
    for the transforms in :data:`ANY_KIND` also series (N, C, T) and vectors (N, D)."""
    check_domains([name])
    if x.ndim != 4 and name not in ANY_KIND:
        raise ValueError(f"domain {name!r} takes (N, C, H, W) images, got shape {x.shape}; the domains of any "
                         f"input are {sorted(ANY_KIND)}")
    return DOMAINS[name](x, rng, np.asarray(mean, np.float32), np.asarray(std, np.float32))
