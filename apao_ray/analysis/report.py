"""``python -m apao_ray report``: a markdown report with PNGs from one or more studies (one per seed).

Reads MLflow (each study is exported first, into ``<out>/exports/<study>/``, so the report's data lie
beside it) or committed exports (``benchmarks/results/<study>/``), and writes ``<out>/report.md``:
test metrics per (backbone, method) as mean and spread over seeds next to paper Table 1 where the
protocol and schedule match, paired differences against the baseline with bootstrap CIs and
Holm-corrected Wilcoxon p-values, cost per method, and the figures.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from ..cli.types import OneOf, positive_int
from ..names import PLAN_TAG, PLUGINS_ENV, counted
from ..paths import add_tracking_uri_argument
from ..rank_metrics import AT_10_METRICS, FULL_SORT, metric_label
from .bar import TRAINING_FREE, bar_words, dataset_heuristics, heuristic_method, heuristic_paired, metric_means, \
    with_bar
from .comparisons import Paired, compare_methods
from .cost_table import cost_table, epoch_seconds, number
from .export import STUDY_FILE, StudyExport, export_study, load_export, sole_study
from .grid import build_grid, load_queue, queue_path_default
from .heuristics import baseline_sections, recorded_datasets
from .results import (EARLY_LEARNING, NO_BETTER_THAN_POPULARITY, ONE_EPOCH, SELECTION_METRIC, STEEP_LAST_GAIN,
                      STILL_RISING, TEST_METRICS, TRIAL_CHOICES, Method, Trial, finished_trials, group_methods,
                      is_early_learning, seeds_text, selection_of, unfinished_trials, unknown_knobs)
from .stats import INTERVALS_NOTE
from .subsets import subset_sections
from .ties import selection_ties

REPORT_FILE = "report.md"


def _mean_std(method: Method, key: str, digits: int = 4, whole: bool = False) -> str:
    """The mean ± sd over a method's seeds; one seed: its value (``whole``: a count such as an epoch, as an int)."""
    stats = method.mean_std(key)
    if stats is None:
        return "-"
    mean, std = stats
    if math.isnan(std):
        return str(int(mean)) if whole and float(mean).is_integer() else number(mean, digits)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _paper_cell(method: Method) -> str:
    if method.paper is None:
        return "-"
    recall, ndcg = method.paper
    return f"{recall:.4f} / {ndcg:.4f}" if method.is_paper_protocol else f"({recall:.4f} / {ndcg:.4f}) n/c"


def _metrics_table(methods: list[Method], bars: dict[str, dict[str, Any]]) -> list[str]:
    """One row per method, then per dataset the training-free heuristics (``bar``) with the same metrics."""
    header = ["dataset", "backbone", "method", "seeds", *(metric_label(m.removeprefix("test/")) for m in TEST_METRICS),
              "paper R@10 / N@10",
              "protocol", "schedule", "precision", "best epoch", "epochs", "s/epoch (median)", "converged"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        cells = [method.dataset, method.backbone, method.label, seeds_text(method.seeds),
                 *(_mean_std(method, key) for key in TEST_METRICS), _paper_cell(method),
                 method.tag_values("apao.protocol", "paper"), method.tag_values("apao.schedule"),
                 method.tag_values("apao.precision"), _mean_std(method, "best/epoch", 1, whole=True),
                 ",".join(str(n) for n in map(_epochs_trained, method.trials) if n is not None) or "-",
                 epoch_seconds(method),
                 with_bar(method.convergence, bar_words(method, bars.get(method.dataset.lower())))]
        lines.append("| " + " | ".join(cells) + " |")
    for dataset in dict.fromkeys(m.dataset for m in methods):
        for name, table in bars.get(dataset.lower(), {}).items():
            row = heuristic_method(dataset, "-", name)
            lines.append("| " + " | ".join([dataset, "-", row.label, "-", *map(number, metric_means(table)),
                                            *["-"] * 7, TRAINING_FREE]) + " |")
    return lines


def _epochs_trained(trial: Trial) -> int | None:
    """The epochs a trial trained: its ``epochs_trained`` metric, else its last logged epoch."""
    if "epochs_trained" in trial.metrics:
        return int(trial.metrics["epochs_trained"])
    history = trial.history("perf/epoch_seconds")
    return None if history.empty else int(history.index.max())


def _unfinished_table(methods: list[Method]) -> list[str]:
    header = ["study", "backbone", "method", "seed", "status", "outcome", "epochs so far", "val NDCG@10 (last)",
              "best val NDCG@10", "s/epoch (median)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        for trial in method.trials:
            curve = trial.history("val/ndcg_at_10")
            seconds = trial.history("perf/epoch_seconds")
            cells = [trial.export.name, method.backbone, method.label, str(trial.seed), trial.record["status"],
                     trial.tags.get("apao.outcome", "-")[:80], str(int(curve.index.max())) if not curve.empty else "0",
                     number(float(curve.iloc[-1])) if not curve.empty else "-",
                     number(trial.metrics.get(SELECTION_METRIC)), number(float(seconds.median()), 1) if not seconds.empty else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _significance_table(results: list[Paired]) -> list[str]:
    seeds = sorted({s for r in results for s in r.per_seed})
    header = ["dataset", "backbone", "method - baseline", "metric", "over seeds", *(f"seed {s}" for s in seeds), "users"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        users = r.over_seeds.num_users if r.over_seeds else max((c.num_users for c in r.per_seed.values()), default=0)
        early = f"{EARLY_LEARNING}: " if is_early_learning(r.method.convergence, r.baseline.convergence) else ""
        cells = [r.method.dataset, r.method.backbone, f"{r.method.label} - {r.baseline.label}", r.metric,
                 early + (r.over_seeds.text() if r.over_seeds else "-") + (f" ({r.note})" if r.note else ""),
                 *(r.per_seed[s].interval() if s in r.per_seed else "-" for s in seeds), str(users)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _alternative_metrics(methods: list[Method]) -> tuple[str, ...]:
    """The per-user columns at @10 that every trial's table has beyond the kept epoch's beam metrics: each selection
    rule's (``ndcg_at_10_by_val_loss``) and the full sort's (``full_sort_ndcg_at_10``); none for older runs."""
    tables = [trial.per_user() for method in methods for trial in method.trials]
    if not tables or any(table is None for table in tables):
        return ()
    shared = set.intersection(*(set(table.columns) for table in tables))
    full_sort = {FULL_SORT + name for name in AT_10_METRICS}
    return tuple(sorted(c for c in shared if c.startswith(tuple(f"{name}_by_" for name in AT_10_METRICS))
                        or c in full_sort))


def _sources(exports: list[StudyExport]) -> list[str]:
    lines = []
    for export in exports:
        for parent in export.record["parents"]:
            tags = parent["tags"]
            lines.append(f"- study `{export.name}` (exported {export.record['exported_at']} from "
                         f"`{export.record['tracking_uri']}`; code `{tags.get('code_version', '?')[:12]}`, "
                         f"{len(export.trials)} trials):\n  `{tags.get('command_line', '?')}`")
    return lines


def _plans(exports: list[StudyExport]) -> list[str]:
    """What each study's plan answered, its budget protocol and the methods it deferred (rows without trials)."""
    lines = []
    for export in exports:
        for parent in export.record["parents"]:
            plan = json.loads(parent["tags"].get(PLAN_TAG) or "{}")
            if plan.get("answers"):
                protocol = f"; {plan['budget_protocol']}" if plan.get("budget_protocol") else ""
                lines.append(f"- `{export.name}` answers: {plan['answers']}{protocol}")
            lines += [f"  - `{name}`: {reason}" for name, reason in plan.get("deferred", {}).items()]
    return lines


def _chosen_by(exports: list[StudyExport]) -> str:
    """How the best trial of each (study, backbone, loss) was chosen: the selection each study recorded."""
    selections = sorted({selection_of(export).text() for export in exports})
    return f"the best per (study, backbone, loss) by the study's selection: {'; '.join(selections)}"


def build_report(exports: list[StudyExport], out_dir: str | Path, baseline: str = "ce", trials: str = "best",
                 num_resamples: int = 10_000, data_dir: str | None = None) -> Path:
    """Writes ``report.md`` and its PNGs into ``out_dir``; returns the markdown file's path. ``data_dir``: where
    the training-free baselines read the studies' datasets (default: ``$APAO_DATA_DIR``, ``./data``, the cache)."""
    from . import figures  # lazy: matplotlib (which writes a font cache on first import) only when a report is made

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = group_methods(finished_trials(exports, trials))
    unfinished = group_methods(unfinished_trials(exports))
    if not methods and not unfinished:
        names = [e.name for e in exports]
        raise ValueError(f"studies {names} have no trial that trained an epoch: nothing to report on")
    compared = compare_methods(methods, baseline, num_resamples=num_resamples)
    bars = dataset_heuristics({m.dataset for m in methods}, data_dir)
    plans = _plans(exports)
    unknown = unknown_knobs([trial for method in methods for trial in method.trials])
    ties = selection_ties(exports) if trials == "best" else []
    lines = [f"# Study report: {', '.join(e.name for e in exports)}", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python -m apao_ray report`. "
             f"Trials: {_chosen_by(exports) if trials == 'best' else 'all finished'}; "
             "seeds of one method are its trials across the given studies.", "", "## Sources", "", *_sources(exports), "",
             *(["## Plans", "", *plans, ""] if plans else []),
             *([f"Knobs that no loss loaded here declares (a plugin whose module `{PLUGINS_ENV}` does not name): "
                + "; ".join(f"`{loss}`: {', '.join(names)}" for loss, names in unknown.items())
                + ". They label and group the methods as recorded; their ranges and meaning are unknown here.", ""]
               if unknown else []),
             "## Test metrics (beam 20): mean ± sample std over seeds", "", *_metrics_table(methods, bars), "",
             *(["Ties on the selection metric (a tie goes to the trial that started first):", "",
                *(f"- {line}" for line in ties), ""] if ties else []),
             "`paper R@10 / N@10` is SPEC §6 (paper Table 1). It is shown plain only where every seed ran the `paper` "
             "protocol on the paper's schedule (tag `apao.schedule` = `paper`: 200 epochs, patience 20); in "
             "parentheses with `n/c` (not comparable) otherwise. `s/epoch (median)`: each trial's median epoch "
             "(MLflow `perf/epoch_seconds`), averaged over seeds (listed per seed where they differ by more than 2x, e.g. a "
             "CPU seed beside GPU seeds); a median, as epochs that ran beside other work on a "
             "shared machine would pull a mean up (the cost table has the totals). `converged` names each reason a method "
             f"has not converged in its own words: `{STILL_RISING}` where a seed's validation NDCG@10 was still rising "
             f"by more than {STEEP_LAST_GAIN:.0%} at its last epoch (`{ONE_EPOCH}`: it trained one epoch, no slope to "
             f"read), `{NO_BETTER_THAN_POPULARITY}` where its test NDCG@10 is not clearly above the popularity "
             "heuristic's (within two standard errors of the difference, or below it: the verdict the study recorded "
             "with its dataset), both where both hold; a paired difference involving such a method is labelled "
             f"`{EARLY_LEARNING}`: a comparison of early learning, not of trained models. The training-free heuristics (popularity, last-item "
             "transitions; `apao_ray/analysis/bar.py`) stand in the table on the same test users; a method whose test "
             "NDCG@10 is below the last-item heuristic's by more than two standard errors says `below the last-item "
             "heuristic` (`within noise of` it: above by less than two).", "",
             "## Cost per method: all its trials (the price of the answer, as `sweep` and `best` give it; peak memory: "
             "the largest), and the chosen trial's own time (summed over seeds, or per seed where their epochs differ "
             "by more than 2x, as between a CPU and a GPU)", "", *cost_table(methods), ""]
    lines += [f"## Paired differences against `{baseline}` (same seed, same test users)", ""]
    if compared:
        lines += [f"`over seeds`: {INTERVALS_NOTE} `seed N`: that seed alone, 95% bootstrap CI over test users only (no verdict). A one-seed "
                  "comparison whose cell another study measured with >= 2 seeds says how many seeds a verdict would "
                  "need at that spread (80% power for the difference seen).", "",
                  *_significance_table(compared + heuristic_paired(methods, bars, baseline, num_resamples=num_resamples)),
                  "", "A training-free heuristic's row compares it with each seed of the baseline on the same users "
                  "(Holm over the heuristics' rows of one dataset and metric, apart from the trained methods').", ""]
    else:
        lines += [f"No method to compare: each (dataset, backbone) needs a `{baseline}` trial and another method.", ""]
    lines += baseline_sections(recorded_datasets(exports), data_dir)
    lines += subset_sections(methods, data_dir, baseline, num_resamples)
    alternatives = _alternative_metrics(methods)
    if alternatives and compared:
        lines += ["## The same differences at the epoch each selection rule keeps, and by the full sort", "",
                  "`<metric>_by_val_ndcg_at_10` / `_by_val_loss` / `_by_last`: test at the epoch that rule keeps "
                  "(every trial records all three; its own rule's equals the table above); `full_sort_<metric>`: the "
                  "kept epoch ranked by the exact full sort instead of the beam (docs/PROTOCOLS.md). Intervals as "
                  "above, Holm per metric.", "",
                  *_significance_table(compare_methods(methods, baseline, metrics=alternatives,
                                                       num_resamples=num_resamples)), ""]
    pictures = [("Per-prefix recall (paper Fig. 7)", figures.prefix_recall(methods, out_dir / "prefix_recall.png")),
                ("Beam retention (paper Fig. 1c)", figures.retention(methods, out_dir / "beam_retention.png")),
                ("Adaptive weights per epoch", figures.adaptive_weights(methods, out_dir / "adaptive_weights.png")),
                ("Validation NDCG@10 per epoch", figures.validation_curves(methods, out_dir / "val_ndcg_at_10.png"))]
    if unfinished:
        pictures.append(("Trials without test metrics yet: validation NDCG@10 per epoch",
                         figures.validation_curves(unfinished, out_dir / "unfinished_val_ndcg_at_10.png")))
        lines += ["## Trials without test metrics (running, interrupted, pruned or failed)", "",
                  *_unfinished_table(unfinished), ""]
    lines += ["## Figures", ""]
    for title, path in pictures:
        lines += [f"### {title}", "", f"![{title}]({path.name})" if path else "(no data for this figure)", ""]
    report = out_dir / REPORT_FILE
    report.write_text("\n".join(lines))
    return report


def find_exports(directories: list[str], studies: list[str] | None) -> list[StudyExport]:
    """Export directories given directly or as a folder of them (``benchmarks/results/``), kept to
    ``studies`` when given (each must be found)."""
    found: dict[str, StudyExport] = {}
    for directory in map(Path, directories):
        if not directory.is_dir():
            raise FileNotFoundError(f"--exports {directory}: no such directory")
        candidates = [directory] if (directory / STUDY_FILE).exists() else sorted(
            path.parent for path in directory.glob(f"*/{STUDY_FILE}"))
        for candidate in candidates:
            export = load_export(candidate)
            found.setdefault(export.name, export)
    if studies:
        missing = [s for s in studies if s not in found]
        if missing:
            raise ValueError(f"studies {missing} are not in the exports given; found {sorted(found)}")
        return [found[s] for s in studies]
    if not found:
        raise ValueError(f"no study export (a folder with {STUDY_FILE}) in {directories}")
    return list(found.values())


def _main(args: argparse.Namespace) -> int:
    if args.grid:
        if not args.exports:
            raise ValueError("--grid reads committed exports: give --exports DIR (e.g. benchmarks/results)")
        queue_file = args.queue or queue_path_default(args.exports)
        grid = build_grid(find_exports(args.exports, args.study), args.out,
                          load_queue(queue_file) if queue_file else [], args.resamples, args.data_dir)
        print(f"wrote {grid}" + (f" (queue {queue_file})" if queue_file else ""))
        return 0
    if args.exports:
        exports = find_exports(args.exports, args.study)
    else:
        args.study = args.study or [sole_study(args.tracking_uri)]  # the store's only one, else an error naming them
        exports = []
        for study in args.study:
            directory = Path(args.out) / "exports" / study
            export_study(args.tracking_uri, study, directory)
            exports.append(load_export(directory))
    report = build_report(exports, args.out, args.baseline, args.trials, args.resamples, args.data_dir)
    print(f"wrote {report} ({counted(len(exports), 'study', 'studies')})")
    return 0


def _loss_names() -> list[str]:
    from ..losses import LOSSES  # imports torch: only for --help or a given --baseline

    return sorted(LOSSES)


def register(subparsers: Any) -> None:
    """Adds ``report`` to ``python -m apao_ray``."""
    parser = subparsers.add_parser("report", help="markdown report with figures and significance from studies",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", action="extend", nargs="+", metavar="NAME",
                        help="study names, one per seed (--study A B or --study A --study B; default: the MLflow "
                             "store's only study)")
    source = parser.add_mutually_exclusive_group()
    add_tracking_uri_argument(source, "MLflow store to read when --exports is absent")
    source.add_argument("--exports", action="extend", nargs="+", metavar="DIR",
                        help="export directories, or folders of them (e.g. benchmarks/results); --exports A B "
                             "or --exports A --exports B")
    parser.add_argument("--out", required=True, help="directory for report.md and its PNGs")
    parser.add_argument("--baseline", default="ce", action=OneOf, names=_loss_names,
                        help="loss every other method is compared with: one of %(names)s (default ce)")
    parser.add_argument("--trials", choices=TRIAL_CHOICES, default="best",
                        help="per (study, backbone, loss): the best trial by the study's recorded selection (the one "
                             "`best` and the study's table name), or all (default best)")
    parser.add_argument("--resamples", type=positive_int, default=10_000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--data-dir", metavar="DIR", help="where the studies' datasets are, for the training-free "
                        "baselines (default: $APAO_DATA_DIR, ./data, the user cache; never downloaded)")
    parser.add_argument("--grid", action="store_true",
                        help="write grid.md instead: every cell of paper Table 1 with ours at the full protocol, the "
                             "paired difference against CE, the paper's figure and the cell's status (needs --exports)")
    parser.add_argument("--queue", metavar="FILE", help="with --grid: the evidence queue for the status and cost of "
                        "cells not run yet (default: evidence/queue.json beside the exports folder, if there)")
    parser.set_defaults(handler=_main)
