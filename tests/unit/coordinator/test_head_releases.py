"""Who is sent a release as a delta, and who whole (coordinator/head_releases.py, protocol 1.7)."""

from __future__ import annotations

from edgepfl.coordinator.head_releases import DeltaRelease, HeadReleases
from edgepfl.protocol import Capabilities, ReleaseRef, StatusMeta

FIRST, SECOND = ReleaseRef(release_id="fedavg-r0-aaaa", sequence=1), ReleaseRef(release_id="fedavg-r1-bbbb", sequence=2)
WHOLE, DELTA = b"whole second release", b"second release as a delta against the first"


class Sent:
    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    def __call__(self, agent_id: str, frame: bytes, round: int) -> int:
        self.frames.append((agent_id, frame))
        return len(frame)

    def to(self, agent_id: str) -> list[bytes]:
        return [frame for agent, frame in self.frames if agent == agent_id]


def status(release: ReleaseRef | None, version: str = "1.7", codecs: list | None = None, connection: int = 1,
           session: str = "5e" * 16) -> StatusMeta:
    return StatusMeta(state="online", tier="head", version=version, session=session, connection=connection,
                      release=release, capabilities=Capabilities(head_kinds=["lr"], release_codecs=codecs))


def releases_with_a_delta(sent: Sent) -> HeadReleases:
    heads = HeadReleases(sent)
    heads.published(b"first", 0, FIRST)
    return heads


def publish_second(heads: HeadReleases) -> None:
    heads.published(WHOLE, 1, SECOND, DeltaRelease(base=FIRST, frame=DELTA, codec="q4"))


def test_an_agent_with_the_base_that_decodes_the_codec_gets_the_delta():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(FIRST, codecs=["q8", "q4"]), came_online=True)
    publish_second(heads)
    assert sent.to("pi") == [DELTA]


def test_the_installed_release_is_learned_from_reports_as_well_as_statuses():
    """An agent publishes a status when it connects, and reports on each release it installs:
    the report is how the coordinator knows it has the next delta's base."""
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(None, codecs=["q4"]), came_online=True)
    assert sent.to("pi") == [b"first"]
    heads.reported("pi", FIRST.release_id, refused=False)
    publish_second(heads)
    assert sent.to("pi") == [b"first", DELTA]


def test_whole_to_an_agent_without_the_base_the_codec_or_the_version():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("other-base", status(ReleaseRef(release_id="fedavg-r9-cccc", sequence=0), codecs=["q4"]), True)
    heads.status("q8-only", status(FIRST, codecs=["q8"]), True)
    heads.status("no-codecs", status(FIRST), True)
    heads.status("v1.6", status(FIRST, version="1.6", codecs=["q4"]), True)
    publish_second(heads)
    for agent in ("other-base", "q8-only", "no-codecs", "v1.6"):
        assert sent.to(agent)[-1] == WHOLE, agent


def test_a_refused_delta_is_followed_by_the_whole_release_once():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(FIRST, codecs=["q4"]), True)
    publish_second(heads)
    heads.reported("pi", SECOND.release_id, refused=True)
    assert sent.to("pi") == [DELTA, WHOLE]
    heads.reported("pi", SECOND.release_id, refused=True)  # refused whole too: not sent again and again
    heads.reported("pi", FIRST.release_id, refused=True)  # another release's refusal changes nothing
    assert sent.to("pi") == [DELTA, WHOLE]
    # on its next connection it is offered the whole release again (the rule of MAX_RELEASE_COPIES), not the delta
    heads.status("pi", status(FIRST, codecs=["q4"], connection=2), False)
    assert sent.to("pi") == [DELTA, WHOLE, WHOLE]


def test_a_refusal_of_a_whole_release_sends_nothing_more():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(None, codecs=["q4"]), True)
    publish_second(heads)
    assert sent.to("pi") == [b"first", WHOLE]
    heads.reported("pi", SECOND.release_id, refused=True)
    assert sent.to("pi") == [b"first", WHOLE]


def test_a_resumed_release_goes_whole():
    sent = Sent()
    heads = HeadReleases(sent)
    heads.resumed(WHOLE, 1, SECOND)
    heads.status("pi", status(FIRST, codecs=["q4"]), True)
    assert sent.to("pi") == [WHOLE]
