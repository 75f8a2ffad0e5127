"""The torch-free head tier on arm64 under emulation: ``benchmarks/arm64_head_tier.py`` end
to end — the wheel with ``[agent]`` in a Debian bookworm arm64 root run by qemu-user,
``fit-head`` and ``predict`` against the same commands on x86_64, and a live head agent in
the root against Mosquitto and a coordinator on the host.

Opt-in (``EDGEPFL_ARM64=1``), not in CI: a cold run (a new root: debootstrap and pip under
emulation) takes far longer than the CI budget allows (docs/BENCHMARKS.md, "The head tier on
arm64"). Asked for, it fails rather than skips when root, debootstrap or qemu is missing.
The cached root is the script's default (``/var/cache/edgepfl/arm64-bookworm``, or
``$EDGEPFL_ARM64_ROOT``). The comparison's own logic is checked on every run, below.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import arm64_head_tier  # noqa: E402

SCRIPT = REPO / "benchmarks" / "arm64_head_tier.py"


def _line(cls: str, probs: dict[str, float], name: str = "a.png") -> str:
    preds = [{"class": c, "index": i, "probability": p} for i, (c, p) in enumerate(sorted(probs.items(),
                                                                                            key=lambda kv: -kv[1]))]
    return json.dumps({"input": f"/somewhere/{name}", "predictions": preds})


def test_comparison_sees_a_changed_class_and_a_probability_drift():
    same = arm64_head_tier.compare_predictions(_line("1", {"1": 0.9, "2": 0.1}), _line("1", {"1": 0.90004, "2": 0.09996}))
    assert same["same_inputs"] and same["same_classes"] and same["max_abs_probability_diff"] == pytest.approx(4e-5)
    flipped = arm64_head_tier.compare_predictions(_line("1", {"1": 0.51, "2": 0.49}), _line("2", {"2": 0.51, "1": 0.49}))
    assert not flipped["same_classes"] and flipped["classes_differing"] == 1
    other = arm64_head_tier.compare_predictions(_line("1", {"1": 1.0}, "a.png"), _line("1", {"1": 1.0}, "b.png"))
    assert not other["same_inputs"]
    assert not arm64_head_tier.compare_predictions("", "")["same_inputs"]  # nothing predicted is no agreement


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--heads", "forest", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "unknown head kind" in proc.stderr and "forest" in proc.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(os.environ.get("EDGEPFL_ARM64") != "1", reason="slow (arm64 under qemu): set EDGEPFL_ARM64=1")
def test_head_tier_on_arm64_matches_x86_and_reports_live(tmp_path):
    missing = [t for t in ("debootstrap", "qemu-aarch64-static", "mosquitto", "unshare")
               if not shutil.which(t) and not Path("/usr/sbin", t).exists()]
    assert os.geteuid() == 0 and not missing, (
        f"EDGEPFL_ARM64=1 asks for the arm64 lane, which needs root and {missing or 'nothing more'}: "
        "apt-get install debootstrap qemu-user-static binfmt-support mosquitto")
    out = tmp_path / "arm64"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["failures"] == []
    assert r["install"]["machine"] == "aarch64" and r["install"]["torch"] is False
    assert not any(p.lower().startswith("torch") for p in r["install"]["packages"])
    for pred in r["predict"].values():
        for case in ("agreement_own", "agreement_x86_head"):
            agree = pred[case]
            assert agree["same_inputs"] and agree["same_classes"] and agree["inputs"] == 96
            assert agree["max_abs_probability_diff"] <= 1e-4
    for fits in r["fit_head"].values():
        assert fits["same_accuracies"] and fits["arm64"]["report"]["validation_accuracy"] > 0.8
    report = r["live"]["report"]
    assert report["tier"] == "head" and report["accuracy"] > 0.5
    assert report["release_id"] == r["live"]["installed_release"]
