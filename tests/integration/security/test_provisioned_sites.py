"""A fleet of sites from ``edgepfl provision --site`` (docs/OPERATING.md, "Sites"), live: the
central broker and two site brokers run the ``mosquitto.conf`` it wrote (TLS, client
certificates, ACLs), the central coordinator its ``coordinator.yaml``, each aggregator its
``aggregator.yaml`` and each device its bundle, with only what the summary says to add
(method, model, data, rounds); every message signed. Two training rounds take every device."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from edgepfl.config import load_run_config
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, stop_agents
from edgepfl.provision import main_provision
from edgepfl.testing.brokers import MosquittoBroker

from tests.conftest import require_mosquitto
from tests.fleet_helpers import read_rows, run_config
from tests.integration.security.test_provisioned_federation import spawn_bundle_agent

SITES = {"site-a": ["cam-0", "cam-1"], "site-b": ["cam-2", "cam-3"]}
RUN = {"method": {"name": "fedavg"}, "model": {"arch": "mlp", "feature_dim": 16}}


def _edit(path: Path, **changes) -> None:
    """What an operator adds to a bundle's YAML (keys of a section merged into it)."""
    body = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        body[key] = {**body[key], **value} if isinstance(value, dict) and isinstance(body.get(key), dict) else value
    path.write_text(yaml.safe_dump(body, sort_keys=False))


def test_a_provisioned_fleet_of_two_sites_runs_from_its_bundles(tmp_path):
    require_mosquitto()
    federation = f"p{uuid.uuid4().hex[:8]}"
    out = tmp_path / "plant"
    sites = [f"--site={site}:{','.join(devices)}" for site, devices in SITES.items()]
    assert main_provision(["--federation", federation, *sites, "--broker-host", "localhost", "--site-host",
                           "site-a=localhost,site-b=localhost", "--out", str(out)]) == 0
    data = run_config(federation).data.model_copy(update={"num_clients": 4})
    procs: list[subprocess.Popen] = []
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as central, \
            MosquittoBroker(conf=out / "sites" / "site-a" / "broker" / "mosquitto.conf") as broker_a, \
            MosquittoBroker(conf=out / "sites" / "site-b" / "broker" / "mosquitto.conf") as broker_b:
        site_brokers = {"site-a": broker_a, "site-b": broker_b}
        coordinator_yaml = out / "coordinator" / "coordinator.yaml"
        _edit(coordinator_yaml, **RUN, data=data.model_dump(mode="json"), rounds=2, min_agents=4, round_timeout_s=60,
              broker={"url": central.url})
        config = load_run_config(coordinator_yaml)
        assert config.sites.enabled and config.sites.ids == sorted(SITES)
        index = 0
        try:
            for site, devices in SITES.items():
                folder = out / "sites" / site
                written = yaml.safe_load((folder / "aggregator.yaml").read_text())
                _edit(folder / "aggregator.yaml", central={"broker": {**written["central"]["broker"], "url": central.url}},
                      site={**RUN, "broker": {**written["site"]["broker"], "url": site_brokers[site].url}})
                log = open(folder / "aggregator.log", "ab")  # noqa: SIM115 (the process writes it until it stops)
                procs.append(subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "aggregator", "--config",
                                               "aggregator.yaml"], cwd=folder, stdout=log, stderr=subprocess.STDOUT))
                for device in devices:
                    bundle = folder / "agents" / device
                    _edit(bundle / "agent.yaml", broker={"url": site_brokers[site].url})
                    procs.append(spawn_bundle_agent(bundle, config, index))
                    index += 1
            fleet = MqttFleet(config.federation, config.broker, security=config.security)
            try:
                Coordinator(config, fleet, tmp_path / "run", progress=False, **data_shape(config)).run()
            finally:
                fleet.close()
        finally:
            stop_agents(procs)
    rows = read_rows(tmp_path / "run")
    logs = "".join((out / "sites" / s / "aggregator.log").read_text(errors="replace") for s in SITES)
    assert [r.round for r in rows] == [0, 1, 2] and rows[-1].final, logs[-3000:]
    for row in rows[:-1]:
        assert row.participants == sorted(sum(SITES.values(), [])) and not row.aborted and row.rejected == {}, \
            logs[-3000:]
