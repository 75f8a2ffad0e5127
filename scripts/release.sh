#!/usr/bin/env bash
# Build a release: the sdist and the wheel, checked the way an index would check them.
#
#   bash scripts/release.sh [OUT]      # OUT defaults to the repository's dist/
#
# 1. `python -m build` makes the sdist, then the wheel from the sdist (so the sdist is
#    complete enough to build), in an isolated environment with setuptools from the index;
# 2. `twine check --strict` refuses a description PyPI would not render, or missing metadata;
# 3. the wheel must hold every package pyproject.toml lists and nothing of tests/, research/
#    or benchmarks/, and, installed on its own (its dependencies from the running
#    environment), import its apps and print this version.
# Prints the two paths, one per line, on success; exit 1 with the failing step's output
# otherwise. Uploading is a separate, deliberate step (`twine upload OUT/*`), never done here.
set -euo pipefail
out=$(realpath -m "${1:-$(dirname "$0")/../dist}")
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute, not resolved: a venv's python is a link
version=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')

fail() { echo "release: $*" >&2; exit 1; }

[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || \
  echo "release: warning: the work tree has uncommitted changes; the artifacts contain them" >&2

mkdir -p "$out"
sdist="$out/edgepfl-$version.tar.gz"
wheel="$out/edgepfl-$version-py3-none-any.whl"
rm -f "$sdist" "$wheel"
"$python" -m build --outdir "$out" . >"$out/build.log" 2>&1 || \
  { tail -20 "$out/build.log" >&2; fail "python -m build failed (log: $out/build.log)"; }
[ -f "$sdist" ] && [ -f "$wheel" ] || fail "the build made no $sdist and $wheel (log: $out/build.log)"

"$python" -m twine check --strict "$sdist" "$wheel" >&2 || fail "twine check refused the artifacts"

"$python" - "$wheel" <<'EOF' || fail "the wheel's contents are wrong"
import sys, tomllib, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
packages = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"]
missing = [p for p in packages if p.replace(".", "/") + "/__init__.py" not in names]
stray = [n for n in names if n.split("/")[0] in {"tests", "research", "benchmarks", "runs"}]
if missing or stray:
    sys.exit(f"release: the wheel lacks {missing} or holds {stray[:5]}")
EOF

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$python" -m pip install --quiet --no-deps --target "$site" "$wheel" >&2 || fail "pip cannot install $wheel"
# run from inside the wheel's files, so that they, not this checkout, are what imports
got=$(cd "$site" && PYTHONPATH="$site" "$python" -c '
import os, edgepfl, edgepfl.coordinator, edgepfl.edge_agent, edgepfl.export
from edgepfl.cli import main
assert edgepfl.__file__.startswith(os.getcwd()), f"imported {edgepfl.__file__}, not the wheel"
main(["--version"])' 2>&1) || fail "the installed wheel does not start: $got"
[ "$got" = "edgepfl $version" ] || fail "the installed wheel says '$got', not 'edgepfl $version'"

echo "$sdist"
echo "$wheel"
