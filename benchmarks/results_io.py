"""Where every benchmark script writes what it measured: ``<out>.json`` and ``<out>.md``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_results(result: dict, out: str | Path, markdown: Callable[[dict], str]) -> None:
    """Write ``result`` as JSON and its markdown table next to it, and print the table."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    print(table)
