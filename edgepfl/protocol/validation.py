"""One-line messages for pydantic validation errors, shared by the envelope and the manifest."""

from __future__ import annotations

from pydantic import ValidationError


def first_validation_error(exc: ValidationError) -> str:
    """``loc: message`` of a validation error's first problem, and how many more there are."""
    errs = exc.errors()
    first = errs[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {first.get('msg')}{more}"
