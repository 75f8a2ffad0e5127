"""Diagnostic for FedRIR's collapse in the benchmark: one client, no federation.

Runs FedRIR's own ``local_update`` round after round on a single client of a
benchmark setting (no averaging, so nothing federated can be the cause) and records,
per round, the stage-2 terms the method reports (CE, q's NLL, the vCLUB estimate),
the mean norm of the global features f_g on the training data, and the client's test
accuracy — once per information term (``--modes``, FedRIR's ``mi`` choices: the paper's
literal vCLUB, the conditional CLUB procedure, the authors' code; ``mi+option=value``
overrides another option too). Options otherwise come from configs/fedrir.yaml, which
clamps the bound (``mi_clamp: true``); the diagnoses recorded before it
ran unclamped, so ``vclub+mi_clamp=false`` repeats those. Writes
``--out`` (default research/results/diagnose_fedrir.json)::

    OMP_NUM_THREADS=1 python research/diagnose_fedrir.py --rounds 30 --modes vclub,code
    OMP_NUM_THREADS=1 python research/diagnose_fedrir.py --setting dir03 --rounds 20 \
        --out research/results/fedrir_mi/diagnose_dir03.json
    python research/diagnose_fedrir.py --summarize research/results/fedrir_mi/*.json   # table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "research"))

from run_methods import SETTINGS, method_block  # noqa: E402

from edgepfl.config import DataSpec, ModelSpec, TrainConfig  # noqa: E402
from edgepfl.data import load_client_data  # noqa: E402
from edgepfl.methods import LocalContext, create_method  # noqa: E402


def run(mode: str, setting: str, client: int, rounds: int, seed: int) -> list[dict]:
    s = SETTINGS[setting]
    spec = DataSpec(**{**s["data"], "num_clients": s["clients"], "seed": seed})
    raw = load_client_data(spec, client)
    data = raw.to_torch("cpu")
    # a mode is an ``mi`` choice, optionally with other options overridden: "code+keep_optimizer_state=false"
    mi, *overrides = mode.split("+")
    options = {k: v for k, v in method_block("+".join(["fedrir", *overrides]), 1).items() if k != "name"}
    method = create_method("fedrir", {**options, "mi": mi})
    torch.manual_seed(seed)
    model = method.build_model(ModelSpec(arch="cnn", feature_dim=128), raw.input_shape, raw.num_classes)
    train = TrainConfig(epochs=1, batch_size=50, lr=0.01, momentum=0.5, weight_decay=5e-4)
    out = []
    for r in range(rounds):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        ctx = LocalContext(train=train, device=torch.device("cpu"), round=r, seed=seed,
                           num_classes=data.num_classes, generator=g)
        res = method.local_update(model, data, ctx)
        ev = method.evaluate(model, data, ctx)
        model.eval()
        with torch.no_grad():
            norm = float(model.encoder(data.x_train).norm(dim=1).mean())
        row = {"round": r + 1, "test_accuracy": ev.accuracy, "f_g_norm": norm,
               **{k: res.metrics[k] for k in ("cls_ce", "q_nll", "mi_vclub", "recon_mse")}}
        out.append(row)
        print(mode, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return out


def summarize(paths: list[Path], last: int = 5) -> str:
    """A markdown table of diagnostic files: per setting, client and mode the best, final and
    mean of the last ``last`` rounds' test accuracy, and f_g's norm after rounds 1, 10, last."""
    lines = [f"| setting | client | mode | best % (round) | final % | mean % last {last} | f_g norm r1 / r10 / last "
             "| q NLL last |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for path in paths:
        d = json.loads(path.read_text())
        for mode, rows in d["modes"].items():
            acc = [r["test_accuracy"] for r in rows]
            best = max(acc)
            norms = [rows[0]["f_g_norm"], rows[min(9, len(rows) - 1)]["f_g_norm"], rows[-1]["f_g_norm"]]
            lines.append(f"| {d['setting']} | {d['client']} | {mode} | {100 * best:.1f} ({acc.index(best) + 1}) | "
                         f"{100 * acc[-1]:.1f} | {100 * sum(acc[-last:]) / len(acc[-last:]):.1f} | "
                         f"{' / '.join(f'{n:.0f}' for n in norms)} | {rows[-1]['q_nll']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", default="fedrir_pathological", choices=list(SETTINGS))
    p.add_argument("--client", type=int, default=0)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="club_conditional,vclub,code",
                   help="comma list of FedRIR's mi choices, each optionally with options overridden as in "
                        "run_methods' variants: club_conditional+keep_optimizer_state=false")
    p.add_argument("--out", default=str(REPO / "research" / "results" / "diagnose_fedrir.json"))
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="only print a markdown table of these results")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize([Path(x) for x in args.summarize]), end="")
        return 0
    torch.set_num_threads(1)
    t0 = time.monotonic()
    result = {"setting": args.setting, "client": args.client, "rounds": args.rounds, "seed": args.seed,
              "command": "OMP_NUM_THREADS=1 python research/diagnose_fedrir.py " + " ".join(argv or sys.argv[1:]),
              "modes": {mode: run(mode, args.setting, args.client, args.rounds, args.seed)
                        for mode in args.modes.split(",")}}
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
