"""Federated methods, one module each, found by name through a registry.

Adding a method means adding one module in this package that defines a
:class:`~edgepfl.methods.base.Method` subclass decorated with :func:`register`,
plus its tests; modules here are discovered automatically.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    ClientUpdate,
    EvalResult,
    LocalContext,
    LocalResult,
    Method,
    MethodConfig,
    ServerState,
    TensorDict,
    UpdateRejected,
)

_REGISTRY: dict[str, type[Method]] = {}
_INFRA = {"base", "aggregate", "training", "losses"}
_discovered = False


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _INFRA and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _discovered = True


def available_methods() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get_method_class(name: str) -> type[Method]:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


get_method = get_method_class


def create_method(name: str, options: dict | None = None) -> Method:
    """Instantiate a method with validated options."""
    cls = get_method_class(name)
    return cls(cls.config_class.model_validate(options or {}))


__all__ = [
    "ClientUpdate", "EvalResult", "LocalContext", "LocalResult", "Method", "MethodConfig", "ServerState",
    "TensorDict", "UpdateRejected", "available_methods", "create_method", "get_method", "register",
]
