"""``python -m ds_paci.tools.studies.quality``: see :mod:`ds_paci.tools.studies.quality.cli`."""

import sys

from .cli import main

sys.exit(main())
