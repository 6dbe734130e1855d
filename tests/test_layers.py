"""The layer contract of ``probe/`` (issue 22), read from every import statement in the code.

Every ``import`` and ``from ... import`` is counted: at module level, inside functions, and under
``if TYPE_CHECKING:`` (a type is a dependency too). A statement depends on each module it names:
``import a.b`` on ``a.b``; ``from a import b`` on ``a`` (its ``__init__`` runs) and on ``a.b`` when
that is a module; relative imports are resolved. Why an ast test and not import-linter: see
docs/architecture.md ("Layers").
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from probe.rundir.mode_files import ModeReader, registered_mode_files

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first, as docs/architecture.md draws them. A module belongs to the layer whose
# name is the longest prefix of its own.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("probe.vocabulary", "probe.errors", "probe.version", "probe.devices")),
    ("rundir", ("probe.rundir",)),
    ("tracer", ("probe.tracer",)),
    ("modes", ("probe.modes",)),
    ("analysis", ("probe.analysis",)),
    ("exporters", ("probe.exporters",)),
    ("session", ("probe.options", "probe.lifecycle", "probe.escalation",
                 "probe.session", "probe.session_plugins", "probe.session_writer")),
    ("integrations", ("probe.integrations",)),
    ("cli", ("probe.cli",)),
]

# The contract: what each layer never imports (issue 22, "What to build", item 1).
NEVER_IMPORTS: dict[str, tuple[str, ...]] = {
    "probe.tracer": ("probe.modes", "probe.analysis", "probe.exporters", "probe.session", "probe.cli",
                     "probe.integrations", "probe.escalation"),
    # Issue 34: rundir is the bottom layer again: the op record's fields are the run format's
    # (rundir.op_record_fields), which the tracer reads, not the other way round.
    "probe.rundir": ("probe.tracer", "probe.modes", "probe.analysis", "probe.exporters", "probe.session",
                     "probe.cli"),
    # Issue 34: modes never import exporters either: they write live output through the sinks the
    # session offers them (probe.modes.sinks), which the exporters implement.
    "probe.modes": ("probe.analysis", "probe.exporters", "probe.session", "probe.cli", "probe.integrations"),
    "probe.analysis": ("probe.exporters", "probe.session", "probe.cli", "probe.modes", "probe.tracer"),
    "probe.exporters": ("probe.session", "probe.cli"),
    "probe.vocabulary": ("probe.rundir", "probe.tracer", "probe.modes", "probe.analysis", "probe.exporters",
                         "probe.options", "probe.session", "probe.escalation", "probe.cli",
                         "probe.integrations"),
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def probe_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the ``probe`` package."""
    found = {}
    for path in sorted((root / "probe").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The probe modules that ``name`` (at ``path``) imports -> the line of the first statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names
                                  if f"{source}.{alias.name}" in known]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    modules = probe_modules(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def contract_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        for layer, forbidden in NEVER_IMPORTS.items():
            if not _within(module, layer):
                continue
            for target, line in sorted(imported.items()):
                if any(_within(target, f) for f in forbidden):
                    found.append(f"{module} -> {target} (line {line})")
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_layer_contract_holds() -> None:
    assert contract_violations(import_graph()) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} (line {graph[a][b]})"
                                                     for a in c for b in graph[a] if b in c) for c in found]
    assert described == []


def test_every_layer_of_the_contract_exists() -> None:
    # A layer renamed away would make its contract vacuous.
    modules = probe_modules()
    for layer, forbidden in NEVER_IMPORTS.items():
        for name in (layer, *forbidden):
            assert any(_within(m, name) for m in modules), name
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            assert any(_within(m, prefix) for m in modules), prefix


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reading_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    # The checker itself must be able to fail: a lazy import and a TYPE_CHECKING import against the
    # contract, and a cycle made of a function-level import, are all found.
    _write(tmp_path, {
        "probe/__init__.py": "",
        "probe/tracer/__init__.py": "",
        "probe/tracer/a.py": "def f():\n    from probe.modes import b\n",
        "probe/rundir/__init__.py": "",
        "probe/rundir/r.py": ("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from ..modes.b import X\n"),
        "probe/modes/__init__.py": "",
        "probe/modes/b.py": "X = 1\ndef g():\n    import probe.modes.c\n",
        "probe/modes/c.py": "from probe.modes.b import X\n",
    })
    graph = import_graph(tmp_path)
    assert contract_violations(graph) == [
        "probe.rundir.r -> probe.modes.b (line 3)",
        "probe.tracer.a -> probe.modes (line 2)", "probe.tracer.a -> probe.modes.b (line 2)",
    ]
    assert cycles(graph) == [["probe.modes.b", "probe.modes.c"]]



# The pieces of probe/modes/ every mode may read; any other subpackage is a mode of its own.
SHARED_BY_MODES = ("probe.modes.base", "probe.modes.config", "probe.modes.registry",
                   "probe.modes.mode_options", "probe.modes.statistics", "probe.modes.rerunnable",
                   "probe.modes.sinks")


def _mode_of(module: str) -> str | None:
    """The mode package ``module`` belongs to (``probe.modes.stats``), or None for a shared piece."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["probe", "modes"] or any(_within(module, s) for s in SHARED_BY_MODES):
        return None
    return ".".join(parts[:3])


def test_modes_never_import_each_other() -> None:
    # Issue 34: what two modes share moves down to a shared piece (upcast's "may this op be re-run").
    found = [f"{module} -> {target} (line {line})" for module, imported in sorted(import_graph().items())
             for target, line in sorted(imported.items())
             if _mode_of(module) and _mode_of(target) and _mode_of(module) != _mode_of(target)]
    assert found == []


def test_exporters_name_no_mode() -> None:
    # Issue 34: the console renders what each mode's reader declares for a step (its section), and
    # a sink's writer implements the modes' sink interface: no exporter imports a mode's package.
    found = [f"{module} -> {target} (line {line})" for module, imported in sorted(import_graph().items())
             if _within(module, "probe.exporters") for target, line in sorted(imported.items())
             if _mode_of(target)]
    assert found == []


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_a_modes_files_are_named_in_its_package_only() -> None:
    # Issue 34: a mode's reader declares its files (ModeFiles.file_names), and no module of rundir
    # names one: rundir/layout.py holds the files every run has, not the statistics', the dump's,
    # the monitor's or the checks'.
    owned = {name: mode for mode, files in registered_mode_files().items() if files is not None
             for name in files.file_names}
    assert [owned.get(name) for name in ("monitor.csv", "checks.jsonl", "checksums.json", "stats.npy",
                                         "stats_index.npy", "tensors.json", "calls.jsonl")] == [
        "monitor", "free_benchmark", "checksums", "stats", "stats", "dump", "dump"]
    found = [f"{path.name} names {name!r}, a file of mode {owned[name]!r}"
             for path in sorted((ROOT / "probe" / "rundir").glob("*.py"))
             for name in sorted(_string_constants(path)) if name in owned]
    assert found == []


def _returned_classes(method: typing.Any) -> set[type]:
    """The classes a method's return annotation names (``list[X]`` names X)."""
    pending, found = [typing.get_type_hints(method).get("return")], set()
    while pending:
        hint = pending.pop()
        if isinstance(hint, type) and not typing.get_args(hint):
            found.add(hint)
        pending += typing.get_args(hint)
    return found


def _package_of(cls: type) -> str:
    return cls.__module__.rpartition(".")[0]


def test_a_modes_records_are_defined_in_its_package() -> None:
    # Issue 34: what run.mode(name) returns is the mode's own (its records beside its reader), not
    # a type of rundir/records.py; rundir reads the records every run has.
    readers = {mode: files.run_reader for mode, files in registered_mode_files().items()
               if files is not None and files.run_reader is not ModeReader}
    assert {"monitor", "free_benchmark", "checksums", "stats", "dump"} <= set(readers)
    found = [f"{mode}: {reader.__name__}.{name} returns {cls.__module__}.{cls.__qualname__}"
             for mode, reader in sorted(readers.items()) for name in dir(reader)
             if not name.startswith("_") and name not in vars(ModeReader)
             for cls in _returned_classes(getattr(reader, name))
             if cls.__module__.startswith("probe.") and not _within(cls.__module__, _package_of(reader))]
    assert found == []


# The package facade re-exports each mode's public classes (probe.Stats, probe.AnomalyStop, ...):
# API.md's names, bound lazily by name; it runs nothing of a mode.
FACADE = "probe"


def mode_package_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of a mode's package from outside ``probe/modes/`` (the facade aside): code outside
    the modes reaches a mode through the registry (``probe.modes.registry``, ``probe.modes.config``)."""
    return [f"{module} -> {target} (line {line})" for module, imported in sorted(graph.items())
            if module != FACADE and not _within(module, "probe.modes")
            for target, line in sorted(imported.items()) if _mode_of(target)]


def test_nothing_outside_modes_imports_a_mode_package() -> None:
    # Issue 34: the session, the options, the CLI, analysis and exporters name no mode's code.
    assert mode_package_imports(import_graph()) == []


def test_the_mode_package_check_finds_a_lazy_import_of_a_mode(tmp_path: Path) -> None:
    _write(tmp_path, {
        "probe/__init__.py": "from probe.modes.stats import Stats\n",
        "probe/cli.py": ("def f():\n    from probe.modes.stats.mode import X\n"
                         "    from probe.modes import registry\n"),
        "probe/modes/__init__.py": "",
        "probe/modes/registry.py": "",
        "probe/modes/stats/__init__.py": "",
        "probe/modes/stats/mode.py": "X = 1\n",
    })
    assert mode_package_imports(import_graph(tmp_path)) == ["probe.cli -> probe.modes.stats.mode (line 2)"]


def _mode_named(call: ast.AST) -> str | None:
    """The mode ``call`` reads when it is ``self.mode("name")`` (or ``run.mode(...)``)."""
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "mode"
            and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
        return call.args[0].value
    return None


def rundir_mode_reads(root: Path = ROOT) -> list[str]:
    """Where a module of rundir reads a mode's records: calls or names a method of a mode's run
    reader (``series``, ``output_stats``, ...) or one of ``Run``'s one-line aliases of them (a
    method whose body asks ``self.mode("name")``), outside those aliases themselves."""
    reads = {name: mode for mode, files in registered_mode_files().items()
             if files is not None and files.run_reader is not ModeReader
             for name in vars(files.run_reader) if not name.startswith("_")}
    trees = {path: ast.parse(path.read_text(), str(path))
             for path in sorted((root / "probe" / "rundir").glob("*.py"))}
    aliases: set[ast.AST] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                named = {mode for inner in ast.walk(node) if (mode := _mode_named(inner)) is not None}
                if named:
                    aliases.add(node)
                    reads[node.name] = ", ".join(sorted(named))
    inside = {id(inner) for alias in aliases for inner in ast.walk(alias)}
    found = []
    for path, tree in trees.items():
        imported = {(alias.asname or alias.name).partition(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        found += [f"{path.name}:{node.lineno} reads {node.attr!r} (mode {reads[node.attr]!r})"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in reads and id(node) not in inside
                  and not (isinstance(node.value, ast.Name) and node.value.id in imported)]  # torch.tensor
    return sorted(found)


def test_rundir_reads_no_modes_records() -> None:
    # Issue 34: what the run reader and its analyses of op records (the loss scaler, the rank a
    # fault started on) need of a mode they ask through ModeFiles' declared capabilities
    # (outputs_nonfinite, loss_scaler), never by a mode's reader method or Run's alias of one.
    assert rundir_mode_reads() == []
