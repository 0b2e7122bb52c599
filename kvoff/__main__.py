"""``python -m kvoff``: the same as the ``kvoff`` console script."""

import sys

from kvoff.cli import main

sys.exit(main())
