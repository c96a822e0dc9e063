"""``python -m ds_paci.tools.replay``: the replay's command line (see :mod:`.replayer`)."""
import sys

from .replayer import main

sys.exit(main())
