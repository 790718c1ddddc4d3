"""`python -m benchmarks.catalog`: see the package's docstring."""

import sys

from benchmarks.catalog.run import main

if __name__ == "__main__":
    sys.exit(main())
