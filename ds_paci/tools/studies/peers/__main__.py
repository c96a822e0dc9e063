"""``python -m ds_paci.tools.studies.peers``: PACI against torch's synchronous schedules (see :mod:`.study`)."""
import sys

from .study import main

sys.exit(main())
