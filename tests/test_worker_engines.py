"""The vLLM and SGLang adapters build the requests each engine's HTTP API documents and read its answers.

No network: httpx.MockTransport records every request and answers as the engine would (shapes taken from
vLLM 0.32's and SGLang's own source; see the adapter modules' docstrings).
"""
from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

httpx = pytest.importorskip("httpx", reason="the engine adapters need httpx (the test extra installs it)")

from coda_worker.engines import EngineError, FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from coda_worker.engines.sglang import SGLangEngine  # noqa: E402
from coda_worker.engines.vllm import VLLMEngine  # noqa: E402


class Recorder:
    """A MockTransport handler: records (method, path, query, json body) and answers from a table."""

    def __init__(self, answers: dict[str, httpx.Response]):
        self.answers = answers
        self.requests: list[tuple[str, str, dict, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, dict(request.url.params), body))
        return self.answers[request.url.path]


def run(coro):
    return asyncio.run(coro)


REQUEST = GenerationRequest("r-1", [1, 5, 9], 7, SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=20,
                                                                   stop_token_ids=(2,), seed=11,
                                                                   extra={"ignore_eos": True}))

VLLM_ANSWER = {
    "id": "cmpl-r-1", "object": "text_completion", "model": "tiny",
    "choices": [{"index": 0, "text": "abc", "finish_reason": "length",
                 "token_ids": [40, 41, 42], "logprobs": {"token_logprobs": [-0.5, -1.25, -2.0],
                                                         "tokens": ["a", "b", "c"], "text_offset": [0, 1, 2],
                                                         "top_logprobs": [{}, {}, {}]}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}


def vllm_engine(recorder: Recorder, **kwargs) -> VLLMEngine:
    return VLLMEngine("http://vllm.test:8000/", transport=httpx.MockTransport(recorder), **kwargs)


def test_vllm_completion_request_is_token_ids_with_logprobs_and_token_ids_returned():
    recorder = Recorder({"/v1/completions": httpx.Response(200, json=VLLM_ANSWER)})

    async def go():
        async with vllm_engine(recorder, model="tiny") as engine:
            return await engine.generate(REQUEST)

    generation = run(go())
    assert recorder.requests == [("POST", "/v1/completions", {}, {
        "prompt": [1, 5, 9], "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "logprobs": 0,
        "return_token_ids": True, "request_id": "r-1", "stream": False, "model": "tiny", "top_k": 20,
        "stop_token_ids": [2], "seed": 11, "ignore_eos": True,
    })]
    assert generation.token_ids == [40, 41, 42]
    assert generation.logprobs == [-0.5, -1.25, -2.0]
    assert generation.finish_reason is FinishReason.LENGTH and not generation.aborted


def test_vllm_aborted_answer_keeps_the_partial_tokens():
    answer = json.loads(json.dumps(VLLM_ANSWER))
    answer["choices"][0].update(finish_reason="abort", token_ids=[40], logprobs={"token_logprobs": [None]})
    recorder = Recorder({"/v1/completions": httpx.Response(200, json=answer)})

    async def go():
        async with vllm_engine(recorder) as engine:
            return await engine.generate(REQUEST)

    generation = run(go())
    assert generation.aborted and generation.token_ids == [40] and math.isnan(generation.logprobs[0])
    assert "model" not in recorder.requests[0][3]  # no model named: the server's only one


def test_vllm_abort_pause_resume_and_weight_version_requests():
    ok = httpx.Response(200, json={"status": "ok"})
    recorder = Recorder({"/abort_requests": ok, "/pause": ok, "/resume": ok, "/update_weight_version": ok})

    async def go():
        async with vllm_engine(recorder) as engine:
            await engine.abort(["r-1", "r-2"])
            await engine.abort([])  # nothing: an empty list would abort every request of the engine
            await engine.pause("wait")
            await engine.resume()
            await engine.update_weight_version(3)
            with pytest.raises(ValueError, match="abort, wait, keep"):
                await engine.pause("sideways")

    run(go())
    assert recorder.requests == [
        ("POST", "/abort_requests", {}, {"request_ids": ["cmpl-r-1-0", "cmpl-r-2-0"]}),
        ("POST", "/pause", {"mode": "wait"}, {}),
        ("POST", "/resume", {}, {}),
        ("POST", "/update_weight_version", {}, {"new_version": "3"}),
    ]


@pytest.mark.parametrize("response, message", [
    (httpx.Response(400, json={"error": {"message": "max_tokens too large"}}), "HTTP 400.*max_tokens too large"),
    (httpx.Response(200, text="<html>proxy</html>"), "not JSON"),
    (httpx.Response(200, json={"choices": [{"text": "no ids"}]}), "return_token_ids"),
])
def test_vllm_failures_are_engine_errors_that_say_what_came_back(response, message):
    recorder = Recorder({"/v1/completions": response})

    async def go():
        async with vllm_engine(recorder) as engine:
            await engine.generate(REQUEST)

    with pytest.raises(EngineError, match=message):
        run(go())


def test_unreachable_engine_is_an_engine_error_naming_the_call():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    async def go():
        async with VLLMEngine("http://vllm.test:1", transport=httpx.MockTransport(refuse)) as engine:
            await engine.generate(REQUEST)

    with pytest.raises(EngineError, match="POST /v1/completions failed: ConnectError"):
        run(go())


SGLANG_ANSWER = {
    "text": "abc", "output_ids": [40, 41, 42],
    "meta_info": {"id": "r-1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                  "completion_tokens": 3, "output_token_logprobs": [[-0.5, 40, None], [-1.25, 41, None],
                                                                    [-2.0, 42, None]]},
}


def sglang_engine(recorder: Recorder) -> SGLangEngine:
    return SGLangEngine("http://sglang.test:30000", transport=httpx.MockTransport(recorder))


def test_sglang_generate_request_is_input_ids_with_return_logprob():
    recorder = Recorder({"/generate": httpx.Response(200, json=SGLANG_ANSWER)})

    async def go():
        async with sglang_engine(recorder) as engine:
            return await engine.generate(REQUEST)

    generation = run(go())
    assert recorder.requests == [("POST", "/generate", {}, {
        "input_ids": [1, 5, 9],
        "sampling_params": {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                            "stop_token_ids": [2], "sampling_seed": 11, "ignore_eos": True},
        "rid": "r-1", "return_logprob": True, "stream": False,
    })]
    assert generation.token_ids == [40, 41, 42] and generation.logprobs == [-0.5, -1.25, -2.0]
    assert generation.finish_reason is FinishReason.STOP


def test_sglang_aborted_answer_keeps_the_partial_tokens():
    answer = json.loads(json.dumps(SGLANG_ANSWER))
    answer["meta_info"].update(finish_reason={"type": "abort", "message": "Abort by user"},
                               output_token_logprobs=[[-0.5, 40, None]])
    recorder = Recorder({"/generate": httpx.Response(200, json=answer)})

    async def go():
        async with sglang_engine(recorder) as engine:
            return await engine.generate(REQUEST)

    generation = run(go())
    assert generation.aborted and generation.token_ids == [40]


def test_sglang_abort_pause_and_continue_requests():
    ok = httpx.Response(200, json={"status": "ok"})
    recorder = Recorder({"/abort_request": httpx.Response(200), "/pause_generation": ok, "/continue_generation": ok})

    async def go():
        async with sglang_engine(recorder) as engine:
            await engine.abort(["r-1", "r-2"])
            await engine.pause("retract")
            await engine.resume()
            with pytest.raises(ValueError, match="abort, retract, in_place"):
                await engine.pause("wait")

    run(go())
    assert sorted(recorder.requests[:2], key=lambda r: r[3]["rid"]) == [
        ("POST", "/abort_request", {}, {"rid": "r-1", "abort_all": False}),
        ("POST", "/abort_request", {}, {"rid": "r-2", "abort_all": False}),
    ]
    assert recorder.requests[2:] == [("POST", "/pause_generation", {}, {"mode": "retract"}),
                                     ("POST", "/continue_generation", {}, {})]


def test_sglang_answer_without_logprobs_is_an_engine_error():
    recorder = Recorder({"/generate": httpx.Response(200, json={"text": "x", "meta_info": {}})})

    async def go():
        async with sglang_engine(recorder) as engine:
            await engine.generate(REQUEST)

    with pytest.raises(EngineError, match="return_logprob"):
        run(go())


class Sequenced(Recorder):
    """A Recorder whose answers for a path can be a list, handed out in order (the last one repeats)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, dict(request.url.params), body))
        answer = self.answers[request.url.path]
        if isinstance(answer, list):
            return answer.pop(0) if len(answer) > 1 else answer[0]
        return answer


def reset_answer(success: bool) -> httpx.Response:
    return httpx.Response(200, json={"success": success})


def test_vllm_weight_sync_waits_for_idle_reloads_resets_the_prefix_cache_and_confirms_the_version():
    recorder = Sequenced({
        # still draining once (aborted requests freeing their blocks), then idle; after the reload, idle
        "/reset_prefix_cache": [reset_answer(False), reset_answer(True), reset_answer(True)],
        "/collective_rpc": httpx.Response(200),  # reload_weights returns None: an empty answer
        "/update_weight_version": httpx.Response(200, json={"success": True, "new_version": "3"}),
        "/weight_info": httpx.Response(200, json={"weight_version": "3"}),
    })

    async def go():
        async with vllm_engine(recorder) as engine:
            return await engine.sync_weights("/ckpt/step-3", 3)

    assert run(go()) == 3
    assert recorder.requests == [
        ("POST", "/reset_prefix_cache", {}, {}),
        ("POST", "/reset_prefix_cache", {}, {}),
        ("POST", "/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-3"}}),
        ("POST", "/reset_prefix_cache", {}, {}),
        ("POST", "/update_weight_version", {}, {"new_version": "3"}),
        ("GET", "/weight_info", {}, None),
    ]


def test_vllm_weight_sync_is_refused_while_the_engine_runs_requests_and_nothing_is_reloaded():
    recorder = Sequenced({"/reset_prefix_cache": reset_answer(False), "/collective_rpc": httpx.Response(200)})

    async def go():
        async with vllm_engine(recorder) as engine:
            await engine.sync_weights("/ckpt/step-1", 1, drain_timeout=0.2)

    with pytest.raises(EngineError, match="refusing a weight sync: the engine still runs requests.*mix old and new"):
        run(go())
    assert {path for _, path, _, _ in recorder.requests} == {"/reset_prefix_cache"}


def test_weight_sync_is_refused_at_once_while_this_adapter_has_a_generate_call_running():
    release = asyncio.Event()
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/v1/completions":
            await release.wait()
            return httpx.Response(200, json=VLLM_ANSWER)
        return reset_answer(True)

    async def go():
        async with VLLMEngine("http://vllm.test:8000", transport=httpx.MockTransport(handler)) as engine:
            running = asyncio.create_task(engine.generate(REQUEST))
            for _ in range(200):  # bounded: until the call is on its way
                if engine.generating:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(EngineError, match="1 generate calls sent through this adapter are still running"):
                await engine.sync_weights("/ckpt", 1)
            release.set()
            await running
            assert engine.generating == 0

    run(go())
    assert seen == ["/v1/completions"]  # the refusal sent nothing


def test_vllm_weight_sync_fails_when_the_engine_reports_another_version():
    recorder = Sequenced({
        "/reset_prefix_cache": reset_answer(True), "/collective_rpc": httpx.Response(200),
        "/update_weight_version": httpx.Response(200, json={"success": True}),
        "/weight_info": httpx.Response(200, json={"weight_version": "default"}),  # vLLM before any update
    })

    async def go():
        async with vllm_engine(recorder) as engine:
            await engine.sync_weights("/ckpt", 4)

    with pytest.raises(EngineError, match="reports weight version None loaded after syncing 4"):
        run(go())


def test_sglang_weight_sync_updates_from_disk_with_the_version_and_flushes_the_cache():
    flushed = httpx.Response(200, text="Cache flushed.\nPlease check backend logs for more details.\n")
    busy = httpx.Response(400, text="Cache flushed.\n(When there are running or waiting requests, ...)\n")
    recorder = Sequenced({
        "/flush_cache": [busy, flushed, flushed],
        "/update_weights_from_disk": httpx.Response(200, json={
            "success": True, "message": "Succeeded to update model weights. Weight version updated to 5.",
            "num_paused_requests": 0}),
        "/get_weight_version": httpx.Response(200, json={"weight_version": "5"}),
    })

    async def go():
        async with sglang_engine(recorder) as engine:
            return await engine.sync_weights("/ckpt/step-5", 5)

    assert run(go()) == 5
    assert recorder.requests == [
        ("POST", "/flush_cache", {}, {}),
        ("POST", "/flush_cache", {}, {}),
        ("POST", "/update_weights_from_disk", {}, {"model_path": "/ckpt/step-5", "weight_version": "5"}),
        ("POST", "/flush_cache", {}, {}),
        ("GET", "/get_weight_version", {}, None),
    ]


def test_sglang_weight_sync_refusals_say_why():
    busy = httpx.Response(400, text="(When there are running or waiting requests, ...)")
    recorder = Sequenced({"/flush_cache": busy})

    async def go(engine_recorder, **kwargs):
        async with sglang_engine(engine_recorder) as engine:
            await engine.sync_weights("/ckpt", 2, **kwargs)

    with pytest.raises(EngineError, match="refusing a weight sync: the engine still runs or queues requests"):
        run(go(recorder, drain_timeout=0.2))
    assert {path for _, path, _, _ in recorder.requests} == {"/flush_cache"}

    failed = Sequenced({"/flush_cache": httpx.Response(200, text="ok"), "/update_weights_from_disk": httpx.Response(
        400, json={"success": False, "message": "Failed to get weights iterator", "num_paused_requests": 0})})
    with pytest.raises(EngineError, match="update_weights_from_disk answered HTTP 400.*Failed to get weights"):
        run(go(failed))


def test_sampling_params_refuse_bad_values_with_what_is_allowed():
    with pytest.raises(ValueError, match="max_tokens 0 must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p 1.5 must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)


def test_calls_in_flight_are_spread_over_connection_pools_of_at_most_16():
    """One httpx pool scans all its connections on every call; the adapter keeps pools small and fills the
    one with the most room, so 40 calls in flight on max_connections=40 sit 16, 16 and 8 to a pool."""
    arrived = []

    async def go():
        release = asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            arrived.append(request)
            await release.wait()
            return httpx.Response(200, json=VLLM_ANSWER)

        async with VLLMEngine("http://vllm.test:8000", transport=httpx.MockTransport(handler),
                              max_connections=40) as engine:
            calls = [asyncio.create_task(engine.generate(REQUEST)) for _ in range(40)]
            for _ in range(1000):
                if len(arrived) == 40:
                    break
                await asyncio.sleep(0.005)
            in_flight = sorted(engine._pool_calls)
            release.set()
            answers = await asyncio.gather(*calls)
        return in_flight, answers

    in_flight, answers = run(go())
    assert len(arrived) == 40 and in_flight == [8, 16, 16]
    assert all(a.token_ids == [40, 41, 42] for a in answers)


def test_max_connections_below_one_is_refused():
    with pytest.raises(ValueError, match="max_connections 0 must be >= 1"):
        VLLMEngine("http://vllm.test:8000", max_connections=0)


@pytest.mark.parametrize("adapter", [VLLMEngine, SGLangEngine])
@pytest.mark.parametrize("base_url, message", [
    ("localhost:8000", "base_url 'localhost:8000' must be the engine server's URL with its scheme"),
    ("", "base_url '' must be the engine server's URL with its scheme"),
    ("http://localhost:8000/v1", "base_url 'http://localhost:8000/v1' is the OpenAI API's base; give the server's "
                                 "root (without /v1), e.g. http://localhost:8000"),
])
def test_a_base_url_no_request_could_reach_is_refused_when_the_adapter_is_made(adapter, base_url, message):
    """Without a scheme every call failed with httpx's "unsupported protocol"; with the OpenAI base (/v1), which an
    OpenAI client is given, every request went to /v1/v1/... and each trajectory failed on a 404."""
    with pytest.raises(ValueError, match=re.escape(f"{adapter.__name__}: {message}")):
        adapter(base_url)


def test_a_base_url_under_a_path_prefix_is_kept():
    assert VLLMEngine("http://gateway.test/engines/vllm-0/").base_url == "http://gateway.test/engines/vllm-0"


def test_the_http_adapters_import_from_the_kit_itself_on_first_use():
    import coda_worker
    from coda_worker.engines import SGLangEngine, VLLMEngine

    assert (coda_worker.VLLMEngine, coda_worker.SGLangEngine) == (VLLMEngine, SGLangEngine)
    assert "VLLMEngine" not in coda_worker.__all__  # `import *` must not need httpx
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchEngine'"):
        coda_worker.NoSuchEngine  # noqa: B018
