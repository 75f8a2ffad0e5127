"""Files with state or secrets are never writable by other local users, whatever the umask
(a red team's finding, docs/SECURITY.md): a run under ``umask 000`` leaves no group- or world-writable file or
directory in its run directory, agents' state included."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import yaml

from tests.fleet_helpers import run_config


def test_a_run_under_umask_000_leaves_nothing_others_may_write(tmp_path):
    config = run_config(method={"name": "fedrep"}, model={"arch": "mlp", "feature_dim": 16},
                        data={"samples_per_client": 60}, rounds=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "edgepfl.cli", "simulate", "--in-process", "--config", str(path),
                           "--agents", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.umask(0))
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [out, *out.rglob("*")]
    # the run wrote what the checks below are about: checkpoints, rows, agents' personal state
    names = {p.name for p in paths}
    assert {"state.json", "metrics.jsonl"} <= names and any(n.startswith("personal-") for n in names), names
    shared = sorted(f"{p.relative_to(tmp_path)} {stat.S_IMODE(p.lstat().st_mode):o}" for p in paths
                    if not p.is_symlink() and p.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    assert not shared, shared
