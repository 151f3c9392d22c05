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
  `POST /update_weight_version {"new_version": "..."}` records the weight version and `GET /weight_info`
  answers `{"weight_version": ...}` (null before any update). These control routes exist only when the
  server runs with `VLLM_SERVER_DEV_MODE=1`.
* Weight sync from disk (`vllm/entrypoints/serve/dev/rpc/api_router.py`, `dev/cache/api_router.py`):
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` has every model
  worker reload its weights in place from the safetensors in DIR (the GPU model runner's
  `reload_weights(weights_path=...)`). It does not wait for running requests: a reload under them mixes
  old and new weights within their responses. `POST /reset_prefix_cache` answers `{"success": false}`
  while requests hold KV blocks and `{"success": true}` once it emptied the prefix cache; without it a
  repeated prefix (a continued trajectory resends prompt + partial response) reuses KV computed under the
  old weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._http import DEFAULT_DRAIN_TIMEOUT_SECONDS, HttpEngine, shape_error
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

    async def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache; False while requests still hold KV blocks (then nothing was reset)."""
        answer = await self._post("/reset_prefix_cache")
        if not isinstance(answer, dict) or "success" not in answer:
            raise shape_error(self, "no success in the /reset_prefix_cache answer", answer)
        return bool(answer["success"])

    async def reload_weights(self, weights_path: str) -> None:
        """Has every model worker reload its weights from the safetensors in `weights_path` (a directory the
        engine can read). Only call it with nothing generating: `sync_weights` checks that, this does not."""
        await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})

    async def loaded_weight_version(self) -> int | None:
        """The weight version the engine reports loaded (`GET /weight_info`); None while it reports none that is an
        integer (vLLM says "default" before any update)."""
        return await self._reported_weight_version("/weight_info")

    async def sync_weights(self, weights_path: str, version: int, *,
                           drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_SECONDS) -> int:
        """Loads the weights saved in `weights_path` as weight version `version`, while generation is paused.

        Refuses (EngineError, saying why) while requests generate: at once for requests sent through this
        adapter, after `drain_timeout` seconds for the engine's (the prefix-cache reset fails while any
        request holds KV blocks). Then reloads, empties the prefix cache (KV computed under the old weights
        must not be reused), records the version and returns the version the engine reports loaded.
        """
        self._refuse_sync_while_generating()
        await self._until_idle(
            self.reset_prefix_cache, drain_timeout,
            "refusing a weight sync: the engine still runs requests (POST /reset_prefix_cache answers success: "
            "false while requests hold KV blocks), and reloading under them would mix old and new weights "
            "within their responses; pause generation first (Reset with ABORT), then sync, then Resume")
        await self.reload_weights(weights_path)
        await self._until_idle(
            self.reset_prefix_cache, drain_timeout,
            "the prefix cache could not be emptied after the reload: a request started during the sync, and "
            "the cache holds KV computed under the old weights")
        await self.update_weight_version(version)
        return await self._confirm_loaded(version)
