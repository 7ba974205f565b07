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


def optuna_figures(study: Any, method_studies: dict[str, Any], importance_methods: set[str]) -> dict[str, Any]:
    """Optuna's own matplotlib plots of a study: ``{artifact name: figure}``.

    The optimization history over the whole study; a slice plot per method, and parameter
    importances per method in ``importance_methods`` (``method_studies``: method -> a study of its
    trials with knob names): one method's knobs ranked against another's would mean nothing.
    """
    import warnings

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
