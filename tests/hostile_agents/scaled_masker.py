"""An enrolled device that sends its masked vector times 1,000 (modulo 2**64, as the ring adds)
in every secure round: its masks no longer cancel, so the sum it is in is noise the size of the
ring. Everything else — keys, shares, reveals, signatures — is edgepfl's agent.

    python -m tests.hostile_agents.scaled_masker --config agent.yaml
"""

from __future__ import annotations

import sys

import numpy as np

from edgepfl.edge_agent.secure import SecureSessions

_honest_mask = SecureSessions.mask


def _scaled_mask(self, federation, round, task, vector):
    return _honest_mask(self, federation, round, task, vector) * np.uint64(1000)


SecureSessions.mask = _scaled_mask  # type: ignore[method-assign]

if __name__ == "__main__":
    from edgepfl.cli import main

    sys.exit(main(["agent", *sys.argv[1:]]))
