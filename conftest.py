"""The documentation's Python blocks as tests: README.md and docs/*.md, collected with pytest-markdown-docs.

`python -m pytest` collects them because pyproject's testpaths name README.md and docs/ (no flag needed:
this file hands .md files to the plugin's collector). Each block that is not marked `python notest` runs
as a script in a fresh interpreter, as a reader who pastes it into a file would run it, against a real
coda-server started for it on 127.0.0.1:0 with the default configuration (its address in the environment
variable CODA_ADDRESS, which the blocks read). A block fails on an exception, a non-zero exit, or when it
has not ended within DOC_BLOCK_TIMEOUT_SECONDS (it is killed). tests/test_doc_blocks.py checks that every
`notest` block says why it is a fragment.
"""
from __future__ import annotations

import os
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


@register_runner(default=True)
class ScriptRunner(_Runner):
    """Runs a block as a script of its own (`python block.py`) in a fresh interpreter, with a time limit."""

    def runtest(self, test: Any, args: dict[str, Any], *, asyncio_runner: Any = None) -> None:
        workdir = Path(os.environ.get("DOC_BLOCK_WORKDIR") or ROOT)
        source_path = Path(test.source_path)
        script = workdir / f"{source_path.name}-line{test.start_line}.py"
        script.write_text(test.source)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen([sys.executable, str(script)], cwd=workdir, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=DOC_BLOCK_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise DocBlockFailed(f"{source_path.name}:{test.start_line}: the block did not end within "
                                 f"{DOC_BLOCK_TIMEOUT_SECONDS:g} s (killed). Its output:\n"
                                 f"{output.decode(errors='replace')[-4000:]}") from None
        text = output.decode(errors="replace")
        if process.returncode != 0:
            raise DocBlockFailed(f"{source_path.name}:{test.start_line}: the block exited with "
                                 f"{process.returncode}. Its output:\n{text[-4000:]}")
        print(text, end="")

    def repr_failure(self, test: Any, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        return str(excinfo.value)


class DocBlockFailed(AssertionError):
    """A documentation block raised, exited non-zero, or hung."""
