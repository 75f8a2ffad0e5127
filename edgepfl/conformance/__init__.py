"""The conformance kit: ``edgepfl conformance --agent-cmd "…"`` plays the coordinator against an
agent implementation over a real broker and checks the MUSTs of docs/PROTOCOL.md.

See docs/CONFORMANCE.md: the agent-command contract, its placeholders and every check.
"""

from .checks import CHECKS, PROFILES, SCENARIOS, Check, Report, Result
from .kit import KitOptions, run_kit

__all__ = ["CHECKS", "PROFILES", "SCENARIOS", "Check", "KitOptions", "Report", "Result", "run_kit"]
