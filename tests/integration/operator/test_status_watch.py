"""``edgepfl status --watch`` follows the fleet view as the coordinator publishes it:
a real Mosquitto, views published by a plain paho client, the command as a subprocess; a
payload that is not a view is passed over, not the end of the watch; Ctrl-C ends it with 0,
even when it was started with SIGINT ignored and the signal lands on its network thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import paho.mqtt.client as mqtt

from edgepfl.broker import parse_broker_url
from edgepfl.protocol.view import FleetView

from tests.fleet_helpers import wait_until


def view(federation: str, round: int) -> bytes:
    now = time.time()
    return FleetView(federation=federation, method="fedavg", updated=now, started=now - 5, heartbeat_s=5,
                     phase="training", round=round, rounds=10, rounds_completed=round).model_dump_json().encode()


def not_main_thread(pid: int) -> int:
    """A thread of ``pid`` other than its main one (Linux: /proc), or ``pid`` itself where there is no /proc."""
    tasks = f"/proc/{pid}/task"
    others = sorted(int(tid) for tid in os.listdir(tasks) if int(tid) != pid) if os.path.isdir(tasks) else []
    return others[-1] if others else pid


def ignore_sigint() -> None:
    """What a process started in the background by a non-interactive shell (a CI script) inherits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_status_watch_shows_each_new_view_passes_over_junk_and_stops_on_ctrl_c(mosquitto):
    federation = f"w{uuid.uuid4().hex[:8]}"
    host, port, _ = parse_broker_url(mosquitto.url)
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    publisher.connect(host, port)
    publisher.loop_start()
    topic = f"edgepfl/v1/{federation}/view"
    publisher.publish(topic, view(federation, 3), qos=1, retain=True).wait_for_publish(5)
    proc = subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "status", "--broker", mosquitto.url, "--federation",
                             federation, "--watch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore_sigint)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, sink=sink: sink.extend(iter(s.readline, "")), daemon=True)
               for s, sink in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        wait_until(lambda: any("round 3 of 0..9" in line for line in out), 60, what="the retained view shown")
        publisher.publish(topic, b'{"not": "a view"}', qos=1).wait_for_publish(5)
        publisher.publish(topic, view(federation, 4), qos=1).wait_for_publish(5)
        wait_until(lambda: any("round 4 of 0..9" in line for line in out), 60, what="the next view shown")
        # stderr has its own pipe and reader: the line may come after stdout's next view
        wait_until(lambda: any("passed over a message" in line for line in err), 60, what="the junk passed over")
        assert proc.poll() is None  # still watching
        # the kernel hands a process's signal to whichever thread it likes: this one lands on the
        # network thread, and the main thread, waiting for the next view, must still act on it
        os.kill(not_main_thread(proc.pid), signal.SIGINT)
        assert proc.wait(timeout=30) == 0, "".join(err)
    finally:
        if proc.poll() is None:
            proc.kill()
        publisher.loop_stop()
        publisher.disconnect()
