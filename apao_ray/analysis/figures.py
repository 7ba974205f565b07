"""The report's PNGs: per-prefix recall, beam retention, adaptive weights, validation NDCG@10 per epoch."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display (also inside headless CI)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..names import counted  # noqa: E402
from .results import Method, prefix_keys  # noqa: E402

SEED_STYLES = ("-", "--", ":", "-.")


def _panels(methods: list[Method]) -> dict[tuple[str, str], list[Method]]:
    panels: dict[tuple[str, str], list[Method]] = {}
    for method in methods:
        panels.setdefault((method.dataset, method.backbone), []).append(method)
    return panels


def _save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def prefix_recall(methods: list[Method], path: Path) -> Path | None:
    """Test Recall@K of the target's length-m prefix at beam step m (paper Fig. 7), mean and spread over seeds."""
    panels = {key: [m for m in group if m.trials and prefix_keys(m.trials[0].metrics)]
              for key, group in _panels(methods).items()}
    panels = {key: group for key, group in panels.items() if group}
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axis, ((dataset, backbone), group) in zip(axes[0], panels.items()):
        for method in group:
            keys = prefix_keys(method.trials[0].metrics)
            stats = [method.mean_std(key) for key in keys]
            means = [s[0] for s in stats]
            spreads = [0.0 if np.isnan(s[1]) else s[1] for s in stats]
            axis.errorbar(range(1, len(keys) + 1), means, yerr=spreads, marker="o", capsize=3,
                          label=f"{method.label} ({counted(len(method.trials), 'seed')})")
        axis.set(title=f"{dataset} / {backbone}", xlabel="prefix length m (beam step)",
                 ylabel=keys[0].rsplit("_m", 1)[0].replace("test/", "test ") + "_m", xticks=range(1, len(keys) + 1))
        axis.legend(fontsize=8)
    return _save(figure, path)


def retention(methods: list[Method], path: Path) -> Path | None:
    """Test beam retention (share of the exact top-K that the beam returns; paper Fig. 1c) per method."""
    rows = [(m, key) for m in methods for key in sorted(m.trials[0].metrics) if key.startswith("test/beam_retention")]
    if not rows:
        return None
    figure, axis = plt.subplots(figsize=(max(5, 1.6 * len(rows)), 4))
    labels, means, spreads = [], [], []
    for method, key in rows:
        mean, spread = method.mean_std(key)
        labels.append(f"{method.backbone}/{method.label}".replace(" ", "\n", 1))
        means.append(mean)
        spreads.append(0.0 if np.isnan(spread) else spread)
    axis.bar(range(len(rows)), means, yerr=spreads, capsize=4, color="tab:blue")
    axis.set_xticks(range(len(rows)), labels, fontsize=8)
    axis.set(ylabel=rows[0][1].replace("test/", "test "), ylim=(0, 1), title="beam retention (mean, spread over seeds)")
    return _save(figure, path)


def adaptive_weights(methods: list[Method], path: Path) -> Path | None:
    """APAO's adaptive prefix weights w_m per epoch (``train/apao_weight_m*``), one panel per method."""
    group = [m for m in methods if any(not t.history("train/apao_weight_m1").empty for t in m.trials)]
    if not group:
        return None
    figure, axes = plt.subplots(1, len(group), figsize=(5.5 * len(group), 4), squeeze=False)
    for axis, method in zip(axes[0], group):
        for index, trial in enumerate(method.trials):
            for m in range(1, 9):
                series = trial.history(f"train/apao_weight_m{m}")
                if series.empty:
                    break
                axis.plot(series.index, series.values, SEED_STYLES[index % len(SEED_STYLES)], color=f"C{m - 1}",
                          label=f"m={m}" if index == 0 else None)
        axis.set(title=f"{method.dataset}/{method.backbone} {method.label}\n(line style: seed {method.seeds})",
                 xlabel="epoch", ylabel="adaptive weight w_m")
        axis.title.set_fontsize(9)
        axis.ticklabel_format(axis="y", useOffset=False)  # weights near 1/T: absolute values, not offsets
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=8)
    return _save(figure, path)


def validation_curves(methods: list[Method], path: Path, key: str = "val/ndcg_at_10") -> Path | None:
    """Validation NDCG@10 per epoch for every method and seed (CE vs APAO), one panel per (dataset, backbone)."""
    panels = _panels(methods)
    if not any(not t.history(key).empty for m in methods for t in m.trials):
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axis, ((dataset, backbone), group) in zip(axes[0], panels.items()):
        for color, method in enumerate(group):
            for index, trial in enumerate(method.trials):
                series = trial.history(key)
                axis.plot(series.index, series.values, SEED_STYLES[index % len(SEED_STYLES)], color=f"C{color}",
                          marker=".", label=f"{method.label} seed {trial.seed}" + (
                              "" if trial.record["status"] == "FINISHED" else f" ({trial.record['status'].lower()})"))
        axis.set(title=f"{dataset} / {backbone}", xlabel="epoch", ylabel=key)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=7)
    return _save(figure, path)
