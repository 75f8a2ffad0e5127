"""The configuration reference, templates and JSON Schemas, generated from the pydantic models.

One home per fact: a field's type, default and description live on its model; this
module only renders them — ``docs/CONFIG.md`` is :func:`reference_markdown` (a test
regenerates and compares it), ``edgepfl config --template`` is :func:`template_yaml`
and ``edgepfl config --schema`` is :func:`json_schema`.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from .config import AgentConfig, MethodSpec, RunConfig
from .config_loading import _is_path, _unwrap
from .methods import METHODS, get_method

Kind = Literal["run", "agent"]
ROOTS: dict[str, type[BaseModel]] = {"run": RunConfig, "agent": AgentConfig}
REGENERATE = "edgepfl config > docs/CONFIG.md"


def _hints(model: type[BaseModel]) -> dict[str, Any]:
    return typing.get_type_hints(model, include_extras=True)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, alone or as the items of a list."""
    for alt in _unwrap(annotation):
        if typing.get_origin(alt) is list:
            return _submodel(typing.get_args(alt)[0])
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            return alt
    return None


def _type_name(annotation: Any) -> str:
    if _is_path(annotation):
        return "path" + (" \\| null" if type(None) in typing.get_args(annotation) else "")
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            # MethodSpec has no table of its own: each method's options are under "method options"
            anchor = "method-options" if annotation is MethodSpec else _section(annotation).lower()
            return f"[{_section(annotation)}](#{anchor})"
        return annotation.__name__
    return str(annotation)


def _section(model: type[BaseModel]) -> str:
    return model.__name__


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return PydanticUndefined
    else:
        value = field.default
    return to_jsonable_python(value)  # a model, or models in a list, as their JSON values


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _models(root: type[BaseModel], seen: list[type[BaseModel]]) -> list[type[BaseModel]]:
    if root in seen:
        return seen
    seen.append(root)
    hints = _hints(root)
    for name in root.model_fields:
        sub = _submodel(hints[name])
        if sub is not None:
            _models(sub, seen)
    return seen


def _table(model: type[BaseModel]) -> list[str]:
    hints = _hints(model)
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        sub = _submodel(hints[name])
        default = _default(field)
        shown = "required" if default is PydanticUndefined else (
            "(section)" if sub is not None and isinstance(default, dict) else f"`{_scalar(default)}`")
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(hints[name])} | {shown} | {description} |")
    return rows


def reference_markdown() -> str:
    """``docs/CONFIG.md``: every model of a run and an agent config, and every method's options."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic models by `{REGENERATE}`; `tests/unit/core/test_operator.py` fails",
        "when it is out of date. `edgepfl config --template run` (or `agent`) prints a commented",
        "YAML file with every default, `edgepfl config --schema run` the JSON Schema.",
        "",
        "* Unknown fields are errors, reported with the file and the field's dotted path.",
        "* A field of type **path**, given in a YAML file, is relative to that file's folder",
        "  (`~` is expanded); given by `--set` or in Python, to the working directory.",
        "* `--set key.path=value` (repeatable) overrides any field on `simulate`, `coordinator` and",
        "  `agent`; the value is YAML: `--set rounds=20 --set data.partition.alpha=0.1",
        "  --set model.weights=null`.",
        "* `edgepfl simulate` without `--agents` runs `data.num_clients` agents (less `--head-agents`).",
        "",
    ]
    for kind, root in ROOTS.items():
        title = {"run": "coordinator and `simulate` (`--config`)", "agent": "`edgepfl agent --config`"}[kind]
        out += [f"## {kind} config: {title}", ""]
        for model in _models(root, []):
            if model is MethodSpec or (kind == "agent" and model in _models(RunConfig, [])):
                continue
            out += [f"### {_section(model)}", ""]
            doc = (model.__doc__ or "").strip().split("\n\n")[0]
            if doc:
                out += [" ".join(doc.split()), ""]
            out += _table(model) + [""]
    out += ["## method options", "",
            "`method.name` picks the method; its options sit beside the name (`method: {name: fedprox, mu: 0.01}`)",
            "and are validated by the method's config class.", ""]
    for name in sorted(METHODS):  # the built-ins: a plugin installed here documents its own options
        cls = get_method(name).config_class
        out += [f"### method: {name}", "", " ".join((get_method(name).summary or "").split()), ""]
        out += _table(cls) + [""] if cls.model_fields else ["No options.", ""]
    return "\n".join(out).rstrip() + "\n"


def _comment(text: str | None, indent: str) -> list[str]:
    text = " ".join((text or "").split())
    return [f"{indent}# {text}"] if text else []


def _template_model(model: type[BaseModel], indent: str, values: dict[str, Any] | None = None) -> list[str]:
    hints = _hints(model)
    lines: list[str] = []
    for name, field in model.model_fields.items():
        annotation = hints[name]
        sub = _submodel(annotation)
        default = (values or {}).get(name, _default(field))
        choices = ""
        literal = [a for a in _unwrap(annotation) if typing.get_origin(a) is Literal]
        if literal:
            choices = "one of " + ", ".join(str(a) for a in typing.get_args(literal[0]))
        kind = "path; relative to this file's folder" if _is_path(annotation) else choices
        lines += _comment(" — ".join(t for t in (field.description, kind) if t), indent)
        if default is PydanticUndefined:
            lines.append(f"{indent}{name}: my-{name.replace('_', '-')}  # required")
        elif sub is not None and isinstance(default, dict) and sub is not MethodSpec:
            lines.append(f"{indent}{name}:")
            lines += _template_model(sub, indent + "  ", default)
        elif sub is not MethodSpec:
            lines.append(f"{indent}{name}: {_scalar(default)}")
    return lines


def template_yaml(kind: Kind, method: str = "fedavg") -> str:
    """A commented YAML config of ``kind`` with every field at its default (``method``'s options for a run)."""
    root = ROOTS[kind]
    lines = [f"# edgepfl {kind} config: every field at its default (edgepfl config --template {kind}).",
             "# Reference: docs/CONFIG.md. Delete what you keep at its default."]
    body = _template_model(root, "")
    if kind == "run":
        cls = get_method(method).config_class
        method_lines = ["# the federated method (edgepfl methods lists them) and its options", "method:",
                        f"  name: {method}"]
        for name, field in cls.model_fields.items():
            method_lines += _comment(field.description, "  ") + [f"  {name}: {_scalar(_default(field))}"]
        at = next(i for i, line in enumerate(body) if line.startswith("model:"))
        while at > 0 and body[at - 1].startswith("#"):
            at -= 1
        body[at:at] = method_lines
    return "\n".join(lines + body) + "\n"


def json_schema(kind: Kind) -> dict[str, Any]:
    """The JSON Schema of a ``kind`` config (editors validate and complete YAML with it)."""
    schema = ROOTS[kind].model_json_schema()
    schema["title"] = f"edgepfl {kind} config"
    return schema


__all__ = ["json_schema", "reference_markdown", "template_yaml"]
