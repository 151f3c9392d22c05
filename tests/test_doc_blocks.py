"""The documentation's code blocks: the Python ones run in CI (see the root conftest.py), the fragments say why
they are fragments, and the runner fails a block that raises or hangs."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from pytest_markdown_docs.definitions import FenceTestDefinition

from conftest import read_pyproject

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python", "py", "python3")


def python_fences() -> list[tuple[Path, int, list[str], str]]:
    """(file, line, info words, code) of every Python fence, as pytest-markdown-docs' parser sees them."""
    parser = MarkdownIt("commonmark")
    found = []
    for path in DOCS:
        for token in parser.parse(path.read_text(encoding="utf-8")):
            words = token.info.split()
            if token.type == "fence" and words and words[0] in PYTHON:
                found.append((path, token.map[0] + 1, words, token.content))
    return found


def test_pytest_collects_the_documentation_blocks():
    """`python -m pytest` (the README's command, and CI's) runs the blocks: testpaths name README.md and docs."""
    settings = read_pyproject()["tool"]["pytest"]["ini_options"]
    assert {"tests", "README.md", "docs"} <= set(settings["testpaths"])
    assert (ROOT / "conftest.py").read_text().count("MarkdownTextFile.from_parent") == 1


def test_every_fragment_says_why_it_is_one():
    fences = python_fences()
    assert len(fences) >= 10
    unexplained = []
    for path, line, words, code in fences:
        assert words[0] == "python" and set(words[1:]) <= {"notest"}, (
            f"{path.name}:{line}: a Python fence is `python` (runs in CI) or `python notest` (a fragment), "
            f"not {' '.join(words)!r}")
        if "notest" in words:
            first = code.splitlines()[0] if code else ""
            reason = re.fullmatch(r"#\s*(?:Fragment|.*\ba fragment\b).*", first, re.IGNORECASE)
            if reason is None or len(first.split()) < 6:
                unexplained.append(f"{path.name}:{line}: {first!r}")
    assert not unexplained, ("a `python notest` block must open with a comment saying it is a fragment and why "
                             "(e.g. `# Fragment: needs torch.distributed`): " + "; ".join(unexplained))


def test_runnable_blocks_take_the_server_address_from_the_environment():
    """A runnable block that talks to a server reads CODA_ADDRESS (the test's server) with the default address
    as the fallback a reader gets, rather than a fixed address the test cannot point elsewhere."""
    fixed = [f"{path.name}:{line}" for path, line, words, code in python_fences()
             if "notest" not in words and ":50051" in code and "CODA_ADDRESS" not in code]
    assert not fixed, f"runnable blocks with a fixed server address: {fixed}"


@pytest.fixture
def runner(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("doc_blocks_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DOC_BLOCK_TIMEOUT_SECONDS", 3.0)
    monkeypatch.setenv("DOC_BLOCK_WORKDIR", str(tmp_path))
    return module


def block(code: str) -> FenceTestDefinition:
    return FenceTestDefinition(code, (), 7, ROOT / "docs" / "example.md", None)


def test_the_block_runner_passes_a_block_that_ends_and_fails_one_that_raises_or_hangs(runner):
    run = runner.ScriptRunner().runtest
    run(block("print('fine')\n"), {})
    with pytest.raises(runner.DocBlockFailed, match="(?s)exited with 1.*ValueError: broken"):
        run(block("raise ValueError('broken')\n"), {})
    with pytest.raises(runner.DocBlockFailed, match="did not end within 3 s"):
        run(block("import time\nwhile True:\n    time.sleep(0.1)\n"), {})


def test_a_block_that_defines_tests_has_them_run_and_a_failing_assertion_fails_it(runner, monkeypatch):
    """A block of `def test_...` functions was run as a script: the tests were defined, never called, and a wrong
    assertion in docs/custom-strategies.md's example passed CI. Such a block now runs under pytest."""
    monkeypatch.setattr(runner, "DOC_BLOCK_TIMEOUT_SECONDS", 120.0)  # pytest's start-up on a busy machine
    run = runner.ScriptRunner().runtest
    with pytest.raises(runner.DocBlockFailed, match=r"(?s)tests failed under pytest.*assert \[\] == \['p0'\]"):
        run(block("def test_restored():\n    restored = []\n    assert restored == ['p0']\n"), {})
    run(block("def test_fine():\n    assert 1 + 1 == 2\n"), {})
    with pytest.raises(runner.DocBlockFailed, match="tests failed under pytest"):
        run(block("class TestGroup:\n    def test_it(self):\n        assert False, 'class tests run too'\n"), {})


def test_a_block_finds_the_repository_paths_the_docs_give_and_writes_outside_the_repository(runner, tmp_path,
                                                                                           monkeypatch):
    """The docs give paths from the repository root (`examples/strategies`); blocks ran in an empty temporary
    directory, where the path did not exist (`skipping custom strategy directory examples/strategies: not a
    directory`) and the block passed anyway."""
    monkeypatch.setattr(runner, "DOC_BLOCK_TIMEOUT_SECONDS", 120.0)
    run = runner.ScriptRunner().runtest
    run(block("from pathlib import Path\n"
              "assert Path('examples/strategies/fixed_capacity.py').is_file()\n"
              "Path('written-by-a-block.txt').write_text('x')\n"), {})
    assert (tmp_path / "written-by-a-block.txt").is_file() and not (ROOT / "written-by-a-block.txt").exists()
    run(block("from coda_server.core.plugins import load_custom_modules\n"
              "from coda_server.core.strategy import STRATEGIES\n"
              "load_custom_modules(['examples/strategies'])\n\n\n"
              "def test_registered():\n    assert 'fixed-capacity' in STRATEGIES.names()\n"), {})


def test_runnable_blocks_name_only_repository_paths_that_exist():
    """A path a runnable block gives from the repository root (a custom strategy directory, a config file) exists
    in the repository, as a reader running the block from the repository root would need it to."""
    tops = "|".join(re.escape(p.name) for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    missing = [f"{path.name}:{line}: {found}" for path, line, words, code in python_fences() if "notest" not in words
               for found in re.findall(rf"(?<![\w./-])((?:{tops})/[\w./-]*\w)", code)
               if not (ROOT / found).exists()]
    assert not missing, f"runnable blocks name repository paths that do not exist: {missing}"


def test_the_docs_refer_only_to_files_in_the_repository():
    """Relative links resolve to files of the repository, and no page sends the reader to a folder it does not
    ship (the design notes the project was built from are not part of it)."""
    broken, outside = [], []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).resolve().exists():
                broken.append(f"{path.name}: {target}")
        for phrase in ("design folder", "pacing-semantics", "seed guide", "/work/"):
            if phrase in text:
                outside.append(f"{path.name}: {phrase!r}")
    assert not broken, f"links to files that do not exist: {broken}"
    assert not outside, f"references to files outside the repository: {outside}"


def test_the_trainer_loop_shown_is_the_one_the_rl_example_runs():
    """docs/trainer.md shows examples/rl_cpu/run.py's train_fully_async loop as it is (a fragment: it needs torch
    and vLLM); the runnable loop above it runs the same calls against FakeEngine workers."""
    import ast
    import textwrap

    source = (ROOT / "examples" / "rl_cpu" / "run.py").read_text(encoding="utf-8")
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == "train_fully_async")
    loop = next(node for node in function.body if isinstance(node, ast.For))
    region = textwrap.dedent("\n".join(source.splitlines()[loop.lineno - 1:loop.end_lineno]))
    shown = [code for path, _, words, code in python_fences()
             if path.name == "trainer.md" and "notest" in words and "examples/rl_cpu/run.py" in code.splitlines()[0]]
    assert len(shown) == 1, "docs/trainer.md shows examples/rl_cpu/run.py's loop once"
    assert shown[0].split("\n", 1)[1].rstrip("\n") == region, (
        "docs/trainer.md's copy of examples/rl_cpu/run.py's train_fully_async loop differs from the example: "
        "copy the loop again")
