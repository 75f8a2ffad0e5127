"""Edge agent: the agent loop (:mod:`.agent`), trainer tier (:mod:`.trainer`, torch) and
head tier (:mod:`.head_tier`, onnxruntime + scikit-learn, never torch).

Importing this package imports nothing else: :class:`Agent` and :func:`run_agent` load the
agent loop when first named. A head fit's child process (``python -m
edgepfl.edge_agent.head_fit``) imports the package too, and runs beside the resident agent on
a device capped at 150 MB, so the protocol stack (12 MiB) stays out of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .agent import Agent, run_agent


def __getattr__(name: str) -> Any:
    if name in ("Agent", "run_agent"):
        from . import agent

        return getattr(agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Agent", "run_agent"]
