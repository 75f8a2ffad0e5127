"""An enrolled device whose sealed shares open for no one: in each secure round it answers
the roster with one ciphertext of the right size per neighbour, all zero bytes (signed with
its own key, as every frame of it). Everything else is edgepfl's agent.

    python -m tests.hostile_agents.garbage_sealer --config agent.yaml
"""

from __future__ import annotations

import sys

from edgepfl.edge_agent.secure import SecureSessions
from edgepfl.protocol.secagg import SecAggMeta, b64, unb64

_honest_roster = SecureSessions._roster


def _garbage_roster(self, h, meta) -> SecAggMeta:
    answer = _honest_roster(self, h, meta)
    garbage = [s.model_copy(update={"ciphertext": b64(bytes(len(unb64(s.ciphertext))))}) for s in answer.shares]
    return answer.model_copy(update={"shares": garbage})


SecureSessions._roster = _garbage_roster  # type: ignore[method-assign]

if __name__ == "__main__":
    from edgepfl.cli import main

    sys.exit(main(["agent", *sys.argv[1:]]))
