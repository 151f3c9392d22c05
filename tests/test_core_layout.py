"""The core's layout stays what docs/architecture.md describes: one concept per module, imports one way."""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "coda_server" / "core"


def runtime_imports(path: Path) -> set[str]:
    """The core modules `path` imports when it runs (imports under `if TYPE_CHECKING:` do not count)."""
    tree = ast.parse(path.read_text())
    checking_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                     for statement in block.body for node in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("coda_server.core."):
                found.add(node.module.split(".")[2])
    return {name for name in found if (CORE / f"{name}.py").exists()}


def test_core_modules_import_each_other_without_cycles():
    graph = {path.stem: runtime_imports(path) for path in CORE.glob("*.py") if path.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, f"import cycle: {' -> '.join(trail + (module,))}"
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, trail + (module,))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


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
