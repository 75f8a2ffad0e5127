"""The registry needs no torch: listing the methods, validating every shipped config and
locating a bad method option work in an interpreter where torch cannot be imported, and
a torch method used there names the extra to install (the import rules of the
architecture: tests/contract/test_layering.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_methods_listing_works_without_torch():
    proc = _run_without_torch("from edgepfl.cli import main; sys.exit(main(['methods']))")
    assert proc.returncode == 0, proc.stderr
    from edgepfl.methods import available_methods

    names = available_methods()
    assert len(names) >= 14
    for name in names:
        assert name in proc.stdout


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_config_validation_works_without_torch(config):
    code = (f"from edgepfl.config import load_run_config\n"
            f"c = load_run_config({str(ROOT / 'configs' / config)!r})\n"
            f"print(c.method.name)\n"
            f"assert 'torch' not in {{k for k, v in sys.modules.items() if v is not None}}\n")
    proc = _run_without_torch(code)
    assert proc.returncode == 0, proc.stderr
    # the method the file names (a method's config is named after it; a scenario's, e.g. unequal_fleet, is not)
    assert proc.stdout.strip() == yaml.safe_load((ROOT / "configs" / config).read_text())["method"]["name"]


def test_a_torch_method_used_without_torch_names_the_extra():
    code = ("from edgepfl.config import ModelSpec\nfrom edgepfl.methods import create_method\n"
            "create_method('repper').build_model(ModelSpec(), (1, 28, 28), 10)\n")
    proc = _run_without_torch(code)
    assert proc.returncode != 0
    assert "pip install 'edgepfl[train]'" in proc.stderr.strip().splitlines()[-1]


def test_a_bad_method_option_is_located_without_torch():
    code = ("from edgepfl.config import ConfigError, parse_config, RunConfig\n"
            "try:\n    parse_config(RunConfig, {'method': {'name': 'repper', 'head': 'knn'}}, 'x.yaml')\n"
            "except ConfigError as e:\n    print(e)\n")
    proc = _run_without_torch(code)
    assert proc.returncode == 0, proc.stderr
    assert "method" in proc.stdout and "head" in proc.stdout


def test_a_bad_config_to_simulate_or_the_coordinator_is_said_before_torch_is_imported(tmp_path):
    """`simulate` once imported torch (seconds, hundreds of MB) before it read the YAML."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1\n")
    for command in ("simulate", "coordinator"):
        code = ("import sys\nfrom edgepfl.cli import main\n"
                f"rc = main([{command!r}, '--config', {str(bad)!r}])\n"
                "print(rc, 'torch' in sys.modules)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.stdout.split() == ["2", "False"], (command, proc.stdout, proc.stderr)
        assert "invalid YAML" in proc.stderr


def test_the_release_service_connects_without_torch(mosquitto, tmp_path):
    """`edgepfl release` runs from the `[agent]` extra: the release service builds no method
    (its inbox opens no round, so every update is rejected before one would be needed)."""
    code = (f"from pathlib import Path\n"
            f"from edgepfl.config import RunConfig\n"
            f"from edgepfl.coordinator.fleet import MqttFleet\n"
            f"from edgepfl.coordinator.releases.rollout import ReleaseService\n"
            f"config = RunConfig(federation='light-release', method={{'name': 'repper'}})\n"
            f"fleet = MqttFleet(config.federation, config.broker, url={mosquitto.url!r})\n"
            f"service = ReleaseService(config, fleet, Path({str(tmp_path / 'releases')!r}))\n"
            f"service.close()\n"
            f"print('torch' in {{k for k, v in sys.modules.items() if v is not None}})\n")
    proc = _run_without_torch(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
