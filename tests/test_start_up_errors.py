"""coda-server start-up errors: exit 2 (configuration) or 1 (the address), one line naming the key, no traceback."""
from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda_server.core import ConfigError, load_config
from coda_server.core.filters import filter_specs
from coda_server.core.journal import StateDirError

SERVER = [sys.executable, "-m", "coda_server"]


def run_server(tmp_path: Path, *argv: str, state_dir: str = "sd", timeout: float = 60) -> subprocess.CompletedProcess:
    """coda-server with `argv`, expected to stop at start-up (a start that serves is killed by the timeout)."""
    base = ["server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
            f"server.state_dir={tmp_path / state_dir if state_dir else ''}"]
    return subprocess.run([*SERVER, *base, *argv], capture_output=True, text=True, timeout=timeout)


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *says: str) -> str:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for text in says:
        assert text in proc.stderr, proc.stderr
    return proc.stderr


# ------------------------------------------------------------------ a custom strategy whose __init__ raises

def assert_plugin_refused_before_the_state_dir(tmp_path: Path, filename: str, source: str, setting: str,
                                               *says: str) -> None:
    """Starts coda-server with the plugin module `source` (as plugins/`filename`) chosen by `setting`: it must stop
    with exit 2 and one line saying `says`, the state directory not made."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / filename).write_text(textwrap.dedent(source))
    proc = run_server(tmp_path, f"server.custom_strategy_dirs=[{plugins}]", setting)
    err = assert_one_line(proc, 2, *says)
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sd").exists()  # checked before the state directory is made


def test_a_strategy_whose_init_raises_stops_with_exit_2_naming_it_before_the_state_dir_is_made(tmp_path):
    assert_plugin_refused_before_the_state_dir(tmp_path, "initfail.py", """\
        from coda_server import SlidingWindowStrategy, register_sliding_window_strategy

        @register_sliding_window_strategy("init-fail")
        class InitFail(SlidingWindowStrategy):
            def __init__(self, config):
                super().__init__()
                raise RuntimeError("boom in init")

            def compute_dispatch_count(self, running_count):
                return 1
        """, "fully_async.sliding_window=init-fail", "fully_async.sliding_window = 'init-fail'",
        "RuntimeError: boom in init", str(tmp_path / "plugins" / "initfail.py"))


def test_a_filter_whose_init_raises_stops_with_exit_2_naming_it_before_the_state_dir_is_made(tmp_path):
    assert_plugin_refused_before_the_state_dir(tmp_path, "filterfail.py", """\
        from coda_server.core.filters import GroupFilter, register_group_filter

        @register_group_filter("init-fail-filter")
        class InitFailFilter(GroupFilter):
            def __init__(self, config, **params):
                raise RuntimeError("boom in filter init")

            def keep(self, group):
                return True
        """, "rollout.filter=[status,init-fail-filter]",
        "rollout.filter: the filter 'init-fail-filter' could not be built", "RuntimeError: boom in filter init")


def test_a_replay_strategy_whose_init_raises_stops_with_exit_2_naming_it_before_the_state_dir_is_made(tmp_path):
    assert_plugin_refused_before_the_state_dir(tmp_path, "replayfail.py", """\
        from coda_server import BufferReplayStrategy, register_buffer_replay_strategy

        @register_buffer_replay_strategy("init-fail-replay")
        class InitFailReplay(BufferReplayStrategy):
            def __init__(self, config):
                raise RuntimeError("boom in replay init")

            def select(self, restored, count, step):
                return list(restored[:count])
        """, "data_source.dataset.buffer_replay_strategy=init-fail-replay",
        "data_sources[0].dataset.buffer_replay_strategy = 'init-fail-replay'", "RuntimeError: boom in replay init")


def test_a_loongsage_style_replay_function_stops_with_exit_2_naming_the_class_api_before_the_state_dir_is_made(
        tmp_path):
    # LoongSage's buffer replay strategy is a function (config, step, buffer, num): it used to register, pass the
    # checks and die at start-up with a traceback (exit 1) when the pacer called it as a class.
    plugin = tmp_path / "plugins" / "lifo_replay.py"
    assert_plugin_refused_before_the_state_dir(tmp_path, "lifo_replay.py", """\
        from coda_server import register_buffer_replay_strategy

        @register_buffer_replay_strategy("lifo")
        def lifo(config, step, buffer, num):
            k = min(len(buffer), num)
            groups = buffer[len(buffer) - k:][::-1]
            del buffer[len(buffer) - k:]
            return groups
        """, "data_source.dataset.buffer_replay_strategy=lifo",
        "data_sources[0].dataset.buffer_replay_strategy = 'lifo'", f"lifo in {plugin}",
        "is a function taking (config, step, buffer, num)", "BufferReplayStrategy",
        "select(self, restored, count, step)")


# ------------------------------------------------------------------ Hydra's override syntax without Hydra

@pytest.mark.parametrize("override, instead, filters", [
    ("+rollout.filter.reward={}", "rollout.filter.reward={}", ["status", "reward"]),
    ("~rollout.filter.status", "rollout.filter.status=false", []),
])
def test_hydras_override_syntax_without_config_name_stops_with_exit_2_saying_what_to_write(tmp_path, override,
                                                                                          instead, filters):
    # They used to say "+rollout: unknown section" and "must look like key=value", neither naming Hydra or the fix.
    proc = run_server(tmp_path, override)
    err = assert_one_line(proc, 2, f"override {override!r}", "Hydra's override syntax",
                          "valid with --config-path/--config-name", f"write {instead}")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sd").exists()
    # The plain override it names does what the Hydra one meant: adds the filter, or takes it out.
    assert [name for name, _ in filter_specs(load_config(None, [instead]).rollout.filter)] == filters


# ------------------------------------------------------------------ an undeclared option under fully_async

def test_an_undeclared_key_under_fully_async_says_how_a_custom_strategy_declares_its_options():
    # docs/custom-strategies.md used to offer config.fully_async.get("my_option", 4) set by fully_async.my_option=8.
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["fully_async.my_option=8"])
    line = next(line for line in str(caught.value).splitlines() if "fully_async.my_option" in line)
    assert line.strip().startswith("fully_async.my_option: unknown key (known keys here: fully_async.enable")
    assert "a custom strategy declares its own options as `options` on its class" in line
    assert "fully_async.<its section>.<option>" in line and "Strategy options in docs/custom-strategies.md" in line
    with pytest.raises(ConfigError) as typo:  # a near miss keeps its short hint
        load_config(None, ["fully_async.stale_step=1"])
    assert "did you mean fully_async.stale_steps?)" in str(typo.value) and "custom strategy" not in str(typo.value)


# ------------------------------------------------------------------ a section or sub-mapping that is not a mapping

@pytest.mark.parametrize("overrides, names", [
    (("server.address=127.0.0.1:0",), "server = 5: must be a mapping"),  # used to be a traceback (log_format)
    (("server.state_dir=/tmp/x",), "server = 5: must be a mapping"),  # used to name server.address
])
def test_a_file_whose_section_is_a_scalar_is_refused_whatever_the_overrides(tmp_path, overrides, names):
    path = tmp_path / "run.yaml"
    path.write_text("server: 5\n")
    with pytest.raises(ConfigError, match="server = 5: must be a mapping of options"):
        load_config(path, overrides)
    proc = subprocess.run([*SERVER, "--config", str(path), *overrides], capture_output=True, text=True, timeout=60)
    assert_one_line(proc, 2, names)


@pytest.mark.parametrize("override, key, names", [
    ("server.tls=5", "server.tls = 5", "cert_file, client_ca_file, key_file"),
    ("server.client_rate_limits=5", "server.client_rate_limits = 5", "burst, dispatch_per_second"),
    ("fully_async.latency_aware=5", "fully_async.latency_aware = 5", "collect_window"),
    ("data_source.dataset=fifo", "data_source.dataset = 'fifo'", "buffer_replay_strategy"),
    ("server=[1, 2]", "server = [1, 2]", "must be a mapping of options"),
])
def test_a_sub_mapping_given_as_a_scalar_is_refused_naming_the_key(override, key, names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert f"{key}: must be a mapping" in str(caught.value) and names in str(caught.value)


def test_a_sub_mapping_given_as_a_scalar_in_a_file_is_refused_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("server:\n  client_rate_limits: 5\nfully_async:\n  latency_aware: [1]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["server.state_dir="])
    assert "server.client_rate_limits = 5: must be a mapping" in str(caught.value)
    assert "fully_async.latency_aware = [1]: must be a mapping" in str(caught.value)


def test_a_null_sub_mapping_keeps_its_defaults():
    config = load_config(None, ["server.tls=null", "server.client_rate_limits=null"])
    assert config.server.tls is None and config.server.client_rate_limits is None


def test_server_tls_as_a_scalar_stops_coda_server_naming_the_key(tmp_path):
    assert_one_line(run_server(tmp_path, "server.tls=5"), 2, "server.tls = 5: must be a mapping of cert_file")


def test_a_config_file_holding_a_list_says_a_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("- server\n- 5\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "not a list" in str(caught.value) and "ListConfig" not in str(caught.value)


# ------------------------------------------------------------------ server.client_rate_limits.burst

@pytest.mark.parametrize("value", ["0", "0.5", "-1"])
def test_a_burst_below_one_is_refused_with_its_own_message(value):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"server.client_rate_limits.burst={value}"])
    assert f"server.client_rate_limits.burst = {value}: must be a finite number >= 1" in str(caught.value)
    assert "a rate of 0" not in str(caught.value)


def test_a_burst_of_one_is_accepted():
    assert load_config(None, ["server.client_rate_limits.burst=1"]).server.client_rate_limits.burst == 1


# ------------------------------------------------------------------ TLS files that do not go together

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path_factory.mktemp("tls")
    for name in ("srv", "other"):
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        f"/CN={name}", "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.crt")],
                       check=True, capture_output=True)
    return directory


@pytest.mark.parametrize("cert, key, says", [
    ("srv.crt", "other.key", "the private key is not the certificate's"),
    ("srv.key", "srv.crt", "they look swapped"),
    ("srv.crt", "other.crt", "key_file holds no private key"),
])
def test_a_key_that_is_not_the_certificates_stops_start_up_with_exit_2_naming_both_keys(tmp_path, tls_files, cert, key,
                                                                                        says):
    proc = run_server(tmp_path, f"server.tls.cert_file={tls_files / cert}", f"server.tls.key_file={tls_files / key}")
    err = assert_one_line(proc, 2, "server.tls.cert_file = ", "server.tls.key_file = ", says)
    assert "cannot listen" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sd").exists()


# ------------------------------------------------------------------ the gRPC port in use

def test_a_port_in_use_is_said_to_be_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_server(tmp_path, f"server.address=127.0.0.1:{port}", state_dir="")
    assert_one_line(proc, 1, f"cannot listen on 127.0.0.1:{port}: the address is already in use")


# ------------------------------------------------------------------ a full disk

def test_a_full_disk_at_start_up_says_the_file_system_is_full_not_who_may_write(tmp_path, monkeypatch):
    from coda_server.core import sqlite_journal

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sqlite_journal.sqlite3, "connect", full)
    with pytest.raises(StateDirError) as caught:
        sqlite_journal.SqliteJournal(str(tmp_path / "sd"), fsync="normal")
    message = str(caught.value)
    assert "database or disk is full" in message and "file system is full" in message
    assert "this user can write" not in message


def test_a_state_dir_this_user_cannot_write_keeps_its_advice(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("")
        target = blocker / "sd"  # a path under a regular file: not creatable, even for root
    else:
        target = tmp_path / "ro" / "sd"
        target.parent.mkdir(mode=0o500)
    from coda_server.core.sqlite_journal import SqliteJournal

    with pytest.raises(StateDirError) as caught:
        SqliteJournal(str(target), fsync="normal")
    assert "that this user can write" in str(caught.value) and "file system is full" not in str(caught.value)
