"""``python -m ds_paci.tools.quality``: see :mod:`ds_paci.tools.quality.cli`."""

import sys

from .cli import main

sys.exit(main())
