"""``edgepfl dashboard`` in a real headless Chromium (Debian's, driven by Selenium).

A real Mosquitto holds a retained fleet view; the dashboard is a real ``edgepfl dashboard``
process; the page is read as an operator sees it:

* a view of 10,000 agents (as large as one MQTT message of the default size allows, the
  rest counted in ``agents_left_out``): the agent count, the head agents on each release,
  the rollout's stage and the latest accuracy are on the page, and it redraws when the coordinator publishes
  the next view (the accuracy curve gains its point); the time the page took to draw it is
  recorded with a screenshot (``$EDGEPFL_TEST_ARTIFACTS`` or the test's folder);
* a provisioned federation over TLS: the dashboard reads the view with the operator's
  read-only bundle (``operator/operator.yaml``) and shows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from edgepfl.protocol.view import AgentView, FleetView, RolloutView, encode_view

from tests.conftest import require_mosquitto
from tests.fleet_helpers import wait_until

RELEASES = ("fedavg-r9-aaaaaaaaaaaa", "fedavg-r19-bbbbbbbbbbbb")


def fleet_view(federation: str, agents: int, round: int, accuracy: float, started: float) -> FleetView:
    heads = agents // 2
    listed = [AgentView(id=f"pi-{i:05d}", tier="head", online=i % 10 != 0, last_seen=started,
                        release=RELEASES[i % 4 == 0], num_train=120) for i in range(heads)]
    listed += [AgentView(id=f"jetson-{i:05d}", tier="trainer", online=True, last_seen=started, num_train=600)
               for i in range(agents - heads)]
    online_heads = [a for a in listed if a.tier == "head" and a.online]
    releases = {r: sum(a.release == r for a in online_heads) for r in RELEASES}
    return FleetView(federation=federation, method="fedavg", updated=time.time(), started=started, phase="training",
                     round=round, rounds=50, rounds_completed=round, last_accuracy=accuracy,
                     last_accuracy_round=round - 1, release=RELEASES[1],
                     online={"trainer": agents - heads, "head": len(online_heads)}, releases=releases,
                     rejected={"unsigned": 3}, agents=listed,
                     rollout=RolloutView(release=RELEASES[1], stage=2, stages=[0.05, 0.25, 1.0], state="staging",
                                         admitted=1125, reported=1000, paired=980, mean_change=0.004,
                                         worst_change=-0.031, latency_ratio=1.04))


def publish_view(url: str, federation: str, payload: bytes, broker: dict | None = None) -> None:
    import paho.mqtt.client as mqtt

    from edgepfl.broker import parse_broker_url

    host, port, tls = parse_broker_url(url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    if tls and broker is not None:
        client.tls_set(ca_certs=broker["ca_file"], certfile=broker.get("cert_file"), keyfile=broker.get("key_file"))
        if "password_file" in broker:
            client.username_pw_set(broker["username"], Path(broker["password_file"]).read_text().strip())
    client.connect(host, port)
    client.loop_start()
    try:
        client.publish(f"edgepfl/v1/{federation}/view", payload, qos=1, retain=True).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("chromium and chromium-driver (apt) are needed: scripts/setup.sh --tests installs them as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    # its profile in the test's folder: Chromium would leave org.chromium.Chromium.* folders in /tmp
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def start_dashboard(*args: str, log: Path) -> tuple[subprocess.Popen, str]:
    """An ``edgepfl dashboard`` process on a free port; (process, its URL)."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "edgepfl", "dashboard", "--listen", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=out, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "edgepfl dashboard of <fed>: http://127.0.0.1:<port>/ (Ctrl-C to stop)"
    assert "http://" in line, (line, log.read_text())
    return proc, line.split("http://", 1)[1].split(" ", 1)[0].join(("http://", ""))


def rendered(driver, updated: float) -> bool:
    """Whether the page has drawn the view published at ``updated``."""
    shown = driver.execute_script("return document.body.dataset.updated")
    return shown is not None and abs(float(shown) - updated) < 1e-6


def served(url: str) -> bool:
    """Whether the dashboard at ``url`` has a view to serve."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "view.json", timeout=5) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def text(driver, testid: str) -> str:
    return driver.find_element("css selector", f'[data-testid="{testid}"]').text


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("EDGEPFL_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_dashboard_shows_a_ten_thousand_agent_fleet_live_in_chromium(mosquitto, browser, tmp_path):
    federation, started = "big", time.time() - 600
    first = fleet_view(federation, 10_000, round=7, accuracy=0.7531, started=started)
    payload = encode_view(first, 1_000_000)  # what the coordinator sends at the default max_message_bytes
    shown = FleetView.model_validate_json(payload)
    assert shown.agents_left_out > 0  # the view of a fleet this size lists only part of it
    publish_view(mosquitto.url, federation, payload)
    proc, url = start_dashboard("--broker", mosquitto.url, "--federation", federation, log=tmp_path / "dash.log")
    try:
        wait_until(lambda: served(url), 60, what="the dashboard holding the retained view")
        loaded = time.monotonic()
        browser.get(url)
        wait_until(lambda: rendered(browser, shown.updated), 60, interval=0.05, what="the page drawing the view")
        seconds_to_render = time.monotonic() - loaded
        assert text(browser, "agents-total") == "10000"
        assert text(browser, "agents-online").startswith(str(sum(shown.online.values())))
        assert text(browser, "accuracy") == "75.31 %"
        releases = text(browser, "releases")
        for release, count in shown.releases.items():  # every head agent online, the left-out ones too
            assert f"{release}{' (current)' if release == RELEASES[1] else ''} {count}" in releases, releases
        # the table fits its panel, long release ids included: nothing cut off or hidden behind a scroll bar
        widths = browser.execute_script("const t = document.querySelector('[data-testid=\"releases\"]');"
                                        "return [t.scrollWidth, t.parentElement.clientWidth]")
        assert widths[0] <= widths[1], f"the releases table is {widths[0]} px wide in a {widths[1]} px panel"
        assert len(browser.find_elements("css selector", '[data-testid="agents"] tr')) == 201  # a page of 200
        assert f"rollout of {RELEASES[1]}: stage 2 of 3 (25 %), 1000 of 1125 reported" in text(browser, "rollout")
        assert ("stage 2 measured: held-out accuracy +0.4 points on average over 980 devices, worst -3.1; "
                "encoder time 1.04x the release before") in text(browser, "rollout")
        render_ms = float(browser.execute_script("return document.body.dataset.renderMs"))

        # the coordinator publishes the next view: the page follows it, the curve gains a point
        second = fleet_view(federation, 10_000, round=8, accuracy=0.7712, started=started)
        publish_view(mosquitto.url, federation, encode_view(second, 1_000_000))
        wait_until(lambda: rendered(browser, second.updated), 30, interval=0.1, what="the page following the view")
        assert text(browser, "accuracy") == "77.12 %" and text(browser, "round") == "8 of 0..49"
        points = browser.execute_script("return document.querySelector('#curve polyline').getAttribute('points')")
        assert len(points.split()) == 2
        # a held release (passed its stages so far, waiting for the operator) is not drawn as a halt
        held = second.model_copy(update={"updated": time.time(), "rollout": second.rollout.model_copy(
            update={"state": "held"})})
        publish_view(mosquitto.url, federation, encode_view(held, 1_000_000))
        wait_until(lambda: rendered(browser, held.updated), 30, interval=0.1, what="the page drawing the held view")
        rollout = text(browser, "rollout")
        assert "held" in rollout and "halted" not in rollout and "rolled back" not in rollout, rollout
        assert not browser.find_elements("css selector", '[data-testid="rollout"] .warn')
        # a view its coordinator stopped republishing (two heartbeats and more ago): the agents
        # it called online are shown as they were, not green and "online" (70 s after every agent
        # stopped, 7 were still shown online)
        silent = held.model_copy(update={"updated": time.time() - 61, "heartbeat_s": 30.0})
        publish_view(mosquitto.url, federation, encode_view(silent, 1_000_000))
        wait_until(lambda: rendered(browser, silent.updated), 30, interval=0.1, what="the page drawing the old view")
        assert text(browser, "agents-online").startswith("was ") and "stale" in browser.find_element("id", "updated").text
        assert not browser.find_elements("css selector", '[data-testid="agents"] .on')
        # a finished run's view: the same, at once
        done = held.model_copy(update={"updated": time.time(), "phase": "done"})
        publish_view(mosquitto.url, federation, encode_view(done, 1_000_000))
        wait_until(lambda: rendered(browser, done.updated), 30, interval=0.1, what="the page drawing the done view")
        assert text(browser, "agents-online").startswith("was ") and "was online" in text(browser, "agents")
        folder = artifacts(tmp_path)
        browser.save_screenshot(str(folder / "dashboard-10000-agents.png"))
        (folder / "dashboard-10000-agents.txt").write_text(
            f"view of 10,000 agents ({len(shown.agents)} listed, {shown.agents_left_out} counted only): drawn in "
            f"{render_ms:.1f} ms; page load to drawn {seconds_to_render:.2f} s (headless Chromium)\n")
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_dashboard_reads_a_provisioned_tls_federation_with_the_operator_bundle(browser, tmp_path):
    from edgepfl.testing import MosquittoBroker

    from tests.integration.security.test_provisioned_federation import bundle_broker
    from tests.unit.core.test_provision import provision

    require_mosquitto()
    out = provision(tmp_path / "p", agents="pi-01", auth="cert")
    view = fleet_view("demo", 40, round=3, accuracy=0.6612, started=time.time())
    with MosquittoBroker(conf=out / "broker" / "mosquitto.conf") as broker:
        publish_view(broker.url, "demo", encode_view(view, 1_000_000),
                     bundle_broker(out / "coordinator", "coordinator.yaml"))
        operator_yaml = out / "operator" / "operator.yaml"
        bundle = yaml.safe_load(operator_yaml.read_text())
        bundle["broker"]["url"] = broker.url  # only the port moves to the test's
        operator_yaml.write_text(yaml.safe_dump(bundle))
        assert broker.url.startswith("mqtts://")
        proc, url = start_dashboard("--config", str(operator_yaml), log=tmp_path / "dash.log")
        try:
            browser.get(url)
            wait_until(lambda: rendered(browser, view.updated), 60, interval=0.1, what="the page drawing the view")
            assert text(browser, "agents-total") == "40" and text(browser, "accuracy") == "66.12 %"
            assert "demo" in browser.find_element("id", "federation").text
        finally:
            proc.terminate()
            proc.wait(10)


def _get(url: str, path: str, host: str | None, **headers: str) -> tuple[int, dict[str, str], bytes]:
    """One real HTTP GET to the dashboard at ``url`` with this ``Host`` header (None: none at all)."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        connection.putrequest("GET", path, skip_host=True)
        if host is not None:
            connection.putheader("Host", host)
        for name, value in headers.items():
            connection.putheader(name.replace("_", "-"), value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_the_dashboard_refuses_a_foreign_host_and_with_a_token_file_a_request_without_it(mosquitto, tmp_path):
    """DNS rebinding: a web page re-points its own name at the dashboard's address and reads the
    view as same-origin; its requests carry its name in Host, and are refused (421)."""
    federation = "rebind"
    publish_view(mosquitto.url, federation, encode_view(fleet_view(federation, 4, 3, 0.5, time.time()), 1_000_000))
    proc, url = start_dashboard("--broker", mosquitto.url, "--federation", federation, log=tmp_path / "open.log")
    try:
        wait_until(lambda: served(url), 60, what="the dashboard holding the retained view")
        port = url.rstrip("/").rsplit(":", 1)[1]
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"127.0.0.1:{int(port) + 1}",
                     None):
            status, _, body = _get(url, "/view.json", host)
            assert status == 421 and b"pi-0" not in body, (host, status, body)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
            status, _, body = _get(url, "/view.json", host)
            assert status == 200 and b"pi-00000" in body, (host, status)
    finally:
        proc.terminate()
        proc.wait(10)
    assert "refused Host 'evil.example:" in (tmp_path / "open.log").read_text()

    token = "s3cret-token-of-the-operator"
    (tmp_path / "token").write_text(token + "\n")
    proc, url = start_dashboard("--broker", mosquitto.url, "--federation", federation, "--token-file",
                                str(tmp_path / "token"), "--allow-host", "dash.example", log=tmp_path / "token.log")
    try:
        port = url.rstrip("/").rsplit(":", 1)[1]
        local = f"127.0.0.1:{port}"
        bearer = {"Authorization": f"Bearer {token}"}
        wait_until(lambda: _get(url, "/view.json", local, **bearer)[0] == 200, 60, what="the view served")
        assert _get(url, "/view.json", local)[0] == 401
        assert _get(url, "/view.json", local, Authorization="Bearer wrong-token-of-someone")[0] == 401
        assert _get(url, "/view.json", f"evil.example:{port}", **bearer)[0] == 421
        assert _get(url, "/view.json", "dash.example", **bearer)[0] == 200  # a reverse proxy's name, any port
        status, headers, _ = _get(url, f"/?token={token}", local)  # the address an operator opens
        assert status == 200 and "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";", 1)[0]
        status, _, body = _get(url, "/view.json", local, Cookie=cookie)  # the page's own request
        assert status == 200 and b"pi-00000" in body
    finally:
        proc.terminate()
        proc.wait(10)
