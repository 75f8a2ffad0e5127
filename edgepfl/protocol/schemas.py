"""JSON Schemas of everything an agent reads or writes, generated from the pydantic models.

``python -m edgepfl.protocol.schemas --out docs/schemas`` writes one file per schema:
the frame header (``header.json``), the meta of every message type
(``meta-<type>.json``), the run spec every task carries (``run-spec.json``) and the
release manifest (``release-manifest.json``). The models are the one source; the files
are for implementers in other languages, and a test regenerates them and fails on any
difference, so they cannot drift from the code.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .envelope import Header
from .manifest import ReleaseManifest
from .messages import META_TYPES
from .run import RunSpec

__all__ = ["schema_documents", "write_schemas"]

_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _document(model: type[BaseModel], title: str, description: str) -> dict[str, Any]:
    schema = _open_objects(model.model_json_schema(mode="validation"))
    return {"$schema": _DIALECT, **schema, "title": title,
            "description": description + " Keys this version does not define are ignored by receivers "
                                         "(docs/PROTOCOL.md §16); `x-since` marks a key a minor version added."}


def _open_objects(node: Any) -> Any:
    """The schema without ``additionalProperties: false``: a receiver ignores the keys a
    newer minor version adds (:mod:`.evolution`), so a schema for receivers must too."""
    if isinstance(node, dict):
        return {k: _open_objects(v) for k, v in node.items()
                if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_open_objects(v) for v in node]
    return node


def schema_documents() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema (draft 2020-12) of each wire model."""
    docs = {
        "header.json": _document(Header, "edgepfl frame header",
                                 "The JSON header of every edgepfl frame (docs/PROTOCOL.md §4); "
                                 "`meta` is validated by the meta schema of `type`."),
        "run-spec.json": _document(RunSpec, "edgepfl run spec",
                                   "What a federation runs (task.meta.run, checkpoints, release manifests; "
                                   "docs/PROTOCOL.md §5)."),
        "release-manifest.json": _document(ReleaseManifest, "edgepfl release manifest",
                                           "An exported encoder's manifest.json and release.meta.manifest "
                                           "(docs/PROTOCOL.md §12)."),
    }
    for mtype, meta in META_TYPES.items():
        docs[f"meta-{mtype.value}.json"] = _document(
            meta, f"edgepfl {mtype.value} meta",
            f"header.meta of a `{mtype.value}` frame (docs/PROTOCOL.md §5).")
    return docs


def render(schema: dict[str, Any]) -> str:
    """The file text of one schema: 2-space indented JSON and a final newline."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def write_schemas(out_dir: str | Path) -> list[Path]:
    """Write every schema into ``out_dir`` (atomically, file by file); returns the paths.

    Files of an earlier generation that no model produces any more are removed, so the
    folder holds exactly the current schemas.
    """
    from ..atomic import write_bytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = schema_documents()
    for stale in out.glob("*.json"):
        if stale.name not in docs:
            stale.unlink()
    paths = []
    for name, schema in docs.items():
        write_bytes(out / name, render(schema).encode())
        paths.append(out / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgepfl.protocol.schemas", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/schemas", help="folder to write the schemas to (default docs/schemas)")
    args = parser.parse_args(argv)
    for path in write_schemas(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
