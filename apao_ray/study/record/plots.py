"""Figures logged as MLflow artifacts (matplotlib, no display needed)."""
from __future__ import annotations

from typing import Any
import warnings

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


def prefix_recall_axis(axis: Any, series: list[tuple[str, list[float]]], beam_size: int, title: str) -> None:
    """Draws prefix recall at levels 1..T, a line per ``(label, values)``: on a log scale where every value is
    positive, so that a deep level's 0.003 stands apart from 0.07 instead of lying on zero, each point labelled."""
    for label, values in series:
        levels = range(1, len(values) + 1)
        axis.plot(levels, values, marker="o", label=label)
        for level, value in zip(levels, values):
            axis.annotate(f"{value:.3g}", (level, value), textcoords="offset points", xytext=(0, 5), ha="center",
                          fontsize=6)
    values = [value for _, line in series for value in line]
    if values and min(values) > 0:
        axis.set_yscale("log")
    axis.set(xlabel="prefix length m (codes)", ylabel=f"prefix Recall@{beam_size}", title=title,
             xticks=range(1, max((len(line) for _, line in series), default=0) + 1))
    axis.title.set_fontsize(9)
    axis.legend(fontsize=7)


def prefix_recall_figure(panels: dict[str, list[tuple[str, dict[str, float]]]], beam_size: int,
                         num_levels: int = 4) -> Any:
    """Per-prefix test recall (paper Fig. 7): a panel per method (``label -> [(legend, metrics), ...]``), a line per
    trial in it, its knobs in the legend."""
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for axis, (method, trials) in zip(axes[0], panels.items()):
        series = [(legend, [metrics.get(f"test/prefix_recall_at_{beam_size}_m{m}") for m in range(1, num_levels + 1)])
                  for legend, metrics in trials]
        prefix_recall_axis(axis, [(legend, values) for legend, values in series if None not in values], beam_size,
                           f"{method}: test")
    figure.tight_layout()
    return figure


def trial_prefix_recall_figure(series: list[tuple[str, list[float]]], beam_size: int) -> Any:
    """One trial's per-prefix test recall, a line per selection rule (``(label, values at m = 1..T)``)."""
    figure, axis = plt.subplots(figsize=(5.5, 3.8))
    prefix_recall_axis(axis, series, beam_size, "Test prefix recall at the epoch each selection rule kept")
    figure.tight_layout()
    return figure


def close(figure: Any) -> None:
    plt.close(figure)


def optuna_figures(study: Any, method_studies: dict[str, Any], importance_methods: set[str]) -> dict[str, Any]:
    """Optuna's own matplotlib plots of a study: ``{artifact name: figure}``.

    The optimization history over the whole study; a slice plot per method, and parameter
    importances per method in ``importance_methods`` (``method_studies``: method -> a study of its
    trials with knob names): one method's knobs ranked against another's would mean nothing.
    """
    from optuna.exceptions import ExperimentalWarning
    from optuna.visualization import matplotlib as optuna_plots

    with warnings.catch_warnings():  # "experimental since v2.2.0": Optuna's label, not a problem here
        warnings.simplefilter("ignore", ExperimentalWarning)
        figures = {"optimization_history": _figure_of(optuna_plots.plot_optimization_history(study))}
        for method, sub in method_studies.items():
            name = method.replace("/", "_")
            figure = _figure_of(optuna_plots.plot_slice(sub))  # laid out by Optuna (it has a colorbar)
            figure.suptitle(f"Slice plot: {method}")
            figures[f"slice_{name}"] = figure
            if method in importance_methods:
                figure = _figure_of(optuna_plots.plot_param_importances(sub))
                figure.axes[0].set_title(f"Hyperparameter importances: {method}")
                figure.tight_layout()
                figures[f"param_importances_{name}"] = figure
    return figures


def _figure_of(axes: Any) -> Any:
    """Optuna's plot functions return an Axes, or an array of them (one slice panel per parameter)."""
    return axes.flat[0].figure if hasattr(axes, "flat") else axes.figure
