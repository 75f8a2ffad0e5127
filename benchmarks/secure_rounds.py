"""What a secure round costs on the wire and in time: the protocol's real frames
(PROTOCOL.md §19), against a round in the clear, with a third of the round's agents dying
after their shares went out.

Two parts, both with the FedAvg CNN on Fashion-MNIST (feature 64, batch norm: 118,538
shared parameters; digits and an MLP where Fashion-MNIST is absent):

* **bytes per agent-round**, for every fleet size asked (1,000 included): the frames one
  agent of the round sends and receives — advertise, keys, roster, shares, its task with
  the shares sealed to it, its masked update (one int64 per parameter: the exact grid's
  ring is 2**64), unmask, reveal — encoded by the real encoder, with the neighbour count
  and threshold the coordinator would use, against the task and float32 update of a round
  in the clear. Unsigned frames, whole (chunk headers and signatures add the same few
  hundred bytes to both);
* **a real round**, where ``--run-up-to`` allows: the real coordinator (``SecureRounds``)
  and real trainer agents on the in-process fleet, a third of the sampled agents dying as
  their training task arrives (after their keys and shares), one training round secure and
  one in the clear, interleaved, after an untimed warm-up round; bytes from the rows, the process's CPU-seconds and wall
  seconds of each round (every agent's training and masking run in this one process), the
  coordinator's unmasking CPU from the row, and a check that both rounds adopted the same
  state, bit for bit.

::

    .venv/bin/python benchmarks/secure_rounds.py --agents 10 100 1000 --run-up-to 100

Writes ``benchmarks/results/secure_rounds.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgepfl.config import RunConfig  # noqa: E402
from edgepfl.coordinator.fleet import SENDER, LocalFleet  # noqa: E402
from edgepfl.coordinator.rounds import Coordinator  # noqa: E402
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare  # noqa: E402
from edgepfl.data import fmnist_available  # noqa: E402
from edgepfl.edge_agent.tiers import TrainerTier, local_trainers  # noqa: E402
from edgepfl.methods import create_method  # noqa: E402
from edgepfl.protocol import Message, MessageType, TaskMeta, UpdateMeta, encode, new_message_id  # noqa: E402
from edgepfl.protocol.secagg import (  # noqa: E402
    MASKED_TENSOR,
    PeerKeys,
    RevealedShare,
    SealedShare,
    SecAggMeta,
    SecAggTask,
    b64,
)
from edgepfl.secagg import SecureAggregationSpec  # noqa: E402

from results_io import write_results  # noqa: E402

NO_BOUNDS = {"max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}
DROPOUT = 1 / 3


def config(agents: int, secure: bool, group_size: int | None = None) -> RunConfig:
    data = ({"dataset": "fmnist", "samples_per_client": 40} if fmnist_available()
            else {"dataset": "digits"})
    model = {"arch": "cnn", "feature_dim": 64} if fmnist_available() else {"arch": "mlp", "feature_dim": 16}
    return prepare(RunConfig(federation="bench", method={"name": "fedavg"}, model=model, data=data,
                             train={"epochs": 1, "batch_size": 32}, rounds=1, min_agents=agents, fraction=1.0,
                             device="cpu", aggregation=NO_BOUNDS, release_at_end=False,
                             secure_aggregation={"enabled": secure, "group_size": group_size}), agents)


# --------------------------------------------------------------------------- frames
def frame_bytes(agents: int) -> dict:
    """One agent's frames in a round of ``agents``, secure and in the clear (module docstring)."""
    cfg = config(agents, secure=False)
    method = create_method("fedavg")
    shape = data_shape(cfg)
    from edgepfl.coordinator.rounds import initial_state

    state = initial_state(cfg, method, cfg.run_spec(**shape))
    payload = method.payload_for(state, "a")
    params = int(sum(v.size for k, v in payload.items() if "/" not in k))
    spec = SecureAggregationSpec(enabled=True)
    k = spec.degree_for(agents)
    threshold = k // 2 + 1
    ids = [f"agent-{i:04d}" for i in range(k)]
    key = b64(bytes(32))
    run, fed, session = cfg.run_spec(**shape), cfg.federation, new_message_id()

    def meta_frame(meta, sender=SENDER, tensors=None) -> int:
        return len(encode(MessageType.SECAGG if isinstance(meta, SecAggMeta) else
                          MessageType.TASK if isinstance(meta, TaskMeta) else MessageType.UPDATE,
                          federation=fed, sender=sender, round=0, meta=meta, tensors=tensors))

    def task(secagg: SecAggTask | None) -> int:
        return meta_frame(TaskMeta(task_id=new_message_id(), kind="train", run=run, seed=0, deadline_s=60,
                                   secagg=secagg), tensors=dict(payload))

    sealed = [SealedShare(peer=a, ciphertext=b64(bytes(2 + 48 + 16))) for a in ids]
    update = UpdateMeta(task_id=new_message_id(), kind="train", num_train=30, num_test=10, eval_correct=5)
    survivors = ids[: round(k * (1 - DROPOUT))]
    dropped = ids[len(survivors):]
    down = {
        "advertise": meta_frame(SecAggMeta(session=session, step="advertise", threshold=threshold)),
        "roster": meta_frame(SecAggMeta(session=session, step="roster", threshold=threshold,
                                        neighbours=[PeerKeys(agent=a, mask_public=key, share_public=key)
                                                    for a in ids])),
        "task": task(SecAggTask(session=session, shares=sealed)),
        "unmask": meta_frame(SecAggMeta(session=session, step="unmask", survivors=survivors, dropped=dropped)),
    }
    up = {
        "keys": meta_frame(SecAggMeta(session=session, step="keys", keys=PeerKeys(agent="a", mask_public=key,
                                                                                  share_public=key)), "a"),
        "shares": meta_frame(SecAggMeta(session=session, step="shares", shares=sealed), "a"),
        "update": meta_frame(update, "a", {MASKED_TENSOR: np.zeros(params, np.int64)}),
        "reveal": meta_frame(SecAggMeta(
            session=session, step="reveal",
            seeds=[RevealedShare(agent=a, index=i + 1, share=b64(bytes(16))) for i, a in enumerate(survivors)],
            mask_keys=[RevealedShare(agent=a, index=i + 1, share=b64(bytes(32))) for i, a in enumerate(dropped)]),
            "a"),
    }
    plain_down, plain_up = task(None), meta_frame(update, "a", {k: v for k, v in payload.items() if "/" not in k})
    secure_total = sum(down.values()) + sum(up.values())
    return {"agents": agents, "params": params, "neighbours": k, "threshold": threshold,
            "secure_down": down, "secure_up": up, "plain_down": plain_down, "plain_up": plain_up,
            "ratio_total": secure_total / (plain_down + plain_up), "ratio_up": sum(up.values()) / plain_up}


# --------------------------------------------------------------------------- a real round
@dataclass
class Dying:
    """A trainer that dies as its training task of round 0 arrives (after its keys and shares)."""

    tier: TrainerTier
    dies: bool

    def status(self):
        return self.tier.status()

    def handle(self, message: Message):
        if self.dies and message.type == MessageType.TASK and message.meta_as(TaskMeta).kind == "train":
            return None
        return self.tier.handle(message)


def real_round(agents: int, secure: bool, out: Path, group_size: int | None = None) -> tuple[dict, dict]:
    cfg = config(agents, secure, group_size)
    ids = agent_ids(agents)
    dying = set(ids[1::3])  # a third
    devices = {a: Dying(t, a in dying) for a, t in local_trainers(cfg, ids, out).items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), out, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    cpu, wall = time.process_time(), time.perf_counter()
    rows = coordinator.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    row = next(r for r in rows if not r.final)
    s = row.secure
    return ({"secure": secure, "agents": agents, "group_size": group_size, "groups": s.groups if s else None,
             "participants": s.survivors if s else len(row.participants), "aborted": row.aborted,
             "bytes_per_agent": (row.bytes_up + row.bytes_down) / agents, "bytes_up_per_agent": row.bytes_up / agents,
             "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
             "unmask_cpu_s": s.unmask_seconds if s else None, "recovered": s.recovered if s else None},
            coordinator.server_state().global_tensors)


def markdown(result: dict) -> str:
    lines = [f"# Secure rounds: bytes and time ({result['machine']})", "",
             f"`{result['command']}`", "",
             "## Bytes per agent-round, real frames (unsigned, whole)", "",
             "| agents | neighbours | threshold | secure down | secure up | clear down | clear up | total / clear | "
             "up / clear |", "|---|---|---|---|---|---|---|---|---|"]
    for f in result["frames"]:
        lines.append(f"| {f['agents']:,} | {f['neighbours']} | {f['threshold']} | {sum(f['secure_down'].values()):,} | "
                     f"{sum(f['secure_up'].values()):,} | {f['plain_down']:,} | {f['plain_up']:,} | "
                     f"{f['ratio_total']:.2f}x | {f['ratio_up']:.2f}x |")
    lines += ["", "Per step (bytes), at each size: " + "; ".join(
        f"{f['agents']:,}: " + ", ".join(f"{k} {v:,}" for k, v in {**f['secure_down'], **f['secure_up']}.items())
        for f in result["frames"]), ""]
    if result["rounds"]:
        lines += ["## One real round, a third of the agents dying after their shares", "",
                  "| agents | round | updates in the sum | masks removed | bytes / agent | up / agent | CPU-s | wall s | "
                  "unmask CPU-s | same state |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["rounds"]:
            kind = ("clear" if not r["secure"] else "secure" if not r.get("group_size")
                    else f"secure, {r['groups']} groups of ≥ {r['group_size']}")
            lines.append(f"| {r['agents']} | {kind} | {r['participants']} | "
                         f"{r['recovered'] if r['recovered'] is not None else '–'} | {r['bytes_per_agent']:,.0f} | "
                         f"{r['bytes_up_per_agent']:,.0f} | {r['cpu_s']} | {r['wall_s']} | "
                         f"{r['unmask_cpu_s'] if r['unmask_cpu_s'] is not None else '–'} | {r['same_state']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--run-up-to", type=int, default=100, help="run real rounds for fleet sizes up to this")
    parser.add_argument("--out", default="benchmarks/results/secure_rounds")
    parser.add_argument("--group-size", type=int, default=None,
                        help="also run each real round secure in groups of at least this many (group_size)")
    ns = parser.parse_args(argv)
    frames = [frame_bytes(n) for n in ns.agents]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:  # untimed: loads the data and warms torch for both paths alike
        real_round(min(ns.agents), False, Path(tmp) / "warm-up")
    for n in (n for n in ns.agents if n <= ns.run_up_to):
        with tempfile.TemporaryDirectory() as tmp:
            clear, clear_state = real_round(n, False, Path(tmp) / "clear")  # interleaved: clear, then secure, per size
            secure, secure_state = real_round(n, True, Path(tmp) / "secure")
            grouped = (real_round(n, True, Path(tmp) / "grouped", ns.group_size)
                       if ns.group_size is not None and n >= 2 * ns.group_size else None)
        rounds.append({**clear, "same_state": True})
        for run, state in (secure, secure_state), *([grouped] if grouped else []):
            same = set(clear_state) == set(state) and all(np.array_equal(clear_state[k], state[k]) for k in clear_state)
            rounds.append({**run, "same_state": same})
            print(f"{n} agents: clear {clear['wall_s']} s, secure (groups {run['groups']}) {run['wall_s']} s, "
                  f"same state {same}", flush=True)
    result = {"command": "python benchmarks/secure_rounds.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "frames": frames, "rounds": rounds}
    write_results(result, ns.out, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
