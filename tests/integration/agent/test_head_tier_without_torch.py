"""Head tier runtime: the whole head path never imports torch, in a fresh interpreter (the
runtime in process: tests/unit/edge_agent/test_head_tier.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from edgepfl.export.onnx_export import read_release

from tests.export_fixtures import DEVICE_PREAMBLE, REPO_ROOT_HINT, write_device_files
from tests.unit.edge_agent import test_head_tier as unit

# the unit tests' fixtures: pytest finds them here under their names
releases, data = unit.releases, unit.data


def test_head_runtime_never_imports_torch(releases, data, tmp_path):
    """The whole head path in a fresh interpreter: install, fit, save, restore, predict — no torch."""
    manifest, artifact = read_release(releases[0])
    write_device_files(tmp_path, manifest, artifact, data)
    script = DEVICE_PREAMBLE.format(tmp=str(tmp_path)) + textwrap.dedent("""
        from edgepfl.edge_agent.head_tier import HeadRuntime

        out = {}
        for kind in ("svm", "lr", "mlp"):
            rt = HeadRuntime(tmp / kind, kind, data)
            m = rt.install_release(manifest, artifact, manifest.encoder.sha256)
            again = HeadRuntime(tmp / kind, kind, data)
            again.load()
            same = bool((again.predict(data.x_test) == rt.predict(data.x_test)).all())
            out[kind] = {"accuracy": m.accuracy, "same_after_restart": same}
        out["torch_imported"] = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("torch_imported") == []
    for kind, r in result.items():
        assert r["accuracy"] > 0.5 and r["same_after_restart"], (kind, r)
