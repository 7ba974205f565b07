"""What a method cost, for the report: every trial of its (backbone, loss) summed (the price of the answer), its
median epoch, and the chosen trial's own time; per seed where the seeds ran on different devices."""
from __future__ import annotations

import math
from typing import Any

from ..names import CPU, ENERGY, GPU_MEMORY, RSS, WALL
from .export import cost_totals
from .results import Method, seeds_text


def number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def epoch_medians(method: Method) -> list[float]:
    return [float(t.history("perf/epoch_seconds").median()) for t in method.trials
            if not t.history("perf/epoch_seconds").empty]


def mixed_devices(method: Method) -> bool:
    """Whether the seeds' median epochs differ by more than 2x, as between a CPU seed and a GPU seed: their mean
    or sum would describe neither, so the report lists them per seed."""
    medians = epoch_medians(method)
    return bool(medians) and max(medians) > 2 * min(medians)


def epoch_seconds(method: Method) -> str:
    """The trials' median epoch, averaged over seeds (per seed, ``a / b / c``, on mixed devices)."""
    medians = epoch_medians(method)
    if not medians:
        return "-"
    if mixed_devices(method):
        return " / ".join(number(m, 1) for m in medians)
    return number(sum(medians) / len(medians), 1)


def minutes(method: Method, *keys: str) -> str:
    """The trials' first recorded ``keys`` in minutes: summed over seeds, or per seed on mixed devices."""
    per_trial = [next((t.metrics[k] for k in keys if k in t.metrics), None) for t in method.trials]
    if mixed_devices(method):
        return " / ".join("-" if v is None else number(v / 60, 1) for v in per_trial)
    known = [v for v in per_trial if v is not None]
    return number(sum(known) / 60, 1) if known else "-"


def cost_table(methods: list[Method]) -> list[str]:
    """Per method, its cost: every trial of its (backbone, loss) in its studies (finished, pruned or failed: the
    price of the answer, as ``sweep``, ``best`` and the study's MLflow page give it) summed (peak memory: the largest);
    then the chosen trial's own wall time (summed over seeds, or per seed on mixed devices)."""
    header = ["dataset", "backbone", "method", "seeds", "trials", "wall min", "CPU min", "peak RSS MB", "peak GPU MB",
              "energy kWh", "energy method", "chosen trial's time (wall min)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        records = method_records(method)
        cost = cost_totals(records).get((method.backbone, method.loss), {})
        cells = [method.dataset, method.backbone, method.label, seeds_text(method.seeds), str(len(records)),
                 *(number(cost[key] / 60, 1) if key in cost else "-" for key in (WALL, CPU)),
                 *(number(cost[key], 0) if key in cost else "-" for key in (RSS, GPU_MEMORY)),
                 f"{cost[ENERGY]:.3g}" if ENERGY in cost else "-",
                 method.tag_values("apao.energy_method", "not recorded"),
                 minutes(method, WALL, "perf/total_seconds")]  # perf/: runs before cost/ existed
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def method_records(method: Method) -> list[dict[str, Any]]:
    """Every trial record of the method's (backbone, loss) in the studies its seeds come from, whatever its end."""
    exports = {trial.export.name: trial.export for trial in method.trials}.values()
    return [record for export in exports for record in export.trials
            if (record["tags"].get("backbone"), record["tags"].get("loss")) == (method.backbone, method.loss)]
