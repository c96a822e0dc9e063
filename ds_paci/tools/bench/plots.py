"""Plots of a benchmark (throughput, loss curves, ratios) and its rendered timelines."""

from __future__ import annotations

import os

from .config import BenchConfig, ENGINE_TITLES, engines_in


def _engine_colors():
    return {"stock": "#8C8C8C", "paci": "#4C72B0", "paci+lookahead": "#DD8452"}


def plot_throughput(cfg: BenchConfig, comparison: dict, path: str) -> str:
    """Bars of each engine's median tokens/s with per-round dots, the measured ratio and the ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = _engine_colors()
    tps = comparison["tokens_per_second"]
    engines = engines_in(tps)
    fig, ax = plt.subplots(figsize=(5.5 + 1.2 * (len(engines) - 2), 4.2))
    for x, engine in enumerate(engines):
        ax.bar(x, tps[engine]["median"], color=colors[engine], width=0.6, label=ENGINE_TITLES[engine])
        ax.scatter([x] * len(tps[engine]["per_round"]), tps[engine]["per_round"], color="black", s=12, zorder=3)
    ideal_paci = tps["stock"]["median"] * comparison["ideal_ratio"]
    ax.hlines(ideal_paci, 0.65, len(engines) - 0.65, colors="#C44E52", linestyles="--",
              label=f"ideal PACI = stock x (M+P-1)/M = {comparison['ideal_ratio']:.3f}")
    ax.set_xticks(range(len(engines)))
    ax.set_xticklabels([ENGINE_TITLES[e] for e in engines], fontsize=8)
    ax.set_ylabel("training tokens/s (steady state" + (", emulated)" if cfg.emulated else ")"))
    ratio = comparison["ratio"]["median"]
    ax.set_title(f"{cfg.label()}\nPACI/stock {ratio:.3f} ({comparison['share_of_ideal']:.0%} of ideal)", fontsize=10)
    ax.set_ylim(0, 1.3 * max(ideal_paci, *(max(tps[e]["per_round"]) for e in engines)))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(cfg: BenchConfig, rounds: list, comparison: dict, path: str) -> str:
    """Training loss (last stage, per call) and validation loss against training wall time, first round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = _engine_colors()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    engines = engines_in(rounds[0])
    for engine in engines:
        run = rounds[0][engine]
        ax.plot([p["train_seconds"] for p in run["train_loss"]], [p["loss"] for p in run["train_loss"]],
                color=colors[engine], alpha=0.35, linewidth=0.8)
        ax.plot([p["train_seconds"] for p in run["validation"]], [p["loss"] for p in run["validation"]],
                color=colors[engine], marker="o", markersize=3.5, label=f"{ENGINE_TITLES[engine]} validation")
    tta = comparison["time_to_target"]
    ax.axhline(tta["target_loss"], color="#C44E52", linestyle="--", linewidth=0.9,
               label=f"target {tta['target_loss']:.3f}")
    for engine in engines:
        seconds = tta["seconds"][engine]["per_round"][0]
        if seconds is not None:
            ax.axvline(seconds, color=colors[engine], linestyle=":", linewidth=0.9)
    clock = "training wall time, evaluation excluded (s" + (", emulated)" if cfg.emulated else ")")
    ax.set_xlabel(clock)
    ax.set_ylabel("loss (nats/token); faint: training loss per call")
    speed = tta["speedup"]["median"]
    ax.set_title(f"{cfg.label()}: loss vs time" + (f", time to target {speed:.2f}x shorter with PACI" if speed else ""),
                 fontsize=10)
    finals = [rounds[0][e]["final_val_loss"] for e in engines]
    ax.set_ylim(min(finals) - 0.15, max(p["loss"] for p in rounds[0]["stock"]["validation"]) + 0.1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratios(entries: list, path: str) -> str:
    """Measured PACI/stock throughput ratio next to the ideal, one group per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.9 * len(entries) + 2.5, 4.0))
    xs = range(len(entries))
    measured = [e["comparison"]["ratio"]["median"] for e in entries]
    ideal = [e["comparison"]["ideal_ratio"] for e in entries]
    ax.bar([x - 0.18 for x in xs], measured, width=0.36, color="#4C72B0", label="measured PACI/stock (median)")
    ax.bar([x + 0.18 for x in xs], ideal, width=0.36, color="#DDDDDD", edgecolor="#888888",
           label="ideal (M+P-1)/M")
    for x, m, i in zip(xs, measured, ideal):
        ax.text(x - 0.18, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
        ax.text(x + 0.18, i, f"{i:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([BenchConfig(**e["config"]).label().replace(" (", "\n(") for e in entries], fontsize=8)
    ax.set_ylabel("throughput ratio PACI / stock")
    ax.set_title("PACI vs stock DeepSpeed pipeline (emulated rows: emulated device time)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_timelines(cfg: BenchConfig, traces: dict, stock_seconds_per_batch: float, out: str, batches: int = 2):
    """PNG, Chrome trace and text grid of each engine's trace over the same wall-clock window.

    The window starts at the first steady-state call on stage 0 and lasts ``batches``
    stock batches (so PACI shows how much more it completes in the same time).
    Returns ``{engine: {"png", "chrome", "text"}}``.
    """
    from ds_paci.tools.sim import render
    window = batches * stock_seconds_per_batch
    rendered = {}
    for engine, (records, start) in traces.items():
        chosen = [r for r in records if r["start"] >= start and r["end"] <= start + window]
        if not chosen:
            continue
        title = (f"{ENGINE_TITLES[engine]}, {cfg.label()}: {window:.2f} s of steady state"
                 f" ({batches} stock batches)")
        png = render.to_png(chosen, os.path.join(out, f"{cfg.name}_timeline_{engine}.png"), title)
        chrome = render.to_chrome_trace(chosen, os.path.join(out, f"{cfg.name}_timeline_{engine}.json"),
                                          label=title)
        rendered[engine] = {"png": os.path.basename(png), "chrome": os.path.basename(chrome),
                            "text": render.to_text_grid(chosen, width=100), "title": title}
    return rendered


def plot_study_curves(label: str, runs: dict, lrs, seeds, engines, seconds_per_batch: dict | None, path: str,
                      emulated: bool) -> str:
    """Validation loss of every engine and seed against throughput-derived time (steps x seconds per batch), one
    panel per learning rate. ``runs``: ``{(lr, seed, engine): [(step, loss), ...]}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = _engine_colors()
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(lrs), figsize=(6.2 * len(lrs), 4.4), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        lowest = []
        for engine in engines:
            scale = 1.0 if seconds_per_batch is None else seconds_per_batch[engine]
            for i, seed in enumerate(seeds):
                curve = runs[(lr, seed, engine)]
                lowest.append(min(l for _, l in curve))
                ax.plot([s * scale for s, _ in curve], [l for _, l in curve], color=colors[engine],
                        linestyle=styles[i % len(styles)], marker="o", markersize=2.5, linewidth=1.1,
                        label=f"{ENGINE_TITLES[engine]}, seed {seed}")
        if seconds_per_batch is None:
            ax.set_xlabel("step")
        else:
            ax.set_xlabel("training time from measured seconds per batch (s" + (", emulated)" if emulated else ")"))
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_ylim(min(lowest) - 0.05, min(lowest) + 1.2)
        ax.set_title(f"{label}, lr {lr:g}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
