"""Every command against its bad inputs: one ``edgepfl: …`` line on stderr, no traceback,
the documented exit code (docs/OPERATING.md, "Exit codes").

The config-level cases run in-process through ``main()`` here;
tests/integration/operator/test_cli_error_matrix.py runs the whole matrix, each case as a subprocess.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.cli import main
from edgepfl.errors import ExitCode

USAGE, DATA, BROKER = int(ExitCode.USAGE), int(ExitCode.DATA), int(ExitCode.BROKER)


@dataclass
class Case:
    name: str
    args: list[str]
    code: int
    says: str = ""  # a fragment the line must contain (what, or where)
    env: dict[str, str] = field(default_factory=dict)
    fast: bool = False  # cheap enough to also run in-process in the fast lane


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")

    def yml(name: str, data) -> None:
        (d / name).write_text(data if isinstance(data, str) else yaml.safe_dump(data))

    yml("good.yaml", {"method": {"name": "fedavg"}, "data": {"dataset": "digits"}, "rounds": 1})
    yml("bad_fields.yaml", "method: {name: fedavg}\nrounds: -3\nfraction: 2\n")
    yml("bad_yaml.yaml", "rounds: [1\n")
    yml("list.yaml", "- 1\n- 2\n")
    yml("bad_method.yaml", {"method": {"name": "fedmagic"}})
    yml("bad_option.yaml", {"method": {"name": "fedprox", "mu": "lots"}})
    yml("no_root.yaml", {"data": {"dataset": "imagefolder", "root": "photos-missing", "num_clients": 2}})
    (d / "empty_photos" / "cat").mkdir(parents=True)
    yml("empty_folder.yaml", {"data": {"dataset": "imagefolder", "root": "empty_photos", "num_clients": 2}})
    yml("no_npz.yaml", {"data": {"dataset": "npz", "root": "nope.npz"}})
    (d / "pickled.npz").write_bytes(b"not a zip at all")
    yml("bad_npz.yaml", {"data": {"dataset": "npz", "root": "pickled.npz"}})
    yml("fmnist.yaml", {"data": {"dataset": "fmnist"}})
    yml("few.yaml", {"data": {"dataset": "digits", "num_clients": 2000, "samples_per_client": 50}})
    yml("agent.yaml", {"agent_id": "pi-1", "data": {"dataset": "digits"}})
    yml("aggregator_same_federation.yaml", {"site_id": "site-a", "central": {"federation": "f"},
                                            "site": {"federation": "f"}})
    yml("aggregator_bad_id.yaml", {"site_id": "site/a", "central": {"federation": "f"}})
    yml("agent_bad_id.yaml", {"agent_id": "pi/1#", "broker": {"url": "mqtt://127.0.0.1:1"}})
    yml("agent_bad_url.yaml", {"agent_id": "pi-1", "tier": "head", "broker": {"url": "ftp://broker:21"},
                               "data": {"dataset": "digits", "num_clients": 2}})
    yml("agent_no_data.yaml", {"agent_id": "pi-1", "tier": "head", "broker": {"url": "mqtt://127.0.0.1:1"},
                               "data": {"dataset": "imagefolder", "root": "photos-missing"}})
    (d / "corrupt.onnx").write_bytes(b"\x08\x07garbage, not a protobuf" * 10)
    # the red team's frame as files: JSON / YAML nested 200,000 / 100,000 deep
    yml("nested.yaml", "a: " + "[" * 100_000 + "]" * 100_000)
    (d / "nested_release").mkdir()
    (d / "nested_release" / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    (d / "nested_release" / "encoder.onnx").write_bytes(b"\x08\x07garbage, not a protobuf" * 10)
    (d / "run_without_checkpoint").mkdir()
    (d / "run_without_checkpoint" / "metrics.jsonl").write_text("")
    (d / "not_a_run").mkdir()
    (d / "garbled_run").mkdir()
    (d / "garbled_run" / "metrics.jsonl").write_text("garbage{\n")
    np.save(d / "x.npy", np.zeros((1, 1, 8, 8), np.float32))
    return d


def cases(d: Path) -> list[Case]:
    no_fmnist = {"EDGEPFL_FMNIST_ROOT": str(d / "no-fmnist")}
    return [
        # arguments
        Case("no command", [], USAGE, "required", fast=True),
        Case("unknown command", ["trian"], USAGE, "invalid choice", fast=True),
        Case("unknown option", ["methods", "--colour"], USAGE, "unrecognized arguments", fast=True),
        Case("log level before", ["--log-level", "verbose", "methods"], USAGE, "verbose", fast=True),
        Case("log level after", ["methods", "--log-level", "verbose"], USAGE, "verbose", fast=True),
        Case("log format", ["methods", "--log-format", "xml"], USAGE, "xml", fast=True),
        Case("agents 0", ["simulate", "--config", str(d / "good.yaml"), "--agents", "0"], USAGE, "--agents", fast=True),
        Case("agents word", ["simulate", "--config", str(d / "good.yaml"), "--agents", "four"], USAGE, "four", fast=True),
        Case("no agents anywhere", ["simulate", "--config", str(d / "good.yaml")], USAGE, "num_clients", fast=True),
        Case("in-process head agents", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--in-process",
                                        "--head-agents", "1"], USAGE, "--in-process", fast=True),
        Case("head knn", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--head-agents", "1",
                          "--head", "knn"], USAGE, "knn", fast=True),
        # a head the run's method does not release: refused before any training, not by every head agent after it
        Case("head the method lacks", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--head-agents",
                                       "1", "--head", "dualfed"], USAGE, "a fedavg release has no such head", fast=True),
        Case("report needs --run", ["report"], USAGE, "--run", fast=True),
        Case("report target not an accuracy", ["report", "--run", ".", "--target", "85"], USAGE,
             "not an accuracy between 0 and 1", fast=True),
        Case("config template kind", ["config", "--template", "fleet"], USAGE, "fleet", fast=True),
        Case("config template unknown method", ["config", "--template", "run", "--method", "fedavgg"], USAGE,
             "unknown method 'fedavgg'", fast=True),
        Case("config method without template", ["config", "--method", "fedavg"], USAGE, "--template", fast=True),
        # configs
        Case("missing config", ["simulate", "--config", str(d / "nope.yaml"), "--agents", "2"], USAGE,
             "config file not found", fast=True),
        Case("bad fields", ["simulate", "--config", str(d / "bad_fields.yaml"), "--agents", "2"], USAGE,
             "fraction", fast=True),
        Case("bad yaml", ["coordinator", "--config", str(d / "bad_yaml.yaml")], USAGE, "invalid YAML", fast=True),
        Case("nested yaml", ["agent", "--config", str(d / "nested.yaml")], USAGE, "nest more than", fast=True),
        Case("yaml list", ["coordinator", "--config", str(d / "list.yaml")], USAGE, "mapping", fast=True),
        Case("unknown method", ["simulate", "--config", str(d / "bad_method.yaml"), "--agents", "2"], USAGE,
             "fedmagic", fast=True),
        Case("bad method option", ["simulate", "--config", str(d / "bad_option.yaml"), "--agents", "2"], USAGE,
             "mu", fast=True),
        Case("set unknown field", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--set", "Cc=1"],
             USAGE, "Cc", fast=True),
        # digits are 8 x 8: the CNN cannot take them; said as the configuration error it is, not a crash
        Case("digits with the cnn", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--in-process",
                                     "--set", "model.arch=cnn"], USAGE, "use model.arch mlp"),
        Case("set malformed", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--set", "rounds"],
             USAGE, "key.path=value", fast=True),
        Case("set bad value", ["coordinator", "--config", str(d / "good.yaml"), "--set", "rounds=many"], USAGE,
             "rounds", fast=True),
        Case("coordinator embedded", ["coordinator", "--config", str(d / "good.yaml")], USAGE, "broker URL"),
        Case("agent embedded", ["agent", "--config", str(d / "agent.yaml")], USAGE, "broker URL", fast=True),
        Case("agent bad id", ["agent", "--config", str(d / "agent_bad_id.yaml")], USAGE, "agent_id", fast=True),
        Case("aggregator on its devices' federation", ["aggregator", "--config",
                                                        str(d / "aggregator_same_federation.yaml")], USAGE,
             "site.federation", fast=True),
        Case("aggregator bad id", ["aggregator", "--config", str(d / "aggregator_bad_id.yaml")], USAGE, "site_id",
             fast=True),
        Case("aggregator no config", ["aggregator"], USAGE, "--config", fast=True),
        Case("agent head knn", ["agent", "--config", str(d / "agent.yaml"), "--set", "head=knn"], USAGE, "knn",
             fast=True),
        # data and input files
        Case("data root missing", ["simulate", "--config", str(d / "no_root.yaml"), "--agents", "2", "--in-process"],
             DATA, "photos-missing"),
        Case("empty image folder", ["simulate", "--config", str(d / "empty_folder.yaml"), "--agents", "2",
                                    "--in-process"], DATA, "no images"),
        Case("npz missing", ["simulate", "--config", str(d / "no_npz.yaml"), "--agents", "2", "--in-process"], DATA,
             "nope.npz"),
        Case("npz corrupt", ["simulate", "--config", str(d / "bad_npz.yaml"), "--agents", "2", "--in-process"], DATA,
             "pickled.npz"),
        Case("fmnist absent", ["simulate", "--config", str(d / "fmnist.yaml"), "--agents", "2", "--in-process"], DATA,
             "Fashion-MNIST", env=no_fmnist),
        Case("too many clients", ["simulate", "--config", str(d / "few.yaml"), "--in-process"], DATA, ""),
        Case("agent data missing", ["agent", "--config", str(d / "agent_no_data.yaml")], DATA, "photos-missing"),
        Case("export without checkpoint", ["export", "--run", str(d / "run_without_checkpoint"), "--out",
                                           str(d / "rel")], DATA, "checkpoint"),
        Case("export missing run", ["export", "--run", str(d / "no-such-run"), "--out", str(d / "rel")], DATA, ""),
        Case("report not a run", ["report", "--run", str(d / "not_a_run")], USAGE, "metrics.jsonl"),
        Case("report garbled metrics", ["report", "--run", str(d / "garbled_run")], DATA, "not JSON", fast=True),
        Case("predict corrupt onnx", ["predict", "--encoder", str(d / "corrupt.onnx"), "--head", str(d / "corrupt.onnx"),
                                      str(d / "x.npy")], DATA, ""),
        Case("predict missing encoder", ["predict", "--encoder", str(d / "none.onnx"), "--head", str(d / "none.onnx"),
                                         str(d / "x.npy")], DATA, "none"),
        Case("predict nested manifest", ["predict", "--encoder", str(d / "nested_release" / "encoder.onnx"), "--head",
                                         str(d / "corrupt.onnx"), str(d / "x.npy")], DATA, "manifest.json"),
        Case("fit-head nested manifest", ["fit-head", "--encoder", str(d / "nested_release" / "encoder.onnx"), "--data",
                                          str(d / "x.npy"), "--head", "lr", "--out", str(d / "h.onnx")], DATA,
             "manifest.json"),
        Case("predict no inputs", ["predict", "--encoder", str(d / "none.onnx")], USAGE, "required"),
        Case("fit-head corrupt encoder", ["fit-head", "--encoder", str(d / "corrupt.onnx"), "--data", str(d / "x.npy"),
                                          "--head", "lr", "--out", str(d / "h.onnx")], DATA, ""),
        Case("fit-head unknown head", ["fit-head", "--encoder", str(d / "corrupt.onnx"), "--data", str(d / "x.npy"),
                                       "--head", "knn", "--out", str(d / "h.onnx")], USAGE, "knn"),
        # broker
        # (--log-level warning: the agent service logs at info by default, the error must still be its only line)
        # a URL in a config file is checked when the file loads: a config error, which no restart can fix
        Case("broker url scheme", ["agent", "--config", str(d / "agent_bad_url.yaml"), "--log-level", "warning"],
             USAGE, "ftp"),
        # ... and on the command line too: a URL no broker can have is a usage error, everywhere
        Case("simulate broker url", ["simulate", "--config", str(d / "good.yaml"), "--agents", "2", "--broker",
                                     "ftp://x:1"], USAGE, "ftp", fast=True),
        Case("coordinator broker url", ["coordinator", "--config", str(d / "good.yaml"), "--broker",
                                        "tcp://127.0.0.1:1883"], USAGE, "tcp", fast=True),
        Case("status broker url", ["status", "--broker", "tcp://127.0.0.1:1883", "--federation", "f"], USAGE, "tcp",
             fast=True),
        # a broker nobody runs: 4, as for every command that connects (port 1 on loopback: nothing listens)
        Case("status no broker", ["status", "--broker", "mqtt://127.0.0.1:1", "--federation", "f", "--timeout", "5"],
             BROKER, "refused", fast=True),
        Case("provision port", ["provision", "--out", str(d / "prov"), "--federation", "f", "--broker-host", "h",
                                "--count", "1", "--port", "70000"], USAGE, "--port", fast=True),
    ]


def _check(case: Case, code: int, stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, f"{case.name}: traceback\n{stderr[-2000:]}"
    assert code == case.code, f"{case.name}: exit {code}, expected {case.code}\n{stderr[-1000:]}"
    # "edgepfl: …", or a command that names itself: "edgepfl status: …"
    assert len(lines) == 1 and re.match(r"edgepfl( [a-z-]+)?: ", lines[0]), f"{case.name}: not one line\n{stderr[-1000:]}"
    assert case.says in lines[0], f"{case.name}: {case.says!r} not in {lines[0]!r}"


FAST = [c.name for c in cases(Path("/x")) if c.fast]


@pytest.mark.parametrize("name", FAST)
def test_config_and_argument_errors_in_process(name, files, capsys, monkeypatch):
    case = next(c for c in cases(files) if c.name == name)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("EDGEPFL_DEBUG", raising=False)
    monkeypatch.chdir(files)
    code = main(case.args)
    _check(case, code, capsys.readouterr().err)


def test_debug_shows_the_traceback(files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    assert main(["--debug", "coordinator", "--config", "list.yaml"]) == USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("edgepfl: ")
    monkeypatch.setenv("EDGEPFL_DEBUG", "1")
    assert main(["coordinator", "--config", "list.yaml"]) == USAGE
    assert "Traceback" in capsys.readouterr().err


EXTRA = int(ExitCode.EXTRA)


@pytest.mark.parametrize("args", [
    ["simulate", "--config", "good.yaml", "--agents", "1", "--head-agents", "1", "--head", "svm", "--out", "run"],
    ["agent", "--config", "head.yaml", "--broker", "mqtt://127.0.0.1:1"],
    ["fit-head", "--encoder", "none.onnx", "--data", "none", "--head", "svm", "--out", "head.onnx"],
], ids=["simulate --head-agents", "head agent", "fit-head"])
def test_a_missing_fitting_library_is_named_with_its_extra_before_any_work(args, files, capsys, monkeypatch):
    """scikit-learn absent (a None entry in sys.modules is how Python spells "cannot
    be imported"). Each command that would fit a generic head on a device says so in one
    line, naming the extra that installs it, before it loads data, starts a broker or
    opens a file: no run directory, no connection attempt (the broker URL is closed)."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.chdir(files)
    (files / "head.yaml").write_text(yaml.safe_dump({"agent_id": "pi", "tier": "head", "head": "svm"}))
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXTRA and len(err) == 1, err
    assert "sklearn, which is not installed; pip install 'edgepfl[agent]'" in err[0] and "svm" in err[0]
    assert not (files / "run").exists()
