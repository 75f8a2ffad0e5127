"""Load a research script as a module, as the scripts load each other (from research/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

RESEARCH = Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """``research/<name>.py`` imported under ``name`` (research/ on the path first)."""
    if str(RESEARCH) not in sys.path:
        sys.path.insert(0, str(RESEARCH))
    spec = importlib.util.spec_from_file_location(name, RESEARCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
