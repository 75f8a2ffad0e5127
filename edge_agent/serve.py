"""Serve the device's model: ``edgepfl serve``, a long-running predictor over the release a
head agent installed, which picks up the agent's next release and head without a restart.

::

    edgepfl serve --state /var/lib/edgepfl/state                     # JSON lines on stdin/stdout
    edgepfl serve --state /var/lib/edgepfl/state --watch ~/inbox     # images dropped in a folder

**Requests on stdin**, one per line, answered in order on stdout, one JSON line each:

- a path (an image file, a directory of images or a ``.npy`` array of raw pixels), or
- a JSON object ``{"inputs": [path, ...], "id": …}`` (or ``"input": path``); ``id`` is
  any JSON value, echoed back. The inputs of one request are run as one batch.

Each answer is ``{"id", "release_id", "head", "ms", "results": [{"input", "predictions":
[{"class", "index", "probability"}, …]}]}`` (``ms``: this request's wall time, images read
to probabilities), or ``{"id", "error"}`` for a request that cannot be answered (a missing
file, no release installed yet): the server logs it and goes on. End of input ends it (0).

**A series or vector release** (the manifest's ``run.data.input_kind``) takes ``.npy`` and
``.npz`` (array ``x``) files of raw samples, (N, C, T) or (N, D), and, for a series, CSV
sensor logs cut into windows of the release's length (``--label``, ``--channels``,
``--segment``, ``--stride``, as ``edgepfl predict``); each window is one result. The
manifest's normalization is applied with numpy alone; a file of another shape is an
``error`` answer (one line) and, in a watch folder, moved to ``failed/``.

**A watch folder**: every image file (series and vector releases: ``.npy``, ``.npz``,
``.csv`` file) that appears in the folder (not a hidden one: write ``.name.jpg`` and
rename it when complete) is answered with one JSON line on stdout (``id``:
its name) and moved into ``done/`` beside it, or ``failed/`` when it cannot be read. Files
that arrive while no release is installed wait for one. SIGTERM or SIGINT ends it (0).
A symbolic link is not followed: it is not an input, and stays unread. No file stops the
server twice (:func:`serve_folder`): one whose header says it cannot be read goes to
``failed/`` before it is decoded, and the others wait in ``processing/`` while they are answered.

**Image size**: an image whose header declares more than ``--max-pixels`` (default
:data:`~edgepfl.export.predict.MAX_IMAGE_PIXELS`, 25 million) is an ``error`` answer, and
is never decoded.

**Releases**: before each request the server looks at the state directory's
``release.json`` (one ``stat``). When the agent has installed another release or head it
opens the new files — named by content and checked against the record's sha256 — and
answers with them from then on; a release it cannot open keeps the one in use (logged).

**Permissions**: the agent's unit writes its state directory group-readable (``UMask=0027``,
``StateDirectoryMode=0750``, group ``edgepfl``): a user in that group serves and predicts
with the device's model as themselves (``sudo usermod -aG edgepfl $USER``,
examples/README.md). Torch-free and scikit-learn-free: numpy, onnxruntime and Pillow.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from edgepfl.data.preprocess import IMAGE_SUFFIXES
from edgepfl.errors import InputError, OneLineParser, report
from edgepfl.export.predict import (
    MAX_IMAGE_PIXELS,
    SAMPLE_SUFFIXES,
    add_csv_arguments,
    add_max_pixels_argument,
    check_input,
    collect_inputs,
    csv_spec,
    head_class_names,
    top_predictions,
)

from .head_tier import STATE_FILE, InstalledModel, open_installed

log = logging.getLogger("edgepfl.agent.serve")

#: where a watch folder's answered and unreadable images are moved, and where the ones being answered wait
DONE, FAILED, WORKING = "done", "failed", "processing"


@dataclass(frozen=True)
class Answer:
    """One request's answer: its results, or why it has none."""

    id: Any
    results: list[dict] | None = None
    error: str | None = None
    release_id: str | None = None
    head: str | None = None
    ms: float | None = None

    def json(self) -> str:
        if self.error is not None:
            return json.dumps({"id": self.id, "error": self.error})
        return json.dumps({"id": self.id, "release_id": self.release_id, "head": self.head,
                           "ms": round(self.ms or 0.0, 3), "results": self.results})


class ModelServer:
    """The installed release of a head agent's state directory, kept open and followed.

    ``answer(inputs)`` runs one batch with the release installed at that moment: before each
    request, a changed ``release.json`` (another release or head) is opened and used from
    then on; one that cannot be opened leaves the current model in use.
    """

    def __init__(self, state_dir: str | Path, *, top: int = 1, threads: int | None = None,
                 csv: Mapping[str, Any] | None = None, max_pixels: int = MAX_IMAGE_PIXELS):
        self.state_dir = Path(state_dir)
        #: an image declaring more pixels than this is refused before it is decoded
        self.max_pixels = max_pixels
        #: how a series release reads a CSV sensor log: :func:`~edgepfl.export.predict.csv_spec`'s
        #: options (the window length is each release's own)
        self.csv = dict(csv or {})
        self.top = top
        self.threads = threads
        self.model: InstalledModel | None = None
        self._labels: list[str] = []
        self._seen: tuple[int, int, int] | None = None  # release.json's (inode, mtime_ns, size) last opened
        self._failed: tuple[int, int, int] | None = None  # ... last refused (logged once)

    def refresh(self) -> InstalledModel | None:
        """Open the installed release if it changed since the last look; the model in use."""
        try:
            st = os.stat(self.state_dir / STATE_FILE)
        except FileNotFoundError:
            return self.model
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key in (self._seen, self._failed):
            return self.model
        try:
            model = open_installed(self.state_dir, threads=self.threads)
            labels = head_class_names(model.head, model.encoder, federation_labels=True)
        except PermissionError:
            raise
        except (OSError, ValueError) as exc:  # a newer install removed its files, a torn record
            self._failed = key
            log.warning("cannot open the release installed in %s (%s); %s", self.state_dir, exc,
                        "keeping " + self.model.record.release_id if self.model else "no model yet")
            return self.model
        previous = self.model.record.release_id if self.model else None
        self.model, self._labels, self._seen = model, labels, key
        record = model.record
        if previous is None:
            log.info("serving release %s with its %s head", record.release_id, record.metrics.head)
        else:
            log.info("switched from release %s to %s (%s head)", previous, record.release_id, record.metrics.head)
        return model

    def answer(self, inputs: list[str], request_id: Any = None) -> Answer:
        """Predictions for ``inputs`` as one batch: image files, directories, ``.npy`` raw pixels;
        for a series or vector release ``.npy``, ``.npz`` and (series) ``.csv`` files of raw samples."""
        started = time.perf_counter()
        model = self.refresh()
        if model is None:
            return Answer(request_id, error=f"no release installed in {self.state_dir} yet")
        try:
            spec = csv_spec(model.encoder, **self.csv) if model.encoder.input_kind == "series" else None
            names, x = collect_inputs(inputs, model.encoder, csv=spec, max_pixels=self.max_pixels)
            proba = model.head.predict_proba(model.encoder.features(x))
        except (ValueError, OSError, KeyError) as exc:
            return Answer(request_id, error=str(exc))
        results = [{"input": name, "predictions": top_predictions(row, model.head.classes_, self._labels, self.top)}
                   for name, row in zip(names, proba)]
        return Answer(request_id, results, release_id=model.record.release_id, head=model.record.metrics.head,
                      ms=1000 * (time.perf_counter() - started))


def parse_request(line: str) -> tuple[Any, list[str]]:
    """(id, inputs) of one stdin line: a path, or a JSON object with ``inputs`` or ``input``."""
    text = line.strip()
    if not text.startswith("{"):
        return None, [text]
    try:
        request = json.loads(text)
    except ValueError as exc:
        raise InputError(f"not a JSON object: {exc}") from None
    inputs = request.get("inputs", [request["input"]] if "input" in request else None)
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise InputError('a request needs "inputs": a non-empty list of paths (or "input": one path)')
    return request.get("id"), inputs


def serve_lines(server: ModelServer, lines: Iterable[str], out: TextIO) -> int:
    """Answer each request line on ``out``; returns how many were answered with an error."""
    errors = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            request_id, inputs = parse_request(line)
        except InputError as exc:
            answer = Answer(None, error=str(exc))
        else:
            answer = server.answer(inputs, request_id)
        if answer.error is not None:
            errors += 1
            log.warning("request %s not answered: %s", answer.id if answer.id is not None else line.strip()[:80],
                        answer.error)
        out.write(answer.json() + "\n")
        out.flush()
    return errors


def waiting_images(folder: Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[Path]:
    """The inputs waiting in a watch folder (files ending in one of ``suffixes``: images, or a
    series or vector release's :data:`~edgepfl.export.predict.SAMPLE_SUFFIXES`), oldest name
    first. Hidden files are being written; a symbolic link is never followed (it would let
    whoever writes the folder make the server read any file it may read, or a FIFO that never
    ends), so it is not an input: it stays where it is, unread."""
    with os.scandir(folder) as entries:
        return sorted(Path(e.path) for e in entries
                      if not e.name.startswith(".") and e.name.lower().endswith(suffixes)
                      and e.is_file(follow_symlinks=False))


def serve_folder(server: ModelServer, folder: Path, out: TextIO, stop: threading.Event, *,
                 poll_s: float = 0.5, batch: int = 32) -> Iterator[Answer]:
    """Answer the images that appear in ``folder`` until ``stop`` is set, each moved into
    ``done/`` once answered or ``failed/`` when it cannot be read; yields each answer.

    No file can stop the server twice. A file whose header already says it cannot be an input
    (:func:`~edgepfl.export.predict.check_input`: an image declaring more than the server's
    ``max_pixels``, an array declaring more data than it holds, no image at all) goes to
    ``failed/`` before anything else is done with it. The others are moved into ``processing/``
    while they are answered; what a server killed meanwhile left there is, at the next start,
    moved to ``failed/`` before each is answered again alone, and back to ``done/`` if it is.
    """
    for sub in (DONE, FAILED, WORKING):
        (folder / sub).mkdir(exist_ok=True)
    unmovable: set[str] = set()  # answered, but could not be moved: not answered again
    links: set[str] = set()  # symbolic links seen (logged once each)
    while not stop.is_set():
        model = server.refresh()
        if model is not None:
            yield from _answer_leftovers(server, folder, out)
        suffixes = IMAGE_SUFFIXES if model is None or model.encoder.input_kind == "image" else SAMPLE_SUFFIXES
        _note_links(folder, suffixes, links)
        images = [p for p in waiting_images(folder, suffixes) if p.name not in unmovable]
        if not images or model is None:
            stop.wait(poll_s)
            continue
        for start in range(0, len(images), batch):
            claimed: list[Path] = []
            for image in images[start : start + batch]:
                try:
                    check_input(image, server.max_pixels)
                except ValueError as exc:  # moved away before it is answered: it never stops a server
                    _move(image, folder / FAILED, unmovable)
                    yield _emit(out, _named(Answer(None, error=str(exc)), image.name))
                    continue
                if _move(image, folder / WORKING, unmovable):
                    claimed.append(folder / WORKING / image.name)
            for answer, image in _answer_images(server, claimed):
                _move(image, folder / (DONE if answer.error is None else FAILED), unmovable)
                yield _emit(out, answer)


def _answer_leftovers(server: ModelServer, folder: Path, out: TextIO) -> Iterator[Answer]:
    """The files a server killed while answering them left in ``processing/``: each moved to
    ``failed/`` first (it may be what killed it), then answered alone, and moved to ``done/`` if it was."""
    working = folder / WORKING
    for path in sorted(p for p in working.iterdir() if p.is_file() or p.is_symlink()):
        failed = folder / FAILED / path.name
        try:
            path.replace(failed)
        except OSError as exc:
            log.warning("%s could not be moved out of %s: %s", path.name, working, exc)
            continue
        log.warning("%s was being answered when the server stopped; answering it again alone (in %s/ meanwhile)",
                    path.name, FAILED)
        if failed.is_symlink():
            answer = _named(Answer(None, error=f"{failed}: a symbolic link, not read"), path.name)
        else:
            answer = _named(server.answer([str(failed)]), path.name)
        if answer.error is None:
            _move(failed, folder / DONE, set())
        yield _emit(out, answer)


def _note_links(folder: Path, suffixes: tuple[str, ...], seen: set[str]) -> None:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() and entry.name.lower().endswith(suffixes) and entry.name not in seen:
                seen.add(entry.name)
                log.warning("%s is a symbolic link: not followed, not answered (copy or move the file itself in)",
                            entry.name)


def _move(path: Path, into: Path, unmovable: set[str]) -> bool:
    """Move ``path`` into the folder ``into``; False (logged, remembered in ``unmovable``) when it cannot be."""
    try:
        path.replace(into / path.name)
        return True
    except OSError as exc:  # taken away meanwhile, or a folder we may not write
        unmovable.add(path.name)
        log.warning("%s could not be moved into %s: %s", path.name, into, exc)
        return False


def _emit(out: TextIO, answer: Answer) -> Answer:
    out.write(answer.json() + "\n")
    out.flush()
    return answer


def _answer_images(server: ModelServer, images: list[Path]) -> list[tuple[Answer, Path]]:
    """One batch; when it fails (an unreadable image among them), each image alone, so that
    one bad file fails only itself."""
    if not images:
        return []
    together = server.answer([str(p) for p in images], request_id=None)
    if together.error is None and together.results is not None:
        return [(Answer(p.name, [r], release_id=together.release_id, head=together.head,
                        ms=(together.ms or 0.0) / len(images)), p) for p, r in zip(images, together.results)]
    return [(_named(server.answer([str(p)]), p.name), p) for p in images]


def _named(answer: Answer, name: str) -> Answer:
    if answer.error is not None:
        log.warning("%s not answered: %s", name, answer.error)
    return Answer(name, answer.results, answer.error, answer.release_id, answer.head, answer.ms)


def main_serve(args: list[str]) -> int:
    """``edgepfl serve``: answer images with the model a head agent installed, following its releases."""
    parser = OneLineParser(prog="edgepfl serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help="the head agent's state directory (its state_dir)")
    parser.add_argument("--watch", default=None, metavar="FOLDER",
                        help="answer images dropped in FOLDER (moved to FOLDER/done) instead of stdin's requests")
    parser.add_argument("--top", type=int, default=1, help="classes to show per input")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the watch folder")
    add_max_pixels_argument(parser)
    add_csv_arguments(parser)
    ns = parser.parse_args(args)
    state = Path(ns.state)
    try:
        if not state.is_dir():
            raise InputError(f"{state}: no such directory (the head agent's state_dir)")
        if ns.stride is not None and ns.stride < 1:
            raise InputError(f"--stride must be at least 1, got {ns.stride}")
        channels = [c.strip() for c in ns.channels.split(",")] if ns.channels else None
        server = ModelServer(state, top=ns.top, threads=ns.threads, max_pixels=ns.max_pixels,
                             csv={"label": ns.label, "channels": channels, "segment": ns.segment, "stride": ns.stride})
        server.refresh()
        if ns.watch is None:
            serve_lines(server, sys.stdin, sys.stdout)
            return 0
        folder = Path(ns.watch)
        if not folder.is_dir():
            raise InputError(f"{folder}: no such directory to watch")
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        for _ in serve_folder(server, folder, sys.stdout, stop, poll_s=ns.poll):
            pass
        return 0
    except PermissionError as exc:
        return report(InputError(f"{exc.filename or state}: permission denied: a user serving the agent's model "
                                 "must be in the group that owns its state directory "
                                 "(sudo usermod -aG edgepfl $USER, then log in again)"), "serve")
    except (ValueError, OSError) as exc:
        return report(InputError(str(exc)), "serve")


__all__ = ["Answer", "ModelServer", "main_serve", "parse_request", "serve_folder", "serve_lines"]
