"""Device profiles of a simulated fleet, and the virtual time their work takes.

A real fleet is unequal: a Pi Zero computes 20x slower than a Jetson, some devices sit
behind slow links, some sleep for hours. A run config's ``simulation:`` block describes
the fleet as classes of devices (:class:`DeviceClass`); :class:`FleetTiming` assigns each
agent a class and a speed (seeded) and answers, for one task, when its answer arrives
in **virtual time**: the task's download, the device's compute (only while it is online),
the answer's upload. ``edgepfl simulate --in-process`` runs on that clock alone, so the
same seed gives the same result on any machine at any load, and a device is late only
because its profile says so, never because the host is busy.

The work model: a training task costs ``epochs x num_train`` samples of training and
``num_test`` of evaluation (a forward pass: :data:`EVAL_COST` of a training sample);
an evaluate task ``num_test`` of evaluation. A method with more local passes (a head
phase, a second body phase) costs what its epochs say; the model is a model.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: what evaluating one sample costs, relative to training on it (a forward pass of three)
EVAL_COST = 1.0 / 3.0


class DeviceClass(BaseModel):
    """One kind of device in a simulated fleet."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    name: str = Field("device", description="a label for the class (shown in the run's device table)")
    share: float = Field(1.0, gt=0, description="this class's share of the fleet, relative to the other classes'")
    seconds_per_sample: float = Field(
        0.001, ge=0, description="virtual seconds one training sample takes for one epoch, at speed 1")
    speed_sigma: float = Field(
        0.0, ge=0, description="spread of speed within the class: each device's time is multiplied by "
                               "exp(N(0, sigma)) (log-normal), seeded per device")
    downlink_mbps: float = Field(50.0, gt=0, description="megabits per second towards the device (tasks)")
    uplink_mbps: float = Field(10.0, gt=0, description="megabits per second from the device (answers)")
    latency_ms: float = Field(50.0, ge=0, description="one-way delay of every message, milliseconds")
    mean_online_s: float | None = Field(
        None, gt=0, description="availability: mean length of an online period (exponential, seeded per device); "
                                "null: always online")
    mean_offline_s: float | None = Field(None, gt=0, description="availability: mean length of an offline period")

    @model_validator(mode="after")
    def _availability_pairs(self) -> DeviceClass:
        if (self.mean_online_s is None) != (self.mean_offline_s is None):
            raise ValueError("set both mean_online_s and mean_offline_s, or neither (always online)")
        return self


class SimulationSpec(BaseModel):
    """How the devices of a simulated fleet differ (``edgepfl simulate``)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    devices: list[DeviceClass] = Field(
        default_factory=lambda: [DeviceClass()], min_length=1,
        description="device classes; agents are dealt to them by share (agent order shuffled with the run's seed)")
    pace_processes: bool = Field(
        False, description="over MQTT: each agent process answers no sooner than its device would (compute, links; "
                           "not availability), so one profile compares the two paths; the in-process path always "
                           "runs on the profiles' virtual clock")


class DevicePace(BaseModel):
    """One device's pace: what its work and its messages take (its class's, speed spread
    applied). The virtual clock computes with it; a paced agent process sleeps to it."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    seconds_per_sample: float = Field(ge=0, description="seconds one training sample takes, for one epoch")
    downlink_mbps: float = Field(gt=0, description="megabits per second towards the device")
    uplink_mbps: float = Field(gt=0, description="megabits per second from the device")
    latency_ms: float = Field(ge=0, description="one-way delay of every message, milliseconds")

    def download_s(self, nbytes: int) -> float:
        """A task of ``nbytes`` reaching the device (latency included)."""
        return self.latency_ms / 1000.0 + nbytes * 8 / (self.downlink_mbps * 1e6)

    def compute_s(self, samples: float) -> float:
        return samples * self.seconds_per_sample

    def upload_s(self, nbytes: int) -> float:
        """An answer of ``nbytes`` sent (the link only; its latency is :meth:`arrival_delay_s`)."""
        return nbytes * 8 / (self.uplink_mbps * 1e6)

    def arrival_delay_s(self) -> float:
        return self.latency_ms / 1000.0

    def answer_s(self, task_bytes: int, samples: float, answer_bytes: int) -> float:
        """A task's whole turn on an idle, always-online device: download, work, upload."""
        return (self.download_s(task_bytes) + self.compute_s(samples) + self.upload_s(answer_bytes)
                + self.arrival_delay_s())


@dataclass
class Availability:
    """A device's online periods: alternating exponential on / off spans, generated lazily
    from its own seeded stream, starting at virtual time 0."""

    mean_online_s: float | None
    mean_offline_s: float | None
    rng: np.random.Generator
    #: edges[i] is where period i starts; even periods are online when online_first, else odd ones
    edges: list[float] = field(default_factory=lambda: [0.0])
    online_first: bool = True

    def __post_init__(self) -> None:
        if self.mean_online_s is not None and self.mean_offline_s is not None:
            share = self.mean_online_s / (self.mean_online_s + self.mean_offline_s)
            self.online_first = bool(self.rng.random() < share)

    @property
    def always_online(self) -> bool:
        return self.mean_online_s is None

    def _extend_past(self, t: float) -> None:
        while self.edges[-1] <= t:
            online = (len(self.edges) - 1) % 2 == (0 if self.online_first else 1)
            mean = self.mean_online_s if online else self.mean_offline_s
            assert mean is not None
            self.edges.append(self.edges[-1] + float(self.rng.exponential(mean)))

    def online_at(self, t: float) -> bool:
        if self.always_online:
            return True
        self._extend_past(t)
        period = bisect.bisect_right(self.edges, t) - 1
        return (period % 2 == 0) == self.online_first

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which the device goes on- or offline (inf: never)."""
        if self.always_online:
            return math.inf
        self._extend_past(t)
        return self.edges[bisect.bisect_right(self.edges, t)]

    def finish(self, start: float, busy: float) -> float:
        """When ``busy`` seconds of online time, begun at ``start``, are done."""
        t, left = start, busy
        while True:
            if self.online_at(t):
                end = self.next_change(t)
                if t + left <= end:
                    return t + left
                left -= end - t
            t = self.next_change(t)


@dataclass
class Device:
    """One simulated device: its class, speed and availability, and until when it is busy."""

    agent_id: str
    profile: DeviceClass
    time_factor: float
    availability: Availability
    busy_until: float = 0.0

    @cached_property  # one model per device, not one per task (answer_time runs for every task)
    def pace(self) -> DevicePace:
        p = self.profile
        return DevicePace(seconds_per_sample=p.seconds_per_sample * self.time_factor, downlink_mbps=p.downlink_mbps,
                          uplink_mbps=p.uplink_mbps, latency_ms=p.latency_ms)

    def answer_time(self, sent_at: float, task_bytes: int, samples: float, answer_bytes: int) -> float:
        """When the answer to a task sent at ``sent_at`` arrives: the task's download, the
        work (after any earlier task, and only while online), the answer's upload."""
        pace = self.pace
        start = max(sent_at + pace.download_s(task_bytes), self.busy_until)
        done = self.availability.finish(start, pace.compute_s(samples) + pace.upload_s(answer_bytes))
        self.busy_until = done
        return done + pace.arrival_delay_s()


def _stream(seed: int, *parts: str) -> np.random.Generator:
    digest = hashlib.sha256("/".join([str(seed), *parts]).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class FleetTiming:
    """The devices of one simulated fleet: agent ``i`` of ``agent_ids`` gets a class by the
    classes' shares (largest remainders, over the agents in a seeded order), a speed and an
    availability of its own, all from ``seed``."""

    def __init__(self, spec: SimulationSpec, agent_ids: list[str], seed: int):
        total = sum(c.share for c in spec.devices)
        quotas = [c.share / total * len(agent_ids) for c in spec.devices]
        counts = [math.floor(q) for q in quotas]
        by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
        for i in by_remainder[: len(agent_ids) - sum(counts)]:
            counts[i] += 1
        order = [agent_ids[i] for i in _stream(seed, "device-classes").permutation(len(agent_ids))]
        self.devices: dict[str, Device] = {}
        position = 0
        for profile, count in zip(spec.devices, counts):
            for agent_id in order[position: position + count]:
                rng = _stream(seed, "device", agent_id)
                factor = float(math.exp(rng.normal(0.0, profile.speed_sigma))) if profile.speed_sigma else 1.0
                availability = Availability(profile.mean_online_s, profile.mean_offline_s, _stream(seed, "online", agent_id))
                self.devices[agent_id] = Device(agent_id, profile, factor, availability)
            position += count

    def __getitem__(self, agent_id: str) -> Device:
        return self.devices[agent_id]


def task_samples(kind: str, num_train: int, num_test: int, epochs: int) -> float:
    """Training-sample equivalents of one task (the work model of the module docstring)."""
    evaluation = num_test * EVAL_COST
    return evaluation if kind == "evaluate" else epochs * num_train + evaluation
