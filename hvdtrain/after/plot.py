"""`hvdtrain plot`: loss and every validation metric against epoch and against wall time, one
colour per run, so that runs (np=1 against np=4, say) can be compared at a glance; and, for runs of
several processes, each rank's seconds per epoch outside collectives (data + compute) and in data
alone, so that a slow rank stands out."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.after.runs import RunRecord
from hvdtrain.io.atomic import WriteFailed, make_dir

# Record keys that are not curves.
_SKIP = {"val_samples", "val_loss"}
RANK_TIMES = "rank seconds"
_RANK_TIMES_AXIS = "s per rank outside collectives"
"""The row of each rank's times (metrics.jsonl's rank_data_s, rank_compute_s)."""
_RANK_STYLES = ("-", "--", ":", "-.")


def panels(runs: list[RunRecord]) -> list[str]:
    """The rows of the figure: loss (train and val together), each validation metric, throughput."""
    metrics: list[str] = []
    for run in runs:
        for record in run.epochs:
            metrics += [k for k in record if k.startswith("val_") and k not in _SKIP and k not in metrics]
    ranks = any("rank_data_s" in record for run in runs for record in run.epochs)
    return ["loss", *metrics, "train_samples_per_s", *([RANK_TIMES] if ranks else [])]


def draw(runs: list[RunRecord], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    rows = panels(runs)
    longest = max((r.get("elapsed_s", 0.0) for run in runs for r in run.epochs), default=0.0)
    unit, seconds_per_unit = next((u, n) for u, n in (("hours", 3600), ("minutes", 60), ("seconds", 1))
                                  if longest >= 2 * n or n == 1)
    figure, axes = plt.subplots(len(rows), 2, figsize=(11, 2.6 * len(rows) + 0.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        colour = colours[index % len(colours)]
        label = f"{run.path.name} (np={run.world_size or '?'})"
        epochs = [r["epoch"] for r in run.epochs]
        clock = [r.get("elapsed_s", 0.0) / seconds_per_unit for r in run.epochs]
        for row, name in enumerate(rows):
            for column, xs in enumerate((epochs, clock)):
                ax = axes[row][column]
                if name == "loss":
                    _line(ax, xs, run, "train_loss", colour, f"{label} train", "-")
                    _line(ax, xs, run, "val_loss", colour, f"{label} val", "--")
                elif name == RANK_TIMES:
                    _rank_lines(ax, xs, run, colour, label)
                else:
                    _line(ax, xs, run, name, colour, label, "-")
    for row, name in enumerate(rows):
        for column, xlabel in enumerate(("epoch", f"wall time since start ({unit})")):
            ax = axes[row][column]
            ax.set_xlim(left=0 if column else None)  # from the start: start-up time shows
            ax.set_xlabel(xlabel)
            ax.set_ylabel(_RANK_TIMES_AXIS if name == RANK_TIMES else name.replace("_", " "))
            ax.grid(alpha=0.3)
            if name in ("loss", "val_perplexity") and _all_positive(runs, name):
                ax.set_yscale("log")
            if name == RANK_TIMES and not column:
                ax.legend(fontsize="x-small")
    axes[0][0].legend(fontsize="small")
    figure.suptitle("  vs  ".join(str(run.path) for run in runs)[:150])
    figure.tight_layout()
    make_dir(output.parent)
    try:
        figure.savefig(output, dpi=110)
    except OSError as err:
        raise WriteFailed.of(output, err) from err
    plt.close(figure)


def _line(ax, xs: list[float], run: RunRecord, key: str, colour: str, label: str, style: str) -> None:
    points = [(x, r[key]) for x, r in zip(xs, run.epochs) if isinstance(r.get(key), (int, float))]
    if points:
        ax.plot(*zip(*points), style, color=colour, label=label, marker="o", markersize=3)


def _rank_lines(ax, xs: list[float], run: RunRecord, colour: str, label: str) -> None:
    """Each rank's data + compute seconds per epoch (a line style per rank), its data seconds as crosses;
    an epoch of another world size (elastic training) has its own number of ranks."""
    rows = [(x, r["rank_data_s"], r["rank_compute_s"]) for x, r in zip(xs, run.epochs) if "rank_data_s" in r]
    for rank in range(max((len(data) for _, data, _ in rows), default=0)):
        held = [(x, data[rank], compute[rank]) for x, data, compute in rows if rank < min(len(data), len(compute))]
        style = _RANK_STYLES[rank % len(_RANK_STYLES)]
        ax.plot([x for x, _, _ in held], [d + c for _, d, c in held], style, color=colour, marker="o", markersize=3,
                label=f"{label} rank {rank}")
        ax.plot([x for x, _, _ in held], [d for _, d, _ in held], "x", color=colour, markersize=4,
                label=f"{label} each rank's data loading (x)" if rank == 0 else None)


def _all_positive(runs: list[RunRecord], name: str) -> bool:
    keys = ("train_loss", "val_loss") if name == "loss" else (name,)
    values = [r[k] for run in runs for r in run.epochs for k in keys if isinstance(r.get(k), (int, float))]
    return bool(values) and min(values) > 0
