"""The operator's side, unit level: --set overrides, paths relative to the YAML, log levels
and formats, file modes, the Jetson torch specifier, the config reference, the demo's data."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import socket
import stat
from pathlib import Path

import pytest
import yaml

from edgepfl.atomic import write_bytes, write_json
from edgepfl.config import AgentConfig, ConfigError, RunConfig, apply_overrides, load_agent_config, load_run_config
from edgepfl.config_docs import json_schema, reference_markdown, template_yaml
from edgepfl.errors import ExitCode, MissingExtra, classify
from edgepfl.logs import setup_logging
from edgepfl.service import ServiceNotifier

REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- --set


def test_set_assigns_nested_yaml_typed_values():
    data = apply_overrides({"train": {"lr": 1}, "rounds": 3},
                           ["train.lr=0.5", "data.partition.alpha=0.1", "rounds=7", "model.weights=null",
                            "data.partition.domains=[identity, invert]"])
    assert data == {"train": {"lr": 0.5}, "rounds": 7, "model": {"weights": None},
                    "data": {"partition": {"alpha": 0.1, "domains": ["identity", "invert"]}}}


@pytest.mark.parametrize("bad, why", [("rounds", "key.path=value"), ("=3", "key.path=value"),
                                      ("train..lr=1", "key.path=value"), ("rounds.x=1", "not a section"),
                                      ("rounds=[1", "not valid YAML")])
def test_malformed_set_is_a_config_error(bad, why):
    with pytest.raises(ConfigError, match=why):
        apply_overrides({"rounds": 3}, [bad])


def test_set_is_validated_and_located(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rounds: 3\n")
    assert load_run_config(cfg, ["rounds=5", "method.name=fedprox", "method.mu=0.1"]).method_config().mu == 0.1
    with pytest.raises(ConfigError) as err:
        load_run_config(cfg, ["train.lr=-1"])
    message = str(err.value)
    assert "\n" not in message and "run.yaml" in message and "--set train.lr=-1" in message and "train.lr" in message


# ----------------------------------------------------------------------------- ConfigPath


def test_paths_in_a_yaml_resolve_against_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "agent.yaml").write_text(yaml.safe_dump({
        "agent_id": "pi-1", "state_dir": "state", "data": {"dataset": "npz", "root": "data/own.npz"},
        "security": {"signing_key": "keys/pi-1.pem", "coordinator_key": "/abs/coord.pub", "enrolled_dir": "~/enrolled"},
    }))
    monkeypatch.chdir(tmp_path)  # elsewhere than the file's folder
    config = load_agent_config("etc/agent.yaml")
    assert config.state_dir == str(folder / "state")
    assert config.data.root == str(folder / "data" / "own.npz")
    assert config.security.signing_key == str(folder / "keys" / "pi-1.pem")
    assert config.security.coordinator_key == "/abs/coord.pub"
    assert config.security.enrolled_dir == str(Path("~/enrolled").expanduser())
    # --set is typed in a shell: relative to the working directory, as given
    assert load_agent_config("etc/agent.yaml", ["state_dir=here"]).state_dir == "here"
    run = tmp_path / "run.yaml"
    run.write_text("model: {arch: resnet18, weights: w/r18.pt}\n")
    assert load_run_config(run).model.weights == str(tmp_path / "w" / "r18.pt")


def test_every_path_field_is_a_config_path():
    """Fields whose name says path are marked, so the loaders resolve them (new fields too)."""
    from edgepfl.config_docs import _hints, _models
    from edgepfl.config_loading import _is_path

    names = ("root", "weights", "dir", "key", "file", "path")
    for root in (RunConfig, AgentConfig):
        for model in _models(root, []):
            hints = _hints(model)
            for name in model.model_fields:
                if any(name == n or name.endswith("_" + n) for n in names) and "str" in str(hints[name]):
                    assert _is_path(hints[name]), f"{model.__name__}.{name} should be a ConfigPath"


# ----------------------------------------------------------------------------- logging


def test_log_level_acts_on_edgepfl_loggers_only():
    stream = io.StringIO()
    root_level = logging.getLogger().level
    try:
        setup_logging("debug", stream=stream)
        logging.getLogger("edgepfl.agent").debug("ours")
        logging.getLogger("matplotlib.font_manager").debug("theirs")
        assert "ours" in stream.getvalue() and "theirs" not in stream.getvalue()
        assert logging.getLogger().level == root_level
        with pytest.raises(ValueError, match="verbose"):
            setup_logging("verbose")
    finally:
        setup_logging("warning")


def test_json_log_lines_carry_time_level_logger_message_and_extras():
    stream = io.StringIO()
    try:
        setup_logging("info", "json", stream=stream)
        logging.getLogger("edgepfl.coordinator").info("round %d closed", 3, extra={"round": 3, "agent": "pi-1"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("edgepfl.agent").exception("failed")
    finally:
        setup_logging("warning")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "round 3 closed" and first["level"] == "info" and first["logger"] == "edgepfl.coordinator"
    assert first["round"] == 3 and first["agent"] == "pi-1" and first["time"].endswith("+00:00")
    assert second["level"] == "error" and "RuntimeError: boom" in second["exception"]


def test_every_json_line_carries_the_process_context_and_a_calls_extras_win():
    from edgepfl.logs import log_context, set_log_context

    stream = io.StringIO()
    before = log_context()
    try:
        setup_logging("info", "json", stream=stream)
        set_log_context(federation="demo", agent="pi-07", tier="head")
        logging.getLogger("edgepfl.agent").info("release installed", extra={"release": "fedavg-r3"})
        set_log_context(round=4, tier=None)
        logging.getLogger("edgepfl.agent").warning("late", extra={"agent": "pi-08"})
    finally:
        set_log_context(**{**{k: None for k in log_context()}, **before})  # as the tests before left it
        setup_logging("warning")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["federation"], first["agent"], first["tier"], first["release"]) == ("demo", "pi-07", "head",
                                                                                      "fedavg-r3")
    assert (second["round"], second["agent"], "tier" in second) == (4, "pi-08", False)


def test_json_logs_carry_python_warnings_and_other_libraries_records_as_json_too():
    """Under --log-format json nothing reaches stderr as text: a library's warnings.warn (a
    solver's ConvergenceWarning on a device) and another library's logged error are JSON lines."""
    import warnings

    stream = io.StringIO()
    try:
        setup_logging("info", "json", stream=stream)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("lbfgs failed to converge", UserWarning, stacklevel=1)
        logging.getLogger("some.library").error("it broke")
        logging.getLogger("some.library").info("chatter")  # below warning: not ours to show
    finally:
        setup_logging("warning")
    lines = stream.getvalue().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert [r["logger"] for r in records] == ["py.warnings", "some.library"], lines
    assert "lbfgs failed to converge" in records[0]["message"] and records[1]["level"] == "error"
    assert not any(getattr(h, "_edgepfl", False) for h in logging.getLogger().handlers)  # text mode again


def test_every_module_logs_under_the_edgepfl_tree():
    import importlib
    import pkgutil

    import edgepfl

    before = set(logging.root.manager.loggerDict)
    for info in pkgutil.walk_packages(edgepfl.__path__, "edgepfl."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        log = getattr(module, "log", None)
        if isinstance(log, logging.Logger):
            assert log.name.startswith("edgepfl."), f"{info.name} logs as {log.name!r}"
    ours = {n for n in set(logging.root.manager.loggerDict) - before if "edgepfl" in n}
    assert all(n.startswith("edgepfl.") or n == "edgepfl" for n in ours)


# ----------------------------------------------------------------------------- errors


def test_errors_map_to_documented_exit_codes():
    from edgepfl.data import DataError

    assert classify(ConfigError("x"))[0] == ExitCode.USAGE
    assert classify(DataError("x"))[0] == ExitCode.DATA
    assert classify(ConnectionError("x"))[0] == ExitCode.BROKER
    assert classify(MissingExtra("export", "torch", "train"))[0] == ExitCode.EXTRA
    missing = ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime")
    assert classify(missing) == (ExitCode.EXTRA, classify(missing)[1]) and "edgepfl[agent]" in classify(missing)[1]
    assert classify(KeyError("bug"))[0] == ExitCode.OTHER

    class BrokerUnreachable(ConnectionError):  # what a typed broker error looks like: still the broker's code
        def __init__(self, msg, cause):
            super().__init__(msg)
            self.cause = cause

    assert classify(BrokerUnreachable("tls handshake failed", "tls"))[0] == ExitCode.BROKER
    operating = (REPO / "docs" / "OPERATING.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} |" in operating, f"exit code {int(code)} is not documented in docs/OPERATING.md"


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_or_read_only_disk_is_one_line_saying_what_to_do_not_an_internal_error(capsys, number):
    from edgepfl.errors import report

    exc = OSError(number, os.strerror(number), "runs/x/checkpoint/.state.json.tmp")
    assert report(exc, "coordinator") == ExitCode.DATA
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "internal error" not in line
    assert f"cannot write runs/x/checkpoint/.state.json.tmp: {os.strerror(number)}" in line
    assert "free space" in line and "resumes from its last checkpoint" in line


def test_a_real_write_to_a_full_device_is_classified_as_one(capsys):
    from edgepfl.errors import report

    try:
        with open("/dev/full", "wb") as fh:  # every write: ENOSPC, as on a full disk
            fh.write(b"x")
    except OSError as exc:
        assert report(exc, "coordinator") == ExitCode.DATA
    else:
        pytest.skip("no /dev/full here")
    assert "No space left on device" in capsys.readouterr().err


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("umask, expect", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_files_get_the_umask_mode_and_secrets_0600(tmp_path, umask, expect):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "manifest.json", {"a": 1})
        write_bytes(tmp_path / "key.pem", b"secret", private=True)
        write_bytes(tmp_path / "manifest.json", b"{}")  # replacing keeps the rule
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "manifest.json").stat().st_mode) == expect
    assert stat.S_IMODE((tmp_path / "key.pem").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- packaging


def test_torch_specifier_accepts_nvidia_jetpack_builds():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    spec = {Requirement(r).name: Requirement(r).specifier for r in train}
    for jetpack in ("2.1.0a0+41361538.nv23.06", "2.3.0a0+ebedce2.nv24.02", "2.14.1", "2.1.0"):
        assert spec["torch"].contains(jetpack), jetpack
    for old in ("2.0.0+nv23.05", "2.0.1", "1.13.0"):
        assert not spec["torch"].contains(old), old
    assert spec["torchvision"].contains("0.16.0a0+fbb4cc5") and not spec["torchvision"].contains("0.15.2")


def test_both_device_extras_install_what_fitting_a_generic_head_needs():
    """docs/OPERATING.md, "Installing": ``[agent]`` runs the head tier, and ``[train]`` runs everything a
    coordinator's machine does, head agents of ``simulate --head-agents``, ``fit-head`` and the
    kit's head profile included (a head's exporter was once only in ``[agent]``, so a ``[train]``
    install exited 0 with no head-tier result)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    from edgepfl.heads import GENERIC_HEAD_KINDS, fitting_modules

    distribution = {"sklearn": "scikit-learn", "onnx": "onnx"}
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("agent", "train"):
        names = {Requirement(r).name for r in extras[extra]}
        for kind in GENERIC_HEAD_KINDS:
            missing = {distribution[m] for m in fitting_modules(kind)} - names
            assert not missing, f"[{extra}] lacks {missing} for a {kind} head"


# ----------------------------------------------------------------------------- config reference


def test_config_reference_is_generated_from_the_models(capsys):
    assert (REPO / "docs" / "CONFIG.md").read_text() == reference_markdown(), \
        "docs/CONFIG.md is out of date: run `edgepfl config > docs/CONFIG.md`"
    from edgepfl.cli import main

    assert main(["config"]) == 0  # the command the message above gives prints it
    assert capsys.readouterr().out == reference_markdown()


def test_config_reference_lists_every_field_and_method_option():
    from edgepfl.config_docs import _models
    from edgepfl.methods import available_methods, get_method

    text = reference_markdown()
    for model in _models(RunConfig, []) + _models(AgentConfig, []):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name}"
    for method in available_methods():
        assert f"### method: {method}" in text
        for option in get_method(method).config_class.model_fields:
            assert f"| `{option}` |" in text


@pytest.mark.parametrize("method", ["fedavg", "fedpac", "repper"])
def test_run_template_is_a_valid_config_of_the_defaults(method):
    data = yaml.safe_load(template_yaml("run", method=method))
    config = RunConfig.model_validate(data)
    assert config.model_dump(exclude={"method"}) == RunConfig().model_dump(exclude={"method"})
    assert config.method.name == method
    assert config.method_config() == RunConfig(method={"name": method}).method_config()


def test_agent_template_is_a_valid_config_of_the_defaults():
    data = yaml.safe_load(template_yaml("agent"))
    assert AgentConfig.model_validate(data) == AgentConfig(agent_id=data["agent_id"])


def test_json_schema_describes_the_config():
    schema = json_schema("run")
    assert schema["title"] == "edgepfl run config" and "rounds" in schema["properties"]
    assert "agent_id" in json_schema("agent")["required"]


# ----------------------------------------------------------------------------- demo data


def test_demo_uses_digits_with_a_fitting_model_where_fmnist_is_absent(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from edgepfl.cli import demo_config
    from edgepfl.data import clear_cache, fmnist_available, load_client_data
    from edgepfl.models import SplitModel

    monkeypatch.setenv("EDGEPFL_FMNIST_ROOT", str(tmp_path / "no-fmnist"))
    assert not fmnist_available()
    clear_cache()
    config = demo_config(rounds=1)
    assert config.data.dataset == "digits"
    import torch

    data = load_client_data(config.data, 0)
    model = SplitModel.build(config.model, data.input_shape, data.num_classes)
    assert model(torch.zeros(2, *data.input_shape)).shape == (2, data.num_classes)
    # every one of the demo's default 4 agents gets data
    assert all(load_client_data(config.data, i).num_train > 0 for i in range(4))
    clear_cache()


# ----------------------------------------------------------------------------- systemd


def test_notifier_sends_ready_watchdog_and_stopping_to_notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "1000000")
        n = ServiceNotifier()
        n.ready("up")
        n.watchdog()
        n.watchdog()  # not due yet: half a second between pings
        n.stopping()
        got = [sock.recv(256).decode() for _ in range(3)]
    assert got == ["READY=1\nSTATUS=up", "WATCHDOG=1", "STOPPING=1"]
    # an abstract socket, as systemd may give: "@name" is "\0name"
    name = f"edgepfl-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        ServiceNotifier().ready()
        assert sock.recv(256) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    quiet = ServiceNotifier()
    assert not quiet.active
    quiet.ready()
    quiet.watchdog()  # no socket: nothing to do, no error


def test_a_flood_of_one_warning_is_a_few_lines_and_then_a_count(caplog):
    """Per-message warnings (a rejected frame, a dropped one) go through LogLimiter: ten lines
    per reason a minute, one saying the rest are counted, then how many were left out."""
    from edgepfl.logs import LogLimiter

    now = [0.0]
    limiter = LogLimiter(logging.getLogger("edgepfl.test"), per_window=10, window_s=60, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="edgepfl.test"):
        for i in range(1000):
            limiter.warning("malformed", "dropped frame %d", i)
        limiter.warning("expired", "dropped an expired task")  # another reason has its own lines
        now[0] = 61
        limiter.warning("malformed", "dropped frame %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:10] == [f"dropped frame {i}" for i in range(10)]
    assert lines[10:] == ["more malformed warnings this minute are counted, not logged", "dropped an expired task",
                          "990 more malformed warnings were not logged", "dropped frame 1000"]
