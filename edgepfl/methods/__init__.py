"""Federated methods, one module each, found by name through a registry.

Adding a built-in method means adding one module in this package that defines a
:class:`~edgepfl.methods.base.Method` subclass decorated with :func:`register`, its name
in :data:`METHODS`, and its tests. A third-party package adds a method without editing
edgepfl: it declares an entry point in the ``edgepfl.methods`` group
(:data:`ENTRY_POINT_GROUP`), ``name = "package.module:MethodClass"`` or
``name = "package.module"`` for a module that registers its class with :func:`register`,
and checks it with :func:`edgepfl.testing.check_method`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .base import (
    ClientUpdate,
    DevicePart,
    EvalResult,
    LocalContext,
    LocalResult,
    Method,
    MethodConfig,
    RoundAggregate,
    ServerState,
    SitePart,
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

#: the entry-point group a package registers its methods in: ``name = "module:MethodClass"``
#: (the class, registered when loaded) or ``name = "module"`` (a module that registers it)
ENTRY_POINT_GROUP = "edgepfl.methods"


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by ``cls.name``.

    The registry is lazy: a built-in method named ``x`` lives in ``edgepfl/methods/x.py``,
    which is imported the first time ``x`` is looked up, so listing and validating methods
    costs one small import each and needs no torch. A plugin's class lives in its own
    package (found through :data:`ENTRY_POINT_GROUP`) and may not take a built-in's name.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    module = cls.__module__.rpartition(".")[2]
    built_in = cls.__module__.startswith(f"{__name__}.")
    if built_in and module != cls.name:
        raise ValueError(f"method {cls.name!r} must live in {__name__}.{cls.name}, not {cls.__module__}")
    if not built_in and cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} of {cls.__module__} takes the name of a built-in method")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def plugin_methods() -> list[str]:
    """The names of the ``edgepfl.methods`` entry points installed here, sorted; none is
    loaded (a name is metadata). A name that is a built-in's stays the built-in's."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(METHODS))


def available_methods() -> list[str]:
    """Names of every method: the built-ins (:data:`METHODS`) and the installed plugins, sorted."""
    return sorted({*METHODS, *plugin_methods()})


def get_method(name: str) -> type[Method]:
    """The method class registered as ``name``; imports its module (a built-in's, or the
    plugin's entry point) on first use."""
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    if name in METHODS:
        importlib.import_module(f"{__name__}.{name}")
        where = f"module {__name__}.{name}"
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise KeyError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
        where = _load_plugin(name, found[0])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"{where} registers no method named {name!r}") from None


def _load_plugin(name: str, entry: EntryPoint) -> str:
    """Load the entry point of plugin method ``name``: a module registers on import, a class
    is registered here. Returns how the entry point is named in a message; anything that
    fails is one ``KeyError`` line naming it."""
    where = f"entry point {name} = {entry.value} ({ENTRY_POINT_GROUP})"
    try:
        target = entry.load()
    except Exception as exc:  # the plugin's own import fails: its error, named
        text = str(exc).strip().splitlines()
        raise KeyError(f"method {name!r}: {where} cannot be loaded: {type(exc).__name__}"
                       f"{': ' + text[0] if text else ''}") from None
    if inspect.isclass(target):
        if not issubclass(target, Method):
            raise KeyError(f"method {name!r}: {where} is {target.__name__}, not a Method subclass")
        if target.name != name:
            raise KeyError(f"method {name!r}: {where} is named {target.name!r}; the entry point and the "
                           "class's name must agree")
        try:
            register(target)
        except ValueError as exc:
            raise KeyError(f"method {name!r}: {exc}") from None
    elif not inspect.ismodule(target):
        raise KeyError(f"method {name!r}: {where} is a {type(target).__name__}, neither a Method subclass nor "
                       "a module that registers one")
    return where


def available_head_kinds() -> list[str]:
    """Every head kind some method offers (``Method.head_kinds``); imports every method module.
    An installed plugin that cannot load offers none: a command or config that names no head
    of it still works, and a run that names the plugin is refused with why (:func:`get_method`)."""
    kinds: set[str] = set()
    for name in available_methods():
        try:
            kinds.update(get_method(name).head_kinds)
        except KeyError:
            if name in METHODS:  # a built-in that does not load is edgepfl's own bug: said, not hidden
                raise
    return sorted(kinds)


def create_method(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """Instantiate a method with validated options (a run spec's, a release's: any mapping)."""
    cls = get_method(name)
    return cls(cls.config_class.model_validate(dict(options or {})))


__all__ = [
    "ClientUpdate", "DevicePart", "EvalResult", "LocalContext", "LocalResult", "Method", "MethodConfig", "RoundAggregate",
    "ServerState", "SitePart", "TensorDict", "UpdateRejected", "ENTRY_POINT_GROUP", "METHODS", "available_head_kinds",
    "available_methods", "create_method", "get_method", "plugin_methods", "register",
]
