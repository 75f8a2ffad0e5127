"""docs/ARCHITECTURE.md names every module of the apps and the core, so a module added
without a line there fails here.

The modules are the layering test's (every ``.py`` under ``edgepfl/``, ``coordinator/``,
``edge_agent/`` and ``export/``). A module is named by its path from the repository root
(``coordinator/drivers/secure.py``) or, inside a sub-folder, by its folder and file name
when no other module ends the same way (``drivers/secure.py``); a package's
``__init__.py`` by its folder's path (``coordinator/drivers/``). A name counts only whole:
``xdrivers/secure.py`` or ``coordinator/drivers/secure.pyi`` names nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tests.contract.test_layering import ROOT, _modules

DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _names(path: Path, short_counts: Counter[str]) -> list[str]:
    """The forms that name the module at ``path`` in the doc."""
    rel = path.relative_to(ROOT)
    if rel.name == "__init__.py":
        return [f"{rel.parent.as_posix()}/"]
    forms = [rel.as_posix()]
    short = "/".join(rel.parts[-2:])
    if len(rel.parts) > 2 and short_counts[short] == 1:
        forms.append(short)
    return forms


def _named(text: str, form: str) -> bool:
    # not preceded by a path or word character (a longer path naming another module), and
    # a file name not continued (``.pyi``); a folder ends with its slash
    tail = "" if form.endswith("/") else r"(?![\w])"
    return re.search(rf"(?<![\w/.-]){re.escape(form)}{tail}", text) is not None


def _unnamed(text: str, paths: list[Path]) -> list[str]:
    short_counts = Counter("/".join(p.relative_to(ROOT).parts[-2:]) for p in paths)
    return sorted(p.relative_to(ROOT).as_posix() for p in paths
                  if not any(_named(text, form) for form in _names(p, short_counts)))


def test_every_module_of_the_apps_and_the_core_is_named_in_architecture_md():
    paths = list(_modules().values())
    assert len(paths) > 100  # the walk found the code, not an empty folder
    missing = _unnamed(DOC.read_text(), paths)
    assert not missing, f"docs/ARCHITECTURE.md names no row or sentence for: {', '.join(missing)}"


def test_a_name_counts_only_whole():
    paths = [ROOT / "coordinator/drivers/secure.py", ROOT / "edge_agent/secure.py", ROOT / "coordinator/drivers/__init__.py"]
    assert _unnamed("`coordinator/drivers/secure.py`, `edge_agent/secure.py`, `coordinator/drivers/`", paths) == []
    assert _unnamed("`drivers/secure.py` and `edge_agent/secure.py` in `coordinator/drivers/`", paths) == []
    # a longer path, another extension, a folder without its slash: none of them names the module
    assert _unnamed("`tests/drivers/secure.py`, `edge_agent/secure.pyi`, `coordinator/drivers`", paths) == [
        "coordinator/drivers/__init__.py", "coordinator/drivers/secure.py", "edge_agent/secure.py"]
