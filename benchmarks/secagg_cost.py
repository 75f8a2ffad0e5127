"""What secure aggregation's masking costs an agent and the coordinator, per round.

The masking core (:mod:`edgepfl.secagg`) on the FedAvg CNN's shared parameters (Fashion-MNIST,
feature 64: 118,538 parameters; ``--params`` to change), integers modulo 2**64 (the
protocol's ring, :data:`edgepfl.secagg.RING_BITS`), the neighbour graph of :func:`edgepfl.secagg.default_degree` at a third
dropping out, and a threshold of a majority of the neighbours. For each fleet size:

* **agent**: CPU-seconds of one agent's round, measured — two key pairs, the Shamir shares
  of its secrets encrypted to each neighbour, opening the shares it receives, its masked
  input (one ChaCha20 mask per neighbour and its own);
* (the bytes on the wire, frame by frame: ``benchmarks/secure_rounds.py``);
* **coordinator**: CPU-seconds (and wall seconds) to unmask the sum with a third of the
  agents dropped out after their shares went out — a Shamir reconstruction per agent (its
  self seed if it survived, its mask key if not), batched by
  :func:`edgepfl.secagg.reconstruct_many` (one set of Lagrange coefficients per set of share
  indices, cached, starting empty), one mask per survivor and one per edge between a dropped
  agent and a surviving neighbour. Measured whole where ``--measure-up-to`` allows (every
  agent's masked input is computed, summed and unmasked, and the result checked against the
  plaintext sum, bit for bit); above it, the reconstructions are measured at the indices the
  round's survivors would hold (random share bytes: the work does not depend on them) and the
  masks are their count times the measured time of one, and marked so.
* **one agent's reconstruction**: CPU-seconds to reconstruct one agent's self seed, and its
  mask key, from ``threshold`` shares at indices not seen before (their coefficients computed).

::

    .venv/bin/python benchmarks/secagg_cost.py --agents 10 100 1000

Writes ``benchmarks/results/secagg_cost.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgepfl import secagg  # noqa: E402
from edgepfl.secagg import (  # noqa: E402
    Masker,
    RoundKeys,
    default_degree,
    neighbour_graph,
    reconstruct_many,
    reconstruct_mask_key,
    reconstruct_seed,
    unmask,
)

from results_io import write_results  # noqa: E402

CONTEXT = b"bench\0round-0"
BITS = secagg.RING_BITS


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_round(n: int, params: int, measure_whole: bool, seed: int = 0) -> dict:
    ids = [f"agent-{i:05d}" for i in range(n)]
    degree = default_degree(n)
    graph = neighbour_graph(ids, degree, b"bench")
    rng = np.random.default_rng(seed)
    # the agent measured: agent 0, with its real neighbours' keys
    me = ids[0]
    neighbours = graph[me]
    started = cpu()
    keys = {a: RoundKeys.generate() for a in [me, *neighbours]}
    key_cpu = (cpu() - started) / len(keys)
    masker = Masker(me, keys[me], {b: keys[b].mask_public for b in neighbours},
                    {b: keys[b].share_public for b in neighbours}, threshold=degree // 2 + 1, bits=BITS,
                    context=CONTEXT)
    x = rng.integers(0, np.iinfo(np.uint64).max, size=params, dtype=np.uint64, endpoint=True)
    t0 = cpu()
    shares = masker.shares_for()
    t1 = cpu()
    # the shares it receives: each neighbour's share for it (made by a neighbour's masker)
    received = []
    for b in neighbours[: min(len(neighbours), 8)]:  # time a few, scale to all (each is the same work)
        other = Masker(b, keys[b], {me: keys[me].mask_public}, {me: keys[me].share_public}, 1, BITS, CONTEXT)
        received.append((other.shares_for()[0], keys[b].share_public))
    t2 = cpu()
    for share, public in received:
        masker.open_share(share, public)
    open_cpu = (cpu() - t2) / len(received) * len(neighbours)
    t3 = cpu()
    masked = masker.masked(x)
    t4 = cpu()
    one_mask = (t4 - t3) / (len(neighbours) + 1)
    agent_cpu = key_cpu + (t1 - t0) + open_cpu + (t4 - t3)
    dropped = round(n / 3)
    edges = sum(len(graph[a]) for a in ids[:dropped]) * (n - dropped) / max(1, n - 1)  # edges from dropped to survivors
    result = {
        "agents": n, "degree": degree, "threshold": degree // 2 + 1, "params": params,
        "agent_cpu_s": agent_cpu, "agent_mask_cpu_s": t4 - t3, "agent_shares_cpu_s": (t1 - t0) + open_cpu,
        "one_mask_cpu_s": one_mask, "masked_bytes": masked.nbytes, "dropped": dropped,
    }
    # reconstructing one agent's secrets from ``threshold`` shares (Shamir in GF(2^128)), with no
    # coefficients cached: in a sparse graph nearly every agent's holders have their own indices
    opened = [maskers_share for maskers_share in (masker_for(b, keys, me, neighbours, degree).open_share(sh, keys[me]
              .share_public) for b, sh in zip(neighbours, shares))]
    secagg._lagrange_at_zero.cache_clear()
    t5 = cpu()
    reconstruct_seed([(i, s) for i, s, _ in opened], degree // 2 + 1)
    seed_cpu = cpu() - t5
    secagg._lagrange_at_zero.cache_clear()
    t6 = cpu()
    reconstruct_mask_key([(i, k) for i, _, k in opened], degree // 2 + 1)
    key_cpu = cpu() - t6
    result.update({"reconstruct_seed_cpu_s": seed_cpu, "reconstruct_key_cpu_s": key_cpu})
    if measure_whole:
        result.update(whole_round(ids, graph, params, dropped, rng))
    else:
        masks = (n - dropped) + edges
        rebuilt = reconstructions(ids, graph, dropped, rng)
        estimate = masks * one_mask + rebuilt["reconstruct_cpu_s"]
        result.update({"unmask_cpu_s": estimate, "unmask_wall_s": None, "unmask_masks": int(masks),
                       "unmask_measured": False, **rebuilt})
    return result


def reconstructions(ids: list[str], graph: dict[str, list[str]], dropped: int, rng) -> dict:
    """The coordinator's reconstructions in a round too large to run whole, measured: each
    survivor's seed and each dropped agent's mask key, from the shares its surviving neighbours
    hold (its ``p``-th neighbour holds index ``p``, as :meth:`Masker.shares_for` numbers them),
    the shares' bytes random (the work depends on the indices only)."""
    gone = set(rng.choice(ids, size=dropped, replace=False))
    (threshold,) = {len(graph[a]) // 2 + 1 for a in ids}  # the neighbour graph is regular

    def held(agent: str, length: int) -> list[tuple[int, bytes]]:
        return [(p, os.urandom(length)) for p, b in enumerate(graph[agent], 1) if b not in gone]

    seeds = [held(a, 16) for a in ids if a not in gone]
    keys = [held(a, 32) for a in ids if a in gone and any(b not in gone for b in graph[a])]
    secagg._lagrange_at_zero.cache_clear()
    started, wall = cpu(), time.perf_counter()
    reconstruct_many(seeds, threshold)
    reconstruct_many(keys, threshold, length=32)
    return {"reconstruct_cpu_s": cpu() - started, "reconstruct_wall_s": time.perf_counter() - wall,
            "index_sets": len({frozenset(i for i, _ in g[:threshold]) for g in seeds + keys})}


def masker_for(agent: str, keys: dict[str, RoundKeys], me: str, neighbours: list[str], degree: int) -> Masker:
    """Neighbour ``agent``'s masker, enough of it to open the shares ``me`` sent it."""
    return Masker(agent, keys[agent], {me: keys[me].mask_public}, {me: keys[me].share_public}, 1, BITS, CONTEXT)


def whole_round(ids: list[str], graph: dict[str, list[str]], params: int, dropped: int, rng) -> dict:
    """Every agent masks, a third drop out, the coordinator unmasks: measured, and checked."""
    keys = {a: RoundKeys.generate() for a in ids}
    maskers = {a: Masker(a, keys[a], {b: keys[b].mask_public for b in graph[a]},
                         {b: keys[b].share_public for b in graph[a]}, threshold=len(graph[a]) // 2 + 1, bits=BITS,
                         context=CONTEXT) for a in ids}
    gone = set(rng.choice(ids, size=dropped, replace=False))
    survivors = [a for a in ids if a not in gone]
    inputs = {a: rng.integers(0, np.iinfo(np.uint64).max, size=params, dtype=np.uint64, endpoint=True)
              for a in survivors}
    held: dict[str, list[tuple[int, bytes, bytes]]] = {a: [] for a in ids}
    for sender in ids:
        for share in maskers[sender].shares_for():
            if share.recipient in survivors:
                held[sender].append(maskers[share.recipient].open_share(share, keys[sender].share_public))
    total = np.zeros(params, dtype=np.uint64)
    for a in survivors:
        total += maskers[a].masked(inputs[a])
    (threshold,) = {m.threshold for m in maskers.values()}  # the neighbour graph is regular
    revealed = [a for a in ids if a in gone and any(b in survivors for b in graph[a])]
    secagg._lagrange_at_zero.cache_clear()
    started, wall = cpu(), time.perf_counter()
    seeds = dict(zip(survivors, reconstruct_many([[(i, s) for i, s, _ in held[a]] for a in survivors], threshold)))
    lost = dict(zip(revealed, reconstruct_many([[(i, k) for i, _, k in held[a]] for a in revealed], threshold,
                                               length=32)))
    reconstruct_cpu, reconstruct_wall = cpu() - started, time.perf_counter() - wall
    result = unmask(total, survivors, graph, {a: keys[a].mask_public for a in ids}, seeds, lost, BITS, CONTEXT)
    unmask_cpu, unmask_wall = cpu() - started, time.perf_counter() - wall
    expected = np.zeros(params, dtype=np.uint64)
    for a in survivors:
        expected += inputs[a]
    assert np.array_equal(result, expected), "the unmasked sum is not the plaintext sum"
    masks = len(survivors) + sum(1 for a in gone for b in graph[a] if b in survivors)
    index_sets = len({frozenset(i for i, _, _ in held[a][:threshold]) for a in [*survivors, *revealed]})
    return {"unmask_cpu_s": unmask_cpu, "unmask_wall_s": unmask_wall, "unmask_masks": masks, "unmask_measured": True,
            "exact": True, "reconstruct_cpu_s": reconstruct_cpu, "reconstruct_wall_s": reconstruct_wall,
            "index_sets": index_sets}


def markdown(result: dict) -> str:
    lines = [
        "# Secure aggregation's masking: cost per round",
        "",
        f"`{result['command']}` — {result['machine']}; {result['params']:,} parameters (FedAvg CNN, FMNIST, "
        "feature 64), integers modulo 2**64, a third of the agents dropping out after sending their shares; "
        "the bytes on the wire: benchmarks/secure_rounds.py.",
        "",
        "| agents | neighbours | threshold | agent CPU-s | of it: masks "
        "| coordinator unmask CPU-s (wall s) | of it: Shamir reconstructions CPU-s (wall s) | index sets "
        "| masks it removes | one agent's Shamir reconstruction (seed / key) CPU-s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        unmask = (f"{r['unmask_cpu_s']:.2f} ({r['unmask_wall_s']:.2f})" if r["unmask_measured"]
                  else f"{r['unmask_cpu_s']:.2f} (from the measured parts)")
        lines.append(f"| {r['agents']:,} | {r['degree']} | {r['threshold']} | {r['agent_cpu_s']:.3f} | "
                     f"{r['agent_mask_cpu_s']:.3f} | "
                     f"{unmask} | {r['reconstruct_cpu_s']:.3f} ({r['reconstruct_wall_s']:.3f}) | "
                     f"{r['index_sets']:,} | {r['unmask_masks']:,} | "
                     f"{r['reconstruct_seed_cpu_s']:.4f} / {r['reconstruct_key_cpu_s']:.4f} |")
    lines += ["", "Shamir reconstructions: `edgepfl.secagg.reconstruct_many`, one set of Lagrange coefficients "
                  "per index set (the index sets column), starting with none cached; the result equals PyCryptodome's "
                  "`Shamir.combine`, bit for bit."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--params", type=int, default=118_538)
    parser.add_argument("--measure-up-to", type=int, default=100,
                        help="fleet sizes up to this are run whole (every agent masks; the sum is checked)")
    parser.add_argument("--out", default="benchmarks/results/secagg_cost")
    ns = parser.parse_args(argv)
    rows = []
    for n in ns.agents:
        began = time.monotonic()
        rows.append(one_round(n, ns.params, n <= ns.measure_up_to))
        print(f"{n} agents: {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    result = {"command": "python benchmarks/secagg_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.machine()}, {platform.python_version()}", "params": ns.params, "rows": rows}
    write_results(result, ns.out, markdown)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
