"""Method accuracy benchmark on Fashion-MNIST: every method, identical settings.

Runs each (setting, method) pair as one in-process federation — the same coordinator
round loop and trainer runtime as an MQTT run (``tests/integration/rounds/test_federation.py`` proves the
two give the same numbers for the same seed) — and writes one JSON per run plus a
markdown table::

    python research/run_methods.py --tag cpu30 --rounds 30 --jobs 2
    python research/run_methods.py --tag cpu30 --rounds 30 --seeds 0,1,2 --jobs 2
    python research/run_methods.py --tag cpu30 --table          # table and curves.png only, from the JSONs
    python research/run_methods.py --tag cpu30 --rounds 30 --seeds 0,1,2 --skip-done --resume   # go on after a stop
    python research/run_methods.py --tag later --rounds 30 --seeds 0,1,2 --methods "fedrir+mi_clamp=true"
    python research/run_methods.py --tag cpu30 --merge later --table   # a variant beside cpu30's baselines
    python research/run_methods.py --tag cpu200 --rounds 200 --extend cpu30 --resume  # rounds 30..199 of cpu30's runs

A method ``name+option=value[+...]`` is a variant: the method with those options set on
top of ``configs/<name>.yaml``; tables rank it after, and compare it like, its method.

Every run checkpoints each round (it is the coordinator's own round loop): with
``--resume`` a run whose directory holds a checkpoint of the same configuration goes on
from it, so a run cut off by a time limit (a lent GPU's, a session's) loses at most
one round. Bring its run directory (``--runs-root``) back with the results.

``--over-mqtt`` runs one federation's agents as their own processes over the embedded
broker, one torch thread each, instead of one after another in one process: a single
long run then uses every core. The numbers are the in-process run's, bit for bit
(``research/tests/test_run_methods.py``), so a run may be resumed either way.

The table of a setting leads with mean ± std over seeds, the paired per-client
difference to FedRep and FedAvg and in how many seeds each method is ahead of them
(``research/seed_stats.py``).

What is identical across the methods of a setting: the data (partition, clients,
samples, seed), the model (SmallCNN, feature_dim 128, unless the setting names its own:
``fedpac_table1`` runs FedPAC's published CNN; FedRIR builds its own CNN of SmallCNN's
trunk), the ``train`` section (SGD lr 0.01, momentum 0.5, wd 5e-4, batch 50,
``--epochs`` local epochs), rounds, participation (full, unless ``--fraction``) and the seed. What differs is
only each method's own options, read from ``configs/<method>.yaml`` (their values
and sources are written there), except that FedPAC's ``body_epochs`` follows
``--epochs`` like every other method's local epochs.

Paper numbers beside the measured ones come from docs/METHODS.md (FedPAC
Table 1, FedRIR Tables 1 and 4); they were obtained with the papers' full protocols
(200-1000 rounds, more data in FedRIR's case), which the table states.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "research" / "results"

#: the benchmark's settings; ``data`` is a DataSpec, ``clients`` the fleet size, ``model`` (where
#: given) the setting's own model
SETTINGS: dict[str, dict] = {
    "fedpac_dominant": {
        "title": "FedPAC's label shift: 20 clients x 600 train samples, dominant class, s = 20 %",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.2}},
        "paper_source": "FedPAC Table 1, 20 clients, 600 train samples/client, E = 5, 200 rounds",
    },
    # the partition of FedPAC's published code (data_loader.py, mnist_noniid_s), which the
    # paper's text ("each client's specific primary category") does not pin down: four
    # clients a group, five groups, three dominant classes each; 600 test images a client
    "fedpac_sets": {
        "title": "FedPAC's label shift as its code partitions it: 20 clients x 600 train samples, s = 20 %, "
                 "3 dominant classes (5 groups)",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 1200, "test_fraction": 0.5,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.2,
                               "dominant_sets": [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]}},
        "paper_source": "FedPAC Table 1, 20 clients, 600 train samples/client, E = 5, 200 rounds; the authors' "
                        "partition",
    },
    "fedrir_pathological": {
        "title": "FedRIR's pathological label shift: 20 clients, 2 classes per client",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "pathological", "classes_per_client": 2}},
        "paper_source": "FedRIR Table 1, 20 clients, all 70k FMNIST images (~2,600 train/client), 1000 rounds",
    },
    "fedrir_dir01": {
        "title": "FedRIR's practical label shift: 20 clients, Dir(0.1)",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "dirichlet", "alpha": 0.1}},
        "paper_source": "FedRIR Table 4, 20 clients, all 70k FMNIST images, 1000 rounds",
    },
    # two settings none of the method defaults was tuned on: for deciding defaults
    "dominant_s10": {
        "title": "held-out label shift: 20 clients, dominant class, s = 10 %",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.1}},
        "paper_source": "no paper: a setting kept out of tuning",
    },
    "dir03": {
        "title": "held-out label shift: 20 clients, Dir(0.3)",
        "clients": 20,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "dirichlet", "alpha": 0.3}},
        "paper_source": "no paper: a setting kept out of tuning",
    },
    "domain": {
        "title": "cross-domain: 10 clients, one transform-defined domain each (identity, rot90, rot180, invert, "
                 "noise; two clients per domain), labels IID",
        "clients": 10,
        "data": {"dataset": "fmnist", "samples_per_client": 800, "test_fraction": 0.25,
                 "partition": {"kind": "domain", "domains": ["identity", "rot90", "rot180", "invert", "noise"]}},
        "paper_source": "no paper reports FMNIST cross-domain numbers",
    },
}


# cross-device: many small devices, a tenth of them a round, for client-level DP (issue: the
# ε table); a small model, evaluated every tenth round (400 devices a round would dominate)
SETTINGS["cross_device"] = {
    "title": "cross-device: 400 clients x 150 samples, Dir(0.3), an MLP, a tenth of them a round",
    "clients": 400,
    "data": {"dataset": "fmnist", "samples_per_client": 150, "test_fraction": 0.25,
             "partition": {"kind": "dirichlet", "alpha": 0.3}},
    "model": {"arch": "mlp", "feature_dim": 64, "norm": "none"},
    "run": {"eval_every": 10},
    "paper_source": "no paper: the privacy study's fleet",
}

# FedPAC's Table 1 as its code runs it: the code's partition and the code's CNN (16 / 32
# channels, LeakyReLU, no BatchNorm), for the paper-protocol rows
SETTINGS["fedpac_table1"] = {
    **SETTINGS["fedpac_sets"],
    "title": f"{SETTINGS['fedpac_sets']['title']}, the code's CNN",
    "model": {"arch": "fedpac_cnn", "feature_dim": 128, "norm": "none"},
    "paper_source": "FedPAC Table 1, 20 clients, 600 train samples/client, E = 5, 200 rounds; the authors' "
                    "partition and CNN",
}

#: the model every setting runs unless it names its own
MODEL = {"arch": "cnn", "feature_dim": 128, "norm": "batch"}


def at_full_data_size(setting: str, paper_source: str) -> dict:
    """``setting`` with every image of the pool, no per-client cap: FedRIR's data size (all
    70k Fashion-MNIST images over 20 clients, ~2,625 training images each)."""
    s = SETTINGS[setting]
    return {**s, "title": f"{s['title']}, all 70k images", "paper_source": paper_source,
            "data": {**s["data"], "samples_per_client": None}}


# FedRIR's settings at its paper's data size, for its paper-protocol runs
SETTINGS["fedrir_pathological_full"] = at_full_data_size(
    "fedrir_pathological", "FedRIR Table 1, 20 clients, all 70k FMNIST images, 1000 rounds")
SETTINGS["fedrir_dir01_full"] = at_full_data_size(
    "fedrir_dir01", "FedRIR Table 4, 20 clients, all 70k FMNIST images, 1000 rounds")

#: run order per setting: the founding methods in their target setting with FedAvg and
#: FedRep first, then the remaining baselines
ORDER: dict[str, list[str]] = {
    "fedpac_dominant": ["fedavg", "fedrep", "fedpac", "repper", "fedrir", "fedrod", "fedper", "local", "fedavg_ft",
                        "lgfedavg", "fedprox", "fedbn", "dualfed", "fedpick"],
    "fedpac_sets": ["fedavg", "fedrep", "fedpac", "local", "fedavg_ft", "fedrod", "fedper", "lgfedavg", "repper",
                    "fedrir", "dualfed", "fedpick"],
    "fedpac_table1": ["local", "fedavg", "fedavg_ft", "fedper", "lgfedavg", "fedrep", "fedrod", "fedpac", "repper",
                      "fedrir", "dualfed", "fedpick"],
    "fedrir_pathological": ["fedavg", "fedrep", "fedrir", "fedpac", "repper", "fedrod", "fedper", "local",
                            "fedavg_ft", "lgfedavg", "fedprox", "fedbn", "dualfed", "fedpick"],
    "fedrir_dir01": ["fedavg", "fedrep", "fedrir", "fedpac", "repper", "fedrod", "fedper", "local", "fedavg_ft",
                     "lgfedavg", "fedprox", "fedbn", "dualfed", "fedpick"],
    "fedrir_pathological_full": ["fedavg", "fedrep", "fedrir", "fedrod", "local"],
    "fedrir_dir01_full": ["fedavg", "fedrep", "fedrir", "fedrod"],
    "cross_device": ["fedavg", "fedrep", "repper", "fedpick"],
    "dominant_s10": ["fedavg", "fedrep", "fedpac", "repper", "fedrir", "dualfed", "fedpick"],
    "dir03": ["fedavg", "fedrep", "fedpac", "repper", "fedrir", "dualfed", "fedpick"],
    "domain": ["fedavg", "fedrep", "fedbn", "dualfed", "fedpick", "fedrod", "fedper", "local", "fedavg_ft",
               "lgfedavg", "fedprox", "fedpac", "repper", "fedrir"],
}

#: every method of the run orders, in order of first appearance (a method's colour in the curves)
ALL_METHODS = list(dict.fromkeys(m for methods in ORDER.values() for m in methods))

#: the paper's Fashion-MNIST accuracy (%) for the same method name and setting (METHODS.md)
PAPER: dict[str, dict[str, float]] = {
    "fedpac_dominant": {"local": 85.68, "fedavg": 85.28, "fedavg_ft": 90.47, "fedper": 87.43, "lgfedavg": 85.66,
                        "fedrep": 88.25, "fedrod": 90.11, "fedpac": 91.83},
    "fedrir_pathological": {"local": 86.36, "fedavg": 86.01, "fedrep": 85.86, "fedrod": 86.43, "fedrir": 90.58},
    "fedrir_dir01": {"fedavg": 71.99, "fedrep": 95.47, "fedrod": 95.57, "fedrir": 97.51},
    "domain": {},
    "dominant_s10": {},
    "dir03": {},
    "cross_device": {},  # the privacy study's own fleet: no paper reports it
}

# FedPAC's code settings and the full-data settings are the same paper tables as their twins
PAPER["fedpac_sets"] = PAPER["fedpac_table1"] = PAPER["fedpac_dominant"]
PAPER["fedrir_pathological_full"] = PAPER["fedrir_pathological"]
PAPER["fedrir_dir01_full"] = PAPER["fedrir_dir01"]

#: the settings each founding method's paper targets
TARGET = {"fedpac": ("fedpac_dominant", "fedpac_sets", "fedpac_table1"),
          "repper": ("fedpac_dominant", "fedpac_sets", "fedpac_table1"),
          "fedrir": ("fedrir_pathological", "fedrir_dir01", "fedrir_pathological_full", "fedrir_dir01_full"),
          "dualfed": ("domain",), "fedpick": ("domain",)}


def method_block(method: str, epochs: int) -> dict:
    """The method's own options, from ``configs/<method>.yaml`` (sourced there).

    ``method`` may name a variant, ``<name>+<option>=<value>[+...]``, e.g.
    ``fedrir+mi=code``: the config's options with those overridden (values parsed as
    YAML). Variants are reported under that label, beside the default.
    """
    import yaml

    name, *overrides = method.split("+")
    block = dict(yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["method"])
    if name == "fedpac":
        # FedPAC's body epochs are its local epochs: keep them equal to every other method's
        block["body_epochs"] = epochs
    for item in overrides:
        key, _, value = item.partition("=")
        block[key] = yaml.safe_load(value)
    return block


def federation_name(setting: str, method: str) -> str:
    """``bench-<setting>-<method>`` in the protocol's alphabet; a name past its length
    limit (a variant with several options) keeps its start and a hash of the whole."""
    from edgepfl.protocol.topics import NAME_MAX_CHARS

    name = re.sub(r"[^A-Za-z0-9-]", "-", f"bench-{setting}-{method}")
    if len(name) > NAME_MAX_CHARS:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: NAME_MAX_CHARS - len(digest) - 1]}-{digest}"
    return name


def run_config_dict(setting: str, method: str, rounds: int, epochs: int, seed: int, device: str,
                    data_root: str | None = None, fraction: float = 1.0, epsilon: float | None = None,
                    sampling: str = "fixed") -> dict:
    s = SETTINGS[setting]
    return {**({"privacy": dp_block(epsilon, rounds, s["clients"], fraction, sampling)} if epsilon else {}),
        **s.get("run", {}),
        "federation": federation_name(setting, method),
        "method": method_block(method, epochs),
        "model": s.get("model", MODEL),
        "train": {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "weight_decay": 5e-4, "batch_size": 50,
                  "epochs": epochs},
        "data": {**s["data"], "num_clients": s["clients"], "seed": seed, "root": data_root},
        "rounds": rounds,
        "fraction": fraction,  # of the clients trained each round; every client is evaluated every round
        "seed": seed,
        "device": device,
        "round_timeout_s": 3600,
    }


#: the δ of the privacy study (below 1 / the number of clients of every setting)
DP_DELTA = 1e-5


def dp_block(epsilon: float, rounds: int, clients: int, fraction: float, sampling: str = "fixed") -> dict:
    """The ``privacy`` section of a run that spends ``epsilon`` at :data:`DP_DELTA` over its
    rounds (central DP, client level, the sample its ``fraction`` draws each round, fixed-size
    or ``poisson``): the smallest noise multiplier that does (``edgepfl privacy``), with
    adaptive clipping from a clip of 1 towards the median change, inside the same ε
    (docs/SECURITY.md)."""
    from edgepfl.coordinator.sampling import sample_size
    from edgepfl.privacy import noise_multiplier_for

    z = noise_multiplier_for(epsilon, rounds, clients, sample_size(fraction, clients), DP_DELTA,
                             sampling=sampling)  # type: ignore[arg-type]
    return {"mechanism": "central", "clip_norm": 1.0, "noise_multiplier": z, "delta": DP_DELTA, "sampling": sampling,
            "adaptive_clipping": {"target_quantile": 0.5, "learning_rate": 0.2}}


def run_dir(runs_root: Path, tag: str, setting: str, method: str, seed: int) -> Path:
    """Where one run keeps its checkpoint, metrics and agents' state. The seed is part of
    the name: two seeds of one pair may run at once, and a directory holding another
    seed's checkpoint must never be resumed."""
    return runs_root / tag / f"{setting}__{method}__s{seed}"


#: the benchmark's own record of the configuration a run directory was started with
BENCH_CONFIG = "bench_config.json"
#: in a run directory that went on from a shorter run (--extend): that run's tag and rounds
EXTENDED = "extended_from.json"
#: in a run directory: where the agents ran in each coordinator session (run_times.json's)
AGENT_MODES = "agent_modes.json"


def agent_mode(over_mqtt: bool) -> str:
    return "processes over MQTT" if over_mqtt else "in process"


def note_agent_mode(out: Path, over_mqtt: bool) -> None:
    """Record where the agents of the coordinator session about to begin in ``out`` run.

    The entry is keyed by that session's index in ``run_times.json``; a process killed
    before its session began leaves an entry the next one overwrites."""
    from edgepfl.atomic import write_json
    from edgepfl.metrics import read_run_times

    path = out / AGENT_MODES
    modes = json.loads(path.read_text()) if path.is_file() else {}
    modes[str(len(read_run_times(out).sessions))] = agent_mode(over_mqtt)
    write_json(path, modes)


def agents_label(out: Path) -> str:
    """Where a run's agents ran: one mode, or, when a resumed run changed it, each mode
    with the first round it trained ("in process from round 0, processes over MQTT from
    round 112"). The numbers are the same either way (research/tests/test_run_methods.py)."""
    from edgepfl.metrics import read_run_times

    path = out / AGENT_MODES
    modes = json.loads(path.read_text()) if path.is_file() else {}
    spans: list[tuple[int, str]] = []
    for i, session in enumerate(read_run_times(out).sessions):
        mode = modes.get(str(i), "not recorded")
        if not spans or spans[-1][1] != mode:
            spans.append((0 if session.resumed_from is None else session.resumed_from + 1, mode))
    if len(spans) == 1:
        return spans[0][1]
    return ", ".join(f"{mode} from round {first}" for first, mode in spans)


def resumable(out: Path, cfg: dict) -> bool:
    """True when ``out`` holds a checkpoint of a run started with exactly ``cfg``.

    A directory with a checkpoint of any other configuration is an error, not a fresh
    start: resuming it would mix two runs, starting over would discard one."""
    if not (out / "checkpoint").is_dir():
        return False
    recorded = out / BENCH_CONFIG
    previous = json.loads(recorded.read_text()) if recorded.is_file() else None
    if previous != cfg:
        raise SystemExit(f"{out} holds a checkpoint of another configuration (see {recorded.name}); "
                         "remove the directory or run without --resume")
    return True


def extend_from(out: Path, source: Path, cfg: dict) -> None:
    """Start ``out`` as a copy of the finished shorter run in ``source``, so that a run of
    R rounds goes on from a finished run of r < R rounds of the same configuration instead
    of training its first r rounds again; ``out``'s :data:`EXTENDED` records where it began.

    Exact, not approximate: nothing in a round depends on the run's length (no learning-rate
    schedule; client sampling, seeds and each agent's state depend on the round alone), and
    the final evaluation only reads state, so rounds r..R-1 continue the run as if it had
    been started with R (``research/tests/test_run_methods.py`` compares the two round by round).
    The copy lives under its own tag: the shorter run's directory and results stay as
    they were."""
    recorded = source / BENCH_CONFIG
    if not (source / "summary.json").is_file() or not recorded.is_file():
        raise SystemExit(f"--extend: {source} holds no finished run to go on from")
    previous = json.loads(recorded.read_text())
    shorter = previous.get("rounds")
    if {**previous, "rounds": cfg["rounds"]} != cfg or not isinstance(shorter, int) or shorter >= cfg["rounds"]:
        raise SystemExit(f"--extend: {source} is not a shorter run of this configuration (see {recorded.name})")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)
    (out / "summary.json").unlink()  # the shorter run's: this one is not finished
    (out / BENCH_CONFIG).write_text(json.dumps(cfg, indent=1))
    (out / EXTENDED).write_text(json.dumps({"tag": source.parent.name, "rounds": shorter}))


def majority_floor(setting: str, seed: int, data_root: str | None = None) -> float:
    """What a client scores by always predicting its training split's majority class,
    sample-weighted over clients' test splits as the federation's accuracy is: the
    floor a personalized method must clear in a label-skew setting."""
    import numpy as np

    from edgepfl.config import DataSpec
    from edgepfl.data import client_indices, load_pool

    s = SETTINGS[setting]
    spec = DataSpec(**{**s["data"], "num_clients": s["clients"], "seed": seed, "root": data_root})
    y = np.asarray(load_pool(spec).y)
    correct = total = 0
    for client in range(s["clients"]):
        train, test = client_indices(spec, client)
        majority = np.bincount(y[train]).argmax()
        correct += int((y[test] == majority).sum())
        total += len(test)
    return correct / total


def participation(records: list[dict]) -> str:
    """How many clients trained a round in these runs, as the table's header says it."""
    shares = sorted({r.get("config", {}).get("fraction", 1.0) for r in records})
    if shares == [1.0]:
        return "full participation"
    return "a share of " + " / ".join(f"{x:g}" for x in shares) + " of the clients training each round " \
        "(all evaluated)"


def run_one(setting: str, method: str, rounds: int, epochs: int, seed: int, device: str, tag: str,
            runs_root: Path, data_root: str | None = None, resume: bool = False,
            extend: str | None = None, over_mqtt: bool = False, fraction: float = 1.0,
            epsilon: float | None = None, sampling: str = "fixed") -> dict:
    """One federation (in process, or its agents over MQTT); returns (and the caller stores) its result record.

    With ``resume``, a checkpoint of the same configuration in the run's directory is
    continued (:func:`resumable`); with ``extend``, a run not started yet begins as a copy
    of the same run, finished with fewer rounds, under that tag (:func:`extend_from`). The
    record covers every round either way. With ``over_mqtt`` the agents are processes on
    the embedded broker (the module docstring); the configuration, and so the checkpoint a
    run resumes from, is the same."""
    import torch

    from edgepfl.config import RunConfig, parse_config
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers
    from edgepfl.metrics import read_metrics

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = run_config_dict(setting, method, rounds, epochs, seed, device, data_root, fraction, epsilon, sampling)
    config = parse_config(RunConfig, cfg, f"benchmark {setting}/{method}")
    out = run_dir(runs_root, tag, setting, method, seed)
    fresh = not (resume and resumable(out, cfg))
    resumed = not fresh  # its own checkpoint, after a stop: not the shorter run it went on from
    if fresh and extend:
        extend_from(out, run_dir(runs_root, extend, setting, method, seed), cfg)
        fresh = False
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / BENCH_CONFIG).write_text(json.dumps(cfg, indent=1))
    note_agent_mode(out, over_mqtt)
    t0 = time.monotonic()
    _, summary = simulate(config, SETTINGS[setting]["clients"], out, in_process=None if over_mqtt else local_trainers, progress=False,
                          fresh=False, threads=1 if over_mqtt else None)
    wall = time.monotonic() - t0
    rows = read_metrics(out)  # every round, those before a resume included
    extended = json.loads((out / EXTENDED).read_text()) if (out / EXTENDED).is_file() else None
    scored = [r for r in rows if r.accuracy is not None]
    return {
        "setting": setting,
        "method": method,
        "tag": tag,
        "rounds": rounds,
        "local_epochs": epochs,
        "seed": seed,
        "clients": SETTINGS[setting]["clients"],
        "device": str(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")),
        "torch_threads": torch.get_num_threads(),
        "agents": agents_label(out),
        "config": cfg,
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "best_round": summary["best_round"],
        "accuracy_curve": [r.accuracy for r in scored],
        "train_loss_curve": [r.train_loss for r in rows if not r.final],
        "participants_per_round": [len(r.participants) for r in rows if not r.final],
        "round_seconds": [r.seconds for r in rows],
        "final_per_client": summary["final_per_client"],
        # the rounds' own seconds: the fleet's virtual clock in process, the wall clock over MQTT
        "wall_seconds": round(sum(r.seconds for r in rows), 1),
        "wall_seconds_this_process": round(wall, 1),  # what the run cost on this machine
        "resumed": resumed,
        "extended_from": extended,
        "majority_floor": majority_floor(setting, seed, data_root),
        "paper_accuracy": PAPER.get(setting, {}).get(base_method(method)),
        "command": command_line(tag, rounds, epochs, seed, device, [setting], [method], data_root, extend, over_mqtt,
                                fraction, epsilon, sampling),
        "epsilon": epsilon,
        "sampling": sampling if epsilon else None,
    }


def command_line(tag, rounds, epochs, seed, device, settings, methods, data_root=None, extend=None,
                 over_mqtt=False, fraction=1.0, epsilon=None, sampling="fixed") -> str:
    root = f" --data-root {data_root}" if data_root else ""
    root += f" --fraction {fraction:g}" if fraction != 1.0 else ""
    root += f" --epsilon {epsilon:g}" if epsilon else ""
    root += f" --sampling {sampling}" if epsilon and sampling != "fixed" else ""
    longer = f" --extend {extend}" if extend else ""
    longer += " --over-mqtt" if over_mqtt else ""
    return (f"OMP_NUM_THREADS=1 python research/run_methods.py --tag {tag} --rounds {rounds} --epochs {epochs} "
            f"--seed {seed} --device {device} --settings {','.join(settings)} --methods {','.join(methods)}"
            f"{root}{longer}")


def parse_pair(item: str, seeds: list[int]) -> list[tuple[str, str, int]]:
    """``setting:method`` (once per seed of ``seeds``) or ``setting:method@seed`` (that
    seed only): the queue runs in the order given, so the runs that matter most go first."""
    pair, at, seed = item.partition("@")
    setting, _, method = pair.partition(":")
    if setting not in SETTINGS or not method:
        raise SystemExit(f"--pairs: {item!r} is not setting:method[@seed] with a setting of {', '.join(SETTINGS)}")
    return [(setting, method, int(seed))] if at else [(setting, method, s) for s in seeds]


def result_path(tag: str, setting: str, method: str, seed: int) -> Path:
    return RESULTS / tag / f"{setting}__{method}__s{seed}.json"


# ---------------------------------------------------------------------- table
def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def run_seconds(record: dict) -> float:
    """The seconds a run took on this machine (the rounds' own seconds for records that kept no more).

    In process the rounds run on the fleet's virtual clock, so their sum is virtual time, not cost.
    """
    return float(record.get("wall_seconds_this_process", record["wall_seconds"]))


def _tail_mean(record: dict, k: int = 10):
    """Mean of the last ``k`` evaluations (rounds R-k+1 .. R): less noisy than one round."""
    tail = [a for a in record["accuracy_curve"][-k:] if a is not None]
    return sum(tail) / len(tail) if tail else None


def floor_of(record: dict) -> float | None:
    """The record's majority-class floor; records written before it was stored get it
    computed from the data (None where the data are not on this machine)."""
    if record.get("majority_floor") is not None:
        return record["majority_floor"]
    try:
        return majority_floor(record["setting"], record["seed"])
    except Exception:  # noqa: BLE001 - a table is still worth writing without the floor
        return None


def below_floor_from(record: dict, floor: float | None, start: int = 5) -> str:
    """``"k/n"``: of the evaluations after ``start`` or more rounds, how many scored below
    the floor (the defaults' criterion: DualFed must stay above it from round 5 on)."""
    curve = [a for a in record["accuracy_curve"][start:] if a is not None]
    if floor is None or not curve:
        return "—"
    return f"{sum(1 for a in curve if a < floor)}/{len(curve)}"


def load_results(tag: str, merge: Sequence[str] = ()) -> list[dict]:
    """The run records of ``tag`` and of the tags in ``merge`` (a method's later runs kept
    under their own tag, tabulated beside the baselines they are compared with); other
    JSON beside them (final_state_eval's paired readings of a run's state) is not a run
    and is left out."""
    records = [json.loads(p.read_text()) for t in (tag, *merge) for p in sorted((RESULTS / t).glob("*.json"))]
    return [r for r in records if "setting" in r and "method" in r]


def base_method(method: str) -> str:
    """``fedrir`` for the variant ``fedrir+mi_clamp=true``: a variant ranks and counts as a
    target like the method it varies."""
    return method.partition("+")[0]


def markdown_table(tag: str, merge: Sequence[str] = ()) -> str:
    """One table per setting: with several methods first their spread over seeds and
    paired per-client comparisons (``seed_stats``), then every run's final and
    best-round accuracy beside the paper's number."""
    from seed_stats import seed_table

    results = load_results(tag, merge)
    lines = []
    for setting, s in SETTINGS.items():
        rows = [r for r in results if r["setting"] == setting]
        if not rows:
            continue
        order = {m: i for i, m in enumerate(ORDER[setting])}
        rows.sort(key=lambda r: (order.get(base_method(r["method"]), 99), r["method"], r["seed"]))
        r0 = rows[0]
        lines += [f"### {s['title']}", "",
                  f"{'/'.join(sorted({str(r['rounds']) for r in rows}))} rounds, "
                  f"{'/'.join(sorted({str(r['local_epochs']) for r in rows}))} local epoch(s), seed(s) "
                  f"{sorted({r['seed'] for r in rows})}, {r0['clients']} clients, {participation(rows)}. "
                  f"Paper column: {s['paper_source']}.", ""]
        if len({r["method"] for r in rows}) > 1:  # paired per client: worth it from one seed on
            methods = list(dict.fromkeys(r["method"] for r in rows))  # in the rows' order: variants after their base
            lines += [*seed_table(rows, methods,
                                  targets=[m for m in methods if setting in TARGET.get(base_method(m), ())]),
                      "", "Every run:", ""]
        lines += [
                  "| method | seed | final acc. % (after round " + str(r0["rounds"]) + ") | best acc. % (round) | "
                  "best − final pts | majority floor % | evals below floor from round 5 | paper % | "
                  "mean acc. % last 10 evals | run s (this process) | device |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            # a variant is set beside its method's published number (records before this stored none)
            paper = r.get("paper_accuracy") or PAPER.get(setting, {}).get(base_method(r["method"]))
            target = " (target)" if setting in TARGET.get(base_method(r["method"]), ()) else ""
            floor = floor_of(r)
            drop = (f"{100 * (r['best_accuracy'] - r['final_accuracy']):.2f}"
                    if r["best_accuracy"] is not None and r["final_accuracy"] is not None else "—")
            lines.append(f"| {r['method']}{target} | {r['seed']} | {_pct(r['final_accuracy'])} | "
                         f"{_pct(r['best_accuracy'])} ({r['best_round']}) | {drop} | {_pct(floor)} | "
                         f"{below_floor_from(r, floor)} | {'—' if paper is None else f'{paper:.2f}'} | "
                         f"{_pct(_tail_mean(r))} | {run_seconds(r):.0f} | {r['device']} |")
        lines.append("")
    return "\n".join(lines)


def plot_curves(tag: str, path: Path, merge: Sequence[str] = ()) -> bool:
    """Accuracy per round, one panel per setting: each method's mean over its seeds with a
    ± std band, the majority-class floor dashed. False (nothing written) without results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from seed_stats import by_method_seed, curve_band

    results = load_results(tag, merge)
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in results)]
    if not settings:
        return False
    # one colour per method in every panel, its variants dashed in the same colour; the ten
    # strong colours first, then the light ones (the default cycle repeats after ten)
    palette = [*plt.get_cmap("tab10").colors, *plt.get_cmap("tab20").colors[1::2]]
    bases = list(dict.fromkeys([*ALL_METHODS, *sorted(base_method(r["method"]) for r in results)]))
    colour = {m: palette[i % len(palette)] for i, m in enumerate(bases)}
    cols = min(2, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(settings):]:
        ax.set_visible(False)
    for ax, setting in zip(axes.flat, settings):
        records = [r for r in results if r["setting"] == setting]
        table = by_method_seed(records)
        rank = {m: i for i, m in enumerate(ORDER[setting])}
        lowest = 100.0  # the axis starts below the lowest mean from round 5 on: the first rounds' climb is not the story
        for method in sorted(table, key=lambda m: (rank.get(base_method(m), len(rank)), m)):
            xs, mean, std = curve_band(table[method])
            if not xs:
                continue
            lowest = min([lowest, *(100 * m for x, m in zip(xs, mean, strict=True) if x >= 5)])  # a run of < 5 rounds adds none
            target = setting in TARGET.get(base_method(method), ())
            line, = ax.plot(xs, [100 * m for m in mean], lw=2.0 if target else 1.1, color=colour[base_method(method)],
                            ls="--" if method != base_method(method) else "-",
                            label=f"{method} ({len(table[method])} seed{'s' if len(table[method]) > 1 else ''})")
            if all(d is not None for d in std):
                ax.fill_between(xs, [100 * (m - d) for m, d in zip(mean, std, strict=True)],
                                [100 * (m + d) for m, d in zip(mean, std, strict=True)],
                                color=line.get_color(), alpha=0.15, lw=0)
        floors = [f for f in (floor_of(r) for r in records) if f is not None]
        if floors:
            floor = 100 * sum(floors) / len(floors)
            ax.axhline(floor, color="grey", ls="--", lw=1, label="majority floor")
            lowest = min(lowest, floor)
        ax.set_title("\n".join(textwrap.wrap(SETTINGS[setting]["title"], 60)), fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy % (mean ± std over seeds)")
        ax.set_ylim(max(0.0, lowest - 3), min(100.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", required=True, help="results go to research/results/<tag>/")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=1, help="local epochs of every method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, help="comma list of seeds, each pair runs once per seed (overrides --seed)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--settings", default="fedpac_dominant,fedrir_pathological,fedrir_dir01,domain",
                   help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--methods", default="all", help="comma list, or 'all' (each setting's ORDER)")
    p.add_argument("--pairs", default=None, help="explicit run queue 'setting:method[@seed],...', run in this order "
                   "(overrides --settings/--methods; without @seed a pair runs once per --seeds)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (separate processes)")
    p.add_argument("--runs-root", default=str(REPO / "runs" / "bench"), help="run directories (not committed)")
    p.add_argument("--data-root", default=None, help="folder with the four Fashion-MNIST IDX files "
                   "(default: the Debian package's)")
    p.add_argument("--skip-done", action="store_true", help="skip pairs whose result JSON exists")
    p.add_argument("--resume", action="store_true", help="continue each run from its directory's checkpoint "
                   "(same configuration only) instead of starting it over")
    p.add_argument("--extend", default=None, metavar="TAG", help="start each run not started yet from the same "
                   "run finished with fewer rounds under TAG (copied, TAG's results stay), instead of from round 0")
    p.add_argument("--fraction", type=float, default=1.0, help="share of the clients that train each round "
                   "(all of them are evaluated every round); 1.0: full participation, as the tables assume")
    p.add_argument("--over-mqtt", action="store_true", help="run each federation's agents as processes over the "
                   "embedded broker, one core each (same numbers as in process; for one long run on idle cores)")
    p.add_argument("--table", action="store_true", help="only (re)write the markdown table and curves.png for --tag")
    p.add_argument("--merge", default="", help="comma list of tags whose runs the table and curves of --tag "
                   "include beside its own (e.g. a method's later variant runs)")
    p.add_argument("--epsilon", type=float, default=None,
                   help="client-level differential privacy: each run spends this ε at δ = 1e-5 over its rounds "
                        "(central, adaptive clipping; the noise multiplier is the smallest that does); use one tag "
                        "per ε")
    p.add_argument("--sampling", choices=("fixed", "poisson"), default="fixed",
                   help="with --epsilon: privacy.sampling (poisson: each client drawn on its own, add-or-remove "
                        "accounting)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # worker: setting:method
    args = p.parse_args(argv)

    if args.one:
        from edgepfl.atomic import write_json

        setting, method = args.one.split(":")
        record = run_one(setting, method, args.rounds, args.epochs, args.seed, args.device, args.tag,
                         Path(args.runs_root), args.data_root, resume=args.resume, extend=args.extend,
                         over_mqtt=args.over_mqtt, fraction=args.fraction, epsilon=args.epsilon,
                         sampling=args.sampling)
        path = result_path(args.tag, setting, method, args.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        # atomic: a run killed mid-write must not leave a JSON that --skip-done takes as finished
        write_json(path, record)
        print(f"{setting:22s} {method:10s} final {_pct(record['final_accuracy'])} best "
              f"{_pct(record['best_accuracy'])} ({record['best_round']}) {run_seconds(record):.0f}s", flush=True)
        return 0

    if not args.table:
        settings = args.settings.split(",")
        pairs = []
        for setting in settings:
            methods = ORDER[setting] if args.methods == "all" else args.methods.split(",")
            pairs += [(setting, m) for m in methods]
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
        runs = [(s, m, seed) for seed in seeds for s, m in pairs]
        if args.pairs:
            runs = [run for item in args.pairs.split(",") for run in parse_pair(item, seeds)]
        if args.skip_done:
            runs = [(s, m, seed) for s, m, seed in runs if not result_path(args.tag, s, m, seed).exists()]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        log_dir = Path(args.runs_root) / args.tag
        log_dir.mkdir(parents=True, exist_ok=True)

        def work(run):
            setting, method, seed = run
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", f"{setting}:{method}", "--tag", args.tag,
                   "--rounds", str(args.rounds), "--epochs", str(args.epochs), "--seed", str(seed),
                   "--device", args.device, "--runs-root", args.runs_root]
            if args.data_root:
                cmd += ["--data-root", args.data_root]
            if args.resume:
                cmd.append("--resume")
            if args.extend:
                cmd += ["--extend", args.extend]
            if args.over_mqtt:
                cmd.append("--over-mqtt")
            if args.fraction != 1.0:
                cmd += ["--fraction", str(args.fraction)]
            if args.epsilon:
                cmd += ["--epsilon", str(args.epsilon), "--sampling", args.sampling]
            log_path = log_dir / f"{setting}__{method}__s{seed}.log"
            with open(log_path, "w") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            text = log_path.read_text().strip().splitlines()
            print(text[-1] if rc == 0 and text else f"{setting} {method} FAILED rc={rc}: see {log.name}", flush=True)
            return rc

        print(f"{len(runs)} runs, {args.jobs} at a time: " + shlex.join(sys.argv), flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(work, runs))
        if any(codes):
            print(f"{sum(1 for c in codes if c)} run(s) failed", flush=True)

    merge = [t for t in args.merge.split(",") if t]
    table = markdown_table(args.tag, merge)
    (RESULTS / args.tag).mkdir(parents=True, exist_ok=True)
    (RESULTS / args.tag / "table.md").write_text(table)
    plot_curves(args.tag, RESULTS / args.tag / "curves.png", merge)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
