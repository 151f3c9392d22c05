"""The vLLM and SGLang adapters build the requests each engine's HTTP API documents and read its answers.

No network: httpx.MockTransport records every request and answers as the engine would (shapes taken from
vLLM 0.32's and SGLang's own source; see the adapter modules' docstrings).
"""
from __future__ import annotations

import asyncio
import json
import math

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


def test_sampling_params_refuse_bad_values_with_what_is_allowed():
    with pytest.raises(ValueError, match="max_tokens 0 must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p 1.5 must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
