"""A Reset that waits out a dead worker's groups names every group released meanwhile in its answer, once.

A group whose worker goes silent (its in-flight lease, or the worker's liveness grace, runs out) while a Reset waits
for it is released: handed back in the answer's `expired` (rollout.continue_restored false), or kept by the server for
re-offer (true), when it is listed in `kept_prompt_ids`. Before, a kept one was in no Reset answer at all. The
`coda-client` lines say the same: `state` counts `expired` and `kept for continuation`, `reset` names the groups.
"""
from __future__ import annotations

import io
import threading

from coda_client import ControlStream, PacerClient, PacerClientError, Trajectory, TrajectoryStatus
from coda_client import cli as client_cli
from coda_server.core import Pacer, PromptRef, ResetMode, load_config
from coda_server.core import Trajectory as CoreTrajectory
from coda_server.core.sqlite_journal import SqliteJournal
from conftest import core_overrides
from fake_clock import FakeClock
from server_harness import ServerProcess

# The longest a Reset here may wait; each ends once the dead worker's groups are released, seconds after it began.
RESET_WAIT = 60
# Short enough for a quick test, long enough that no group is released before the Reset begins.
LEASE_SECONDS = 3


def overrides(continue_restored: bool, *extra: str) -> list[str]:
    return core_overrides("no-window", B=2, stale=1.0, N=2, M=2, continue_restored=continue_restored, extra=extra)


def trajectory(prompt_id: str, index: int, status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    return Trajectory(trajectory_id=f"{prompt_id}#{index}", prompt_id=prompt_id, status=status, token_ids=[1, 2])


def watching(stream: ControlStream) -> threading.Event:
    """Reads `stream` in a thread until it is cancelled; the event is set at its first event (the STATE a new
    watcher gets): from then on the server watches the worker's liveness."""
    opened = threading.Event()

    def read() -> None:
        try:
            for _ in stream:
                opened.set()
        except PacerClientError:  # the server went away first (a test that failed): nothing more to read
            pass

    threading.Thread(target=read, daemon=True).start()
    return opened


def run_cli(address: str, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return client_cli.main(["--address", address, *argv], out=out), out.getvalue()


def test_a_wait_mode_reset_lists_the_groups_kept_from_a_worker_that_died_during_its_wait(tmp_path):
    """continue_restored: the dead worker's groups released during the wait are kept, and this Reset says so in
    kept_prompt_ids (before the group it restored itself); the next Reset does not name them again."""
    lease = (f"server.inflight_lease_seconds={LEASE_SECONDS}", "server.worker_liveness_seconds=0")
    with ServerProcess(tmp_path, *overrides(True, *lease)) as server, PacerClient(server.address) as pacer:
        assert pacer.dispatch(["a", "b", "c"]).admitted == ["a", "b", "c"]
        pacer.submit([trajectory("a", 0)])  # a: one of two; b: none
        # c is assembled, its trajectories ABORTED: the gate holds it for the Reset, which restores it.
        pacer.submit([trajectory("c", i, TrajectoryStatus.ABORTED) for i in range(2)])
        pacer.keep_alive(["a", "b"])  # the worker's last sign of life: its leases run out LEASE_SECONDS from now
        before = pacer.state()
        assert (before.running, before.expired, before.restored_kept) == (3, 0, 0)

        result = pacer.reset("wait", wait=RESET_WAIT)

        assert result.kept_prompt_ids == ["a", "b", "c"], result
        assert result.report.partial_restored_group_count == 1  # c; a and b were kept when released
        assert (result.restored, result.expired, result.dropped_prompt_ids) == ([], [], [])
        state = pacer.state()
        assert (state.running, state.expired, state.restored_kept) == (0, 2, 3)
        assert state.dispatched == (state.running + state.collected + state.filtered + state.restored + state.dropped
                                    + state.expired + state.quarantined)  # each group counted once

        code, text = run_cli(server.address, "state")
        assert code == 0, text
        assert "  expired 2  " in text and "kept for continuation 3 (oldest waiting " in text, text

        again = pacer.reset("wait", wait=0)  # still kept, but named already: not again
        assert (again.kept_prompt_ids, again.expired, again.dropped_prompt_ids) == ([], [], [])
        assert pacer.state().restored_kept == 3


def test_an_abort_mode_reset_names_the_groups_of_a_worker_taken_as_gone_during_its_wait(tmp_path, capsys):
    """The liveness path (a watched worker falls silent) and ABORT mode, through `coda-client reset`: the groups
    released during the wait are in the answer's kept_prompt_ids, and the command's lines name them."""
    liveness = ("server.inflight_lease_seconds=0", f"server.worker_liveness_seconds={LEASE_SECONDS}")
    with ServerProcess(tmp_path, *overrides(True, *liveness)) as server:
        with PacerClient(server.address, client_id="dead-worker") as dead, PacerClient(server.address) as trainer:
            stream = dead.watch()
            try:
                assert watching(stream).wait(30), "the worker's control stream never delivered its first event"
                assert dead.dispatch(["a", "b"]).admitted == ["a", "b"]
                dead.submit([trajectory("a", 0)])  # its last call
                assert trainer.state().running == 2
                code, text = run_cli(server.address, "reset", "--mode", "abort", "--wait", str(RESET_WAIT))
            finally:
                stream.cancel()
            said = capsys.readouterr().err
            assert code == 0, (text, said)
            assert "2 kept for continuation (2 released from silent workers: a, b)" in text, text
            assert "0 groups restored" in text and "0 dropped" in text, text
            assert "2 released from silent workers and kept for continuation" in said, said
            state = trainer.state()
            assert (state.running, state.expired, state.restored_kept) == (0, 2, 2)
            assert trainer.reset("abort", wait=0).kept_prompt_ids == []  # named once


def test_without_continuation_the_reset_hands_back_the_expired_groups_and_coda_client_names_them(tmp_path, capsys):
    """continue_restored false: the groups released during the wait come back in `expired` with what was submitted;
    `coda-client reset` names them and `coda-client state` counts them."""
    lease = (f"server.inflight_lease_seconds={LEASE_SECONDS}", "server.worker_liveness_seconds=0")
    with ServerProcess(tmp_path, *overrides(False, *lease)) as server, PacerClient(server.address) as pacer:
        assert pacer.dispatch(["a", "b"]).admitted == ["a", "b"]
        pacer.submit([trajectory("a", 0)])
        pacer.keep_alive(["a", "b"])
        assert pacer.state().expired == 0
        args = client_cli.build_parser().parse_args(["reset", "--mode", "wait", "--wait", str(RESET_WAIT)])

        result, text = client_cli.run_reset(pacer, args)

        assert [(g.prompt_id, [t.trajectory_id for t in g.trajectories]) for g in result.expired] == [
            ("a", ["a#0"]), ("b", [])]
        assert (result.kept_prompt_ids, result.restored, result.dropped_prompt_ids) == ([], [], [])
        assert "0 dropped, 2 expired (a, b), 0 quarantined" in text, text
        said = capsys.readouterr().err
        assert "no group dropped, 2 expired (their worker went silent)" in said, said

        code, state_text = run_cli(server.address, "state")
        assert code == 0, state_text
        assert "  expired 2  " in state_text and "kept for continuation 0" in state_text, state_text
        assert "oldest waiting" not in state_text  # nothing kept: nothing waits

        again = pacer.reset("wait", wait=0)
        assert (again.expired, again.kept_prompt_ids) == ([], [])


def test_a_group_released_twice_in_a_step_is_named_once_and_a_restart_during_the_wait_loses_none(tmp_path):
    """In the pacer itself: a group released, continued by another worker and released again during the Reset's
    wait is listed once, at its latest release; one continued and completed is not listed; a process that dies during
    the wait leaves them to the Reset its trainer retries on the recovered state."""
    config = load_config(overrides=overrides(True, "server.inflight_lease_seconds=10"))
    state_dir = tmp_path / "state"
    clock = FakeClock()
    first = Pacer(config, clock=clock, journal=SqliteJournal(state_dir, fsync="off"))
    first.dispatch([PromptRef("a"), PromptRef("b"), PromptRef("c")], client_id="w1")
    clock.now += 11
    assert first.expire_leases() == (["a", "b", "c"], [])  # w1 died mid-step: all three kept
    taken = first.dispatch([], client_id="w2", max_continuations=2)
    seqs = {group.prompt_id: group.seq for group in taken.continued}
    assert sorted(seqs) == ["a", "b"]
    first.submit([CoreTrajectory(f"a#{i}", "a") for i in range(2)], dispatch_seqs={"a": seqs["a"]})  # a completes
    first.begin_reset(ResetMode.WAIT)
    clock.now += 11
    assert first.expire_leases() == (["b"], [])  # w2 died too, during the Reset's wait
    first.journal.close()  # and so did the server

    pacer = Pacer(config, clock=clock, journal=SqliteJournal(state_dir, fsync="off"))
    pacer.recover()  # the Reset that was waiting is abandoned; the trainer retries it
    assert pacer.state().resetting is False
    result = pacer.reset(ResetMode.WAIT, wait=0)
    assert result.kept_prompt_ids == ["c", "b"], result  # in the order of their latest release
    assert (result.expired, result.dropped_prompt_ids) == ([], [])
    pacer.resume(1)
    assert pacer.reset(ResetMode.WAIT, wait=0).kept_prompt_ids == []
    assert pacer.state().restored_kept == 2
    pacer.journal.close()


def test_a_waiting_reset_that_drops_groups_at_its_bound_says_so_in_the_log(tmp_path):
    """LoongSage's waiting pause never drops; here the wait is bounded (server.max_wait_seconds), and a Reset that
    ends its wait there drops the incomplete groups: the answer lists them, and the log warns with the setting."""
    with ServerProcess(tmp_path, *overrides(True, "server.max_wait_seconds=1")) as server, \
            PacerClient(server.address) as pacer:
        pacer.dispatch(["w0"])
        pacer.submit([trajectory("w0", 0)])  # one of its two: the group never completes
        result = pacer.reset("wait")  # no wait given: until assembled, within server.max_wait_seconds
        assert result.dropped_prompt_ids == ["w0"]
        log = server.log()
    assert ("Reset (mode wait) waited" in log and "dropped 1 incomplete group(s) (w0), 1 trajectories of them "
            "submitted: the wait ended at server.max_wait_seconds or the call's deadline (1 s)" in log), log
