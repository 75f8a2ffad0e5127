"""``edgepfl serve``: a real server process over a head agent's state directory answers a
stream of images with the right class names, and switches to the agent's next release
without a restart. The releases are real exports installed by the head
tier's own install path; the predictions checked against the same model run in-process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.export_fixtures import NEW_CLIENT, REPO_ROOT_HINT, client_data, client_pixels, export_dir
from tests.fleet_helpers import wait_until


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Two releases of one federation: after one round, and after three."""
    first = export_dir(tmp_path_factory.mktemp("release-a"), "fedavg", rounds=1)
    second = export_dir(tmp_path_factory.mktemp("release-b"), "fedavg", rounds=3)
    return first, second


def _install(state: Path, export: Path) -> str:
    """Install ``export`` as the head agent does (an LR head fitted on the device's data);
    returns the release id."""
    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.export.onnx_export import read_release

    manifest, artifact = read_release(export)
    runtime = HeadRuntime(state, "lr", client_data(NEW_CLIENT))
    if (state / "release.json").exists():
        runtime.load()
    previous = os.umask(0o027)  # the agent unit's UMask: the state is group-readable, no more
    try:
        runtime.install_release(manifest, artifact, manifest.encoder.sha256)
    finally:
        os.umask(previous)
    return manifest.release_id


def _images(folder: Path, count: int) -> tuple[list[Path], np.ndarray]:
    """``count`` PNGs of the new client's digits; (paths, their raw pixels as the server reads them)."""
    from PIL import Image

    pixels, _, _ = client_pixels(NEW_CLIENT)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, px in enumerate(pixels[:count]):
        Image.fromarray(np.round(px[0] * 255).astype(np.uint8), mode="L").save(folder / f"img{i:03d}.png")
        paths.append(folder / f"img{i:03d}.png")
    return paths, pixels[:count]


def _expected(state: Path, paths: list[Path]) -> list[str]:
    """The class names the installed model gives these images, run in-process."""
    from edgepfl.edge_agent.head_tier import open_installed
    from edgepfl.export.predict import collect_inputs, head_class_names

    model = open_installed(state)
    names = head_class_names(model.head, model.encoder)
    _, x = collect_inputs([str(p) for p in paths], model.encoder)
    proba = model.head.predict_proba(model.encoder.features(x))
    return [names[i] for i in proba.argmax(axis=1)]


def _serve(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "edgepfl.cli", "serve", *args], cwd=REPO_ROOT_HINT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ask(server: subprocess.Popen, request: dict | str) -> dict:
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write((request if isinstance(request, str) else json.dumps(request)) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    assert line, f"the server ended: {server.stderr.read() if server.stderr else ''}"
    return json.loads(line)


def test_serve_answers_a_stream_and_switches_release_without_a_restart(releases, tmp_path):
    first, second = releases
    state = tmp_path / "state"
    first_id = _install(state, first)
    paths, _ = _images(tmp_path / "photos", 40)
    server = _serve("--state", str(state), "--top", "2")
    try:
        answer = _ask(server, {"id": "batch-1", "inputs": [str(p) for p in paths]})
        assert answer["id"] == "batch-1" and answer["release_id"] == first_id and answer["head"] == "lr"
        assert [r["input"] for r in answer["results"]] == [str(p) for p in paths]
        assert [r["predictions"][0]["class"] for r in answer["results"]] == _expected(state, paths)
        assert all(len(r["predictions"]) == 2 and r["predictions"][0]["probability"] >= r["predictions"][1][
            "probability"] for r in answer["results"])
        assert answer["ms"] > 0

        # bad requests are answered with an error, and the stream goes on
        assert "no such file" in _ask(server, {"id": 7, "inputs": [str(tmp_path / "missing.png")]})["error"]
        assert "not a JSON object" in _ask(server, "{nope")["error"]
        one = _ask(server, str(paths[0]))  # a bare path is a request too
        assert one["id"] is None and len(one["results"]) == 1

        second_id = _install(state, second)  # the agent installs its next release meanwhile
        assert second_id != first_id
        answer = _ask(server, {"id": "batch-2", "inputs": [str(p) for p in paths]})
        assert answer["release_id"] == second_id  # the same process: no restart
        assert [r["predictions"][0]["class"] for r in answer["results"]] == _expected(state, paths)
        assert server.poll() is None
    finally:
        assert server.stdin is not None
        server.stdin.close()  # end of input: the server ends
        server.wait(timeout=60)
    assert server.returncode == 0
    assert "switched from release" in (server.stderr.read() if server.stderr else "")


def test_a_watch_folder_waits_for_a_release_then_answers_each_image_and_moves_it(releases, tmp_path):
    first, _ = releases
    state, inbox = tmp_path / "state", tmp_path / "inbox"
    state.mkdir()
    inbox.mkdir()
    server = _serve("--state", str(state), "--watch", str(inbox), "--poll", "0.1")
    try:
        paths, _ = _images(tmp_path / "photos", 3)
        for p in paths:  # as a camera would: written hidden, renamed when complete
            shutil.copy(p, inbox / f".{p.name}")
            (inbox / f".{p.name}").rename(inbox / p.name)
        (inbox / "broken.png").write_bytes(b"not a png")
        # no release installed yet: the images wait, none is lost
        assert sorted(f.name for f in inbox.iterdir() if f.is_file()) == ["broken.png", *[p.name for p in paths]]
        release_id = _install(state, first)
        assert server.stdout is not None
        answers = [json.loads(server.stdout.readline()) for _ in range(4)]
        by_id = {a["id"]: a for a in answers}
        expected = _expected(state, paths)
        for p, name in zip(paths, expected):
            assert by_id[p.name]["release_id"] == release_id
            assert by_id[p.name]["results"][0]["predictions"][0]["class"] == name
        assert "error" in by_id["broken.png"]
        wait_until(lambda: not any(f.is_file() for f in inbox.iterdir()), 30, what="the inbox emptied")
        assert sorted(f.name for f in (inbox / "done").iterdir()) == [p.name for p in paths]
        assert [f.name for f in (inbox / "failed").iterdir()] == ["broken.png"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_owners_own_user_serves_the_agents_model_through_the_state_group_only(releases):
    """The unit's UMask=0027 and StateDirectoryMode=0750 make the state group-readable: a user
    in its group serves the model; one outside it gets one line and exit 3, not a traceback."""
    first, _ = releases
    group = 47_011  # the agent's group, as `useradd --system edgepfl` would make it
    root = Path(tempfile.mkdtemp(prefix="edgepfl-serve-"))
    try:
        os.chmod(root, 0o755)
        state = root / "state"
        state.mkdir(mode=0o750)
        release_id = _install(state, first)
        paths, _ = _images(root / "photos", 2)
        for path in [state, *state.iterdir()]:
            os.chown(path, 0, group)
        assert all(f.stat().st_mode & 0o007 == 0 for f in state.iterdir())  # nothing for others
        owner = ("setpriv", "--reuid=65534", "--regid=65534")
        member = _serve("--state", str(state), prefix=(*owner, f"--groups={group}"))
        try:
            answer = _ask(member, {"inputs": [str(p) for p in paths]})
            assert answer["release_id"] == release_id and len(answer["results"]) == 2
        finally:
            assert member.stdin is not None
            member.stdin.close()
            member.wait(timeout=60)
        stranger = _serve("--state", str(state), prefix=(*owner, "--clear-groups"))
        _, err = stranger.communicate("", timeout=60)
        assert stranger.returncode == 3, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "permission denied" in lines[0] and "usermod -aG edgepfl" in lines[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
