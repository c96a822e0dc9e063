"""``python -m ds_paci.run SCRIPT.py [args]``: run an unmodified DeepSpeed script on the PACI engine.

A thin entry point; the runner and its contract live in :mod:`ds_paci.integrations.runner`.
"""

import sys

from ds_paci.integrations.runner import main

if __name__ == "__main__":
    sys.exit(main())
