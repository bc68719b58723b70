"""``python -m slimcaching.cli``: the same as the ``slimcaching`` command."""

import sys

from slimcaching.cli import main

sys.exit(main())
