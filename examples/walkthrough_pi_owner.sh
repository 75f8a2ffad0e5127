#!/usr/bin/env bash
# The Raspberry Pi owner's day: a torch-free head agent joins a federation, receives its
# encoder release, fits a personal head on the owner's own labelled photos, and
# `edgepfl predict` names new photos with the owner's class names; `edgepfl serve` answers
# them again from the model kept loaded.
#
#   bash examples/walkthrough_pi_owner.sh [WORK_DIR] [PORT]
#
# WORK_DIR (default ./walkthrough-pi) receives every file; PORT (default: a free one) is
# the local broker's port; both may also come from the environment (WORK_DIR, PORT).
# Needs Fashion-MNIST (`bash scripts/setup.sh` installs it as root): the federation
# trains on it, and its images stand in for the owner's photos. About a minute on 2 cores.
#
# The owner's classes are Trouser, Sandal and Bag. Their folders sort as Bag, Sandal,
# Trouser (local labels 0, 1, 2), the reverse of the federation's order (Trouser is its
# class 1, Sandal 5, Bag 8): the head records each class's name, so predictions come out
# right whatever the order.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
EDGEPFL="${EDGEPFL:-$REPO/.venv/bin/edgepfl}"     # what `bash scripts/setup.sh` installed
PYTHON="$REPO/.venv/bin/python"                   # only to make the stand-in photos and pick a port
WORK="${1:-${WORK_DIR:-./walkthrough-pi}}"
PORT="${2:-${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}}"
BROKER="mqtt://127.0.0.1:$PORT"
FEDERATION=pi-walkthrough
export OMP_NUM_THREADS=1

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
echo "== working in $WORK, broker $BROKER"

PIDS=()
cleanup() {  # newest first: the agents and the coordinator, then the broker they talk through
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; wait "${PIDS[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

# --------------------------------------------------------------------------------------
# 0. Stand-ins. In real life the federation already runs somewhere (the operator's
#    walk-through sets one up over TLS) and the photos come from the Pi's camera. Here:
#    a local broker (plain MQTT on 127.0.0.1: a trial, not a deployment) and photos cut
#    from Fashion-MNIST's test images, the ones the federation does not train on.
# --------------------------------------------------------------------------------------
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$PORT" > "$WORK/mosquitto.conf"
"$MOSQUITTO" -c "$WORK/mosquitto.conf" > "$WORK/mosquitto.log" 2>&1 &
PIDS+=($!)

"$PYTHON" - "$WORK" <<'PY'
"""photos/<class>/*.png to train on, and to-classify/<class>-NNN.png (other images) to predict."""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from edgepfl.config import DataSpec
from edgepfl.data import fmnist_available, load_pool

if not fmnist_available():
    sys.exit("Fashion-MNIST is not installed: run `bash scripts/setup.sh` as root (apt-get install dataset-fashion-mnist)")
work = Path(sys.argv[1])
pool = load_pool(DataSpec(dataset="fmnist"))
test_images = np.arange(60_000, len(pool.y))  # the federation's clients draw from all; few reach these
for name in ("Trouser", "Sandal", "Bag"):
    picks = test_images[pool.y[test_images] == pool.class_names.index(name)][-100:]
    (work / "photos" / name).mkdir(parents=True, exist_ok=True)
    (work / "to-classify").mkdir(exist_ok=True)
    for i, idx in enumerate(picks):
        pixels = np.round(np.asarray(pool.pixels[idx][0], dtype=np.float32) * 255).astype(np.uint8)
        target = work / "photos" / name / f"{i:03d}.png" if i < 80 else work / "to-classify" / f"{name}-{i:03d}.png"
        Image.fromarray(pixels, mode="L").save(target)
PY
echo "photos:      $(ls "$WORK/photos" | tr '\n' ' ')($(find "$WORK/photos" -name '*.png' | wc -l) images)"
echo "to classify: $(ls "$WORK/to-classify" | wc -l) images, named after their true class"

# --------------------------------------------------------------------------------------
# 1. On the Pi: `pip install './edgepfl-0.1.0-py3-none-any.whl[agent]' pillow` (the wheel, no
#    torch), then one config. tier: head = receive releases, fit a head on local data.
#    dataset: imagefolder = one folder per class; the whole folder is this device's data,
#    a quarter of it held out to measure the accuracy the agent reports.
# --------------------------------------------------------------------------------------
mkdir -p "$WORK/pi"
cat > "$WORK/pi/agent.yaml" <<YAML
agent_id: pi-kitchen-01
federation: $FEDERATION
tier: head
head: svm
broker: {url: "$BROKER"}
data:
  dataset: imagefolder
  root: ../photos
  num_clients: 1
  test_fraction: 0.25
state_dir: state
threads: 1
YAML
(cd "$WORK/pi" && exec "$EDGEPFL" agent --config agent.yaml) > "$WORK/pi/agent.log" 2>&1 &
PIDS+=($!)

# --------------------------------------------------------------------------------------
# 2. The federation (stand-in): a coordinator and 2 trainer agents on Fashion-MNIST for
#    2 rounds; release_at_end publishes the encoder (retained) to head agents and waits
#    for their reports. The Pi, online, gets it at once.
# --------------------------------------------------------------------------------------
cat > "$WORK/federation.yaml" <<YAML
federation: $FEDERATION
method: {name: fedavg}
model: {arch: cnn, feature_dim: 32}
train: {epochs: 1, batch_size: 32, lr: 0.05, momentum: 0.5}
data: {dataset: fmnist, samples_per_client: 200, partition: {kind: dirichlet, alpha: 0.5}}
rounds: 2
round_timeout_s: 90
wait_for_agents_s: 120
release_at_end: true
device: cpu
YAML
"$EDGEPFL" simulate --config "$WORK/federation.yaml" --agents 2 --broker "$BROKER" --out "$WORK/run" \
    > "$WORK/federation.log" 2>&1 || { tail -n 30 "$WORK/federation.log" >&2; exit 1; }

# --------------------------------------------------------------------------------------
# 3. Back on the Pi: the agent's log says what it did with the release.
# --------------------------------------------------------------------------------------
echo "== the head agent's log"
grep -E "online|release" "$WORK/pi/agent.log" || { tail -n 30 "$WORK/pi/agent.log" >&2; exit 1; }
# state/release.json (written last) names the installed encoder and head files
read -r ENCODER HEAD < <("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["encoder_file"], r["head_file"])' "$WORK/pi/state/release.json")
ls "$WORK/pi/state"

# --------------------------------------------------------------------------------------
# 4. Predict new photos with the Pi's encoder and head, onnxruntime only. predict prints
#    the class names the head recorded (the owner's folder names). Each file here is
#    named after its true class, so we can count how many came out right.
# --------------------------------------------------------------------------------------
echo "== edgepfl predict --encoder pi/state/$ENCODER --head pi/state/$HEAD to-classify/"
"$EDGEPFL" predict --encoder "$WORK/pi/state/$ENCODER" --head "$WORK/pi/state/$HEAD" "$WORK/to-classify" \
    | tee "$WORK/predictions.tsv"
# each line: path<TAB>class probability
awk -F'\t' '{ n = split($1, p, "/"); truth = p[n]; sub(/-[0-9]+\.png$/, "", truth);
              split($2, top, " "); total++; if (top[1] == truth) right++ }
            END { printf "== right: %d of %d (%.0f%%)\n", right, total, 100 * right / total;
                  exit (total == 0 || right < 0.8 * total) }' "$WORK/predictions.tsv"

# --------------------------------------------------------------------------------------
# 5. Serve: the model kept loaded, one JSON answer per request line, following the
#    agent's next release without a restart (on the Pi, as the owner's own user in group
#    edgepfl: examples/README.md). The same photos, as one request.
# --------------------------------------------------------------------------------------
echo "== echo to-classify/ | edgepfl serve --state pi/state"
echo "$WORK/to-classify" | "$EDGEPFL" serve --state "$WORK/pi/state" > "$WORK/served.jsonl"
"$PYTHON" - "$WORK/served.jsonl" "$WORK/predictions.tsv" "$WORK/pi/state/release.json" <<'PY'
import json, sys
answer = json.loads(open(sys.argv[1]).read())
predicted = [line.split("\t")[1].split(" ")[0] for line in open(sys.argv[2]).read().splitlines()]
served = [r["predictions"][0]["class"] for r in answer["results"]]
assert answer["release_id"] == json.load(open(sys.argv[3]))["release_id"], answer.get("error", answer)
assert served == predicted, "serve and predict disagree"
print(f"== served {len(served)} photos in {answer['ms']:.0f} ms with release {answer['release_id'][:12]}, as predict named them")
PY
echo "== the Pi owner's walk-through completed"
