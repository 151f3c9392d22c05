"""coda rollout pacing service: the server package and its plugin API for custom strategies."""
try:
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
except ModuleNotFoundError as missing:  # the plain distribution is the client; the server is an extra
    from coda_client.commands import exit_if_run_as_module

    exit_if_run_as_module(missing)
    raise ModuleNotFoundError(f"{missing.msg}: coda-server needs the server's packages: "
                              f"pip install 'coda-pacer[server]'", name=missing.name) from missing

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
