"""decode.py --bench --plot FILE.png: what the bench printed, drawn. Per method, its speedup against the run's AR and
its tokens per step at the first batch size; with several batch sizes, each method's speedup against batch size.

matplotlib is an optional extra (pip install -e ".[plot]"); without it, --plot stops before benchmarking with one
line saying so (`check`).
"""
import importlib.util

from . import NanospecError


def check() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise NanospecError('--plot draws with matplotlib, which is not installed: pip install -e ".[plot]"')


def plot(results: list[dict], path, title: str) -> None:
    """results: the bench's rows (method, batch, speedup, mean_accepted), drawn into the PNG at path."""
    import matplotlib
    matplotlib.use("Agg")  # no screen: draw to a file
    import matplotlib.pyplot as plt

    results = [r for r in results if r.get("speedup") is not None and r.get("mean_accepted") is not None]
    batches = sorted({r["batch"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    first = {r["method"]: r for r in results if r["batch"] == batches[0]}
    fig, axes = plt.subplots(1, 2 + (len(batches) > 1), figsize=(5 * (2 + (len(batches) > 1)), 4), squeeze=False)
    bars = [("speedup", f"speedup against AR (B = {batches[0]})"), ("mean_accepted", "tokens per step")]
    for ax, (key, label) in zip(axes[0], bars):
        ax.bar(methods, [first[m][key] for m in methods], color="tab:green")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=45)
    if len(batches) > 1:
        ax = axes[0][2]
        for m in methods:
            rows = sorted((r["batch"], r["speedup"]) for r in results if r["method"] == m)
            ax.plot(*zip(*rows), marker="o", label=m)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set(xscale="log", xticks=batches, xticklabels=batches, xlabel="batch size", ylabel="speedup against AR")
        ax.minorticks_off()
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
