"""A worker restarted under the same id resumes its prompt source from the server's prompt cursor. The cursor knows a
prompt by its (ds_index, epoch, index) (or a LoongSage-form id) and keeps no ids, so it stays the size of the gaps,
not of the run. Prompts built as the docs built them, `Prompt(f"p{i}", tokens)`, have neither: a restarted worker
proposed again, and the server admitted and the trainer trained again, prompts already trained, without a word.
Now ListPromptSource says so in one warning the first time it is resumed (and the docs give prompts their index);
with indices, a restarted worker proposes none of the prompts admitted before."""
from __future__ import annotations

import asyncio
import logging
import re

import pytest

from coda_client import AsyncPacerClient
from coda_client.types import PromptCursor
from coda_worker import AsyncRolloutWorker, FakeEngine, ListPromptSource, Prompt, SamplingParams
from conftest import core_overrides
from server_harness import ServerProcess
from test_worker_loop import until, until_state

WORKER_ID = "rollout-restarted"
PROMPTS = 8
WINDOW = 4  # no-window, B=2, stale 1.0: C = 4 groups running or buffered, so each worker's run admits 4
RUN_TIMEOUT = 60.0
UNTRACKED = "carry no index"


def prompt_list(indexed: bool) -> list[Prompt]:
    return [Prompt(f"p{i}", [100 + i, 7, 7], epoch=0, index=i) if indexed else Prompt(f"p{i}", [100 + i, 7, 7])
            for i in range(PROMPTS)]


@pytest.fixture
def server(tmp_path):
    with ServerProcess(tmp_path, *core_overrides("no-window", B=2, stale=1.0, N=2, M=4)) as process:
        yield process


async def run_until_window_full(address: str, source: ListPromptSource) -> set[str]:
    """A worker named WORKER_ID on FakeEngine, run until the window is full of its submitted groups, then stopped;
    the prompt ids of the trajectories the server acknowledged."""
    acknowledged: list = []
    async with AsyncPacerClient(address, client_id=WORKER_ID) as pacer:
        worker = AsyncRolloutWorker(pacer, FakeEngine(seed=0, mean_tokens=4, length_sigma=0.0), source,
                                    sampling=SamplingParams(max_tokens=16), max_groups=2, dispatch_wait=0.5,
                                    on_submitted=acknowledged.extend)
        task = asyncio.create_task(worker.run())
        try:
            await until_state(pacer, lambda s: s.buffered == WINDOW, f"{WINDOW} groups submitted and buffered",
                              timeout=RUN_TIMEOUT)
            await until(lambda: len(acknowledged) == 2 * WINDOW, "their trajectories acknowledged to the worker")
        finally:
            worker.stop()
            await asyncio.wait_for(task, RUN_TIMEOUT)
    return {t.prompt_id for t in acknowledged}


def restart_with(address: str, indexed: bool) -> tuple[set[str], set[str]]:
    """The first worker's run, the trainer training its groups and taking its step, then a worker with the same id
    on a fresh source over the same prompts (a restarted process): the prompt ids each got admitted."""
    async def go():
        first = await run_until_window_full(address, ListPromptSource(prompt_list(indexed)))
        async with AsyncPacerClient(address, client_id="trainer") as trainer:
            trained = await trainer.collect(WINDOW, wait=RUN_TIMEOUT)  # out of the server: proposable again
            assert sorted(g.prompt_id for g in trained) == sorted(first)
            await trainer.reset("wait", wait=RUN_TIMEOUT, resume=True, weight_version=1)
        second = await run_until_window_full(address, ListPromptSource(prompt_list(indexed)))
        return first, second

    return asyncio.run(go())


def prompts_left(resumed: list[str]) -> list[int]:
    """The count each "prompt source resumed from the server's cursor (N prompts left, 0 restores)" line gives."""
    return [int(re.search(r"\((\d+) prompts left, 0 restores\)$", line).group(1)) for line in resumed]


def said(caplog, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("coda_worker") and r.levelno == level and text in r.getMessage()]


def test_a_restarted_worker_on_prompts_without_an_index_warns_at_once_that_it_runs_admitted_ones_again(server,
                                                                                                       caplog):
    caplog.set_level(logging.INFO, logger="coda_worker")
    first, second = restart_with(server.address, indexed=False)

    # What the warning says happens: the cursor cannot place these prompts, so the restarted worker proposes the
    # ones already trained, and the server admits them again.
    assert first == {"p0", "p1", "p2", "p3"} and second == first
    resumed = said(caplog, logging.INFO, "prompt source resumed from the server's cursor")
    assert prompts_left(resumed) == [PROMPTS, PROMPTS], resumed
    # Said at once, at each worker's start (each run its own source, as each process has), once each.
    warnings = said(caplog, logging.WARNING, UNTRACKED)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"ListPromptSource: {PROMPTS} of its {PROMPTS} prompts carry no index (nor a "
                                  "LoongSage-form id), e.g. 'p0', 'p1', 'p2', ..., so the server's prompt cursor "
                                  "cannot track them: a worker restarted on these prompts cannot skip those a "
                                  "Dispatch already admitted and runs them again"), warnings[0]
    assert warnings[0].endswith("Give each Prompt its epoch and index (its position in the epoch's order): "
                                "Prompt(prompt_id, input_ids, epoch=e, index=i)"), warnings[0]
    # At once: the first worker said it before its first Dispatch, long before any restart.
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("coda_worker")]
    first_dispatch = next(i for i, message in enumerate(messages) if ": dispatched " in message)
    assert messages.index(warnings[0]) < first_dispatch


def test_a_restarted_worker_on_indexed_prompts_skips_every_admitted_one_without_a_warning(server, caplog):
    caplog.set_level(logging.INFO, logger="coda_worker")
    first, second = restart_with(server.address, indexed=True)

    assert first == {"p0", "p1", "p2", "p3"} and second == {"p4", "p5", "p6", "p7"}  # none admitted twice
    resumed = said(caplog, logging.INFO, "prompt source resumed from the server's cursor")
    assert prompts_left(resumed) == [PROMPTS, PROMPTS - WINDOW], resumed
    warned = [r.getMessage() for r in caplog.records
              if r.name.startswith("coda_worker") and r.levelno >= logging.WARNING]
    assert warned == []


def test_the_warning_is_said_once_per_source_its_shards_and_restores_included(caplog):
    """Every worker sharing a source (or a shard of it) resumes it, at start and after each Restore: one warning,
    counting the prompts without an index among all of them (a LoongSage-form id is placed by the cursor)."""
    caplog.set_level(logging.WARNING, logger="coda_worker")
    source = ListPromptSource([Prompt(f"q{i}", [1], epoch=0, index=i) for i in range(4)]
                              + [Prompt("epoch0_ds0_prompt9", [1]), Prompt("loose", [1]), Prompt("other", [1])])
    shards = [source.shard(i, 2) for i in range(2)]
    for restores in (0, 1):
        for shard in shards:
            shard.resume_from(PromptCursor({}, restores))
    source.resume_from(PromptCursor({}, 2))
    warnings = said(caplog, logging.WARNING, UNTRACKED)
    assert len(warnings) == 1 and warnings[0].startswith(
        "ListPromptSource: 2 of its 7 prompts carry no index (nor a LoongSage-form id), e.g. 'loose', 'other', so "), \
        warnings
    # On a logger of its own under coda_worker's (the same handlers): a job can silence it alone.
    assert [(r.name, r.__dict__["fields"]) for r in caplog.records if UNTRACKED in r.getMessage()] == \
        [("coda_worker.prompts", {"untracked_prompts": 2, "prompts": 7})]

    indexed = ListPromptSource([Prompt(f"q{i}", [1], epoch=0, index=i) for i in range(4)]
                               + [Prompt("epoch3_prompt0", [1])])
    caplog.clear()
    assert indexed.resume_from(PromptCursor({(0, 0): (2, frozenset())}, 0)) == 3
    assert caplog.records == []


def test_two_prompts_at_one_index_are_refused_as_one_would_be_skipped_after_a_restart():
    with pytest.raises(ValueError, match=r"prompts 'p1' and 'p1-again' are both at ds_index 0, epoch 0, index 1: the "
                                         r"prompt cursor knows a prompt by these"):
        ListPromptSource([Prompt("p0", [1], index=0), Prompt("p1", [1], index=1),
                          Prompt("p1-again", [1], epoch=0, index=1)])
    with pytest.raises(ValueError, match=r"'p3' and 'epoch0_ds0_prompt3' are both at ds_index 0, epoch 0, index 3"):
        ListPromptSource([Prompt("p3", [1], epoch=0, index=3), Prompt("epoch0_ds0_prompt3", [1])])
    # Another epoch or data source is another place.
    assert len(ListPromptSource([Prompt("a", [1], epoch=0, index=1), Prompt("b", [1], epoch=1, index=1),
                                 Prompt("c", [1], ds_index=1, epoch=0, index=1)])) == 3
