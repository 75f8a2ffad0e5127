"""Federated methods, one module each, found by name through a registry.

Adding a method means adding one module in this package that defines a
:class:`~edgepfl.methods.base.Method` subclass decorated with :func:`register`,
plus its tests; modules here are discovered automatically.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import (
    ClientUpdate,
    EvalResult,
    LocalContext,
    LocalResult,
    Method,
    MethodConfig,
    RoundAggregate,
    ServerState,
    TensorDict,
    UpdateRejected,
)

_REGISTRY: dict[str, type[Method]] = {}
# A method module registers its class with a line of its own, `@register`: that is how
# a method is told from a building block (base, losses, ...) without importing either.
_REGISTERS = re.compile(rb"^@register\b", re.MULTILINE)


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by ``cls.name``.

    The registry is lazy: a method named ``x`` lives in ``edgepfl/methods/x.py``, which
    is imported the first time ``x`` is looked up, so listing and validating methods
    costs one small import each and needs no torch.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    module = cls.__module__.rpartition(".")[2]
    if cls.__module__.startswith(f"{__name__}.") and module != cls.name:
        raise ValueError(f"method {cls.name!r} must live in {__name__}.{cls.name}, not {cls.__module__}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    """Names of every method: the modules of this package that register one (read, not imported)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        spec = None if info.name.startswith("_") else info.module_finder.find_spec(
            f"{__name__}.{info.name}", None)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py") and _REGISTERS.search(Path(origin).read_bytes()):
            found.append(info.name)
    return sorted(found)


def get_method_class(name: str) -> type[Method]:
    """The method class registered as ``name``; imports its module on first use."""
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    if name not in available_methods():
        raise KeyError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    importlib.import_module(f"{__name__}.{name}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"module {__name__}.{name} registers no method named {name!r}") from None


get_method = get_method_class


def available_head_kinds() -> list[str]:
    """Every head kind some method offers (``Method.head_kinds``); imports every method module."""
    return sorted({kind for name in available_methods() for kind in get_method_class(name).head_kinds})


def create_method(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """Instantiate a method with validated options (a run spec's, a release's: any mapping)."""
    cls = get_method_class(name)
    return cls(cls.config_class.model_validate(dict(options or {})))


__all__ = [
    "ClientUpdate", "EvalResult", "LocalContext", "LocalResult", "Method", "MethodConfig", "RoundAggregate",
    "ServerState", "TensorDict", "UpdateRejected", "available_head_kinds", "available_methods", "create_method", "get_method",
    "register",
]
