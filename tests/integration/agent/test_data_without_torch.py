"""Data package: it imports and loads without torch, in a fresh interpreter (the rest of
the package: tests/unit/data/test_data.py)."""

from __future__ import annotations

import subprocess
import sys


def test_import_and_load_without_torch():
    # a finder that refuses torch: the head tier's environment, without uninstalling anything
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'torchvision'):\n"
        "            raise ImportError('torch is not installed on this device')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from edgepfl.config import DataSpec\n"
        "from edgepfl.data import load_client_data\n"
        "c = load_client_data(DataSpec(dataset='digits', num_clients=2), 1)\n"
        "assert c.num_train > 0 and 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
