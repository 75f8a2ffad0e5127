"""When a head agent takes the retained release (edge_agent/release_fetch.py; live:
tests/integration/releases/test_release_by_reference.py)."""

from __future__ import annotations

import pytest

from edgepfl.edge_agent.release_fetch import wants_retained
from edgepfl.protocol import CoordinatorMeta, ReleaseRef

R1 = ReleaseRef(release_id="fedavg-r1-aaaaaaaaaaaa", sequence=1)
R2 = ReleaseRef(release_id="fedavg-r2-bbbbbbbbbbbb", sequence=2)
R1_RESEQUENCED = ReleaseRef(release_id=R1.release_id, sequence=3)  # same encoder, published again


def presence(state="online", release=None, version="1.4") -> CoordinatorMeta:
    return CoordinatorMeta(state=state, release=release, version=version)


@pytest.mark.parametrize("coordinator, installed, known, takes", [
    # online, 1.4, naming a release: it sends what the agent lacks, so the retained copy would come twice
    (presence(release=R2), R1, None, False),
    (presence(release=R1), R1, None, False),
    (presence(release=R2), None, None, False),
    # online, 1.4, naming none (it published none yet): only an agent without any release takes
    # what may be retained from an earlier run; the coordinator does not send it its first release
    (presence(release=None), None, None, True),
    (presence(release=None), R1, None, False),
    # done, naming a release: only when that is not the installed one
    (presence("done", R1), R1, R1, False),
    (presence("done", R2), R1, R1, True),
    (presence("done", R1_RESEQUENCED), R1, R1, True),
    (presence("done", R1), None, None, True),
    # the coordinator's last will (names nothing): unless the installed release is the last one named
    (presence("offline"), R1, R1, False),
    (presence("offline"), R1, R2, True),
    (presence("offline"), R1, None, True),
    (presence("offline"), None, None, True),
    # a 1.3 coordinator sends no release to an agent it believes has one: the retained copy, as before
    (presence(release=None, version="1.3"), R1, None, True),
    (presence(release=None, version="1.3"), R1, R1, False),
    # no presence within the wait
    (None, None, None, True),
    (None, R1, R1, False),
])
def test_a_head_agent_takes_the_retained_release_only_when_nobody_else_brings_what_it_lacks(
        coordinator, installed, known, takes):
    assert wants_retained(coordinator, installed, known) is takes
