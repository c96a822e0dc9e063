"""The main job: GPT-2 pipeline training on a real text corpus, with PACI or DeepSpeed's stock engine.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/paci.json    # PACI
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/flush.json   # stock 1F1B-flush

The same script runs both: ``ds_paci.initialize`` returns the PACI engine when the
config has ``"paci": {"enabled": true}`` and DeepSpeed's own engine otherwise.
The job itself is the package ``ds_paci.mainjob`` (flags: ``--help``); this file is its entry point.
"""

import os
import sys

if __name__ == "__main__":
    try:
        from ds_paci.mainjob.entry import run_script
    except KeyboardInterrupt:  # SIGINT while the job is imported (start-up), as run_script ends one
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + 2)
    run_script()
