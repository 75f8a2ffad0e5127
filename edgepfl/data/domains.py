"""Image transforms that turn IID clients into distinct "domains" for cross-domain runs.

Each transform maps a batch of *normalized* images ``(N, C, H, W)`` float32 to a batch
of the same shape. Inversion and blur need the raw pixel scale, so every transform
gets the dataset's per-channel normalization; noise draws from the generator it is
given, so a client's noisy domain is the same every time it is loaded.
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
    sigma = NOISE_SIGMA / _channel(std)
    return (x + rng.standard_normal(x.shape, dtype=np.float32) * sigma).astype(np.float32)


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
}


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
    """Apply domain transform ``name`` to normalized images ``x`` (N, C, H, W) float32."""
    check_domains([name])
    if x.ndim != 4:
        raise ValueError(f"domain transforms take (N, C, H, W) images, got shape {x.shape}")
    return DOMAINS[name](x, rng, np.asarray(mean, np.float32), np.asarray(std, np.float32))
