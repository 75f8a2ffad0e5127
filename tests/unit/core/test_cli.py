"""The ``edgepfl`` command line as a user meets it, in process (the commands as
subprocesses, the demo included: tests/integration/operator/test_cli_commands.py)."""

from __future__ import annotations

import sys

from edgepfl.cli import DEMO
from edgepfl.config import RunConfig, parse_config


def test_demo_config_is_valid_and_small():
    config = parse_config(RunConfig, DEMO, "demo")
    assert config.rounds <= 10 and config.broker.url == "embedded"


def test_a_new_method_is_its_module_and_its_row_and_a_helper_module_is_no_method(tmp_path, monkeypatch, capsys):
    """Methods are listed in ``METHODS``: a module of building blocks beside them (no
    ``@register``, no row) is not offered, and a new method module with its row is."""
    import edgepfl.methods as methods
    from edgepfl.cli import main

    (tmp_path / "shared_helpers.py").write_text("def helper():\n    return 1\n")
    (tmp_path / "toy.py").write_text(
        "from edgepfl.methods import register\nfrom edgepfl.methods.fedavg import FedAvg\n\n\n"
        "@register\nclass Toy(FedAvg):\n    name = 'toy'\n    description = 'a test method'\n")
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(tmp_path)])
    monkeypatch.setattr(methods, "METHODS", (*methods.METHODS, "toy"))
    try:
        assert "shared_helpers" not in methods.available_methods() and "toy" in methods.available_methods()
        assert main(["methods"]) == 0
        listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert "toy" in listed and "shared_helpers" not in listed and "fedavg" in listed
    finally:  # the registry is the process's: no toy method for the tests after this one
        methods._REGISTRY.pop("toy", None)
        sys.modules.pop("edgepfl.methods.toy", None)
