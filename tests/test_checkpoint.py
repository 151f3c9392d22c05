"""Trainer checkpoints of the pacer: Checkpoint, Restore, the prompt cursor and the step guard rails."""
from __future__ import annotations

import pytest

from coda_client import PacerClient, Trajectory as WireTrajectory, TrajectoryStatus as WireStatus
from coda_client.errors import BadRequestError, FailedPreconditionError
from coda_server.core import Pacer, PromptRef, Trajectory, TrajectoryStatus
from coda_server.core import checkpoints
from coda_server.core.cursor import PromptCursor
from coda_server.core.errors import InvalidArgumentError, JobEndedError, LeaseExpiredError, ResetInProgressError
from coda_server.core.journal import PickledTrajectories
from conftest import core_overrides, load_core_config
from server_harness import ServerProcess
from test_durability_restart import Restartable

CODEC = PickledTrajectories()


def pacer_of(**kwargs) -> Pacer:
    return Pacer(load_core_config("no-window", B=4, N=2, **kwargs))


def ref(i: int, epoch: int = 0) -> PromptRef:
    return PromptRef(f"e{epoch}p{i}", 0, epoch, i)


def generate(pacer: Pacer, indices, version: int, status=TrajectoryStatus.COMPLETED, complete: bool = True) -> list:
    """Dispatch these prompts and submit their trajectories made under `version`; returns the admitted ids."""
    admitted = pacer.dispatch([ref(i) for i in indices], max_continuations=0).admitted_ids
    for prompt_id in admitted:
        pacer.submit([Trajectory(f"{prompt_id}#{j}", prompt_id, status=status, start_weight_version=version,
                                 end_weight_version=version, body=(prompt_id, j, version), size_bytes=7)
                      for j in range(2 if complete else 1)])
    return admitted


def contents(groups) -> list:
    return [(g.prompt_id, [t.content_key() for t in g.trajectories]) for g in groups]


# ------------------------------------------------------------------ the core


def test_restore_brings_back_the_step_the_buffer_and_kept_groups_and_discards_what_came_after():
    pacer = pacer_of(continue_restored=True)
    generate(pacer, range(4), 0)
    pacer.collect(1)
    generate(pacer, [4], 0, status=TrajectoryStatus.ABORTED)  # assembled, aborted: kept at the Reset
    pacer.reset(resume=True, weight_version=1)
    generate(pacer, [5], 1, complete=False)  # in flight at the checkpoint
    buffered_at_k = contents(sorted((g for _, g in pacer.buffer), key=lambda g: g.seq))
    blob = checkpoints.encode(pacer.checkpoint(), CODEC)
    assert pacer.state().last_checkpoint_step == 1

    # The steps after the checkpoint: the trainer takes the buffer, newer versions are generated.
    pacer.collect(3)
    pacer.reset(resume=True, weight_version=2)
    generate(pacer, [6, 7], 2)
    generate(pacer, [8], 2, complete=False)
    result = pacer.restore(checkpoints.decode(blob, CODEC))

    state = pacer.state()
    assert (state.step, state.weight_version, state.paused) == (1, 1, False)
    assert (result.step, result.weight_version) == (1, 1)
    assert contents(pacer.collect(3).groups) == buffered_at_k  # byte for byte, in their order
    assert pacer.state().restored_kept == 1 and pacer.dispatch([], max_continuations=1).continued[0].prompt_id == "e0p4"
    # Discarded: the two buffered groups of version 2, the running e0p8 (one trajectory of version 2) and the
    # kept e0p4 (version 0, put back from the checkpoint).
    assert (result.discarded_groups, result.discarded_newer_trajectories, result.dropped_running) == (4, 5, 1)
    assert sorted(result.discarded_prompt_ids) == ["e0p4", "e0p6", "e0p7", "e0p8"]
    assert result.reinstated_groups == 3 and result.kept_groups == 1
    # Offered again: e0p5 (in flight at the checkpoint) and e0p6..e0p8 (dispatched after it).
    assert result.reoffered_prompts == 4
    cursor = PromptCursor.restored(pacer.prompt_cursor())
    assert [i for i in range(10) if cursor.admitted(0, 0, i, f"e0p{i}")] == [0, 1, 2, 3, 4]
    assert state.invariant_holds() and state.rolled_back == 2 and state.restores == 1


def test_an_ack_of_a_lease_the_restore_discarded_says_the_restore_ended_it():
    pacer = pacer_of()
    generate(pacer, range(2), 0)
    blob = checkpoints.encode(pacer.checkpoint(), CODEC)
    leased = pacer.collect_now(1, lease_seconds=600)
    pacer.restore(checkpoints.decode(blob, CODEC))
    with pytest.raises(LeaseExpiredError, match="ended with a Restore before this Ack; the pacer went back"):
        pacer.ack(leased.lease_id)
    assert [g.prompt_id for g in pacer.collect(2).groups] == ["e0p0", "e0p1"]  # the checkpoint held them


def test_late_submits_of_discarded_work_are_refused_as_stale():
    pacer = pacer_of()
    blob = checkpoints.encode(pacer.checkpoint(), CODEC)
    generate(pacer, [0], 0, complete=False)
    pacer.restore(checkpoints.decode(blob, CODEC))
    with pytest.raises(Exception, match="dispatched before the pacer's last Reset or Restore"):
        pacer.submit([Trajectory("e0p0#1", "e0p0", start_weight_version=0, end_weight_version=0)])
    assert pacer.state().running == 0


def test_a_restore_that_cannot_apply_changes_nothing():
    pacer = pacer_of()
    generate(pacer, range(2), 0)
    checkpoint = pacer.checkpoint()
    other = Pacer(load_core_config("no-window", B=8, N=2))
    before = other.state()
    with pytest.raises(checkpoints.CheckpointMismatchError, match="num_prompts_per_step|other pacing settings"):
        other.restore(checkpoint)
    assert other.state() == before
    with pytest.raises(checkpoints.CheckpointFormatError, match="not a pacer checkpoint"):
        checkpoints.decode(b"something else", CODEC)
    newer = checkpoints.MAGIC + checkpoints._HEADER.pack(checkpoints.CHECKPOINT_FORMAT + 1) + b"..."
    with pytest.raises(checkpoints.CheckpointFormatError, match="format 3, this server reads formats 1 and 2"):
        checkpoints.decode(newer, CODEC)
    damaged = {**checkpoint, "cursor": "not a cursor"}  # in process, the dict is validated whole as decode does
    before = pacer.state()
    with pytest.raises(checkpoints.CheckpointFormatError, match="nothing changed"):
        pacer.restore(damaged)
    assert pacer.state() == before
    pacer.begin_reset()
    before = pacer.state()
    with pytest.raises(ResetInProgressError, match="Reset is running"):
        pacer.restore(checkpoint)
    assert pacer.state() == before
    pacer.abandon_reset()
    pacer.end_job()
    before = pacer.state()
    with pytest.raises(JobEndedError, match="EndJob ended this job"):
        pacer.restore(checkpoint)
    assert pacer.state() == before


def test_a_checkpoint_taken_while_paused_is_restored_paused_until_the_trainers_resume():
    pacer = pacer_of()
    events = []
    pacer.add_control_listener(events.append)
    generate(pacer, range(2), 0)
    pacer.reset()  # no resume: the trainer syncs weights, then resumes
    checkpoint = pacer.checkpoint()
    pacer.resume(1)
    del events[:]
    pacer.restore(checkpoint)
    assert pacer.state().paused and [e.type.name for e in events] == ["PAUSE"] and events[0].restores == 1
    assert pacer.dispatch([ref(5)]).admitted_ids == []
    pacer.resume(1)
    assert pacer.dispatch([ref(5)]).admitted_ids == ["e0p5"]


def test_the_cursor_keeps_a_low_water_mark_and_gives_back_what_it_unmarks():
    cursor = PromptCursor()
    for i in (0, 1, 3, 5):
        cursor.mark(0, 0, i, f"p{i}")
    cursor.mark(0, None, None, "loose")  # no index: not tracked (every snapshot would grow with the run)
    cursor.mark(0, None, None, "epoch2_ds0_prompt7")  # the LoongSage form carries (epoch, index)
    assert cursor.export() == {"marks": [(0, 0, 2, [3, 5]), (0, 2, 0, [7])]}
    cursor.mark(0, 0, 2, "p2")
    assert cursor.export()["marks"][0] == (0, 0, 4, [5]) and len(cursor) == 6 and not cursor.admitted(0, 0, None, "loose")
    cursor.unmark(0, 0, 1, "p1")
    assert cursor.export()["marks"][0] == (0, 0, 1, [2, 3, 5]) and not cursor.admitted(0, 0, 1, "p1")
    assert PromptCursor.restored(cursor.export()).export() == cursor.export()


def test_resume_with_an_older_weight_version_and_a_collect_at_another_step_say_restore_first():
    pacer = pacer_of()
    pacer.resume(5)
    with pytest.raises(InvalidArgumentError, match="restore first"):
        pacer.resume(3)
    generate(pacer, range(2), 5)
    with pytest.raises(Exception, match="restore first") as refused:
        pacer.collect(1, trainer_step=0)
    assert refused.value.reason == "STEP_MISMATCH" and pacer.state().buffered == 2
    assert len(pacer.collect(1, trainer_step=1).groups) == 1


# ------------------------------------------------------------------ over gRPC


def wire_trajectories(prompt_id: str, version: int, tokens: int = 5) -> list[WireTrajectory]:
    return [WireTrajectory(trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, status=WireStatus.COMPLETED,
                           token_ids=list(range(i, i + tokens)), logprobs=[-0.5] * tokens, reward=float(i),
                           start_weight_version=version, end_weight_version=version, metadata={"k": prompt_id})
            for i in range(2)]


def test_checkpoint_and_restore_over_grpc_survive_a_restart_and_tell_watchers(tmp_path):
    durable = Restartable(tmp_path, "state", "data_source.num_prompts_per_step=4", "rollout.continue_restored=false")
    pacer = durable.client
    try:
        pacer.dispatch(["a", "b", "c"])
        for p in "abc":
            pacer.submit(wire_trajectories(p, 0))
        pacer.reset("abort", wait=0, resume=True, weight_version=1)
        path = tmp_path / "pacer-step-1.ckpt"
        taken = pacer.checkpoint(path)
        assert (taken.step, taken.weight_version, taken.buffered_groups) == (1, 1, 3) and path.read_bytes() == taken.blob
        before = pacer.collect(3)
        pacer.reset("abort", wait=0, resume=True, weight_version=2)
        pacer.dispatch(["d"])
        pacer.submit(wire_trajectories("d", 2))
        stream = pacer.watch()
        assert next(iter(stream)).restores == 0
        result = pacer.restore(path)
        events = iter(stream)
        pause, resume = next(events), next(events)
        stream.cancel()
        assert (pause.type.name, resume.type.name, resume.weight_version, resume.restores) == ("PAUSE", "RESUME", 1, 1)
        assert (result.step, result.discarded_groups, result.discarded_newer_trajectories) == (1, 1, 2)
        durable.restart(kill=True)  # the Restore is journalled
        state = pacer.state()
        assert (state.step, state.weight_version, state.buffered, state.restores) == (1, 1, 3, 1)
        assert (state.last_checkpoint_step, state.last_restore_step, state.last_restore_weight_version) == (1, 1, 1)
        with pytest.raises(FailedPreconditionError, match="restore first"):
            pacer.collect_result(3, trainer_step=3)
        again = pacer.collect_result(3, trainer_step=1).groups
        assert [(g.prompt_id, g.trajectories) for g in again] == [(g.prompt_id, g.trajectories) for g in before]
        with pytest.raises(BadRequestError, match="restore first"):
            pacer.resume(0)
        with pytest.raises(BadRequestError, match="not a pacer checkpoint"):
            pacer.restore(b"nonsense")
        assert pacer.state().restores == 1
    finally:
        durable.close()


def test_the_command_line_writes_and_restores_a_checkpoint(tmp_path):
    import io
    import json

    from coda_client import cli as client_cli

    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, N=2)) as server, PacerClient(server.address) as pacer:
        pacer.dispatch(["a"])
        pacer.submit(wire_trajectories("a", 0))
        out, path = io.StringIO(), tmp_path / "pacer.ckpt"
        assert client_cli.main(["--address", server.address, "checkpoint", str(path), "--json"], out=out) == 0
        assert json.loads(out.getvalue())["buffered_groups"] == 1 and path.stat().st_size > 0
        pacer.collect(1)
        out = io.StringIO()
        assert client_cli.main(["--address", server.address, "restore", str(path), "--json"], out=out) == 0
        assert json.loads(out.getvalue())["reinstated_groups"] == 1 and pacer.state().buffered == 1


def test_a_checkpoint_of_another_job_is_refused_over_grpc(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, N=2)) as one, PacerClient(one.address) as first:
        taken = first.checkpoint()
    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, N=2)) as two, PacerClient(two.address) as second:
        with pytest.raises(FailedPreconditionError, match="other pacing settings") as refused:
            second.restore(taken)
        assert refused.value.reason == "CHECKPOINT_MISMATCH" and second.state().restores == 0


# ------------------------------------------------------------------ the worker kit and the prompt cursor


def test_a_run_with_a_restore_in_the_middle_trains_every_prompt_exactly_once(tmp_path):
    """Two workers (one shard each) and a trainer that checkpoints every step; after step K + 2 it goes back
    to its step-K checkpoint. Over the run every prompt is trained once, and nothing generated under a
    discarded weight version is trained."""
    import asyncio
    from collections import Counter

    from coda_client import AsyncPacerClient
    from coda_worker import AsyncRolloutWorker, ListPromptSource, Prompt
    from coda_worker.engines import FakeEngine, SamplingParams

    prompts, per_step, K = 24, 2, 3
    dataset = ListPromptSource([Prompt(f"q{i}", [1, 2, 3], epoch=0, index=i) for i in range(prompts)])

    async def main(address: str) -> tuple[list, list, object]:
        async with AsyncPacerClient(address) as pacer:
            workers = [AsyncRolloutWorker(pacer, FakeEngine(seed=n, mean_tokens=6, length_sigma=0.3,
                                                            seconds_per_token=0.002),
                                          dataset.shard(n, 2), sampling=SamplingParams(max_tokens=12), max_groups=2,
                                          dispatch_wait=0.5) for n in range(2)]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            trained: list = []  # (step, prompt id, weight versions of its trajectories)
            version, step, checkpoint, restored = 0, 0, None, None
            while len({p for _, p, _ in trained}) < prompts:
                result = await pacer.collect_result(per_step, wait=30, trainer_step=step)
                assert not result.timed_out, f"no batch for step {step}; trained {len(trained)} groups"
                trained += [(step, g.prompt_id, {v for t in g.trajectories for v in (t.start_weight_version,
                                                                                     t.end_weight_version)})
                            for g in result.groups]
                step += 1
                version = version + 1 if restored is None else max(version + 1, 1000 + step)
                await pacer.reset("abort", wait=10, resume=True, weight_version=version)
                if step == K and checkpoint is None:
                    checkpoint = await pacer.checkpoint()
                elif step == K + 2 and restored is None:
                    # The trainer dies after step K + 2 and comes back from its step-K checkpoint.
                    restored = await pacer.restore(checkpoint)
                    trained = [entry for entry in trained if entry[0] < K]
                    step, version = K, K
            for worker in workers:
                worker.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return trained, [w.stats for w in workers], restored

    with ServerProcess(tmp_path, *core_overrides("no-window", B=per_step, stale=1.0, N=2, M=4,
                                                 continue_restored=True)) as server:
        trained, stats, restored = asyncio.run(main(server.address))
    counts = Counter(prompt_id for _, prompt_id, _ in trained)
    assert sorted(counts) == sorted(f"q{i}" for i in range(prompts)) and set(counts.values()) == {1}, counts
    # Versions K+1 and K+2 were discarded by the Restore: nothing trained carries them.
    assert not [entry for entry in trained if entry[2] & {K + 1, K + 2}]
    assert restored.step == K and restored.reoffered_prompts > 0


def test_the_cursor_survives_a_server_restart_and_a_fresh_source_skips_what_was_admitted(tmp_path):
    from coda_client import PromptRef as WireRef
    from coda_worker import ListPromptSource, Prompt

    durable = Restartable(tmp_path, "state", "data_source.num_prompts_per_step=8")
    try:
        pacer = durable.client
        pacer.dispatch([WireRef(f"q{i}", 0, 0, i) for i in (0, 1, 2, 4)] + ["epoch1_ds0_prompt3", "loose"])
        durable.restart(kill=True)  # replayed from the journal
        cursor = pacer.prompt_cursor()
        source = ListPromptSource([Prompt(f"q{i}", [1], epoch=0, index=i) for i in range(6)]
                                  + [Prompt("epoch1_ds0_prompt3", [1]), Prompt("loose", [1]), Prompt("other", [1])])
        assert source.resume_from(cursor) == 4  # "loose" has no index: not tracked, proposed again
        assert [p.prompt_id for p in source.take(10)] == ["q3", "q5", "loose", "other"]
        source.give_back([Prompt("q3", [1], epoch=0, index=3)])
        assert source.resume_from(cursor) == 1  # once per Restore count: a second worker sharing it changes nothing
    finally:
        durable.close()


def test_a_checkpoint_larger_than_a_message_is_refused_naming_the_setting(tmp_path):
    from coda_client.errors import ResourceExhaustedError

    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, N=2), "server.max_message_bytes=65536") as server, \
            PacerClient(server.address) as pacer:
        pacer.dispatch([f"p{i}" for i in range(4)])
        for i in range(4):
            pacer.submit(wire_trajectories(f"p{i}", 0, tokens=3000))
        with pytest.raises(ResourceExhaustedError, match="server.max_message_bytes") as refused:
            pacer.checkpoint()
        assert refused.value.reason == "CHECKPOINT_TOO_LARGE" and pacer.state().buffered == 4


def test_a_checkpoint_larger_than_the_clients_limit_is_refused_before_it_is_counted(tmp_path):
    """A client whose max_message_bytes is below the server's could not receive a large checkpoint: gRPC refused the
    answer at the client, after the server had counted it taken (GetState's checkpoints and last checkpoint said one
    was taken that no trainer holds). The client says what it receives, the server refuses the checkpoint first."""
    from coda_client.errors import ResourceExhaustedError

    with ServerProcess(tmp_path, *core_overrides("no-window", B=4, N=2)) as server, \
            PacerClient(server.address, max_message_bytes=65536) as pacer:
        pacer.dispatch([f"p{i}" for i in range(4)])
        for i in range(4):
            pacer.submit(wire_trajectories(f"p{i}", 0, tokens=3000))
        before = pacer.state()
        with pytest.raises(ResourceExhaustedError) as refused:
            pacer.checkpoint()
        after = pacer.state()
    assert refused.value.reason == "CHECKPOINT_TOO_LARGE", refused.value
    assert "max_message_bytes (65536)" in refused.value.details, refused.value.details
    assert (after.checkpoints, after.last_checkpoint_step) == (before.checkpoints, before.last_checkpoint_step)
    assert after.buffered == 4
