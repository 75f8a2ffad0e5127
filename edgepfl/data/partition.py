"""Partitioners: split a pooled labelled dataset over simulated clients.

Every partitioner is a pure function ``(labels, num_clients, spec, rng) -> list of
index arrays``: one sorted int64 array of pool indices per client, pairwise disjoint,
and the same for the same generator seed. ``spec`` is the run's
:class:`~edgepfl.config.PartitionSpec`; each partitioner reads only its own fields.

Helpers used by the client split live here too: :func:`stratified_take` picks a
subset that keeps a client's class proportions (for ``samples_per_client`` caps and
for the per-client train / test split).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..specs import PartitionSpec

Partitioner = Callable[[np.ndarray, int, PartitionSpec, np.random.Generator], list[np.ndarray]]

#: Dirichlet re-draws before giving up (small alpha with many clients may need several)
DIRICHLET_MAX_TRIES = 1000
#: Dirichlet: the smallest client a draw may produce, bounded by what the pool allows
DIRICHLET_MIN_SIZE = 10


class PartitionError(ValueError):
    """The requested partition cannot be made from this pool."""


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(f"labels must be a 1-D integer array, got {labels.dtype}{labels.shape}")
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")
    if len(labels) < num_clients:
        raise PartitionError(f"{len(labels)} samples cannot be split over {num_clients} clients")
    return labels


def _finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for p in parts:
        arr = np.concatenate(p) if isinstance(p, list) else p
        out.append(np.sort(arr.astype(np.int64, copy=False)))
    return out


def iid(labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the pool and deal it into ``num_clients`` near-equal parts."""
    labels = _check(labels, num_clients)
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet(labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dir(alpha).

    The usual FL recipe (Hsu et al. 2019; NIID-Bench): a client already holding its
    ``N / K`` share gets no more of later classes, and the whole draw is repeated until
    every client holds at least ``min(10, N // (2K))`` samples. Smaller alpha -> more
    skewed label distributions.
    """
    labels = _check(labels, num_clients)
    n = len(labels)
    min_size = max(1, min(DIRICHLET_MIN_SIZE, n // (2 * num_clients)))
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(DIRICHLET_MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, spec.alpha))
            p = p * (sizes < n / num_clients)
            if p.sum() <= 0:  # every client full: fall back to the raw draw
                p = rng.dirichlet(np.full(num_clients, spec.alpha))
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for k, piece in enumerate(np.split(idx, cuts)):
                parts[k].append(piece)
                sizes[k] += len(piece)
        if sizes.min() >= min_size:
            return _finish(parts)
    raise PartitionError(
        f"Dirichlet(alpha={spec.alpha}) gave a client fewer than {min_size} samples in "
        f"{DIRICHLET_MAX_TRIES} draws; use a larger alpha or fewer clients"
    )


def pathological(
    labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` classes (shards of those classes).

    Classes are dealt round-robin over a seeded permutation, so every class is held by
    about ``K * k / C`` clients; each class's samples are split into equal shards among
    its holders. With ``K * k < C`` some classes are held by no one and go unused.
    """
    labels = _check(labels, num_clients)
    classes = np.unique(labels)
    k = spec.classes_per_client
    if k > len(classes):
        raise PartitionError(f"classes_per_client={k} but the pool has only {len(classes)} classes")
    order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for i in range(num_clients):
        for j in range(k):
            holders[int(order[(i * k + j) % len(classes)])].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, who in holders.items():
        if not who:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(who):
            raise PartitionError(f"class {c} has {len(idx)} samples for {len(who)} clients")
        for client, shard in zip(who, np.array_split(idx, len(who)), strict=True):
            parts[client].append(shard)
    return _finish(parts)


def _uniform_quota(n_uniform: int, num_classes: int, client: int) -> np.ndarray:
    # the remainder rotates with the client index so clients' extras land on different classes
    q = np.full(num_classes, n_uniform // num_classes, dtype=np.int64)
    extra = n_uniform % num_classes
    q[(client + np.arange(extra)) % num_classes] += 1
    return q


def _dominant_sets(spec: PartitionSpec, num_classes: int) -> list[list[int]]:
    if spec.dominant_sets is None:
        return [[c] for c in range(num_classes)]
    for group in spec.dominant_sets:
        if max(group) >= num_classes:
            raise PartitionError(f"dominant_sets names class {max(group)} but the pool has {num_classes} classes")
    return spec.dominant_sets


def _dominant_demand(n: int, frac: float, num_clients: int, sets: list[list[int]], num_classes: int) -> np.ndarray:
    """(K, C) samples each client takes from each class, when each holds ``n`` samples."""
    n_uniform = int(round(frac * n))
    demand = np.zeros((num_clients, num_classes), dtype=np.int64)
    for i in range(num_clients):
        demand[i] = _uniform_quota(n_uniform, num_classes, i)
        group = sets[i % len(sets)]
        share = np.full(len(group), (n - n_uniform) // len(group), dtype=np.int64)
        share[: (n - n_uniform) % len(group)] += 1
        demand[i, group] += share
    return demand


def dominant(labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """FedPAC's label-shift setting: a share ``uniform_fraction`` of each client's samples
    is spread evenly over all classes, the rest evenly over the client's dominant classes,
    ``dominant_sets[i % len]`` (clients form groups sharing their dominant classes).

    Without ``dominant_sets`` a client has one dominant class, ``client_index mod
    num_classes``, and that class's share is ``(1 - s) + s / C``. FedPAC's published code
    for Fashion-MNIST uses five overlapping sets of three, ``[[0,1,2],[2,3,4],...,[8,9,0]]``.

    All clients get the same size: the largest the pool can supply without reusing a
    sample (``samples_per_client`` then caps it, keeping these proportions).
    """
    labels = _check(labels, num_clients)
    classes = np.unique(labels)
    num_classes = len(classes)
    sets = _dominant_sets(spec, num_classes)
    counts = np.array([(labels == c).sum() for c in classes], dtype=np.int64)
    frac = spec.uniform_fraction

    def fits(n: int) -> bool:
        return bool(np.all(_dominant_demand(n, frac, num_clients, sets, num_classes).sum(0) <= counts))

    # the largest n that fits; demand grows with n, so bisect
    lo, hi = 0, len(labels) // num_clients
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    n = lo
    if n < 1:
        raise PartitionError("the pool is too small for a dominant-class partition over this many clients")
    demand = _dominant_demand(n, frac, num_clients, sets, num_classes)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    used = np.zeros(num_classes, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for i in range(num_clients):
        for c in range(num_classes):
            take = demand[i, c]
            parts[i].append(pools[c][used[c] : used[c] + take])
            used[c] += take
    return _finish(parts)


def domain(labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """IID over labels; the client's images are transformed by its domain at load time
    (see :mod:`edgepfl.data.domains`), so each client is a distinct input domain."""
    return iid(labels, num_clients, spec, rng)


PARTITIONERS: dict[str, Partitioner] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "pathological": pathological,
    "dominant": dominant,
    "domain": domain,
}


def partition(labels: np.ndarray, num_clients: int, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Dispatch to the partitioner named by ``spec.kind``."""
    try:
        fn = PARTITIONERS[spec.kind]
    except KeyError:
        raise PartitionError(f"unknown partition kind {spec.kind!r}; known: {sorted(PARTITIONERS)}") from None
    return fn(labels, num_clients, spec, rng)


def stratified_quota(counts: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``counts`` (largest remainder,
    ties broken by ``rng``); never more than a class holds."""
    counts = np.asarray(counts, dtype=np.int64)
    if total > counts.sum():
        raise ValueError(f"cannot take {total} of {counts.sum()} samples")
    exact = counts * (total / max(1, counts.sum()))
    quota = np.floor(exact).astype(np.int64)
    rest = total - int(quota.sum())
    if rest:
        frac = exact - quota
        order = np.lexsort((rng.random(len(counts)), -frac))
        quota[order[:rest]] += 1
    return quota


def stratified_take(labels: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Positions (into ``labels``) of a seeded subset of size ``total`` whose class
    proportions match ``labels``' as closely as integers allow; sorted."""
    labels = np.asarray(labels)
    classes, inverse = np.unique(labels, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(classes))
    quota = stratified_quota(counts, total, rng)
    picked = [rng.choice(np.flatnonzero(inverse == c), size=q, replace=False) for c, q in enumerate(quota) if q]
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
