"""The ``edgepfl`` command line (also ``python -m edgepfl``).

    edgepfl demo                                  a small federation on the embedded defaults
    edgepfl simulate --config F [--agents N]      coordinator + N agents (MQTT or --in-process)
    edgepfl coordinator --config F [--broker URL] the coordinator service
    edgepfl agent --config F [--broker URL]       an edge agent (trainer or head tier)
    edgepfl export --run DIR --out DIR            frozen encoder -> ONNX + manifest
    edgepfl fit-head ... / edgepfl predict ...    offline heads for new clients
    edgepfl serve --state DIR [--watch FOLDER]    a device's model, kept loaded, following its releases
    edgepfl report --run DIR                      table + plots from a run directory
    edgepfl status --broker URL --federation F    live view of a running federation (--json)
    edgepfl conformance --agent-cmd "CMD"         check an agent implementation against the protocol
    edgepfl methods                               list registered methods
    edgepfl config --template|--schema [run|agent] a commented config, or its JSON Schema

Every command takes ``--log-level``, ``--log-format`` and ``--debug`` before or after its
name; commands that read a config take ``--set key.path=value``. Errors are one line
and an exit code (:mod:`edgepfl.errors`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .errors import ExitCode, InputError, OneLineParser, UsageError, report, require, require_installed
from .logs import FORMATS, LEVELS, setup_logging

if TYPE_CHECKING:
    from .config import RunConfig

# No pydantic plugins are used here: without this, building the first model scans the entry
# points of every installed distribution (about 30 ms of a head agent's start on a full venv).
# A user's own setting wins. (Nothing imported above builds a model yet.)
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

# The configs and specs (and with them numpy, the methods and the protocol's models) are imported by
# the commands that read one: `edgepfl predict` needs none of it, and an import that fails
# for lack of memory then happens inside main(), which reports it as such (exit code 6).

DEMO = {
    "federation": "demo",
    "method": {"name": "fedper"},
    "model": {"arch": "cnn", "feature_dim": 128},
    "train": {"epochs": 1, "batch_size": 50, "lr": 0.05, "momentum": 0.5},
    "data": {"dataset": "auto", "samples_per_client": 500, "partition": {"kind": "dirichlet", "alpha": 0.3}},
    "rounds": 5,
    "fraction": 1.0,
    "quorum": 0.5,
    "round_timeout_s": 120,
}

#: the demo where Fashion-MNIST is absent: scikit-learn's 8x8 digits (always present with
#: the package's extras) with a model that fits them — the CNN needs 28x28 inputs
DEMO_DIGITS_CHANGES = {
    "model": {"arch": "mlp", "feature_dim": 64},
    "data": {"dataset": "digits", "samples_per_client": None, "partition": {"kind": "dirichlet", "alpha": 0.3}},
}

#: subcommands that live in other modules: (name, "module:function(argv) -> int", help)
DELEGATES = (
    ("fit-head", "edgepfl.export.fit_head:main_fit_head", "fit a personal head on an exported encoder"),
    ("predict", "edgepfl.export.predict:main_predict", "predict with an exported encoder and a head"),
    ("serve", "edgepfl.edge_agent.serve:main_serve",
     "answer images with a head agent's installed model, following its releases"),
    ("status", "edgepfl.coordinator.ops.status:main_status", "live view of a running federation"),
    ("dashboard", "edgepfl.coordinator.ops.dashboard:main_dashboard", "the live fleet view as a web page"),
    ("provision", "edgepfl.provision:main_provision", "CA, broker config and ACL, per-agent bundles and keys"),
    ("aggregator", "edgepfl.coordinator.site_aggregator:main_aggregator",
     "a site aggregator between a site's devices and the central coordinator"),
    ("conformance", "edgepfl.conformance.cli:main_conformance",
     "check an agent implementation against docs/PROTOCOL.md over a real broker"),
)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks stop child processes."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def _count(text: str) -> int:
    return _whole(text, 0)


def demo_config(rounds: int) -> RunConfig:
    """The demo's run config: Fashion-MNIST with the CNN where it is installed, else digits with an MLP."""
    from .config import RunConfig, parse_config
    from .data import fmnist_available

    data: dict[str, Any] = dict(DEMO, rounds=rounds)
    if not fmnist_available():
        data.update(DEMO_DIGITS_CHANGES)
    return parse_config(RunConfig, data, "built-in demo config")


def cmd_demo(args) -> int:
    require("torch", "edgepfl demo")
    from .coordinator.simulate import simulate
    from .specs import EMBEDDED_BROKER

    config = demo_config(args.rounds)
    out = Path(args.out)
    from .data import resolve_kind

    # the data set the demo runs on ("auto" is a setting, not an answer: Fashion-MNIST when installed)
    print(f"edgepfl demo: {args.agents} agents, {config.rounds} rounds of {config.method.name} on "
          f"{resolve_kind(config.data)} ({config.model.arch}) over {'an embedded' if not args.broker else 'the'} "
          f"MQTT broker; run directory {out}", file=sys.stderr)
    simulate(config, args.agents, out, broker=args.broker or EMBEDDED_BROKER)
    print((out / "results.txt").read_text())
    print(f"plot: {out / 'accuracy.png'}")
    return 0


def _require_release_tools(config: RunConfig, head_agents: int = 0, head: str = "lr") -> None:
    if config.release_every or config.release_at_end or head_agents:
        for module in ("onnx", "onnxruntime"):
            require(module, "publishing encoder releases (release_every / release_at_end / --head-agents)")
    if head_agents:
        _require_head_fitting(head, "--head-agents")


def _require_head_fitting(head: str, what: str) -> None:
    """Before any work: what fitting a ``head`` kind on a device needs, named with its extra."""
    from .heads import fitting_modules

    for module in fitting_modules(head):
        require_installed(module, f"{what} fitting a {head!r} head")


def cmd_simulate(args) -> int:
    require_installed("torch", "edgepfl simulate")  # found, not imported: a bad config is said before torch loads
    from .config import AgentConfig, load_run_config, parse_config
    from .coordinator.simulate import simulate

    config = load_run_config(args.config, args.set)
    agents = args.agents
    if agents is None:
        if "num_clients" not in config.data.model_fields_set:
            raise UsageError(f"how many agents? give --agents N, or set data.num_clients in {args.config}")
        agents = config.data.num_clients - args.head_agents
        if agents < 1:
            raise UsageError(f"data.num_clients ({config.data.num_clients}) leaves no trainer agents beside "
                             f"--head-agents {args.head_agents}; raise data.num_clients or give --agents")
    if args.in_process and args.head_agents:
        raise UsageError("--in-process cannot run --head-agents: head agents are separate, torch-free processes "
                         "that need a broker")
    if args.head_agents:
        parse_config(AgentConfig, {"agent_id": "check", "tier": "head", "head": args.head}, "--head")
        from .methods import get_method

        kinds = get_method(config.method.name).head_kinds
        if args.head not in kinds:  # before any training: the head agents would refuse every release
            raise UsageError(f"--head {args.head}: a {config.method.name} release has no such head; "
                             f"choose from {', '.join(kinds)}")
    _require_release_tools(config, args.head_agents, args.head)
    out = Path(args.out or f"runs/{config.federation}-{config.method.name}")
    from edgepfl.edge_agent.tiers import local_trainers

    simulate(config, agents, out, broker=args.broker or config.broker.url,
             in_process=local_trainers if args.in_process else None,
             rounds=args.rounds, head_agents=args.head_agents, head=args.head, fresh=not args.resume)
    print((out / "results.txt").read_text())
    return 0


def cmd_coordinator(args) -> int:
    require_installed("torch", "edgepfl coordinator")  # found, not imported: a bad config is said first
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.ops.report import write_report
    from edgepfl.coordinator.rounds import Coordinator

    from .config import ConfigError, load_run_config
    from .service import notifier
    from .specs import EMBEDDED_BROKER

    config = load_run_config(args.config, args.set)
    url = args.broker or config.broker.url
    if url == EMBEDDED_BROKER:
        raise ConfigError("the coordinator service needs a broker URL (--broker mqtt://host:1883 or broker.url)")
    _require_release_tools(config)
    from .coordinator.simulate import service_data_shape

    shape = service_data_shape(config)
    out = Path(args.out or f"runs/{config.federation}")
    fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
    notifier().ready(f"coordinator of {config.federation} connected to {url}")
    try:
        coordinator = Coordinator(config, fleet, out, **shape)
        coordinator.run()
    finally:
        notifier().stopping()
        fleet.close()
    table, _ = write_report(out, config.method.name)
    print(table)
    return 0


def cmd_runs(args) -> int:
    from edgepfl.coordinator.ops import runs

    if args.follow:
        return runs.follow_run(Path(args.follow), out=lambda line: print(line, flush=True))
    print(runs.list_runs(Path(args.dir)))
    return 0


def cmd_release(args) -> int:
    from edgepfl.coordinator.releases import command as release_command

    if args.action == "status":
        if not args.run:
            raise UsageError("edgepfl release status needs --run DIR (the run directory)")
        return release_command.status(Path(args.run), args.json)
    if not args.config:
        raise UsageError(f"edgepfl release {args.action} needs --config (the run's config: broker, keys, rollout)")
    from .config import ConfigError, load_run_config
    from .specs import EMBEDDED_BROKER

    config = load_run_config(args.config, args.set)
    url = args.broker or config.broker.url
    if url == EMBEDDED_BROKER:
        raise ConfigError("edgepfl release needs the federation's broker URL (--broker mqtt://host:1883 or broker.url)")
    if args.stages:
        config = config.model_copy(update={"rollout": config.rollout.model_validate(
            {**config.rollout.model_dump(), "stages": args.stages})})
    run = Path(args.run or f"runs/{config.federation}")
    if args.action == "rollback":
        return release_command.rollback(config, run, url, args.heads, args.wait)
    if args.action == "halt":
        return release_command.halt(config, run, url, args.heads, args.wait)
    if args.action == "promote":
        return release_command.promote(config, run, url, args.heads, args.wait, args.hold)
    require_installed("torch", "edgepfl release publish")
    return release_command.publish(config, run, url, Path(args.export) if args.export else None, args.heads,
                                   args.wait, args.hold)


def _stages(text: str) -> list[float]:
    """``0.05,0.25,1`` -> [0.05, 0.25, 1.0]."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of shares (e.g. 0.05,0.25,1)") from None


def cmd_agent(args) -> int:
    from edgepfl.edge_agent import run_agent

    from .agent_config import load_agent_config
    from .config_loading import ConfigError

    overrides: dict[str, Any] = {}
    if args.agent_id:
        overrides["agent_id"] = args.agent_id
    if args.client_index is not None:
        overrides["client_index"] = args.client_index
    config = load_agent_config(args.config, args.set, **overrides)
    if args.broker:
        config = config.model_copy(update={"broker": config.broker.model_copy(update={"url": args.broker})})
    if config.broker.embedded:
        raise ConfigError("an agent needs a broker URL (--broker mqtt://host:1883 or broker.url)")
    if config.tier == "trainer":
        require("torch", "a trainer-tier agent")
    else:
        require("onnxruntime", "a head-tier agent")
        _require_head_fitting(config.head, "a head-tier agent")
    if args.reset_state:
        from edgepfl.edge_agent.agent import reset_state

        reset_state(config.state_dir)
    run_agent(config)
    return 0


def _accuracy(text: str) -> float:
    """An accuracy argument: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an accuracy between 0 and 1 (e.g. 0.85)")
    return value


def cmd_report(args) -> int:
    from edgepfl.coordinator.ops.report import write_report
    from edgepfl.state import CheckpointError, read_checkpoint_meta

    run = Path(args.run)
    if not (run / "metrics.jsonl").is_file():
        raise UsageError(f"{run} is not a run directory (no metrics.jsonl): give the --out of a "
                         f"simulate / coordinator run")
    try:
        meta = read_checkpoint_meta(run / "checkpoint")
    except CheckpointError:  # a run of an older edgepfl: the report does not need its checkpoint
        meta = None
    method = meta.run.method.name if meta else ""
    table, _ = write_report(run, method, args.target)
    print(table)
    return 0


def cmd_export(args) -> int:
    for module in ("torch", "onnx", "onnxruntime"):
        require(module, "edgepfl export")
    from .state import read_checkpoint_meta

    run = Path(args.run)
    if read_checkpoint_meta(run / "checkpoint" if (run / "checkpoint").is_dir() else run) is None:
        raise InputError(f"no checkpoint in {run} (expected checkpoint/state.json): is it a run directory?")

    def progress(step: str) -> None:  # seconds to minutes on a busy machine: each step is said as it begins
        print(f"export: {step}", flush=True)

    progress("loading torch")
    from edgepfl.export.onnx_export import export_run

    path = export_run(args.run, args.out, quantize=args.quantize or [], progress=progress)
    print(f"exported to {path}")
    return 0


def cmd_methods(args) -> int:
    from .methods import available_methods, get_method

    for name in available_methods():
        try:
            summary = get_method(name).summary
        except KeyError as exc:  # a plugin that cannot load is listed with why, the others still are
            summary = f"(cannot load: {exc.args[0]})"
        print(f"{name:12s} {summary}")
    return 0


def cmd_privacy(args) -> int:
    """The noise multiplier that keeps a run of this size within ε (client-level DP, central or
    distributed: the same noise on the round's sum)."""
    require("dp_accounting", "edgepfl privacy")
    from .coordinator.sampling import sample_size
    from .privacy import PrivacyAccountant, PrivacySpec, noise_multiplier_for

    sampled = sample_size(args.fraction, args.devices)
    poisson = args.sampling == "poisson"
    try:
        multiplier = noise_multiplier_for(args.epsilon, args.rounds, args.devices, sampled, args.delta,
                                          sampling=args.sampling)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    spec = PrivacySpec(mechanism="central", noise_multiplier=multiplier, delta=args.delta, sampling=args.sampling)
    event = (args.devices, sampled, sampled / args.devices) if poisson else (args.devices, sampled)
    spent = PrivacyAccountant(spec, [event] * args.rounds).epsilon()
    drawn = f"each of {args.devices} devices with probability {sampled / args.devices:.4g}" if poisson else \
        f"{sampled} of {args.devices} devices"
    print(f"noise_multiplier: {multiplier:.4g}   # {args.rounds} rounds of {drawn}: "
          f"epsilon {spent:.3f} at delta {args.delta:g}" + ("   (privacy.sampling: poisson)" if poisson else ""))
    if poisson:
        print(f"# noise on the round's mean: {multiplier:.4g} x clip_norm / {sampled} (the expected count) per "
              "coordinate; central only")
    else:
        print(f"# noise on the round's mean: {multiplier:.4g} x clip_norm / {sampled} per coordinate (distributed: "
              f"each device adds {multiplier:.4g} x clip_norm / sqrt(the round's quorum))")
    return 0


def cmd_config(args) -> int:
    import json

    from . import config_docs

    if args.method and not args.template:
        raise UsageError("--method picks the method of a --template; the reference and the schema cover every method")
    if args.template:
        try:
            text = config_docs.template_yaml(args.template, method=args.method or "fedavg")
        except KeyError as exc:  # the registry's "unknown method …; available: …"
            raise UsageError(str(exc.args[0])) from None
        print(text, end="")
    elif args.schema:
        print(json.dumps(config_docs.json_schema(args.schema), indent=2))
    else:
        print(config_docs.reference_markdown(), end="")
    return 0


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """Options every command takes; on subcommands they default to 'not given' so the top level's value stands."""
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=default(None), metavar="LEVEL",
                        help=f"{', '.join(LEVELS)} (default: info for the agent and coordinator services, warning "
                             "otherwise); acts on edgepfl's own loggers only")
    parser.add_argument("--log-format", choices=FORMATS, default=default("text"),
                        help="text, or json: one JSON object per line (time, level, logger, message, extras)")
    parser.add_argument("--debug", action="store_true", default=default(False),
                        help="show the traceback of an error (also EDGEPFL_DEBUG=1)")


def _with_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a config field, YAML-typed (repeatable), e.g. --set train.lr=0.05 "
                             "--set data.partition.alpha=0.1")


def build_parser() -> argparse.ArgumentParser:
    """The ``edgepfl`` argument parser (errors are one line; see :class:`edgepfl.errors.OneLineParser`)."""
    p = OneLineParser(prog="edgepfl", description="Personalized federated learning for edge fleets over MQTT",
                      allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"edgepfl {__version__}")
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, allow_abbrev=False, **kw)
        _common(parser, suppress=True)
        return parser

    d = command("demo", "run a small federation on the embedded defaults")
    d.add_argument("--agents", type=_positive, default=4)
    d.add_argument("--rounds", type=_positive, default=DEMO["rounds"])
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--broker", default=None, help="mqtt://host:port (default: embedded broker)")
    d.set_defaults(func=cmd_demo)

    s = command("simulate", "coordinator + N agents on this machine")
    s.add_argument("--config", required=True)
    s.add_argument("--agents", type=_positive, default=None,
                   help="trainer agents (default: data.num_clients of the config, less --head-agents)")
    s.add_argument("--rounds", type=_positive, default=None)
    s.add_argument("--broker", default=None, help="mqtt://host:port or 'embedded'")
    s.add_argument("--in-process", action="store_true", help="no broker: agents as objects in this process")
    s.add_argument("--head-agents", type=_count, default=0, help="extra head-tier (torch-free) agents")
    s.add_argument("--head", default="lr", help="head kind for head-tier agents")
    s.add_argument("--out", default=None)
    s.add_argument("--resume", action="store_true", help="continue the run in --out instead of starting fresh")
    _with_set(s)
    s.set_defaults(func=cmd_simulate)

    c = command("coordinator", "run the coordinator service")
    c.add_argument("--config", required=True)
    c.add_argument("--broker", default=None)
    c.add_argument("--out", default=None)
    _with_set(c)
    c.set_defaults(func=cmd_coordinator)

    a = command("agent", "run an edge agent")
    a.add_argument("--config", required=True)
    a.add_argument("--broker", default=None)
    a.add_argument("--agent-id", default=None)
    a.add_argument("--client-index", type=_count, default=None)
    _with_set(a)
    a.add_argument("--reset-state", action="store_true",
                   help="delete the agent's saved state (personal models, task order, installed release) first")
    a.set_defaults(func=cmd_agent)

    ru = command("runs", "the runs in a folder, or one run's rounds as they come (--follow)")
    ru.add_argument("--dir", default="runs", help="the folder of run directories (default: runs)")
    ru.add_argument("--follow", default=None, metavar="RUN", help="a run directory: print its metrics rows as the "
                                                                "coordinator writes them, until the run ends")
    ru.set_defaults(func=cmd_runs)

    rel = command("release", "publish a run's encoder by stages, promote or halt a held one, roll back, show a "
                             "rollout")
    rel.add_argument("action", choices=["publish", "promote", "halt", "rollback", "status"])
    rel.add_argument("--config", default=None, help="the run's config (publish, rollback): federation, broker, keys, "
                                                   "rollout")
    rel.add_argument("--run", default=None, help="the run directory (default: runs/<federation>)")
    rel.add_argument("--export", default=None, help="publish: an exported encoder directory instead of the checkpoint")
    rel.add_argument("--broker", default=None)
    rel.add_argument("--stages", type=_stages, default=None, help="publish: override rollout.stages, e.g. 0.1,0.5,1")
    rel.add_argument("--heads", type=_count, default=0, help="head agents to wait for before the first stage")
    rel.add_argument("--wait", type=float, default=60.0, help="seconds to wait for --heads head agents")
    rel.add_argument("--hold", action="store_true", help="publish, promote: stop after the next stage that passes "
                                                        "(promote goes on, halt rolls it back)")
    rel.add_argument("--json", action="store_true", help="status: the record as JSON")
    _with_set(rel)
    rel.set_defaults(func=cmd_release)

    r = command("report", "table and plots for a run directory")
    r.add_argument("--run", required=True)
    r.add_argument("--target", type=_accuracy, action="append", default=[], metavar="ACC",
                   help="an accuracy (0-1) to give the bytes sent before it was reached; repeat for several "
                        "(default: 90, 95 and 99 %% of the run's best)")
    r.set_defaults(func=cmd_report)

    e = command("export", "export the frozen encoder of a run to ONNX")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--quantize", nargs="*", choices=["int8", "fp16"])
    e.set_defaults(func=cmd_export)

    m = command("methods", "list registered methods")
    m.set_defaults(func=cmd_methods)

    pv = command("privacy", "the noise multiplier that keeps a run within a privacy budget (privacy.mechanism central "
                            "or distributed)")
    pv.add_argument("--epsilon", type=float, required=True, help="the budget: epsilon at --delta over the whole run")
    pv.add_argument("--rounds", type=int, required=True, help="training rounds the run will have")
    pv.add_argument("--devices", type=int, required=True, help="trainer devices a round samples from")
    pv.add_argument("--fraction", type=float, default=1.0, help="the run's fraction: share of them sampled per round")
    pv.add_argument("--delta", type=float, default=1e-5, help="delta (below 1 / devices)")
    pv.add_argument("--sampling", choices=("fixed", "poisson"), default="fixed",
                    help="privacy.sampling: fixed-size rounds (replace-one) or Poisson ones (add-or-remove, central)")
    pv.set_defaults(func=cmd_privacy)

    g = command("config", "config reference (docs/CONFIG.md), a commented template, or the JSON Schema")
    what = g.add_mutually_exclusive_group()
    what.add_argument("--template", choices=["run", "agent"], help="a commented YAML config with every default")
    what.add_argument("--schema", choices=["run", "agent"], help="the config's JSON Schema")
    g.add_argument("--method", default=None, help="--template run: whose method options to list (default: fedavg)")
    g.set_defaults(func=cmd_config)

    for name, target, help_text in DELEGATES:
        x = command(name, f"{help_text} (see 'edgepfl {name} --help')", add_help=False)
        x.set_defaults(func=None, delegate=target)
    return p


def _signals(command: str) -> Any:
    """The SIGTERM handler to restore: the agent installs its own (it says goodbye on the
    broker); every other command turns SIGTERM into an exception, so that ``finally``
    blocks close the fleet and stop the agent processes ``simulate`` started."""
    if command == "agent" or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def main(argv: list[str] | None = None) -> int:
    """Run the ``edgepfl`` command; returns its exit code (:class:`edgepfl.errors.ExitCode`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed as one line
        return int(exc.code or 0) if isinstance(exc.code, int) else int(ExitCode.USAGE)
    debug = bool(args.debug or os.environ.get("EDGEPFL_DEBUG", "").lower() in ("1", "true", "yes"))
    service = args.command in ("agent", "coordinator", "serve")
    setup_logging(args.log_level or ("info" if service else "warning"), args.log_format)
    previous = _signals(args.command)
    try:
        if getattr(args, "delegate", None):
            import importlib

            module, func = args.delegate.split(":")
            return int(getattr(importlib.import_module(module), func)(rest) or 0)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(args.func(args) or 0)
    except SystemExit as exc:  # argparse inside a delegate; its line is printed
        return exc.code if isinstance(exc.code, int) else int(ExitCode.USAGE)
    except KeyboardInterrupt:
        print("edgepfl: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except Terminated:
        print("edgepfl: terminated (SIGTERM)", file=sys.stderr)
        return int(ExitCode.TERMINATED)
    except Exception as exc:
        return report(exc, args.command, debug)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
