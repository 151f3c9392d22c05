"""server.event_loop: the coda-server process serves on uvloop or asyncio's loop, says which, and refuses a loop it
cannot have; long-polls, watch streams and the SIGTERM drain work on either."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from coda_client import ControlEventType, PacerClient, ResetMode, Trajectory, TrajectoryStatus
from coda_server import event_loop
from coda_server.core.errors import ConfigError
from server_harness import REPO_ROOT, ServerProcess

N = 2  # group size


def uvloop_installed() -> bool:
    return event_loop._uvloop() is not None


def trajectory(prompt_id: str, i: int) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}/t{i}", prompt_id=prompt_id, status=TrajectoryStatus.COMPLETED,
                      reward=float(i), token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 1, 1])


@pytest.mark.parametrize("choice", ["asyncio", "uvloop", "auto"])
def test_the_server_serves_long_polls_and_streams_and_drains_on_the_loop_it_names(tmp_path, choice):
    if choice == "uvloop" and not uvloop_installed():
        pytest.skip("uvloop is not installed here (the server extra installs it on Linux and macOS)")
    expected = "uvloop" if choice == "uvloop" or (choice == "auto" and uvloop_installed()) else "asyncio"
    with ServerProcess(tmp_path, f"server.event_loop={choice}", "data_source.num_prompts_per_step=2",
                       f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={N}",
                       "server.state_dir=") as server:
        with PacerClient(server.address) as trainer, PacerClient(server.address) as worker:
            stream = trainer.watch()
            collected: list = []
            # A Collect waiting on the loop before anything is there, woken by the Submit below.
            waiting = threading.Thread(target=lambda: collected.extend(trainer.collect(1, wait=30.0)))
            waiting.start()
            admitted = worker.dispatch(["p0"]).admitted
            assert admitted == ["p0"]
            assert worker.submit([trajectory("p0", i) for i in range(N)]).accepted == N
            waiting.join(30.0)
            assert not waiting.is_alive(), "the waiting Collect was not woken by the Submit"
            assert [[t.trajectory_id for t in g.trajectories] for g in collected] == [["p0/t0", "p0/t1"]]
            events = iter(stream)
            assert next(events).type == ControlEventType.STATE  # a watch stream opens with the state as it is
            trainer.reset(ResetMode.WAIT, wait=0)
            assert next(events).type == ControlEventType.PAUSE
            stream.cancel()
        assert server.terminate() == 0
        log = server.log()
    assert f"event loop: {expected}" in log, log
    assert "stopped: step 0" in log, log


def run_cli_without_uvloop(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """coda-server in a Python that cannot import uvloop (as on Windows, or without the server extra)."""
    code = ("import sys; sys.modules['uvloop'] = None\n"  # None in sys.modules: `import uvloop` raises ImportError
            "from coda_server.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "server.address=127.0.0.1:0", "server.metrics_address=",
                           "server.state_dir=", *overrides], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_uvloop_asked_for_but_not_installed_is_refused_at_start_saying_how_to_fix_it(tmp_path):
    result = run_cli_without_uvloop(tmp_path, "server.event_loop=uvloop")
    assert result.returncode == 2, result.stderr
    assert "server.event_loop is uvloop but uvloop is not installed" in result.stderr
    assert "pip install 'coda-pacer[server]'" in result.stderr and "auto or asyncio" in result.stderr


def test_auto_without_uvloop_falls_back_to_asyncio(monkeypatch):
    monkeypatch.setattr(event_loop, "_uvloop", lambda: None)
    assert event_loop.loop_factory("auto") is None
    assert event_loop.loop_factory("asyncio") is None
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop.loop_factory("uvloop")


def test_an_unknown_loop_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="must be one of auto, asyncio, uvloop, got 'tokio'"):
        event_loop.loop_factory("tokio")


def test_a_misspelt_event_loop_in_the_configuration_stops_start_up_naming_the_choices(tmp_path):
    result = run_cli_without_uvloop(tmp_path, "server.event_loop=uv-loop")
    assert result.returncode == 2
    assert "server.event_loop = 'uv-loop': must be auto (uvloop when installed, else asyncio), asyncio or uvloop" \
        in result.stderr
