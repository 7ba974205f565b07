"""The package's import graph, read with ``ast`` (function-level imports included): no cycles, and
the arrows point the way docs/architecture.md says: core -> training -> study -> (nothing above it);
inside the study, each sub-package imports only those before it in STUDY_LAYERS (spec and cluster at the
bottom, then record, search, setup, plan, run, api, cli); analysis below the study driver; only ``tracking``
imports mlflow; only the study and the Ray Train worker import ray."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "apao_ray"
# the layers that must not reach up: a module in a layer may not import a module of the layers named
CORE = ("data", "models", "losses", "decoding", "metrics", "rank_metrics", "config", "protocol", "names", "paths", "hardware", "storage")
FORBIDDEN: dict[tuple[str, ...], tuple[str, ...]] = {
    CORE: ("training", "study", "tracking", "analysis", "reuse", "serving", "cli.commands"),
    ("training",): ("study", "tracking", "analysis", "reuse", "serving", "cli.commands"),
    ("analysis",): ("study", "reuse", "serving", "cli.commands"),
    ("tracking",): ("study", "analysis", "serving", "cli.commands"),
    ("reuse",): ("study", "analysis", "tracking", "serving", "cli.commands"),
    ("serving",): ("study", "analysis", "cli.commands"),
    ("cli.types",): ("data", "models", "losses", "training", "study", "tracking", "analysis", "reuse", "cli.commands"),
}
# inside the study layer, lowest first: a sub-package (or module) imports only those before it. spec (what was
# asked, pure) and cluster (Ray start-up, stop signals) need nothing of the study; record (tags, callbacks, table)
# is read by the search (its trials' tags) and everything above; setup checks a spec against the world with
# them; the plan fits a setup; run drives Tune with spec, setup and plan; api and cli on top
STUDY_LAYERS = ("study.spec", "study.cluster", "study.record", "study.search", "study.setup", "study.plan", "study.run",
                "study.api", "study.cli")
FORBIDDEN.update({(layer,): STUDY_LAYERS[i + 1:] for i, layer in enumerate(STUDY_LAYERS[:-1])})
THIRD_PARTY_OWNERS = {"mlflow": ("tracking",), "ray": ("study", "training.worker")}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every name ``module`` imports anywhere in its file, resolved to modules of the package where they are."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:  # `from . import x` imports the submodule x where there is one
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, third-party top-level names each module imports)."""
    modules = _modules()
    edges, external = {}, {}
    for module, path in modules.items():
        names = _imports(module, path, modules)
        internal = set()
        for name in names:
            if name.split(".")[0] == "apao_ray":
                while name not in modules:  # `from .data.catalog import Catalog` resolved to its module
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    internal.add(name)
        edges[module] = internal
        external[module] = {name.split(".")[0] for name in names if name.split(".")[0] != "apao_ray"}
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return components


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    relative = module.removeprefix("apao_ray.")
    return any(relative == p or relative.startswith(p + ".") for p in prefixes)


def test_the_graph_reader_sees_function_level_imports_and_cycles():
    edges, _ = _graph()
    # cli imports its subcommands' modules inside functions (importlib by name is not an import: not seen)
    assert "apao_ray.data" in edges["apao_ray.cli.commands"]
    assert "apao_ray.losses.registry" in edges["apao_ray.losses.apao"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(_graph()[0]) == []


def _folder(module: str) -> str:
    """The folder of apao_ray/ a module lives in ('reuse', 'study'); the package's own top-level modules
    (config.py, paths.py, ...) are each a node of their own. Inside study/ the layers are STUDY_LAYERS' test."""
    return module.split(".")[1] if "." in module else ""


def test_no_import_cycles_between_folders():
    """Modules without a cycle can still tie their folders in one (reuse/serve -> tracking -> reuse/inference):
    the folders must form a stack too. The package's __init__ (load_recommender, above everything) is left out."""
    modules = _graph()[0]
    folders: dict[str, set[str]] = {}
    for module, targets in modules.items():
        if module == "apao_ray":
            continue
        here = _folder(module)
        folders.setdefault(here, set()).update(_folder(t) for t in targets if t != "apao_ray" and _folder(t) != here)
    for targets in list(folders.values()):
        for target in targets:
            folders.setdefault(target, set())
    assert _cycles(folders) == []
    assert _folder("apao_ray.study.run.driver") == "study" and _folder("apao_ray.paths") == "paths"


@pytest.mark.parametrize("layer", list(FORBIDDEN), ids=lambda layer: "core" if layer == CORE else "+".join(layer))
def test_lower_layers_never_import_upper_ones(layer):
    edges, _ = _graph()
    wrong = sorted(f"{module} -> {target}" for module, targets in edges.items() if _in(module, layer)
                   for target in targets if _in(target, FORBIDDEN[layer]))
    assert wrong == []


@pytest.mark.parametrize("library", list(THIRD_PARTY_OWNERS))
def test_only_its_owners_import_a_framework(library):
    _, external = _graph()
    wrong = sorted(module for module, names in external.items()
                   if library in names and not _in(module, THIRD_PARTY_OWNERS[library]))
    assert wrong == []


MAX_LINES = 400  # a module or test file past this holds more than one job: split it by subject


def test_no_module_or_test_file_is_over_400_lines():
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tests").glob("*.py")]
    assert len(files) > 50  # the walk found the package and the tests
    long = {str(f.relative_to(PACKAGE.parent)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


# test files named for no module, command or script, each for what it checks across the package
CROSS_CUTTING = {
    "test_architecture": "the package's import graph and file sizes",
    "test_docs": "the documentation's links and the rules it states",
    "test_documented_commands": "the commands the documentation shows",
    "test_own_data": "a user's own dataset directory, through load_dataset and `data stats`",
    "test_postgres": "a study whose Optuna and MLflow stores are on PostgreSQL",
    "test_toy_loss": "a loss defined outside the package, loaded as a plugin by this module's name",
}


def _test_file_subjects() -> set[str]:
    """What a test file may be named for: a module or package of apao_ray (``budget``, ``record_report`` where
    two folders share the name, ``semantic_ids``), a command (``sweep``, ``export_study``) or a script of
    benchmarks/ (``wheelset``)."""
    from apao_ray.cli.commands import build_parser

    subjects = set()
    for module in _modules():
        parts = module.split(".")[1:]
        if parts and parts[-1] != "__main__":
            subjects.update({parts[-1], "_".join(parts[-2:])})
    commands = build_parser()._subparsers._group_actions[0].choices
    subjects.update(name.replace("-", "_") for name in commands)
    subjects.update(path.stem for path in (PACKAGE.parent / "benchmarks").rglob("*.py"))
    return subjects


def _misnamed(names: list[str], subjects: set[str]) -> list[str]:
    """Test files named neither test_<subject> nor test_<subject>_<aspect>, nor in CROSS_CUTTING."""
    return sorted(name for name in names if name not in CROSS_CUTTING
                  and not any(name == f"test_{s}" or name.startswith(f"test_{s}_") for s in subjects))


def test_every_test_file_is_named_for_a_module_a_command_or_a_script():
    """docs/testing.md's "Where a test goes": a newcomer finds a module's tests by its name."""
    subjects = _test_file_subjects()
    assert {"budget", "record_report", "analysis_report", "semantic_ids", "export_study", "sweep", "wheelset"} <= subjects
    assert _misnamed(["test_budget", "test_loop_two_stage", "test_sweep_s3", "test_misc", "test_unit_losses"],
                     subjects) == ["test_misc", "test_unit_losses"]
    names = [path.stem for path in (PACKAGE.parent / "tests").glob("test_*.py")]
    assert len(names) > 50 and set(CROSS_CUTTING) <= set(names), "a named cross-cutting file is gone: drop it here"
    assert _misnamed(names, subjects) == [], "name it test_<module>[_<aspect>].py, or see docs/testing.md"
