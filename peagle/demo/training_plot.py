"""The curves of a training run (``peagle train --plot``, ``peagle plot-train RUN``): loss, per-depth top-1 accuracy
and held-out acceptance length against steps, from the run's ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["plot_training", "read_metrics"]


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl``; ValueError when the run has none."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} is not a training run directory: no metrics.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records yet")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    kept = [r for r in records if key in r]
    return [r["step"] for r in kept], [r[key] for r in kept]


def plot_training(run: str | os.PathLike, png: str | os.PathLike | None = None) -> Path:
    """Draws the run's curves to ``png`` (default ``RUN/training.png``) and returns its path: training and held-out
    loss; top-1 accuracy per depth (training batches solid, held-out dashed); held-out acceptance length (chains
    drafted in parallel, and autoregressively for K = 1) when the run evaluated (``--eval-every``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run)
    png = Path(png) if png is not None else Path(run) / "training.png"
    depths = sorted(int(k.removeprefix("acc_")) for k in records[0] if k.startswith("acc_"))
    fig, (loss_ax, acc_ax, al_ax) = plt.subplots(1, 3, figsize=(14, 4))
    loss_ax.plot(*_series(records, "loss"), label="training batch", color="#1f77b4")
    if any("eval_loss" in r for r in records):
        loss_ax.plot(*_series(records, "eval_loss"), "o-", label="held-out", color="#d62728")
    loss_ax.set(title="loss", xlabel="step", yscale="log")
    loss_ax.legend(fontsize=8)
    colors = plt.get_cmap("viridis")
    for d in depths:
        color = colors(d / max(1, len(depths) - 1))
        acc_ax.plot(*_series(records, f"acc_{d}"), color=color, label=f"depth {d}", linewidth=1)
        if any(f"eval_acc_{d}" in r for r in records):
            acc_ax.plot(*_series(records, f"eval_acc_{d}"), "o--", color=color, markersize=3)
    acc_ax.set(title="top-1 accuracy per depth (dashed: held-out)", xlabel="step", ylim=(0, 1))
    acc_ax.legend(fontsize=7, ncol=2)
    al_ax.set(title="held-out acceptance length", xlabel="step")
    for key, label in (("eval_acceptance_length", "chain (parallel)"), ("eval_ar_acceptance_length", "autoregressive")):
        if any(key in r for r in records):
            al_ax.plot(*_series(records, key), "o-", label=label)
    if al_ax.lines:
        al_ax.legend(fontsize=8)
    else:
        al_ax.text(0.5, 0.5, "not evaluated\n(--eval-every)", ha="center", va="center", transform=al_ax.transAxes)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
