"""A journal written on any supported Python is read back on any other: Python 3.11.0-3.11.3 pickle an enum member
by name (getattr(class, name)), which the journal's restricted unpickler refused, so a server on Debian 12's
Python 3.11.2 could not restart on its own state directory. Emulated here by giving enums that era's reduction in a
server process (through sitecustomize), then restarting servers with and without it on the same state directory."""
from __future__ import annotations

import io
import pickle
import textwrap

import pytest

from coda_client._proto import pacer_pb2 as pb
from coda_server.core.journal import PickledTrajectories, Submitted, dumps, loads
from coda_server.core.types import ResetMode, Trajectory, TrajectoryStatus
from conftest import core_overrides
from server_harness import ServerProcess

# What Python 3.11.0-3.11.3's Enum.__reduce_ex__ returned.
BY_NAME = "lambda self, protocol: (getattr, (self.__class__, self._name_))"

SITECUSTOMIZE = f"""
import enum
enum.Enum.__reduce_ex__ = {BY_NAME}
"""


class _ByNamePickler(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.3 did."""

    def reducer_override(self, obj):
        if isinstance(obj, (TrajectoryStatus, ResetMode)):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_records_pickled_by_name_are_read_back_as_their_members():
    record = Submitted(1.0, [Trajectory("t0", "p0", 0, TrajectoryStatus.ABORTED)], "r-1")
    buffer = io.BytesIO()
    _ByNamePickler(buffer, protocol=5).dump((record, ResetMode.WAIT))
    read, mode = loads(buffer.getvalue(), PickledTrajectories())
    assert read.trajectories[0].status is TrajectoryStatus.ABORTED and mode is ResetMode.WAIT


class _Marker:
    """Stands for whatever a forged journal's getattr would fetch."""


@pytest.mark.parametrize("target, name", [(Trajectory, "__class__"), (TrajectoryStatus, "_member_map_"),
                                          (ResetMode, 3)])
def test_getattr_fetches_only_a_member_of_a_journal_enum(target, name):
    class Forged(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (target, name)) if isinstance(obj, _Marker) else NotImplemented

    buffer = io.BytesIO()
    Forged(buffer, protocol=5).dump([_Marker()])
    with pytest.raises(pickle.UnpicklingError, match="may not contain"):
        loads(buffer.getvalue(), PickledTrajectories())


def test_the_journal_pickles_enums_by_value_whatever_the_python(monkeypatch):
    import enum
    monkeypatch.setattr(enum.Enum, "__reduce_ex__", eval(BY_NAME))
    data = dumps([TrajectoryStatus.COMPLETED, ResetMode.ABORT], PickledTrajectories())
    assert b"getattr" not in data
    assert loads(data, PickledTrajectories()) == [TrajectoryStatus.COMPLETED, ResetMode.ABORT]


def group(prompt_id: str, status: int) -> list[pb.Trajectory]:
    return [pb.Trajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=status, reward=float(i),
                          token_ids=[1, 2, 3]) for i in range(2)]


def test_a_server_restarts_on_a_journal_written_by_python_3_11_2_and_the_other_way(tmp_path):
    old_python = tmp_path / "old_python"
    old_python.mkdir()
    (old_python / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    as_3_11_2 = {"PYTHONPATH": str(old_python)}
    state_dir = tmp_path / "state"
    overrides = (*core_overrides("no-window", B=4, stale=1.0, N=2, filters="[]"), f"server.state_dir={state_dir}")

    def restarted(env):
        return ServerProcess(tmp_path, *overrides, env=env, cwd=tmp_path).start()

    server = restarted(as_3_11_2)
    try:
        stub = server.stub()
        stub.Dispatch(pb.DispatchRequest(candidates=[pb.PromptRef(prompt_id=p) for p in ("a", "b")]), timeout=10)
        stub.Submit(pb.SubmitRequest(trajectories=group("a", pb.TRAJECTORY_STATUS_ABORTED)), timeout=10)
        stub.Submit(pb.SubmitRequest(trajectories=group("b", pb.TRAJECTORY_STATUS_COMPLETED)), timeout=10)
        before = stub.GetState(pb.GetStateRequest(), timeout=10)
        assert before.submitted == 4
        server.kill()  # nothing but the journal's events: every one replayed at the restart
        server.close()
        for env in ({}, as_3_11_2):  # read by a current Python, then by the era's own
            server = restarted(env)
            state = server.stub().GetState(pb.GetStateRequest(), timeout=10)
            assert (state.submitted, state.buffered, state.filtered) == (
                before.submitted, before.buffered, before.filtered), server.log()
            server.terminate()
            server.close()
    finally:
        server.close()
