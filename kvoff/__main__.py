"""``python -m kvoff``: the same as the ``kvoff`` console script."""

import sys

from kvoff.tools.cli import main

sys.exit(main())
