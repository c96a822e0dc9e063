"""The fault suite's table: every fault the project handles, what happens, and the test that asserts it.

``docs/reliability.md`` is generated from :data:`CASES`; ``tests/test_reliability.py::
test_reliability_page_matches_the_suite`` fails when the page differs from what this file renders,
when a case names a test that does not exist, or when a test of the fault suite is in no case.
Regenerate the page after changing a case:

    .venv/bin/python tests/reliability_cases.py > docs/reliability.md

A case whose ``tests`` is ``PENDING`` is rendered as "pending" and needs no test yet (none is, now).
"""

import ast
import os
import statistics
import sys

from harness import REPO_ROOT as ROOT

PENDING = "pending"
SUITE = "tests/test_reliability.py"  # every test function in this file must appear in some case

# (section, fault, how it is injected, behaviour asserted, tests as "file::function")
CASES = [
    # -- checkpoints ---------------------------------------------------------------------------------
    ("Checkpoints", "kill at any disk step of a save",
     "a rank copies the checkpoint folder at each of its disk steps (each file write, before and after, a file cut "
     "to half its size, manifest, renames, hard links, `latest`) over a new-tag save and a same-tag re-save",
     "`latest` names a complete checkpoint in every copy, and the engine loads it (the previous or the new weights, "
     "never a mix)",
     ["tests/test_reliability.py::test_every_disk_step_of_a_save_leaves_latest_complete"]),
    ("Checkpoints", "`kill -9` of a rank during a save",
     "SIGKILL from the fault hook: stage 1 while writing its model file (file cut to half), rank 0 just before "
     "renaming the staging folder, rank 0 in the middle of a same-tag swap",
     "the other rank fails fast; a fresh world resumes from what `latest` names (a complete checkpoint) and trains",
     ["tests/test_reliability.py::test_a_rank_killed_during_a_save_leaves_a_resumable_checkpoint"]),
    ("Checkpoints", "`kill -9` of a rank at a random moment of a main-job save",
     "`--save-interval 1`; SIGKILL to a random rank U(0, 30 ms) after a staging folder appears "
     "(`python -m ds_paci.tools.studies.savekill --kills 20` does this 20 times)",
     "every rank ends within 10 s; the next `--resume` prints `resumed from ... at step N` with N the step of "
     "the checkpoint `latest` names, and trains to the end",
     ["tests/test_reliability.py::test_stop_signal_to_one_rank_saves_and_resume_continues"]),
    ("Checkpoints", "truncated, missing or absent checkpoint file on load",
     "a copy of a checkpoint folder with one file cut, one deleted, an unknown tag",
     "`load_checkpoint` raises `CheckpointError` on every rank: one line naming the file and the last complete tag",
     ["tests/test_reliability.py::test_partial_checkpoint_is_refused_with_one_line"]),
    ("Checkpoints", "`--resume` when `latest` is incomplete",
     "checkpoint folders built on disk (complete, truncated, without `latest`, none complete)",
     "falls back to the newest complete checkpoint and says so in the `resumed from` line; none complete: one "
     "`error:` line, exit 2",
     ["tests/test_reliability.py::test_resume_plan_falls_back_to_the_last_complete_checkpoint",
      "tests/test_reliability.py::test_bad_flags_and_keys_end_before_any_process_group"]),
    ("Checkpoints", "checkpoint without a manifest (stock DeepSpeed, older ds_paci)",
     "the manifest removed from a copy",
     "loads, with one warning that completeness cannot be checked",
     ["tests/test_reliability.py::test_partial_checkpoint_is_refused_with_one_line"]),
    ("Checkpoints", "a PACI checkpoint read by DeepSpeed's own engine",
     "`deepspeed`'s `PipelineEngine.load_checkpoint(dir)` and `(dir, tag=...)`",
     "loads the same weights (DeepSpeed's layout is kept); `ds_paci.save_checkpoint(engine, ...)` makes the stock "
     "engine's saves atomic too",
     ["tests/test_reliability.py::test_deepspeed_layout_and_stock_engine_interplay"]),
    ("Checkpoints", "a save while an accumulation window is open",
     "`a` = 3 with `M` = 1 (4 stages, tied weights) and `M` = 2 (2 stages x 2 replicas, every optimizer path): "
     "`save_checkpoint` after a call count `a` does not divide, then a fresh engine with another init loads it",
     "the save adds no optimizer step; each rank's open-window gradients (and a tied owner's pending windows) are "
     "saved beside DeepSpeed's files and restored, so the resumed run's losses, counters and weights equal the "
     "uninterrupted run's bit for bit (bf16 without ZeRO: restored in place; DeepSpeed 0.19.8 cannot load its own "
     "`BF16_Optimizer` checkpoints, stock engine too)",
     ["tests/test_counters.py::test_counters_follow_calls_and_drains_add_no_step",
      "tests/test_counters.py::test_every_optimizer_path_passes_the_collective_check_and_resumes_an_open_window"]),
    # -- stops ---------------------------------------------------------------------------------------
    ("Stops", "SIGTERM to one rank of the main job",
     "`kill -TERM` to stage 1 only",
     "all ranks stop after the same step (agreed within two steps), save a complete checkpoint there, exit 143 "
     "within 10 s; `--resume` continues from that step",
     ["tests/test_reliability.py::test_stop_signal_to_one_rank_saves_and_resume_continues"]),
    ("Stops", "SIGTERM / SIGINT to the `deepspeed` runner",
     "`kill -TERM` / `kill -INT` to the runner process alone (it dies; DeepSpeed leaves launcher and ranks running)",
     "the ranks see their launcher chain end, stop at an agreed step, save, and end within 10 s; the launcher ends too",
     ["tests/test_reliability.py::test_signal_to_runner_or_launcher_ends_every_rank"]),
    ("Stops", "a job started with SIGINT ignored (`deepspeed ... &` from a script: a shell without job control "
     "starts background commands with SIGINT and SIGQUIT ignored, and children inherit that)",
     "the fault tests' launches, made from a suite whose SIGINT and SIGQUIT are set to ignored",
     "the launched job has both at their defaults (the runner gets Python's `KeyboardInterrupt` handler), so the "
     "row above holds under `make test &`. A user's runner started that way ignores `kill -INT`, as its shell asked: "
     "send it SIGTERM, or SIGINT to a rank (a rank installs its own handler)",
     ["tests/test_reliability.py::test_launched_jobs_see_sigint_as_from_a_terminal_even_when_the_suite_ignores_it"]),
    ("Stops", "`kill -9` of the launcher (`deepspeed.launcher.launch`)",
     "SIGKILL to the launcher",
     "the parent-death signal reaches every rank: they stop (`launcher exit`), save and end within 10 s",
     ["tests/test_reliability.py::test_signal_to_runner_or_launcher_ends_every_rank"]),
    ("Stops", "SIGINT / SIGTERM handling in a rank",
     "signals to a process with a `StopController` (immediate and graceful modes, blocked main thread, repeated "
     "signal)",
     "start-up: exit 128+signal at once; training: a stop request, deadline `--stop-timeout` (default 8 s) after "
     "which the rank exits anyway; a second signal more than 2 s later exits at once",
     ["tests/test_reliability.py::test_stop_controller_modes_and_deadline"]),
    ("Stops", "a rank's parent process dies",
     "the parent of a process that called `watch_launchers()` is killed with SIGKILL",
     "the orphan ends within a few seconds (parent-death signal plus a 1 s poll of the launcher chain)",
     ["tests/test_reliability.py::test_a_process_whose_parent_dies_exits"]),
    ("Stops", "stop requested on one rank only",
     "rank 1 raises its stop flag just before boundary 2 of a `StopAgreement`",
     "both ranks stop at boundary 3 with the same decision (no collective inside `train_batch`)",
     ["tests/test_reliability.py::test_stop_agreement_bound"]),
    ("Stops", "a stage exits right after its final drain while the last stage still publishes",
     "3 stages; after training and a drain stage 1 calls `os._exit(0)` (as a finished launcher rank), the last stage "
     "then drains twice more (each publishes a loss on the side channel) and stage 0 polls",
     "the message to the exited stage is dropped (`LossChannel.gone`), never raised: the last stage and stage 0 end "
     "normally and stage 0 still receives every loss",
     ["tests/test_loss_channel.py::test_a_stage_that_exits_after_its_drain_does_not_fail_the_last_stages_publish"]),
    # -- nodes ----------------------------------------------------------------------------------------------
    ("Nodes", "every process of one node killed",
     "two nodes on one machine (one `deepspeed --no_ssh --node_rank R` launcher each); `kill -9` of node 1's whole "
     "session: PP=2 with a stage per node (node-local disks, tied embedding), and PP=2 x DP=2 with stage 1's "
     "replicas on both nodes (shared folder)",
     "the other node's ranks end within 30 s (measured: about 3-4 s) with exit code 87 and exactly one line naming "
     "the lost ranks by node, no traceback; `latest` names the last complete checkpoint on every disk; `--resume` "
     "continues with the uninterrupted run's losses, bit for bit",
     ["tests/test_multinode.py::test_one_stage_per_node_tied_node_local_disks_node_killed_and_resumed_exactly",
      "tests/test_multinode.py::test_replicas_across_nodes_shared_folder_node_killed_and_resumed_exactly"]),
    ("Nodes", "one node's launcher killed",
     "`kill -9` of node 1's `deepspeed.launcher.launch` during a resumed run",
     "its rank stops (parent-death signal) and every rank of both nodes agrees on the stop step, saves there on both "
     "node-local disks and ends within 30 s; the line names `launcher exit on rank 1`",
     ["tests/test_multinode.py::test_one_stage_per_node_tied_node_local_disks_node_killed_and_resumed_exactly"]),
    ("Nodes", "node-local disks (with or without `use_node_local_storage`)",
     "four ranks as two nodes, each node's disk bind-mounted at the same path (mount namespaces); a stage's "
     "replicas on both nodes, so node 1's ranks write no file themselves",
     "each disk commits its own files plus copies of what its ranks load; `latest` on both; every rank loads",
     ["tests/test_multinode.py::test_node_local_disks_each_commit_and_hold_what_their_ranks_load"]),
    ("Nodes", "a commit failing on one node",
     "node 1's committer gets ENOSPC renaming its staging folder (after node 0 renamed its own)",
     "every rank raises one line naming node 1 and the error; `latest` stays on the previous checkpoint on both "
     "disks; loading the half-committed tag is refused naming node 1",
     ["tests/test_multinode.py::test_latest_moves_only_once_every_disk_has_committed"]),
    ("Nodes", "a checkpoint partial on one node's disk",
     "a layer file deleted on node 1's disk",
     "every rank refuses with one line naming node 1, its file and the last checkpoint complete on every node; "
     "`--resume` falls back to it; a re-save of the tag mends node 1",
     ["tests/test_multinode.py::test_a_partial_checkpoint_on_one_node_is_refused_everywhere_naming_its_file"]),
    ("Nodes", "`use_node_local_storage` on a shared folder, or with a placement DeepSpeed cannot save",
     "the flag on with one folder for all; the flag on with no replica of stage 1 at local rank 0",
     "shared: one committer (no rename race), the manifest from every rank's report; unsaveable: refused with one "
     "line naming the file nobody wrote, `latest` untouched",
     ["tests/test_multinode.py::test_use_node_local_storage_is_honoured_or_refused"]),
    ("Nodes", "a bad input on one node only",
     "the main job's `--data` missing on node 1",
     "both nodes exit 2 with one `error:` line naming node 1 (verdicts agreed after the process group starts; no "
     "rendezvous hang)",
     ["tests/test_multinode.py::test_the_runner_and_a_bad_input_across_nodes"]),
    # -- hangs and dead peers (earlier suites) ----------------------------------------------------------
    ("Hangs", "a stage that never joins its stream (stuck neighbour)",
     "stage 1 sleeps instead of training",
     "the watchdog ends the waiting rank within a minute, naming rank, stage, instruction and tick (exit 86)",
     ["tests/test_engine.py::test_a_hang_fails_within_a_minute_and_names_rank_and_instruction"]),
    ("Hangs", "a stage process dies mid-training",
     "stage 1 calls `os._exit(3)` after one call",
     "its neighbour's next transfer fails and names rank, stage and tick",
     ["tests/test_engine.py::test_a_dead_stage_is_reported_by_its_neighbour_with_position"]),
    ("Hangs", "a rank stuck in its own forward",
     "stage 0's forward sleeps past `watchdog_seconds`",
     "the watchdog says the rank is stuck in its own computation (not waiting for a stage) and exits 86; a rank "
     "blocked on a transfer names the stage it waits for",
     ["tests/test_nonfinite.py::test_watchdog_says_a_rank_is_stuck_in_its_own_forward",
      "tests/test_engine.py::test_a_hang_fails_within_a_minute_and_names_rank_and_instruction"]),
    ("Hangs", "the tied exchange on NCCL (ungrouped point-to-point)",
     "NCCL's semantics modelled in `tests/nccl_model.py` (issue-order matching per pair, one stream per pair or per "
     "group, host waits) over the exchange's program for 2 to 4 owners and lags 1 to 3, and over the transfer order "
     "real engines record in a 50-step run",
     "every transfer completes (owners walk peers by rank, the lower rank sends first); the former "
     "receive-then-send order deadlocks in the same model",
     ["tests/test_tied_faults.py::test_the_exchange_order_cannot_deadlock_under_nccl",
      "tests/test_tied_faults.py::test_pending_tied_sends_stay_bounded_over_50_local_steps_without_a_drain"]),
    ("Hangs", "NCCL communicators created lazily, and the order of the whole program on NCCL",
     "every rank's transfers, collectives and host waits derived from the lowered program (P = 2-8, M = 1-16, windows "
     "1-2P and auto, tied, 2 replicas, eval/save/closing drains, sync mode; DeepSpeed's TrainSchedule) run in "
     "`tests/nccl_model.py` with per-pair or per-group streams and eager or lazy communicators",
     "no deadlock and every transfer meets its own; without the start-up exchange the last stage's first tied "
     "receive deadlocks against stage 0's local step when communicators are lazy; real engines make the exchange "
     "and train bit-identically",
     ["tests/test_nccl_order.py::test_the_whole_program_cannot_deadlock_under_nccl",
      "tests/test_nccl_order.py::test_lazy_tied_communicators_deadlocked_without_the_start_up_exchange",
      "tests/test_first_exchange.py::test_every_group_gets_its_first_exchange_and_training_is_unchanged"]),
    ("Hangs", "a collective spanning stages inside a local step (a DeepSpeed newer than the newest tested)",
     "`BF16_Optimizer` handed the pipeline's own grid back (its norm all-reduce spans both stages), with the check "
     "forced by `DS_PACI_CHECK_COLLECTIVES=1`; the same check on the real first local step of torch.optim, "
     "DeepSpeed's AdamW, `BF16_Optimizer` and ZeRO-1 with 2 data-parallel replicas",
     "refused before the collective is entered, with one `CrossStageCollectiveError` line naming the rank, the "
     "collective, the group's ranks and stages and the fix; every rank ends with an error, none hangs (without "
     "the check both ranks hang until the watchdog, exit 86); the real steps pass and record only their stage's "
     "groups",
     ["tests/test_counters.py::test_a_cross_stage_collective_in_a_local_step_is_refused_with_one_line",
      "tests/test_counters.py::test_every_optimizer_path_passes_the_collective_check_and_resumes_an_open_window"]),
    # -- bad input ---------------------------------------------------------------------------------------
    ("Bad input", "every main-job flag out of range",
     "`--log-interval 0`, `--eval-batches 0`, `--eval-interval -1`, `--save-interval -1`, `--save-interval` without "
     "`--checkpoint-dir`, `--threads 0`, `--device-time -1` / `nan`, `--seq-len 0`, `--steps 0`, `--n-layer 0`, "
     "`--stages 0`, `--stop-timeout 0`",
     "one `error:` line naming the flag and what is allowed, exit 2, no process group started",
     ["tests/test_reliability.py::test_bad_flags_and_keys_end_before_any_process_group"]),
    ("Bad input", "unusable `--checkpoint-dir`",
     "a file in its place; a path below a file",
     "one `error:` line naming the path, exit 2, before any process group (not at the first save)",
     ["tests/test_reliability.py::test_bad_flags_and_keys_end_before_any_process_group"]),
    ("Bad input", "bad batch keys, fp16, ZeRO >= 2",
     "`gradient_accumulation_steps: 0`, `train_micro_batch_size_per_gpu: \"8\"`, a missing key, "
     "`fp16.enabled` with PACI, `zero_optimization.stage: 2` (PACI and stock)",
     "one `error:` line naming the key, exit 2, no process group started",
     ["tests/test_reliability.py::test_bad_flags_and_keys_end_before_any_process_group"]),
    ("Bad input", "bad `\"paci\"` values",
     "`watchdog_seconds` NaN, infinite, 1e-9, -1; `accumulation_window` 10^9 (more than 64 x "
     "`gradient_accumulation_steps`)",
     "`PACIConfigError` naming the key, the value and what is allowed (refused, not warned about)",
     ["tests/test_reliability.py::test_paci_section_bounds",
      "tests/test_reliability.py::test_bad_flags_and_keys_end_before_any_process_group"]),
    # -- non-finite values ----------------------------------------------------------------------------------
    ("Non-finite values", "NaN in one micro-batch loss (2-stage async run)",
     "a test-only wrapper makes one training micro-batch's loss NaN: on real engines (torch.optim AdamW, DeepSpeed's "
     "configured AdamW, bf16) and in the main job (`tests/scripts/nan_job.py --nan-at 9`)",
     "every stage skips exactly that local step (gradients zeroed, nothing applied, the LR scheduler still steps, "
     "`was_step_applied()` False once), the weights stay finite, the last stage returns the NaN loss of that call; "
     "the main job's progress line says `non-finite loss at step 3`, later `skipped steps 1`, it validates finite "
     "and writes its final checkpoint",
     ["tests/test_nonfinite.py::test_a_nan_micro_batch_is_skipped_on_every_stage_never_applied",
      "tests/test_main_job_nonfinite.py::test_main_job_skips_a_nan_micro_batch_and_says_so"]),
    ("Non-finite values", "NaN in one micro-batch loss with tied weights (2 and 4 stages, DP = 2)",
     "the same wrapper on a tied MLP (2 stages: torch.optim AdamW, DeepSpeed's AdamW, bf16, ZeRO-1 with a resume), "
     "a tied tiny GPT (4 stages), and PP = 2 x DP = 2 under ZeRO-1 with the NaN on one replica only; clipping on",
     "every stage skips its own NaN window; every tied owner also skips that window's tied total, L steps later, "
     "together (the finite flags travel with the exchange); the copies, Adam moments and step counters stay "
     "bit-identical after every local step and after a resume, the weights finite, no collective spans two stages, "
     "and training goes on to the end",
     ["tests/test_tied_faults.py::test_one_nan_micro_batch_keeps_tied_copies_identical_on_every_optimizer_path",
      "tests/test_tied_faults.py::test_four_stage_tied_gpt_trains_on_through_a_nan_with_clipping",
      "tests/test_tied_faults.py::test_a_nan_on_one_data_parallel_replica_is_skipped_by_every_replica_and_owner"]),
    ("Non-finite values", "non-finite weights at a save",
     "sync mode in fp32 (DeepSpeed's engine, which applies a NaN step) with a poisoned micro-batch, then "
     "`save_checkpoint`",
     "refused on every rank with one line naming the stages; nothing written, `latest` not created",
     ["tests/test_nonfinite.py::test_no_checkpoint_is_written_from_nonfinite_weights"]),
    ("Non-finite values", "consecutive non-finite steps beyond the limit",
     "3 stages, every micro-batch NaN from one point on, `\"paci\": {\"max_consecutive_skips\": 2}`",
     "every rank stops with one `PACINonFiniteError` line naming itself, the stage, the step, the limit and what to "
     "try (a lower learning rate, the data); the main job exits with code 3",
     ["tests/test_nonfinite.py::test_consecutive_skips_stop_every_rank_with_one_line"]),
    # -- long runs -------------------------------------------------------------------------------------------
    ("Long runs", "memory, transfers in flight and saves over a long async run (the soak benchmark, below)",
     "`ds_paci.tools.studies.soak` on 2 stages with a tied embedding, the look-ahead, a = 1 (L = 2): 120 calls, an "
     "`eval_batch` and a `save_checkpoint` every 40, a sample every 10 calls (the benchmark itself: thousands of "
     "calls on 2 stages x 2 replicas)",
     "every rank samples every interval; the tied sends and receives in flight, read through `paci_stats()`, never "
     "exceed L + 1 per peer (L between calls, none after a drain); only the newest 2 checkpoints stay on disk, "
     "`latest` names the last, complete, and a fresh engine loading it holds the trained weights; memory growth "
     "and seconds per call are figures of the benchmark, never asserted",
     ["tests/test_soak.py::test_a_short_soak_samples_every_rank_bounds_tied_transfers_and_resumes"]),
]

SOAK_RESULT = os.path.join(ROOT, "docs", "results", "soak", "soak.json")


def _load_range(result: dict) -> str:
    loads = [s["load1"] for r in result["ranks"] for s in r["samples"] if "load1" in s]
    if not loads:
        return f"{result['load_avg']['start'][0]:.1f} at the start, {result['load_avg']['end'][0]:.1f} at the end"
    return (f"1-minute load average {min(loads):.1f} to {max(loads):.1f} over the samples, median "
            f"{statistics.median(loads):.1f}")


def _load(summary, part):
    value = summary.get(f"median_load1_{part}_10pct")
    return "n/a" if value is None else f"{value:.1f}"


def _object_spread(result):
    """The widest range of the garbage collector's object count after 10% of the calls, over the ranks."""
    calls = result["job"]["calls"]
    spans = []
    for r in result["ranks"]:
        counts = [s["gc_objects"] for s in r["samples"] if s["call"] >= calls / 10]
        spans.append((max(counts) - min(counts), min(counts), max(counts), counts[0], counts[-1]))
    span, low, high, first, last = max(spans)
    return f"between {low:,} and {high:,} on the widest rank ({first:,} at 10%, {last:,} at the end)"


def soak_markdown(result: dict, growth_limit_pct: float = 2.0) -> str:
    """A markdown section of ``result`` (what ran, the command, when, the per-rank table, the verdict)."""
    job, summary = result["job"], result["summary"]
    window = job.get("window") or job["micro_batches"]
    worst = max(s["rss_growth_pct"] for s in summary)
    objects = _object_spread(result)
    bound_ok = all(s["max_pending_sends"] <= s["pending_bound"] and s["max_pending_receives"] <= s["pending_bound"]
                   for s in summary if s["pending_bound"] is not None)
    out = [
        f"{job['stages']} pipeline stages x {job['dp']} data-parallel replicas = {job['stages'] * job['dp']} ranks "
        f"over gloo on the CPU; a tiny GPT-2 ({job['n_layer']} blocks, width {job['n_embd']}, byte vocabulary, "
        f"sequences of {result.get('seq_len', 32)}) with its token embedding tied to the LM head across the first "
        f"and last stage; PACI async with the look-ahead, M = {job['micro_batches']} micro-batches of "
        f"{result.get('micro_batch', 2)} per call, "
        f"a = {window}; DeepSpeed's AdamW, clipping 1.0. {job['calls']} `train_batch` calls, an `eval_batch` every "
        f"{job['eval_every']} calls, a `save_checkpoint` every {job['save_every']} calls (the newest {job['keep']} "
        f"kept), a sample every {job['sample_every']} calls; then a drain, a last save, and a fresh engine "
        "(another seed) loading `latest`.",
        "",
        f"Command (commit `{result['commit']}`, started {result['started']}, {result['seconds'] / 60:.0f} minutes, "
        f"{_load_range(result)}; its `--out` file is kept as `docs/results/soak/soak.json`):",
        "",
        f"    nice -n 10 .venv/bin/{result.get('command', 'python -m ds_paci.tools.studies.soak')}",
        "",
        "| rank | stage | replica | RSS at call | RSS at 10% (MiB) | RSS at end (MiB) | growth | tied sends / receives "
        "in flight, max per peer (bound L + 1) | s/call, median first 10% (load) | last 10% (load) | resume |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        out.append(f"| {s['rank']} | {s['stage']} | {s['dp']} | {s['call_at_10pct']} | {s['rss_mib_at_10pct']:.1f} | "
                   f"{s['rss_mib_end']:.1f} | {s['rss_growth_pct']:+.2f}% | {s['max_pending_sends']} / "
                   f"{s['max_pending_receives']} ({s['pending_bound']}) | {s['median_s_per_call_first_10pct']:.3f} "
                   f"({_load(s, 'first')}) | {s['median_s_per_call_last_10pct']:.3f} ({_load(s, 'last')}) | "
                   f"{'loads, equal' if s['resume_matches'] else 'DIFFERS'} |")
    verdict = "below" if worst < growth_limit_pct else "NOT below"
    out += ["", f"Resident memory after the first 10% grows by at most {worst:+.2f}% to the end: {verdict} the "
            f"{growth_limit_pct:g}% target on every rank. Tied transfers in flight "
            f"{'stay within' if bound_ok else 'EXCEED'} the bound on every rank. Python objects tracked by the "
            f"garbage collector, from 10% to the end: {objects} (the tool's own sample and evaluation records "
            "included). Seconds per call include the "
            "evaluations and saves of their interval and follow the machine's load (shared, 2 cores): a figure, "
            "not a target."]
    return "\n".join(out) + "\n"


def render_soak():
    """The soak benchmark's section, from its result file (none when the file is absent)."""
    import json
    if not os.path.exists(SOAK_RESULT):
        return []
    with open(SOAK_RESULT) as f:
        return ["", "## Soak", "", "The soak benchmark (issue 16, item 9; `ds_paci/tools/studies/soak.py`): resident memory, "
                "the tied exchange's transfers in flight and seconds per call sampled over a long asynchronous run "
                "with evaluations and saves. Its figures, regenerated with this page from "
                "`docs/results/soak/soak.json`:", "", soak_markdown(json.load(f)).rstrip("\n")]


def render():
    """The markdown page for :data:`CASES`."""
    out = [
        "# Reliability: faults and what happens",
        "",
        "Generated from `tests/reliability_cases.py` (the fault suite's table); "
        "`tests/test_reliability.py::test_reliability_page_matches_the_suite` fails when this page, the cases and "
        "the tests drift apart. Regenerate: `.venv/bin/python tests/reliability_cases.py > docs/reliability.md`.",
        "",
        "Full random-kill check (not in CI): `.venv/bin/python -m ds_paci.tools.studies.savekill --kills 20`.",
    ]
    section = None
    for sec, fault, how, behaviour, tests in CASES:
        if sec != section:
            section = sec
            out += ["", f"## {sec}", "", "| fault | injected as | behaviour (asserted) | test |", "|---|---|---|---|"]
        where = "pending" if tests == PENDING else "<br>".join(f"`{t.split('::')[1]}` ({t.split('::')[0]})"
                                                                   for t in tests)
        out.append(f"| {fault} | {how} | {behaviour} | {where} |")
    return "\n".join(out + render_soak()) + "\n"


def test_functions(path):
    """Names of the module-level ``test_*`` functions of a test file."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def problems():
    """Everything that makes the page, the cases and the tests disagree (empty when they agree)."""
    found = []
    named = set()
    for _, fault, _, _, tests in CASES:
        if tests == PENDING:
            continue
        if not tests:
            found.append(f"case {fault!r} names no test")
        for t in tests:
            path, name = t.split("::")
            named.add((path, name))
            if not os.path.exists(os.path.join(ROOT, path)) or name not in test_functions(path):
                found.append(f"case {fault!r} names {t}, which does not exist")
    for name in sorted(test_functions(SUITE)):
        if (SUITE, name) not in named and name != "test_reliability_page_matches_the_suite":
            found.append(f"{SUITE}::{name} is in no case of tests/reliability_cases.py")
    page = os.path.join(ROOT, "docs", "reliability.md")
    current = open(page).read() if os.path.exists(page) else ""
    if current != render():
        found.append("docs/reliability.md differs from the cases; regenerate it: "
                     ".venv/bin/python tests/reliability_cases.py > docs/reliability.md")
    return found


if __name__ == "__main__":
    sys.stdout.write(render())
