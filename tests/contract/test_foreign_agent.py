"""An agent written from docs/PROTOCOL.md, docs/MODELS.md and docs/schemas alone
(tests/foreign_agent/agent.py) computes what edgepfl computes, in process: it imports no
edgepfl module, its frames and chunks decode with edgepfl and back, its local update is
the project's step for step, its documented seed and its split of pooled data are
edgepfl's.

The same agent in a real federation beside edgepfl's agents, in a process that cannot
import edgepfl: tests/integration/agent/test_foreign_agent_federation.py.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from edgepfl.protocol import MessageType, UpdateMeta, decode, encode
from edgepfl.protocol.reassembly import Reassembler

AGENT = Path(__file__).resolve().parents[1] / "foreign_agent" / "agent.py"
SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def foreign_module():
    """The foreign agent as a module of this (edgepfl-importing) test process, for codec checks."""
    spec = importlib.util.spec_from_file_location("foreign_agent_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_foreign_agent_imports_no_edgepfl_module():
    imported = set()
    for node in ast.walk(ast.parse(AGENT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            imported.add(node.module or "")
    assert imported and not {name for name in imported if name.split(".")[0] == "edgepfl"}
    assert "importlib" not in imported and "__import__" not in AGENT.read_text()


def test_foreign_frames_and_chunks_decode_with_edgepfl_and_back():
    agent = foreign_module()
    codec = agent.Codec(SCHEMAS)
    tensors = {"encoder.net.1.weight": np.arange(40_000, dtype=np.float32).reshape(200, 200) / 7,
               "head.bias": np.array([0.5, -1.25], np.float32)}
    meta = {"task_id": "ab" * 16, "kind": "train", "num_train": 600, "num_test": 150, "eval_correct": 117,
            "eval_loss": 0.61, "train_loss": 0.42, "train_seconds": 1.5, "extra": {}}
    frame = codec.encode("update", "demo", "pi-07", 3, meta, tensors)
    message = decode(frame)
    assert message.type == MessageType.UPDATE and message.meta.eval_correct == 117
    assert message.tensors["encoder.net.1.weight"].tobytes() == tensors["encoder.net.1.weight"].tobytes()

    chunks = agent.split_frame(codec, frame, 16_384, "demo", "pi-07", 3)
    assert len(chunks) > 5 and all(len(c) <= 16_384 for c in chunks)
    joined = Reassembler(max_bytes=2**20)
    whole = [joined.add("t", decode(c)) for c in reversed(chunks)]  # any order (§8)
    assert whole[:-1] == [None] * (len(chunks) - 1) and whole[-1] == frame

    theirs = encode(MessageType.UPDATE, federation="demo", sender="pi-07", round=3, meta=UpdateMeta(**meta),
                    tensors=tensors)
    header, back = codec.decode(theirs, 2**20)
    assert header["meta"]["task_id"] == "ab" * 16 and back["head.bias"].tolist() == [0.5, -1.25]
    with pytest.raises(agent.Rejected, match="corrupt"):
        codec.decode(theirs[:-1] + bytes([theirs[-1] ^ 1]), 2**20)
    bad_meta = dict(meta, eval_correct=-1)
    with pytest.raises(agent.Rejected, match="malformed"):
        codec.decode(frame.replace(b'"eval_correct": 117', b'"eval_correct": -1'), 2**20)
    with pytest.raises(agent.Rejected, match="malformed"):
        codec.encode("update", "demo", "pi-07", 3, bad_meta)


@pytest.mark.parametrize("method, arch, norm, options", [
    ("fedavg", "cnn", "batch", {}), ("fedavg", "mlp", "none", {}), ("fedper", "cnn", "none", {}),
    ("fedrep", "mlp", "batch", {}), ("fedrep", "cnn", "batch", {"head_epochs": 2, "body_epochs": 1}),
])
def test_the_foreign_local_update_is_the_project_s_step_for_step(method, arch, norm, options):
    """Same weights, data and task seed in: the same trained weights out (to float rounding),
    the same evaluation and train_loss. What differs between the two agents in a federation
    is then only their seeds and their personal initialisation."""
    import torch

    from edgepfl.data import ClientTensors
    from edgepfl.methods import LocalContext, create_method
    from edgepfl.specs import ModelSpec, TrainConfig

    agent = foreign_module()
    run = {"method": {"name": method, "options": options}, "model": {"arch": arch, "feature_dim": 16, "norm": norm},
           "train": {"epochs": 2, "batch_size": 13, "lr": 0.05, "momentum": 0.5, "weight_decay": 5e-4,
                     "optimizer": "sgd"},
           "data": {"input_shape": [1, 16, 16], "num_classes": 3}}
    project = create_method(method, options)
    theirs = project.build_model(ModelSpec(**run["model"]), (1, 16, 16), 3)
    ours = agent.Classifier(run)
    assert list(ours.state_dict()) == list(theirs.state_dict())  # MODELS.md's names, in order
    ours.load_state_dict(theirs.state_dict())
    assert agent.shared_keys(method, ours) == project.shared_keys(theirs)

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(61, 1, 16, 16)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, 61))
    data = ClientTensors(x_train=x[:45], y_train=y[:45], x_test=x[45:], y_test=y[45:], num_classes=3)
    ctx = LocalContext(train=TrainConfig(**run["train"]), device="cpu", round=0, seed=11, num_classes=3,
                       generator=torch.Generator().manual_seed(11))
    evaluation = project.evaluate(theirs, data, ctx)
    assert agent.evaluate(ours, x[45:], y[45:]) == (evaluation.correct, pytest.approx(evaluation.loss, abs=1e-6))
    their_loss = project.local_update(theirs, data, ctx).train_loss
    our_loss = agent.local_update(method, {**agent.OPTIONS[method], **options}, ours, x[:45], y[:45], run["train"],
                                  torch.Generator().manual_seed(11))
    assert our_loss == pytest.approx(their_loss, rel=1e-5)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_the_documented_seed_for_example_is_edgepfl_s():
    import re

    from edgepfl.protocol import seed_for

    text = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()
    example = re.search(r'`seed_for\(0, 3, "pi-07"\)` hashes `0/3/pi-07` and is\s+(\d+)', text)
    assert example is not None and int(example.group(1)) == seed_for(0, 3, "pi-07")
    assert foreign_module().seed_for(0, 3, "pi-07") == seed_for(0, 3, "pi-07")
    assert foreign_module().seed_for(7, "init", "agent-01") == seed_for(7, "init", "agent-01")


def test_the_foreign_agent_splits_pooled_data_per_class_in_file_order(tmp_path):
    from edgepfl.conformance.wire import CLASS_NAMES, SAMPLES_PER_CLASS, TEST_FRACTION, write_dataset

    write_dataset(tmp_path / "data.npz")
    raw = np.load(tmp_path / "data.npz")
    split = foreign_module().split_pooled(raw["x"], raw["y"], TEST_FRACTION)
    held = round(TEST_FRACTION * SAMPLES_PER_CLASS)
    assert np.bincount(split["y_test"]).tolist() == [held] * len(CLASS_NAMES)
    assert np.bincount(split["y_train"]).tolist() == [SAMPLES_PER_CLASS - held] * len(CLASS_NAMES)
    last = np.flatnonzero(raw["y"] == 0)[-held:]  # class 0's last samples are its held-out ones
    assert np.array_equal(split["x_test"][:held], raw["x"][last])
