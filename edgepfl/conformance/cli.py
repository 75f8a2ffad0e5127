"""``edgepfl conformance``: run the kit against an agent command, print the report."""

from __future__ import annotations

from pathlib import Path

from edgepfl.errors import ExitCode, OneLineParser

from .checks import PROFILES, SCENARIOS


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="edgepfl conformance", description=(
        "Play the coordinator against an agent implementation over a real Mosquitto and check the MUSTs of "
        "docs/PROTOCOL.md; exit code 0 only when every MUST check passed (1: one failed). docs/CONFORMANCE.md "
        "lists the placeholders of --agent-cmd and every check."))
    p.add_argument("--agent-cmd", required=True, metavar="TEMPLATE",
                   help="the agent's command line, with placeholders such as {broker}, {federation}, {agent_id}, "
                        "{data}, {config}, e.g. \"edgepfl agent --config {config}\"")
    p.add_argument("--head-agent-cmd", metavar="TEMPLATE",
                   help="the head agent's command line for the `head` scenario (default: --agent-cmd; the "
                        "{tier} and {head} placeholders tell one command which tier to run)")
    p.add_argument("--profile", choices=list(PROFILES), default="both",
                   help="what the implementation is certified as: a trainer (scenarios session, reconnect, "
                        "signatures), a head agent (scenario head: releases and the head agent's own presence, "
                        "reconnect and signatures; --agent-cmd is the head agent) or both (default)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--skip", action="append", default=[], choices=list(SCENARIOS),
                   help=f"leave a scenario out (repeatable): {', '.join(SCENARIOS)}")
    p.add_argument("--workdir", metavar="DIR", help="keep agents' inputs, state and logs here (default: a "
                                                    "temporary directory, removed afterwards)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, metavar="N", help="run the kit's Mosquitto on this loopback port (default: a "
                                                           "free one the OS picks)")
    where.add_argument("--broker", metavar="URL", help="use this broker (mqtt://HOST:PORT) instead of starting one; "
                                                      "the `reconnect` scenario, which restarts the broker, is then "
                                                      "reported skipped")
    p.add_argument("--answer-timeout", type=float, default=60.0, metavar="S", help="seconds per task answer")
    p.add_argument("--start-timeout", type=float, default=120.0, metavar="S",
                   help="seconds from the agent's start to its first status")
    return p


def main_conformance(argv: list[str]) -> int:
    """``edgepfl conformance ...``; returns the exit code."""
    from .kit import ExternalBroker, KitOptions, run_kit

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.broker:
        try:
            ExternalBroker(args.broker)
        except ValueError as exc:
            parser.error(str(exc))
    options = KitOptions(agent_cmd=args.agent_cmd, head_agent_cmd=args.head_agent_cmd,
                         scenarios=tuple(s for s in SCENARIOS if s not in args.skip), profile=args.profile,
                         port=args.port,
                         broker_url=args.broker,
                         workdir=Path(args.workdir).resolve() if args.workdir else None,
                         answer_timeout_s=args.answer_timeout, start_timeout_s=args.start_timeout)
    report = run_kit(options)
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.to_json() + "\n")
    return int(ExitCode.OK) if report.conformant else int(ExitCode.OTHER)
