"""``python -m ds_paci.tools.bench``: see :mod:`ds_paci.tools.bench`."""

import sys

from ds_paci.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
