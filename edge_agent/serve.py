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
    SAMPLE_SUFFIXES,
    add_csv_arguments,
    collect_inputs,
    csv_spec,
    head_class_names,
    top_predictions,
)

from .head_tier import STATE_FILE, InstalledModel, open_installed

log = logging.getLogger("edgepfl.agent.serve")

#: where a watch folder's answered and unreadable images are moved
DONE, FAILED = "done", "failed"


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
                 csv: Mapping[str, Any] | None = None):
        self.state_dir = Path(state_dir)
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
            names, x = collect_inputs(inputs, model.encoder, csv=spec)
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
    first (hidden files are being written)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in suffixes)


def serve_folder(server: ModelServer, folder: Path, out: TextIO, stop: threading.Event, *,
                 poll_s: float = 0.5, batch: int = 32) -> Iterator[Answer]:
    """Answer the images that appear in ``folder`` until ``stop`` is set, each moved into
    ``done/`` once answered or ``failed/`` when it cannot be read; yields each answer."""
    (folder / DONE).mkdir(exist_ok=True)
    (folder / FAILED).mkdir(exist_ok=True)
    unmovable: set[str] = set()  # answered, but could not be moved: not answered again
    while not stop.is_set():
        model = server.refresh()
        suffixes = IMAGE_SUFFIXES if model is None or model.encoder.input_kind == "image" else SAMPLE_SUFFIXES
        images = [p for p in waiting_images(folder, suffixes) if p.name not in unmovable]
        if not images or model is None:
            stop.wait(poll_s)
            continue
        for start in range(0, len(images), batch):
            for answer, image in _answer_images(server, images[start : start + batch]):
                try:
                    image.replace(folder / (DONE if answer.error is None else FAILED) / image.name)
                except OSError as exc:  # taken away meanwhile, or a folder we may not write
                    unmovable.add(image.name)
                    log.warning("%s could not be moved out of the watch folder: %s", image.name, exc)
                out.write(answer.json() + "\n")
                out.flush()
                yield answer


def _answer_images(server: ModelServer, images: list[Path]) -> list[tuple[Answer, Path]]:
    """One batch; when it fails (an unreadable image among them), each image alone, so that
    one bad file fails only itself."""
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
    add_csv_arguments(parser)
    ns = parser.parse_args(args)
    state = Path(ns.state)
    try:
        if not state.is_dir():
            raise InputError(f"{state}: no such directory (the head agent's state_dir)")
        if ns.stride is not None and ns.stride < 1:
            raise InputError(f"--stride must be at least 1, got {ns.stride}")
        channels = [c.strip() for c in ns.channels.split(",")] if ns.channels else None
        server = ModelServer(state, top=ns.top, threads=ns.threads,
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
