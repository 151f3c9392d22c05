"""Checkpoint and Restore as a user found them: damaged blobs refused whole, refused checkpoints uncounted, the
checkpointing loop of docs/trainer.md through a second crash, a missing pacer.ckpt and a server killed under it."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from coda_client.errors import BadRequestError, ResourceExhaustedError
from coda_server.convert import ProtoTrajectories
from coda_server.core import checkpoints
from coda_server.core.journal import dumps
from conftest import core_overrides
from server_harness import REPO_ROOT, ServerProcess
from test_durability_restart import Restartable

N = 4  # trajectories per prompt
CONFIG = core_overrides("no-window", B=8, N=N, M=16)
CODEC = ProtoTrajectories()


def fill(pacer: PacerClient, prefix: str, groups: int, tokens: int = 5) -> int:
    """Up to `groups` complete groups in the buffer (as many as Dispatch admits); returns how many."""
    admitted = pacer.dispatch([f"{prefix}{i}" for i in range(groups)]).admitted
    for prompt_id in admitted:
        pacer.submit([Trajectory(trajectory_id=f"{prompt_id}#{j}", prompt_id=prompt_id,
                                 status=TrajectoryStatus.COMPLETED, token_ids=list(range(tokens)))
                      for j in range(N)])
    return len(admitted)


def counters(pacer: PacerClient) -> tuple:
    """What a half-applied Restore changed (the user saw rolled_back rise, buffered go from 2 to 3)."""
    s = pacer.state()
    return (s.step, s.weight_version, s.generation, s.buffered, s.running, s.paused, s.dropped, s.rolled_back,
            s.restores, s.held_bytes, s.last_restore_step)


def two_buffered_at_version_7(pacer: PacerClient) -> bytes:
    """The user's set-up: two groups buffered after a Reset that resumed at weight version 7; its checkpoint."""
    fill(pacer, "g", 2)
    pacer.reset("abort", wait=5, resume=True, weight_version=7)
    return pacer.checkpoint().blob


def refused_as_damaged(pacer: PacerClient, blob: bytes) -> str:
    """Restore `blob`: refused INVALID_ARGUMENT CHECKPOINT_FORMAT, changing nothing; its message."""
    before = counters(pacer)
    with pytest.raises(BadRequestError) as refused:
        pacer.restore(blob)
    assert refused.value.reason == "CHECKPOINT_FORMAT", refused.value
    message = str(refused.value)
    assert "Restore refused, nothing changed: checkpoint " in message, message
    assert counters(pacer) == before
    return message


def still_works(pacer: PacerClient, good: bytes) -> None:
    """The good checkpoint restores, and its two groups are collected."""
    assert pacer.restore(good).reinstated_groups == 2
    assert sorted(g.prompt_id for g in pacer.collect(2, wait=5)) == ["g0", "g1"]


def format_1(checkpoint: dict) -> bytes:
    """The blob of `checkpoint` as the version before the digest wrote it (format 1: magic, format, body)."""
    return dumps({**checkpoint, "format": 1}, CODEC, prefix=checkpoints.MAGIC + checkpoints._HEADER.pack(1))


def test_a_checkpoint_damaged_in_one_bit_is_refused_and_the_server_restores_the_good_one_after_a_restart(tmp_path):
    """One bit flipped ('prompt_id' read as 'qrompt_id') was restored OK (reinstated 2); then Collect failed
    UNKNOWN "'TrajectoryGroup' object has no attribute 'prompt_id'", and so did the good checkpoint's Restore,
    also after kill -9 and a restart on the state directory."""
    durable = Restartable(tmp_path, "state", *CONFIG)
    pacer = durable.client
    try:
        good = two_buffered_at_version_7(pacer)
        damaged = bytearray(good)
        damaged[good.index(b"\x8c\tprompt_id") + 2] ^= 0x01  # 'p' -> 'q'
        message = refused_as_damaged(pacer, bytes(damaged))
        assert "damaged (its digest does not match" in message, message
        still_works(pacer, good)
        pacer.reset("abort", wait=5, resume=True, weight_version=8)
        assert pacer.restore(good).step == 1
        durable.restart(kill=True)
        assert pacer.state().buffered == 2
        still_works(pacer, good)
    finally:
        durable.close()


def test_no_single_bit_flip_of_a_checkpoint_is_restored_or_changes_anything(tmp_path):
    """Every byte of a checkpoint with one bit flipped: each is refused CHECKPOINT_FORMAT, changing nothing (some
    were accepted, some half-applied, some left the server unable to restore the good checkpoint)."""
    with ServerProcess(tmp_path, *CONFIG, "server.state_dir=") as server, \
            PacerClient(server.address, client_id="flips") as pacer:
        good = two_buffered_at_version_7(pacer)
        before = counters(pacer)
        accepted = []
        for i in range(len(good)):
            flipped = bytearray(good)
            flipped[i] ^= 1 << (i % 8)
            try:
                pacer.restore(bytes(flipped))
                accepted.append(i)
            except BadRequestError as refused:
                assert refused.reason == "CHECKPOINT_FORMAT", (i, refused)
            assert counters(pacer) == before, i
        assert not accepted, f"restored with a flipped bit at bytes {accepted} of {len(good)}"
        still_works(pacer, good)


def damaged_checkpoints(good: dict) -> dict:
    """Checkpoints of the previous format (no digest) damaged as single flips damaged them, by what they
    break, with the words the refusal must name."""
    (first_priority, first_group), (_, second_group) = good["buffer"]
    renamed = {("cuffer" if key == "buffer" else key): value for key, value in good.items()}
    return {
        # KeyError: 'buffer', after rolled_back had risen by 2: half-applied.
        "a field renamed": (renamed, "lacks buffer"),
        # TypeError: '<' not supported between instances of 'float' and 'tuple', buffered 2 -> 3.
        "a priority of another type": ({**good, "buffer": [(1.0, first_group), (first_priority, second_group)]},
                                       "buffer[0]'s priority 1.0"),
        "two equal priorities": ({**good, "buffer": [(first_priority, first_group), (first_priority, second_group)]},
                                 "another entry's too"),
        "a step that is not a number": ({**good, "step": "1"}, "step '1'"),
        "a trajectory that is not one": ({**good, "kept": [type(first_group)("k0", trajectories=["t"])]},
                                         "kept[0] (prompt 'k0') trajectory 0 is not a trajectory"),
        "a cursor of another shape": ({**good, "cursor": {"marks": [(0, 0)]}}, "cursor mark 0"),
    }


def test_a_checkpoint_of_the_previous_format_is_restored_and_refused_whole_when_damaged(tmp_path):
    """A format-1 blob (no digest) still restores; damaged, it is refused naming what is wrong, changing nothing,
    and the server goes on."""
    with ServerProcess(tmp_path, *CONFIG, "server.state_dir=") as server, \
            PacerClient(server.address, client_id="old") as pacer:
        good_blob = two_buffered_at_version_7(pacer)
        good = checkpoints.decode(good_blob, CODEC)
        old = format_1(good)
        assert pacer.restore(old).reinstated_groups == 2
        flipped = bytearray(old)
        flipped[old.index(b"\x8c\tprompt_id") + 2] ^= 0x01  # the user's flip, with no digest to catch it
        message = refused_as_damaged(pacer, bytes(flipped))
        assert "not a whole pacer checkpoint" in message and "qrompt_id" in message, message
        for what, (damaged, named) in damaged_checkpoints(good).items():
            message = refused_as_damaged(pacer, format_1(damaged))
            assert named in message, (what, message)
        still_works(pacer, old)
        still_works(pacer, good_blob)


def test_a_checkpoint_refused_as_too_large_is_not_counted(tmp_path):
    """CHECKPOINT_TOO_LARGE (no blob sent) moved GetState's (checkpoints, last_checkpoint_step,
    last_checkpoint_weight_version) from (0, -1, -1) to (1, 2, 2)."""
    def taken(pacer: PacerClient) -> tuple:
        s = pacer.state()
        return s.checkpoints, s.last_checkpoint_step, s.last_checkpoint_weight_version

    with ServerProcess(tmp_path, *CONFIG, "server.max_message_bytes=65536") as server, \
            PacerClient(server.address) as pacer:
        fill(pacer, "big", 4, tokens=3000)
        pacer.reset("abort", wait=5, resume=True, weight_version=1)
        pacer.reset("abort", wait=5, resume=True, weight_version=2)
        with pytest.raises(ResourceExhaustedError) as refused:
            pacer.checkpoint()
        assert refused.value.reason == "CHECKPOINT_TOO_LARGE"
        assert taken(pacer) == (0, -1, -1)
        for _ in range(4):
            assert len(pacer.collect(1, wait=5)) == 1
        assert pacer.checkpoint().buffered_groups == 0
        assert taken(pacer) == (1, 2, 2)


# ------------------------------------------------------------------ docs/trainer.md's checkpointing loop


class Died(Exception):
    """The trainer is killed here (its files stay, as after kill -9)."""


def checkpointing_loop() -> str:
    """The code of docs/trainer.md's "A checkpointing trainer loop"."""
    text = (REPO_ROOT / "docs" / "trainer.md").read_text()
    section = text[text.index("## A checkpointing trainer loop"):]
    start = section.index("```python notest\n") + len("```python notest\n")
    return section[start:section.index("```", start)]


def generate(address: str, stop: threading.Event) -> None:
    """A worker: proposes fresh prompts and submits their groups at once, riding through server restarts."""
    with PacerClient(address, client_id="gen", timeout=5, wait_for_ready=True) as pacer:
        batch = 0
        while not stop.is_set():
            try:
                if not fill(pacer, f"b{batch}-", 4):  # paused, or the window is full
                    stop.wait(0.02)
            except Exception:  # stale after a Restore, or the server restarting: propose again
                stop.wait(0.05)
            batch += 1


def test_the_checkpointing_loop_in_trainer_md_survives_two_crashes_and_a_server_kill_without_reusing_a_version(
        tmp_path, monkeypatch):
    """Run 1 dies between save_model and pacer.checkpoint (the old loop resumed from the last directory saved:
    FileNotFoundError); run 2 restores and dies before its first Resume (the old loop then took the server's
    weight version, the checkpoint's, and announced discarded numbers again: 3, 4, 5); run 3's server is killed
    -9 at a step boundary (the old loop's client died of UnavailableError)."""
    code = checkpointing_loop()
    durable = Restartable(tmp_path, "state", *core_overrides("no-window", B=2, N=N, M=2 * N))
    code = code.replace('"127.0.0.1:50051"', repr(durable.server.address))
    monkeypatch.chdir(tmp_path)
    stop = threading.Event()
    worker = threading.Thread(target=generate, args=(durable.server.address, stop), daemon=True)
    worker.start()
    announced: list[list[int]] = []  # per run, the versions the loop announced (not the checkpoint's, reloaded)
    restarter: list[threading.Thread] = []

    def restart_later() -> None:
        time.sleep(3.0)  # longer than a client without wait_for_ready retries (about 1.5 s)
        durable.server.close()
        durable.server = ServerProcess(tmp_path, *durable.overrides).start()

    def run(die) -> None:
        model, reloading = {"version": 0, "trained": []}, [False]
        announced.append([])

        def sync_weights(version: int) -> None:
            if reloading[0]:  # the checkpoint's weights, loaded again
                reloading[0] = False
            else:
                announced[-1].append(version)
                die("sync", version)
            model["version"] = version

        def save_model(path: Path) -> None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(model))
            die("save_model", Path(path).parent.name)

        def checkpoint_version(resume_dir: Path) -> int:
            reloading[0] = True
            return json.loads((resume_dir / "model.pt").read_text())["version"]

        saved = sorted(Path("ckpt").glob("step-*")) if Path("ckpt").exists() else []
        scope = {"load_model": lambda path: model.update(json.loads(Path(path).read_text())),
                 "save_model": save_model, "sync_weights": sync_weights, "checkpoint_version": checkpoint_version,
                 "train_on": lambda batch: model["trained"].extend(g.prompt_id for g in batch.groups),
                 "num_steps": 6, "M": 2 * N, "K": 2, "steps_batches": "step",
                 "resume_dir": saved[-1] if saved else None}  # the old loop's "the last one saved"
        try:
            exec(compile(code, "docs/trainer.md", "exec"), scope)
        finally:
            if "pacer" in scope:
                scope["pacer"].close()

    def first(kind: str, value) -> None:
        if (kind, value) == ("save_model", "step-000004"):
            raise Died("between save_model and pacer.checkpoint")

    def second(kind: str, value) -> None:
        if kind == "sync":
            raise Died("after the Restore, before the first Resume")

    def third(kind: str, value) -> None:
        if kind == "sync" and not restarter and len(announced[-1]) == 2:
            durable.server.kill()  # at a step boundary: the Reset and Resume come next
            restarter.append(threading.Thread(target=restart_later))
            restarter[0].start()

    try:
        with pytest.raises(Died, match="between save_model"):
            run(first)
        with pytest.raises(Died, match="before the first Resume"):
            run(second)
        run(third)
        restarter[0].join()
        every = [version for versions in announced for version in versions]
        assert announced[0] == [1, 2, 3, 4] and len(every) == len(set(every)) and every == sorted(every), announced
        state = durable.client.state()
        assert (state.step, state.weight_version, state.restores) == (6, every[-1], 2), state
        assert state.last_restore_step == 2 and state.last_checkpoint_step == 6
    finally:
        stop.set()
        worker.join(30)
        durable.close()
