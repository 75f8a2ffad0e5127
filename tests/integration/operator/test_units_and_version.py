"""The operator's side, against other processes: the example systemd units pass
``systemd-analyze security``, and ``python -m edgepfl --version`` (the operator's side at
unit level: tests/unit/core/test_operator.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgepfl.errors import ExitCode

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("unit", sorted(p.name for p in (REPO / "examples").glob("*.service")))
def test_example_units_are_hardened(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    text = (REPO / "examples" / unit).read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text
    assert any(line.startswith("RestartPreventExitStatus=") and str(int(ExitCode.USAGE)) in line.split("=")[1].split()
               for line in text.splitlines())
    shutil.copy(REPO / "examples" / unit, tmp_path / unit)  # --offline reads the unit by its file name
    proc = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(tmp_path / unit)],
                          capture_output=True, text=True, timeout=60)
    line = next((ln for ln in proc.stdout.splitlines() if "Overall exposure level" in ln), None)
    if line is None:
        pytest.skip(f"systemd-analyze security --offline is not supported here: {proc.stderr[-300:]}")
    score = float(line.split(":")[1].split()[0])
    assert score <= 2.0, line


def test_python_m_edgepfl_and_version():
    from edgepfl import __version__

    proc = subprocess.run([sys.executable, "-m", "edgepfl", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"edgepfl {__version__}"
