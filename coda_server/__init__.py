"""coda rollout pacing service: the server package and its plugin API for custom strategies."""
from .core import (
    BufferReplayStrategy,
    GroupFilter,
    Pacer,
    SlidingWindowStrategy,
    TrajectoryStatus,
    create_strategy,
    load_config,
    register_buffer_replay_strategy,
    register_group_filter,
    register_sliding_window_strategy,
)

__all__ = [
    "BufferReplayStrategy",
    "GroupFilter",
    "Pacer",
    "SlidingWindowStrategy",
    "TrajectoryStatus",
    "create_strategy",
    "load_config",
    "register_buffer_replay_strategy",
    "register_group_filter",
    "register_sliding_window_strategy",
]
