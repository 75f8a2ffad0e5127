#!/usr/bin/env bash
# The operator's day: provision a federation, start its broker, coordinator and agents
# over TLS with signed messages, watch it with `edgepfl status`, read the report.
#
#   bash examples/walkthrough_operator.sh [WORK_DIR] [PORT]
#
# WORK_DIR (default ./walkthrough-operator, must not exist or be empty) receives every
# file; PORT (default: a free one) is the broker's TLS port. Both may also come from the
# environment as WORK_DIR and PORT. Runs in 1-2 minutes on 2 cores: 2 trainer agents and
# 1 head agent (a Raspberry Pi in real life) on scikit-learn's digits, 3 rounds.
# Everything runs on this machine; the comments say which machine each step belongs to.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
EDGEPFL="${EDGEPFL:-$REPO/.venv/bin/edgepfl}"     # what `bash scripts/setup.sh` installed
PYTHON="$REPO/.venv/bin/python"                   # only to pick a free port and read JSON
WORK="${1:-${WORK_DIR:-./walkthrough-operator}}"
PORT="${2:-${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}}"
FEDERATION=walkthrough
export OMP_NUM_THREADS=1                          # a small box: one thread per process

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
echo "== working in $WORK, broker port $PORT"

# Every process started in the background is stopped when the script ends, however it ends.
PIDS=()
cleanup() {  # newest first: the agents and the coordinator, then the broker they talk through
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; wait "${PIDS[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

# --------------------------------------------------------------------------------------
# 1. Provision (administrator's machine): a private CA, the broker's certificate and
#    configuration, an ACL, and one bundle per client: the coordinator, each agent, and a
#    read-only operator bundle for `edgepfl status`. Each client gets a certificate (its
#    MQTT identity) and an Ed25519 key that signs its messages.
# --------------------------------------------------------------------------------------
"$EDGEPFL" provision --federation "$FEDERATION" --agents trainer-01,trainer-02,pi-01 \
    --broker-host localhost --port "$PORT" --out "$WORK/fleet"
ls "$WORK/fleet" "$WORK/fleet/agents"

# --------------------------------------------------------------------------------------
# 2. Start Mosquitto (broker host) from the generated configuration.
# --------------------------------------------------------------------------------------
CONF="$WORK/fleet/broker/mosquitto.conf"
if [ "$(id -u)" = "0" ]; then
  # Started as root, Mosquitto switches to the user 'mosquitto', which cannot read the
  # broker's private key here. A packaged broker runs as that user and owns its files;
  # for this trial we keep it root, in a copy of the configuration.
  cp "$CONF" "$WORK/mosquitto-trial.conf"
  echo "user root" >> "$WORK/mosquitto-trial.conf"
  CONF="$WORK/mosquitto-trial.conf"
fi
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
"$MOSQUITTO" -c "$CONF" > "$WORK/mosquitto.log" 2>&1 &
PIDS+=($!)
sleep 1

# --------------------------------------------------------------------------------------
# 3. The coordinator (data center). The bundle's coordinator.yaml holds its identity,
#    broker and signing key; add what to train. release_at_end: after the last round the
#    encoder goes out as an ONNX release to head agents, which report their accuracy.
# --------------------------------------------------------------------------------------
cat >> "$WORK/fleet/coordinator/coordinator.yaml" <<'YAML'
method: {name: fedavg}
model: {arch: mlp, feature_dim: 32}
train: {epochs: 1, batch_size: 32, lr: 0.05, momentum: 0.5}
data: {dataset: digits, num_clients: 3}
rounds: 3
round_timeout_s: 60
wait_for_agents_s: 120
release_at_end: true
device: cpu
YAML
(cd "$WORK/fleet/coordinator" && exec "$EDGEPFL" coordinator --config coordinator.yaml --out "$WORK/run") \
    > "$WORK/coordinator.log" 2>&1 &
COORDINATOR=$!
PIDS+=($COORDINATOR)

# --------------------------------------------------------------------------------------
# 4. The agents (each on its own device; copy fleet/agents/<id>/ there). Add the
#    device's data and tier to its agent.yaml and start it from its bundle folder: the
#    bundle's paths (certificates, keys, state/) are relative to it.
# --------------------------------------------------------------------------------------
for i in 1 2; do
  cat >> "$WORK/fleet/agents/trainer-0$i/agent.yaml" <<YAML
tier: trainer
data: {dataset: digits, num_clients: 3}
client_index: $((i - 1))
device: cpu
threads: 1
YAML
done
# The Pi: torch-free head tier (onnxruntime + scikit-learn); it fits an SVM head on each release.
cat >> "$WORK/fleet/agents/pi-01/agent.yaml" <<'YAML'
tier: head
head: svm
data: {dataset: digits, num_clients: 3}
client_index: 2
threads: 1
YAML
for agent in trainer-01 trainer-02 pi-01; do
  (cd "$WORK/fleet/agents/$agent" && exec "$EDGEPFL" agent --config agent.yaml) > "$WORK/$agent.log" 2>&1 &
  PIDS+=($!)
done

# --------------------------------------------------------------------------------------
# 5. Watch it (anywhere): `edgepfl status` reads the coordinator's retained fleet view
#    with the operator bundle, whose credentials may read that one topic and nothing else.
#    We poll until a round has completed with every agent online, then show the view.
# --------------------------------------------------------------------------------------
STATUS=(status --config "$WORK/fleet/operator/operator.yaml")
for _ in $(seq 1 120); do
  kill -0 "$COORDINATOR" 2>/dev/null || break
  if "$EDGEPFL" "${STATUS[@]}" --json --timeout 2 > "$WORK/status.json" 2>/dev/null \
      && "$PYTHON" -c 'import json, sys; v = json.load(open(sys.argv[1]))
sys.exit(not (v["rounds_completed"] >= 1 and v["online"].get("trainer") == 2 and v["online"].get("head") == 1))' \
      "$WORK/status.json"; then
    break
  fi
  sleep 1
done
echo "== edgepfl ${STATUS[*]} --json"
cat "$WORK/status.json"
echo
echo "== edgepfl ${STATUS[*]}"
"$EDGEPFL" "${STATUS[@]}" --timeout 5 || true

# --------------------------------------------------------------------------------------
# 6. The end of the run: the coordinator exits after the release and the head agent's
#    report; `edgepfl report` rebuilds the table and plots from the run directory.
# --------------------------------------------------------------------------------------
if ! wait "$COORDINATOR"; then
  echo "the coordinator failed; its log:" >&2
  tail -n 30 "$WORK/coordinator.log" >&2
  exit 1
fi
echo "== edgepfl report --run $WORK/run"
"$EDGEPFL" report --run "$WORK/run"
ls "$WORK/run"
echo "== the operator's walk-through completed"
