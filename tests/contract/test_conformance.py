"""The conformance kit in process: its verdicts (a newer requirement is skipped for an older
agent, a failed SHOULD leaves it conformant), docs/CONFORMANCE.md lists exactly the kit's
checks, and the command is registered.

The kit against real agent processes and a real Mosquitto:
tests/integration/agent/test_conformance_kit_live.py.
"""

from __future__ import annotations

import re

from edgepfl.conformance import CHECKS, Report

from tests.conftest import REPO_ROOT


def test_a_newer_requirement_is_skipped_for_an_older_agent():
    report = Report(agent_cmd="x", protocol="1.2", agent_version="1.1")
    report.record("refusal.data_mismatch", False, "no refusal (silence)")
    report.record("refusal.data_mismatch.silent", False, "answered with an update")
    assert report.results["refusal.data_mismatch"].verdict == "skip"
    assert report.results["refusal.data_mismatch.silent"].verdict == "fail"
    assert not report.conformant
    assert "NOT CONFORMANT" in report.table()


def test_a_failed_should_leaves_the_agent_conformant():
    report = Report(agent_cmd="x", protocol="1.2", agent_version="1.2")
    report.record("presence.capabilities", False, "capabilities None")
    report.record("task.train", True, "answered")
    report.record("task.train", False, "a later verdict does not replace the first")
    assert report.results["task.train"].verdict == "pass"
    assert report.conformant


def test_docs_list_every_check_with_its_section_and_level():
    text = (REPO_ROOT / "docs" / "CONFORMANCE.md").read_text()
    pattern = r"^\| `([a-z0-9_.]+)` \| \[(§\w+)\]\(PROTOCOL\.md#[^)]+\) \| (MUST|SHOULD) \|"
    rows = {m[0]: (m[1], m[2]) for m in re.findall(pattern, text, re.M)}
    assert rows == {c.id: (c.section, c.level) for c in CHECKS.values()}


def test_cli_registers_the_command():
    from edgepfl.cli import DELEGATES

    assert ("conformance", "edgepfl.conformance.cli:main_conformance") in [(n, t) for n, t, _ in DELEGATES]


def test_the_probes_score_everything_for_a_right_agent_and_near_chance_for_each_break(tmp_path):
    """task.preprocessing and task.class_order tell breaks apart only if the kit's trained
    model is right on every sample and far below MIN_ACCURACY under each break."""
    from edgepfl.conformance.kit import _Kit
    from edgepfl.conformance.probes import MIN_ACCURACY, discrimination
    from edgepfl.conformance.wire import write_dataset

    data = tmp_path / "data.npz"
    run = _Kit.run_spec(write_dataset(data))
    scored = discrimination(run, data)
    assert scored["right"] == 1.0 and scored["class order, mapped"] == 1.0
    for broken in ("x / 255 only", "the file's normalization", "class order, local numbers"):
        assert scored[broken] <= MIN_ACCURACY - 0.4, (broken, scored)


def test_the_training_probes_pass_a_right_trainer_and_fail_each_break(tmp_path):
    """train.preprocessing and train.class_order, on training as docs/MODELS.md and METHODS.md
    define it (the run's SGD, BatchNorm momentum 0.1; the project's own method and model): a
    trainer that feeds the task's inputs keeps the first BatchNorm variance within the kit's
    range and the class-order model right; one that trains on x / 255 alone, on its file's
    normalization, or on its local label numbers does not — whatever it does in evaluate."""
    import numpy as np

    from edgepfl._torch import torch
    from edgepfl.conformance.kit import _Kit
    from edgepfl.conformance.probes import (
        MIN_ACCURACY,
        PROBE_NORMALIZATION,
        VARIANCE_RATIO,
        Probe,
        accuracy,
        build_probes,
        preprocess,
        read_data,
        training_probe,
        variance_ratio,
    )
    from edgepfl.conformance.wire import TEST_FRACTION, write_dataset
    from edgepfl.methods import create_method
    from edgepfl.methods.base import load_tensors
    from edgepfl.protocol import Normalization

    data = tmp_path / "data.npz"
    run = _Kit.run_spec(write_dataset(data))
    pixels, labels, names = read_data(data)
    plain, order = (training_probe(p) for p in build_probes(run, data))
    kept = int(round(len(labels) * (1 - TEST_FRACTION)))

    def trained(probe: Probe, normalization: Normalization, map_labels: bool, seed: int) -> dict:
        r = probe.run
        method = create_method(r.method.name, r.method.options)
        model = method.build_model(r.model, r.data.input_shape, r.data.num_classes)
        load_tensors(model, probe.payload)
        y = labels
        if map_labels:
            index = {name: i for i, name in enumerate(r.data.class_names)}
            y = np.array([index[names[j]] for j in labels], dtype=np.int64)
        x = torch.from_numpy(preprocess(pixels, normalization, r.data.pixel_scale))[:kept]
        y = torch.from_numpy(np.asarray(y, np.int64))[:kept]
        optimizer = torch.optim.SGD(model.parameters(), lr=r.train.lr, momentum=r.train.momentum,
                                    weight_decay=r.train.weight_decay)
        generator = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(r.train.epochs):
            for batch in torch.randperm(kept, generator=generator).split(r.train.batch_size):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(method.logits(model, x[batch]), y[batch]).backward()
                optimizer.step()
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k in probe.payload}

    low, high = VARIANCE_RATIO
    for seed in range(3):
        right = trained(plain, PROBE_NORMALIZATION, True, seed)
        ratio = variance_ratio(plain.payload, right)
        assert ratio is not None and low <= ratio <= high, ratio
        for wrong in (Normalization(mean=[0.0], std=[1.0]), run.data.normalization):
            ratio = variance_ratio(plain.payload, trained(plain, wrong, True, seed))
            assert ratio is not None and ratio < low - 0.2, ratio
        assert accuracy(Probe(order.run, trained(order, PROBE_NORMALIZATION, True, seed)), pixels, labels,
                        names) >= MIN_ACCURACY
        assert accuracy(Probe(order.run, trained(order, PROBE_NORMALIZATION, False, seed)), pixels, labels,
                        names) <= MIN_ACCURACY - 0.4
