"""The main job: GPT-2 pipeline training on a real text corpus, with PACI or DeepSpeed's stock engine.

``launch/train.py`` is its entry point (``deepspeed --num_gpus 2 launch/train.py --deepspeed_config
configs/paci.json``). The job is a user of the engine like any other script: it imports ``ds_paci``'s
public facade, ``ds_paci.core`` (its checks, checkpoints, stops) and ``ds_paci.workload`` (model and
data); nothing in the package imports the job.

- :mod:`.options`: the command line, its exit codes, and the range of every flag;
- :mod:`.inputs`: everything a rank checks before any process group exists (the config by core's checks,
  the checkpoint folder, the corpus, the model's size), and the verdicts agreed across nodes;
- :mod:`.metrics`: what the job measures while it trains and where it writes it (the metrics file);
- :mod:`.summary`: the final summary, as the metrics record and as the printed lines;
- :mod:`.loop`: :class:`~.loop.TrainingLoop`, the steps, evaluations, saves and the agreed stop;
- :mod:`.job`: ``main``: one rank's job from the command line to its exit code;
- :mod:`.entry`: the exit policy of the script (the non-finite guard's code, a crash, a signal at start-up).
"""
