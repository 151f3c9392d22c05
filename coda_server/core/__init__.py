"""The pacing core: pure Python (no grpc), embeddable in-process by tests, the simulator and users."""
from .builtin_strategies import NoWindowStrategy, WindowedFifoStrategy, WindowGatedStrategy
from .latency_aware import LatencyAwareStrategy
from .config import default_config_path, load_config, validate_config
from .errors import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    PacerError,
    ResetInProgressError,
    ResourceExhaustedError,
    ShuttingDownError,
    StaleGenerationError,
    UnknownPromptError,
)
from .filters import GroupFilter, register_group_filter
from .pacer import Pacer
from .replay import BufferReplayStrategy, register_buffer_replay_strategy
from .shares import BatchShape
from .strategy import SlidingWindowStrategy, create_strategy, register_sliding_window_strategy
from .types import (
    ControlEvent,
    ControlEventType,
    PromptRef,
    ResetMode,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

__all__ = [name for name in dir() if not name.startswith("_")]
