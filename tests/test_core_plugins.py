"""Discovery of custom strategy modules: configured directories, sub-packages, broken modules."""
from __future__ import annotations

import logging
import textwrap
import uuid

import pytest

from coda_server.core import ConfigError, Pacer, PromptRef, load_config
from coda_server.core.plugins import load_custom_modules
from coda_server.core.strategy import STRATEGIES

# Strategies and filters registered here must not leak into other tests' registries.
pytestmark = pytest.mark.usefixtures("scratch_registry")

STRATEGY_MODULE = textwrap.dedent("""\
    from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


    @register_sliding_window_strategy("{name}")
    class Strategy(SlidingWindowStrategy):
        def __init__(self, config):
            super().__init__()

        def compute_dispatch_count(self, buf_qsize: int) -> int:
            return max(0, {cap} - self._running_count - buf_qsize)
    """)


def _plugin_tree(root, tag):
    """root/good.py, root/broken.py (raises at import), root/subpkg/deep.py; returns the two good names."""
    good, deep = f"good-{tag}", f"deep-{tag}"
    (root / "good.py").write_text(STRATEGY_MODULE.format(name=good, cap=3))
    (root / "broken.py").write_text("raise RuntimeError('boom at import time')\n")
    sub = root / "subpkg"
    sub.mkdir()
    (sub / "__init__.py").write_text("")
    (sub / "deep.py").write_text(STRATEGY_MODULE.format(name=deep, cap=2))
    return good, deep


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_good_modules_register_broken_one_is_skipped_with_one_warning(tmp_path, caplog):
    tag = uuid.uuid4().hex[:10]
    good, deep = _plugin_tree(tmp_path, tag)
    assert good not in STRATEGIES and deep not in STRATEGIES
    with caplog.at_level(logging.WARNING):
        loaded = load_custom_modules([str(tmp_path)])
    assert good in STRATEGIES and deep in STRATEGIES
    assert any(name.endswith(".good") for name in loaded)
    assert any(name.endswith(".subpkg.deep") for name in loaded)
    assert not any(name.endswith(".broken") for name in loaded)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "broken" in warnings[0].getMessage() and "boom at import time" in warnings[0].getMessage()


def test_plugin_dir_through_config_selects_a_sub_package_strategy(tmp_path, caplog):
    tag = uuid.uuid4().hex[:10]
    _, deep = _plugin_tree(tmp_path, tag)
    with caplog.at_level(logging.WARNING):
        config = load_config(overrides=[f"server.custom_strategy_dirs=[{tmp_path}]",
                                        f"fully_async.sliding_window={deep}"])
    assert len(_warnings(caplog)) == 1
    pacer = Pacer(config)
    assert pacer.state().strategy == deep
    result = pacer.dispatch([PromptRef(f"p{i}") for i in range(5)])
    assert len(result.admitted) == 2  # the plugin's own capacity
    pacer.close()


def test_loading_the_same_directory_twice_is_harmless(tmp_path, caplog):
    tag = uuid.uuid4().hex[:10]
    (tmp_path / "only.py").write_text(STRATEGY_MODULE.format(name=f"only-{tag}", cap=1))
    load_custom_modules([str(tmp_path)])
    with caplog.at_level(logging.WARNING):
        load_custom_modules([str(tmp_path)])
    assert _warnings(caplog) == []
    assert f"only-{tag}" in STRATEGIES


def test_broken_sub_package_is_skipped_with_one_warning(tmp_path, caplog):
    tag = uuid.uuid4().hex[:10]
    (tmp_path / "fine.py").write_text(STRATEGY_MODULE.format(name=f"fine-{tag}", cap=1))
    bad = tmp_path / "badpkg"
    bad.mkdir()
    (bad / "__init__.py").write_text("import does_not_exist_anywhere\n")
    (bad / "inner.py").write_text(STRATEGY_MODULE.format(name=f"inner-{tag}", cap=1))
    with caplog.at_level(logging.WARNING):
        load_custom_modules([str(tmp_path)])
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "badpkg" in warnings[0].getMessage()
    assert f"fine-{tag}" in STRATEGIES and f"inner-{tag}" not in STRATEGIES


def test_missing_directory_warns_and_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        load_custom_modules([str(tmp_path / "not-there")])
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "not-there" in warnings[0].getMessage()


def test_custom_package_is_walked_with_sub_packages(tmp_path, monkeypatch, caplog):
    """The coda_server/custom/ mechanism, on a throwaway package so the real one stays untouched."""
    tag = uuid.uuid4().hex[:10]
    package = f"coda_custom_test_{tag}"
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    good, deep = _plugin_tree(root, tag)
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        load_custom_modules([], package=package)
    assert good in STRATEGIES and deep in STRATEGIES
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and f"{package}.broken" in warnings[0].getMessage()


def test_name_clash_between_two_classes_is_refused(tmp_path, caplog):
    tag = uuid.uuid4().hex[:10]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "one.py").write_text(STRATEGY_MODULE.format(name=f"clash-{tag}", cap=1))
    (b / "two.py").write_text(STRATEGY_MODULE.format(name=f"clash-{tag}", cap=2))
    with caplog.at_level(logging.WARNING):
        load_custom_modules([str(a), str(b)])
    warnings = _warnings(caplog)
    # The second module fails to import (its registration raises) and is skipped, naming it.
    assert len(warnings) == 1 and "two" in warnings[0].getMessage() and "already registered" in warnings[0].getMessage()


def test_unknown_strategy_after_plugins_lists_plugin_names_too(tmp_path):
    tag = uuid.uuid4().hex[:10]
    (tmp_path / "listed.py").write_text(STRATEGY_MODULE.format(name=f"listed-{tag}", cap=1))
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"server.custom_strategy_dirs=[{tmp_path}]", "fully_async.sliding_window=missing"])
    assert f"listed-{tag}" in str(info.value)


@pytest.mark.parametrize("value", ["{dir}", "[{dir}, 5]", "[{dir}, '']"])
def test_custom_strategy_dirs_that_is_no_list_of_paths_is_refused_before_anything_is_imported(tmp_path, monkeypatch,
                                                                                              value):
    # A bare path (the usual slip) was read one character at a time: "." (or "/") imported what lay there.
    (tmp_path / "side_effect.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"server.custom_strategy_dirs={value.format(dir='.x')}"])
    assert "server.custom_strategy_dirs" in str(info.value) and "list of directory paths" in str(info.value)
    assert not (tmp_path / "IMPORTED").exists()
