"""``python -m offload``: the same as the ``offload`` console script."""

import sys

from offload.cli import main

sys.exit(main())
