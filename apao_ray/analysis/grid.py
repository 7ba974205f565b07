"""One page for paper Table 1's grid: every (dataset, backbone, method) cell with ours at the
paper's full protocol (mean ± std over seeds, n), the paired difference against CE, the paper's figure, and
the cell's status: done, in progress (its epoch, from the latest export), or queued (its cost here, from the
evidence queue). Built by ``python -m apao_ray report --grid`` from committed exports alone.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..rank_metrics import AT_10_METRICS, metric_label
from .bar import TRAINING_FREE, bar_words, dataset_heuristics, heuristic_paired, metric_means, with_bar
from .comparisons import Paired, compare_methods
from .export import StudyExport
from .heuristics import baseline_sections, recorded_datasets
from .paper import TABLE1
from .results import SELECTION_METRIC, Method, Trial, finished_trials, group_methods, unfinished_trials
from .stats import INTERVALS_NOTE
from .subsets import subset_sections

GRID_FILE = "grid.md"
# the grid's cells: paper Table 1's CE and APAO rows on the datasets whose interactions are public (Yelp's are not)
GRID_CELLS = tuple(key for key in TABLE1 if key[0] in ("office", "grocery", "beauty")
                   and key[2] in ("ce", "apao_pointwise", "apao_pairwise"))
GRID_METRICS_PER_USER = AT_10_METRICS  # every registered metric at 10: the paper's R@10 and N@10 first
GRID_METRICS = tuple(f"test/{metric}" for metric in GRID_METRICS_PER_USER)
GRID_LABEL = " / ".join(map(metric_label, GRID_METRICS_PER_USER))  # R@10 / N@10 / MRR@10
COMPARED_METRIC = "ndcg_at_10"  # a per-user table column


@dataclass(frozen=True)
class QueueItem:
    """A run still to do: its cells, seeds, cost per trial here and on a GPU, and the command."""

    dataset: str
    backbone: str
    losses: tuple[str, ...]
    protocol: str
    seeds: tuple[int, ...]
    cpu_hours: dict[str, float]
    gpu_minutes: dict[str, float]
    command: str


def load_queue(path: str | Path) -> list[QueueItem]:
    """The evidence queue (``benchmarks/evidence/queue.json``): items with per-trial costs scaled from Office."""
    record = json.loads(Path(path).read_text())
    costs, scale = record["office_cost_per_trial"], record["dataset_scale"]
    items = []
    for item in record["items"]:
        factor = scale[item["dataset"]]
        keys = {loss: f"{item['backbone']}/{loss}" for loss in item["losses"]}
        items.append(QueueItem(item["dataset"], item["backbone"], tuple(item["losses"]), item["protocol"],
                               tuple(item["seeds"]),
                               {loss: costs[key]["cpu_hours"] * factor for loss, key in keys.items()},
                               {loss: costs[key]["gpu_minutes"] * factor for loss, key in keys.items()},
                               item["command"]))
    return items


def _is_full_length(trial: Trial) -> bool:
    return trial.tags.get("apao.schedule") == "paper"


def _is_paper_cell(trial: Trial) -> bool:
    return _is_full_length(trial) and trial.tags.get("apao.protocol", "paper") == "paper"


def _by_loss(methods: list[Method]) -> dict[tuple[str, str, str], Method]:
    """One method per (dataset, backbone, loss): the one with most seeds where knobs differ between studies."""
    cells: dict[tuple[str, str, str], Method] = {}
    for method in methods:
        key = (method.dataset.lower(), method.backbone, method.loss)
        if key not in cells or len(method.trials) > len(cells[key].trials):
            cells[key] = method
    return cells


def _ours(method: Method) -> str:
    parts = []
    for metric in GRID_METRICS:
        stats = method.mean_std(metric)  # None: a run logged before the metric was registered
        mean, std = stats if stats is not None else (math.nan, math.nan)
        parts.append("-" if math.isnan(mean) else f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}")
    return " / ".join(parts) + f" (n={len(method.trials)})"


def _progress(trials: list[Trial]) -> str:
    """``epoch 21, best val N@10 0.0298`` per seed of the trials without test metrics."""
    parts = []
    for trial in sorted(trials, key=lambda t: t.seed):
        curve = trial.history("val/ndcg_at_10")
        epoch = int(curve.index.max()) if not curve.empty else 0
        best = trial.metrics.get(SELECTION_METRIC)
        parts.append(f"seed {trial.seed}: epoch {epoch}" + (f", best val N@10 {best:.4f}" if best is not None else "")
                     + f" ({trial.export.record['exported_at'][:10]})")
    return "; ".join(parts)


def _queued(queue: list[QueueItem], dataset: str, backbone: str, loss: str, protocol: str = "paper") -> str:
    for position, item in enumerate(queue, 1):
        if (item.dataset, item.backbone, item.protocol) == (dataset, backbone, protocol) and loss in item.losses:
            return (f"queued #{position}: seeds {','.join(map(str, item.seeds))}, ~{item.cpu_hours[loss]:.0f} h per "
                    f"trial on 2 CPUs, ~{item.gpu_minutes[loss]:.0f} min on a GPU")
    return "not queued"


def build_grid(exports: list[StudyExport], out_dir: str | Path, queue: list[QueueItem] | None = None,
               num_resamples: int = 10_000, data_dir: str | None = None) -> Path:
    """Writes ``grid.md`` into ``out_dir`` and returns its path; ``data_dir``: where the training-free baselines
    read the grid's datasets (default: ``$APAO_DATA_DIR``, ``./data``, the cache)."""
    queue = queue or []
    finished = [t for t in finished_trials(exports, "best") if _is_full_length(t)]
    paper_methods = _by_loss(group_methods([t for t in finished if _is_paper_cell(t)]))
    compared: dict[tuple[str, str, str], Paired] = {
        (p.method.dataset.lower(), p.method.backbone, p.method.loss): p
        for p in compare_methods(list(paper_methods.values()), "ce", metrics=(COMPARED_METRIC,),
                                 num_resamples=num_resamples)}
    bars = dataset_heuristics({d for d, _, _ in GRID_CELLS}, data_dir)
    bar_rows = heuristic_paired(list(paper_methods.values()), bars, "ce", (COMPARED_METRIC,), num_resamples)
    running: dict[tuple[str, str, str, str], list[Trial]] = {}
    for trial in unfinished_trials(exports):
        if _is_full_length(trial):
            key = (trial.dataset.lower(), trial.backbone, trial.loss, trial.tags.get("apao.protocol", "paper"))
            running.setdefault(key, []).append(trial)

    header = ["dataset", "backbone", "method", f"ours {GRID_LABEL} (mean ± std, n seeds)",
              "APAO - CE test N@10 (95% CI; p_holm with >= 2 seeds)", "paper R@10 / N@10", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    counts = {"done": 0, "in progress": 0, "queued": 0}
    for dataset, backbone, loss in GRID_CELLS:
        recall, ndcg = TABLE1[dataset, backbone, loss]
        method = paper_methods.get((dataset, backbone, loss))
        in_progress = running.get((dataset, backbone, loss, "paper"), [])
        paired = compared.get((dataset, backbone, loss))
        if method is not None:
            kind, status = "done", with_bar(f"done (seeds {','.join(map(str, method.seeds))})",
                                            bar_words(method, bars.get(dataset)))
            if in_progress:
                status += "; in progress " + _progress(in_progress)
        elif in_progress:
            kind, status = "in progress", "in progress: " + _progress(in_progress)
        else:
            kind, status = "queued", _queued(queue, dataset, backbone, loss)
        counts[kind] += 1
        difference = "-" if paired is None or paired.over_seeds is None else paired.over_seeds.text()
        lines.append("| " + " | ".join([dataset, backbone, loss, _ours(method) if method else "-", difference,
                                        f"{recall:.4f} / {ndcg:.4f}", status]) + " |")
    for paired in bar_rows:  # the bar: each heuristic on the same users, minus CE of the grid's backbone
        means = metric_means(bars[paired.method.dataset.lower()][paired.method.loss], GRID_METRICS_PER_USER)
        difference = "-" if paired.over_seeds is None else f"heuristic - CE: {paired.over_seeds.text()}"
        lines.append("| " + " | ".join([paired.method.dataset.lower(), paired.method.backbone,
                                        paired.method.label, " / ".join(f"{mean:.4f}" for mean in means),
                                        difference, "-", TRAINING_FREE]) + " |")

    others = group_methods([t for t in finished if not _is_paper_cell(t)])
    other_lines = [f"- {m.dataset} {m.backbone} {m.label}, protocol `{m.tag_values('apao.protocol')}`: "
                   f"{_ours(m)}, best epoch {', '.join(str(int(v)) for v in m.values('best/epoch')) or '-'}"
                   for m in others]
    other_lines += [f"- {d} {b} {loss}, protocol `{protocol}`, in progress: {_progress(trials)}"
                    for (d, b, loss, protocol), trials in sorted(running.items()) if protocol != "paper"]
    pending = [f"{i}. {item.dataset} {item.backbone} {'+'.join(item.losses)} (`{item.protocol}`), seeds "
               f"{','.join(map(str, item.seeds))}: `{item.command}`" for i, item in enumerate(queue, 1)]
    text = [
        "# Paper Table 1, cell by cell", "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python -m apao_ray report --grid` from "
        f"{len(exports)} committed study exports. {counts['done']} of {len(GRID_CELLS)} cells done, "
        f"{counts['in progress']} in progress, {counts['queued']} not started.", "",
        "Ours: test Recall@10 / NDCG@10 (beam 20) at the paper's full protocol (preset `paper`, up to 200 epochs, "
        "patience 20), best trial per study, mean ± sample std over seeds. The difference is APAO minus CE. "
        f"{INTERVALS_NOTE} Paper: Table 1. The training-free heuristics stand below the cells, on the same "
        "test users, with their difference to CE; a cell whose test NDCG@10 is below the last-item heuristic's by more "
        "than two standard errors says so in its status (`apao_ray/analysis/bar.py`).", "",
        *lines, "",
        "## Other full-length runs (not paper cells)", "", *(other_lines or ["(none)"]), "",
        *baseline_sections({**{d: None for d, _, _ in GRID_CELLS}, **recorded_datasets(exports)}, data_dir),
        *subset_sections(list(paper_methods.values()), data_dir),
        "## The queue (benchmarks/evidence/queue.json), in order", "", *(pending or ["(empty)"]), "",
    ]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / GRID_FILE
    path.write_text("\n".join(text))
    return path


def queue_path_default(exports_dirs: list[str]) -> Path | None:
    """``benchmarks/evidence/queue.json`` beside a ``benchmarks/results`` folder, when there is one."""
    for directory in exports_dirs:
        candidate = Path(directory).resolve().parent / "evidence" / "queue.json"
        if candidate.exists():
            return candidate
    return None
