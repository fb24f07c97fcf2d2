"""``python -m rollart.cli``: the ``rollart`` command."""

import sys

from rollart.cli import main

sys.exit(main())
