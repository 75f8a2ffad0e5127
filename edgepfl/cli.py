"""The ``edgepfl`` command line.

    edgepfl demo                                  a small federation on the embedded defaults
    edgepfl simulate --config F --agents N        coordinator + N agents (MQTT or --in-process)
    edgepfl coordinator --config F [--broker URL] the coordinator service
    edgepfl agent --config F [--broker URL]       an edge agent (trainer or head tier)
    edgepfl export --run DIR --out DIR            frozen encoder -> ONNX + manifest
    edgepfl fit-head ... / edgepfl predict ...    offline heads for new clients
    edgepfl report --run DIR                      table + plots from a run directory
    edgepfl methods                               list registered methods
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .broker import BrokerError
from .config import ConfigError, RunConfig, load_agent_config, load_run_config, parse_config

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


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def cmd_demo(args) -> int:
    from .coordinator.simulate import simulate

    config = parse_config(RunConfig, dict(DEMO, rounds=args.rounds), "built-in demo config")
    out = Path(args.out)
    print(f"edgepfl demo: {args.agents} agents, {config.rounds} rounds of {config.method.name} over an embedded "
          f"MQTT broker; run directory {out}", file=sys.stderr)
    rows, summary = simulate(config, args.agents, out, broker=args.broker or "embedded")
    print((out / "results.txt").read_text())
    print(f"plot: {out / 'accuracy.png'}")
    return 0


def cmd_simulate(args) -> int:
    from .coordinator.simulate import simulate

    config = load_run_config(args.config)
    out = Path(args.out or f"runs/{config.federation}-{config.method.name}")
    rows, summary = simulate(config, args.agents, out, broker=args.broker or config.broker.url,
                             in_process=args.in_process, rounds=args.rounds, head_agents=args.head_agents,
                             head=args.head, fresh=not args.resume)
    print((out / "results.txt").read_text())
    return 0


def cmd_coordinator(args) -> int:
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.report import write_report
    from edgepfl.coordinator.rounds import Coordinator

    config = load_run_config(args.config)
    url = args.broker or config.broker.url
    if url == "embedded":
        raise ConfigError("the coordinator service needs a broker URL (--broker mqtt://host:1883 or broker.url)")
    shape = {}
    if config.input_shape is None or config.num_classes is None:
        from .coordinator.simulate import data_shape

        shape = data_shape(config)
    out = Path(args.out or f"runs/{config.federation}")
    fleet = MqttFleet(config.federation, config.broker, url=url)
    try:
        coordinator = Coordinator(config, fleet, out, **shape)
        coordinator.run()
    finally:
        fleet.close()
    table, _ = write_report(out, config.method.name, coordinator.head_reports or None)
    print(table)
    return 0


def cmd_agent(args) -> int:
    from edgepfl.edge_agent import run_agent

    overrides = {}
    if args.agent_id:
        overrides["agent_id"] = args.agent_id
    if args.client_index is not None:
        overrides["client_index"] = args.client_index
    config = load_agent_config(args.config, **overrides)
    if args.broker:
        config = config.model_copy(update={"broker": config.broker.model_copy(update={"url": args.broker})})
    if config.broker.url == "embedded":
        raise ConfigError("an agent needs a broker URL (--broker mqtt://host:1883 or broker.url)")
    run_agent(config)
    return 0


def cmd_report(args) -> int:
    import json

    from edgepfl.coordinator.report import write_report
    from edgepfl.state import CheckpointError, read_checkpoint_meta

    run = Path(args.run)
    try:
        meta = read_checkpoint_meta(run / "checkpoint")
    except CheckpointError:  # a run of an older edgepfl: the report does not need its checkpoint
        meta = None
    method = meta.run.method.name if meta else ""
    heads = run / "head_metrics.json"
    table, _ = write_report(run, method, json.loads(heads.read_text()) if heads.exists() else None)
    print(table)
    return 0


def cmd_export(args) -> int:
    from edgepfl.export.onnx_export import export_run

    path = export_run(args.run, args.out, quantize=args.quantize or [])
    print(f"exported to {path}")
    return 0


def cmd_methods(args) -> int:
    from .methods import available_methods, get_method

    for name in available_methods():
        cls = get_method(name)
        print(f"{name:12s} {cls.summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgepfl", description="Personalized federated learning for edge fleets over MQTT")
    p.add_argument("--log-level", default=None,
                   help="debug, info, warning, error (default: info for the agent and coordinator services, "
                        "warning otherwise)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a small federation on the embedded defaults")
    d.add_argument("--agents", type=int, default=4)
    d.add_argument("--rounds", type=int, default=DEMO["rounds"])
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--broker", default=None, help="mqtt://host:port (default: embedded broker)")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("simulate", help="coordinator + N agents on this machine")
    s.add_argument("--config", required=True)
    s.add_argument("--agents", type=int, required=True)
    s.add_argument("--rounds", type=int, default=None)
    s.add_argument("--broker", default=None, help="mqtt://host:port or 'embedded'")
    s.add_argument("--in-process", action="store_true", help="no broker: agents as objects in this process")
    s.add_argument("--head-agents", type=int, default=0, help="extra head-tier (torch-free) agents")
    s.add_argument("--head", default="lr", help="head kind for head-tier agents")
    s.add_argument("--out", default=None)
    s.add_argument("--resume", action="store_true", help="continue the run in --out instead of starting fresh")
    s.set_defaults(func=cmd_simulate)

    c = sub.add_parser("coordinator", help="run the coordinator service")
    c.add_argument("--config", required=True)
    c.add_argument("--broker", default=None)
    c.add_argument("--out", default=None)
    c.set_defaults(func=cmd_coordinator)

    a = sub.add_parser("agent", help="run an edge agent")
    a.add_argument("--config", required=True)
    a.add_argument("--broker", default=None)
    a.add_argument("--agent-id", default=None)
    a.add_argument("--client-index", type=int, default=None)
    a.set_defaults(func=cmd_agent)

    r = sub.add_parser("report", help="table and plots for a run directory")
    r.add_argument("--run", required=True)
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="export the frozen encoder of a run to ONNX")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--quantize", nargs="*", choices=["int8", "fp16"])
    e.set_defaults(func=cmd_export)

    m = sub.add_parser("methods", help="list registered methods")
    m.set_defaults(func=cmd_methods)

    for name, target in (("fit-head", "edgepfl.export.fit_head:main_fit_head"), ("predict", "edgepfl.export.predict:main_predict"),
                         ("provision", "edgepfl.provision:main_provision")):
        x = sub.add_parser(name, help=f"see 'edgepfl {name} --help'", add_help=False)
        x.set_defaults(func=None, delegate=target)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    service = args.command in ("agent", "coordinator")
    _setup_logging(args.log_level or ("info" if service else "warning"))
    try:
        if getattr(args, "delegate", None):
            import importlib

            module, func = args.delegate.split(":")
            return int(getattr(importlib.import_module(module), func)(rest) or 0)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"edgepfl: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, TimeoutError, ConnectionError, BrokerError) as exc:
        print(f"edgepfl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
