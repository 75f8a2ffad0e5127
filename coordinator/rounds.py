"""The round loop, written once for every method and both fleets.

Per round: sample a fraction of the online trainer agents, send each a task
(shared parameters + method payload), collect updates until every sampled agent
answered — or the quorum is met when the round timeout passes — reject and count
stale, duplicate, unknown-agent and malformed updates, run the method's server
step, checkpoint atomically, append a metrics row. A restarted coordinator resumes
after the last checkpointed round with the same global state.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgepfl.config import RunConfig
from edgepfl.methods import ClientUpdate, Method, ServerState, create_method
from edgepfl.protocol import (
    AgentChannel,
    CoordinatorMeta,
    MessageType,
    ProtocolError,
    TaskMeta,
    decode,
    encode,
    new_message_id,
)
from edgepfl.state import load_checkpoint, save_checkpoint

from .fleet import SENDER, Fleet, Incoming
from .gate import Rejection, RoundTasks, Task, UpdateGate
from .progress import Progress

log = logging.getLogger("edgepfl.coordinator")


def seed_for(*parts: object) -> int:
    from hashlib import sha256

    return int.from_bytes(sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") & 0x7FFFFFFF


def sample_agents(online: list[str], fraction: float, seed: int, round: int) -> list[str]:
    """Deterministic per (seed, round): the same sample whether or not the coordinator restarted."""
    if not online:
        return []
    k = max(1, int(round_half_up(fraction * len(online))))
    rng = np.random.default_rng([seed, round])
    return sorted(rng.choice(sorted(online), size=min(k, len(online)), replace=False).tolist())


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


@dataclass
class RoundResult:
    round: int
    updates: list[ClientUpdate] = field(default_factory=list)
    evaluations: dict[str, dict] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    bytes_up: int = 0
    bytes_down: int = 0
    dropped: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)


class Coordinator:
    """Runs a federation described by a :class:`RunConfig` over a :class:`Fleet`."""

    def __init__(self, config: RunConfig, fleet: Fleet, out_dir: str | Path, *, input_shape=None, num_classes=None,
                 class_names=None, normalization=None, progress: bool = True):
        self.config = config
        self.fleet = fleet
        self.out_dir = Path(out_dir)
        self.method: Method = create_method(config.method.name, config.method.options())
        self.input_shape = tuple(input_shape or config.input_shape)
        self.num_classes = int(num_classes or config.num_classes)
        self.class_names = list(class_names or [])
        self.normalization = dict(normalization or {})
        self.progress = Progress(config.rounds, enabled=progress)
        self.rejected_total: Counter = Counter()
        self.head_reports: dict[str, dict] = {}
        self.gate = UpdateGate(config.federation, self.method, fleet.registry, max_bytes=config.broker.max_payload_bytes)
        self._tasks = RoundTasks(-1)
        fleet.on_reject = self._reject
        self.state: ServerState | None = None
        self.start_round = 0

    # ---------------------------------------------------------------- state
    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def _run_dict(self) -> dict:
        c = self.config
        return {
            "method": {"name": c.method.name, **c.method.options()},
            "model": c.model.model_dump(),
            "train": c.train.model_dump(),
            "seed": c.seed,
        }

    def init_or_resume(self) -> None:
        """Fresh server state from a seeded model, or the last checkpoint if one exists."""
        found = load_checkpoint(self.checkpoint_dir)
        if found is not None:
            state, meta = found
            if meta.get("method") != self.config.method.name:
                raise RuntimeError(f"{self.checkpoint_dir} holds a {meta.get('method')} run, config says "
                                   f"{self.config.method.name}; use another --out")
            self.state, self.start_round = state, int(meta["round"]) + 1
            self.rejected_total.update(meta.get("rejected_total", {}))
            log.info("resuming from checkpoint after round %d", meta["round"])
            self._truncate_metrics(self.start_round)
            return
        import torch

        from edgepfl.config import ModelSpec

        torch.manual_seed(seed_for(self.config.seed, "global-init"))
        model = self.method.build_model(ModelSpec(**self.config.model.model_dump()), self.input_shape, self.num_classes)
        self.state = self.method.init_server(model)
        self.start_round = 0

    def run_meta(self, round: int) -> dict:
        """What a checkpoint (and an export) records about this run as of ``round``."""
        return {
            "round": round,
            "method": self.config.method.name,
            "method_options": self.config.method.options(),
            "model": self.config.model.model_dump(),
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "class_names": self.class_names,
            "normalization": self.normalization,
            "run": self.config.model_dump(mode="json"),
            "rejected_total": dict(self.rejected_total),
        }

    def _checkpoint(self, round: int) -> None:
        save_checkpoint(self.checkpoint_dir, self.state, self.run_meta(round))

    # ---------------------------------------------------------------- main loop
    def run(self) -> list[dict]:
        """Wait for agents, run the remaining rounds and a final evaluation; return metrics rows."""
        if self.state is None:
            self.init_or_resume()
        c = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._wait_for_agents()
        rows = []
        for r in range(self.start_round, c.rounds):
            if r > self.start_round:
                # Agents that dropped out get up to one round timeout to come back before we go on without them.
                self._wait_for_agents(required=False)
            self.fleet.announce(CoordinatorMeta(state="online", method=c.method.name, round=r))
            rows.append(self._run_round(r, final=False))
            if c.release_every and (r + 1) % c.release_every == 0 and r + 1 < c.rounds:
                self.release(r)
        rows.append(self._run_round(c.rounds, final=True))
        if c.release_at_end or c.release_every:
            self.release(c.rounds - 1)
            self._collect_head_reports(timeout=c.round_timeout_s)
        self.fleet.announce(CoordinatorMeta(state="done", method=c.method.name, round=c.rounds))
        return rows

    def _wait_for_agents(self, required: bool = True) -> None:
        """Block until ``min_agents`` trainers are online. Before round 0 that is required
        (TimeoutError after ``wait_for_agents_s``); between rounds we wait at most one
        round timeout and go on with whoever is there."""
        need = self.config.min_agents
        wait = self.config.wait_for_agents_s if required else self.config.round_timeout_s
        deadline = time.monotonic() + wait
        last = -1
        while True:
            online = self.fleet.registry.online("trainer")
            if len(online) >= need:
                return
            if len(online) != last:
                self.progress.note(f"waiting for agents: {len(online)}/{need} online")
                last = len(online)
            if time.monotonic() > deadline:
                if not required and online:
                    log.warning("only %d of min_agents=%d online; going on without the others", len(online), need)
                    return
                raise TimeoutError(f"only {len(online)} of min_agents={need} trainer agents came online within "
                                   f"{self.config.wait_for_agents_s:.0f}s")
            self._handle(self.fleet.poll(0.2))

    def _run_round(self, r: int, final: bool) -> dict:
        c = self.config
        started = time.perf_counter()
        online = self.fleet.registry.online("trainer")
        sampled = [] if final else sample_agents(online, c.fraction, c.seed, r)
        evaluators = [a for a in online if a not in sampled] if (final or r % c.eval_every == 0) else []
        result = RoundResult(round=r, sampled=sampled)
        self._tasks, self._result = RoundTasks(r), result
        run = self._run_dict()
        for agent_id, kind in [(a, "train") for a in sampled] + [(a, "evaluate") for a in evaluators]:
            task_id = new_message_id()
            meta = TaskMeta(task_id=task_id, kind=kind, run=run, seed=seed_for(c.seed, r, agent_id),
                            deadline_s=c.round_timeout_s)
            frame = encode(MessageType.TASK, federation=c.federation, sender=SENDER, round=r, meta=meta,
                           tensors=self.method.payload_for(self.state, agent_id))
            self._tasks.add(Task(agent_id, task_id, kind))
            result.bytes_down += self.fleet.send(agent_id, frame, r)
        self._collect(result, sampled, started)
        result.updates.sort(key=lambda u: u.agent_id)
        aborted = False
        if sampled:
            quorum = math.ceil(c.quorum * len(sampled))
            if len(result.updates) >= quorum and result.updates:
                self.state = self.method.server_step(self.state, result.updates, r)
            else:
                aborted = True
                log.warning("round %d: %d of %d updates, below quorum %d; global state unchanged", r,
                            len(result.updates), len(sampled), quorum)
        row = self._row(result, time.perf_counter() - started, final, aborted)
        # Row first, checkpoint second: a crash in between leaves a row that the resumed
        # run drops and writes again (see _truncate_metrics), never a round without a row.
        self._append_metrics(row)
        if sampled:
            self._checkpoint(r)
        self.progress.update(row)
        return row

    def _collect(self, result: RoundResult, sampled: list[str], started: float) -> None:
        c = self.config
        timeout = c.round_timeout_s
        quorum = math.ceil(c.quorum * len(sampled)) if sampled else 0
        hard_deadline = started + 2 * timeout
        while True:
            waiting = sorted(self._tasks.waiting)
            if not waiting:
                return
            elapsed = time.perf_counter() - started
            offline = [a for a in waiting if a not in self.fleet.registry.online()]
            if offline and len(offline) == len(waiting) and len(result.updates) >= quorum:
                result.dropped.extend(offline)
                return
            if elapsed > timeout and len(result.updates) >= quorum:
                result.dropped.extend(waiting)
                log.info("round %d: closed on quorum (%d/%d) after %.0fs; no answer from %s", result.round,
                         len(result.updates), len(sampled), elapsed, ", ".join(waiting))
                return
            if time.perf_counter() > hard_deadline:
                result.dropped.extend(waiting)
                return
            self._handle(self.fleet.poll(0.2))

    # ---------------------------------------------------------------- inbound
    def _reject(self, agent_id: str | None, reason: str, detail: str) -> None:
        self.rejected_total[reason] += 1
        if getattr(self, "_result", None) is not None:
            self._result.rejected[reason] += 1
        log.warning("rejected message from %s: %s (%s)", agent_id or "?", reason, detail)

    def _handle(self, incoming: Incoming | None) -> None:
        if incoming is None:
            return
        if incoming.channel == AgentChannel.METRICS:
            self._handle_metrics(incoming)
            return
        verdict = self.gate.admit(incoming.agent_id, incoming.frame, self._tasks, self.state)
        if isinstance(verdict, Rejection):
            return self._reject(verdict.agent_id, verdict.reason, verdict.detail)
        meta = verdict.meta
        self._result.bytes_up += incoming.wire_bytes
        self._result.evaluations[verdict.agent_id] = {
            "correct": meta.eval_correct, "total": meta.num_test, "loss": meta.eval_loss,
            "train_loss": meta.train_loss, "kind": meta.kind, "train_seconds": meta.train_seconds,
        }
        if verdict.update is not None:
            self._result.updates.append(verdict.update)

    def _handle_metrics(self, incoming: Incoming) -> None:
        try:
            message = decode(incoming.frame)
        except ProtocolError as exc:
            return self._reject(incoming.agent_id, exc.reason, exc.detail)
        if message.type != MessageType.METRICS or message.header.sender != incoming.agent_id:
            return self._reject(incoming.agent_id, "malformed", "not a metrics message from this agent")
        m = message.meta
        self.head_reports[incoming.agent_id] = {
            "tier": m.tier, "release_id": m.release_id, "head": m.head, "correct": m.eval_correct,
            "total": m.num_test, "accuracy": m.eval_correct / m.num_test if m.num_test else None, **m.values,
        }
        log.info("agent %s (%s tier) reported accuracy %.4f with head %s", incoming.agent_id, m.tier,
                 self.head_reports[incoming.agent_id]["accuracy"] or float("nan"), m.head)

    # ---------------------------------------------------------------- releases
    def release(self, round: int) -> str | None:
        """Export the frozen encoder and publish it (retained) for head-tier agents."""
        from .release import build_release

        release_id, frame = build_release(self.state, self.run_meta(round), self.out_dir / "releases", self.config)
        self.fleet.publish_release(frame, round)
        self.progress.note(f"released encoder {release_id} ({len(frame) / 1e6:.2f} MB) to head-tier agents")
        return release_id

    def _collect_head_reports(self, timeout: float) -> None:
        heads = self.fleet.registry.online("head")
        deadline = time.monotonic() + timeout
        while heads and time.monotonic() < deadline:
            if all(a in self.head_reports for a in heads):
                break
            self._handle(self.fleet.poll(0.2))
        if heads:
            self._write_head_reports()

    def _write_head_reports(self) -> None:
        from edgepfl.atomic import write_json

        write_json(self.out_dir / "head_metrics.json", self.head_reports)

    # ---------------------------------------------------------------- metrics
    def _row(self, result: RoundResult, seconds: float, final: bool, aborted: bool) -> dict:
        evals = result.evaluations
        correct = sum(e["correct"] for e in evals.values())
        total = sum(e["total"] for e in evals.values())
        losses = [e["train_loss"] for e in evals.values() if e["train_loss"] is not None]
        return {
            "round": result.round,
            "final": final,
            "accuracy": correct / total if total else None,
            "per_client": {a: (e["correct"] / e["total"] if e["total"] else None) for a, e in sorted(evals.items())},
            "participants": sorted(u.agent_id for u in result.updates),
            "sampled": result.sampled,
            "evaluated": len(evals),
            "dropped": sorted(result.dropped),
            "rejected": dict(result.rejected),
            "aborted": aborted,
            "train_loss": float(np.mean(losses)) if losses else None,
            "bytes_up": result.bytes_up,
            "bytes_down": result.bytes_down,
            "shared_bytes": int(sum(v.nbytes for v in self.state.shared_params().values())),
            "seconds": round(seconds, 4),
        }

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def _append_metrics(self, row: dict) -> None:
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()

    def _truncate_metrics(self, start_round: int) -> None:
        """Drop rows the resumed run will write again (written after the last checkpoint)."""
        if not self.metrics_path.exists():
            return
        keep = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line)["round"] < start_round and not json.loads(line).get("final")]
        from edgepfl.atomic import write_bytes

        write_bytes(self.metrics_path, ("\n".join(keep) + "\n").encode() if keep else b"")
