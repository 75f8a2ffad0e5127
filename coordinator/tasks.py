"""The frames of a round's tasks: what every agent of the round is sent.

Most methods send every agent the same tensors, so :class:`TaskWriter` encodes and hashes
a payload's body once per round and signs each agent's header on its own.
"""

from __future__ import annotations

from edgepfl.config import RunConfig
from edgepfl.methods import Method, ServerState
from edgepfl.protocol import (
    Body,
    Capabilities,
    MessageType,
    RunSpec,
    TaskDelta,
    TaskMeta,
    UplinkSpec,
    encode,
    encode_body,
    new_message_id,
    seed_for,
)
from edgepfl.protocol.secagg import SecAggTask
from edgepfl.protocol.signing import Signer
from edgepfl.protocol.site import SiteOrders

from .downlink import DownlinkChain, delta_body
from .fleet import SENDER
from .registry import AgentInfo


class TaskWriter:
    """Task frames of one round at a time (:meth:`open`, then :meth:`frame` per agent)."""

    def __init__(self, config: RunConfig, run_spec: RunSpec, method: Method, signer: Signer | None):
        self.config = config
        self.run_spec = run_spec
        self.method = method
        self.signer = signer
        self._round = -1
        self._state: ServerState | None = None
        self._epoch = 0
        # The payload is held with its body so that its arrays' ids cannot be reused by
        # another agent's payload while the round's tasks are written.
        self._bodies: dict[tuple, tuple[dict, Body, TaskDelta | None]] = {}
        self._uplink = config.compression.uplink_spec(type(method).exact_uploads)
        #: how the last frame's tensors travelled ("whole", or a task delta's codec): the round counts its bytes so
        self.last_downlink = "whole"
        #: how each new state is rounded, and who gets a round's tasks as a delta (protocol 1.7)
        self.downlink = DownlinkChain(config, method)

    def uplink_for(self, capabilities: Capabilities | None) -> UplinkSpec | None:
        """What a training task asks an agent with these capabilities to compress its update
        with: the run's codec, if the agent announced it (None: uncompressed)."""
        uplink = self._uplink
        if uplink is None or capabilities is None or uplink.codec not in (capabilities.codecs or ()):
            return None
        return uplink

    def open(self, round: int, state: ServerState, epoch: int) -> None:
        """The tasks that follow are round ``round``'s, built from ``state``, of the run begun at ``epoch``."""
        self._round, self._state, self._epoch, self._bodies = round, state, epoch, {}

    def task_bytes(self, state: ServerState) -> int:
        """How large a task frame of this run built from ``state`` is, at least: one carrying
        the global tensors every agent gets. A run's payloads keep their shapes from round to
        round; the tensors a method adds per agent (FedPAC's) are small, and an agent that
        then refuses a task as ``too_large`` is left out of the run like any other."""
        c = self.config
        meta = TaskMeta(task_id=new_message_id(), kind="train", run=self.run_spec, seed=0, deadline_s=c.round_timeout_s,
                        epoch=self._epoch)
        return len(encode(MessageType.TASK, federation=c.federation, sender=SENDER, round=0, meta=meta,
                          tensors=dict(state.global_tensors), signer=self.signer,
                          recipient="size-probe" if self.signer is not None else None))

    def frame(self, agent_id: str, kind: str, task_id: str | None = None,
              uplink: UplinkSpec | None = None, agent: AgentInfo | None = None,
              secagg: SecAggTask | None = None, site: SiteOrders | None = None) -> tuple[str, bytes]:
        """A new task for ``agent_id`` (``train`` or ``evaluate``): its id and its frame; with
        ``task_id``, that task of the open round again (the same id, seed and payload, whole).
        ``uplink``: the codec its update's change is to be compressed with (protocol 1.6);
        ``secagg``: its secure round's part, the update to be masked (protocol 1.9);
        ``agent``: what the registry knows of it, for a task delta (protocol 1.7); ``site``: a
        site aggregator's orders for its devices (protocol 1.13)."""
        if self._state is None:
            raise RuntimeError("open() a round first")
        c = self.config
        delta = self.downlink.delta_for(self._state, self._round, agent) if task_id is None else None
        task_id = task_id or new_message_id()
        payload = self.method.payload_for(self._state, agent_id)
        key = (delta is not None, *((name, id(array)) for name, array in payload.items()))
        if key not in self._bodies:
            downlink, tensors = delta_body(delta, payload) if delta is not None else (None, payload)
            self._bodies[key] = (payload, encode_body(tensors), downlink)
        _, body, downlink = self._bodies[key]
        self.last_downlink = downlink.codec.codec if downlink is not None else "whole"
        meta = TaskMeta(task_id=task_id, kind=kind, run=self.run_spec, seed=seed_for(c.seed, self._round, agent_id),
                        deadline_s=c.round_timeout_s, epoch=self._epoch, uplink=uplink, downlink=downlink,
                        secagg=secagg, site=site)
        # signed per agent over its own header only: the shared body is hashed once per round
        frame = encode(MessageType.TASK, federation=c.federation, sender=SENDER, round=self._round, meta=meta,
                       body=body, signer=self.signer,
                       recipient=agent_id if self.signer is not None else None)
        return task_id, frame
