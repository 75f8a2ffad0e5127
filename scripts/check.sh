#!/usr/bin/env bash
# Static checks: ruff (lint) and mypy (types); exits non-zero if either fails.
#
#   bash scripts/check.sh          both
#   bash scripts/check.sh ruff     ruff only
#   bash scripts/check.sh mypy     mypy only
#
# EDGEPFL_VENV=path: the virtual environment with ruff and mypy (default: .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
BIN="${EDGEPFL_VENV:-.venv}/bin"
[[ "$BIN" = /* ]] || BIN="$ROOT/$BIN"
what="${1:-all}"

run_ruff() {
  "$BIN/ruff" check .
}

run_mypy() {
  # mypy does not run the editable install's import hook, so it would not see
  # coordinator/ as edgepfl.coordinator (pyproject.toml, [tool.mypy]). Rebuild the
  # installed layout as symlinks on every run, so added or removed modules are seen.
  local tree="$ROOT/build/mypy"
  rm -rf "$tree/edgepfl"
  mkdir -p "$tree/edgepfl"
  local entry
  for entry in "$ROOT"/edgepfl/*; do
    [ "$(basename "$entry")" = "__pycache__" ] || ln -s "$entry" "$tree/edgepfl/"
  done
  for app in coordinator edge_agent export; do
    ln -s "$ROOT/$app" "$tree/edgepfl/$app"
  done
  # Errors name files as mypy sees them (edgepfl/coordinator/rounds.py); print the
  # repository path (coordinator/rounds.py) instead.
  (cd "$tree" && "$BIN/mypy" --config-file "$ROOT/pyproject.toml") \
    | sed -E 's#^edgepfl/(coordinator|edge_agent|export)/#\1/#'
}

status=0
case "$what" in
  all) run_ruff || status=1; run_mypy || status=1 ;;
  ruff) run_ruff || status=1 ;;
  mypy) run_mypy || status=1 ;;
  *) echo "usage: $0 [ruff|mypy]" >&2; exit 2 ;;
esac
exit "$status"
