"""``python -m mismatch_monitor.cli``: the same as the ``mismatch-monitor`` command."""

import sys

from . import main

sys.exit(main())
