"""``python -m plugrt`` is the ``plugrt`` command."""

import sys

from .cli import main

sys.exit(main())
