"""Broken configs fail loudly through the CLI: it exits non-zero, naming the offending
field, before starting anything (the configs and the Python API:
tests/unit/core/test_configs.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.core.test_configs import BROKEN, _broken

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("case", ["wrong type", "unknown method option"])
def test_cli_with_bad_config_exits_nonzero_naming_the_field(case, tmp_path):
    mutate, field = BROKEN[case]
    path = _broken(tmp_path, mutate)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "edgepfl.cli", "simulate", "--config", str(path), "--agents", "2",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert proc.returncode != 0
    assert f"{field}:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr  # a user error, not a crash
    assert not (tmp_path / "run").exists()  # refused before anything was started
