"""Figures logged as MLflow artifacts (matplotlib, no display needed)."""
from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def adaptive_weights_figure(history: dict[str, list[tuple[int, float]]]) -> Any:
    """``{"train/apao_weight_m1": [(epoch, w), ...], ...}`` -> one line per prefix level."""
    figure, axis = plt.subplots(figsize=(5, 3.2))
    for key in sorted(history):
        steps, values = zip(*history[key]) if history[key] else ((), ())
        axis.plot(steps, values, marker="o", label=key.rsplit("_", 1)[-1])
    axis.set(xlabel="epoch", ylabel="weight w_m", title="Adaptive prefix weights")
    axis.legend(title="prefix")
    figure.tight_layout()
    return figure


def prefix_recall_figure(rows: list[dict[str, Any]], beam_size: int, num_levels: int = 4) -> Any:
    """Per-prefix test recall (paper Fig. 7): one line per method (label -> metrics)."""
    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    levels = list(range(1, num_levels + 1))
    for row in rows:
        values = [row["metrics"].get(f"test/prefix_recall_at_{beam_size}_m{m}") for m in levels]
        if all(v is not None for v in values):
            axis.plot(levels, values, marker="o", label=row["label"])
    axis.set(xlabel="prefix length m", ylabel=f"prefix Recall@{beam_size}", xticks=levels,
             title="Prefix-level recall on the test split")
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def close(figure: Any) -> None:
    plt.close(figure)


def slice_figure(points: list[tuple[dict[str, Any], float]], knobs: tuple[str, ...]) -> Any:
    """Optuna-style slice plot: the objective against each tuned knob, one colour per method."""
    present = [k for k in knobs if any(k in choices for choices, _ in points)]
    figure, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for axis, knob in zip(axes[0], present):
        methods = sorted({f"{c['backbone']}/{c['loss']}" for c, _ in points if knob in c})
        for method in methods:
            xs = [c[knob] for c, v in points if knob in c and f"{c['backbone']}/{c['loss']}" == method]
            ys = [v for c, v in points if knob in c and f"{c['backbone']}/{c['loss']}" == method]
            axis.scatter(xs, ys, label=method, s=18)
        axis.set(xlabel=knob, ylabel="best validation NDCG@10", xscale="log" if knob in ("eta", "num_negatives") else "linear")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("Study slice plot")
    figure.tight_layout()
    return figure
