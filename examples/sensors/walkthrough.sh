#!/usr/bin/env bash
# Your model, your sensors: a federation of smartwatches trains the user's own 1-D CNN
# (my_model.py) on real accelerometer + gyroscope windows (BasicMotions, shipped in the
# sensors extra's wheel), a new watch's torch-free head agent fits its head on its own CSV
# log, and the exported encoder names the new watch's windows with fit-head, predict and
# serve. examples/sensors/README.md explains every step.
#
#   bash examples/sensors/walkthrough.sh [WORK_DIR] [PORT]
#
# WORK_DIR (default ./walkthrough-sensors) receives every file; PORT (default: a free one)
# is the local Mosquitto's port; both may also come from the environment (WORK_DIR, PORT).
# ROUNDS=N overrides the config's rounds (the test runs a shorter federation). About a
# minute and a half on 2 cores.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
EDGEPFL="${EDGEPFL:-$REPO/.venv/bin/edgepfl}"     # what `bash scripts/setup.sh` installed
PYTHON="${PYTHON:-$(dirname "$EDGEPFL")/python}"   # only to cut the new watch's data and check answers
WORK="${1:-${WORK_DIR:-./walkthrough-sensors}}"
PORT="${2:-${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}}"
BROKER="mqtt://127.0.0.1:$PORT"
ROUNDS_OPTION=(${ROUNDS:+--rounds "$ROUNDS"})
export OMP_NUM_THREADS=1
# the trainers import my_model from here (model.arch: my_model:build); head agents never do
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
echo "== working in $WORK, broker $BROKER"

PIDS=()
cleanup() {  # newest first: the head agent, then the broker it talks through
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; wait "${PIDS[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

# --------------------------------------------------------------------------------------
# 0. The new watch's own data. The federation trains on BasicMotions' TRAIN split; the
#    TEST split's 40 windows are a watch it has never seen: 24 of them become the watch's
#    sensor log (one row per sample, columns ax..gz and the activity, a recording number
#    per window), the other 16 an npz of raw windows to classify.
# --------------------------------------------------------------------------------------
mkdir -p "$WORK/watch"
"$PYTHON" - "$WORK/watch" <<'PY'
import csv
import sys
from pathlib import Path

import numpy as np

from edgepfl.data import bundled_ts_files, read_ts

watch = Path(sys.argv[1])
try:
    (test_file,) = bundled_ts_files("BasicMotions_TEST")
except ValueError as exc:
    sys.exit(f"{exc}\n(run `bash scripts/setup.sh`, or pip install 'edgepfl[sensors]')")
x, y, classes = read_ts(test_file)
order = np.random.default_rng(0).permutation(len(y))
logged = np.sort(np.concatenate([order[y[order] == c][:6] for c in range(len(classes))]))
rest = np.setdiff1d(np.arange(len(y)), logged)
with (watch / "recordings.csv").open("w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["ax", "ay", "az", "gx", "gy", "gz", "activity", "recording"])
    for recording, i in enumerate(logged):
        for step in range(x.shape[2]):
            out.writerow([f"{v:.6f}" for v in x[i, :, step]] + [classes[y[i]], recording])
np.savez(watch / "new-windows.npz", x=x[rest], y=y[rest], class_names=np.array(classes))
print(f"watch/recordings.csv: {len(logged)} windows x 100 rows; watch/new-windows.npz: {len(rest)} windows "
      f"{x.shape[1:]}, raw values {x[rest].min():.1f}..{x[rest].max():.1f}")
PY

# --------------------------------------------------------------------------------------
# 1. A broker (plain MQTT on 127.0.0.1: a trial, not a deployment), and the new watch's
#    head agent: onnxruntime + scikit-learn, no torch, no my_model.py. It reads its CSV
#    log with its data.csv settings and waits for the federation's encoder.
# --------------------------------------------------------------------------------------
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$PORT" > "$WORK/mosquitto.conf"
"$MOSQUITTO" -c "$WORK/mosquitto.conf" > "$WORK/mosquitto.log" 2>&1 &
PIDS+=($!)

cat > "$WORK/watch/agent.yaml" <<YAML
agent_id: watch-new
federation: sensors
tier: head
head: lr
broker: {url: "$BROKER"}
data:
  dataset: csv
  root: recordings.csv
  csv: {label: activity, channels: [ax, ay, az, gx, gy, gz], segment: recording, window: 100, stride: 100,
        classes: [Standing, Running, Walking, Badminton]}
  num_clients: 1
  test_fraction: 0.25
state_dir: state
threads: 1
YAML
(cd "$WORK/watch" && exec "$EDGEPFL" agent --config agent.yaml) > "$WORK/watch/agent.log" 2>&1 &
PIDS+=($!)

# --------------------------------------------------------------------------------------
# 2. The federation: 4 trainer agents (data.num_clients) on BasicMotions' TRAIN split, each
#    with its own activity mix and sensor gain, train my_model's encoder with FedRep.
#    release_at_end publishes the encoder; min_head_agents=1 waits for the watch's report.
# --------------------------------------------------------------------------------------
echo "== edgepfl simulate --config examples/sensors/federation.yaml"
"$EDGEPFL" simulate --config "$HERE/federation.yaml" --broker "$BROKER" --out "$WORK/run" "${ROUNDS_OPTION[@]}" \
    --set min_head_agents=1 > "$WORK/federation.log" 2>&1 || { tail -n 30 "$WORK/federation.log" >&2; exit 1; }
grep -E "^final accuracy|^per-client|head-tier agents" "$WORK/federation.log"

# --------------------------------------------------------------------------------------
# 3. Export the run's encoder to ONNX (checked against torch), with its manifest: the input
#    contract (series 6 x 100, the per-channel normalization) every head-side command applies.
# --------------------------------------------------------------------------------------
echo "== edgepfl export --run run --out release"
"$EDGEPFL" export --run "$WORK/run" --out "$WORK/release"
ls "$WORK/release"

# --------------------------------------------------------------------------------------
# 4. Offline, on a laptop: fit the new watch's head on its CSV log, then name its other
#    windows (raw values in an npz) with onnxruntime alone.
# --------------------------------------------------------------------------------------
echo "== edgepfl fit-head --data watch/recordings.csv"
"$EDGEPFL" fit-head --encoder "$WORK/release/encoder.onnx" --data "$WORK/watch/recordings.csv" --head lr \
    --label activity --channels ax,ay,az,gx,gy,gz --segment recording --out "$WORK/watch/head.onnx"
echo "== edgepfl predict watch/new-windows.npz"
"$EDGEPFL" predict --encoder "$WORK/release/encoder.onnx" --head "$WORK/watch/head.onnx" --json \
    "$WORK/watch/new-windows.npz" > "$WORK/predictions.jsonl"
"$PYTHON" - "$WORK/predictions.jsonl" "$WORK/watch/new-windows.npz" <<'PY'
import json, sys
import numpy as np
answers = [json.loads(line) for line in open(sys.argv[1])]
data = np.load(sys.argv[2])
truth = [str(data["class_names"][i]) for i in data["y"]]
named = [a["predictions"][0]["class"] for a in answers]
right = sum(a == b for a, b in zip(named, truth))
print(f"== predict: {right} of {len(truth)} windows right ({100 * right / len(truth):.0f}%)")
sys.exit(len(named) != len(truth) or right < len(truth) // 2)
PY

# --------------------------------------------------------------------------------------
# 5. On the watch: its head agent installed the release and fitted its own head on its
#    log (the same kind of head as step 4, fitted on the agent's own training split).
#    `edgepfl serve` keeps that model loaded and answers one JSON line per request.
# --------------------------------------------------------------------------------------
echo "== the head agent's log"
grep -E "online|release" "$WORK/watch/agent.log" || { tail -n 30 "$WORK/watch/agent.log" >&2; exit 1; }
echo "== echo watch/new-windows.npz | edgepfl serve --state watch/state"
echo "$WORK/watch/new-windows.npz" | "$EDGEPFL" serve --state "$WORK/watch/state" > "$WORK/served.jsonl"
read -r ENCODER HEAD < <("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["encoder_file"], r["head_file"])' "$WORK/watch/state/release.json")
"$EDGEPFL" predict --encoder "$WORK/watch/state/$ENCODER" --head "$WORK/watch/state/$HEAD" --json \
    "$WORK/watch/new-windows.npz" > "$WORK/agent-predictions.jsonl"
"$PYTHON" - "$WORK/served.jsonl" "$WORK/agent-predictions.jsonl" <<'PY'
import json, sys
answer = json.loads(open(sys.argv[1]).read())
assert "error" not in answer, answer
served = [r["predictions"][0]["class"] for r in answer["results"]]
predicted = [json.loads(line)["predictions"][0]["class"] for line in open(sys.argv[2])]
assert served == predicted, f"serve and predict disagree: {served} vs {predicted}"
print(f"== served {len(served)} windows in {answer['ms']:.0f} ms with release {answer['release_id'][:20]}, "
      f"as predict named them with the agent's head")
PY
echo "== the sensors walk-through completed"
