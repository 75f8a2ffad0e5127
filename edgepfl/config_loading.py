"""Reading a config from YAML: bounded parsing, ``--set`` overrides, paths relative to the file,
and validation errors as one line naming the file and every bad field.

Shared by the run config (:mod:`edgepfl.config`) and the agent config
(:mod:`edgepfl.agent_config`); it imports neither, so a head agent reading its own config
loads no run-side model.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .protocol.bounded_json import MAX_DEPTH
from .specs import PathField

__all__ = ["MAX_YAML_NODES", "ConfigError", "apply_overrides", "load_config", "load_yaml", "load_yaml_bounded",
           "parse_config", "resolve_paths"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file and field."""


def _format(exc: ValidationError, source: str) -> str:
    problems = [f"{'.'.join(str(p) for p in err.get('loc', ())) or '<root>'}: {err.get('msg')}" for err in exc.errors()]
    return f"invalid config {source}: " + "; ".join(problems)


#: the most nodes a YAML document may stand for once its aliases are expanded: a config
#: is a few hundred; a "billion laughs" of nested aliases is what this stops
MAX_YAML_NODES = 100_000


def load_yaml_bounded(text: str) -> Any:
    """``yaml.safe_load(text)``, after checking on the event stream (which PyYAML produces
    without recursing) that collections nest at most :data:`MAX_DEPTH` deep and that the
    document, its aliases expanded, has at most :data:`MAX_YAML_NODES` nodes. Either
    excess is a :class:`yaml.YAMLError`: the composer would otherwise recurse once per
    level (RecursionError) or a validator walk every expanded alias."""
    sizes: list[list] = [[None, 0]]  # per open collection: its anchor, its expanded node count
    anchored: dict[str, int] = {}
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(sizes) > MAX_DEPTH:
                raise yaml.YAMLError(f"collections nest more than {MAX_DEPTH} deep")
            sizes.append([event.anchor, 1])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = sizes.pop()
            if anchor is not None:
                anchored[anchor] = size
            sizes[-1][1] += size
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchored[event.anchor] = 1
            sizes[-1][1] += 1
        elif isinstance(event, yaml.AliasEvent):
            sizes[-1][1] += anchored.get(event.anchor, 1)
        if sizes[-1][1] > MAX_YAML_NODES:
            raise yaml.YAMLError(f"more than {MAX_YAML_NODES} nodes once aliases are expanded")
    return yaml.safe_load(text)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; :class:`ConfigError` when it is missing or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = load_yaml_bounded(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def parse_config(kind: type[BaseModel], data: dict[str, Any], source: str = "<dict>"):
    """Validate ``data`` as ``kind``; :class:`ConfigError` naming ``source`` and every bad field."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, source)) from None


def apply_overrides(data: dict[str, Any], assignments: Iterable[str]) -> dict[str, Any]:
    """``data`` with ``key.path=value`` assignments applied (``--set``); values are YAML (``3``, ``[1, 2]``, ``null``).

    Intermediate mappings are created; :class:`ConfigError` for a malformed assignment or
    a key path through a value that is not a mapping.
    """
    out = dict(data)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"--set {assignment!r}: expected key.path=value, e.g. --set train.lr=0.05")
        try:
            value = load_yaml_bounded(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {assignment!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {assignment!r}: {'.'.join(parts[:depth + 1])} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of ``X | None`` / ``Optional[X]`` (or ``[annotation]``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_path(annotation: Any) -> bool:
    return any(typing.get_origin(a) is typing.Annotated and any(isinstance(m, PathField) for m in a.__metadata__)
               for a in _unwrap(annotation))


def resolve_paths(kind: type[BaseModel], data: dict[str, Any], base: Path) -> dict[str, Any]:
    """``data`` (raw YAML for ``kind``) with every relative :data:`~edgepfl.specs.ConfigPath` joined to ``base``.

    ``~`` is expanded; absolute paths and values of the wrong type are left to validation.
    """
    out = dict(data)
    hints = typing.get_type_hints(kind, include_extras=True)
    for name, field in kind.model_fields.items():
        key = field.alias or name
        if key not in out:
            continue
        annotation = hints.get(name, field.annotation)
        value = out[key]
        if _is_path(annotation) and isinstance(value, str) and value:
            path = Path(value).expanduser()
            out[key] = str(path if path.is_absolute() else base / path)
            continue
        models = [a for a in _unwrap(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if models and isinstance(value, dict):
            out[key] = resolve_paths(models[0], value, base)
    return out


def load_config(kind: type[BaseModel], path: str | Path, sets: Iterable[str], overrides: dict[str, Any]):
    """``kind`` from the YAML file ``path``: its relative paths joined to the file's folder, then the ``--set``
    ``sets`` and the non-``None`` keyword ``overrides`` applied, then validated (:class:`ConfigError`)."""
    path = Path(path)
    data = resolve_paths(kind, load_yaml(path), path.expanduser().absolute().parent)
    sets = list(sets)
    data = apply_overrides(data, sets)
    data.update({k: v for k, v in overrides.items() if v is not None})
    source = str(path) + (f" (with --set {', '.join(sets)})" if sets else "")
    return parse_config(kind, data, source)
