"""Who is sent a release as a delta, a restore or whole, and who is sent a staged one (coordinator/releases/head_releases.py)."""

from __future__ import annotations

from edgepfl.coordinator.releases.head_releases import DeltaRelease, HeadReleases, RestoreRelease
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
    heads.reported("other-base", FIRST.release_id, refused=True)  # sent the first, it kept its own
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
    heads.reported("pi", FIRST.release_id, refused=True)
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


BAD = ReleaseRef(release_id="fedavg-r2-dddd", sequence=3)
FIRST_AGAIN = ReleaseRef(release_id=FIRST.release_id, sequence=4)  # a rollback to the first release


def test_a_staged_release_goes_only_to_the_admitted_agents_then_to_everyone_when_promoted():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    for agent in ("canary", "pi", "late"):
        heads.status(agent, status(FIRST, version="1.8", codecs=["q4"]), True)
    heads.stage(WHOLE, 1, SECOND, ["canary", "late"], DeltaRelease(base=FIRST, frame=DELTA, codec="q4"))
    assert sent.to("canary") == [DELTA] and sent.to("pi") == [] and sent.to("late") == [DELTA]
    heads.status("newcomer", status(None, version="1.8"), True)  # not admitted: gets the current release
    assert sent.to("newcomer") == [b"first"]
    heads.reported("newcomer", FIRST.release_id, refused=False)
    heads.reported("canary", SECOND.release_id, refused=False)
    heads.published(WHOLE, 1, SECOND, DeltaRelease(base=FIRST, frame=DELTA, codec="q4"), have=["canary"])
    assert sent.to("canary") == [DELTA]  # installed in its stage: not sent again
    assert sent.to("pi") == [DELTA] and sent.to("newcomer") == [b"first", WHOLE]


def test_a_halted_release_is_sent_to_no_one_and_the_rollback_restores_where_the_release_is_held():
    """After a halt, the release gone back to is published again under a new sequence: an agent
    of 1.8 that holds it — installed, or kept before the halted one — gets its restore form, even
    if the release was sent to it earlier in the session; others get it whole; a refused restore
    is followed by the whole release."""
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("canary", status(FIRST, version="1.8"), True)
    heads.status("pi", status(None, version="1.8"), True)  # sent the first release whole in this session
    heads.reported("pi", FIRST.release_id, refused=False)
    heads.status("old", status(FIRST, version="1.7"), True)
    heads.status("empty", status(None, version="1.8", connection=2, session="7a" * 16), True)
    heads.stage(b"bad", 2, BAD, ["canary"])
    heads.reported("canary", BAD.release_id, refused=False)
    heads.unstage()
    heads.status("late", status(FIRST, version="1.8"), True)  # the halted release goes to no one now
    assert sent.to("canary") == [b"bad"] and sent.to("late") == []
    holders = frozenset({FIRST.release_id, BAD.release_id})
    heads.published(b"first again", 0, FIRST_AGAIN, restore=RestoreRelease(b"restore first", holders))
    assert sent.to("canary") == [b"bad", b"restore first"]
    assert sent.to("pi") == [b"first", b"restore first"]
    assert sent.to("old")[-1] == b"first again"  # 1.7 keeps no release before the installed one
    heads.reported("pi", FIRST.release_id, refused=True)  # its kept files are gone, say
    assert sent.to("pi") == [b"first", b"restore first", b"first again"]


def test_after_a_release_halted_and_rolled_back_the_operators_rollback_still_has_the_one_before(tmp_path):
    """r0, r1 published; r2 halted at its canary and rolled back to r1. ``edgepfl release
    rollback`` said "nothing to roll back to" though the fleet held r0: the halt's rollback
    dropped what was before r1. Now r1's previous is r0 again; a rollback to r0 leaves none."""
    from types import SimpleNamespace

    from edgepfl.config import RunConfig
    from edgepfl.coordinator.releases.channel import ReleaseChannel
    from edgepfl.coordinator.releases.release import fleet_current, publish_release, published_frame, rollback_release
    from edgepfl.protocol import MessageType, ReleaseMeta, decode, encode

    from tests.export_fixtures import export_dir
    from tests.fleet_helpers import release_frame

    class Built:  # what publish_release reads of a BuiltRelease
        def __init__(self, frame: bytes):
            self.frame, self.delta = frame, None

    base = release_frame("f", export_dir(tmp_path, "fedavg", rounds=1), 0)
    meta = decode(base).meta_as(ReleaseMeta)

    def named(release_id: str) -> bytes:
        message = decode(base)
        return encode(MessageType.RELEASE, federation="f", sender="coordinator", round=0,
                      meta=meta.model_copy(update={"release_id": release_id}), tensors=dict(message.tensors))

    # publish_release reaches the fleet through its release channel only: the base one publishes nowhere
    releases, fleet, config = tmp_path / "releases", SimpleNamespace(releases=ReleaseChannel()), RunConfig(federation="f")
    releases.mkdir()
    for rid in ("r0", "r1", "r2"):
        publish_release(fleet, Built(named(rid)), 0, releases)
    assert fleet_current(releases).release_id == "r2"

    def previous_id() -> str | None:
        frame = published_frame(releases, previous=True)
        return decode(frame).meta_as(ReleaseMeta).release_id if frame is not None else None

    assert previous_id() == "r1"
    back = rollback_release(published_frame(releases, previous=True), releases, config, rolled_back=["r2"])
    publish_release(fleet, back, back.round, releases)  # the halt at r2's canary
    assert fleet_current(releases).release_id == "r1" and previous_id() == "r0"
    again = rollback_release(published_frame(releases, previous=True), releases, config, rolled_back=["r1"])
    publish_release(fleet, again, again.round, releases)  # the operator's rollback
    assert fleet_current(releases).release_id == "r0" and previous_id() is None


def test_the_bytes_sent_are_counted_by_the_form_they_went_in():
    """The console said "0.07 MB as a delta" of releases that went whole: what it says now is
    what was sent, counted here, by form."""
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("keeps", status(FIRST, codecs=["q4"]), True)
    heads.status("lost-it", status(FIRST, codecs=["q4"]), True)
    heads.status("old", status(FIRST, version="1.6", codecs=["q4"]), True)
    publish_second(heads)
    heads.reported("lost-it", SECOND.release_id, refused=True)  # then whole
    assert heads.sent_bytes == {"whole": 2 * len(WHOLE), "delta": 2 * len(DELTA), "restore": 0}
    assert sum(len(frame) for _, frame in sent.frames) == sum(heads.sent_bytes.values())
    # and by release: the first went to nobody (each agent had it), the second in both forms
    assert heads.sent_by_release == {SECOND.release_id: {"whole": 2 * len(WHOLE), "delta": 2 * len(DELTA),
                                                         "restore": 0}}


THIRD = ReleaseRef(release_id="fedavg-r2-eeee", sequence=3)
THIRD_WHOLE, THIRD_DELTA = b"whole third release", b"third release as a delta against the second"


def publish_third(heads: HeadReleases) -> None:
    heads.published(THIRD_WHOLE, 2, THIRD, DeltaRelease(base=SECOND, frame=THIRD_DELTA, codec="q4"))


def test_releases_published_while_an_agent_installs_wait_for_its_report_and_then_only_the_current_one_goes():
    """Installs slower than rounds: an agent fitting the first release is sent nothing more
    until it reports on it, then the release current at that moment, once (whole: the delta is
    against the second, which it never had). Before, each release went at once, whole."""
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(None, codecs=["q4"]), True)
    assert sent.to("pi") == [b"first"]
    publish_second(heads)
    publish_third(heads)
    assert sent.to("pi") == [b"first"]
    heads.reported("pi", FIRST.release_id, refused=False)
    assert sent.to("pi") == [b"first", THIRD_WHOLE]
    heads.reported("pi", FIRST.release_id, refused=False)  # an unasked report again: nothing more
    heads.status("pi", status(FIRST, codecs=["q4"]), False)  # its status after the install, same connection
    assert sent.to("pi") == [b"first", THIRD_WHOLE]
    heads.reported("pi", THIRD.release_id, refused=False)
    assert sent.to("pi") == [b"first", THIRD_WHOLE]


def test_the_status_an_agent_publishes_after_its_install_settles_the_release_in_flight_as_a_report_does():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(None, codecs=["q4"]), True)
    publish_second(heads)
    heads.status("pi", status(FIRST, codecs=["q4"]), False)
    assert sent.to("pi") == [b"first", DELTA]  # it has the second's base now: the delta
    heads.reported("pi", FIRST.release_id, refused=False)  # the report after the status: nothing more
    assert sent.to("pi") == [b"first", DELTA]


def test_a_reconnect_ends_what_was_in_flight_and_the_agent_is_sent_the_current_release():
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("pi", status(None, codecs=["q4"]), True)
    publish_second(heads)
    heads.status("pi", status(None, codecs=["q4"], connection=2), True)  # lost the first with its connection
    assert sent.to("pi") == [b"first", WHOLE]


def test_an_agent_that_takes_the_retained_copies_has_the_first_release_in_flight_and_then_gets_a_delta():
    sent = Sent()
    heads = HeadReleases(sent)
    heads.status("pi", status(None, codecs=["q4"]), True)  # said it has none while nothing was named
    heads.published(b"first", 0, FIRST)
    publish_second(heads)
    assert sent.to("pi") == []  # the first from the retained copies; the second waits for its report
    heads.reported("pi", FIRST.release_id, refused=False)
    assert sent.to("pi") == [DELTA]


def test_an_agent_before_1_4_is_sent_no_copy_of_its_own():
    """It subscribes to the retained copies on every connect: a copy on its task topic as well
    was a second download of the release on every reconnect."""
    sent = Sent()
    heads = releases_with_a_delta(sent)
    heads.status("old", status(None, version="1.3"), came_online=True)
    heads.status("old", status(None, version="1.3", connection=2), came_online=True)
    assert sent.to("old") == []
