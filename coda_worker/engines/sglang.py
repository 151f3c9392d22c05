"""SGLang's native HTTP server as a rollout engine: token-id generation, abort, pause and continue.

Checked against SGLang's source (`python/sglang/srt/entrypoints/http_server.py`,
`managers/io_struct.py`, `sampling/sampling_params.py`):

* `POST /generate` takes `input_ids`, `sampling_params` (`max_new_tokens`, `temperature`, `top_p`,
  `top_k`, `stop_token_ids`, `sampling_seed`), `rid` (the request id) and `return_logprob`. The answer's
  `meta_info.output_token_logprobs` lists `[logprob, token_id, text]` for every generated token and
  `meta_info.finish_reason.type` is "stop", "length" or "abort"; an aborted request answers with the
  tokens generated until the abort.
* `POST /abort_request {"rid": ..., "abort_all": false}` aborts one request.
* `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}` pauses the scheduler (older versions
  take no body) and `POST /continue_generation` resumes it.
* Weight sync from disk: `POST /update_weights_from_disk {"model_path": DIR, "weight_version": "v"}`
  (`UpdateWeightFromDiskReqInput`) loads the weights in DIR and records the version; it answers
  `{"success", "message", "num_paused_requests"}`, HTTP 400 when it failed. Its tokenizer manager takes
  the model-update writer lock, so it waits for running requests rather than mixing weights under them.
  `GET|POST /flush_cache` empties the radix cache: HTTP 200, or 400 "when there are running or waiting
  requests" (a text answer, not JSON). `GET /get_weight_version` answers `{"weight_version": ...}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ._http import DEFAULT_DRAIN_TIMEOUT_SECONDS, HttpEngine, shape_error
from .base import EngineError, FinishReason, Generation, GenerationRequest

__all__ = ["SGLangEngine"]

PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangEngine(HttpEngine):
    """An AsyncEngine over an SGLang server (`python -m sglang.launch_server`)."""

    def generate_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body of `POST /generate` for one request."""
        sampling = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        params.update(sampling.extra)
        return {
            "input_ids": list(request.input_ids),
            "sampling_params": params,
            "rid": request.request_id,
            "return_logprob": True,
            "stream": False,
        }

    def parse_generate(self, answer: Any) -> Generation:
        """A Generation from a `/generate` answer."""
        if isinstance(answer, list) and len(answer) == 1:  # a batch of one
            answer = answer[0]
        try:
            meta = answer["meta_info"]
            entries = meta["output_token_logprobs"]
            token_ids = [int(entry[1]) for entry in entries]
            logprobs = [float("nan") if entry[0] is None else float(entry[0]) for entry in entries]
            finish = meta.get("finish_reason") or {}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise shape_error(self, f"no meta_info.output_token_logprobs ({exc!r}); was return_logprob sent?",
                              answer) from exc
        return Generation(token_ids, logprobs, FinishReason.parse(finish.get("type") if isinstance(finish, dict)
                                                                  else finish))

    async def generate(self, request: GenerationRequest) -> Generation:
        """Runs one generation; an aborted one returns its partial tokens with FinishReason.ABORT."""
        answer = await self._post("/generate", self.generate_body(request), generate=True)
        return self.parse_generate(answer)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts these requests; SGLang takes one id per call, so they go out together."""
        await asyncio.gather(*(self._post("/abort_request", {"rid": rid, "abort_all": False})
                               for rid in request_ids))

    async def pause(self, mode: str = "abort") -> None:
        """Pauses the scheduler: "abort" running requests, "retract" them to the queue, or keep them "in_place"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown SGLang pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Continues a paused scheduler."""
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> bool:
        """Empties the radix cache; False while requests are running or waiting (then nothing was flushed)."""
        response = await self._send("POST", "/flush_cache")
        if response.status_code == 200:
            return True
        if response.status_code == 400:
            return False
        raise EngineError(f"{self!r}: POST /flush_cache answered HTTP {response.status_code}: {response.text[:300]}")

    async def update_weights_from_disk(self, weights_path: str, version: int | str | None = None) -> None:
        """Loads the weights in `weights_path` (and records `version` with them); raises when SGLang refuses."""
        body: dict[str, Any] = {"model_path": str(weights_path)}
        if version is not None:
            body["weight_version"] = str(version)
        answer = await self._post("/update_weights_from_disk", body)
        if not isinstance(answer, dict) or not answer.get("success"):
            raise EngineError(f"{self!r}: /update_weights_from_disk did not load {weights_path}: {str(answer)[:300]}")

    async def loaded_weight_version(self) -> int | None:
        """The weight version the engine reports loaded (`GET /get_weight_version`); None while it reports none
        that is an integer (the server's `--weight-version` defaults to "default")."""
        return await self._reported_weight_version("/get_weight_version")

    async def sync_weights(self, weights_path: str, version: int, *,
                           drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_SECONDS) -> int:
        """Loads the weights saved in `weights_path` as weight version `version`, while generation is paused.

        Refuses (EngineError, saying why) while requests generate: at once for requests sent through this
        adapter, after `drain_timeout` seconds for the engine's (the cache flush fails while any request
        runs or waits). Then loads, flushes the radix cache and returns the version the engine reports.
        """
        self._refuse_sync_while_generating()
        await self._until_idle(
            self.flush_cache, drain_timeout,
            "refusing a weight sync: the engine still runs or queues requests (POST /flush_cache answers 400 "
            "while it does); pause generation first (Reset with ABORT), then sync, then Resume")
        await self.update_weights_from_disk(weights_path, version)
        await self._until_idle(
            self.flush_cache, drain_timeout,
            "the radix cache could not be flushed after the weight update: a request started during the sync, "
            "and the cache holds KV computed under the old weights")
        return await self._confirm_loaded(version)
