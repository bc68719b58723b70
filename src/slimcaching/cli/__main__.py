"""``python -m slimcaching.cli``: the same as the ``slimcaching`` command."""

import sys

from slimcaching.cli import main
from slimcaching.cli.common import finish

sys.exit(finish(main()))
