"""``python -m edgepfl``: the ``edgepfl`` command."""

import sys

from edgepfl.cli import main

sys.exit(main())
