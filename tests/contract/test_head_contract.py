"""Heads belong to their methods: one vocabulary, one estimator family, every head exportable.

* Every built-in method (a plugin's own tests check its heads), every kind in its ``head_kinds``: the head comes from the
  method (``make_head``), fits on synthetic features, exports to ONNX, and onnxruntime's
  probabilities are the estimator's.
* The vocabulary is ``Method.head_kinds`` only: ``fit-head``'s choices and the agent
  config are derived from it, a method's own head is built by its method module only.
* No drift: RepPer's stage 2, the head tier and ``fit-head`` build the same estimator,
  with the same parameters, for each kind on a RepPer release.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from pydantic import ValidationError

from edgepfl.config import AgentConfig
from edgepfl.export import head_contract
from edgepfl.export.heads import OnnxHead
from edgepfl.heads import GENERIC_HEAD_KINDS, OFFLINE_HEAD_KIND, HeadRelease
from edgepfl.methods import METHODS, available_head_kinds, create_method, get_method, plugin_methods
from edgepfl.protocol import read_manifest

from tests.export_fixtures import NEW_CLIENT, client_data, client_pixels, export_dir

CASES = [(name, kind) for name in METHODS for kind in get_method(name).head_kinds]


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_every_head_of_every_method_fits_and_exports(name, kind, tmp_path):
    """The public check (edgepfl.export.head_contract.check_method_heads): built by the method, fitted on
    synthetic features, exported to ONNX; onnxruntime's probabilities and labels are the estimator's."""
    head_contract.check_head_fits_and_exports(name, kind, tmp_path)


def test_the_head_vocabulary_is_the_methods():
    own = {name for name in METHODS if name in get_method(name).head_kinds}
    assert own >= {"dualfed", "fedpick"}
    for name in METHODS:
        kinds = get_method(name).head_kinds
        # a method offers generic heads and at most its own, never another method's
        assert set(kinds) - set(GENERIC_HEAD_KINDS) <= {name}, (name, kinds)
        head_contract.check_head_vocabulary(name)
    built_in = {kind for name in METHODS for kind in get_method(name).head_kinds}
    assert built_in == set(GENERIC_HEAD_KINDS) | own
    # beyond them, only an installed plugin's own head, which carries its name
    assert built_in <= set(available_head_kinds()) <= built_in | set(plugin_methods())
    # the generic family is exactly the generic kinds
    from edgepfl.heads import estimators

    generic = {c.kind for _, c in inspect.getmembers(estimators, inspect.isclass)
               if issubclass(c, estimators.HeadEstimator) and c.kind}
    assert generic == set(GENERIC_HEAD_KINDS)


def test_a_methods_own_head_is_reachable_only_through_its_method():
    from edgepfl.export import heads as export_heads
    from edgepfl.heads import estimators
    from edgepfl.heads.estimators import HeadEstimator

    # export/ converts and runs heads and defines no estimator: the ONNX runtime head is shaped
    # like one without scikit-learn's base classes, which would load scikit-learn to predict
    defined = {c for _, c in inspect.getmembers(export_heads, inspect.isclass)
               if issubclass(c, HeadEstimator) and c.__module__ == export_heads.__name__}
    assert defined == set() and not issubclass(OnnxHead, HeadEstimator)
    assert not any(hasattr(mod, n) for mod in (export_heads, estimators)
                   for n in ("DualFedHead", "FedPickHead", "HEAD_KINDS", "TORCH_HEADS", "SKLEARN_HEADS", "make_head"))
    # a method without a head of its own does not build another method's
    with pytest.raises(ValueError, match="does not fit a fedavg encoder"):
        create_method("fedavg").make_head("dualfed")
    # a method's head carries that method's options
    head = create_method("fedpick", {"threshold": 0.3}).make_head("fedpick", global_heads={})
    assert head.method == "fedpick" and head.method_options["threshold"] == 0.3


def test_fit_head_choices_and_agent_config_follow_the_registry(capsys):
    from edgepfl.export.fit_head import main_fit_head

    with pytest.raises(SystemExit):
        main_fit_head(["--help"])
    help_text = capsys.readouterr().out
    assert "{" + ",".join(available_head_kinds()) + "}" in help_text
    for kind in [*available_head_kinds(), OFFLINE_HEAD_KIND]:
        assert AgentConfig(agent_id="pi", head=kind).head == kind
    with pytest.raises(ValidationError, match="unknown head kind 'knn'; choose from .*fedpick.*onnx"):
        AgentConfig(agent_id="pi", head="knn")


# --------------------------------------------------------------------------- no drift on a release
REPPER_OPTIONS = {"head_C": 0.5, "head_hidden": 24, "head_max_iter": 300}


@pytest.fixture(scope="module")
def repper_release(tmp_path_factory):
    return export_dir(tmp_path_factory.mktemp("repper"), "repper", rounds=1, epochs=1, options=REPPER_OPTIONS)


@pytest.mark.parametrize("kind", GENERIC_HEAD_KINDS)
def test_stage_two_head_tier_and_fit_head_build_the_same_estimator(kind, repper_release, tmp_path):
    import torch

    from edgepfl.edge_agent.head_tier import HeadRuntime
    from edgepfl.export.fit_head import fit_head, load_dataset
    from edgepfl.export.predict import OnnxEncoder

    manifest = read_manifest(repper_release / "manifest.json")
    options = manifest.run.method.options
    assert options["head_C"] == 0.5  # the release carries the federation's head options

    # stage 2 of a RepPer federation with these options and this head kind
    method = create_method("repper", {**options, "head": kind})
    data = client_data(NEW_CLIENT)
    model = method.build_model(manifest.run.model, data.input_shape, data.num_classes)
    stage2 = method.fit_head(model, torch.from_numpy(data.x_train), torch.from_numpy(data.y_train), seed=0)

    # a head-tier device that received the release over MQTT (no directory)
    device = HeadRuntime(tmp_path / "state", kind, data).new_head(HeadRelease.from_manifest(manifest))

    # edgepfl fit-head on the exported encoder
    encoder = OnnxEncoder.from_dir(repper_release)
    pixels, labels, _ = client_pixels(NEW_CLIENT)
    np.savez(tmp_path / "d.npz", x=pixels, y=labels)
    offline, _ = fit_head(encoder, load_dataset(tmp_path / "d.npz", encoder), kind, export_dir=repper_release)

    assert type(stage2) is type(device) is type(offline)
    assert stage2.get_params() == device.get_params() == offline.get_params()
    params = stage2.get_params()
    assert params["max_iter"] == 300 and params.get("C", 0.5) == 0.5
    assert params.get("hidden_layer_sizes", (24,)) == (24,)
