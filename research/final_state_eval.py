"""Paired evaluations on the saved state of a benchmark run: one training, several readings.

``bn_recalibrate`` and RepPer's stage-2 head rule change only how a client
is evaluated, never what it trains (the personal BatchNorm statistics and the heads
are used by no training step), so the same run state can be read both ways:

* ``dualfed``: every client's model — the checkpoint's global tensors plus the agent's
  saved personal state, the state the agent would evaluate next — scored on its test
  split with the stored personal BatchNorm statistics (what the authors' code
  evaluates) and with statistics re-estimated on its training images (``bn_recalibrate``),
  each as the logit-sum ensemble, as each classifier alone (``h_p`` on u, ``h_s`` on z) and
  as the average of their softmaxes (``ensemble: softmax``),
  beside the majority-class floor;
* ``fedrir``: the same two readings of the GFE's personal BatchNorm statistics (stored,
  or re-estimated on the training images: ``bn_recalibrate``) for FedRIR's head on
  [f_g, f_cs];
* ``fedbn``, ``fedpick`` (``bn_policy = "local"``: every BatchNorm parameter and
  statistic personal, evaluated under freshly aggregated convolutions, as DualFed's):
  the same two readings (``bn_recalibrate``: the encoder's statistics re-estimated),
  and for FedPick each classifier of its ensemble alone (``C_g`` on v, ``C_p`` on m*v)
  and the average of their softmaxes (``ensemble: softmax``);
* ``fedavg``, ``fedavg_ft``: the checkpoint's global model three ways, FedPAC's two
  readings of its FedAvg-FT row (docs/METHODS.md): as received (what FedAvg reports),
  after the classifier alone was fine-tuned for ``FT_EPOCHS`` on a copy (``fedavg_ft``,
  the code's ``local_fine_tuning``), and after the run's own local epochs on a copy (the
  code's ``acc2``: FedAvg's model after local training), each copy's batch order seeded
  per client;
* ``repper``: the checkpoint's encoder; on its features of every client's training
  split, heads fitted by several rules (C fixed or chosen by cross-validation, raw or
  L2-normalized features) and scored on the test split.

Accuracy is the sample-weighted mean over clients, as the federation reports it;
``per_client`` keeps each client's accuracy under every reading, for paired comparisons.
For a method with personal BN statistics (DualFed, FedRIR, FedBN, FedPick) only clients
whose saved personal state belongs to the checkpoint's round are used (RepPer's heads
are fitted afresh)::

    OMP_NUM_THREADS=1 python research/final_state_eval.py --run runs/bench/<tag>/<setting>__<method> \\
        --out research/results/<tag>/<setting>__<method>__paired.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edgepfl.atomic import read_tensors  # noqa: E402
from edgepfl.config import RunConfig, parse_config  # noqa: E402
from edgepfl.data import load_client_data  # noqa: E402
from edgepfl.methods import create_method  # noqa: E402
from edgepfl.methods.base import EvalResult, LocalContext, load_tensors  # noqa: E402
from edgepfl.methods.ensemble import ensemble_logits  # noqa: E402
from edgepfl.state import load_checkpoint  # noqa: E402

#: RepPer head rules read on one encoder: (label, make_head parameters)
HEAD_RULES = [
    ("lr C=1 l2 (the old default)", {"C": 1.0, "normalize": True}),
    ("lr C=1 raw", {"C": 1.0, "normalize": False}),
    ("lr C=100 l2", {"C": 100.0, "normalize": True}),
    ("lr C by 3-fold CV, l2 (default)", {"C": None, "normalize": True}),
    ("lr C by 3-fold CV, raw", {"C": None, "normalize": False}),
]


#: classifier fine-tuning epochs of the ``fedavg`` reading: the length of FedPAC's code's
#: ``local_fine_tuning`` (its ``local_epoch``, 5 in Table 1's runs)
FT_EPOCHS = 5


def _fedavg_readings(config: RunConfig, model, data, index: int) -> dict[str, EvalResult]:
    """FedAvg's global model as received, after ``FT_EPOCHS`` of classifier fine-tuning,
    and after the run's local epochs: each on its own copy, from the same batch order."""
    fedavg = create_method("fedavg")
    readings = {"global model (FedAvg)": fedavg.evaluate(model, data, _context(config, data, index))}
    tuner = create_method("fedavg_ft", {"ft_epochs": FT_EPOCHS})
    readings[f"classifier fine-tuned {FT_EPOCHS} epochs (FedAvg-FT)"] = tuner.evaluate(
        copy.deepcopy(model), data, _context(config, data, index))
    trained = copy.deepcopy(model)
    fedavg.local_update(trained, data, _context(config, data, index))
    readings[f"after {config.train.epochs} local epochs (acc2)"] = fedavg.evaluate(
        trained, data, _context(config, data, index))
    return readings


def _context(config: RunConfig, data, index: int) -> LocalContext:
    """A local context whose batch order depends on the run's seed and the client only."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    return LocalContext(train=config.train, device="cpu", round=0, seed=config.seed,
                        num_classes=data.num_classes, generator=generator)


def _stored_then_recalibrated(method, model, data):
    """Yield "stored" with the model as saved, then "recalibrated" after its personal
    BatchNorm statistics were re-estimated on the training images by the method's own
    rule (``Method.recalibrate``, what ``bn_recalibrate`` does before an evaluation);
    the model is in eval mode at each."""
    for stats in ("stored", "recalibrated"):
        if stats == "recalibrated":
            method.recalibrate(model, data)
        model.eval()
        yield stats


def evaluate_run(run_dir: Path) -> dict:
    config = parse_config(RunConfig, yaml.safe_load((run_dir / "config.yaml").read_text()), str(run_dir))
    loaded = load_checkpoint(run_dir / "checkpoint")
    if loaded is None:
        raise SystemExit(f"{run_dir}: no checkpoint")
    state, meta = loaded
    method = create_method(config.method.name, config.method.options())
    correct: dict[str, int] = {}
    per_client: dict[str, dict[str, float]] = {}
    total, clients = 0, []

    def score(label: str, client: str, pred: np.ndarray, y: np.ndarray) -> None:
        """One reading of one client: its accuracy, and its correct answers in the pooled count."""
        n_correct = int((pred == y).sum())
        correct[label] = correct.get(label, 0) + n_correct
        per_client.setdefault(label, {})[client] = n_correct / len(y)

    chosen_C: dict[str, list[float]] = {}
    for agent_dir in sorted((run_dir / "agents").iterdir()):
        index = int(agent_dir.name.rsplit("-", 1)[1])
        records = sorted(agent_dir.glob("personal-*.json"))  # one run, one signature
        record = json.loads(records[0].read_text())
        if method.bn_policy != "shared" and record["round"] != meta.round:
            # personal BN statistics trained past the checkpoint belong to another global model
            continue
        data = load_client_data(config.data, index).to_torch("cpu")
        torch.manual_seed(0)
        model = method.build_model(config.model, data.x_train.shape[1:], data.num_classes)
        load_tensors(model, read_tensors(records[0].with_suffix(".safetensors")))
        load_tensors(model, state.global_tensors)
        y = data.y_test.numpy()
        client = agent_dir.name
        clients.append(client)
        total += len(y)
        if method.name == "dualfed":
            for stats in _stored_then_recalibrated(method, model, data):
                with torch.no_grad():
                    _, personal, global_ = model.head.parts(model.encoder(data.x_test))
                # the configured ensemble, the other form, and each classifier alone: which carries the client
                for part, logits in (("ensemble", model.head.combine(personal, global_)), ("h_p only", personal),
                                     ("h_s only", global_),
                                     ("softmax average", ensemble_logits(global_, personal, "softmax"))):
                    label = f"{stats} statistics, {part}"
                    score(label, client, logits.argmax(1).numpy(), y)
            majority = int(torch.bincount(data.y_train).argmax())
            score("majority class of the train split", client, np.full_like(y, majority), y)
        elif method.bn_policy != "shared":  # FedRIR, FedBN, FedPick
            for stats in _stored_then_recalibrated(method, model, data):
                with torch.no_grad():
                    readings = {f"{stats} statistics": method.logits(model, data.x_test)}
                    if method.name == "fedpick":
                        # every inference ensemble of the same two classifiers: the shared C_g(v),
                        # the personal C_p(m*v); which combination carries the client
                        parts = model.parts(data.x_test)
                        readings |= {f"{stats} statistics, C_g only": parts["z_g"],
                                     f"{stats} statistics, C_p only": parts["z_p"],
                                     f"{stats} statistics, softmax average":
                                         ensemble_logits(parts["z_g"], parts["z_p"], "softmax")}
                for label, logits in readings.items():
                    score(label, client, logits.argmax(1).numpy(), y)
        elif method.name in ("fedavg", "fedavg_ft"):
            for label, result in _fedavg_readings(config, model, data, index).items():
                correct[label] = correct.get(label, 0) + result.correct
                per_client.setdefault(label, {})[client] = result.correct / result.total
        elif method.name == "repper":
            from edgepfl.methods.training import encoder_features

            f_train = encoder_features(model, data.x_train).numpy()
            f_test = encoder_features(model, data.x_test).numpy()
            y_train = data.y_train.numpy()
            for label, params in HEAD_RULES:
                if len(np.unique(y_train)) < 2:
                    pred = np.full_like(y, y_train[0])
                else:
                    head = method.make_head("lr", random_state=0, **params).fit(f_train, y_train)
                    pred = head.predict(f_test)
                    if params["C"] is None:
                        chosen_C.setdefault(label, []).append(head.C_)
                score(label, client, pred, y)
        else:
            raise SystemExit(f"no paired reading for method {method.name}")
    return {
        "run": str(run_dir),
        "method": method.name,
        "options": dict(config.method.options()),
        "checkpoint_round": meta.round,
        "clients": clients,
        "test_samples": total,
        "accuracy": {label: c / total for label, c in correct.items()},
        "per_client": per_client,
        "chosen_C": {label: {str(c): cs.count(c) for c in sorted(set(cs))} for label, cs in chosen_C.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run directory of research/run_methods.py (--runs-root/<tag>/...)")
    p.add_argument("--out", required=True, help="JSON to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    record = evaluate_run(Path(args.run))
    record["command"] = "OMP_NUM_THREADS=1 python research/final_state_eval.py " + " ".join(sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("checkpoint_round", "accuracy", "chosen_C")}, indent=1))
    print(f"{len(record['clients'])} clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
