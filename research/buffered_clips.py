"""Why honest updates are clipped in buffered rounds (#52 item 1): per run, the updates the
bound clipped and the final accuracy, beside what the local training phases did.

Runs ``configs/sleepy_fleet.yaml`` in-process in buffered rounds for each method and each
``train.max_grad_norm`` given. The local phases are instrumented by wrapping the training
loop (:func:`edgepfl.methods.training.fit`) inside the method's module: per phase, the
loss of each step and the gradient norm over the parameters it trains (before any clip).
A phase *climbs* here when a step's loss is over 20 times its first step's (and over
0.01): what session 37 found behind the clipped FedRep updates (the encoder phase after a
personal head that sharpened over about a hundred tasks).

``--descent redo`` tries a stabiliser not in the product: a phase that ends with its own
training objective (the phase's loss over the device's whole training set, no gradient)
higher than it started is undone and trained again at half the learning rate, at most
three times (the fourth attempt is kept whatever it did). It costs two passes over the
data per phase besides the redone phases.

    python research/buffered_clips.py --methods fedrep fedavg --clips none 2 --states 220 \\
        --out research/results/buffered_clips
    python research/buffered_clips.py --methods fedrep fedavg --clips none --descent redo \\
        --out research/results/buffered_clips_descent
    python research/buffered_clips.py --methods fedrep --clips none --relative 10 5 \\
        --out research/results/buffered_clips_relative

``--relative K`` clips each local step's gradient to K times the median of every earlier
step's norm the same device took in the same kind of phase, across its tasks (a clip
without a model-dependent constant; session 46).

About 2.5 minutes per run on one core of a 2-core box.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgepfl.config import load_run_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.methods import training

FLEET = Path(__file__).resolve().parents[1] / "configs" / "sleepy_fleet.yaml"


def objective(model, data, loss_fn, batch_size: int = 256) -> float:
    """The phase's loss over the device's whole training set, without gradient; the model
    (its BatchNorm statistics too) is left as it was."""
    kept = copy.deepcopy(model.state_dict())
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, data.num_train, batch_size):
            x, y = data.x_train[start:start + batch_size], data.y_train[start:start + batch_size]
            if len(y) >= 2:
                total += float(loss_fn(model, x, y)) * len(y)
                count += len(y)
    model.load_state_dict(kept)
    return total / count if count else math.nan


def descending(fit, redone: list[int]):
    """``fit`` that undoes a phase whose objective rose and trains it again at half the
    learning rate (at most three times); counts the redone phases in ``redone[0]``."""
    def guarded(model, data, ctx, loss_fn, params, epochs, *, optimizer=None, **kw):
        params = list(params)
        opt = optimizer or training.make_optimizer(params, ctx)
        before = objective(model, data, loss_fn)
        model_kept, opt_kept = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        for attempt in range(4):
            mean = fit(model, data, ctx, loss_fn, params, epochs, optimizer=opt, **kw)
            if attempt == 3 or not objective(model, data, loss_fn) > before + 1e-3:
                return mean
            redone[0] += attempt == 0
            model.load_state_dict(model_kept)
            opt.load_state_dict(opt_kept)
            for group in opt.param_groups:
                group["lr"] *= 0.5 ** (attempt + 1)
        return mean
    return guarded


def device_key(data, params: list) -> tuple:
    """Which device and which kind of phase a call of ``fit`` is (in-process, the trainers
    share one process): the device's training labels and the phase's parameter count."""
    return int(data.num_train), hash(data.y_train.numpy().tobytes()), len(params)


def instrument(method: str, phases: list[dict], redone: list[int] | None = None, relative: float | None = None,
               clipped: list[int] | None = None):
    """Wrap ``fit`` where the method's phases call it (its own module, and the base class's
    default local update); each call appends its steps' losses and gradient norms to
    ``phases`` (with ``redone``, inside the descent check: every attempt is a phase; with
    ``relative``, each step's gradient is scaled down to ``relative`` times the median of
    every earlier step's norm the device took in that kind of phase, across its tasks, and
    counted in ``clipped[0]``). Returns a function that undoes it."""
    modules = [importlib.import_module(name) for name in (f"edgepfl.methods.{method}", "edgepfl.methods.base")]
    history: dict[tuple, list[float]] = {}
    clipped = clipped if clipped is not None else [0]
    originals = [(module, module.fit) for module in modules if getattr(module, "fit", None) is training.fit]

    def recorded(model, data, ctx, loss_fn, params, epochs, **kw):
        params = list(params)
        steps: dict[str, list[float]] = {"loss": [], "grad_norm": []}
        seen = history.setdefault(device_key(data, params), [])

        def loss_and_grad_norm(m, x, y):
            loss = loss_fn(m, x, y)
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            norm = math.sqrt(sum(float((g**2).sum()) for g in grads if g is not None))
            steps["grad_norm"].append(norm)
            steps["loss"].append(float(loss.detach()))
            limit = relative * float(np.median(seen[-2000:])) if relative is not None and seen else math.inf
            seen.append(norm)
            if norm > limit:  # scaling the loss scales every gradient of the phase: a norm clip
                clipped[0] += 1
                return loss * (limit / norm)
            return loss

        mean = training.fit(model, data, ctx, loss_and_grad_norm, params, epochs, **kw)
        phases.append({"params": len(params), **steps})
        return mean

    wrapped = recorded if redone is None else descending(recorded, redone)
    for module, _ in originals:
        module.fit = wrapped  # type: ignore[attr-defined]

    def undo() -> None:
        for module, original in originals:
            module.fit = original  # type: ignore[attr-defined]
    return undo


def climbs(phase: dict) -> bool:
    losses = phase["loss"]
    return bool(losses) and max(losses) > max(0.01, 20 * losses[0])


def run(method: str, clip: float | None, states: int, out: Path, descent: bool = False,
        relative: float | None = None) -> dict:
    sets = ["asynchrony.mode=buffered", f"method.name={method}"]
    if clip is not None:
        sets.append(f"train.max_grad_norm={clip}")
    config = load_run_config(FLEET, sets)
    phases: list[dict] = []
    redone = [0] if descent else None
    steps_clipped = [0]
    undo = instrument(method, phases, redone, relative, steps_clipped)
    try:
        rows, _ = simulate(config, config.data.num_clients, out / f"{method}-clip{clip}-{descent}-{relative}",
                           in_process=local_trainers,
                           rounds=states, progress=False, threads=1)
    finally:
        undo()
    training_rows = [row for row in rows if not row.final]
    final = [row for row in rows if row.final][-1]
    norms = np.concatenate([p["grad_norm"] for p in phases]) if phases else np.zeros(1)
    return {
        "method": method, "max_grad_norm": clip, "descent": "redo" if descent else "off",
        "phases_redone": redone[0] if redone else 0, "relative_clip": relative, "steps_clipped": steps_clipped[0],
        "states": len(training_rows),
        "updates": sum(len(row.participants) + len(row.late) for row in training_rows),
        "clipped": sum(len(row.clipped) for row in training_rows),
        "final_accuracy": final.accuracy,
        "phases": len(phases), "climbing_phases": sum(map(climbs, phases)),
        "grad_norm_p50_p99_max": [float(np.percentile(norms, q)) for q in (50, 99, 100)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["fedrep", "fedavg"])
    parser.add_argument("--clips", nargs="+", default=["none", "2"], help="train.max_grad_norm values; none: unset")
    parser.add_argument("--descent", nargs="+", default=["off"], choices=["off", "redo"],
                        help="redo: the descent check described above")
    parser.add_argument("--relative", nargs="+", default=["none"],
                        help="K: clip each local step's gradient to K times the median of the device's earlier steps' "
                             "norms in that kind of phase (none: off)")
    parser.add_argument("--states", type=int, default=220)
    parser.add_argument("--out", type=Path, default=Path("research/results/buffered_clips"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as runs:  # the runs' own folders are large: only the table is kept
        for method in args.methods:
            for clip in args.clips:
                for descent in args.descent:
                    for relative in args.relative:
                        value = None if clip == "none" else float(clip)
                        k = None if relative == "none" else float(relative)
                        results.append(run(method, value, args.states, Path(runs), descent == "redo", k))
                        print(json.dumps(results[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    lines = ["| method | max_grad_norm | descent check | relative clip (steps clipped) | states | updates | clipped | "
             "final accuracy | phases whose loss climbs 20x | phases redone | grad norm p50 / p99 / max (before any "
             "clip) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p50, p99, top = r["grad_norm_p50_p99_max"]
        relative = f"{r['relative_clip']:g} x median ({r['steps_clipped']})" if r.get("relative_clip") else "off"
        lines.append(f"| {r['method']} | {r['max_grad_norm'] or 'unset'} | {r['descent']} | {relative} | {r['states']} | "
                     f"{r['updates']} | {r['clipped']} | {100 * r['final_accuracy']:.2f} % | "
                     f"{r['climbing_phases']} of {r['phases']} | {r['phases_redone']} | {p50:.2f} / {p99:.2f} / {top:.1f} |")
    command = "python research/buffered_clips.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "summary.md").write_text(f"# Honest clips in buffered rounds\n\n`{command}`\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
