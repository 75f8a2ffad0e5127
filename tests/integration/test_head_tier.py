"""Head tier runtime: the whole head path never imports torch, in a fresh interpreter (the
runtime in process: tests/unit/edge_agent/test_head_tier.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np

from edgepfl.export.onnx_export import read_release

from tests.export_fixtures import REPO_ROOT_HINT
from tests.unit.edge_agent import test_head_tier as unit

# the unit tests' fixtures: pytest finds them here under their names
releases, data = unit.releases, unit.data


def test_head_runtime_never_imports_torch(releases, data, tmp_path):
    """The whole head path in a fresh interpreter: install, fit, save, restore, predict — no torch."""
    manifest, artifact = read_release(releases[0])
    (tmp_path / "encoder.onnx").write_bytes(artifact)
    (tmp_path / "manifest.json").write_text(manifest.model_dump_json())
    np.savez(tmp_path / "data.npz", x_train=data.x_train, y_train=data.y_train, x_test=data.x_test,
             y_test=data.y_test)
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        import numpy as np
        from edgepfl.edge_agent.head_tier import HeadRuntime
        from edgepfl.data.client import ClientData
        from edgepfl.protocol import read_manifest

        tmp = Path({str(tmp_path)!r})
        arrays = np.load(tmp / "data.npz")
        data = ClientData(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], 10)
        manifest = read_manifest(tmp / "manifest.json")
        out = {{}}
        for kind in ("svm", "lr", "mlp"):
            rt = HeadRuntime(tmp / kind, kind, data)
            m = rt.install_release(manifest, (tmp / "encoder.onnx").read_bytes(), manifest.encoder.sha256)
            again = HeadRuntime(tmp / kind, kind, data)
            again.load()
            same = bool((again.predict(data.x_test) == rt.predict(data.x_test)).all())
            out[kind] = {{"accuracy": m.accuracy, "same_after_restart": same}}
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
