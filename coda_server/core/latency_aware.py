"""The built-in `latency-aware` strategy: windowed-fifo that goes quiet in the tail of each training step."""
from __future__ import annotations

from typing import Any, Sequence

from .builtin_strategies import WindowedFifoStrategy
from .strategy import register_sliding_window_strategy


@register_sliding_window_strategy("latency-aware")
class LatencyAwareStrategy(WindowedFifoStrategy):
    """Dispatch and collect like windowed-fifo, but admit nothing new once the trainer has taken the step's
    B groups, until the next Resume.

    A group started in that tail runs on weights that are about to be replaced: with partial rollout
    (ABORT) it is aborted moments later and continued on the next weights, one version staler and with its
    first tokens masked; in WAIT mode the step boundary waits for it to finish. Starting it after the
    Resume costs only the slots left idle while the trainer trains its last mini-batch.

    `fully_async.latency_aware.quiet_after` (default 1.0): go quiet once this share of B has been consumed
    in the step (1.0 = after the last mini-batch was taken; lower goes quiet earlier).
    """

    ordered_gate = True  # windowed-fifo's gate, unchanged

    def __init__(self, config: Any):
        super().__init__(config)
        fully_async = getattr(config, "fully_async", None)
        options = (fully_async.get("latency_aware", None) if hasattr(fully_async, "get")
                   else getattr(fully_async, "latency_aware", None))
        if options is None:
            share = 1.0
        else:
            share = float(options.get("quiet_after", 1.0) if hasattr(options, "get")
                          else getattr(options, "quiet_after", 1.0))
        if not 0.0 < share <= 1.0:
            raise ValueError(f"fully_async.latency_aware.quiet_after = {share}: must be in (0, 1]")
        self._quiet_at = max(1, int(round(share * self._batch_size)))
        self._consumed_in_step = 0
        self.quiet_since: float | None = None  # pacer-clock time the current quiet tail began (for metrics)

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        if self._consumed_in_step >= self._quiet_at:
            return 0
        return super().compute_dispatch_count(buf_qsize)

    def on_consumed(self, groups: Sequence[Any]) -> None:
        self._consumed_in_step += len(groups)
        if self._consumed_in_step >= self._quiet_at and self.quiet_since is None:
            self.quiet_since = self.now()

    def on_resume(self, weight_version: int) -> None:
        self._consumed_in_step = 0
        self.quiet_since = None
