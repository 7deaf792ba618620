"""Summary statistics and plots shared by the benchmarks."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% confidence interval (Student's t: benchmarks repeat a few times,
    where the normal 1.96 would state an interval about half as wide as it is for 3 repeats)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    from scipy.stats import t  # scikit-learn's dependency; imported by the bench commands alone

    return mean, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def plot(path: str, x: Sequence[float], series: dict[str, Sequence[float]], *, xlabel: str, ylabel: str,
         title: str, logx: bool = False) -> None:
    """A line plot written to `path` (PNG); matplotlib is imported only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        axes.plot(x, values, marker="o", label=label)
    if logx:
        axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
