"""``edgepfl status``: the fleet view of a running federation, as a table or JSON.

::

    edgepfl status --broker mqtt://broker:1883 --federation demo [--json] [--agents N]
    edgepfl status --config operator/operator.yaml [--json]      (a provisioned federation)

Reads the coordinator's retained JSON view (``edgepfl/v1/<federation>/view``,
``docs/PROTOCOL.md`` §18) with a plain MQTT subscription: it needs read access to that
one topic and nothing else, and publishes nothing. ``--config`` takes the ``federation``
and ``broker:`` section (URL, TLS files, credentials) of a YAML file — the operator
bundle ``edgepfl provision`` writes, whose credentials may read the view only.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path

from edgepfl.broker import BrokerError
from edgepfl.config import ConfigError, load_yaml, parse_config, resolve_paths
from edgepfl.errors import ExitCode
from edgepfl.protocol import FederationChannel, federation_topic
from edgepfl.protocol.connection import BrokerLogin
from edgepfl.protocol.topics import TopicError
from edgepfl.protocol.view import FleetView, parse_view
from edgepfl.specs import BrokerConfig

from .subscribe import subscribe


def fetch_view(url: str, federation: str, *, timeout: float = 5.0, login: BrokerLogin | None = None) -> FleetView:
    """The retained view of ``federation``; TimeoutError when none arrives, ConnectionError when refused.

    ``login``: user name, password and TLS files (CA, client certificate) to present.
    """
    views = follow_views(url, federation, timeout=timeout, login=login)
    try:
        return next(views)
    finally:
        views.close()


def follow_views(url: str, federation: str, *, timeout: float = 5.0, login: BrokerLogin | None = None,
                 on_bad: Callable[[str], None] | None = None) -> Generator[FleetView, None, None]:
    """Every view of ``federation`` as it is published, the retained one first, over one
    subscription held while the iterator is (:meth:`close` it, or let it be collected).
    TimeoutError when no view arrives within ``timeout`` of subscribing (later, a quiet
    coordinator is waited for), ConnectionError when refused. A payload that is not a view
    raises ValueError when reached, or, with ``on_bad``, is passed over and said there
    (anyone who may publish on the topic must not end an operator's watch)."""
    topic = federation_topic(federation, FederationChannel.VIEW)
    client, got = subscribe(url, topic, login or BrokerLogin())

    def views() -> Generator[FleetView, None, None]:
        try:
            deadline: float | None = time.monotonic() + timeout
            while True:
                try:
                    item = _next_item(got, deadline)
                except queue.Empty:
                    raise TimeoutError(f"no fleet view for federation {federation!r} on {url} within {timeout:.0f}s "
                                       "(is its coordinator running, with observe.view on?)") from None
                if isinstance(item, Exception):
                    raise item
                try:
                    view = parse_view(item)
                except ValueError as exc:
                    if on_bad is None:
                        raise
                    on_bad(str(exc))
                    continue
                deadline = None  # one came: from now on the coordinator may be quiet as long as it likes
                yield view
        finally:
            client.disconnect()
            client.loop_stop()

    return views()


#: longest single wait on the queue: a signal caught on the network thread (a Ctrl-C may land on
#: any thread) is acted on by the main thread only when it next runs Python code
SIGNAL_CHECK_S = 0.25


def _next_item(got: queue.Queue[bytes | Exception], deadline: float | None) -> bytes | Exception:
    """The next item of ``got``, waited for in short slices; queue.Empty once ``deadline`` has passed."""
    while True:
        left = SIGNAL_CHECK_S if deadline is None else min(SIGNAL_CHECK_S, deadline - time.monotonic())
        try:
            return got.get(timeout=max(0.0, left))
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def _rollout(view: FleetView) -> str:
    """The last staged rollout in one line."""
    r = view.rollout
    assert r is not None
    where = f"stage {r.stage} of {len(r.stages)}, {r.reported} of {r.admitted} head agents reported"
    if r.state == "promoted":
        return f"{r.release} promoted to the whole fleet"
    if r.state == "staging":
        return f"{r.release} at {where}"
    if r.state == "held":  # passed its stages so far; waits for release promote (or halt)
        return f"{r.release} held after {where} (edgepfl release promote or halt)"
    back = f"; rolled back to {r.to_release}" if r.to_release else ""
    return f"{r.release} halted at {where}: {'; '.join(r.reasons)}{back}"


def _measured(view: FleetView) -> str | None:
    """What the rollout's last judged stage measured, in one line (None before a verdict)."""
    r = view.rollout
    if r is None or r.paired is None:
        return None
    if r.mean_change is None:
        said = "no accuracy compared (no device had a report on the release before it)"
    else:
        said = (f"held-out accuracy {100 * r.mean_change:+.1f} points on average over {r.paired} devices, "
                f"worst {100 * (r.worst_change or 0.0):+.1f}")
    if r.latency_ratio is not None:
        said += f"; encoder time {r.latency_ratio:.2f}x the release before"
    return f"stage {r.stage} measured: {said}"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min ago"
    return f"{seconds / 3600:.1f}h ago"


#: a view not republished for this many of its heartbeats is a stopped coordinator's (a running
#: one republishes every heartbeat; two leave room for one late publish): status and the
#: dashboard then show its agents as they were
STALE_HEARTBEATS = 2
#: phases that come after training: the final evaluation and done (a release may come mid-run)
FINAL_PHASES = ("evaluating", "done")


def format_view(view: FleetView, *, now: float | None = None, max_agents: int = 50) -> str:
    """The view as a terminal table: the run, then one line per agent (online first)."""
    now = time.time() if now is None else now
    acc = "-" if view.last_accuracy is None else f"{view.last_accuracy:.2%} " + (
        "(final evaluation)" if view.last_accuracy_final else f"(round {view.last_accuracy_round})")
    # the final evaluation (and what follows it) is not a round: it evaluates the last round's state
    where = (f"after the last training round ({view.rounds_completed - 1})" if view.phase in FINAL_PHASES
             else f"round {view.round}")
    # a view of a run that ended, or one its coordinator stopped republishing (killed, host down),
    # says what the agents were, not what they are
    silent = view.heartbeat_s is not None and now - view.updated > STALE_HEARTBEATS * view.heartbeat_s
    past = view.phase == "done" or silent
    lines = [
        f"federation {view.federation} — {view.method}; view updated {_ago(now - view.updated)}",
        *([f"note       {'the run is over' if view.phase == 'done' else 'the coordinator stopped updating this view'}"
           f": agent states are as of {_ago(now - view.updated)}, not now"] if past else []),
        f"phase      {view.phase}, {where} of 0..{view.rounds - 1} ({view.rounds_completed} completed)"
        + (f"; resumed after round {view.resumed_from}" if view.resumed_from is not None else ""),
        (f"updates    {view.updates} of {view.buffer_size} in the open state's buffer" if view.buffer_size
         else f"updates    {view.updates} in this round")
        + (" (staleness " + ", ".join(f"{k}: {n}" for k, n in view.staleness.items()) + ")" if view.staleness else ""),
        f"accuracy   {acc}",
        f"release    {view.release or '-'}"
        + (" (head agents on it: " + ", ".join(f"{r} {n}" for r, n in view.releases.items()) + ")"
           if view.releases else ""),
        *([f"rollout    {_rollout(view)}"] if view.rollout is not None else []),
        *([f"           {line}"] if (line := _measured(view)) is not None else []),
        "online     " + ", ".join(f"{n} {tier}" for tier, n in view.online.items()),
        "rejected   " + (", ".join(f"{reason} {n}" for reason, n in view.rejected.items()) or "none"),
        "refused    " + (", ".join(f"{reason} {n}" for reason, n in view.refused.items()) or "none"),
        "",
        f"{'agent':<24} {'tier':<8} {'state':<10} {'last seen':>12} {'samples':>8}  device",
    ]
    for a in view.agents[:max_agents]:
        clock = f"  (clock {a.clock_ahead_s:.0f} s ahead)" if a.clock_ahead_s is not None else ""
        why = clock + (f"  (refused: {a.excluded}, until it restarts)" if a.excluded else
               f"  (suspended: {a.suspended})" if a.suspended else
               f"  (missed its tasks: no task before round {a.benched_until + 1})" if a.benched_until is not None
               else "") + (f"  (did not install release {a.release_refused})" if a.release_refused else "") + \
            (f"  ({a.devices} devices, last sum round {a.last_sum})" if a.tier == "site" else "")
        state = ("was online" if past else "online") if a.online else "offline"
        lines.append(f"{a.id:<24} {a.tier:<8} {state:<10} "
                     f"{_ago(now - a.last_seen):>12} {a.num_train:>8}  {a.device}{why}")
    hidden = len(view.agents) - min(len(view.agents), max_agents) + view.agents_left_out
    if hidden:
        lines.append(f"… and {hidden} more agents (--agents N or --json)")
    return "\n".join(lines)


def read_access(path: str | Path) -> tuple[str | None, BrokerConfig]:
    """``federation`` and the ``broker:`` section of a YAML file, its paths relative to the file's folder.

    Any edgepfl config with a ``broker:`` section will do (operator.yaml, coordinator.yaml,
    agent.yaml); :class:`ConfigError` when it has none or it is invalid.
    """
    path = Path(path)
    data = load_yaml(path)
    section = data.get("broker")
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: no broker: section (give --broker, or an operator.yaml from edgepfl provision)")
    base = path.expanduser().absolute().parent
    broker = parse_config(BrokerConfig, resolve_paths(BrokerConfig, section, base), f"{path} (broker:)")
    federation = data.get("federation")
    return (str(federation) if federation is not None else None), broker


def main_status(argv: list[str]) -> int:
    """``edgepfl status``: print the fleet view; exit 1 when none came within ``--timeout``, 2 on
    bad arguments, 4 when the broker cannot be reached or refuses the login."""
    parser = argparse.ArgumentParser(prog="edgepfl status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help="a YAML file with federation: and broker: (e.g. operator/operator.yaml from "
                             "edgepfl provision): URL, TLS files and credentials")
    parser.add_argument("--broker", default=None, help="mqtt://host[:port] or mqtts://host[:port] (overrides --config)")
    parser.add_argument("--federation", default=None, help="federation name (overrides --config)")
    parser.add_argument("--json", action="store_true", help="the view as JSON (as published)")
    parser.add_argument("--agents", type=int, default=50, help="agents listed in the table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the view")
    parser.add_argument("--watch", action="store_true",
                        help="keep showing the view as the coordinator publishes it, until Ctrl-C")
    parser.add_argument("--username", default=None)
    parser.add_argument("--password", default=None)
    ns = parser.parse_args(argv)
    try:
        federation, broker = read_access(ns.config) if ns.config else (None, BrokerConfig())
        federation = ns.federation or federation
        url = ns.broker or (broker.url if ns.config else None)
        if not url or not federation:
            raise ConfigError("give --broker and --federation, or --config with federation: and broker:")
        if ns.username is not None:
            broker = broker.model_copy(update={"username": ns.username})
        if ns.password is not None:
            broker = broker.model_copy(update={"password": ns.password, "password_file": None, "password_env": None})
        login = BrokerLogin.from_config(broker)
    except (ConfigError, BrokerError, TopicError, ConnectionError) as exc:  # a bad file, URL, name or password file
        print(f"edgepfl status: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    def show(view: FleetView) -> None:
        if ns.json:
            print(json.dumps(view.model_dump(mode="json"), indent=None if ns.watch else 2), flush=True)
            return
        if ns.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")  # redraw in place on a terminal; a pipe gets one table after another
        print(format_view(view, max_agents=ns.agents) + ("\n" if ns.watch else ""), flush=True)

    try:
        if not ns.watch:
            show(fetch_view(url, federation, timeout=ns.timeout, login=login))
            return 0
        # Ctrl-C is the way out of --watch, but a process that a script starts in the background
        # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt: the watch would
        # not stop for it at all
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
        try:
            views = follow_views(url, federation, timeout=ns.timeout, login=login,
                                 on_bad=lambda why: print(f"edgepfl status: passed over a message: {why}",
                                                          file=sys.stderr))
            try:
                for view in views:
                    show(view)
            except KeyboardInterrupt:  # the way out of --watch
                return 0
            finally:
                views.close()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    except (BrokerError, TopicError) as exc:  # a bad URL or federation name
        print(f"edgepfl status: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except ConnectionError as exc:  # no broker there, or it refused us: as every command says it
        print(f"edgepfl status: {exc}", file=sys.stderr)
        return int(ExitCode.BROKER)
    except (TimeoutError, ValueError) as exc:  # the broker answered, but no coordinator published a view
        print(f"edgepfl status: {exc}", file=sys.stderr)
        return int(ExitCode.OTHER)
    return 0


__all__ = ["fetch_view", "follow_views", "format_view", "main_status", "read_access", "subscribe"]
