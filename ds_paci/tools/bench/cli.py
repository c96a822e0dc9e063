"""``python -m ds_paci.tools.bench``: command line, orchestration of configurations, JSON and summary output."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile

from ds_paci.tools.processes import world
from .analysis import TARGET_LOSS_FACTOR, compare_engines, ideal_ratio, study_comparison
from .config import (BenchConfig, ENGINES, OVERRIDABLE_FIELDS, curves_config, make_config, override_config, presets,
                     studies)
from .plots import plot_loss, plot_ratios, plot_study_curves, plot_throughput, render_timelines
from .report import (accuracy_table, format_measured, machine_facts, memory_table, study_tables, summary_markdown,
                     targets_table, throughput_table)
from .runner import curve_key, prepare_tokens, run_curves, run_rounds


def configuration_entry(cfg: BenchConfig, rounds: list, traces: dict, target_loss, out: str) -> dict:
    """Compare the engines over ``rounds``, draw the plots and timelines into ``out``; returns the JSON entry."""
    comparison = compare_engines(cfg, rounds, target_loss)
    entry = {"config": dataclasses.asdict(cfg), "label": cfg.label(), "emulated": cfg.emulated,
             "repeats": len(rounds), "comparison": comparison, "rounds": rounds}
    stem = os.path.join(out, cfg.name)
    entry["plots"] = {
        "throughput": os.path.basename(plot_throughput(cfg, comparison, f"{stem}_throughput.png")),
        "loss": os.path.basename(plot_loss(cfg, rounds, comparison, f"{stem}_loss.png")),
    }
    if traces:
        stock_seconds = comparison["seconds_per_batch"]["stock"]["per_round"][0]
        entry["timelines"] = render_timelines(cfg, traces, stock_seconds, out)
    return entry


def write_json(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.bench",
                                description="Side-by-side benchmark of DeepSpeed's stock pipeline engine and PACI.")
    p.add_argument("--preset", choices=sorted(presets()), help="named set of configurations (flags below override)")
    p.add_argument("--study", choices=sorted(studies()),
                   help="loss-curve study of stock, PACI and PACI + look-ahead (issue 11): --part throughput runs the "
                        "timed rounds, --part curves the untimed 300-step runs per learning rate and seed (resumable), "
                        "--part report the tables and plots; default: all three")
    p.add_argument("--part", choices=["throughput", "curves", "report", "all"], default="all",
                   help="with --study: which part to run")
    p.add_argument("--mode", choices=["real", "emulated"],
                   help="without --preset: real compute or emulated device time; with it: keep only that mode")
    p.add_argument("--summary-only", action="store_true",
                   help="run nothing: recompute comparisons, plots and summary.md from the JSON files in --out")
    p.add_argument("--only", help="comma-separated configuration names of the preset to (re)run, e.g. emulated_P8_M8; "
                                  "summary.md still lists the preset's other configurations from their JSON in --out")
    p.add_argument("--stages", type=int, help="pipeline stages P (one process each)")
    p.add_argument("--micro-batches", type=int, help="M = gradient_accumulation_steps (PACI window a = M)")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--steps", type=int, help="train_batch calls per run")
    p.add_argument("--warmup", type=int, help="calls excluded from throughput at the start of each segment")
    p.add_argument("--repeats", type=int, help="rounds of (stock, PACI)")
    p.add_argument("--device-time", type=float, help="emulated device seconds per block in forward (2x in backward)")
    p.add_argument("--eval-every", type=int, help="validate every this many steps (0: only at start and end)")
    p.add_argument("--eval-batches", type=int, help="eval_batch calls of M micro-batches per validation")
    p.add_argument("--lr", type=float)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="tie the LM head to the token embedding (first and last stage)")
    p.add_argument("--target-loss", type=float,
                   help=f"validation loss to time (default: {TARGET_LOSS_FACTOR} x stock's final validation loss)")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                   help="record and render timelines of the first round (preset default)")
    p.add_argument("--out", default="docs/results", help="output folder")
    p.add_argument("--log-dir", help="per-rank logs (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a world is killed")
    return p


def configurations_from_args(args) -> tuple[list, int, bool]:
    """``(configs, repeats, trace)`` from the parsed command line."""
    overrides = {k: getattr(args, k) for k in OVERRIDABLE_FIELDS}
    if args.preset:
        preset = presets()[args.preset]
        configs = [override_config(c, overrides) for c in preset.configs]
        if args.mode:
            configs = [c for c in configs if c.mode == args.mode]
        repeats, trace = preset.repeats, preset.trace
    else:
        configs = [make_config(args.mode or "emulated", **overrides)]
        repeats, trace = 1, False
    if args.repeats is not None:
        repeats = args.repeats
    if args.trace is not None:
        trace = args.trace
    if not configs or repeats < 1:
        raise SystemExit("nothing to run: check --preset/--mode and --repeats")
    return configs, repeats, trace


def load_entries(out: str, configs: list, fresh: dict) -> list:
    """Entries of ``configs`` in order: from ``fresh`` (this invocation) or from ``out/<name>.json`` if present."""
    entries = []
    for cfg in configs:
        if cfg.name in fresh:
            entries.append(fresh[cfg.name])
            continue
        path = os.path.join(out, f"{cfg.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                entries.append(json.load(f))
    return entries


def write_summary(entries: list, out: str, command: str) -> str:
    """Write ``summary.md`` (and ``ratios.png`` for several configurations) into ``out``; returns the markdown."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    facts = dict(machine_facts(), date_utc_end=now)
    markdown = summary_markdown(entries, entries[0]["machine"], command)
    if len(entries) > 1:
        ratios = os.path.basename(plot_ratios(entries, os.path.join(out, "ratios.png")))
        markdown += f"\n## All configurations\n\n![ratios]({ratios})\n"
    markdown += (f"\nSummary written {facts['date_utc_end']}, load average then "
                 f"{', '.join(f'{x:.2f}' for x in facts['loadavg'])}.\n")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown)
    return markdown


def reanalyse(out: str, configs: list, target_loss) -> dict:
    """Recompute each stored entry's comparison and plots from its per-round data; rewrites its JSON.

    The target loss stays what the stored entry used unless ``target_loss`` is given.
    Timelines are left as they are (their traces are not stored in the JSON).
    """
    fresh = {}
    for entry in load_entries(out, configs, {}):
        cfg = BenchConfig(**entry["config"])
        stored = entry["comparison"]["time_to_target"]
        target = target_loss if target_loss is not None else (
            None if stored["rule"].startswith(str(TARGET_LOSS_FACTOR)) else stored["target_loss"])
        entry["comparison"] = compare_engines(cfg, entry["rounds"], target)
        plot_throughput(cfg, entry["comparison"], os.path.join(out, entry["plots"]["throughput"]))
        plot_loss(cfg, entry["rounds"], entry["comparison"], os.path.join(out, entry["plots"]["loss"]))
        write_json(os.path.join(out, f"{cfg.name}.json"), entry)
        fresh[cfg.name] = entry
    return fresh


def main(argv=None) -> int:
    """Command line entry point (see the module docstring and ``--help``)."""
    from ..studies.peers import study as peers
    if peers.is_peers_study(sys.argv[1:] if argv is None else argv):  # a study with a command line of its own
        return peers.main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.study:
        return study_main(args, "python -m ds_paci.tools.bench " + " ".join(sys.argv[1:] if argv is None else argv))
    try:
        all_configs, repeats, trace = configurations_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    configs = [c for c in all_configs if not args.only or c.name in args.only.split(",")]
    if not configs:
        raise SystemExit(f"--only {args.only} matches none of {', '.join(c.name for c in all_configs)}")
    command = "python -m ds_paci.tools.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.summary_only:
        fresh = reanalyse(args.out, configs, args.target_loss)
        if not fresh:
            raise SystemExit(f"no stored results of {', '.join(c.name for c in configs)} in {args.out}")
        print(write_summary(load_entries(args.out, all_configs, fresh), args.out, command))
        return 0
    os.makedirs(args.out, exist_ok=True)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="ds_paci_bench_")
    os.makedirs(log_root, exist_ok=True)
    facts = machine_facts()
    print(f"ds_paci.bench: {len(configs)} configuration(s) x {repeats} round(s); logs in {log_root}", flush=True)
    fresh, data = {}, {}
    for cfg in configs:
        data_path = os.path.join(log_root, f"tokens_{cfg.tokenizer}.pt")
        if cfg.tokenizer not in data:
            data[cfg.tokenizer] = prepare_tokens(cfg, data_path)
        loadavg_before = [round(x, 2) for x in os.getloadavg()]
        try:
            rounds, traces = run_rounds(cfg, repeats=repeats, trace=trace, data_path=data_path, log_root=log_root,
                                        timeout=args.timeout, echo=lambda line: print(line, flush=True))
        except world.WorldFailure as e:
            print(f"ds_paci.bench: {e}", file=sys.stderr)
            return 1
        entry = configuration_entry(cfg, rounds, traces, args.target_loss, args.out)
        entry.update(machine=facts, command=command, data=data[cfg.tokenizer], loadavg_before=loadavg_before,
                     loadavg_after=[round(x, 2) for x in os.getloadavg()])
        write_json(os.path.join(args.out, f"{cfg.name}.json"), entry)
        fresh[cfg.name] = entry
        markdown = write_summary(load_entries(args.out, all_configs, fresh), args.out, command)
    print(markdown.split("## ")[0])
    entries = load_entries(args.out, all_configs, fresh)
    for title, table in (("Throughput", throughput_table(entries)), ("Time to accuracy", accuracy_table(entries)),
                         ("Memory", memory_table(entries)), ("Issue targets", targets_table(entries))):
        print(f"\n## {title}\n\n{table}")
    if not args.log_dir:
        shutil.rmtree(log_root, ignore_errors=True)
    return 0


# -- curve studies ------------------------------------------------------------------------------------
def _curves_path(out: str, name: str) -> str:
    return os.path.join(out, f"{name}_curves.json")


def load_curves(out: str, name: str) -> dict:
    """The stored curve runs of configuration ``name``: ``{curve_key: run summary}`` (empty if none yet)."""
    path = _curves_path(out, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["runs"]


def study_runs(study, cfg: BenchConfig, stored: dict) -> dict:
    """``{(lr, seed, engine): [(step, loss), ...]}`` of the runs of ``cfg`` that are stored."""
    runs = {}
    for lr in study.lrs[cfg.name]:
        for seed, data_seed in study.seeds:
            for engine in ENGINES:
                run_cfg = curves_config(cfg, study.engine_steps(engine), study.eval_every, lr, seed, data_seed)
                key = curve_key(run_cfg, engine, study.past_steps(engine))
                if key in stored:
                    runs[(lr, seed, engine)] = [(p["step"], p["loss"]) for p in stored[key]["validation"]]
    return runs


def study_report(study, configs: list, out: str, command: str) -> str:
    """``summary.md`` of a study from the stored throughput entries and curve runs; returns the markdown."""
    entries = load_entries(out, configs, {})
    lines = ["# Stock vs PACI vs PACI + look-ahead: loss curves and throughput", "", f"Command: `{command}`", "",
             "Loss curves come from runs without the emulated wait (same model, data, seeds and micro-batching, so "
             "the same losses per step); time = steps x the seconds per batch measured in the timed throughput runs "
             "(emulated device time for emulated rows).", "", "## Throughput (timed rounds)", "",
             throughput_table(entries) if entries else "(no throughput runs stored)", "", "## Loss curves", ""]
    seeds = [s for s, _ in study.seeds]
    targets = []
    for cfg in configs:
        stored = load_curves(out, cfg.name)
        runs = study_runs(study, cfg, stored)
        lrs = [lr for lr in study.lrs[cfg.name]
               if all((lr, seed, e) in runs for seed in seeds for e in ENGINES)]
        if not lrs:
            lines += [f"### {cfg.name}: curve runs incomplete ({len(runs)} stored)", ""]
            continue
        entry = next((e for e in entries if e["config"]["name"] == cfg.name), None)
        spb = None if entry is None else {e: entry["comparison"]["seconds_per_batch"][e]["median"] for e in ENGINES
                                          if e in entry["comparison"]["seconds_per_batch"]}
        if spb is not None and len(spb) < len(ENGINES):
            spb = None
        comparison = study_comparison(runs, lrs, seeds, ENGINES, study.steps, spb)
        label = cfg.label() + (" (times: measured seconds per batch)" if spb else " (no throughput runs: steps only)")
        lines += [study_tables(label, comparison, ENGINES, seeds), ""]
        png = plot_study_curves(cfg.label(), runs, lrs, seeds, ENGINES, spb,
                                os.path.join(out, f"{cfg.name}_curves.png"), cfg.emulated)
        lines += [f"![{cfg.name} curves]({os.path.basename(png)})", ""]
        targets += _study_targets(cfg, comparison, entry)
    lines += ["## Issue 11 targets (reported, not enforced)", "", "| configuration | target | measured | met |",
              "|---|---|---|---|"]
    lines += [f"| {t['config']} | {t['target']} | {format_measured(t['measured'], t['unit'])} | "
              f"{'yes' if t['met'] else 'NO'} |" for t in targets]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown)
    return markdown


def _study_targets(cfg: BenchConfig, comparison: dict, entry) -> list:
    """Issue 11's done-when lines at emulated P=8, M=8, per learning rate."""
    if (cfg.mode, cfg.stages, cfg.micro_batches) != ("emulated", 8, 8):
        return []
    out = []
    for lr, per_lr in comparison.items():
        la = per_lr["paci+lookahead"]
        diff = la["final_vs_stock"]
        out.append({"config": f"{cfg.label()}, lr {lr:g}", "target": "PACI + look-ahead final val loss within 1% of "
                    "stock's (median over seeds)", "measured": diff, "unit": "relative", "met": abs(diff) <= 0.01})
        speed = la["targets"][-1].get("speedup", {}).get("median")
        out.append({"config": f"{cfg.label()}, lr {lr:g}", "target": "PACI + look-ahead reaches stock's final loss "
                    ">= 1.6x sooner", "measured": speed, "unit": "ratio", "met": speed is not None and speed >= 1.6})
    if entry is not None:
        share = entry["comparison"].get("shares_of_ideal", {}).get("paci+lookahead")
        out.append({"config": entry["label"], "target": "PACI + look-ahead throughput >= 95% of (M+P-1)/M = "
                    f"{ideal_ratio(cfg.stages, cfg.micro_batches):.3f}", "measured": share, "unit": "relative_share",
                    "met": share is not None and share >= 0.95})
    return out


def study_main(args, command: str) -> int:
    """``--study``: throughput rounds, curve runs (resumable) and the report (see ``--help``)."""
    study = studies()[args.study]
    configs = [c for c in study.throughput if not args.only or c.name in args.only.split(",")]
    if not configs:
        raise SystemExit(f"--only {args.only} matches none of {', '.join(c.name for c in study.throughput)}")
    out = args.out
    os.makedirs(out, exist_ok=True)
    parts = ("throughput", "curves", "report") if args.part == "all" else (args.part, )
    if parts != ("report", ):
        log_root = args.log_dir or tempfile.mkdtemp(prefix="ds_paci_study_")
        os.makedirs(log_root, exist_ok=True)
        data_path = os.path.join(log_root, "tokens_byte.pt")
        data = prepare_tokens(configs[0], data_path)
        facts = machine_facts()
        print(f"ds_paci.bench: study {args.study}, parts {', '.join(parts)}; logs in {log_root}", flush=True)
        try:
            for cfg in configs:
                if "throughput" in parts:
                    loadavg_before = [round(x, 2) for x in os.getloadavg()]
                    rounds, traces = run_rounds(cfg, repeats=args.repeats or study.repeats, trace=False,
                                                data_path=data_path, log_root=log_root, timeout=args.timeout,
                                                echo=lambda line: print(line, flush=True))
                    entry = configuration_entry(cfg, rounds, traces, args.target_loss, out)
                    entry.update(machine=facts, command=command, data=data, loadavg_before=loadavg_before,
                                 loadavg_after=[round(x, 2) for x in os.getloadavg()])
                    write_json(os.path.join(out, f"{cfg.name}.json"), entry)
                if "curves" in parts:
                    stored = load_curves(out, cfg.name)

                    def save(done, cfg=cfg):
                        write_json(_curves_path(out, cfg.name),
                                   {"config": dataclasses.asdict(cfg), "study": args.study, "command": command,
                                    "machine": facts, "data": data, "steps": study.steps,
                                    "eval_every": study.eval_every, "runs": done})

                    for lr in study.lrs[cfg.name]:
                        for seed, data_seed in study.seeds:
                            for engine in ENGINES:  # PACI engines may train past stock's steps (study.overrun)
                                run_curves(curves_config(cfg, study.engine_steps(engine), study.eval_every, lr, seed,
                                                         data_seed), [engine], data_path=data_path,
                                           log_root=os.path.join(log_root, cfg.name), timeout=args.timeout,
                                           done=stored, save=save, echo=lambda line: print(line, flush=True),
                                           past_steps=study.past_steps(engine))
        except world.WorldFailure as e:
            print(f"ds_paci.bench: {e}", file=sys.stderr)
            return 1
        if not args.log_dir:
            shutil.rmtree(log_root, ignore_errors=True)
    if "report" in parts:
        print(study_report(study, list(study.throughput), out, command))
    return 0
