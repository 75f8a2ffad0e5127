"""docs/MODELS.md is the model spec an agent without edgepfl builds from: every table on
it is parsed and checked against the real ``state_dict`` of every (method, arch, norm)
and against the method's shared keys, both ways (nothing missing, nothing extra)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from edgepfl.methods import METHODS, create_method
from edgepfl.specs import ModelSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "MODELS.md"
ARCHS = ("cnn", "fedpac_cnn", "cnn1d", "mlp", "identity", "resnet18", "mobilenet_v3_small")
NORMS = ("batch", "none")
INPUT = (2, 20, 20)  # C = 2 catches a channel count taken for 3 or 1; S = 2
SERIES_INPUT = (2, 20)  # C x T, for the encoders of series
SERIES_ARCHS = ("cnn1d",)
F, K = 8, 3
#: option sets built besides the defaults, so that every `when` branch is checked
VARIANTS = {"repper": [{"projection_dim": 6, "head": "mlp", "head_hidden": 7}],
            "dualfed": [{"proj_hidden": 5}], "fedrir": [{"embed_dim": 6, "q_hidden": 5}]}
ENCODER_POLICIES = {"shared", "bn-local", "bn-stats-local", "personal"}
_MARKER = re.compile(r"<!-- tensors: (.+?) -->")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*`(\[[^`]*\])`\s*\|([^|]*)\|(?:([^|]*)\|)?\s*$")


def parse_tables(text: str) -> dict[tuple[str, ...], list[tuple[str, str, str, str]]]:
    """Marker words -> rows (name, shape expression, third column, fourth column) of the
    table that follows the marker."""
    tables: dict[tuple[str, ...], list[tuple[str, str, str, str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = _MARKER.search(line)
        if not found:
            continue
        key = tuple(found.group(1).split())
        assert key not in tables, f"two tables for {key}"
        rows: list[tuple[str, str, str, str]] = []
        j = i + 1
        while j < len(lines) and not lines[j].startswith("|"):
            j += 1
        j += 2  # header and separator
        while j < len(lines) and lines[j].startswith("|"):
            row = _ROW.match(lines[j])
            assert row, f"MODELS.md line {j + 1} is not a tensor row: {lines[j]}"
            rows.append((row.group(1), row.group(2), row.group(3).strip(), (row.group(4) or "").strip().strip("`")))
            j += 1
        tables[key] = rows
    return tables


TABLES = parse_tables(DOC.read_text())


def _encoder_table(arch: str, norm: str) -> list:
    for key, rows in TABLES.items():
        if key[:2] == ("encoder", arch) and norm in key[2:]:
            return rows
    raise AssertionError(f"MODELS.md has no encoder table for {arch} / {norm}")


def _method_table(name: str) -> tuple[str, bool, list]:
    for key, rows in TABLES.items():
        if key[:2] == ("method", name):
            policy = next(w.split("=", 1)[1] for w in key if w.startswith("encoder="))
            assert policy in ENCODER_POLICIES, f"{name}: unknown encoder policy {policy}"
            return policy, "own-encoder" in key, rows
    raise AssertionError(f"MODELS.md has no table for method {name}")


def input_of(arch: str) -> tuple[int, ...]:
    return SERIES_INPUT if arch in SERIES_ARCHS else INPUT


def _symbols(method, arch: str, norm: str, model) -> dict:
    if arch in SERIES_ARCHS:
        c, t = SERIES_INPUT
        shape = {"C": c, "T": t}
    else:
        c, h, w = INPUT
        shape = {"C": c, "H": h, "W": w, "S": ((min(h, w) - 4) // 2 - 4) // 2, "P": ((min(h, w) - 4) // 2 - 2) // 2,
                 "Sh": ((h - 4) // 2 - 4) // 2, "Sw": ((w - 4) // 2 - 4) // 2}
    d = {"cnn": F, "fedpac_cnn": F, "cnn1d": F, "mlp": F, "identity": math.prod(input_of(arch)), "resnet18": 512,
         "mobilenet_v3_small": 576}[arch]
    return {**method.config.model_dump(), **shape, "F": F, "K": K, "D": d, "norm": norm, "arch": arch}


def _evaluate(expression: str, symbols: dict):
    return eval(expression, {"__builtins__": {}}, symbols)  # noqa: S307 - expressions from our own doc


def _is_bn(model, key: str) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    module = key.rpartition(".")[0]
    return isinstance(dict(model.named_modules()).get(module), _BatchNorm)


def _encoder_shared(policy: str, key: str, model) -> bool:
    leaf = key.rpartition(".")[2]
    if leaf == "num_batches_tracked" or policy == "personal":
        return False
    if policy == "bn-local":
        return not _is_bn(model, key)
    if policy == "bn-stats-local":
        return not (_is_bn(model, key) and leaf in ("running_mean", "running_var"))
    return True


def expected_tensors(name: str, options: dict, arch: str, norm: str, method, model) -> tuple[dict, set]:
    """(name -> shape, shared names) as MODELS.md states them for this build."""
    symbols = _symbols(method, arch, norm, model)
    policy, own_encoder, rows = _method_table(name)
    shapes: dict[str, list[int]] = {}
    shared: set[str] = set()
    if not own_encoder:
        for tensor, shape, _, _ in _encoder_table(arch, norm):
            shapes[tensor] = _evaluate(shape, symbols)
            if _encoder_shared(policy, tensor, model):
                shared.add(tensor)
    for tensor, shape, is_shared, when in rows:
        if when and not _evaluate(when, symbols):
            continue
        assert tensor not in shapes, f"{name}: {tensor} listed twice for {options}, {arch}, {norm}"
        assert is_shared in ("yes", "no"), f"{name}: shared column of {tensor} is {is_shared!r}"
        shapes[tensor] = _evaluate(shape, symbols)
        if is_shared == "yes":
            shared.add(tensor)
    return shapes, shared


def _builds():
    for name in METHODS:  # the built-ins: a plugin documents its own model
        for options in [{}, *VARIANTS.get(name, [])]:
            # FedRIR builds its own extractors whatever the arch (test_fedrir_ignores_the_arch...)
            for arch in ("cnn",) if name == "fedrir" else ARCHS:
                for norm in NORMS:
                    yield pytest.param(name, options, arch, norm)


@pytest.mark.parametrize("name,options,arch,norm", list(_builds()))
def test_every_tensor_of_every_model_is_in_models_md_with_its_shape_and_sharing(name, options, arch, norm):
    import torch

    torch.manual_seed(0)
    method = create_method(name, options)
    model = method.build_model(ModelSpec(arch=arch, feature_dim=F, norm=norm), input_of(arch), K)
    shapes, shared = expected_tensors(name, options, arch, norm, method, model)
    real = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert sorted(set(real) - set(shapes)) == [], "tensors missing from MODELS.md"
    assert sorted(set(shapes) - set(real)) == [], "tensors in MODELS.md the model does not have"
    wrong = {k: (shapes[k], real[k]) for k in real if shapes[k] != real[k]}
    assert wrong == {}, "MODELS.md shape != state_dict shape"
    assert set(method.shared_keys(model)) == shared


def test_fedrir_ignores_the_arch_as_models_md_says():
    a = create_method("fedrir").build_model(ModelSpec(arch="cnn", feature_dim=F), INPUT, K)
    b = create_method("fedrir").build_model(ModelSpec(arch="resnet18", feature_dim=64), INPUT, K)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}


def test_the_doc_parser_sees_every_table_and_refuses_a_malformed_row():
    assert {k[1] for k in TABLES if k[0] == "method"} == set(METHODS)
    assert {k[1] for k in TABLES if k[0] == "encoder"} == set(ARCHS)
    assert len(_encoder_table("resnet18", "batch")) == 120
    with pytest.raises(AssertionError, match="not a tensor row"):
        parse_tables("<!-- tensors: encoder x batch -->\n\n| t | s | l |\n|---|---|---|\n| encoder.a | [1] | x |\n")
