"""The floors of the house hold (issue 28).

- The import-linter contracts of ``pyproject.toml`` (``[tool.importlinter]``) are kept: entry points >
  trainer > workers > models | algorithms | single_controller | placement > tasks > utils > protocol >
  keys, each importing only downward, and the rooms inside the trainer and the rollout likewise.
- No module of ``hybridflow`` reaches itself through its imports: a layers contract does not see a
  circle inside one layer, so the whole module graph is checked for cycles.

grimp (the graph under import-linter) reads every import statement, those inside functions and under
``TYPE_CHECKING`` included, so a lazy import counts as much as a top-level one.
"""

import pathlib
import sys

import grimp
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

import hybridflow

REPO = pathlib.Path(__file__).resolve().parents[1]


def import_cycles(package: str) -> list[list[str]]:
    """One shortest cycle ``[a, b, ..., a]`` per set of modules that import each other around a loop."""
    graph = grimp.build_graph(package, cache_dir=None)
    cycles: dict[frozenset, list[str]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycles.setdefault(frozenset(back), [importer, *back])
    return list(cycles.values())


def test_the_checked_package_is_this_checkout():
    assert pathlib.Path(hybridflow.__file__).resolve().parent == REPO / "hybridflow"


def test_layer_contracts_are_kept():
    configuration.configure()  # what the lint-imports command does first
    # on failure the captured output names each import that breaks a contract
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), cache_dir=None, no_logo=True)


def test_hybridflow_has_no_import_cycle():
    cycles = import_cycles("hybridflow")
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_a_lazy_import_back_is_a_cycle(tmp_path, monkeypatch):
    """The check sees a circle closed by an import inside a function (the usual way one hides)."""
    package = tmp_path / "circle_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from circle_pkg import high\n")
    (package / "high.py").write_text("from circle_pkg import low\n")
    (package / "apart.py").write_text("import circle_pkg.low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert import_cycles("circle_pkg") == [["circle_pkg.high", "circle_pkg.low", "circle_pkg.high"]]
    finally:
        sys.modules.pop("circle_pkg", None)
