"""The documentation's Python blocks as tests: README.md and docs/*.md, collected with pytest-markdown-docs.

`python -m pytest` collects them because pyproject's testpaths name README.md and docs/ (no flag needed:
this file hands .md files to the plugin's collector). Each block that is not marked `python notest` runs
in a fresh interpreter, as a reader who pastes it into a file would run it, against a real coda-server started
for it on 127.0.0.1:0 with the default configuration (its address in the environment variable CODA_ADDRESS,
which the blocks read): as a script (`python block.py`), or, when it defines pytest tests (a top-level
`def test_...` or `class Test...`), under pytest (`python -m pytest block.py`), so its tests are called and a
failing assertion fails the block. It runs in a fresh directory that mirrors the repository's top level
(symlinks), so a path the docs give from the repository root (`examples/strategies`) is there while the files a
block writes stay out of the repository. A block fails on an exception, a non-zero exit (a failed or missing
test), or when it has not ended within DOC_BLOCK_TIMEOUT_SECONDS (it is killed). tests/test_doc_blocks.py
checks that every `notest` block says why it is a fragment.
"""
from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pytest_markdown_docs._runners import _Runner, register_runner
from pytest_markdown_docs.plugin import MARKER_NAME, MarkdownTextFile

ROOT = Path(__file__).resolve().parent
DOC_FILES = {ROOT / "README.md", *(ROOT / "docs").glob("*.md")}
DOC_BLOCK_TIMEOUT_SECONDS = 90.0
ADDRESS_VARIABLE = "CODA_ADDRESS"
# The runner's own pytest set-up, not part of what the docs show: a block's tests run without it, as in a
# reader's project (and pytest in the block's directory must not pick up this file or the repository's ini).
NOT_MIRRORED = {"conftest.py", "pyproject.toml"}


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Any:
    """README.md and docs/*.md go to pytest-markdown-docs' collector (unless --markdown-docs already does it)."""
    if Path(file_path).resolve() in DOC_FILES and not parent.config.option.markdowndocs:
        return MarkdownTextFile.from_parent(parent, path=Path(file_path))
    return None


@pytest.fixture(autouse=True)
def _doc_block_server(request: pytest.FixtureRequest) -> Any:
    """For a documentation block only: a coda-server on 127.0.0.1:0 (default configuration), its address in
    CODA_ADDRESS, and the block's working directory. Other tests get nothing (and pay nothing)."""
    if request.node.get_closest_marker(MARKER_NAME) is None:
        yield None
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from server_harness import ServerProcess
    finally:
        sys.path.remove(str(ROOT / "tests"))
    with ServerProcess(tmp_path) as server:
        monkeypatch.setenv(ADDRESS_VARIABLE, server.address)
        monkeypatch.setenv("DOC_BLOCK_WORKDIR", str(tmp_path))
        yield server


def defines_tests(source: str) -> bool:
    """The block defines pytest tests: a top-level `def test_...` (or async) or `class Test...`."""
    try:
        body = ast.parse(source).body
    except SyntaxError:  # run as a script, where the error shows as the reader would see it
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
               or isinstance(node, ast.ClassDef) and node.name.startswith("Test") for node in body)


def mirror_repository(workdir: Path) -> None:
    """Symlink the repository's top-level entries into `workdir`: paths the docs give from the repository root
    resolve there, and what a block writes (a checkpoint, a log) lands in `workdir`, not in the repository."""
    if workdir.resolve() == ROOT:
        return
    for entry in ROOT.iterdir():
        link = workdir / entry.name
        if entry.name.startswith(".") or entry.name in NOT_MIRRORED or link.exists() or link.is_symlink():
            continue
        link.symlink_to(entry, target_is_directory=entry.is_dir())


@register_runner(default=True)
class ScriptRunner(_Runner):
    """Runs a block in a fresh interpreter with a time limit: as a script of its own (`python block.py`), or
    under pytest when it defines tests (defining them is not running them)."""

    def runtest(self, test: Any, args: dict[str, Any], *, asyncio_runner: Any = None) -> None:
        workdir = Path(os.environ.get("DOC_BLOCK_WORKDIR") or ROOT)
        mirror_repository(workdir)
        source_path = Path(test.source_path)
        where = f"{source_path.name}:{test.start_line}"
        under_pytest = defines_tests(test.source)
        if under_pytest:  # an importable module name that pytest collects
            script = workdir / f"test_{re.sub(r'[^0-9A-Za-z_]', '_', source_path.stem)}_line{test.start_line}.py"
            command = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider",
                       "--rootdir", str(workdir), str(script)]
        else:
            script = workdir / f"{source_path.name}-line{test.start_line}.py"
            command = [sys.executable, str(script)]
        script.write_text(test.source)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=DOC_BLOCK_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise DocBlockFailed(f"{where}: the block did not end within "
                                 f"{DOC_BLOCK_TIMEOUT_SECONDS:g} s (killed). Its output:\n"
                                 f"{output.decode(errors='replace')[-4000:]}") from None
        text = output.decode(errors="replace")
        if process.returncode != 0:
            what = (f"the block's tests failed under pytest (exit {process.returncode}; 5: no test ran)"
                    if under_pytest else f"the block exited with {process.returncode}")
            raise DocBlockFailed(f"{where}: {what}. Its output:\n{text[-4000:]}")
        print(text, end="")

    def repr_failure(self, test: Any, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        return str(excinfo.value)


class DocBlockFailed(AssertionError):
    """A documentation block raised, exited non-zero, or hung."""
