#!/usr/bin/env bash
# What a lent GPU machine needs to run research/run_methods.py, prepared here.
#
#   bash research/device_kit.sh prepare   here: wheels into .whl/, Fashion-MNIST into .benchdata/
#   bash research/device_kit.sh install   there: the wheels into /tmp/site (then PYTHONPATH=/tmp/site)
#
# The GPU machine's image has torch, numpy, PyYAML and scikit-learn but not pydantic, and
# nothing can be fetched there; its Python is 3.12 on x86-64 (see the device tool's notes).
# So `prepare` downloads pydantic's wheels for that interpreter, at the versions this
# checkout's venv runs, and copies the four IDX files the runs read (`--data-root
# .benchdata`). Both folders are git-ignored; name them in the call's `carry` list:
#
#   carry: [".whl", ".benchdata"]
#   command: bash research/device_kit.sh install && export PYTHONPATH=/tmp/site && \
#            OMP_NUM_THREADS=1 timeout 540 python3 research/run_methods.py ... \
#            --device cuda --data-root .benchdata --jobs 16 --skip-done --resume; \
#            tar czf $OUT/results.tgz research/results/<tag>
#
# Run directories live under runs/ (ignored), which the machine keeps between calls as
# long as it stays warm, so `--resume` continues there; results come back in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

# the simulation's imports the image lacks (the rest of the list is pydantic's own needs;
# cryptography for the signed protocol's keys, and the cffi backend its Rust bindings load)
PACKAGES=(pydantic pydantic_core annotated_types typing_inspection typing_extensions cryptography cffi)
PY_VERSION=3.12

prepare() {
  local venv="${EDGEPFL_VENV:-.venv}" data="${EDGEPFL_FMNIST_ROOT:-/usr/share/datasets/fashion-mnist}"
  [ -x "$venv/bin/python" ] || { echo "device_kit: no venv at $venv (bash scripts/setup.sh first)" >&2; exit 1; }
  local pins=() name version
  for name in "${PACKAGES[@]}"; do
    version=$("$venv/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("${name//_/-}==$version")
  done
  rm -rf .whl && mkdir -p .whl
  # one manylinux tag per pip call matches exactly, so offer the range wheels are built for
  local platforms=() n
  for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
  # the set must be closed: resolve pydantic from these wheels alone, for the target interpreter
  "$venv/bin/python" -m pip install -q --dry-run --ignore-installed --no-index --find-links .whl \
    --only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${platforms[@]}" \
    --target /tmp/device-kit-check "${pins[0]}"
  rm -rf .benchdata && mkdir -p .benchdata
  cp "$data"/{train,t10k}-{images-idx3,labels-idx1}-ubyte* .benchdata/
  echo "device_kit: ${pins[*]} -> .whl ($(du -sh .whl | cut -f1)); Fashion-MNIST -> .benchdata ($(du -sh .benchdata | cut -f1))"
}

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site python3 -c "import pydantic, torch; print('device_kit: pydantic', pydantic.VERSION, \
'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
}

case "${1:-}" in
  prepare) prepare ;;
  install) install ;;
  *) sed -n '2,5p' "$0" >&2; exit 2 ;;
esac
