"""Tier runtimes: the head tier turns a release into metrics in a fresh interpreter that
never imports torch (the tiers and the agent's dispatch in process:
tests/unit/edge_agent/test_tiers.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.export_fixtures import NEW_CLIENT, REPO_ROOT_HINT
from tests.unit.edge_agent import test_tiers as unit
from tests.unit.edge_agent.test_tiers import FED

# the unit tests' fixtures: pytest finds them here under their names
release = unit.release


def test_the_head_tier_never_imports_torch(release, tmp_path):
    (tmp_path / "release.bin").write_bytes(release)
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from edgepfl.config import AgentConfig
        from edgepfl.data import load_client_data
        from edgepfl.edge_agent.agent import Agent
        from edgepfl.edge_agent.tiers import create_tier
        from edgepfl.protocol import decode
        sys.path.insert(0, "tests")
        from export_fixtures import data_spec

        config = AgentConfig(agent_id="pi", federation={FED!r}, tier="head", data=data_spec(),
                             client_index={NEW_CLIENT}, state_dir={str(tmp_path / "state")!r})
        tier = create_tier(config, load_client_data(config.data, config.client_index))
        tier.restore()
        reply = tier.handle(decode(Path({str(tmp_path / "release.bin")!r}).read_bytes()))
        print(json.dumps({{"reply": reply.channel.value,
                          "torch": sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT_HINT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"reply": "metrics", "torch": []}
