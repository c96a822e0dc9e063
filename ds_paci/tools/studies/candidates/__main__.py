"""``python -m ds_paci.tools.studies.candidates``: see :mod:`ds_paci.tools.studies.candidates.study`."""

import sys

from .study import main

sys.exit(main())
