"""Task deltas (protocol 1.7): a round's tasks carry the change of the shared state since the
previous round's tasks, quantized, to the agents that hold those (docs/COMPRESSION.md, "Task
deltas").

With ``compression.downlink`` set, each new state's shared tensors are moved onto the grid
of their change from the state the round's tasks carried: ``previous + dequantized change``,
rounded stochastically (unbiased) by the run's seed and the round. That *is* the
adopted state — checkpointed, sent whole to whoever lacks the previous one, and the
reference every answer is checked against — so an agent that applies the change holds
exactly what the coordinator holds, and nothing drifts between them: the rounding only adds
unbiased noise to each server step. Tensors the method or the codec keep exact (BatchNorm
statistics, integers, a method's ``server/`` extras, per-agent tensors) go as they are.

A round's tasks go as a delta to an agent of 1.7 or later that announced the codec and
answered its task of the previous round in the same session (it holds those tensors);
everyone else, the first round after a start or a resume, a rolled-back state and a task
sent again get the tensors whole. An agent that cannot apply a delta refuses the task
(``no_base``): it sits that round out and, having answered nothing, gets the next one whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from edgepfl.codecs import CodecSpec, Encoded, decode, encode
from edgepfl.config import RunConfig
from edgepfl.methods import Method, ServerState
from edgepfl.protocol import TASK_DELTAS, Capabilities, TaskDelta, supports
from edgepfl.protocol.codec import UplinkSpec, tensors_digest

from .registry import AgentInfo
from .result import RoundResult
from .round_tasks import RoundTasks

log = logging.getLogger("edgepfl.coordinator")

#: the random stream of the state's stochastic rounding (with the run's seed and the round)
DOWNLINK_STREAM = 0xD0317


@dataclass(frozen=True)
class StateDelta:
    """How the adopted state's shared tensors differ from the state of round ``base_round``'s tasks."""

    base_round: int
    #: the adopted state's global tensors (by identity: a later state, or a rollback, is another dict)
    tensors: dict[str, np.ndarray]
    encoded: Encoded


class DownlinkChain:
    """The rounding of each new state and who may get the next round's tasks as a delta."""

    def __init__(self, config: RunConfig, method: Method):
        codec = config.compression.downlink
        self.spec = None if codec == "none" else CodecSpec.from_name(codec, block=config.compression.block)
        self.seed = config.seed
        #: the method's tensors kept exact, the same prefixes its uploads keep exact
        self.exact = UplinkSpec(codec="none", exact=tuple(type(method).exact_uploads))
        self.delta: StateDelta | None = None
        #: agent -> the session that answered its task of the delta's base round
        self.holders: dict[str, str | None] = {}

    def step(self, candidate: ServerState, base: ServerState, tasks: RoundTasks, result: RoundResult) -> ServerState:
        """The state to adopt after the round of ``tasks``, which carried ``base``: ``candidate``
        with its global tensors on the grid of their change from ``base``'s (unchanged without
        a downlink codec, or when the change cannot be encoded). The round's agents that
        answered on time hold ``base``'s tensors: the next round's tasks may go to them as the change."""
        if self.spec is None:
            return candidate
        round, reference = tasks.round, base.global_tensors
        exact = [name for name in candidate.global_tensors if "/" in name or self.exact.is_exact(name)]
        rng = np.random.default_rng([self.seed, round, DOWNLINK_STREAM])  # a rerun rounds alike
        try:
            encoded = encode(candidate.global_tensors, reference, self.spec, rng, exact=exact)
        except ValueError as exc:  # a non-finite or reshaped tensor: the state goes whole next round
            log.warning("round %d: the new state is sent whole (%s)", round, exc)
            self.delta = None
            return candidate
        decoded = decode(encoded, reference)
        tensors = {name: decoded[name] for name in candidate.global_tensors}
        self.delta = StateDelta(round, tensors, encoded)
        on_time = set(result.evaluations) - set(result.late)
        self.holders = {a: task.session for a in on_time if (task := tasks.get(a)) is not None}
        return replace(candidate, global_tensors=tensors)

    def delta_for(self, state: ServerState, round: int, agent: AgentInfo | None) -> StateDelta | None:
        """The delta ``agent``'s task of ``round``, built from ``state``, may carry, or None (whole):
        only when ``state`` is the one the last :meth:`step` adopted after the round before."""
        delta = self.delta
        if delta is None or agent is None or state.global_tensors is not delta.tensors or delta.base_round != round - 1:
            return None
        codecs = agent.capabilities.codecs if isinstance(agent.capabilities, Capabilities) else None
        if not supports(agent.version, TASK_DELTAS) or not codecs or self.spec is None or self.spec.name not in codecs:
            return None
        if agent.agent_id not in self.holders or self.holders[agent.agent_id] != agent.session:
            return None
        return delta


def delta_body(delta: StateDelta, payload: dict[str, np.ndarray]) -> tuple[TaskDelta, dict[str, np.ndarray]]:
    """A task's ``downlink`` meta and body for ``payload`` (the agent's tensors, whole): the
    delta's streams and exact tensors, and the payload's tensors the state does not hold (a
    method's per-agent ones), exact."""
    own = {name: value for name, value in payload.items() if name not in delta.tensors}
    header = delta.encoded.header.model_copy(update={"exact": (*delta.encoded.header.exact, *own)})
    meta = TaskDelta(base_round=delta.base_round, codec=header, digest=tensors_digest(payload))
    return meta, {**delta.encoded.arrays(), **own}
