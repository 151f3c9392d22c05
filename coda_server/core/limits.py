"""The server's bounds on requests and held state (`Limits`), read from the `server.*` configuration once."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .settings import default_server_values

# Request ids (client-made, e.g. UUIDs) and lease ids (server-made) may always be this long, whatever max_id_length.
OPAQUE_ID_MIN_LIMIT = 128
# Answers carrying trajectories (Collect, Reset) are in every snapshot: enough for retries, small enough to write.
DATA_ANSWERS_KEPT = 16


# Limits field -> its server.* key. Every default is the schema's (settings.py), nowhere else.
SERVER_KEYS = {
    "max_id_length": "max_id_length",
    "max_candidates": "max_dispatch_candidates",
    "max_trajectories": "max_submit_trajectories",
    "max_collect": "max_collect_groups",
    "remembered_generations": "remembered_generations",
    "step_reports_kept": "step_reports_kept",
    "incidents_kept": "incidents_kept",
    "answers_kept": "request_id_cache_size",
    "inflight_lease_seconds": "inflight_lease_seconds",
    "worker_liveness_seconds": "worker_liveness_seconds",
    "trainer_liveness_seconds": "trainer_liveness_seconds",
    "max_buffered_groups": "max_buffered_groups",
    "max_held_bytes": "max_held_bytes",
    "remembered_answer_bytes": "remembered_answer_bytes",
    "max_message_bytes": "max_message_bytes",
    "abort_wait_seconds": "abort_wait_seconds",
    "collect_stall_warning_seconds": "collect_stall_warning_seconds",
}


_SECONDS = ("inflight_lease_seconds", "worker_liveness_seconds", "trainer_liveness_seconds", "abort_wait_seconds",
            "collect_stall_warning_seconds")


@dataclass(frozen=True)
class Limits:
    """Every `server.*` bound the pacing core enforces; built once per Pacer by `Limits.from_config`."""

    max_id_length: int  # prompt and trajectory ids
    max_opaque_id_length: int  # request and lease ids: never below OPAQUE_ID_MIN_LIMIT (a UUID must fit)
    max_candidates: int  # per Dispatch
    max_trajectories: int  # per Submit
    max_collect: int  # groups per Collect
    remembered_generations: int  # Reset generations whose prompt ids are told apart from unknown ones
    step_reports_kept: int
    incidents_kept: int  # for GetState's recent_incidents
    answers_kept: int  # request-id answers kept per method (request_id_cache_size)
    data_answers_kept: int  # the same for Collect and Reset, whose answers carry trajectories
    inflight_lease_seconds: float  # 0: running groups never expire
    worker_liveness_seconds: float  # a watched worker silent this long loses its running groups; 0: off
    trainer_liveness_seconds: float  # a trainer silent this long loses its leases that end with silence; 0: off
    max_buffered_groups: int  # 0: unbounded
    max_held_bytes: int  # 0: unbounded
    remembered_answer_bytes: int  # trajectory bytes of remembered Collect and Reset answers; 0: only the count bounds
    max_message_bytes: int  # the largest message the server sends or takes (gRPC's limit, both ways)
    abort_wait_seconds: float  # an ABORT-mode Reset without a wait waits this long for the partial trajectories
    collect_stall_warning_seconds: float  # a Collect waiting this long while dispatch admits nothing is logged

    @classmethod
    def from_config(cls, config: Any) -> "Limits":
        """The limits of a configuration; a key it lacks (or a configuration without `server`) gets its
        declared default (settings.py)."""
        server = config.get("server") or {}
        defaults = shipped_server_defaults()
        values = {name: server.get(key, defaults[key]) for name, key in SERVER_KEYS.items()}
        if values["trainer_liveness_seconds"] is None:  # null: the workers' grace, one setting for both as before
            values["trainer_liveness_seconds"] = values["worker_liveness_seconds"]
        numbers: dict[str, Any] = {name: float(value) if name in _SECONDS else int(value)
                                   for name, value in values.items()}
        return cls(max_opaque_id_length=max(numbers["max_id_length"], OPAQUE_ID_MIN_LIMIT),
                   data_answers_kept=min(numbers["answers_kept"], DATA_ANSWERS_KEPT), **numbers)

    def answer_bytes(self, caller_limit: int = 0) -> int:
        """The largest answer a caller may be sent: what it says it can receive (0: not said), within the
        server's own max_message_bytes."""
        if caller_limit > 0:
            return min(caller_limit, self.max_message_bytes) if self.max_message_bytes else caller_limit
        return self.max_message_bytes

    @classmethod
    def shipped(cls) -> "Limits":
        """The limits of the shipped defaults."""
        return cls.from_config({})


@functools.lru_cache(maxsize=1)
def shipped_server_defaults() -> Mapping[str, Any]:
    """The declared defaults of the `server` keys (settings.py), by name under `server`."""
    return MappingProxyType(default_server_values())
