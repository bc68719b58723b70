"""``python -m slimcaching.runtime.node NAME ...``: one node process (see :mod:`.process`)."""

import os
import sys

from slimcaching.runtime.node.process import main

if __name__ == "__main__":  # pragma: no cover
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the sockets are closed and nothing is left to write: skip the interpreter's teardown (over a
    # second with torch loaded), so a node is gone at once when its launcher stops it
    os._exit(code)
