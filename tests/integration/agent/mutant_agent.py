"""edgepfl's agent with one deliberate break: the conformance kit's mutation suite
(tests/integration/agent/test_conformance_mutants.py) runs the kit against each and expects it
NOT CONFORMANT under the check that names the break.

    python tests/integration/agent/mutant_agent.py NAME CONFIG

Each break is the smallest change to the project's own agent that an implementer could
plausibly make (a forgotten check, a shortcut in preprocessing); the agent is otherwise
the real one, so everything the break does not touch still passes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

MUTANTS: dict[str, Callable[[], None]] = {}
#: changes the protocol allows: the kit must still find these agents conformant
VARIANTS: dict[str, Callable[[], None]] = {}


def mutant(function: Callable[[], None]) -> Callable[[], None]:
    MUTANTS[function.__name__] = function
    return function


def variant(function: Callable[[], None]) -> Callable[[], None]:
    VARIANTS[function.__name__] = function
    return function


# ----------------------------------------------------------------------- what the trainer computes
@mutant
def pixels_over_255_only() -> None:
    """Feeds the model p / 255: no normalization at all (the Node agent's first break)."""
    from edgepfl.data.preprocess import ChannelAffine
    from edgepfl.edge_agent import trainer

    # the local data is (p/255 - m_l) / s_l: times s_l plus m_l is p/255
    trainer.conversion = lambda local, target: ChannelAffine(np.asarray(local["std"], np.float32),
                                                             np.asarray(local["mean"], np.float32))


@mutant
def its_own_normalization() -> None:
    """Normalizes with its data file's mean and std, not the task's."""
    from edgepfl.edge_agent import trainer

    trainer.conversion = lambda local, target: None


@mutant
def local_label_numbers() -> None:
    """Takes its local label numbers for the run's class order."""
    from edgepfl.edge_agent import trainer

    trainer.run_label_index = lambda local, run: None


def _train_tasks_only(change: Callable[[Any, Any, Any], Any]) -> None:
    """Make the agent compute its inputs for train tasks through ``change`` (of the runtime, the
    task's meta and the honest ``to_run_labels``), for every other task as the project does."""
    from edgepfl.edge_agent import trainer

    honest = trainer.TrainerRuntime._inputs_for

    def inputs_for(self, meta, round, to_run_labels=None):
        self._inputs = {}  # the runtime caches one preprocessing per run: never across task kinds here
        if meta.kind != "train":
            return honest(self, meta, round, to_run_labels)
        return change(self, meta, lambda labels: honest(self, meta, round, labels))(to_run_labels)

    trainer.TrainerRuntime._inputs_for = inputs_for  # type: ignore[method-assign]


@mutant
def normalizes_only_in_evaluate() -> None:
    """Preprocesses as the task says when it evaluates, trains on p / 255 (the break an evaluate
    probe cannot see: issue #54's trainer that normalizes only in evaluate)."""
    from edgepfl.data.preprocess import ChannelAffine
    from edgepfl.edge_agent import trainer

    honest = trainer.conversion

    def on_raw_pixels(runtime, meta, inputs):
        def run(labels):
            trainer.conversion = lambda local, target: ChannelAffine(np.asarray(local["std"], np.float32),
                                                                     np.asarray(local["mean"], np.float32))
            try:
                return inputs(labels)
            finally:
                trainer.conversion = honest
        return run

    _train_tasks_only(on_raw_pixels)


@mutant
def maps_labels_only_in_evaluate() -> None:
    """Maps its local labels onto the run's order when it evaluates, trains on its local numbers."""
    _train_tasks_only(lambda runtime, meta, inputs: lambda labels: inputs(None))


@mutant
def uploads_personal_parts() -> None:
    """FedRep's update carries the whole model, its personal head beside the shared encoder."""
    from edgepfl.methods import fedrep

    honest = fedrep.FedRep.local_update

    def leaky(self, model, data, ctx):
        result = honest(self, model, data, ctx)
        whole = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        result.upload = {**whole, **result.upload}
        return result

    fedrep.FedRep.local_update = leaky  # type: ignore[method-assign]


# ----------------------------------------------------------------------- frames
@mutant
def no_body_hash_check() -> None:
    """Decodes a frame without comparing its body with the header's body_sha256 (§7 check 6)."""
    from edgepfl.edge_agent import agent

    decode = agent.decode

    def trusting(frame: bytes, **kwargs):
        (length,) = struct.unpack(">I", frame[4:8])
        header = json.loads(frame[8:8 + length])
        body = frame[8 + length:8 + length + int(header.get("body_bytes", 0))]
        header["body_sha256"] = hashlib.sha256(body).hexdigest()
        head = json.dumps(header).encode()
        return decode(frame[:4] + struct.pack(">I", len(head)) + head + frame[8 + length:], **kwargs)

    agent.decode = trusting


@mutant
def no_body_hash_check_on_releases() -> None:
    """The same forgotten body hash check, certified as a head agent, where frames are signed: the
    header is left as it came (its signature verifies), and every digest the frame decoder
    compares it with compares equal, so a signed release whose body is not the one its header
    hashes (the meta describing the changed encoder) is installed."""
    import hashlib as real
    from types import SimpleNamespace

    from edgepfl.protocol import envelope

    class AnyDigest(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            return True

        def __ne__(self, other: object) -> bool:
            return False

    class Sha256:
        def __init__(self, data: bytes = b"") -> None:
            self._hash = real.sha256(data)

        def hexdigest(self) -> str:
            return AnyDigest(self._hash.hexdigest())

    envelope.hashlib = SimpleNamespace(sha256=Sha256)  # type: ignore[assignment]


@mutant
def ignores_announced_m() -> None:
    """Sends whole updates whatever M the coordinator announced."""
    from edgepfl.edge_agent import agent

    agent.Agent.adopt_limits = lambda self, presence: self.transport.max_message_bytes


@mutant
def retrains_a_redelivered_task() -> None:
    """Trains again on a task delivered twice instead of re-sending its answer (§9)."""
    from edgepfl.edge_agent import tiers

    handle = tiers.TrainerTier.handle

    def forgetful(self, message):
        self._answered.clear()
        return handle(self, message)

    tiers.TrainerTier.handle = forgetful


@mutant
def any_major_version() -> None:
    """Takes every coordinator for one of its own major version (§16)."""
    from edgepfl.edge_agent import agent

    agent.parse_version = lambda version: (1, 2)


@mutant
def no_roll_call() -> None:
    """Never answers a new coordinator session with a fresh status (§11)."""
    from edgepfl.protocol.presence import RollCall

    RollCall.due = lambda self, presence: False


# ----------------------------------------------------------------------- signed tasks
def _forgetting(owner: type, method: str, forgets: Callable[[Any], bool]) -> None:
    """``owner.method`` answers None where it gave a refusal that ``forgets`` matches: the check
    that made that refusal is gone."""
    check = getattr(owner, method)

    def lenient(self, *args, **kwargs):
        why = check(self, *args, **kwargs)
        return None if why is not None and forgets(why) else why

    setattr(owner, method, lenient)


def _task_guard_without(reason: str) -> None:
    from edgepfl.edge_agent import task_guard

    _forgetting(task_guard.TaskGuard, "refusal", lambda refused: refused[0] == reason)


@mutant
def takes_every_task_topic() -> None:
    """Subscribes to `agents/+/task`: every device's tasks reach it, and it trains them all."""
    from edgepfl.edge_agent import tiers
    from edgepfl.protocol import AgentChannel, agent_wildcard

    subscriptions = tiers.TrainerTier.subscriptions

    def wider(self, federation: str, agent_id: str) -> list[str]:
        return [*subscriptions(self, federation, agent_id), agent_wildcard(federation, AgentChannel.TASK)]

    tiers.TrainerTier.subscriptions = wider  # type: ignore[method-assign]


@mutant
def runs_expired_tasks() -> None:
    """Runs a signed task however long past its deadline."""
    _task_guard_without("expired")


@mutant
def runs_stale_tasks() -> None:
    """Runs a signed task older than the newest it acted on."""
    _task_guard_without("stale")


@mutant
def runs_tasks_for_others() -> None:
    """Runs a task addressed to another agent."""
    from edgepfl.edge_agent import task_guard

    task_guard.recipient_refusal = lambda message, agent_id, strict: None


@mutant
def runs_unsigned_tasks() -> None:
    """Runs an unsigned task although it pins the coordinator's key."""
    from edgepfl.edge_agent import agent
    from edgepfl.protocol import MessageType

    verify = agent.verify
    agent.verify = lambda message, key: (None if message.type == MessageType.TASK and message.header.signer is None
                                         else verify(message, key))


# ----------------------------------------------------------------------- releases
@mutant
def no_release_signature_check() -> None:
    """Installs a release whatever key signed it."""
    from edgepfl.edge_agent import agent
    from edgepfl.protocol import MessageType

    verify = agent.verify
    agent.verify = lambda message, key: None if message.type == MessageType.RELEASE else verify(message, key)


@mutant
def head_pixels_over_255_only() -> None:
    """A head agent that feeds its encoder p / 255: no normalization at all (the manifest's ignored)."""
    from edgepfl.data.preprocess import ChannelAffine
    from edgepfl.edge_agent import head_tier

    # the local data is (p/255 - m_l) / s_l: times s_l plus m_l is p/255
    head_tier._renormalization = lambda local, manifest: ChannelAffine(np.asarray(local["std"], np.float32),
                                                                       np.asarray(local["mean"], np.float32))


@mutant
def head_its_own_normalization() -> None:
    """A head agent that keeps its data file's normalization instead of the manifest's."""
    from edgepfl.edge_agent import head_tier

    head_tier._renormalization = lambda local, manifest: None


@mutant
def no_release_hash_check() -> None:
    """Installs a release without comparing its artifact with the sha256 it carries."""
    from edgepfl.edge_agent import head_tier

    install = head_tier.HeadRuntime.install_release

    def trusting(self, manifest, artifact, expected_sha256, **kwargs):
        digest = hashlib.sha256(artifact).hexdigest()
        manifest = manifest.model_copy(update={"encoder": manifest.encoder.model_copy(update={"sha256": digest})})
        return install(self, manifest, artifact, digest, **kwargs)

    head_tier.HeadRuntime.install_release = trusting


def _release_refusal_without(word: str) -> None:
    from edgepfl.edge_agent import head_tier

    _forgetting(head_tier.HeadRuntime, "_release_refusal", lambda why: why.startswith(word))


@mutant
def installs_rollbacks() -> None:
    """Installs a release whose sequence is below the installed one's."""
    _release_refusal_without("rollback")


@mutant
def installs_expired_releases() -> None:
    """Installs a release past its expiry."""
    _release_refusal_without("expired")


@mutant
def installs_unsequenced_releases() -> None:
    """Installs a signed release that carries no sequence and no expiry."""
    _release_refusal_without("unsequenced")


@mutant
def trusts_its_stored_release() -> None:
    """Restores its installed release on restart without checking it against the pinned key."""
    from edgepfl.edge_agent import head_tier

    head_tier._check_proof = lambda *args, **kwargs: None


@mutant
def ignores_retained_parts() -> None:
    """Takes a retained release only when it is whole: never the parts of `release/<i>`."""
    from edgepfl.edge_agent import tiers
    from edgepfl.protocol import FederationChannel, federation_topic

    tiers.HeadTier.release_topics = lambda self, federation: [  # type: ignore[method-assign]
        federation_topic(federation, FederationChannel.RELEASE)]


@variant
def silent_under_done() -> None:
    """Drops every report it makes while the coordinator's presence shows `done` (PROTOCOL §10
    allows it: no coordinator reads it), as an agent of 1.2 written from the text did."""
    from edgepfl.edge_agent import agent
    from edgepfl.protocol import AgentChannel

    send = agent.Agent._send

    def quiet(self, reply) -> None:
        if reply.channel == AgentChannel.METRICS and self.coordinator is not None and self.coordinator.state == "done":
            return
        send(self, reply)

    agent.Agent._send = quiet  # type: ignore[method-assign]


@mutant
def unsigned_will() -> None:
    """Signs its births but leaves its last will unsigned (made once per connection, it is easy
    to build before the signer is wired): with an enrolled dir a crashed device stays "online"."""
    from edgepfl.edge_agent import agent

    status_frame = agent.Agent._status_frame

    def frame(self, state: str) -> bytes:
        if state != "offline":
            return status_frame(self, state)
        signer, self.signer = self.signer, None
        try:
            return status_frame(self, state)
        finally:
            self.signer = signer

    agent.Agent._status_frame = frame  # type: ignore[method-assign]


@mutant
def head_leaks_its_head_in_values() -> None:
    """Reports its fitted head with each release: 330 numbers in `values` (a 32-feature,
    10-class linear head's weights and biases)."""
    from edgepfl.edge_agent import head_tier

    values = head_tier.HeadFit.values

    def leaking(self) -> dict[str, float]:
        rng = np.random.default_rng(0)
        return {**values(self), **{f"head.w{i}": float(w) for i, w in enumerate(rng.normal(size=330))}}

    head_tier.HeadFit.values = leaking


@mutant
def unsigned_head_metrics() -> None:
    """Signs its status but not the metrics it reports on a release."""
    from edgepfl.edge_agent import tiers
    from edgepfl.protocol import MessageType

    encode = tiers.encode
    tiers.encode = lambda type, **kwargs: encode(type, **{**kwargs, "signer": None} if type == MessageType.METRICS
                                                 else kwargs)


if __name__ == "__main__":
    name, config = sys.argv[1], sys.argv[2]
    {**MUTANTS, **VARIANTS}[name]()
    from edgepfl.config import load_agent_config
    from edgepfl.edge_agent import agent as agent_module

    agent_module.run_agent(load_agent_config(config, []))
