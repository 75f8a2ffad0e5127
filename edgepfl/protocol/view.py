"""The fleet view: a read-only JSON mirror of the federation for operators and their tools.

The coordinator publishes a :class:`FleetView` as plain UTF-8 JSON, retained, on
``edgepfl/v1/<federation>/view`` (``docs/PROTOCOL.md`` §18), so ``mosquitto_sub``,
Node-RED, Home Assistant or ``edgepfl status`` can read who is online, the round and
its phase, the last accuracy, rejections and the current release without edgepfl's
binary codec. It is not a frame: it carries no tensors and no signature, nobody acts on
it, and the binary frames stay the protocol's only source of truth.

Size is bounded: a view that would not fit one MQTT message lists fewer agents
(offline ones dropped first) and says how many it left out.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import bounded_json

__all__ = ["VIEW_FORMAT", "AgentView", "FleetView", "Phase", "RolloutState", "RolloutView", "encode_view", "parse_view"]

VIEW_FORMAT: Literal["edgepfl.view/1"] = "edgepfl.view/1"

#: what the coordinator is doing: waiting for agents, training (tasks out, collecting
#: answers), aggregating, evaluating (the final evaluation), releasing an encoder (and
#: collecting head-tier reports), done
Phase = Literal["waiting", "training", "aggregating", "evaluating", "releasing", "done"]


class _View(BaseModel):
    # A reader ignores fields it does not know: a newer coordinator's view still reads
    # (the same rule as a frame's meta, docs/PROTOCOL.md §16).
    model_config = ConfigDict(defer_build=True, extra="ignore")


class AgentView(_View):
    """One agent as the coordinator last saw it."""

    id: str
    tier: Literal["trainer", "head", "site"]
    online: bool
    last_seen: float = Field(description="Unix time of the agent's last frame of any kind")
    device: str = ""
    num_train: int = Field(0, ge=0)
    benched_until: int | None = Field(
        None, description="the last round it sits out for tasks it let time out (it is asked again after it)")
    excluded: str | None = Field(None, description="the refusal that keeps it out of this run until it restarts")
    suspended: str | None = Field(
        None, description="why the rounds leave it out, and until when (secure rounds: its shares did not open for "
                          "its neighbours)")
    clock_ahead_s: float | None = Field(
        None, description="how far ahead of the coordinator's clock its last status was made, when over 60 s")
    release: str | None = Field(None, description="head tier: the release installed, as its last status named it")
    release_refused: str | None = Field(
        None, description="head tier: the last release it did not install, and why (until it reports one installed)")
    site: str | None = Field(None, description="a trainer behind a site aggregator: that site (docs/PROTOCOL.md §20)")
    devices: int | None = Field(None, ge=0, description="a site aggregator: how many devices are behind it now")
    last_sum: int | None = Field(None, description="a site aggregator: the last round its partial sum was folded in")


#: where a staged rollout stands (docs/ROLLOUT.md)
RolloutState = Literal["staging", "held", "promoted", "halted", "rolled_back"]


class RolloutView(_View):
    """The last staged rollout of a release (docs/ROLLOUT.md), as the release service ran it."""

    release: str
    stage: int = Field(ge=0, description="the stage in progress or last judged, 1-based (0: none yet)")
    stages: list[float] = Field(description="the cumulative shares of the head agents online, the last 1.0")
    state: RolloutState
    admitted: int = Field(0, ge=0, description="head agents admitted to the release so far")
    reported: int = Field(0, ge=0, description="of them, those that reported on it (installed or refused)")
    reasons: list[str] = Field(default_factory=list, description="halted: each gate that failed")
    to_release: str | None = Field(None, description="rolled_back: the release the fleet went back to")
    # what the last judged stage measured (docs/ROLLOUT.md, "The gate"): absent before a verdict
    paired: int | None = Field(None, ge=0, description="the last judged stage's devices with a report on this "
                                                       "release and one on the release before it")
    mean_change: float | None = Field(None, description="their mean change of held-out accuracy (0-1); null: no "
                                                        "pair, so no accuracy was compared")
    worst_change: float | None = Field(None, description="the largest drop among them (0-1)")
    latency_ratio: float | None = Field(None, description="median encoder time per sample over the release "
                                                          "before it's, on the same devices")


class FleetView(_View):
    """The federation at ``updated`` (Unix time), as its coordinator sees it."""

    format: Literal["edgepfl.view/1"] = VIEW_FORMAT
    federation: str
    method: str
    updated: float
    started: float = Field(description="Unix time the coordinator started this run (this process)")
    heartbeat_s: float | None = Field(None, description="while it runs, the coordinator republishes the view at "
                                                        "least this often: a view much older is a stopped one's")
    resumed_from: int | None = Field(None, description="the run resumed after this round's checkpoint")
    phase: Phase
    round: int = Field(ge=-1, description="the round in progress (0-based, as metrics.jsonl); -1 before round 0")
    rounds: int = Field(ge=1, description="training rounds of the run")
    rounds_completed: int = Field(ge=0)
    updates: int = Field(0, ge=0, description="updates folded into the round in progress so far (buffered rounds: "
                                              "the open state's buffer)")
    buffer_size: int | None = Field(None, description="updates that make a state (asynchrony.mode: buffered); "
                                                      "None: synchronous rounds")
    staleness: dict[str, int] = Field(default_factory=dict, description="the round in progress's folded updates "
                                                                         "by staleness (states behind)")
    last_accuracy: float | None = Field(None, description="sample-weighted accuracy of the last evaluated round")
    last_accuracy_round: int | None = None
    last_accuracy_final: bool = Field(False, description="the last accuracy is the run's final evaluation (of the "
                                                         "state the last training round made), not a round's")
    release: str | None = Field(None, description="the current encoder release id")
    online: dict[str, int] = Field(default_factory=dict, description="tier -> agents online")
    releases: dict[str, int] = Field(default_factory=dict, description="head agents online by the release they "
                                                                       "run (none: nothing installed), all of them, "
                                                                       "those left out of agents too")
    rejected: dict[str, int] = Field(default_factory=dict, description="run total of rejected messages by reason")
    refused: dict[str, int] = Field(default_factory=dict, description="run total of tasks refused by their agents, "
                                                                      "by reason")
    rollout: RolloutView | None = Field(None, description="the last staged rollout of a release (edgepfl release)")
    agents: list[AgentView] = Field(default_factory=list, description="online agents first, then offline; by id")
    agents_left_out: int = Field(0, ge=0, description="agents not listed to keep the view in one MQTT message")


def encode_view(view: FleetView, max_bytes: int) -> bytes:
    """The view as compact JSON of at most ``max_bytes``, leaving agents out (offline first) if needed."""
    data = view.model_dump_json().encode()
    if len(data) <= max_bytes:
        return data
    # Halve the listed agents until it fits: O(log N) encodings, each O(N).
    keep = len(view.agents)
    while keep > 0:
        keep //= 2
        trimmed = view.model_copy(update={"agents": view.agents[:keep],
                                          "agents_left_out": view.agents_left_out + len(view.agents) - keep})
        data = trimmed.model_dump_json().encode()
        if len(data) <= max_bytes:
            return data
    raise ValueError(f"the fleet view does not fit {max_bytes} bytes even without agents")


def parse_view(payload: bytes | str) -> FleetView:
    """A view read back (``edgepfl status``); ValueError with one line when it is not one."""
    try:
        return FleetView.model_validate(bounded_json.loads(payload, what="the payload"))
    except ValueError as exc:  # JSON and pydantic errors alike
        first = str(exc).splitlines()
        raise ValueError(f"not an edgepfl fleet view: {' '.join(first[:3])}") from None
