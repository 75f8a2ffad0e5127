"""JSON from untrusted bytes, parsed without recursion in Python and with its nesting bounded.

Python's ``json`` parser recurses once per level of nesting, so a few hundred kilobytes of
``[[[[…`` raise :class:`RecursionError` — not :class:`json.JSONDecodeError` — out of any
``except JSONDecodeError`` around it, and the process that read one frame is gone. The
same holds for every later step that walks the parsed value (pydantic, ``repr``, our own
recursive helpers). :func:`loads` parses with pydantic-core's parser (Rust; it stops at
a fixed recursion limit of its own, with an error, long before any stack runs out), then
walks the result once, without recursing, to hold it to :data:`MAX_DEPTH` levels and
finite numbers. Everything a parser can object to (not UTF-8, not JSON, nesting, an
integer too long, ``NaN`` / ``Infinity``, a number that overflows a float) comes out as
one :class:`BoundedJSONError` with a one-line reason.

Every decoder of the project that reads bytes it did not write itself goes through here:
frame headers (:mod:`.envelope`), the fleet view, the conformance kit, the agents' and
the coordinator's state files, release manifests, ONNX metadata. YAML configs are
bounded the same way by :func:`edgepfl.config.load_yaml_bounded`.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic_core import from_json

#: the deepest nesting of arrays and objects accepted (docs/PROTOCOL.md §15); the deepest
#: structure the protocol defines (a task's run spec inside its meta inside the header) is 6
MAX_DEPTH = 32


class BoundedJSONError(ValueError):
    """The text is not JSON this project accepts; the message is one line."""


def check_bounded(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`BoundedJSONError` when ``value`` (parsed JSON) nests deeper than
    ``max_depth`` or holds a float that is not finite. Level by level, without recursing:
    any depth is safe to check."""
    level, depth = [value], 0
    while level:
        containers = []
        for node in level:
            kind = type(node)
            if kind is dict:
                containers.append(node.values())
            elif kind is list:
                containers.append(node)
            elif kind is float and not math.isfinite(node):
                raise BoundedJSONError(f"{node} is not a finite number")
        if containers and depth >= max_depth:
            raise BoundedJSONError(f"nests more than {max_depth} levels deep")
        level = [child for children in containers for child in children]
        depth += 1


def loads(data: bytes | bytearray | memoryview | str, *, max_depth: int = MAX_DEPTH, what: str = "JSON") -> Any:
    """Parse ``data`` (UTF-8 bytes or text) as strict JSON nested at most ``max_depth`` deep.

    Raises :class:`BoundedJSONError` (a :class:`ValueError`) starting with ``what`` for
    anything it will not return: invalid UTF-8 or JSON, nesting deeper than ``max_depth``,
    ``NaN`` / ``Infinity`` or a float overflow, an integer too long to parse.
    """
    if not isinstance(data, str):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BoundedJSONError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        # keys only: pydantic-core would otherwise keep every short string value (message
        # ids, release ids: a sender's choice) in its process-wide cache
        value = from_json(data, allow_inf_nan=False, cache_strings="keys")
    except ValueError as exc:  # pydantic-core's own errors, its recursion limit among them
        raise BoundedJSONError(f"{what} is not JSON ({str(exc).splitlines()[0][:200]})") from None
    try:
        check_bounded(value, max_depth)
    except BoundedJSONError as exc:
        raise BoundedJSONError(f"{what} {exc}") from None
    return value


__all__ = ["MAX_DEPTH", "BoundedJSONError", "check_bounded", "loads"]
