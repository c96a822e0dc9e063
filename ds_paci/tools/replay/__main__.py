"""``python -m ds_paci.tools.replay``: the replay's command line (see :mod:`.cli`)."""
import sys

from .cli import main

sys.exit(main())
