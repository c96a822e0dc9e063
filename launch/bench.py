"""Side-by-side benchmark of DeepSpeed's stock pipeline engine and PACI (same as ``python -m ds_paci.bench``).

    python launch/bench.py --preset headline --out docs/results
    python launch/bench.py --preset smoke --out /tmp/bench

See ``ds_paci/bench.py`` for what is measured and how.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_paci.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
