"""Kill the main job at random moments during checkpoint saves; every following ``--resume`` must succeed.

    python -m ds_paci.tools.studies.savekill --kills 20          # the full check (about 20 s per kill on 2 cores)
    python -m ds_paci.tools.studies.savekill --kills 2 --seed 3  # a quick one

Each round launches ``deepspeed --num_gpus 2 launch/train.py`` (2 stages, a tiny GPT-2, a
small corpus, ``--save-interval 1`` so that most of the run is saving) into one checkpoint
folder, resuming from it after the first round. It waits until the run has saved once,
then watches the folder: as soon as a save's staging folder appears, it waits a random
``U(0, --max-delay)`` seconds and SIGKILLs a random rank (``kill -9``, so nothing of the
rank runs after it). The next round's ``--resume`` must print ``resumed from`` with the
step of the checkpoint ``latest`` named after the kill, and train on. A final round
resumes and runs to its end (exit 0). The summary counts kills, kills that landed while
the save was still in progress (its staging folder still existed at the kill), successful
resumes and fallbacks, and is written as JSON with ``--out``.

Launching goes through :class:`ds_paci.tools.processes.launched.Launched`, as in the fault tests.
"""

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time

from ..processes.launched import ROOT, Launched  # noqa: F401  (ROOT: the tests import it from here)
from ..processes.world import free_port
TRAIN = os.path.join("launch", "train.py")
TINY = ["--tokenizer", "byte", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
        "--eval-interval", "0", "--eval-batches", "1"]


def small_corpus(path, chars=120_000):
    """A slice of the first Shakespeare play as one text file (fast to tokenize)."""
    if not os.path.exists(path):
        from ds_paci.workload.data import load_corpus
        with open(path, "w") as f:
            f.write(load_corpus()[0].text[:chars])
    return path


class Run(Launched):
    """One ``deepspeed`` launch of the main job in its own session; output collected line by line."""

    def __init__(self, args, nproc=2, config="configs/paci.json", env=None):
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [deepspeed, "--num_gpus", str(nproc), "--master_port", str(free_port()), TRAIN, "--deepspeed_config",
               config] + list(args)
        super().__init__(cmd, env=env)
        self._tree = None

    def tree(self):
        """``{"runner", "launcher", "rank0", "rank1", ...}`` -> psutil processes (looked up once, while alive)."""
        import psutil
        if self._tree is None:
            runner = psutil.Process(self.proc.pid)
            found = {"runner": runner}
            for child in runner.children(recursive=True):
                cmd = child.cmdline()
                if "deepspeed.launcher.launch" in cmd:
                    found["launcher"] = child
                else:
                    local = [a for a in cmd if a.startswith("--local_rank=")]
                    if local:
                        found["rank" + local[0].split("=", 1)[1]] = child
            self._tree = found
        return self._tree

    def ranks(self):
        return sorted(name for name in self.tree() if name.startswith("rank"))

    def send(self, target, sig):
        self.tree()[target].send_signal(sig)

    def wait_gone(self, timeout=30, who=None):
        """Seconds until the launcher and every rank (or ``who``) have ended (zombies count as ended); None on timeout."""
        import psutil
        procs = [p for name, p in self.tree().items() if (who is None and name != "runner") or (who and name in who)]
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            alive = []
            for p in procs:
                try:
                    if p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p)
                except psutil.NoSuchProcess:
                    pass
            if not alive:
                return time.monotonic() - start
            time.sleep(0.05)
        return None


def staging_folders(ckpt_dir):
    from ds_paci.core.checkpoint.atomic import HIDDEN_PREFIX
    try:
        return [n for n in os.listdir(ckpt_dir) if n.startswith(HIDDEN_PREFIX + "staging.")]
    except OSError:
        return []


def kill_during_save(run, ckpt_dir, rng, max_delay, victims=("rank0", "rank1"), timeout=120):
    """Once a save's staging folder appears (one not seen before), wait U(0, max_delay) s, SIGKILL a random rank."""
    run.tree()
    before = set(staging_folders(ckpt_dir))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = set(staging_folders(ckpt_dir)) - before
        if current:
            break
        before &= set(staging_folders(ckpt_dir))
        if run.proc.poll() is not None:
            return None
        time.sleep(0.001)
    else:
        return None
    delay = rng.uniform(0, max_delay)
    time.sleep(delay)
    victim = rng.choice(victims)
    in_save = bool(current & set(staging_folders(ckpt_dir)))
    run.send(victim, signal.SIGKILL)
    ranks_gone = run.wait_gone(timeout=30, who=run.ranks())
    gone = run.wait_gone(timeout=30)
    if gone is not None and ranks_gone is not None:
        gone = max(gone, ranks_gone)
    return {"victim": victim, "delay_s": round(delay, 4), "during_save": in_save, "ranks_gone_s": ranks_gone,
            "all_gone_s": gone}


def step_of(ckpt_dir, tag):
    """The main job's step stored in a checkpoint (read from its model-states file, on the CPU)."""
    import glob

    import torch
    path = sorted(glob.glob(os.path.join(ckpt_dir, tag, "mp_rank_*_model_states.pt")))[0]
    return torch.load(path, map_location="cpu", weights_only=False)["step"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.03,
                   help="seconds after a save begins (upper bound; a tiny-model save takes about 35 ms here)")
    p.add_argument("--dir", help="work folder (default: a new temporary folder)")
    p.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args(argv)
    from ds_paci.core.checkpoint.atomic import read_latest, resume_tag
    rng = random.Random(args.seed)
    work = args.dir or tempfile.mkdtemp(prefix="savekill_")
    ckpt = os.path.join(work, "ckpt")
    data = small_corpus(os.path.join(work, "corpus.txt"))
    common = TINY + ["--data", data, "--checkpoint-dir", ckpt, "--save-interval", "1", "--log-interval", "10",
                     "--metrics", os.path.join(work, "metrics.jsonl")]
    kills, resumes = [], []
    started = time.monotonic()
    for i in range(args.kills + 1):
        last = i == args.kills
        steps = ["--steps", "100000"]
        if last:
            steps = ["--steps", str(step_of(ckpt, resume_tag(ckpt)[0]) + 4)]
        run = Run(common + steps + (["--resume"] if i else []))
        try:
            if i:
                expect_tag, note = resume_tag(ckpt)
                expect = step_of(ckpt, expect_tag)
                line = run.wait_for(r"resumed from|error:", timeout=240)
                ok = bool(line) and "resumed from" in line and re.search(rf"at step {expect}(\D|$)", line) is not None
                resumes.append({"round": i, "ok": ok, "line": line, "expected_step": expect, "fallback": note})
                print(f"[savekill] round {i}: resume {'ok' if ok else 'FAILED'}: {line}", flush=True)
                if not ok:
                    print(run.output[-3000:])
                    break
            if last:
                code = run.finish(timeout=240)
                resumes[-1]["completed"] = code == 0
                print(f"[savekill] final run exit code {code}", flush=True)
                break
            if not run.wait_for(r"checkpoint saved", timeout=240):
                print(run.output[-3000:])
                raise SystemExit(f"[savekill] round {i}: the run saved nothing")
            kill = kill_during_save(run, ckpt, rng, args.max_delay)
            if kill is None:
                raise SystemExit(f"[savekill] round {i}: no save began")
            kill["latest_after"] = read_latest(ckpt)
            kills.append(kill)
            print(f"[savekill] round {i}: killed {kill['victim']} {kill['delay_s'] * 1000:.1f} ms into a save "
                  f"(still saving: {kill['during_save']}); every rank gone in {kill['ranks_gone_s']:.2f} s, the launcher "
                  f"too in {kill['all_gone_s']:.2f} s; "
                  f"latest -> {kill['latest_after']}", flush=True)
        finally:
            run.kill_all()
            run.finish(timeout=30)
    summary = {
        "kills": len(kills),
        "kills_during_save": sum(k["during_save"] for k in kills),
        "resumes": len(resumes),
        "resumes_ok": sum(r["ok"] for r in resumes),
        "fallbacks": sum(1 for r in resumes if r["fallback"]),
        "max_ranks_gone_s": max((k["ranks_gone_s"] for k in kills), default=None),
        "final_run_completed": bool(resumes and resumes[-1].get("completed")),
        "seconds": round(time.monotonic() - started, 1),
        "seed": args.seed,
        "max_delay_s": args.max_delay,
        "detail": {"kills": kills, "resumes": resumes},
    }
    print(f"[savekill] {summary['kills']} kills ({summary['kills_during_save']} while the save was in progress), "
          f"{summary['resumes_ok']}/{summary['resumes']} resumes succeeded ({summary['fallbacks']} fell back), final "
          f"run completed: {summary['final_run_completed']}, {summary['seconds']} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    ok = summary["resumes_ok"] == summary["resumes"] == args.kills and summary["final_run_completed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
