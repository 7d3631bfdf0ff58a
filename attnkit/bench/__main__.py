"""``python -m attnkit.bench``: the same options as ``attnkit bench``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
