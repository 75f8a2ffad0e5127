"""A stop request (a real SIGTERM to this process) ends an interruptible step at once, waits
for the end of an uninterruptible section, and outside both only sets the loop's flag."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from edgepfl.service import Stopped, interruptible, request_stop, uninterruptible


@pytest.fixture
def sigterm():
    """SIGTERM sets ``flag`` and calls request_stop, as the agent's handler does."""
    flag = threading.Event()

    def handler(*_):
        flag.set()
        request_stop()

    previous = signal.signal(signal.SIGTERM, handler)
    yield flag
    signal.signal(signal.SIGTERM, previous)


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_ends_an_interruptible_step_at_once(sigterm):
    steps = []
    with pytest.raises(Stopped), interruptible():
        for i in range(1000):  # a long loop of Python steps, as an install's solver iterations
            steps.append(i)
            if i == 3:
                _term()
            time.sleep(0.001)
    assert steps == [0, 1, 2, 3] and sigterm.is_set()


def test_sigterm_during_an_uninterruptible_section_takes_effect_at_its_end(sigterm):
    written = []
    with pytest.raises(Stopped), interruptible():
        with uninterruptible():
            written.append("manifest")
            _term()
            written.append("record")  # the switch is never cut in two
        written.append("after")  # not reached: the stop takes effect as the section ends
    assert written == ["manifest", "record"]


def test_outside_an_interruptible_step_sigterm_only_sets_the_flag(sigterm):
    _term()
    assert sigterm.is_set()  # the handler ran and raised nothing: the loop sees its flag
    with uninterruptible():  # a section outside a step raises nothing either
        pass
    with interruptible():  # nor does a later step: the stop was not pending
        pass


def test_a_long_computation_feeds_the_watchdog_while_it_computes_and_not_while_it_hangs(monkeypatch, tmp_path):
    """fed_while_computing: pings while the calling thread's own CPU clock advances (a head fit,
    a training round), none while it is blocked (a step that hangs: systemd must see it)."""
    import socket

    from edgepfl.service import ServiceNotifier

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping due every 0.1 s
        notifier = ServiceNotifier()

        def pings() -> int:
            count = 0
            while True:
                try:
                    assert sock.recv(64) == b"WATCHDOG=1"
                except BlockingIOError:
                    return count
                count += 1

        a = np.random.default_rng(0).random((256, 256))
        with notifier.fed_while_computing():
            # compute until the helper has pinged three times; bounded by this thread's own CPU
            # time, not the wall clock: on a loaded box the same work takes longer, not more CPU.
            # Matrix products, as a training step computes: like torch's kernels, they leave the
            # interpreter to the helper while they run
            received, started = 0, time.thread_time()
            while received < 3:
                assert time.thread_time() - started < 30, f"{received} pings in 30 CPU-s of computing"
                a = np.tanh(a @ a.T / 256)
                received += pings()
        pings()  # a last one in flight at the end
        with notifier.fed_while_computing():
            time.sleep(1.0)  # blocked for ten ping intervals: no CPU spent, so no ping
        assert pings() == 0


def test_a_stop_that_surfaces_as_another_error_is_still_the_stop(sigterm):
    """C code that calls back into Python (pydantic validating a pattern with ``re``) reports an
    exception raised inside the callback as its own error: a SIGTERM landing there came out of
    an agent's secure step as "invalid SealedShare" and exit 2 (CI, session 44). An error that
    leaves a section in which the stop was raised is the stop; one without a stop is itself."""
    def callback_that_swallows() -> None:
        try:
            _term()
            time.sleep(1)  # the handler runs here and raises Stopped
        except Stopped:
            pass  # what such C code does with it (PyErr_WriteUnraisable), before raising its own error
        raise ValueError("invalid SealedShare: peer: String should match pattern '<unprintable str object>'")

    with pytest.raises(Stopped) as stopped, interruptible():
        callback_that_swallows()
    assert isinstance(stopped.value.__cause__, ValueError)
    assert sigterm.is_set()
    # a new section starts clean: its own error is its own
    with pytest.raises(ValueError, match="its own"), interruptible():
        raise ValueError("its own")
