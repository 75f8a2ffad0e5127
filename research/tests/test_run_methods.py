"""The method benchmark's runner (research/run_methods.py): run queue, run directories,
resume after a kill, the majority floor. Real in-process federations on Fashion-MNIST."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from edgepfl.data import load_client_data
from edgepfl.metrics import read_run_times

RESEARCH = Path(__file__).resolve().parent.parent
REPO = RESEARCH.parent
_PATH = RESEARCH / "run_methods.py"
# as when it runs as a script: its own folder is on the path (it imports seed_stats from there)
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("run_methods", _PATH)
assert _spec and _spec.loader
run_methods = importlib.util.module_from_spec(_spec)
sys.modules["run_methods"] = run_methods
_spec.loader.exec_module(run_methods)

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (apt dataset-fashion-mnist) not installed")

#: a setting small enough for a test: 4 clients x 100 samples, dominant class
TINY = {"title": "tiny", "clients": 4, "paper_source": "none",
        "data": {"dataset": "fmnist", "samples_per_client": 100, "test_fraction": 0.25,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.2}}}

#: runs the benchmark's worker with the tiny setting registered (a worker is a fresh process)
WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {bench!r})
    import run_methods
    run_methods.SETTINGS["tiny"] = json.loads({tiny!r})
    run_methods.RESULTS = __import__("pathlib").Path({results!r})
    sys.exit(run_methods.main(sys.argv[1:]))
""")


class Worker:
    """The benchmark's worker on the tiny setting, as a fresh process, with its results
    and run directories under one temporary folder."""

    def __init__(self, root: Path):
        self.results, self.runs = root / "results", root / "runs"
        self.script = root / "worker.py"
        self.script.write_text(WORKER.format(bench=str(RESEARCH), tiny=json.dumps(TINY),
                                             results=str(self.results)))

    def argv(self, method: str, tag: str, rounds: int, *extra: str, seed: int = 0, epochs: int = 1) -> list[str]:
        return [sys.executable, str(self.script), "--one", f"tiny:{method}", "--tag", tag, "--rounds", str(rounds),
                "--seed", str(seed), "--epochs", str(epochs), "--device", "cpu", "--runs-root", str(self.runs),
                *extra]

    @staticmethod
    def env() -> dict[str, str]:
        return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

    def run(self, method: str, tag: str, rounds: int, *extra: str, seed: int = 0, epochs: int = 1,
            timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(method, tag, rounds, *extra, seed=seed, epochs=epochs), env=self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def record(self, method: str, tag: str, seed: int = 0) -> dict:
        return json.loads((self.results / tag / f"tiny__{method}__s{seed}.json").read_text())

    def run_dir(self, method: str, tag: str, seed: int = 0) -> Path:
        return run_methods.run_dir(self.runs, tag, "tiny", method, seed)


@pytest.fixture
def worker(tmp_path) -> Worker:
    return Worker(tmp_path)


def test_pairs_run_in_the_order_given_with_pinned_or_listed_seeds():
    runs = [r for item in ["dir03:fedrir@2", "domain:fedavg"] for r in run_methods.parse_pair(item, [0, 1])]
    assert runs == [("dir03", "fedrir", 2), ("domain", "fedavg", 0), ("domain", "fedavg", 1)]
    with pytest.raises(SystemExit, match="nowhere:fedavg"):
        run_methods.parse_pair("nowhere:fedavg", [0])
    with pytest.raises(SystemExit, match="not setting:method"):
        run_methods.parse_pair("dir03", [0])


def test_each_seed_has_its_own_run_directory(tmp_path):
    dirs = {run_methods.run_dir(tmp_path, "t", "dir03", "fedavg", s) for s in (0, 1, 2)}
    assert len(dirs) == 3


@needs_fmnist
def test_majority_floor_is_the_weighted_score_of_each_clients_majority_class(monkeypatch):
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)
    from edgepfl.config import DataSpec

    spec = DataSpec(**{**TINY["data"], "num_clients": 4, "seed": 3})
    correct = total = 0
    for i in range(4):
        data = load_client_data(spec, i)
        majority = np.bincount(np.asarray(data.y_train)).argmax()
        correct += int((np.asarray(data.y_test) == majority).sum())
        total += len(data.y_test)
    floor = run_methods.majority_floor("tiny", 3)
    assert floor == pytest.approx(correct / total)
    assert 0.6 < floor < 1.0  # 80 % of each client's samples are its dominant class


@needs_fmnist
def test_a_killed_run_resumes_from_its_checkpoint_and_reports_every_round(worker, monkeypatch):
    """Killed in process, the run goes on over MQTT from its checkpoint: every round is
    reported once and the record says where the agents of each part ran."""
    rounds = 12
    metrics = worker.run_dir("fedavg", "t") / "metrics.jsonl"

    proc = subprocess.Popen(worker.argv("fedavg", "t", rounds), env=worker.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # generous: on a loaded box (benchmarks beside the suite) the worker's start alone took
    # most of the two minutes this wait once had, and the kill then came before round 3
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: give it more rounds"
    assert metrics.exists(), "the worker reported no round in ten minutes: the box is starved"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert 3 <= len(before) < rounds

    # with --resume it goes on from the checkpoint
    done = worker.run("fedavg", "t", rounds, "--resume", "--over-mqtt")
    assert done.returncode == 0, done.stdout + done.stderr
    record = worker.record("fedavg", "t")
    assert record["resumed"] is True
    assert len(record["accuracy_curve"]) == rounds + 1  # round 0 .. the final evaluation
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = len(before) - 1  # the last row may be one the checkpoint did not reach: it is written again
    assert [r["accuracy"] for r in after[:kept]] == [r["accuracy"] for r in before[:kept]]
    assert [r["round"] for r in after if not r["final"]] == list(range(rounds))
    first_resumed = read_run_times(worker.run_dir("fedavg", "t")).sessions[-1].resumed_from + 1
    assert kept <= first_resumed <= len(before)
    assert record["agents"] == f"in process from round 0, processes over MQTT from round {first_resumed}"
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)
    assert record["majority_floor"] == pytest.approx(run_methods.majority_floor("tiny", 0))

    # a directory of another configuration is never resumed
    other = worker.run("fedavg", "t", rounds, "--resume", epochs=2, timeout=300)
    assert other.returncode != 0
    assert "holds a checkpoint of another configuration" in other.stderr


@needs_fmnist
def test_agents_over_mqtt_give_the_in_process_numbers_bit_for_bit(worker):
    """``--over-mqtt`` only changes where the agents run: RepPer (augmented views, a head
    fitted at every evaluation) gives the same curve, per-client scores and state."""
    records = {}
    for tag, extra in (("local", []), ("mqtt", ["--over-mqtt"])):
        done = worker.run("repper", tag, 2, *extra)
        assert done.returncode == 0, done.stdout + done.stderr
        records[tag] = worker.record("repper", tag)
    local, mqtt = records["local"], records["mqtt"]
    assert (local["agents"], mqtt["agents"]) == ("in process", "processes over MQTT")
    assert mqtt["command"].endswith("--over-mqtt")
    assert len(mqtt["accuracy_curve"]) == 3
    assert mqtt["accuracy_curve"] == local["accuracy_curve"]
    assert mqtt["final_per_client"] == local["final_per_client"]
    # the round's mean loss sums the agents' reports in arrival order: equal to float rounding
    assert mqtt["train_loss_curve"] == pytest.approx(local["train_loss_curve"], rel=1e-12)
    runs = {tag: worker.run_dir("repper", tag) for tag in records}
    # an agent process leaves its config and log; an in-process agent neither
    assert sorted(p.name for p in (runs["mqtt"] / "agents").glob("*.yaml")) == [f"agent-0{i}.yaml" for i in range(4)]
    assert not list((runs["local"] / "agents").glob("*.yaml"))
    states = [json.loads((run / "checkpoint" / "state.json").read_text())["tensors_sha256"] for run in runs.values()]
    assert states[0] == states[1]


@needs_fmnist
def test_a_fraction_trains_that_share_of_the_clients_and_still_evaluates_every_client(worker):
    done = worker.run("fedavg", "t", 3, "--fraction", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    record = worker.record("fedavg", "t")
    assert record["participants_per_round"] == [2, 2, 2]
    assert len(record["final_per_client"]) == 4 and None not in record["accuracy_curve"]
    assert "--fraction 0.5" in record["command"]
    assert run_methods.participation([record]).startswith("a share of 0.5 of the clients")
    assert run_methods.participation([{"config": {"fraction": 1.0}}]) == "full participation"


def test_below_floor_counts_evaluations_from_round_five_on():
    record = {"accuracy_curve": [0.1, 0.2, 0.5, 0.7, 0.85, 0.81, 0.90, 0.95, None]}
    assert run_methods.below_floor_from(record, 0.82) == "1/3"  # 0.81 after round 5; None is not an evaluation
    assert run_methods.below_floor_from(record, None) == "—"


def test_every_setting_has_a_run_order_and_a_paper_column():
    assert set(run_methods.ORDER) == set(run_methods.SETTINGS) == set(run_methods.PAPER)
    assert {s for settings in run_methods.TARGET.values() for s in settings} <= set(run_methods.SETTINGS)
    for setting, methods in run_methods.ORDER.items():
        assert set(run_methods.PAPER[setting]) <= set(methods), setting  # every paper number gets its row


def test_the_curves_plot_has_a_panel_per_setting_with_results(tmp_path, monkeypatch):
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path)
    assert run_methods.plot_curves("empty", tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()
    (tmp_path / "t").mkdir()
    for seed in (0, 1):
        for method, top in (("fedavg", 0.7), ("fedrep", 0.9)):
            curve = [0.1 + (top - 0.1) * min(1, r / 5) + 0.01 * seed for r in range(11)]
            record = {"setting": "fedpac_dominant", "method": method, "seed": seed, "accuracy_curve": curve,
                      "majority_floor": 0.8, "final_accuracy": curve[-1]}
            (tmp_path / "t" / f"{method}_{seed}.json").write_text(json.dumps(record))
    assert run_methods.plot_curves("t", tmp_path / "t" / "curves.png")
    from PIL import Image

    with Image.open(tmp_path / "t" / "curves.png") as image:  # one panel: one column, not two
        width, height = image.size
    assert image.format == "PNG" and width < 1.5 * height


def test_tables_read_run_records_only(tmp_path, monkeypatch):
    """A paired reading written beside the runs (final_state_eval) is not a run."""
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path)
    (tmp_path / "t").mkdir()
    run = {"setting": "fedpac_dominant", "method": "fedavg", "seed": 0}
    (tmp_path / "t" / "fedpac_dominant__fedavg__s0.json").write_text(json.dumps(run))
    (tmp_path / "t" / "fedpac_dominant__fedavg__s0__paired.json").write_text(json.dumps({"accuracy": {}}))
    assert run_methods.load_results("t") == [run]


def test_a_long_variant_keeps_the_federation_name_within_the_protocol():
    import re

    short = run_methods.federation_name("fedpac_dominant", "fedavg")
    assert short == "bench-fedpac-dominant-fedavg"
    names = {run_methods.federation_name("fedrir_pathological_full", f"fedrir+bn_recalibrate=false+{o}")
             for o in ("q_steps=5", "mi_clamp=true")}
    assert len(names) == 2 and all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n) for n in names)


def test_a_merged_tag_tabulates_a_variant_beside_its_base_with_paired_comparisons(tmp_path, monkeypatch):
    """A method's later variant runs, kept under their own tag, land in the baselines' table:
    ranked right after the method they vary, marked as its target, compared per client."""
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path)

    def write(tag, method, seed, acc):
        record = {"setting": "fedrir_pathological", "method": method, "seed": seed, "rounds": 30,
                  "local_epochs": 1, "clients": 2, "final_accuracy": acc, "best_accuracy": acc, "best_round": 30,
                  "final_per_client": {"0": acc, "1": acc}, "accuracy_curve": [0.1, acc], "majority_floor": 0.5,
                  "paper_accuracy": None, "wall_seconds": 1.0, "device": "cpu"}
        (tmp_path / tag).mkdir(exist_ok=True)
        (tmp_path / tag / f"fedrir_pathological__{method}__s{seed}.json").write_text(json.dumps(record))

    for seed in (0, 1):
        write("base", "fedavg", seed, 0.70)
        write("base", "fedrep", seed, 0.90)
        write("base", "fedrir", seed, 0.85)
        write("later", "fedrir+mi_clamp=true", seed, 0.95)
    alone = run_methods.markdown_table("base")
    assert "mi_clamp" not in alone
    table = run_methods.markdown_table("base", ["later"])
    summary = [line for line in table.splitlines() if line.startswith("| ") and "clients)" in line]
    assert [line.split("|")[1].strip() for line in summary] == [
        "fedavg", "fedrep", "fedrir (target)", "fedrir+mi_clamp=true (target)"]
    variant = [c.strip() for c in summary[-1].strip("|").split("|")]
    assert variant[1] == "0,1" and variant[3] == "+5.00 ± 0.00 (4/4 clients)" and variant[4] == "2/2"
    assert run_methods.plot_curves("base", tmp_path / "c.png", ["later"])
    # every run of FedRIR, variant or not, is set beside FedRIR's published number
    runs = [line for line in table.splitlines() if line.startswith("| fedrir") and "clients)" not in line]
    paper = f"{run_methods.PAPER['fedrir_pathological']['fedrir']:.2f}"
    assert len(runs) == 4 and all(f"| {paper} |" in line for line in runs)


def test_one_seed_still_gets_the_paired_per_client_comparison(tmp_path, monkeypatch):
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path)
    (tmp_path / "t").mkdir()
    for method, per_client in (("fedrep", {"0": 0.9, "1": 0.8}), ("fedrir", {"0": 0.95, "1": 0.7})):
        record = {"setting": "fedrir_pathological", "method": method, "seed": 1, "rounds": 20, "local_epochs": 1,
                  "clients": 2, "final_accuracy": 0.85 if method == "fedrep" else 0.825, "best_accuracy": 0.9,
                  "best_round": 3, "final_per_client": per_client, "accuracy_curve": [0.1, 0.9], "majority_floor": 0.5,
                  "paper_accuracy": None, "wall_seconds": 1.0, "device": "cpu"}
        (tmp_path / "t" / f"fedrir_pathological__{method}__s1.json").write_text(json.dumps(record))
    row = next(line for line in run_methods.markdown_table("t").splitlines() if line.startswith("| fedrir (target) | 1 |"))
    assert "−2.50 (1/2 clients)" in row and "| 0/1 |" in row


#: top-level modules the lent GPU machine's image holds, of those the benchmark imports
#: (/work/.library/device/KINDS.md's package list; the rest come as wheels)
GPU_IMAGE_HAS = {"torch", "torchgen", "numpy", "yaml", "scipy", "sklearn", "matplotlib", "cuda", "cython_runtime",
                 "setuptools"}


def test_the_device_kit_carries_every_module_the_benchmark_imports_that_the_gpu_image_lacks():
    """What a GPU lease's run imports beyond the image comes from research/device_kit.sh's
    wheels; a new dependency of the simulation path would otherwise fail there, minutes in."""
    kit = (RESEARCH / "device_kit.sh").read_text()
    carried = set(re.search(r"PACKAGES=\(([^)]*)\)", kit).group(1).split())
    probe = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(_PATH.parent)!r}]
        import run_methods
        from edgepfl.config import RunConfig, parse_config
        from edgepfl.coordinator.simulate import simulate
        from edgepfl.metrics import read_metrics
        from edgepfl.data import client_indices, load_pool
        from edgepfl.methods import available_methods, create_method
        for name in available_methods():
            create_method(name)
        print(" ".join(sorted({{m.split(".")[0] for m in sys.modules}})))
    """)
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    # a private extension module a distribution installs (cryptography loads cffi's _cffi_backend) is
    # named by that distribution; other private names are the interpreter's own
    owners = importlib.metadata.packages_distributions()
    third_party = {owners[m][0].lower() if m.startswith("_") else m for m in loaded.stdout.split()
                   if m not in sys.stdlib_module_names and (not m.startswith("_") or m in owners)}
    missing = third_party - {"edgepfl", "run_methods", "seed_stats", "results_io"} - GPU_IMAGE_HAS - carried
    assert not missing, f"the GPU image lacks {sorted(missing)}: add them to PACKAGES in research/device_kit.sh"
    assert "pydantic" in third_party  # the probe saw the simulation's imports


#: every method the benchmark runs in some setting
BENCH_METHODS = sorted({m for methods in run_methods.ORDER.values() for m in methods})


@pytest.mark.slow
@needs_fmnist
@pytest.mark.parametrize("method", BENCH_METHODS)
def test_an_extended_run_is_the_longer_run_round_by_round(tmp_path, monkeypatch, method):
    """--extend is exact for every method: a run that goes on from a finished shorter run
    scores, round by round and client by client, as a run started with its length. A
    method whose rounds came to depend on the run's length (a schedule over ``rounds``) or
    whose final evaluation changed its state would fail here, and its extended rows
    (paper protocols continued from shorter runs) would be wrong."""
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)

    def run(tag: str, rounds: int, extend: str | None = None) -> dict:
        return run_methods.run_one("tiny", method, rounds, 1, 1, "cpu", tag, tmp_path, extend=extend)

    short, straight = run("short", 1), run("straight", 2)
    longer = run("longer", 2, extend="short")
    assert longer["extended_from"] == {"tag": "short", "rounds": 1} and straight["extended_from"] is None
    assert len(longer["accuracy_curve"]) == 3  # rounds 0, 1 and the final evaluation
    assert longer["accuracy_curve"] == straight["accuracy_curve"]
    assert longer["train_loss_curve"] == straight["train_loss_curve"]
    assert longer["final_per_client"] == straight["final_per_client"]
    assert longer["accuracy_curve"][0] == short["accuracy_curve"][0]


@pytest.mark.slow
@needs_fmnist
def test_extend_goes_on_only_from_a_shorter_run_and_leaves_it_as_it_was(worker):
    """The benchmark's worker with --extend: the new run's record says where it began, the
    shorter run's directory is untouched, and a run of another configuration or of as many
    rounds is refused with a one-line reason."""

    def run(tag: str, rounds: int, *extra: str, epochs: int = 1) -> subprocess.CompletedProcess:
        return worker.run("fedavg", tag, rounds, *extra, seed=1, epochs=epochs, timeout=300)

    assert run("short", 1).returncode == 0
    short_dir = worker.run_dir("fedavg", "short", seed=1)
    before = {p.relative_to(short_dir): p.read_bytes() for p in short_dir.rglob("*") if p.is_file()}
    done = run("longer", 2, "--extend", "short", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    record = worker.record("fedavg", "longer", seed=1)
    assert record["extended_from"] == {"tag": "short", "rounds": 1} and record["resumed"] is False
    assert "--extend short" in record["command"]
    assert {p.relative_to(short_dir): p.read_bytes() for p in short_dir.rglob("*") if p.is_file()} == before

    for tag, rounds, epochs in (("as_long", 1, 1), ("other_epochs", 2, 2)):
        refused = run(tag, rounds, "--extend", "short", epochs=epochs)
        assert refused.returncode != 0
        assert "is not a shorter run of this configuration" in refused.stderr


@needs_fmnist
def test_a_private_run_spends_its_epsilon_and_records_it_per_round(worker):
    """``--epsilon``: the run's config carries central DP with the smallest noise multiplier
    that keeps its rounds within ε, adaptive clipping on; the run's rows say ε per round and
    the last equals the budget (to the multiplier's 0.1 %)."""
    from edgepfl.config import RunConfig, parse_config
    from edgepfl.metrics import read_metrics
    from edgepfl.privacy import PrivacyAccountant

    run_methods.SETTINGS["tiny"] = TINY
    try:
        cfg = run_methods.run_config_dict("tiny", "fedavg", 3, 1, 0, "cpu", fraction=0.5, epsilon=3.0)
    finally:
        del run_methods.SETTINGS["tiny"]
    config = parse_config(RunConfig, cfg, "test")
    spent = PrivacyAccountant(config.privacy, [(4, 2)] * 3).epsilon()
    assert config.privacy.adaptive_clipping is not None and 2.99 <= spent <= 3.0
    done = worker.run("fedavg", "dp3", 3, "--epsilon", "3", "--fraction", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    record = worker.record("fedavg", "dp3")
    assert record["epsilon"] == 3.0 and "--epsilon 3" in record["command"]
    rows = [r for r in read_metrics(worker.run_dir("fedavg", "dp3")) if not r.final]
    assert [round(r.privacy.epsilon, 6) for r in rows] == [
        round(PrivacyAccountant(config.privacy, [(4, 2)] * k).epsilon(), 6) for k in (1, 2, 3)]
