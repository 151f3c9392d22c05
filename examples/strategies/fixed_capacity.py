"""The seed guide's minimal example strategy, unchanged but for its import line: at most B groups running or buffered."""
from coda_server import SlidingWindowStrategy, register_sliding_window_strategy


@register_sliding_window_strategy("fixed-capacity")
class FixedCapacityStrategy(SlidingWindowStrategy):
    def __init__(self, config):
        super().__init__()
        self._capacity = int(config.data_sources[0].num_prompts_per_step)

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        return max(0, self._capacity - self._running_count - buf_qsize)
