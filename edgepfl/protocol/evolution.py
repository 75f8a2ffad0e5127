"""How the protocol evolves: versions, negotiation, and tolerance of unknown fields.

From protocol 1.2 on (docs/PROTOCOL.md §16):

* a **minor** version may add optional fields anywhere in a header, a meta, the run spec
  or the release manifest; a receiver **ignores** a key it does not know (it is reported
  in :attr:`edgepfl.protocol.Message.unknown_fields`, so receivers can log it once) and
  validates every key it knows as strictly as before. :func:`strip_unknown` does that
  against the JSON Schema of the receiving model, so the models themselves stay strict
  (a typo in a config file is still an error);
* a field added by a minor version is **omitted when it has its default**
  (:func:`omitted_defaults`): a frame that uses no feature of the new minor version is
  exactly a frame of the old one, which strict receivers of that version still decode;
* the **major** version is negotiated: both sides announce ``major.minor`` (the agent
  in its status, the coordinator in its presence) and a receiver refuses a peer of
  another major version with the reason ``unsupported_version``; within one major, each
  side uses a feature only when the peer announced a minor version that has it
  (:func:`supports`).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.config import JsonDict

__all__ = [
    "MAJOR", "MINOR", "PROTOCOL_VERSION", "VERSION_PATTERN", "omitted_defaults", "parse_version",
    "since", "strip_unknown", "supports",
]

#: the protocol version this implementation speaks (``major.minor``)
MAJOR, MINOR = 1, 17
PROTOCOL_VERSION = f"{MAJOR}.{MINOR}"
VERSION_PATTERN = r"^[0-9]{1,4}\.[0-9]{1,4}$"
_VERSION = re.compile(VERSION_PATTERN)


def parse_version(version: str) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; raises ValueError for anything that is not ``major.minor``."""
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ValueError(f"protocol version {version!r} is not major.minor")
    major, minor = version.split(".")
    return int(major), int(minor)


def supports(version: str | None, feature: tuple[int, int]) -> bool:
    """Whether a peer announcing ``version`` implements a feature added in ``feature``
    (``(major, minor)``). An unannounced or unparseable version supports only 1.0."""
    try:
        major, minor = parse_version(version or "1.0")
    except ValueError:
        return False
    return major == feature[0] and minor >= feature[1]


def since(version: str) -> JsonDict:
    """``json_schema_extra`` of a field a minor version added: ``Field(None, json_schema_extra=since("1.2"))``.

    The mark appears in the published JSON Schemas, and :func:`omitted_defaults` leaves
    such a field out of a frame while it has its default."""
    parse_version(version)
    return {"x-since": version}


def omitted_defaults(model: BaseModel) -> dict[str, Any]:
    """The ``exclude`` argument of ``model_dump`` that leaves out every field marked with
    :func:`since` whose value is its default, at every level of nested models."""
    exclude: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "x-since" in extra and value == field.get_default(call_default_factory=True):
            exclude[name] = True
        elif isinstance(value, BaseModel):
            nested = omitted_defaults(value)
            if nested:
                exclude[name] = nested
    return exclude


@cache
def _schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(mode="validation")


def strip_unknown(data: Any, model: type[BaseModel]) -> tuple[Any, list[str]]:
    """``data`` without the object keys ``model`` does not define, and their dotted paths.

    Only objects whose schema forbids other keys are pruned; free-form mappings (method
    options, ``extra``, ``values``) keep every key. ``data`` is not modified."""
    schema = _schema(model)
    dropped: list[str] = []
    clean = _prune(data, schema, schema.get("$defs", {}), "", dropped)
    return clean, dropped


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _prune(data: Any, node: dict[str, Any], defs: dict[str, Any], path: str, dropped: list[str]) -> Any:
    node = _resolve(node, defs)
    for key in ("anyOf", "oneOf"):
        if key in node:
            # a union: prune by the branch of the data's JSON type (edgepfl's unions are
            # "model or null" and "list or null", never two object shapes)
            for branch in node[key]:
                branch = _resolve(branch, defs)
                if _json_type_matches(data, branch):
                    return _prune(data, branch, defs, path, dropped)
            return data
    if isinstance(data, dict) and "properties" in node:
        props = node["properties"]
        out = {}
        for k, v in data.items():
            if k in props:
                out[k] = _prune(v, props[k], defs, f"{path}.{k}" if path else k, dropped)
            elif node.get("additionalProperties", True) is False:
                dropped.append(f"{path}.{k}" if path else k)
            else:
                out[k] = v
        return out
    if isinstance(data, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _prune(v, node["additionalProperties"], defs, f"{path}.{k}" if path else k, dropped)
                for k, v in data.items()}
    if isinstance(data, list):
        if "prefixItems" in node:
            items = node["prefixItems"]
            return [_prune(v, items[i], defs, f"{path}[{i}]", dropped) if i < len(items) else v
                    for i, v in enumerate(data)]
        if isinstance(node.get("items"), dict):
            return [_prune(v, node["items"], defs, f"{path}[{i}]", dropped) for i, v in enumerate(data)]
    return data


def _json_type_matches(data: Any, node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is None:
        return "properties" in node and isinstance(data, dict)
    return {"object": isinstance(data, dict), "array": isinstance(data, list), "null": data is None}.get(kind, False)
