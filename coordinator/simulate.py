"""Simulation: a coordinator and N agents on one machine.

* over MQTT (the production path): a broker (embedded amqtt unless a URL is given),
  the coordinator in this process, and N real ``edgepfl agent`` processes;
* ``in_process=<factory>`` (``edgepfl.edge_agent.tiers.local_trainers``): the same coordinator
  round loop and the same trainer tier, agents as objects in this process — the fast
  research loop and the reference the MQTT path is compared against (same seed, same result).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from edgepfl.agent_config import DEFAULT_MAX_MODEL_PARAMS
from edgepfl.atomic import make_dirs, open_for_append, write_bytes
from edgepfl.config import AgentConfig, RunConfig, SecuritySpec
from edgepfl.metrics import RoundMetrics
from edgepfl.protocol.clock import simulated_time
from edgepfl.simulation import DevicePace, FleetTiming
from edgepfl.specs import EMBEDDED_BROKER

from .fleet import LocalAgent, LocalFleet

log = logging.getLogger("edgepfl.coordinator.simulate")


def agent_ids(n: int, prefix: str = "agent") -> list[str]:
    return [f"{prefix}-{i:02d}" for i in range(n)]


def data_shape(config: RunConfig) -> dict:
    """Input shape, class count and preprocessing, read from the data (client 0)."""
    from edgepfl.data import load_client_data

    data = load_client_data(config.data, 0)
    return {"input_shape": data.input_shape, "num_classes": data.num_classes, "class_names": data.class_names,
            "normalization": data.normalization, "channel_names": data.channel_names}


def agents_model_cap(config: RunConfig, shape: dict) -> int:
    """The ``max_model_params`` of a simulation's trainers: the default, or the run's own model's
    size where it is larger (simulate chose that model; a task from anyone else still meets the cap).
    ``shape``: what :func:`service_data_shape` read of the data."""
    from edgepfl.methods import create_method
    from edgepfl.methods.base import model_size

    input_shape = shape.get("input_shape") or config.input_shape
    num_classes = shape.get("num_classes") or config.num_classes
    if input_shape is None or num_classes is None:
        return DEFAULT_MAX_MODEL_PARAMS
    method = create_method(config.method.name, config.method.options())
    return max(DEFAULT_MAX_MODEL_PARAMS, model_size(method, config.model, tuple(input_shape), num_classes) or 0)


def service_data_shape(config: RunConfig) -> dict:
    """What the ``edgepfl coordinator`` service reads from its data: whatever of input shape,
    class count and normalization the config does not set (nothing when it sets all three).

    Trainer tasks always carry the normalization (PROTOCOL §5): a coordinator that sets
    only the shape still reads it from the data rather than sending none.
    """
    if config.input_shape is not None and config.num_classes is not None and config.normalization is not None:
        return {}
    shape = data_shape(config)
    if config.input_shape is not None:
        del shape["input_shape"], shape["channel_names"]  # the names are the data's input's, not the config's
    if config.num_classes is not None:
        del shape["num_classes"], shape["class_names"]
    if config.normalization is not None:
        del shape["normalization"]
    return shape


def prepare(config: RunConfig, agents: int, head_agents: int = 0, rounds: int | None = None) -> RunConfig:
    """The run config adjusted to the simulated fleet (one data partition per agent)."""
    update: dict = {"data": config.data.model_copy(update={"num_clients": agents + head_agents})}
    if rounds is not None:
        update["rounds"] = rounds
    if head_agents:
        update["release_at_end"] = True
    update["min_agents"] = agents
    return config.model_copy(update=update)


#: builds the in-process agents of a simulated federation: (run config, agent ids, run
#: directory) -> agent id -> agent; :func:`edgepfl.edge_agent.tiers.local_trainers` is the one
LocalAgents = Callable[[RunConfig, list[str], Path], Mapping[str, LocalAgent]]


def simulate(config: RunConfig, agents: int, out_dir: str | Path, *, broker: str = EMBEDDED_BROKER,
             in_process: LocalAgents | None = None, rounds: int | None = None, head_agents: int = 0,
             head: str = "lr", fresh: bool = True, progress: bool = True, threads: int | None = None,
             agent_brokers: list[str] | None = None) -> tuple[list[RoundMetrics], dict]:
    """Run a whole federation; returns (metrics rows, summary) and writes the report into ``out_dir``.

    By default every agent is an ``edgepfl agent`` process on ``broker``; ``in_process``
    instead builds the agents as objects in this process (no broker), with the factory
    given (the coordinator does not import the agent app: the caller chooses the agents).
    ``agent_brokers`` spreads the agents over other broker URLs (bridged sites, cluster
    nodes): agent i connects to ``agent_brokers[i % len]``, the coordinator to ``broker``.
    """
    from edgepfl.coordinator.ops.report import write_report
    from edgepfl.coordinator.rounds import Coordinator

    original_min_agents = config.min_agents
    out = Path(out_dir)
    if fresh and out.exists():
        shutil.rmtree(out)
    make_dirs(out)
    intermittent = any(device.mean_online_s is not None for device in config.simulation.devices)
    config = prepare(config, agents, head_agents, rounds)
    if head_agents:  # it starts them: the run's end waits for their reports on the last release
        config = config.model_copy(update={"min_head_agents": head_agents})
    if in_process is not None and intermittent:
        # devices that come and go are never all online at once: start with the config's min_agents
        config = config.model_copy(update={"min_agents": min(agents, original_min_agents)})
    shape = service_data_shape(config)
    write_bytes(out / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode())
    ids = agent_ids(agents)
    if in_process is not None:
        if head_agents:
            raise ValueError("head-tier agents run over MQTT only (they are separate, torch-free processes)")
        if threads:
            import torch

            torch.set_num_threads(threads)
        local = LocalFleet(in_process(config, ids, out), config.federation,
                           FleetTiming(config.simulation, ids, config.seed), epochs=config.train.epochs)
        # every frame's time stamp and every agent's stopwatch read the fleet's virtual clock
        with simulated_time(local.clock.now):
            coordinator = Coordinator(config, local, out, progress=progress, **shape)
            rows = coordinator.run()
        table, summary = write_report(out, config.method.name)
        return rows, summary

    from edgepfl.coordinator.fleet import MqttFleet

    embedded = None
    url = broker
    if broker == EMBEDDED_BROKER:
        from edgepfl.broker import EmbeddedBroker

        embedded = EmbeddedBroker()
        url = embedded.start()
    procs: list[subprocess.Popen] = []
    fleet = None
    try:
        n_threads = threads or max(1, (os.cpu_count() or 1) // max(1, agents))
        specs = [(a, i, "trainer") for i, a in enumerate(ids)]
        specs += [(a, agents + i, "head") for i, a in enumerate(agent_ids(head_agents, "device"))]
        urls = agent_brokers or [url]
        # paced processes: each trainer answers no sooner than its simulated device would
        timing = FleetTiming(config.simulation, ids, config.seed) if config.simulation.pace_processes else None
        cap = agents_model_cap(config, shape)
        for agent_id, index, tier in specs:
            pace = timing[agent_id].pace if timing is not None and tier == "trainer" else None
            procs.append(spawn_agent(config, out, urls[index % len(urls)], agent_id, index, tier, head, n_threads,
                                     pace=pace, max_model_params=cap))
        fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
        coordinator = Coordinator(config, fleet, out, progress=progress, **shape)
        rows = coordinator.run()
        table, summary = write_report(out, config.method.name)
        return rows, summary
    finally:
        if fleet is not None:
            fleet.close()
        stop_agents(procs)
        if embedded is not None:
            embedded.stop()


def agent_config(config: RunConfig, out: Path, url: str, agent_id: str, index: int, tier: str, head: str,
                 threads: int | None, security: SecuritySpec | None = None,
                 pace: DevicePace | None = None,
                 max_model_params: int | None = DEFAULT_MAX_MODEL_PARAMS) -> AgentConfig:
    return AgentConfig(
        agent_id=agent_id, federation=config.federation, tier=tier,
        broker=config.broker.model_copy(update={"url": url}), data=config.data, client_index=index,
        # absolute: a relative path in the agent's YAML would resolve against that file's folder
        state_dir=str((out / "agents" / agent_id).absolute()), device=config.device, threads=threads,
        head=head if tier == "head" else "lr", security=security or SecuritySpec(), pace=pace,
        max_model_params=max_model_params,
    )


def spawn_agent(config: RunConfig, out: Path, url: str, agent_id: str, index: int, tier: str = "trainer",
                head: str = "lr", threads: int | None = 1, security: SecuritySpec | None = None,
                pace: DevicePace | None = None,
                max_model_params: int | None = DEFAULT_MAX_MODEL_PARAMS) -> subprocess.Popen:
    """Start one ``edgepfl agent`` process for partition ``index``; its log goes to ``out/agents/<id>.log``.
    ``security``: its keys (none: unsigned); ``pace``: a simulated device's (none: as fast as the host);
    ``max_model_params``: the largest model it builds (:func:`agents_model_cap`)."""
    cfg = agent_config(config, out, url, agent_id, index, tier, head, threads, security, pace, max_model_params)
    cfg_path = out / "agents" / f"{agent_id}.yaml"
    write_bytes(cfg_path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).encode())
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    logf = open_for_append(out / "agents" / f"{agent_id}.log")
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "agent", "--config", str(cfg_path)],
                            stdout=logf, stderr=subprocess.STDOUT, env=env)


def stop_agents(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM (agents publish their offline status), then SIGKILL after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
