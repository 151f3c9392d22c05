"""FakeEngine (the worker kit's engine without a GPU) and Generation's inputs."""
from __future__ import annotations

import asyncio
import statistics

import numpy as np
import pytest

import coda_worker
from coda_worker.engines import FakeEngine, FinishReason, Generation, GenerationRequest, SamplingParams, ServedEngine
from coda_worker.engines.base import AsyncEngine

SAMPLING = SamplingParams(max_tokens=4096)


def request(request_id: str, max_tokens: int = 4096) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], max_tokens, SAMPLING)


def run(coro):
    return asyncio.run(coro)


def test_generation_takes_numpy_arrays_and_the_engines_words():
    generation = Generation(np.array([5, 6, 7], dtype=np.int64), np.array([-0.5, -1.0, -2.0], dtype=np.float32),
                            "length")
    assert generation.token_ids == [5, 6, 7] and all(type(t) is int for t in generation.token_ids)
    assert generation.logprobs == [-0.5, -1.0, -2.0]
    assert generation.finish_reason is FinishReason.LENGTH
    assert Generation(np.array([1]), np.array([]), FinishReason.STOP).logprobs == []


def test_fake_engine_is_exported_and_every_shipped_engine_satisfies_the_protocols():
    from coda_worker.engines import SGLangEngine, VLLMEngine

    assert coda_worker.FakeEngine is FakeEngine
    for engine in (FakeEngine(), VLLMEngine("http://127.0.0.1:1"), SGLangEngine("http://127.0.0.1:1")):
        assert isinstance(engine, AsyncEngine) and isinstance(engine, ServedEngine), type(engine).__name__


def test_fake_engine_is_reproducible_per_seed_and_request_id():
    async def draw(seed: int) -> list[list[int]]:
        engine = FakeEngine(seed=seed, seconds_per_token=0, first_token_seconds=0)
        # concurrently, so the arrival order does not decide what a request gets
        answers = await asyncio.gather(*(engine.generate(request(f"r{i}")) for i in range(8)))
        return [a.token_ids for a in answers]

    first, again, other = run(draw(3)), run(draw(3)), run(draw(4))
    assert first == again
    assert first != other


def test_fake_engine_lengths_have_a_heavy_tail_and_respect_max_tokens():
    async def lengths(engine: FakeEngine, max_tokens: int) -> list[Generation]:
        return [await engine.generate(request(f"r{i}", max_tokens)) for i in range(400)]

    heavy = run(lengths(FakeEngine(seed=1, mean_tokens=50, seconds_per_token=0, first_token_seconds=0), 100000))
    sizes = [len(g.token_ids) for g in heavy]
    assert max(sizes) > 4 * statistics.median(sizes)  # sigma 1.0: the top 1 in 20 is >5x the median
    assert all(g.finish_reason is FinishReason.STOP for g in heavy)
    flat = run(lengths(FakeEngine(seed=1, mean_tokens=50, length_sigma=0, seconds_per_token=0,
                                  first_token_seconds=0), 30))
    assert {len(g.token_ids) for g in flat} == {30}
    assert {g.finish_reason for g in flat} == {FinishReason.LENGTH}


def test_fake_engine_abort_answers_with_the_partial_tokens():
    async def scenario() -> tuple[Generation, Generation]:
        # A full response would take 30 s: the abort ends it long before.
        engine = FakeEngine(seed=0, mean_tokens=3000, length_sigma=0, first_token_seconds=0.0,
                            seconds_per_token=0.01)
        reference = FakeEngine(seed=0, mean_tokens=3000, length_sigma=0, first_token_seconds=0.0,
                               seconds_per_token=0)
        task = asyncio.create_task(engine.generate(request("slow")))
        for _ in range(500):
            if engine.running:
                break
            await asyncio.sleep(0.01)
        await engine.abort(["unknown-id"])  # ignored, as vLLM ignores it
        await asyncio.sleep(0.1)
        assert not task.done()
        await engine.abort(["slow"])
        partial = await asyncio.wait_for(task, 5)
        return partial, await reference.generate(request("slow"))

    partial, full = run(scenario())
    assert partial.finish_reason is FinishReason.ABORT
    assert 0 < len(partial.token_ids) < len(full.token_ids) == 3000
    assert partial.token_ids == full.token_ids[:len(partial.token_ids)]  # the same response, cut
    assert len(partial.logprobs) == len(partial.token_ids)


def test_fake_engine_scripted_tokens_in_request_order_cut_to_the_budget():
    async def scenario() -> list[Generation]:
        engine = FakeEngine(script=[[7, 8, 9], [1, 2, 3, 4, 5]], seconds_per_token=0, first_token_seconds=0)
        return [await engine.generate(request(f"r{i}", max_tokens=4)) for i in range(3)]

    a, b, c = run(scenario())
    assert (a.token_ids, a.finish_reason) == ([7, 8, 9], FinishReason.STOP)
    assert (b.token_ids, b.finish_reason) == ([1, 2, 3, 4], FinishReason.LENGTH)
    assert c.token_ids == [7, 8, 9]
    by_prompt = FakeEngine(script=lambda r: list(r.input_ids)[::-1], seconds_per_token=0, first_token_seconds=0)
    assert run(by_prompt.generate(request("x"))).token_ids == [3, 2, 1]


def test_fake_engine_records_the_weight_version_and_closes_with_async_with():
    async def scenario() -> FakeEngine:
        async with FakeEngine() as engine:
            await engine.update_weight_version(3)
        return engine

    assert run(scenario()).weight_version == 3


@pytest.mark.parametrize("bad", [dict(mean_tokens=0), dict(length_sigma=-1), dict(seconds_per_token=-1),
                                 dict(vocab_size=0)])
def test_fake_engine_refuses_bad_settings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        FakeEngine(**bad)
