"""The core's layout stays what docs/architecture.md describes: one concept per module, imports one way."""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "coda_server" / "core"


def core_imports(path: Path, core: Path = CORE) -> set[str]:
    """The core modules `path` imports, at run time or for type checking only (`if TYPE_CHECKING:`): both
    count, as a module that names another for its annotations depends on it as much."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("coda_server.core."):
                found.add(node.module.split(".")[2])
    return {name for name in found if (core / f"{name}.py").exists()}


def import_cycles(core: Path = CORE) -> set[frozenset[str]]:
    """The modules of each import cycle among the core modules (strongly connected groups of more than one)."""
    graph = {path.stem: core_imports(path, core) for path in core.glob("*.py") if path.stem != "__init__"}
    reaches: dict[str, set[str]] = {module: set() for module in graph}
    for module in graph:
        todo = list(graph[module])
        while todo:
            other = todo.pop()
            if other not in reaches[module]:
                reaches[module].add(other)
                todo.extend(graph[other])
    return {frozenset({module} | {other for other in reaches[module] if module in reaches[other]})
            for module in graph if module in reaches[module]}


def test_core_modules_import_each_other_without_cycles():
    """Imports go one way (docs/architecture.md): from the Pacer down to the objects it builds and the owners."""
    assert import_cycles() == set()


def test_the_cycle_check_finds_a_cycle(tmp_path):
    (tmp_path / "first.py").write_text("from .second import B\n")
    (tmp_path / "second.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .first import A\n")
    (tmp_path / "third.py").write_text("from .first import A\n")
    assert import_cycles(tmp_path) == {frozenset({"first", "second"})}


def test_the_cycle_check_counts_imports_made_for_type_checking_only(tmp_path):
    checked = tmp_path / "checked.py"
    checked.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pacer import Pacer\n")
    assert core_imports(checked) == {"pacer"}


def private_reads(path: Path, owner: str) -> list[str]:
    """`owner._name` (or `x.owner._name`, `x._owner._name`) in `path`: a private attribute of another object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
            if name.lstrip("_") == owner:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_or_writes_the_pacers_private_attributes():
    """The Pacer's state belongs to its owners (the in-flight table, the buffer, the collector, the step
    boundary...): other modules reach them through its public references and change them by their methods."""
    found = [hit for path in sorted(CORE.parent.rglob("*.py")) if path != CORE / "pacer.py"
             for hit in private_reads(path, "pacer")]
    assert found == []


def test_the_private_attribute_check_finds_a_pacer_private(tmp_path):
    reaching = tmp_path / "reaching.py"
    reaching.write_text("def f(pacer, self):\n    pacer._inflight.clear()\n    return self._pacer._lock\n")
    assert len(private_reads(reaching, "pacer")) == 2


MAX_LINES = 500


def long_modules(directory: Path) -> dict[str, int]:
    lengths = {path.name: len(path.read_text().splitlines()) for path in directory.glob("*.py")}
    return {name: n for name, n in lengths.items() if n > MAX_LINES}


def test_no_core_module_is_over_500_lines():
    assert long_modules(CORE) == {}


def test_the_length_check_finds_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_modules(tmp_path) == {"long.py": MAX_LINES + 1}


def test_every_core_module_says_in_one_line_what_it_owns():
    missing = [path.name for path in sorted(CORE.glob("*.py"))
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert missing == []


def test_the_core_runs_without_grpc():
    import subprocess
    import sys

    probe = ("import sys, coda_server.core.async_pacer, coda_server.core.sqlite_journal, coda_server.core.recovery; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))")
    # coda_server/__init__.py imports only the core, so importing a core module loads nothing else.
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def holders_of(pacer: object) -> list[str]:
    """The core objects the Pacer holds (its owners and the objects that cross them) that hold the Pacer itself."""
    def attributes(obj: object) -> dict:
        slots = [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
        return {**getattr(obj, "__dict__", {}), **{name: getattr(obj, name) for name in slots if hasattr(obj, name)}}

    return [f"{name}.{attr}" for name, held in vars(pacer).items()
            if any(cls.__module__.startswith("coda_server.core.") for cls in type(held).__mro__)
            for attr, value in attributes(held).items() if value is pacer]


def test_the_owners_and_the_objects_that_cross_them_are_given_owners_never_the_pacer():
    from coda_server.core import Pacer, load_config
    pacer = Pacer(load_config())
    assert {"admission", "intake", "delivery", "workers", "boundary", "checkpoints", "snapshots", "recovery",
            "collector", "signals", "lifecycle"} <= set(vars(pacer))
    assert holders_of(pacer) == []


def test_the_holder_check_finds_an_object_given_the_pacer():
    from coda_server.core import Pacer, load_config
    from coda_server.core.job_end import Lifecycle

    class Reaching(Lifecycle):
        __slots__ = ("pacer",)

    pacer = Pacer(load_config())
    pacer.lifecycle = Reaching()
    pacer.lifecycle.pacer = pacer
    assert holders_of(pacer) == ["lifecycle.pacer"]
