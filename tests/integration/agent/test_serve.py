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


def _blank_png(path: Path, side: int) -> Path:
    """A real, valid grayscale PNG of ``side`` x ``side`` black pixels, written in milliseconds and
    a few hundred kB whatever its size: every block of rows compresses to the same deflate bytes
    after a full flush, and the zlib checksum of zeros has a closed form."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = next(r for r in (500, 400, 250, 200, 100, 50, 10, 1) if side % r == 0)
    block = bytes((side + 1) * rows)  # each row: filter byte 0, then its pixels
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    adler = (((side + 1) * side % 65521) << 16) | 1  # a = 1 + sum of bytes (0), b = length x a
    idat = b"\x78\xda" + body * (side // rows) + final + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


def _peak_rss_kb(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_the_blank_png_is_valid_and_declares_its_size(tmp_path):
    from PIL import Image

    with Image.open(_blank_png(tmp_path / "small.png", 300)) as im:
        im.load()
        assert im.size == (300, 300) and im.getextrema() == (0, 0)


def test_an_image_declaring_20000_squared_pixels_is_one_error_answer_and_costs_the_server_no_memory(releases, tmp_path):
    """The 382 kB PNG of 20,000 x 20,000 pixels once ended the server ("internal error"); one just under
    Pillow's own limit took it from 84 to 779 MB. Both are refused from their header, never decoded."""
    first, _ = releases
    state = tmp_path / "state"
    _install(state, first)
    huge = _blank_png(tmp_path / "huge.png", 20_000)
    assert huge.stat().st_size < 500_000
    under_pillows = _blank_png(tmp_path / "under.png", 9_000)  # 81 million: under Pillow's 89 million
    paths, _ = _images(tmp_path / "photos", 2)
    server = _serve("--state", str(state))
    try:
        warm = _ask(server, {"id": "warm", "inputs": [str(p) for p in paths]})  # the model loaded, a batch run
        assert warm["release_id"]
        before = _peak_rss_kb(server.pid)
        refused = _ask(server, {"id": "huge", "inputs": [str(huge)]})
        assert refused["id"] == "huge" and "declares 400,000,000 pixels" in refused["error"], refused
        assert "--max-pixels" in refused["error"]
        refused = _ask(server, {"id": "under", "inputs": [str(under_pillows)]})
        assert "9000x9000 = 81,000,000 pixels" in refused["error"], refused
        assert _peak_rss_kb(server.pid) - before < 20_000  # nothing was decoded: no spike
        assert server.poll() is None
        assert len(_ask(server, {"id": "after", "inputs": [str(paths[0])]})["results"]) == 1
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)
    assert server.returncode == 0

    # predict: one line and the input exit code (3), not "internal error"
    from edgepfl.edge_agent.head_tier import read_installed

    record = read_installed(state)
    proc = subprocess.run([sys.executable, "-m", "edgepfl.cli", "predict", "--encoder", str(first / "encoder.onnx"),
                           "--head", str(state / record.head_file), str(huge)], capture_output=True, text=True,
                          cwd=REPO_ROOT_HINT, timeout=120)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgepfl: ") and "400,000,000 pixels" in lines[0], proc.stderr
    # the limit is the operator's to raise: beyond it the image is read (here, into its refusal by Pillow's own)
    proc = subprocess.run([sys.executable, "-m", "edgepfl.cli", "predict", "--encoder", str(first / "encoder.onnx"),
                           "--head", str(state / record.head_file), "--max-pixels", "90000", str(paths[0]),
                           str(_blank_png(tmp_path / "mid.png", 400))], capture_output=True, text=True,
                          cwd=REPO_ROOT_HINT, timeout=120)
    assert proc.returncode == 3 and "400x400 = 160,000 pixels, more than the 90,000" in proc.stderr, proc.stderr


def test_a_watch_folder_moves_a_huge_image_to_failed_first_ignores_links_and_survives_restarts(releases, tmp_path):
    """The crash loop: the huge PNG in the watch folder ended the server at every start. Now it is
    moved to failed/ before anything else, a file a killed server left in processing/ is answered
    again alone (through failed/), a symbolic link is never followed, and every start keeps running."""
    first, _ = releases
    state, inbox = tmp_path / "state", tmp_path / "inbox"
    _install(state, first)
    inbox.mkdir()
    paths, _ = _images(tmp_path / "photos", 4)
    _blank_png(inbox / "huge.png", 20_000)
    (inbox / "processing").mkdir()
    shutil.copy(paths[0], inbox / "processing" / "left.png")  # as a server killed while answering it left it
    secret = tmp_path / "private" / "secret.png"  # a file the writer of the folder should not get read
    secret.parent.mkdir()
    shutil.copy(paths[1], secret)
    (inbox / "link.png").symlink_to(secret)
    shutil.copy(paths[2], inbox / "good.png")

    def run_until(*names: str) -> tuple[subprocess.Popen, dict[str, dict]]:
        server = _serve("--state", str(state), "--watch", str(inbox), "--poll", "0.1")
        assert server.stdout is not None
        answers: dict[str, dict] = {}
        while set(names) - set(answers):
            line = server.stdout.readline()
            assert line, f"the server ended: {server.stderr.read() if server.stderr else ''}"
            answers[json.loads(line)["id"]] = json.loads(line)
        return server, answers

    server, answers = run_until("left.png", "huge.png", "good.png")
    try:
        assert "400,000,000 pixels" in answers["huge.png"]["error"]
        assert answers["left.png"]["results"] and answers["good.png"]["results"]
        shutil.copy(paths[3], inbox / "later.png")  # after a full look at the folder, link.png included
        assert server.stdout is not None
        later = json.loads(server.stdout.readline())
        assert later["id"] == "later.png" and later["results"], later
        assert server.poll() is None
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert "link.png" not in answers and (inbox / "link.png").is_symlink()  # not answered, not moved
    assert "link.png is a symbolic link" in err
    assert sorted(f.name for f in (inbox / "failed").iterdir()) == ["huge.png"]
    assert sorted(f.name for f in (inbox / "done").iterdir()) == ["good.png", "later.png", "left.png"]
    assert not any((inbox / "processing").iterdir())

    # restarted with the huge image back in the folder, and again after: it answers and keeps running
    for attempt in range(2):
        (inbox / "failed" / "huge.png").replace(inbox / f"huge{attempt}.png")
        shutil.copy(paths[0], inbox / f"again{attempt}.png")
        server, answers = run_until(f"huge{attempt}.png", f"again{attempt}.png")
        try:
            assert "error" in answers[f"huge{attempt}.png"] and answers[f"again{attempt}.png"]["results"]
            assert server.poll() is None
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)
        assert server.returncode == 0
        (inbox / "failed" / f"huge{attempt}.png").replace(inbox / "failed" / "huge.png")
