"""The server's bounds on requests and held state (`Limits`), read from the `server.*` configuration once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Request ids (client-made, e.g. UUIDs) and lease ids (server-made) may always be this long, whatever max_id_length.
OPAQUE_ID_MIN_LIMIT = 128
# Answers carrying trajectories (Collect, Reset) are in every snapshot: enough for retries, small enough to write.
DATA_ANSWERS_KEPT = 16


@dataclass(frozen=True)
class Limits:
    """Every `server.*` bound the pacing core enforces; built once per Pacer by `Limits.from_config`."""

    max_id_length: int = 512  # prompt and trajectory ids
    max_opaque_id_length: int = 512  # request and lease ids: never below OPAQUE_ID_MIN_LIMIT (a UUID must fit)
    max_candidates: int = 65536  # per Dispatch
    max_trajectories: int = 65536  # per Submit
    max_collect: int = 65536  # groups per Collect
    remembered_generations: int = 16  # Reset generations whose prompt ids are told apart from unknown ones
    step_reports_kept: int = 32
    incidents_kept: int = 32  # for GetState's recent_incidents
    answers_kept: int = 65536  # request-id answers kept per method (request_id_cache_size)
    data_answers_kept: int = DATA_ANSWERS_KEPT  # the same for Collect and Reset, whose answers carry trajectories
    inflight_lease_seconds: float = 0.0  # 0: running groups never expire
    max_buffered_groups: int = 0  # 0: unbounded
    max_held_bytes: int = 0  # 0: unbounded

    @classmethod
    def from_config(cls, config: Any) -> "Limits":
        """The limits of a (validated) configuration; a configuration without `server` gets the defaults."""
        server = config.get("server") or {}
        defaults = cls()
        max_id_length = int(server.get("max_id_length", defaults.max_id_length))
        answers_kept = int(server.get("request_id_cache_size", defaults.answers_kept))
        return cls(
            max_id_length=max_id_length,
            max_opaque_id_length=max(max_id_length, OPAQUE_ID_MIN_LIMIT),
            max_candidates=int(server.get("max_dispatch_candidates", defaults.max_candidates)),
            max_trajectories=int(server.get("max_submit_trajectories", defaults.max_trajectories)),
            max_collect=int(server.get("max_collect_groups", defaults.max_collect)),
            remembered_generations=int(server.get("remembered_generations", defaults.remembered_generations)),
            step_reports_kept=int(server.get("step_reports_kept", defaults.step_reports_kept)),
            incidents_kept=int(server.get("incidents_kept", defaults.incidents_kept)),
            answers_kept=answers_kept,
            data_answers_kept=min(answers_kept, DATA_ANSWERS_KEPT),
            inflight_lease_seconds=float(server.get("inflight_lease_seconds", 0) or 0),
            max_buffered_groups=int(server.get("max_buffered_groups", 0) or 0),
            max_held_bytes=int(server.get("max_held_bytes", 0) or 0),
        )
