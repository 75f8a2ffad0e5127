"""Federated methods, one module each, found by name through a registry.

Adding a method means adding one module in this package that defines a
:class:`~edgepfl.methods.base.Method` subclass decorated with :func:`register`,
plus its tests; modules here are discovered automatically.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
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
#: The built-in methods: each name is the module of this package that registers it
#: (``@register``). Adding a method is its module plus its name here; the method contract
#: suite checks that the two agree. Listing them needs no import, so no torch.
METHODS: tuple[str, ...] = (
    "dualfed", "fedavg", "fedavg_ft", "fedbn", "fedpac", "fedper", "fedpick", "fedprox", "fedrep", "fedrir",
    "fedrod", "lgfedavg", "local", "repper",
)


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
    """Names of every method (:data:`METHODS`), sorted."""
    return sorted(METHODS)


def get_method(name: str) -> type[Method]:
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


def available_head_kinds() -> list[str]:
    """Every head kind some method offers (``Method.head_kinds``); imports every method module."""
    return sorted({kind for name in available_methods() for kind in get_method(name).head_kinds})


def create_method(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """Instantiate a method with validated options (a run spec's, a release's: any mapping)."""
    cls = get_method(name)
    return cls(cls.config_class.model_validate(dict(options or {})))


__all__ = [
    "ClientUpdate", "EvalResult", "LocalContext", "LocalResult", "Method", "MethodConfig", "RoundAggregate",
    "ServerState", "TensorDict", "UpdateRejected", "available_head_kinds", "available_methods", "create_method", "get_method",
    "register",
]
