"""vLLM's OpenAI-compatible server as a rollout engine: token-id completions, abort, pause and resume.

Checked against vLLM 0.32 (`vllm/entrypoints/openai/completion/protocol.py` and `serving.py`,
`vllm/entrypoints/rl/online/api_router.py`):

* `POST /v1/completions` takes the prompt as a list of token ids; `return_token_ids: true` puts the
  generated ids in `choices[0].token_ids`, and `logprobs: 0` the sampled tokens' log-probabilities in
  `choices[0].logprobs.token_logprobs`. The body's `request_id` names the request: the engine tracks it
  as `cmpl-<request_id>-0` (one prompt, `n` = 1), the id `/abort_requests` takes.
* An aborted request still answers, with the tokens generated so far and `finish_reason: "abort"`.
* `POST /abort_requests {"request_ids": [...]}` aborts those requests without pausing the scheduler;
  `POST /pause?mode=abort|wait|keep` and `POST /resume` pause and resume the whole engine;
  `POST /update_weight_version {"new_version": "..."}` records the weight version. These control routes
  exist only when the server runs with `VLLM_SERVER_DEV_MODE=1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._http import HttpEngine, shape_error
from .base import FinishReason, Generation, GenerationRequest

__all__ = ["VLLMEngine"]

PAUSE_MODES = ("abort", "wait", "keep")


class VLLMEngine(HttpEngine):
    """An AsyncEngine over a vLLM server (`python -m vllm.entrypoints.openai.api_server`).

    model: the served model name (None: the server's only model).
    """

    def __init__(self, base_url: str, *, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.model = model

    def completion_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body of `POST /v1/completions` for one request."""
        sampling = request.sampling
        body: dict[str, Any] = {
            "prompt": list(request.input_ids),
            "max_tokens": request.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,  # the sampled token's log-probability, no alternatives
            "return_token_ids": True,
            "request_id": request.request_id,
            "stream": False,
        }
        if self.model is not None:
            body["model"] = self.model
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        body.update(sampling.extra)
        return body

    @staticmethod
    def engine_request_id(request_id: str) -> str:
        """The id vLLM tracks a single-prompt completion under, as `/abort_requests` wants it."""
        return f"cmpl-{request_id}-0"

    def parse_completion(self, answer: Any) -> Generation:
        """A Generation from a `/v1/completions` answer."""
        try:
            choice = answer["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs_block = choice.get("logprobs") or {}
            raw_logprobs = logprobs_block.get("token_logprobs") or []
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise shape_error(self, f"no choices[0].token_ids ({exc!r}); is return_token_ids supported?",
                              answer) from exc
        # vLLM reports None for a logprob it could not compute (it never does for sampled tokens); keep the
        # arrays aligned instead of failing the whole trajectory.
        logprobs = [float("nan") if value is None else float(value) for value in raw_logprobs]
        return Generation(token_ids, logprobs, FinishReason.parse(choice.get("finish_reason")))

    async def generate(self, request: GenerationRequest) -> Generation:
        """Runs one completion; an aborted one returns its partial tokens with FinishReason.ABORT."""
        answer = await self._post("/v1/completions", self.completion_body(request), generate=True)
        return self.parse_completion(answer)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts these requests (by the worker's ids); unknown or finished ones are ignored by vLLM."""
        if not request_ids:  # an empty list would abort every request of the engine
            return
        await self._post("/abort_requests", {"request_ids": [self.engine_request_id(r) for r in request_ids]})

    async def pause(self, mode: str = "abort") -> None:
        """Pauses the whole engine: "abort" in-flight requests, "wait" for them, or "keep" them frozen."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown vLLM pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        await self._post("/pause", params={"mode": mode})

    async def resume(self) -> None:
        """Resumes a paused engine."""
        await self._post("/resume")

    async def update_weight_version(self, version: int | str) -> None:
        """Tells the engine which weight version it serves (reported in its metrics and `/weight_info`)."""
        await self._post("/update_weight_version", {"new_version": str(version)})
