"""A third party's method (tests/plugins/toy_method.py, outside the package) registered through an
installed package's ``edgepfl.methods`` entry point: listed without being imported, offered by
``edgepfl methods``, accepted by a run's config, and put through the public method contract
(``edgepfl.testing.check_method``), which names what a broken plugin breaks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import edgepfl.methods as methods
from edgepfl.cli import main
from edgepfl.config import RunConfig
from edgepfl.methods import available_methods, create_method, get_method, plugin_methods, register
from edgepfl.testing import check_method, method_checks

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
ENTRY_POINTS = """[edgepfl.methods]
toy_avg = toy_method:ToyAvg
toy_broken = toy_method:BrokenShapes
toy_registered = toy_registering
toy_misnamed = toy_method:Misnamed
toy_missing = toy_method:NoSuchClass
fedavg = toy_method:ToyAvg
"""


@pytest.fixture(autouse=True)
def installed(tmp_path, monkeypatch):
    """A package installed on the path (its dist-info, as pip writes it) declaring the plugin methods;
    the registry and the plugin modules are as before the test when it ends."""
    info = tmp_path / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGINS))
    for module in ("toy_method", "toy_registering"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield
    # the plugins leave the registry; built-ins registered meanwhile stay (their modules stay imported)
    for name in [n for n, cls in methods._REGISTRY.items() if not cls.__module__.startswith("edgepfl.methods.")]:
        del methods._REGISTRY[name]


def test_plugins_are_listed_beside_the_built_ins_without_importing_them():
    assert {"toy_avg", "toy_broken", "toy_registered"} <= set(plugin_methods())
    assert "fedavg" not in plugin_methods()  # a plugin cannot take a built-in's name
    assert set(methods.METHODS) | set(plugin_methods()) == set(available_methods())
    assert "toy_method" not in sys.modules and "toy_registering" not in sys.modules


def test_a_plugin_class_and_a_registering_module_are_found_by_their_entry_point_names():
    from toy_method import ToyAvg

    assert get_method("toy_avg") is ToyAvg
    assert create_method("toy_avg", {"smoothing": 0.2}).config.smoothing == 0.2
    assert get_method("toy_registered").__module__ == "toy_registering"
    assert get_method("fedavg").__module__ == "edgepfl.methods.fedavg"  # the built-in keeps its name


def test_a_plugin_that_cannot_load_or_is_misnamed_is_one_line_naming_its_entry_point():
    with pytest.raises(KeyError, match=r"entry point toy_missing = toy_method:NoSuchClass .*cannot be loaded"):
        get_method("toy_missing")
    with pytest.raises(KeyError, match=r"toy_method:Misnamed .* is named 'toy_other'"):
        get_method("toy_misnamed")


def test_a_plugin_class_may_not_take_a_built_in_name_and_a_built_in_module_keeps_its_rule():
    from toy_method import ToyAvg

    class Impostor(ToyAvg):
        name = "fedavg"

    with pytest.raises(ValueError, match="takes the name of a built-in method"):
        register(Impostor)

    class Stray(ToyAvg):
        name = "stray"

    Stray.__module__ = "edgepfl.methods.fedavg"
    with pytest.raises(ValueError, match="must live in edgepfl.methods.stray"):
        register(Stray)


def test_edgepfl_methods_lists_a_plugin_and_says_why_one_cannot_load(capsys):
    assert main(["methods"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "label-smoothed local loss" in lines["toy_avg"]
    assert "cannot load" in lines["toy_missing"] and "fedavg" in lines


def test_a_run_config_takes_a_plugin_method_and_validates_its_options():
    config = RunConfig(method={"name": "toy_avg", "smoothing": 0.3})
    assert config.method.name == "toy_avg" and config.method_config().smoothing == 0.3
    with pytest.raises(ValidationError, match="smoothing"):
        RunConfig(method={"name": "toy_avg", "smoothing": 2.0})
    with pytest.raises(ValidationError, match="unknown method 'toy_nothing'"):
        RunConfig(method={"name": "toy_nothing"})


def test_the_plugin_passes_the_public_method_contract():
    assert check_method("toy_avg", {"smoothing": 0.05}) == []  # every check applies: none skipped


def test_method_checks_parametrize_a_plugins_tests_one_check_each():
    from toy_method import ToyAvg

    checks = method_checks(ToyAvg)  # the class itself: a plugin's own tests need not install it
    ids = [str(c) for c in checks]
    assert len(ids) == len(set(ids)) and "toy_avg-any_arrival_order_gives_the_same_next_state_bit_for_bit[mean]" in ids
    next(c for c in checks if "server_step_keeps_shapes" in str(c))()


def test_a_broken_server_fails_the_public_check_naming_the_check_and_the_tensor():
    from toy_method import BrokenShapes

    with pytest.raises(AssertionError, match=r"^toy_broken-server_step_keeps_shapes_dtypes_and_is_checkpointable failed: "
                                             r"toy_broken: \S+ changed shape or dtype"):
        check_method(BrokenShapes)


def test_a_plugin_method_brings_its_heads_and_they_pass_the_public_head_check(tmp_path):
    """Heads belong to methods: a plugin's ``head_kinds`` are what a head-tier device may fit on its encoder."""
    from edgepfl.export.head_contract import check_method_heads
    from edgepfl.heads import GENERIC_HEAD_KINDS

    assert get_method("toy_avg").head_kinds == GENERIC_HEAD_KINDS
    check_method_heads("toy_avg", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == sorted(f"head-{k}.onnx" for k in GENERIC_HEAD_KINDS)


def test_a_trainer_announces_the_plugins_it_can_load_and_leaves_out_one_it_cannot():
    """A coordinator offers a plugin method's tasks only to trainers that announce it (their capabilities)."""
    from edgepfl.edge_agent.trainer import trainable_methods

    offered = trainable_methods()
    assert {"toy_avg", "toy_registered", "fedavg"} <= set(offered)
    assert not {"toy_missing", "toy_misnamed"} & set(offered)


def test_a_plugin_that_cannot_load_leaves_the_head_vocabulary_and_the_commands_that_do_not_name_it_working(capsys):
    """``toy_missing`` is installed and cannot load: it offers no head kind, and neither ``edgepfl fit-head``
    nor a head agent's config (which read every method's head kinds) fails for it."""
    from edgepfl.config import AgentConfig
    from edgepfl.heads import GENERIC_HEAD_KINDS

    kinds = methods.available_head_kinds()
    assert set(GENERIC_HEAD_KINDS) | {"dualfed", "fedpick"} <= set(kinds)
    assert AgentConfig(agent_id="pi-1", tier="head", head="dualfed").head == "dualfed"
    assert main(["fit-head", "--help"]) == 0
    assert "--head {" in capsys.readouterr().out
