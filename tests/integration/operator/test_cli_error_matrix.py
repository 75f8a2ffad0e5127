"""Every command against its bad inputs: one ``edgepfl: …`` line on stderr, no traceback,
the documented exit code (docs/OPERATING.md, "Exit codes").

The matrix runs each case as a subprocess; the config-level cases also run in-process
through ``main()`` (tests/unit/core/test_cli_errors.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.unit.core import test_cli_errors as unit
from tests.unit.core.test_cli_errors import _check, cases

# the unit tests' fixtures: pytest finds them here under their names
files = unit.files


def test_every_bad_input_is_one_line_and_an_exit_code(files):
    def run(case) -> str | None:
        env = dict(os.environ, OMP_NUM_THREADS="1", **case.env)
        env.pop("EDGEPFL_DEBUG", None)
        proc = subprocess.run([sys.executable, "-m", "edgepfl", *case.args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=files)
        try:
            _check(case, proc.returncode, proc.stderr)
        except AssertionError as exc:
            return str(exc)
        return None

    # each case is its own process, mostly importing: one per core at a time
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [failure for failure in pool.map(run, cases(files)) if failure is not None]
    assert not failures, "\n\n".join(failures)
