"""Duplicate detection by content fingerprint: today's semantics, without keeping what the trainer has.

An identical re-submit is a duplicate and a different one with a known id is INVALID_ARGUMENT, before and
after the trainer took the group; once it took it (Collect without lease, or Ack), the pacer keeps only a
content key: the body is let go, also by the remembered answer of the acknowledged Collect.
"""
from __future__ import annotations

import asyncio
import gc
import threading
import weakref
import zlib

import numpy as np
import pytest

from coda_client import PacerClient, Trajectory as WireTrajectory, TrajectoryStatus as WireStatus
from coda_client.errors import BadRequestError
from coda_server import wire
from coda_server.core import InvalidArgumentError, Pacer, PromptRef, Trajectory, load_config
from coda_server.core.async_pacer import AsyncPacer
from coda_server.core.content_keys import KEY_ON_LOOP_MAX_BYTES
from server_harness import ServerProcess


class Body:
    """A body with a fingerprint, as the servicer's EncodedTrajectory; weakly referable to watch it go."""

    def __init__(self, content: str):
        self.content = content

    def fingerprint(self) -> int:
        return hash(self.content)


def _pacer() -> Pacer:
    return Pacer(load_config(overrides=["data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                                        "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window"]))


def _group(prompt_id: str, content: str = "x") -> list[Trajectory]:
    return [Trajectory(f"{prompt_id}/{i}", prompt_id, body=Body(f"{content}{i}"), size_bytes=10) for i in range(2)]


@pytest.mark.parametrize("leased, request_id", [(False, ""), (True, ""), (True, "collect-1")])
def test_after_the_trainer_took_a_group_only_its_key_is_kept(leased: bool, request_id: str) -> None:
    pacer = _pacer()
    pacer.dispatch([PromptRef("a")])
    sent = _group("a")
    pacer.submit(sent)
    bodies = [weakref.ref(t.body) for t in sent]
    result = pacer.collect(1, lease_seconds=30 if leased else 0, request_id=request_id)
    if leased:
        pacer.ack(result.lease_id)
    del sent, result
    gc.collect()
    assert [ref() for ref in bodies] == [None, None]  # nothing in the pacer holds the bodies any more
    before = pacer.state()
    assert pacer.submit(_group("a")).duplicates == 2  # identical content (equal fingerprints): duplicates
    with pytest.raises(InvalidArgumentError, match="already accepted with different content"):
        pacer.submit(_group("a", content="y"))
    changed = _group("a")
    changed[1].reward = 0.5
    with pytest.raises(InvalidArgumentError, match="already accepted with different content"):
        pacer.submit(changed)
    after = pacer.state()
    assert (after.submitted, after.buffered, after.held_bytes) == (before.submitted, before.buffered, before.held_bytes)
    assert after.duplicates == before.duplicates + 2


def test_while_the_group_is_held_the_same_rules_apply() -> None:
    pacer = _pacer()
    pacer.dispatch([PromptRef("h")])
    pacer.submit(_group("h")[:1])
    assert pacer.submit(_group("h")[:1]).duplicates == 1
    with pytest.raises(InvalidArgumentError, match="different content"):
        pacer.submit(_group("h", content="z")[:1])


class ThreadNotingBody(Body):
    """A body that notes which thread digests it, caching its fingerprint as EncodedTrajectory does, and counts every
    call of its fingerprint, those that find it cached included."""

    def __init__(self, content: str):
        super().__init__(content)
        self.digested_in: list[int] = []
        self.fingerprint_calls = 0
        self._fingerprint = None

    def fingerprinted(self) -> bool:
        return self._fingerprint is not None

    def fingerprint(self) -> int:
        self.fingerprint_calls += 1
        if self._fingerprint is None:
            self.digested_in.append(threading.get_ident())
            self._fingerprint = hash(self.content)
        return self._fingerprint


def test_a_submits_content_keys_are_computed_once_as_it_arrives() -> None:
    """Up to KEY_ON_LOOP_MAX_BYTES, keyed on the loop as the Submit arrives, so a body holds what its Submit's parse
    read of it for no longer than the call; the Collect and the Ack find the keys made (no digest again, none in the
    keys thread), and the Ack keeps the whole key built then: it does not ask the body again."""
    facade = AsyncPacer(_pacer())
    sent = [Trajectory(f"k/{i}", "k", body=ThreadNotingBody(f"y{i}"), size_bytes=10) for i in range(2)]

    async def run() -> int:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("k")])
            await facade.submit(sent)
            assert [len(t.body.digested_in) for t in sent] == [1, 1]  # by the time the Submit answered
            result = await facade.collect(1, lease_seconds=30)
            await facade.ack(result.lease_id)
            assert [t.body.fingerprint_calls for t in sent] == [1, 1]
            again = await facade.submit([Trajectory("k/0", "k", body=Body("y0"), size_bytes=10)])
            assert again.duplicates == 1  # the kept key is the body's digest
            with pytest.raises(InvalidArgumentError, match="different content"):
                await facade.submit([Trajectory("k/1", "k", body=Body("changed"), size_bytes=10)])
            return threading.get_ident()
        finally:
            facade.drain()

    loop_thread = asyncio.run(run())
    for trajectory in sent:
        assert trajectory.body.digested_in == [loop_thread]


def test_a_large_submits_content_keys_are_computed_off_the_event_loop_without_waiting_for_a_collect() -> None:
    """Over KEY_ON_LOOP_MAX_BYTES the digests (of large arrays, which run without the GIL) are made in the keys
    thread, beside the loop, as soon as the Submit is accepted."""
    facade = AsyncPacer(_pacer())
    size = KEY_ON_LOOP_MAX_BYTES // 2 + 1  # the two of them just over the limit
    sent = [Trajectory(f"k/{i}", "k", body=ThreadNotingBody(f"y{i}"), size_bytes=size) for i in range(2)]

    async def run() -> int:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("k")])
            await facade.submit(sent)
            # The keys thread is one worker taking its work in order: this runs once the Submit's digests are made.
            await asyncio.get_running_loop().run_in_executor(facade.content_keys.thread, lambda: None)
            return threading.get_ident()
        finally:
            facade.drain()

    loop_thread = asyncio.run(run())
    for trajectory in sent:
        assert len(trajectory.body.digested_in) == 1 and trajectory.body.digested_in[0] != loop_thread


def test_a_leased_collects_missing_content_keys_are_computed_off_the_event_loop_before_its_ack() -> None:
    """Trajectories accepted without their keys made (an embedding's Pacer.submit, a journal's replay) have them
    computed in the keys thread while the answer goes out, not on the loop, and the Ack waits for them."""
    facade = AsyncPacer(_pacer())
    sent = [Trajectory(f"a/{i}", "a", body=ThreadNotingBody(f"x{i}"), size_bytes=10) for i in range(2)]

    async def run() -> int:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("a")])
            facade.pacer.submit(sent)  # accepted in process, not through AsyncPacer.submit: nothing keyed yet
            assert [t.body.digested_in for t in sent] == [[], []]
            result = await facade.collect(1, lease_seconds=30)
            assert result.lease_id
            await facade.ack(result.lease_id)
            again = await facade.submit([Trajectory("a/0", "a", body=Body("x0"), size_bytes=10)])
            assert again.duplicates == 1
            return threading.get_ident()
        finally:
            facade.drain()

    loop_thread = asyncio.run(run())
    for trajectory in sent:  # digested once each, in a thread of its own, by the time the Ack kept the keys
        assert len(trajectory.body.digested_in) == 1 and trajectory.body.digested_in[0] != loop_thread


class PendingDigestBody(Body):
    """A body whose digest is not computed until asked (as EncodedTrajectory's, which AsyncPacer computes as a Submit
    is accepted): `fingerprinted()` says whether it is."""

    def __init__(self, content: str):
        super().__init__(content)
        self._fingerprint = None

    def fingerprinted(self) -> bool:
        return self._fingerprint is not None

    def fingerprint(self) -> int:
        if self._fingerprint is None:
            self._fingerprint = hash(self.content)
        return self._fingerprint


def _filtering_pacer() -> Pacer:
    """Groups of 2 whose rewards are all equal are dropped by the `reward` filter."""
    return Pacer(load_config(overrides=["data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=2",
                                        "trainer.mini_batch_size=2", "fully_async.sliding_window=no-window",
                                        "rollout.filter=[status,reward]"]))


def test_a_group_a_filter_dropped_keeps_only_its_key_once_digested() -> None:
    """A filter-dropped group's bodies (the Submit's bytes they are slices of) are let go, not held until the step
    ends: as soon as their digests are made, at the next call that sweeps (a Submit, an Ack)."""
    pacer = _filtering_pacer()
    pacer.dispatch([PromptRef("d"), PromptRef("e")])
    sent = [Trajectory(f"d/{i}", "d", reward=1.0, body=PendingDigestBody(f"x{i}"), size_bytes=10) for i in range(2)]
    pacer.submit(sent)
    assert pacer.state().filtered == 1
    bodies = [weakref.ref(t.body) for t in sent]
    [trajectory.body.fingerprint() for trajectory in sent]  # what AsyncPacer's Submit does
    del sent
    pacer.submit([Trajectory("e/0", "e", reward=0.0, body=PendingDigestBody("e0"), size_bytes=10)])  # sweeps
    gc.collect()
    assert [ref() for ref in bodies] == [None, None]
    assert pacer.submit([Trajectory("d/0", "d", reward=1.0, body=Body("x0"), size_bytes=10)]).duplicates == 1
    with pytest.raises(InvalidArgumentError, match="already accepted with different content"):
        pacer.submit([Trajectory("d/1", "d", reward=1.0, body=Body("changed"), size_bytes=10)])


def test_a_dropped_groups_bodies_wait_for_their_digests_until_the_next_call_at_most() -> None:
    """Not digested when they leave (in the server the Submit made them before its intake); if the digest is not made
    by the next Submit, that call makes it, so what waits is bounded (a journal's replay does not make them)."""
    pacer = _filtering_pacer()
    pacer.dispatch([PromptRef("d"), PromptRef("e")])
    sent = [Trajectory(f"d/{i}", "d", reward=1.0, body=PendingDigestBody(f"x{i}"), size_bytes=10) for i in range(2)]
    bodies = [weakref.ref(t.body) for t in sent]
    pacer.submit(sent)
    del sent
    gc.collect()
    assert [ref() is not None and not ref().fingerprinted() for ref in bodies] == [True, True]
    pacer.submit([Trajectory("e/0", "e", reward=0.0, body=PendingDigestBody("e0"), size_bytes=10)])  # sweeps
    gc.collect()
    assert [ref() for ref in bodies] == [None, None]
    assert pacer.submit([Trajectory("d/1", "d", reward=1.0, body=Body("x1"), size_bytes=10)]).duplicates == 1


def test_a_dropped_groups_submit_bytes_are_let_go() -> None:
    """End to end in process: real Submit bytes, parsed and converted as the servicer does, keyed by AsyncPacer's
    Submit; once a filter dropped their group, nothing in the pacer holds the request's bytes, from the answer of
    the Submit that dropped it on."""
    from coda_client import wire_forms as _wire
    from coda_server import convert

    class Request(bytearray):  # a buffer that can be referred to weakly
        pass

    def request(prompt_id: str, reward: float) -> Request:
        tag = _wire.length_delimited_tag(wire.pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number)
        bodies = [b"".join(WireTrajectory(trajectory_id=f"{prompt_id}/{i}", prompt_id=prompt_id, reward=reward,
                                          status=WireStatus.COMPLETED, token_ids=list(range(100)),
                                          logprobs=[-0.5] * 100).encoded_parts()) for i in range(2)]
        return Request(b"".join(tag + _wire.varint(len(body)) + body for body in bodies))

    facade = AsyncPacer(_filtering_pacer())
    unsent = [request("d", 1.0)]
    watched = weakref.ref(unsent[0])

    async def run() -> int:
        facade.bind_loop()
        try:
            await facade.dispatch([PromptRef("d"), PromptRef("e")])
            await facade.submit(convert.trajectories(wire.parse_submit(unsent.pop()).trajectories))
            assert facade.pacer.state().filtered == 1
            gc.collect()
            # Keyed before the intake, so the group left with its keys made: let go by the Submit that dropped it,
            # not kept until the next call's sweep.
            assert watched() is None
            kept = request("e", 0.0)
            await facade.submit(convert.trajectories(wire.parse_submit(kept).trajectories)[:1])
            again = await facade.submit(convert.trajectories(wire.parse_submit(request("d", 1.0)).trajectories))
            return again.duplicates
        finally:
            facade.drain()

    assert asyncio.run(run()) == 2  # still recognised by its key


@pytest.mark.parametrize("digest", ["xxh3", "crc32"])
def test_the_servicer_fingerprint_ignores_encoding_order_but_not_content(digest, monkeypatch) -> None:
    """With either digest of the arrays: XXH3 (the server extra's xxhash) or CRC-32 (a server without it)."""
    if digest == "xxh3":
        xxhash = pytest.importorskip("xxhash")
        monkeypatch.setattr(wire, "_digest", xxhash.xxh3_64_intdigest)
    else:
        monkeypatch.setattr(wire, "_digest", zlib.crc32)

    def encoded(**fields) -> wire.EncodedTrajectory:
        values = dict(trajectory_id="t", prompt_id="p", status=1, token_ids=[1, 2], logprobs=[-0.5, -1.0],
                      metadata={"a": "1", "b": "2"}, payload=b"\x00")
        values.update(fields)
        return wire.EncodedTrajectory(memoryview(b"".join(WireTrajectory(**values).encoded_parts())))

    reference = encoded()
    reordered = wire.EncodedTrajectory(memoryview(  # same fields, written in the reverse order
        b"".join(reversed(_fields_of(bytes(reference.encoded))))))
    assert bytes(reordered.encoded) != bytes(reference.encoded) and reordered == reference
    assert encoded(metadata={"b": "2", "a": "1"}) == reference
    # An array written as an empty packed run says what its absence says, to any parser: the same content.
    empty_run = bytes([wire.Trajectory.DESCRIPTOR.fields_by_name["loss_mask"].number << 3 | 2, 0])
    assert wire.EncodedTrajectory(memoryview(bytes(reference.encoded) + empty_run)) == reference
    for different in (encoded(token_ids=[1, 3]), encoded(logprobs=[-0.5, float("nan")]), encoded(payload=b"\x01"),
                      encoded(metadata={"a": "1"}), encoded(loss_mask=[1, 1]), encoded(num_turns=2)):
        assert different != reference
    # The same bytes in the same order, split differently between two neighbouring arrays: not the same content.
    whole = encoded(loss_mask=[1, 2], segment_lengths=[])
    moved = encoded(loss_mask=[1], segment_lengths=[2])
    assert whole != moved


def test_the_server_extra_digests_the_arrays_with_xxh3(monkeypatch) -> None:
    """xxhash installed (the server extra), the arrays' digest is XXH3's: the fingerprint changes with it."""
    pytest.importorskip("xxhash")
    assert wire.DIGEST == "XXH3-64"

    def fingerprint() -> int:
        return wire.EncodedTrajectory(memoryview(b"".join(WireTrajectory(
            trajectory_id="t", prompt_id="p", status=1, token_ids=list(range(100))).encoded_parts()))).fingerprint()

    default = fingerprint()
    monkeypatch.setattr(wire, "_digest", zlib.crc32)
    assert fingerprint() != default


def test_the_fingerprint_from_the_submits_parse_is_the_one_read_from_the_bytes() -> None:
    """The servicer's bodies carry what the Submit's parse read (convert.trajectories), so the digest need not
    walk the bytes again; it must come out as the digest read from the bytes alone, and let the parse go."""
    from coda_client import wire_forms as _wire
    from coda_server import convert

    sent = [WireTrajectory(trajectory_id=f"t{i}", prompt_id="p", status=WireStatus.COMPLETED, reward=0.5 * i,
                           token_ids=list(range(i + 1)), logprobs=[-0.25] * (i + 1), num_turns=i,
                           metadata={"z": str(i), "a": "x"} if i % 2 else {}, payload=b"\x07" * i)
            for i in range(4)]
    tag = _wire.length_delimited_tag(wire.pacer_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number)
    request = b"".join(tag + _wire.varint(len(body)) + body for body in (b"".join(t.encoded_parts()) for t in sent))
    converted = convert.trajectories(wire.parse_submit(request).trajectories)
    for trajectory in converted:
        body = trajectory.body
        assert body._parsed is not None
        from_bytes = wire.EncodedTrajectory(memoryview(bytes(body.encoded)))
        assert body.fingerprint() == from_bytes.fingerprint()
        assert body._parsed is None  # the views of the request are let go once digested
    assert len({t.body.fingerprint() for t in converted}) == len(sent)


def _fields_of(data: bytes) -> list[bytes]:
    from coda_client import wire_forms as _wire

    view = memoryview(data)
    return [bytes(view[start:end]) for _, _, start, _, end in _wire.fields(view, 0, len(view))]


def test_over_grpc_a_resubmit_after_collect_is_a_duplicate_and_a_changed_one_is_refused(tmp_path) -> None:
    with ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=4",
                       "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1") as server, \
            PacerClient(server.address) as pacer:
        def trajectory(tokens, reward: float = 0.0, num_turns: int = 0) -> WireTrajectory:
            return WireTrajectory(trajectory_id="g/0", prompt_id="g", status=WireStatus.COMPLETED, reward=reward,
                                  num_turns=num_turns, token_ids=np.asarray(tokens), metadata={"k": "v", "j": "w"})

        pacer.dispatch(["g"])
        pacer.submit([trajectory([1, 2, 3])])
        with pacer.collect_leased(1, lease=30) as groups:
            assert len(groups) == 1
        before = pacer.state()
        assert before.held_bytes == 0 and before.consumed == 1
        again = pacer.submit([trajectory([1, 2, 3])])
        assert (again.accepted, again.duplicates) == (0, 1)
        # A changed array, or a changed routing field (kept in the key beside the arrays' fingerprint): refused.
        for changed in (trajectory([1, 2, 4]), trajectory([1, 2, 3], reward=0.5), trajectory([1, 2, 3], num_turns=2)):
            with pytest.raises(BadRequestError, match="already accepted with different content"):
                pacer.submit([changed])
        after = pacer.state()
        assert (after.submitted, after.held_bytes, after.buffered) == (before.submitted, 0, 0)


def _taken_then_dispatched_again(pacer: Pacer) -> int:
    """Group "a" submitted, taken by the trainer, and "a" dispatched again: the running dispatch's seq."""
    pacer.dispatch([PromptRef("a")])
    pacer.submit(_group("a"))
    assert len(pacer.collect(1).groups) == 1
    return pacer.dispatch([PromptRef("a")]).first_seq


def test_a_submit_fenced_to_a_new_dispatch_under_the_taken_groups_ids_is_refused() -> None:
    pacer = _pacer()
    seq = _taken_then_dispatched_again(pacer)
    before = pacer.state()
    with pytest.raises(InvalidArgumentError, match=rf"earlier dispatch of prompt 'a'.*running dispatch seq {seq}.*"
                                                   r"unique within a generation") as refused:
        pacer.submit(_group("a"), dispatch_seqs={"a": seq})
    assert [field for field, _ in refused.value.violations] == ["trajectories[0].trajectory_id",
                                                                "trajectories[1].trajectory_id"]
    assert pacer.state() == before  # nothing counted, nothing accepted
    fresh = [Trajectory(f"a/new{i}", "a", body=Body(f"x{i}"), size_bytes=10) for i in range(2)]
    assert pacer.submit(fresh, dispatch_seqs={"a": seq}).groups_completed == 1  # new ids: the new group completes


def test_an_unfenced_repeat_of_a_taken_groups_ids_is_a_duplicate_said_in_the_log(caplog) -> None:
    pacer = _pacer()
    seq = _taken_then_dispatched_again(pacer)
    with caplog.at_level("WARNING", logger="coda_server.intake"):
        result = pacer.submit(_group("a"))  # a late retry, or reused ids: the server cannot tell
    assert (result.accepted, result.duplicates) == (0, 2)
    assert [r.getMessage() for r in caplog.records if r.name == "coda_server.intake"] == [
        f"Submit: 2 trajectories were counted as duplicates (the first 'a/0'): an earlier dispatch of prompt 'a' "
        f"brought them in this generation, and its later dispatch (seq {seq}) runs without them. If they are that "
        f"dispatch's work, their ids were reused (trajectory ids must be unique within a generation) and its group "
        f"waits until its in-flight lease runs out (server.inflight_lease_seconds = 300)"]


def test_a_restart_replays_the_unfenced_repeat_without_saying_it_again(tmp_path, caplog) -> None:
    from coda_server.core.sqlite_journal import SqliteJournal

    def journaled() -> Pacer:
        return Pacer(_pacer().config, journal=SqliteJournal(tmp_path / "state", fsync="off"))

    def bodiless(prompt_id: str) -> list[Trajectory]:  # what the journal can write
        return [Trajectory(f"{prompt_id}/{i}", prompt_id, size_bytes=10) for i in range(2)]

    first = journaled()
    first.dispatch([PromptRef("a")])
    first.submit(bodiless("a"))
    assert len(first.collect(1).groups) == 1
    first.dispatch([PromptRef("a")])
    with caplog.at_level("WARNING", logger="coda_server.intake"):
        assert first.submit(bodiless("a")).duplicates == 2
        said_live = [r for r in caplog.records if r.name == "coda_server.intake"]
        before = first.state()
        first.journal.close()
        caplog.clear()
        recovered = journaled()
        recovered.recover()
    assert len(said_live) == 1  # the live Submit said it
    assert not [r for r in caplog.records if r.name == "coda_server.intake"]  # the replay did not say it again
    assert (recovered.state().duplicates, recovered.state().running) == (before.duplicates, before.running)
    recovered.journal.close()


def test_retries_into_the_running_group_are_duplicates_without_a_warning(caplog) -> None:
    pacer = _pacer()
    seq = pacer.dispatch([PromptRef("a")]).first_seq
    first, second = _group("a")
    pacer.submit([first], dispatch_seqs={"a": seq})
    with caplog.at_level("WARNING", logger="coda_server.intake"):
        # The first again (a retry into its own running group) and the second twice in one Submit.
        retried = pacer.submit([first, second, second], dispatch_seqs={"a": seq})
        again = pacer.submit(_group("a"))  # the complete group's, with no later dispatch running
    assert (retried.accepted, retried.duplicates, retried.groups_completed) == (1, 2, 1)
    assert (again.accepted, again.duplicates) == (0, 2)
    assert not [r for r in caplog.records if r.name == "coda_server.intake"]


def test_over_grpc_a_new_dispatchs_work_under_reused_ids_is_refused_when_fenced_and_logged_when_not(tmp_path) -> None:
    with ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=4",
                       "data_source.num_trajectories_per_prompt=1", "trainer.mini_batch_size=1") as server, \
            PacerClient(server.address) as pacer:
        def trajectory() -> WireTrajectory:  # the same id and content each time: greedy decoding, ids by position
            return WireTrajectory(trajectory_id="g/0", prompt_id="g", status=WireStatus.COMPLETED, token_ids=[1, 2])

        pacer.dispatch(["g"])
        pacer.submit([trajectory()])
        assert len(pacer.collect(1)) == 1
        seq = pacer.dispatch(["g"]).seqs[0]
        with pytest.raises(BadRequestError, match=f"running dispatch seq {seq}.*unique within a generation"):
            pacer.submit([trajectory()], dispatch_seqs={"g": seq})
        unfenced = pacer.submit([trajectory()])
        assert (unfenced.accepted, unfenced.duplicates) == (0, 1)
        [held] = pacer.list_workers()[0].groups
        assert (held.prompt_id, held.seq, held.trajectories) == ("g", seq, 0)
    assert (f"WARNING coda_server.intake: Submit: 1 trajectory was counted as a duplicate (the first 'g/0'): an earlier "
            f"dispatch of prompt 'g' brought them in this generation, and its later dispatch (seq {seq}) runs without "
            f"them") in server.log()
