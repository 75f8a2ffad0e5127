#!/usr/bin/env bash
# Set up edgepfl on a fresh machine: system packages (when root), a virtual
# environment in .venv, and the package with its extras. Idempotent: re-running
# only installs what is missing.
#
#   bash scripts/setup.sh           what edgepfl and its examples run: mosquitto and Fashion-MNIST
#                                   (apt), the agent, train and sensors extras
#   bash scripts/setup.sh --tests   also what only the test suite uses: RabbitMQ, nftables, faketime,
#                                   systemd-container, chromium, debootstrap, qemu-user-static (apt) and
#                                   the dev extra (pytest, ruff, mypy)
#
#   EDGEPFL_VENV=path   where the virtual environment goes (default: .venv)
#   EDGEPFL_EXTRAS=...  which extras to install (default: agent,train,sensors; with --tests: all)
#
# Exits 3 when the disk has too little room for torch (see the check below).
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=0
for arg in "$@"; do
  case "$arg" in
    --tests) TESTS=1 ;;
    *) echo "setup: unknown argument $arg (the one option is --tests)" >&2; exit 2 ;;
  esac
done
VENV="${EDGEPFL_VENV:-.venv}"
if [ "$TESTS" = 1 ]; then EXTRAS="${EDGEPFL_EXTRAS:-all}"; else EXTRAS="${EDGEPFL_EXTRAS:-agent,train,sensors}"; fi
PY="${PYTHON:-python3}"

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need_apt+=(dataset-fashion-mnist)
if [ "$TESTS" = 1 ]; then
  # RabbitMQ: the broker-cluster tests (tests/integration/broker/test_topologies_live.py) run a real cluster.
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || command -v rabbitmq-server >/dev/null 2>&1 || need_apt+=(rabbitmq-server)
  # nftables: the idle-socket test (tests/integration/security/test_idle_sockets.py) loads provision's firewall.nft.
  command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || need_apt+=(nftables)
  command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)  # tests/integration/security/test_clock_skew.py
  # systemd-nspawn: tests/integration/operator/test_systemd_unit.py boots this OS under a real systemd
  command -v systemd-nspawn >/dev/null 2>&1 || need_apt+=(systemd-container)
  # chromium: tests/integration/operator/test_dashboard.py reads the dashboard in a real headless browser
  command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
  # debootstrap + qemu-user: tests/integration/agent/test_offline_install_arm64.py installs the
  # documented offline wheelhouse into a Debian arm64 root and runs predict there
  command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need_apt+=(debootstrap)
  command -v qemu-aarch64-static >/dev/null 2>&1 || need_apt+=(qemu-user-static)
  command -v update-binfmts >/dev/null 2>&1 || [ -x /usr/sbin/update-binfmts ] || need_apt+=(binfmt-support)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]} (apt)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: not root (or no apt): please install ${need_apt[*]} yourself; continuing" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# No wheel cache: where torch comes from the registry it brings several GB of CUDA wheels,
# and a cached copy of each would double what the install needs on disk.
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)

if [[ "$EXTRAS" == *all* || "$EXTRAS" == *train* ]] && ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  # The one exact pin: on x86_64 with Python 3.11 these wheels are the ones known to
  # install side by side (see docs/OPERATING.md, "Installing"); elsewhere pyproject's ranges decide.
  if [ "$(uname -m)" = "x86_64" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    # These are CUDA builds: about 5.6 GB in the venv, and where pip has to download them
    # about 3 GB more under TMPDIR while it installs. Say so up front instead of failing
    # half-way with pip's "No space left on device".
    "$VENV/bin/python" - "$VENV" "${TMPDIR:-/tmp}" <<'PYCHECK' || exit 3
import os, shutil, sys
venv, tmp = sys.argv[1], sys.argv[2]
need = {venv: 6.0, tmp: 3.0}
if os.stat(venv).st_dev == os.stat(tmp).st_dev:
    need = {venv: 9.0}
for where, gib in need.items():
    free = shutil.disk_usage(where).free / 2**30
    if free < gib:
        sys.exit(f"setup: torch needs about {gib:.0f} GiB free under {where}, and {free:.1f} GiB is; "
                 f"free some space, or set EDGEPFL_VENV (and TMPDIR) to a bigger disk")
PYCHECK
    echo "setup: installing torch 2.14.1 + torchvision 0.29.1" >&2
    "${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1"
  fi
fi
echo "setup: installing edgepfl[$EXTRAS]" >&2
"${PIP[@]}" -e ".[$EXTRAS]"
echo "setup: done ($VENV)" >&2
