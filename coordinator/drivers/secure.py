"""Secure training rounds (``secure_aggregation.enabled``; docs/PROTOCOL.md §19): the
coordinator learns the sum of the round's updates, never one of them.

A round runs :mod:`edgepfl.secagg`'s steps around the ordinary task and update:

1. **keys** — each sampled agent (of protocol 1.9) is sent an ``advertise`` step and
   answers with two fresh public keys; those that answer within
   ``secure_aggregation.step_timeout_s`` are the round's key holders.
2. **shares** — the key holders are joined in a seeded sparse graph
   (:func:`~edgepfl.secagg.neighbour_graph`); each is sent its neighbours' keys (a
   ``roster``) and answers with a share of its secrets sealed to each of them. Those that
   answer are the round's members: each is sent its training task, carrying the shares
   sealed to it, and masks its update with exactly their senders.
3. **masked updates** — collected like any round's (quorum, timeout, agents going
   offline); :class:`~edgepfl.aggregation.SecureMean` sums the masked vectors modulo 2**64.
4. **unmask** — every agent whose masked update is in the sum is told which of its
   neighbours sent one and which did not, and reveals its shares of the first ones'
   self-mask seeds and of the others' mask keys. The coordinator reconstructs them,
   removes what does not cancel, and the sum is that of the surviving updates, the same
   integers a round in the clear would have summed. If too few shares come back the
   round is aborted (``secagg_failed``) and the state kept: nothing is learnt of anyone.
5. **bound** — the unmasked sum is held to what one update is held to in the clear
   (:meth:`~edgepfl.aggregation.SecureMean.out_of_bounds`): past it, one of its updates was
   past it, and the sum is set aside. A round may be split into groups with no edge between
   them (``secure_aggregation.group_size``, or ``suspect_group_size`` after a sum past the
   bounds), each unmasked and bounded alone: a set-aside group costs its updates, not the
   round, and its members are dealt apart in the next rounds until the one device common to
   the set-aside groups is named and suspended (:meth:`SecureRounds._narrow`).

The coordinator keeps only what the steps need: public keys, sealed shares it cannot
open, the masked sum, and the revealed shares of the one unmasking.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from edgepfl.aggregation import AggregationRejected, SecureMean
from edgepfl.config import ConfigError
from edgepfl.metrics import RoundMetrics, SecureRecord
from edgepfl.pki import load_certificate, uncertified_keys
from edgepfl.protocol import VARIANCE_GRID, MessageType, encode, new_message_id
from edgepfl.protocol.secagg import PeerKeys, SealedShare, SecAggMeta, SecAggTask, unb64
from edgepfl.secagg import (
    RING_BITS,
    SEED_BYTES,
    SecAggError,
    disagreeing_share,
    neighbour_graph,
    reconstruct_mask_key,
    reconstruct_seed,
    session_context,
    unmask,
)

from ..fleet import SENDER, Fleet
from ..gate import Refused, StepAnswer
from ..result import RoundResult
from .base import RoundContext

log = logging.getLogger("edgepfl.coordinator")

#: rounds after which a set of suspects that no sum past the bounds narrowed is forgotten
SUSPECT_ROUNDS = 16

@dataclass
class SecureSetup:
    """One secure round's steps before its tasks: who holds keys, who sealed shares."""

    round: int
    session: str
    keys: dict[str, PeerKeys] = field(default_factory=dict)
    graph: dict[str, list[str]] = field(default_factory=dict)
    threshold: int = 0
    #: recipient -> the shares sealed to it, by sender (members only)
    sealed: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    #: agents that sealed a share to every neighbour: the round's members
    members: set[str] = field(default_factory=set)
    #: agent -> the neighbours whose ``bad_shares`` refusals name it this round
    accused: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: the round's groups of key holders (``secure_aggregation.group_size``), each its own secure sum
    groups: list[list[str]] = field(default_factory=list)
    #: groups whose unmasked sum was set aside, and groups whose masks could not be removed
    set_aside: int = 0
    not_unmasked: int = 0
    #: the steps' bytes, each way
    bytes_down: int = 0
    bytes_up: int = 0

    def record(self, survivors: int = 0, recovered: int = 0, unmasked: bool = False,
               seconds: float = 0.0) -> SecureRecord:
        """The round's row entry."""
        return SecureRecord(key_holders=len(self.keys), members=len(self.members), survivors=survivors,
                            recovered=recovered, neighbours=len(next(iter(self.graph.values()), [])),
                            threshold=self.threshold, unmasked=unmasked, bytes_down=self.bytes_down,
                            bytes_up=self.bytes_up, unmask_seconds=round(seconds, 4),
                            groups=max(1, len(self.groups)), set_aside=self.set_aside,
                            not_unmasked=self.not_unmasked)

    def member_graph(self) -> dict[str, list[str]]:
        """The neighbour graph among the members: who masked with whom."""
        return {a: [b for b in self.graph[a] if b in self.members] for a in sorted(self.members)}


def require_authenticated(fleet: Fleet, signs: bool, enrols: bool) -> None:
    """Refuse secure rounds over a fleet where anyone could write in the round's name
    (ConfigError): on a broker, a roster or an unmask the coordinator did not sign, or keys
    an agent did not sign, would let a network attacker take an agent's secrets. The
    in-process fleet's frames are its own."""
    if fleet.own_frames or (signs and enrols):
        return
    raise ConfigError("secure_aggregation over a broker needs signed steps: set security.signing_key and "
                      "security.enrolled_dir (edgepfl provision makes both; agents pin security.coordinator_key)")


class SecureRounds:
    """Runs each training round as a secure one."""

    waits_between_rounds = True

    def __init__(self, context: RoundContext):
        require_authenticated(context.fleet, context.signer is not None, context.enrols)
        # an agent before 1.9 would never answer a step, one before 1.14 seals both directions of an edge
        # under one key, one before 1.17 puts a BatchNorm variance on another grid (§19): none gets a
        # task of this run (the registry logs it once)
        context.registry.require_protocol(VARIANCE_GRID, "secure aggregation")
        context.route_steps(self._on_step, self._on_refused)
        context.resend_lost_tasks()
        self.co = context
        self.spec = context.config.secure_aggregation
        #: the federation's CA (security.peer_ca): a device whose keys a key it certified did not sign
        #: takes no part in a round (its neighbours would refuse the roster; protocol 1.14)
        peer_ca = context.config.security.peer_ca
        self.peer_ca = load_certificate(peer_ca) if peer_ca else None
        #: agent -> every neighbour that named it in a ``bad_shares`` refusal since it was last suspended
        self.accusers: dict[str, set[str]] = defaultdict(set)
        #: agent -> every neighbour with whom a share it revealed, or dealt, was the one off the
        #: polynomial the others agreed on, since it was last suspended (:meth:`_reconstruct`)
        self.disagreed: dict[str, set[str]] = defaultdict(set)
        #: the agents each set-aside group could have been set aside for, narrowed to those of every
        #: later set-aside group it meets (:meth:`_narrow`): one device's scaled vector is in them all;
        #: beside each, the last round it was narrowed in (a set is forgotten SUSPECT_ROUNDS after)
        self.suspects: list[set[str]] = []
        self._suspected_in: list[int] = []
        self._setup: SecureSetup | None = None
        self._result: RoundResult | None = None
        #: the step awaited, from whom, and the answers so far
        self._step, self._from = "", set[str]()
        self._answers: dict[str, SecAggMeta] = {}

    def run_round(self, r: int) -> RoundMetrics:
        """One secure training round (module docstring); its metrics row."""
        co, c = self.co, self.co.config
        started = co.clock.now()
        sampled, evaluators = co.sample(r, final=False)
        tasks, result, _ = co.open_round(r, sampled, late=False)
        co.observer.enter("training", r)
        self._result = result
        try:
            setup = self._prepare(r, sampled, result)
            if result.aggregate is not None and isinstance(result.aggregate.rule, SecureMean):
                result.aggregate.rule.assign({a: i for i, group in enumerate(setup.groups) for a in group})
            clip_norm, noise_std = co.device_noise(len(sampled))
            for agent_id in sorted(setup.members):
                shares = [SealedShare(peer=s, ciphertext=t) for s, t in sorted(setup.sealed[agent_id].items())]
                co.send_task(tasks, result, agent_id, "train", secagg=SecAggTask(
                    session=setup.session, weight_cap=tasks.weight_cap, shares=shares, clip_norm=clip_norm,
                    noise_std=noise_std))
            for agent_id in evaluators:
                co.send_task(tasks, result, agent_id, "evaluate")
            co.collect(tasks, result, started)
            left_out = sorted(set(sampled) - setup.members)
            if left_out:
                log.info("round %d: %d sampled agents are not in the secure round (no keys or shares in time): %s",
                         r, len(left_out), ", ".join(left_out[:10]))
                result.dropped.extend(left_out)
            for agent_id in result.dropped:
                co.registry.missed(agent_id, r, silent_since=started)
            self._suspend_accused(setup, r)
            result.secure = setup.record()
            self._unmask(setup, result, quorum=c.quorum_of(len(sampled)), noise_std=noise_std or 0.0)
            self._suspend_disagreeing(setup, r)
        finally:
            self._setup = self._result = None
        return co.close_round(tasks, result, started, final=False, quorum=c.quorum_of(len(sampled)))

    # ---------------------------------------------------------------- steps
    def _prepare(self, r: int, agents: list[str], result: RoundResult) -> SecureSetup:
        """Keys, then shares: the round's members and the shares sealed to each."""
        setup = self._setup = SecureSetup(r, new_message_id())
        n = len(agents)
        degree = self.spec.degree_for(n)
        threshold = degree // 2 + 1
        for agent_id in agents:
            self._send(agent_id, SecAggMeta(session=setup.session, step="advertise", threshold=threshold), result)
        answers = {a: m.keys for a, m in self._await("keys", set(agents)).items()
                   if m.keys is not None and m.keys.agent == a}
        uses = Counter(k for keys in answers.values() for k in {keys.mask_public, keys.share_public})
        for agent_id, keys in sorted(answers.items()):
            if keys.mask_public == keys.share_public or uses[keys.mask_public] > 1 or uses[keys.share_public] > 1:
                # a key two agents announce, or one used twice: shares sealed to it would open elsewhere, and
                # which agent owns it cannot be told, so neither takes part this round
                log.warning("round %d: %s announced a public key another agent announced too, or one key for "
                            "both uses; left out", r, agent_id)
                continue
            if self.peer_ca is not None:
                why = uncertified_keys(self.peer_ca, keys, session_context(self.co.config.federation, r, setup.session))
                if why is not None:
                    log.warning("round %d: %s's keys are not certified by the federation's CA (%s); left out", r,
                                agent_id, why)
                    continue
            setup.keys[agent_id] = keys
        holders = sorted(setup.keys)
        self._forget_suspects(r)
        setup.groups = self.spec.groups(holders, bytes.fromhex(setup.session), self.suspects)
        degree = self.spec.degree_for(min(len(group) for group in setup.groups))
        setup.threshold = degree // 2 + 1
        if len(holders) < 3:
            log.warning("round %d: %d agents sent keys; a secure round needs at least 3", r, len(holders))
            return setup
        for group in setup.groups:
            # an odd degree is everyone of the smallest group; one less in a larger group has the same threshold
            setup.graph.update(neighbour_graph(group, degree if degree >= len(group) - 1 else degree - degree % 2,
                                               bytes.fromhex(setup.session)))
        for agent_id in holders:
            roster = [setup.keys[b] for b in setup.graph[agent_id]]
            self._send(agent_id, SecAggMeta(session=setup.session, step="roster", threshold=setup.threshold,
                                            neighbours=roster), result)
        for agent_id, answer in self._await("shares", set(holders)).items():
            recipients = [s.peer for s in answer.shares]
            if sorted(recipients) != setup.graph[agent_id]:
                log.warning("round %d: %s sealed shares to %d agents, not to its %d neighbours; left out", r,
                            agent_id, len(recipients), len(setup.graph[agent_id]))
                continue
            setup.members.add(agent_id)
            for share in answer.shares:
                setup.sealed[share.peer][agent_id] = share.ciphertext
        log.info("round %d: secure round of %d agents (%d with keys, %d neighbours each, threshold %d, %d group%s)",
                 r, len(setup.members), len(holders), degree, setup.threshold, len(setup.groups),
                 "" if len(setup.groups) == 1 else "s")
        return setup

    def _unmask(self, setup: SecureSetup, result: RoundResult, quorum: int, noise_std: float = 0.0) -> None:
        """Ask the survivors for their shares and take each group's unmasked sum into the round's
        rule, or set it aside when it is past the bounds (:meth:`SecureMean.take_group`; its
        members are then suspects, :meth:`_narrow`). Below ``quorum`` nothing is unmasked: the
        round is aborted anyway, and a sum of fewer devices would carry less of their noise than
        distributed DP counts on."""
        aggregate = result.aggregate
        if aggregate is None or not aggregate.participants or len(aggregate.participants) < quorum:
            return
        rule = aggregate.rule
        assert isinstance(rule, SecureMean)  # PrivacyLedger.open's rule of a secure round
        survivors = set(aggregate.participants)
        graph = setup.member_graph()
        dropped = setup.members - survivors
        for agent_id in sorted(survivors):
            neighbours = graph[agent_id]
            self._send(agent_id, SecAggMeta(
                session=setup.session, step="unmask", survivors=[b for b in neighbours if b in survivors],
                dropped=[b for b in neighbours if b in dropped]), result)
        seeds: dict[str, dict[int, bytes]] = defaultdict(dict)
        keys: dict[str, dict[int, bytes]] = defaultdict(dict)
        revealer: dict[tuple[str, int], str] = {}  # (the secret's owner, a share's index) -> who revealed it
        for agent_id, answer in self._await("reveal", survivors).items():
            for share in answer.seeds:  # only what it was asked about, each from a neighbour of it
                if share.agent in survivors and share.agent in graph[agent_id]:
                    seeds[share.agent][share.index] = unb64(share.share)
                    revealer[share.agent, share.index] = agent_id
            for share in answer.mask_keys:
                if share.agent in dropped and share.agent in graph[agent_id]:
                    keys[share.agent][share.index] = unb64(share.share)
                    revealer[share.agent, share.index] = agent_id
        began = time.process_time()
        for owner, shares in (*seeds.items(), *keys.items()):
            self._set_aside_disagreeing(owner, shares, revealer, setup.threshold,
                                        SEED_BYTES if owner in survivors else 2 * SEED_BYTES)
        publics = {a: unb64(setup.keys[a].mask_public) for a in setup.members}
        context = session_context(self.co.config.federation, setup.round, setup.session)
        recovered, failures, in_sum = 0, [], set[str]()
        for index, group in enumerate(setup.groups):
            alive = survivors.intersection(group)
            if not alive:
                continue
            sub = {a: graph[a] for a in group if a in graph}
            try:
                self_seeds = {a: reconstruct_seed(seeds[a].items(), setup.threshold) for a in sorted(alive)}
                lost_keys = {a: reconstruct_mask_key(keys[a].items(), setup.threshold) for a in sorted(dropped)
                             if a in sub and any(b in alive for b in sub[a])}
                total = unmask(rule.group_sums_[index], alive, sub, publics, self_seeds, lost_keys, RING_BITS,
                               context)
            except SecAggError as exc:
                failures.append(f"the masks could not be removed: {exc}")
                setup.not_unmasked += 1
                log.warning("round %d: secure sum of %d updates not unmasked: %s", setup.round, len(alive), exc)
                continue
            try:
                why = rule.take_group(index, total, noise_std)
            except AggregationRejected as exc:
                failures.append(str(exc))
                continue
            if why is None:
                recovered += len(lost_keys)
                in_sum |= alive
                continue
            setup.set_aside += 1
            failures.append(f"the sum of {len(alive)} updates set aside: {why}")
            log.warning("round %d: the secure sum of %s set aside (%s): one of them sent a vector past the "
                        "bounds", setup.round, ", ".join(sorted(alive)), why)
            self._narrow(set(alive), setup.round)
        seconds = time.process_time() - began
        if rule.sum_ is not None and survivors - in_sum:
            # a group set aside or not unmasked: its updates are not in the sum, nor its members participants, and
            # the quorum counts without them (under distributed DP a smaller sum would hold too little noise)
            aggregate.leave_out(survivors - in_sum)
            result.participants[:] = [a for a in result.participants if a in in_sum]
        if rule.sum_ is None:
            rule.failure_ = "; ".join(failures) or "no group's sum was unmasked"
            result.secure = setup.record(len(survivors), 0, False, seconds)
            return
        result.secure = setup.record(len(in_sum), recovered, True, seconds)
        log.info("round %d: secure sum of %d updates unmasked (%d dropped agents' masks removed%s)", setup.round,
                 len(in_sum), recovered, f"; {setup.set_aside} of {len(setup.groups)} groups set aside"
                 if setup.set_aside else "")

    def _narrow(self, group: set[str], r: int) -> None:
        """A group's sum was past the bounds: one of ``group`` sent a vector past them. Each set of
        suspects it meets is narrowed to the agents in both (one device that keeps doing it is in
        every such group, and the next rounds deal the suspects of a set to different groups,
        :meth:`~edgepfl.secagg.SecureAggregationSpec.groups`); a group that meets none is a set of
        its own. A set narrowed to one agent names it: it is suspended with the reason in the view."""
        met = [k for k, found in enumerate(self.suspects) if found & group]
        if not met:
            self.suspects.append(set(group))
            self._suspected_in.append(r)
        for k in met:
            self.suspects[k] &= group
            self._suspected_in[k] = r
        for k in reversed(range(len(self.suspects))):
            if len(self.suspects[k]) == 1:
                (agent_id,) = self.suspects[k]
                self.co.registry.suspend(agent_id, r, f"the secure sum of each group it was in was past the "
                                                      f"bounds every update is held to, until it was the only "
                                                      f"one in common (round {r})")
                del self.suspects[k], self._suspected_in[k]

    def _forget_suspects(self, r: int) -> None:
        """Drop the sets of suspects not narrowed for :data:`SUSPECT_ROUNDS` rounds: whoever was
        behind them stopped, and the rounds need not stay split for them."""
        for k in reversed(range(len(self.suspects))):
            if r - self._suspected_in[k] > SUSPECT_ROUNDS:
                log.info("round %d: %d suspects of a sum past the bounds in round %d forgotten: no such sum since",
                         r, len(self.suspects[k]), self._suspected_in[k])
                del self.suspects[k], self._suspected_in[k]

    def _set_aside_disagreeing(self, owner: str, shares: dict[int, bytes], revealer: dict[tuple[str, int], str],
                               threshold: int, length: int) -> None:
        """Take out of ``shares`` (of ``owner``'s secret) the one share off the polynomial the others
        agree on, so that the secret is the owner's and the round is unmasked, and record the
        disagreement against both its revealer and its dealer (the owner): which of the two lied
        only they know (the share was sealed between them). Each is suspended once as many
        distinct neighbours as a round's threshold (at least two) have disagreed with it since
        its last suspension (:meth:`_suspend_disagreeing`): one device cannot suspend an honest
        one. A disagreement no single share explains is left to the unmasking, which fails."""
        try:
            bad = disagreeing_share(shares.items(), threshold, length)
        except SecAggError as exc:
            log.warning("the revealed shares of %s's secret: %s", owner, exc)
            return
        if bad is None:
            return
        who = revealer[owner, bad]
        del shares[bad]
        log.warning("the share of %s's secret that %s revealed is not on the polynomial of the others': set aside",
                    owner, who)
        self.disagreed[who].add(owner)
        self.disagreed[owner].add(who)

    def _suspend_disagreeing(self, setup: SecureSetup, r: int) -> None:
        """Suspend every agent that as many distinct neighbours as the round's threshold (at least two)
        have disagreed with at unmasking since its last suspension (:meth:`_set_aside_disagreeing`)."""
        needed = max(2, setup.threshold)
        for agent_id, others in sorted(self.disagreed.items()):
            if len(others) >= needed:
                self.co.registry.suspend(agent_id, r, f"its revealed or dealt shares disagreed with those of "
                                                      f"{len(others)} of its neighbours (round {r})")
                del self.disagreed[agent_id]

    def _on_refused(self, refused: Refused) -> None:
        """A refusal of this round's task: ``bad_shares`` names the neighbours whose sealed shares
        did not open for the refuser. Counted only when provably its own (signed by its enrolled
        key, or in process) and only against its neighbours of this round, who sealed it shares."""
        setup = self._setup
        if setup is None or refused.reason != "bad_shares" or not (refused.may_exclude or self.co.fleet.own_frames):
            return
        for peer in refused.peers:
            if peer in setup.graph.get(refused.agent_id, ()):
                setup.accused[peer].add(refused.agent_id)

    def _suspend_accused(self, setup: SecureSetup, r: int) -> None:
        """Suspend every agent that as many distinct neighbours as a round's threshold (at least
        two) have named since it was last suspended: its shares do not open for them, so each
        round it is in costs its neighbours' updates. One device cannot suspend another (it is
        one accuser); colluders can, when they are that many of their victim's neighbours over
        the run (docs/SECURITY.md)."""
        needed = max(2, setup.threshold)
        for agent_id, accusers in sorted(setup.accused.items()):
            known = self.accusers[agent_id]
            known |= accusers
            if len(known) < needed:
                log.warning("round %d: %d neighbours of %s say its shares do not open (%s); %d suspend it", r,
                            len(known), agent_id, ", ".join(sorted(known)[:5]), needed)
                continue
            self.co.registry.suspend(agent_id, r, f"its shares did not open for {len(known)} of its neighbours "
                                                  f"(round {r})")
            del self.accusers[agent_id]

    # ---------------------------------------------------------------- messaging
    def _send(self, agent_id: str, meta: SecAggMeta, result: RoundResult) -> None:
        co = self.co
        frame = encode(MessageType.SECAGG, federation=co.config.federation, sender=SENDER, round=result.round,
                       meta=meta, signer=co.signer, recipient=agent_id if co.signer is not None else None)
        sent = co.fleet.send(agent_id, frame, result.round)
        result.bytes_down += sent
        if self._setup is not None:
            self._setup.bytes_down += sent

    def _await(self, step: str, agents: set[str]) -> dict[str, SecAggMeta]:
        """The ``step`` answers of ``agents`` that come within the step timeout (or until each
        one left is offline): by agent."""
        self._answers, self._step, self._from = {}, step, agents
        co = self.co

        def done() -> bool:
            missing = agents - set(self._answers)
            return not missing or not any(co.registry.is_online(a) for a in missing)

        co.pump_until(done, co.clock.now() + self.spec.step_timeout_s)
        return dict(self._answers)

    def _on_step(self, answer: StepAnswer, wire_bytes: int) -> None:
        """A ``secagg`` frame the gate admitted: kept when it is the step awaited, of this
        round's session, from an agent asked and not yet answered."""
        setup = self._setup
        meta = answer.meta
        if self._result is not None:
            self._result.bytes_up += wire_bytes
        if setup is not None:
            setup.bytes_up += wire_bytes
        if (setup is None or meta.session != setup.session or meta.step != self._step
                or answer.agent_id not in self._from or answer.agent_id in self._answers):
            log.info("ignored a %s step from %s: not awaited now", meta.step, answer.agent_id)
            return
        self._answers[answer.agent_id] = meta
