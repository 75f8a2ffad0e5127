"""Can a rule tell a device that reverses its change from an honest non-IID one by the
direction of its updates (#52 item 2)? Per round, each device's change of the shared
parameters (learned ones; BatchNorm statistics left out) and its cosine with the mean of
the other devices' changes, over the poisoning study's fleet (FedAvg, digits, four devices,
Dirichlet 0.5, 15 rounds, ``centered_clip``; research/poisoning.py) clean, with the
reversal attacker and with the label-flip attacker, seeds 0-2. The changes are read where
the round takes each accepted update (``RoundAggregate.add``, wrapped here), before the rule.

    OMP_NUM_THREADS=1 python research/update_directions.py --seeds 0 1 2

About 10-25 s a run on one core. Writes research/results/update_directions.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import poisoning  # noqa: E402

from edgepfl.methods import base  # noqa: E402

STRATEGIES = ("none", "sign_flip", "label_flip_2^24")
FROM_ROUND = 4  # the first rounds move every device the same way: the model is far from anyone's data


class Recorder:
    """Wraps ``RoundAggregate.add``: each round's (device, change) in arrival order."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[tuple[str, np.ndarray]]] = {}
        self._add = base.RoundAggregate.add

    def __enter__(self) -> Recorder:
        recorder = self

        def add(aggregate, update, base_=None, discount=1.0):
            learned = sorted(k for k, v in aggregate.reference.items()
                             if v.dtype.kind == "f" and not k.endswith(("running_mean", "running_var")))
            change = np.concatenate([(np.asarray(update.tensors[k], np.float64)
                                      - np.asarray(aggregate.reference[k], np.float64)).ravel() for k in learned])
            recorder.rounds.setdefault(id(aggregate), []).append((update.agent_id, change))
            return recorder._add(aggregate, update, base_, discount)

        base.RoundAggregate.add = add  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        base.RoundAggregate.add = self._add  # type: ignore[method-assign]

    def cosines(self) -> dict[str, list[float]]:
        """Per device, per round: the cosine of its change with the mean of the others'."""
        out: dict[str, list[float]] = {}
        for updates in self.rounds.values():
            for agent, change in updates:
                others = np.mean([c for a, c in updates if a != agent], axis=0)
                denominator = float(np.linalg.norm(change) * np.linalg.norm(others)) or 1.0
                out.setdefault(agent, []).append(round(float(change @ others) / denominator, 3))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="research/results/update_directions")
    ns = parser.parse_args(argv)
    runs = []
    for seed in ns.seeds:
        for strategy in STRATEGIES:
            with Recorder() as recorder, tempfile.TemporaryDirectory() as tmp:
                record = poisoning.run_one("digits", "centered_clip", strategy, 15, seed, Path(tmp))
            cos = recorder.cosines()
            runs.append({"seed": seed, "strategy": strategy, "honest_accuracy": record.get("honest_accuracy"),
                         "cosines": cos})
            late = {a: float(np.median(c[FROM_ROUND:])) for a, c in cos.items()}
            print(f"seed {seed} {strategy:16s} " + " ".join(f"{a}: {v:+.2f}" for a, v in sorted(late.items())),
                  flush=True)
    lines = ["# Update directions: a reversing device against honest non-IID ones", "",
             f"`python research/update_directions.py --seeds {' '.join(map(str, ns.seeds))}`", "",
             f"FedAvg, digits, 4 devices (Dirichlet 0.5), 15 rounds, `centered_clip`; agent-00 is the attacker "
             f"(none: it is honest). Median over rounds {FROM_ROUND}-14 of each device's cosine with the mean of "
             f"the others' changes [min, max]:", "",
             "| seed | strategy | agent-00 | agent-01 | agent-02 | agent-03 | honest acc. % |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        cells = []
        for agent in ("agent-00", "agent-01", "agent-02", "agent-03"):
            c = run["cosines"].get(agent, [])[FROM_ROUND:]
            cells.append(f"{np.median(c):+.2f} [{min(c):+.2f}, {max(c):+.2f}]" if c else "—")
        acc = run["honest_accuracy"]
        lines.append(f"| {run['seed']} | {run['strategy']} | " + " | ".join(cells)
                     + f" | {'—' if acc is None else f'{100 * acc:.1f}'} |")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
