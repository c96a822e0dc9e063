"""The peer study's figure: tokens/s against M at one P, one line per schedule, the bubble-free limit drawn."""

from __future__ import annotations

from ds_paci.tools.sim.peer_schedules import PEERS

TITLES = {"stock": "stock 1F1B-flush (DeepSpeed)", "paci": "PACI", "paci+lookahead": "PACI + look-ahead",
          **{name: peer.title for name, peer in PEERS.items()}}
STYLES = {"stock": ("#8C8C8C", "o", "-"), "paci": ("#4C72B0", "s", "-"), "paci+lookahead": ("#DD8452", "D", "-"),
          "gpipe": ("#937860", "v", ":"), "1f1b": ("#555555", "^", ":"), "interleaved-1f1b": ("#8172B3", "<", "--"),
          "zb1p": ("#55A868", ">", "--"), "zbv": ("#C44E52", "P", "--"), "dualpipev": ("#DA8BC3", "X", "--")}


def plot_throughput_vs_m(entries: list, stages: int, path: str) -> str | None:
    """One panel per emulated F:B:W ratio at ``P = stages``; ``None`` if no such cell is stored."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [e for e in entries if e["cell"]["stages"] == stages and e["cell"]["ratio"] != "real"]
    ratios = sorted({(e["cell"]["ratio"], e["cell"]["slow_last"]) for e in cells})
    if not ratios:
        return None
    fig, axes = plt.subplots(1, len(ratios), figsize=(6.2 * len(ratios), 4.6), squeeze=False)
    for ax, (ratio, slow) in zip(axes[0], ratios):
        row = sorted((e for e in cells if (e["cell"]["ratio"], e["cell"]["slow_last"]) == (ratio, slow)),
                     key=lambda e: e["cell"]["micro_batches"])
        ms = [e["cell"]["micro_batches"] for e in row]
        for engine, (color, marker, line) in STYLES.items():
            points = [(e["cell"]["micro_batches"], e["engines"][engine]["tokens_per_second"]["median"])
                      for e in row if engine in e["engines"]]
            if points:
                ax.plot(*zip(*points), color=color, marker=marker, linestyle=line, label=TITLES[engine])
        ax.plot(ms, [e["bubble_free_tokens_per_second"] for e in row], color="black", linestyle="-.", linewidth=1,
                label="bubble-free limit")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([str(m) for m in ms])
        ax.set_xlabel("micro-batches per step M")
        ax.set_ylabel("training tokens/s (emulated device time)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"P = {stages}, F:B:W = {ratio}" + (", slow last stage" if slow else ""), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
