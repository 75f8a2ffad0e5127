"""The conformance checks: one catalog (id, PROTOCOL.md section, MUST/SHOULD) and the report.

Every check the kit can make is declared once in :data:`CHECKS`; a scenario records a
verdict for it (:meth:`Report.record`, :meth:`Report.skip`). docs/CONFORMANCE.md lists the
same catalog for humans, and a test keeps the two in step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from edgepfl.protocol.evolution import supports

Level = Literal["MUST", "SHOULD"]
Verdict = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One requirement of docs/PROTOCOL.md that the kit verifies against an agent."""

    id: str
    #: the PROTOCOL.md section, as ``§<n>`` (the report and CONFORMANCE.md link it)
    section: str
    level: Level
    #: the protocol version that introduced the requirement: an agent announcing an older
    #: one is not held to it (the check is skipped)
    since: str
    title: str


def _catalog(*checks: Check) -> dict[str, Check]:
    return {c.id: c for c in checks}


CHECKS: dict[str, Check] = _catalog(
    # presence (scenario "session")
    Check("presence.birth", "§10", "MUST", "1.0",
          "on connect: a retained, QoS 1 `online` status of this agent (round -1, no tensors)"),
    Check("presence.session", "§10", "SHOULD", "1.1", "the status carries a random 32-hex `session` per process"),
    Check("presence.version", "§16", "MUST", "1.0", "the status announces a `major.minor` version of major 1"),
    Check("presence.capabilities", "§5", "SHOULD", "1.2",
          "the status declares `capabilities` (methods, archs, max_message_bytes)"),
    Check("presence.max_payload", "§5", "SHOULD", "1.4",
          "the status's `capabilities` declare `max_payload_bytes`, the largest frame the agent accepts"),
    Check("presence.roll_call", "§11", "MUST", "1.0",
          "a coordinator presence with a new `session` is answered with a fresh `online` status"),
    # tasks and updates
    Check("task.train", "§10", "MUST", "1.0", "a `train` task is answered with one QoS 1 `update` on the update topic"),
    Check("update.header", "§4", "MUST", "1.0",
          "the update's header: type `update`, the federation, sender = agent id, round = the task's round"),
    Check("update.meta", "§5", "MUST", "1.0",
          "update meta: `task_id` and `kind` echo the task, 0 < num_train <= the status's, eval_correct <= num_test"),
    Check("update.losses", "§5", "SHOULD", "1.0",
          "eval_loss is a finite number >= 0 when num_test > 0; a train answer reports train_loss"),
    Check("update.tensors", "§6", "MUST", "1.0",
          "a train update carries exactly the task's shared keys, same shapes and dtypes, all finite"),
    Check("personal.stays", "§6", "MUST", "1.2",
          "a train update of a personalized method the agent declares (fedrep, fedper or lgfedavg, the first of "
          "them) carries exactly the task's shared keys: its personal head never leaves the device (a MUST since "
          "1.0; checked from 1.2 on, whose capabilities say which methods an agent runs)"),
    Check("update.compressed", "§5", "MUST", "1.6",
          "an agent that declares `capabilities.codecs` answers a train task whose `uplink` asks for one of them "
          "with an update that decodes onto the task's tensors (docs/COMPRESSION.md): the asked codec and block, "
          "the task's tensor names and shapes, finite values (or an uncompressed update, which is also accepted)"),
    Check("task.evaluate", "§5", "MUST", "1.0", "an `evaluate` task is answered with kind `evaluate` and no tensors"),
    Check("task.own_topic", "§2", "MUST", "1.0",
          "a task published on another agent's task topic is not acted on: no answer to it (an agent that "
          "subscribes to `agents/+/task` trains every device's tasks)"),
    Check("task.preprocessing", "§5", "MUST", "1.0",
          "inputs are preprocessed as the task's `run.data` says: an evaluate task of a model the kit trained under "
          "a normalization of its own (not the data file's) scores >= 90 % held out (the model scores 100 % on "
          "every sample; x / 255 alone, or the file's normalization, scores near chance)"),
    Check("task.class_order", "§5", "MUST", "1.0",
          "local labels are mapped onto the run's class order: the same model with the run's class names and the "
          "head's rows permuted alike scores >= 90 % held out (local numbers taken for the run's score near 0)"),
    Check("train.preprocessing", "§5", "MUST", "1.0",
          "training preprocesses as the task's `run.data` says, not only evaluation: a train task (2 epochs) of the "
          "preprocessing probe's model comes back with its first BatchNorm layer's running variance at 0.7-1.43 "
          "times the model's (statistics of the inputs the task describes; docs/MODELS.md's momentum); training "
          "on x / 255 alone or on the file's normalization leaves about 0.35"),
    Check("train.class_order", "§5", "MUST", "1.0",
          "training maps local labels onto the run's class order, not only evaluation: a train task of the class-"
          "order probe's model comes back still scoring >= 90 % held out under the run's order (trained on local "
          "numbers, it scores near 0)"),
    Check("head.preprocessing", "§12", "MUST", "1.0",
          "a head agent feeds its encoder inputs preprocessed as the release manifest's `run.data` says: a probe "
          "release whose encoder passes on only what that preprocessing makes bright (inputs above 2 under mean "
          "0.5, std 0.02) is fitted and reported at >= 90 % held out; x / 255 alone or the file's normalization "
          "makes every feature 0 (one class's share, 25 %)"),
    Check("idempotency.redelivery", "§9", "MUST", "1.0",
          "a task delivered again is answered with the cached update frame (same message_id)"),
    Check("frames.body_hash", "§7", "MUST", "1.0",
          "a task whose body does not match its header's `body_sha256` gets no answer; the next task is answered"),
    Check("frames.valid", "§7", "MUST", "1.0",
          "every frame the agent publishes passes the receiver's checks (§7 1-9) and names the topic's agent"),
    # chunking and limits
    Check("chunking.receive", "§8", "MUST", "1.0", "a task split into §8 chunks is reassembled and answered"),
    Check("chunking.send", "§8", "MUST", "1.0",
          "with a small announced M, an update larger than M travels as §8 chunks on the update topic that reassemble"),
    Check("limits.announced_m", "§8", "MUST", "1.0",
          "after the coordinator announced M, no MQTT message of the agent is larger than M"),
    # evolution, NACKs, refusals
    Check("evolution.unknown_fields", "§16", "MUST", "1.2",
          "a task with header, meta and run-spec keys of a newer minor version is still answered"),
    Check("evolution.unknown_type", "§16", "MUST", "1.2",
          "a frame of an unknown message type on the task topic is ignored; later tasks are answered"),
    Check("nack.keeps_going", "§5", "MUST", "1.2", "after a `nack` of its update the agent answers the next task"),
    Check("refusal.data_mismatch.silent", "§5", "MUST", "1.0",
          "a task whose run.data.input_shape is not the agent's data gets no update"),
    Check("refusal.data_mismatch", "§5", "MUST", "1.2",
          "... and, to a 1.2 coordinator, a `refusal` with reason `data_mismatch` naming the task"),
    Check("refusal.unsupported_method.silent", "§5", "MUST", "1.0",
          "a task of a method the agent cannot run (outside its capabilities) gets no update"),
    Check("refusal.unsupported_method", "§5", "MUST", "1.2",
          "... and, to a 1.2 coordinator, a `refusal` with reason `unsupported_method` naming the task"),
    Check("version.other_major", "§16", "MUST", "1.2",
          "while the coordinator's presence announces another major version, its tasks get no answer "
          "(no update, no refusal); a presence of major 1 brings the agent back"),
    Check("presence.done", "§10", "SHOULD", "1.0",
          "after a `done` presence the agent stays connected (no `offline`, same session) and answers a task "
          "once a later `online` presence comes"),
    Check("presence.clean_stop", "§10", "MUST", "1.0",
          "a clean stop (SIGTERM) leaves a retained `offline` status of the same session"),
    # reconnect (scenario "reconnect")
    Check("reconnect.birth", "§10", "MUST", "1.0", "after a broker restart the agent reconnects and publishes its birth again"),
    Check("reconnect.resubscribe", "§10", "MUST", "1.0", "after the reconnect a new task is answered (subscriptions restored)"),
    Check("reconnect.connection", "§5", "SHOULD", "1.3",
          "the birth after a broker restart carries `connection` of at least 2 (a later connection of its session), "
          "so that a task lost with the old one is sent again"),
    Check("reconnect.held_answer", "§10", "MUST", "1.2",
          "an answer finished while disconnected is published after reconnecting while its round is open"),
    Check("reconnect.held_answer_dropped", "§10", "MUST", "1.2",
          "an answer finished while disconnected is not published when the presence after the reconnect shows "
          "a later round"),
    Check("presence.will", "§11", "MUST", "1.0",
          "on kill -9 the broker publishes the last will: a retained `offline` status of the same session"),
    # signatures (scenario "signatures")
    Check("signing.status", "§3a", "MUST", "1.1", "with a signing key the agent signs its status (verifies with its key)"),
    Check("signing.update", "§3a", "MUST", "1.1", "a signed task for this agent is answered with a signed update"),
    Check("signing.will", "§3a", "MUST", "1.1",
          "with a signing key the agent's last will (the `offline` status the broker publishes on kill -9) is "
          "signed too: retained, of the same session, verifying with its key"),
    Check("signing.unsigned_task", "§7", "MUST", "1.1", "with a pinned coordinator key an unsigned task is ignored"),
    Check("signing.foreign_key", "§7", "MUST", "1.1", "a task signed by another key than the pinned one is ignored"),
    Check("signing.wrong_recipient", "§4", "MUST", "1.1", "a signed task whose `recipient` is another agent is ignored"),
    Check("signing.stale", "§7", "MUST", "1.1",
          "a signed task older by (epoch, round) than the newest acted on is ignored"),
    Check("signing.expired_task", "§7", "MUST", "1.1",
          "a signed task past `created + 2 × deadline_s + 300 s` by the agent's clock is not run (no update; "
          "since 1.3 a `refusal` `expired` may say so)"),
    # the head tier (scenario "head"): releases, with a pinned coordinator key
    Check("release.install", "§12", "MUST", "1.0",
          "a release retained whole before the head agent started is installed: `metrics` (tier head, its "
          "release_id, round = the release's)"),
    Check("release.sha256", "§12", "MUST", "1.0",
          "a release whose artifact does not match its sha256 is refused (no metrics of it installed; the installed one "
          "is kept)"),
    Check("release.signature", "§7", "MUST", "1.1",
          "with a pinned coordinator key, an unsigned release and a release signed by another key are refused"),
    Check("release.unsequenced", "§7", "MUST", "1.1",
          "with a pinned coordinator key, a signed release without `sequence` and `expires` is refused"),
    Check("release.body_hash", "§7", "MUST", "1.0",
          "a release whose body is not the one its header's `body_sha256` hashes (one encoder byte changed, its "
          "meta and manifest describing the changed encoder, the signature valid) is not installed"),
    Check("release.rollback", "§12", "MUST", "1.1",
          "with a pinned coordinator key, a release whose `sequence` is below the installed one's is refused"),
    Check("release.expired", "§12", "MUST", "1.1",
          "with a pinned coordinator key, a release past `expires` is refused"),
    Check("release.refusal_reported", "§12", "SHOULD", "1.5",
          "each refused release the coordinator signed (corrupt, rolled back, expired, unsequenced) is reported to it: "
          "`metrics` naming it, with `refused` (the reason) and no counts; a forged one is dropped unanswered"),
    Check("release.task_topic", "§12", "MUST", "1.0",
          "the installed release sent again on the agent's task topic is answered with `metrics` again"),
    Check("release.by_reference", "§12", "SHOULD", "1.4",
          "restarted with its release installed under a presence naming it, the agent's status names the release "
          "and it reports its metrics on it unasked, downloading nothing"),
    Check("release.reverified", "§12", "MUST", "1.4",
          "restarted with another coordinator key pinned than the one its installed release was signed with, under "
          "a presence naming that release, the agent does not take it as installed (it re-verifies what it stored): "
          "its status does not name it and it reports nothing on it"),
    Check("release.parts", "§12", "MUST", "1.2",
          "a release retained in chunks of <= M on `release/<i>` before the agent started, named by the `done` "
          "presence of a coordinator that exited, is reassembled and installed (its report, or a release "
          "sequenced below it refused once a coordinator is back: a report under `done` may be dropped, §10)"),
    # the head agent's own life cycle (scenario "head"): what presence, reconnect and signatures
    # check of a trainer, so that a head-only device is certified on all of it (--profile head)
    Check("head.birth", "§10", "MUST", "1.0",
          "on connect: a retained, QoS 1 `online` status of the head agent (tier `head`, round -1, no tensors)"),
    Check("head.signing", "§3a", "MUST", "1.1",
          "with a signing key the head agent signs its status and its metrics (both verify with its key)"),
    Check("head.reconnect", "§10", "MUST", "1.0",
          "after a broker restart the head agent publishes its birth again and answers its installed release, "
          "sent again on its task topic, with metrics (still installed, subscriptions restored)"),
    Check("head.clean_stop", "§10", "MUST", "1.0",
          "a clean stop (SIGTERM) of the head agent leaves a retained `offline` status of the same session"),
    Check("head.values", "§5", "MUST", "1.15",
          "every `metrics` report's `values` has at most 32 entries, each named in at most 64 characters: what "
          "the agent measured, never its fitted head (a head agent that reports its head's weights there sends "
          "a personal part off the device)"),
    Check("head.will", "§11", "MUST", "1.0",
          "on kill -9 of the head agent the broker publishes its last will: a retained `offline` status of the "
          "same session, signed with its key (the scenario runs with keys)"),
)

#: scenario name -> the checks it records (the CLI's --skip takes these names)
SCENARIOS: dict[str, tuple[str, ...]] = {
    "session": tuple(k for k in CHECKS if not k.startswith(("reconnect.", "signing.", "release.", "head."))
                     and k != "presence.will"),
    "reconnect": (*(k for k in CHECKS if k.startswith("reconnect.")), "presence.will"),
    "signatures": tuple(k for k in CHECKS if k.startswith("signing.")),
    "head": tuple(k for k in CHECKS if k.startswith(("release.", "head."))),
}

#: what an implementation is certified as: a trainer, a head agent, or both tiers (``--profile``)
PROFILES: dict[str, tuple[str, ...]] = {
    "both": tuple(SCENARIOS),
    "trainer": ("session", "reconnect", "signatures"),
    "head": ("head",),
}


@dataclass
class Result:
    """A check's verdict against one agent, with the evidence for it."""

    id: str
    section: str
    level: Level
    since: str
    title: str
    verdict: Verdict
    evidence: str


@dataclass
class Report:
    """Verdicts of one kit run; :attr:`conformant` when no MUST check failed."""

    agent_cmd: str
    protocol: str
    #: what the agent is certified as (:data:`PROFILES`)
    profile: str = "both"
    #: the version the agent announced in its first status ("" before one arrived)
    agent_version: str = ""
    results: dict[str, Result] = field(default_factory=dict)

    def record(self, check_id: str, ok: bool, evidence: str) -> bool:
        """Record a pass (``ok``) or a fail; a 1.2 requirement of a 1.1 agent is a skip instead."""
        check = CHECKS[check_id]
        if not ok and self.agent_version and not supports(self.agent_version, _version(check.since)):
            return self.skip(check_id, f"the agent announced {self.agent_version}; required from {check.since} "
                                       f"(observed: {evidence})")
        self._put(check, "pass" if ok else "fail", evidence)
        return ok

    def skip(self, check_id: str, reason: str) -> bool:
        self._put(CHECKS[check_id], "skip", reason)
        return False

    def required(self, check_id: str) -> bool:
        """Whether the agent is held to the check (it announced the version that introduced it)."""
        return not self.agent_version or supports(self.agent_version, _version(CHECKS[check_id].since))

    def _put(self, check: Check, verdict: Verdict, evidence: str) -> None:
        # the first verdict of a check stands: a scenario that fails early does not get a pass later
        if check.id not in self.results:
            self.results[check.id] = Result(check.id, check.section, check.level, check.since, check.title, verdict,
                                            " ".join(evidence.split()))

    def skip_unrecorded(self, check_ids: tuple[str, ...] | list[str], reason: str) -> None:
        for check_id in check_ids:
            if check_id not in self.results:
                self.skip(check_id, reason)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.ordered() if r.verdict == "fail"]

    @property
    def conformant(self) -> bool:
        """Every MUST check that ran passed (a skipped one is not a failure)."""
        return not any(r.level == "MUST" for r in self.failed)

    def ordered(self) -> list[Result]:
        return [self.results[k] for k in CHECKS if k in self.results]

    def table(self, width: int = 110) -> str:
        """The report as a plain-text table, one line per check, evidence wrapped beneath."""
        import textwrap

        lines = [f"edgepfl conformance (protocol {self.protocol}, profile {self.profile}) — agent: {self.agent_cmd}",
                 f"agent announced version {self.agent_version or '(none)'}", "",
                 f"{'verdict':7}  {'level':6}  {'section':7}  check"]
        for r in self.ordered():
            lines.append(f"{r.verdict.upper():7}  {r.level:6}  {r.section:7}  {r.id}: {r.title}")
            for part in textwrap.wrap(r.evidence, width - 26):
                lines.append(" " * 26 + part)
        counts = {v: sum(r.verdict == v for r in self.results.values()) for v in ("pass", "fail", "skip")}
        must_failed = sum(r.level == "MUST" for r in self.failed)
        lines += ["", f"{counts['pass']} passed, {counts['fail']} failed ({must_failed} MUST), {counts['skip']} "
                      f"skipped: {'CONFORMANT' if self.conformant else 'NOT CONFORMANT'} as {self.profile}"]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"agent_cmd": self.agent_cmd, "protocol": self.protocol, "profile": self.profile,
                           "agent_version": self.agent_version, "conformant": self.conformant,
                           "checks": [asdict(r) for r in self.ordered()]}, indent=2)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)
