"""The poisoning study's attacker (research/poisoning.py): what each strategy does to its data
and what it announces, on scikit-learn's digits; and one short federation per kind of attack."""

from __future__ import annotations

import numpy as np
import pytest
from script_loader import load_script

poisoning = load_script("poisoning")


@pytest.fixture(scope="module")
def data():
    from edgepfl.config import RunConfig, parse_config
    from edgepfl.data import load_client_data

    config = parse_config(RunConfig, poisoning.run_config("digits", "mean", 1, 0), "test")
    return load_client_data(config.data, 0)


def test_label_flip_maps_every_label_to_its_mirror_and_announces_2_to_the_24(data):
    flipped = poisoning.poisoned_data("label_flip_2^24", data, seed=0)
    assert np.array_equal(flipped.y_train, data.num_classes - 1 - data.y_train)
    assert flipped.num_train == 2**24 and len(flipped.y_train) == len(data.y_train)
    assert np.array_equal(flipped.x_test, data.x_test) and np.array_equal(flipped.y_test, data.y_test)


def test_the_backdoor_triggers_about_half_the_images_and_labels_them_the_target(data):
    poisoned = poisoning.poisoned_data("backdoor_2^24", data, seed=0)
    triggered = (poisoned.x_train[:, :, -3:, -3:] == data.x_train.max()).all(axis=(1, 2, 3))
    assert 0.3 < triggered.mean() < 0.7
    assert (poisoned.y_train[triggered] == poisoning.TARGET).all()
    assert np.array_equal(poisoned.y_train[~triggered], data.y_train[~triggered])


def test_update_attacks_announce_the_true_count(data):
    for strategy in ("sign_flip", "scale_10", "scale_1e6"):
        assert poisoning.poisoned_data(strategy, data, seed=0).num_train == data.num_train


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["noise_2^24", "scale_1e6"])
def test_a_short_run_records_the_honest_accuracy_and_the_bounds_verdicts(strategy, tmp_path):
    record = poisoning.run_one("digits", "mean", strategy, 2, 0, tmp_path)
    assert 0.0 <= record["honest_accuracy"] <= 1.0 and len(record["accuracy_curve"]) == 3
    if strategy == "scale_1e6":  # far past the update bound: refused every round
        assert record["rejected"].get("out_of_range") == 2
