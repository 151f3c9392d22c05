from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrajectoryStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAJECTORY_STATUS_UNSPECIFIED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_COMPLETED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_FAILED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ABORTED: _ClassVar[TrajectoryStatus]

class ResetMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESET_MODE_UNSPECIFIED: _ClassVar[ResetMode]
    RESET_MODE_ABORT: _ClassVar[ResetMode]
    RESET_MODE_WAIT: _ClassVar[ResetMode]

class ControlEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_EVENT_TYPE_UNSPECIFIED: _ClassVar[ControlEventType]
    CONTROL_EVENT_TYPE_STATE: _ClassVar[ControlEventType]
    CONTROL_EVENT_TYPE_PAUSE: _ClassVar[ControlEventType]
    CONTROL_EVENT_TYPE_RESUME: _ClassVar[ControlEventType]
    CONTROL_EVENT_TYPE_SHUTDOWN: _ClassVar[ControlEventType]
    CONTROL_EVENT_TYPE_JOB_ENDED: _ClassVar[ControlEventType]
TRAJECTORY_STATUS_UNSPECIFIED: TrajectoryStatus
TRAJECTORY_STATUS_COMPLETED: TrajectoryStatus
TRAJECTORY_STATUS_FAILED: TrajectoryStatus
TRAJECTORY_STATUS_ABORTED: TrajectoryStatus
RESET_MODE_UNSPECIFIED: ResetMode
RESET_MODE_ABORT: ResetMode
RESET_MODE_WAIT: ResetMode
CONTROL_EVENT_TYPE_UNSPECIFIED: ControlEventType
CONTROL_EVENT_TYPE_STATE: ControlEventType
CONTROL_EVENT_TYPE_PAUSE: ControlEventType
CONTROL_EVENT_TYPE_RESUME: ControlEventType
CONTROL_EVENT_TYPE_SHUTDOWN: ControlEventType
CONTROL_EVENT_TYPE_JOB_ENDED: ControlEventType

class PromptRef(_message.Message):
    __slots__ = ("prompt_id", "ds_index", "epoch", "index")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    DS_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    ds_index: int
    epoch: int
    index: int
    def __init__(self, prompt_id: _Optional[str] = ..., ds_index: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "prompt_id", "ds_index", "status", "reward", "token_ids", "logprobs", "loss_mask", "start_weight_version", "end_weight_version", "num_turns", "metadata", "payload", "segment_lengths", "segment_weight_versions")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    DS_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    START_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    END_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    prompt_id: str
    ds_index: int
    status: TrajectoryStatus
    reward: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    start_weight_version: int
    end_weight_version: int
    num_turns: int
    metadata: _containers.ScalarMap[str, str]
    payload: bytes
    segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    segment_weight_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, trajectory_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., ds_index: _Optional[int] = ..., status: _Optional[_Union[TrajectoryStatus, str]] = ..., reward: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., start_weight_version: _Optional[int] = ..., end_weight_version: _Optional[int] = ..., num_turns: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., payload: _Optional[bytes] = ..., segment_lengths: _Optional[_Iterable[int]] = ..., segment_weight_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("prompt_id", "seq", "ds_index", "epoch", "index", "trajectories")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DS_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    seq: int
    ds_index: int
    epoch: int
    index: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, prompt_id: _Optional[str] = ..., seq: _Optional[int] = ..., ds_index: _Optional[int] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class DispatchRequest(_message.Message):
    __slots__ = ("candidates", "wait_seconds", "request_id", "max_continuations", "loaded_weight_version", "max_response_bytes")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    LOADED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[PromptRef]
    wait_seconds: float
    request_id: str
    max_continuations: int
    loaded_weight_version: int
    max_response_bytes: int
    def __init__(self, candidates: _Optional[_Iterable[_Union[PromptRef, _Mapping]]] = ..., wait_seconds: _Optional[float] = ..., request_id: _Optional[str] = ..., max_continuations: _Optional[int] = ..., loaded_weight_version: _Optional[int] = ..., max_response_bytes: _Optional[int] = ...) -> None: ...

class AdmittedPrompt(_message.Message):
    __slots__ = ("prompt_id", "seq")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    seq: int
    def __init__(self, prompt_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class DispatchResponse(_message.Message):
    __slots__ = ("admitted", "paused", "step", "weight_version", "generation", "running", "buffered", "capacity", "remaining", "continuations", "job_ended")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    admitted: _containers.RepeatedCompositeFieldContainer[AdmittedPrompt]
    paused: bool
    step: int
    weight_version: int
    generation: int
    running: int
    buffered: int
    capacity: int
    remaining: int
    continuations: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    job_ended: bool
    def __init__(self, admitted: _Optional[_Iterable[_Union[AdmittedPrompt, _Mapping]]] = ..., paused: _Optional[bool] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., generation: _Optional[int] = ..., running: _Optional[int] = ..., buffered: _Optional[int] = ..., capacity: _Optional[int] = ..., remaining: _Optional[int] = ..., continuations: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., job_ended: _Optional[bool] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("trajectories", "request_id", "dispatch_seqs")
    class DispatchSeqsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_SEQS_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    request_id: str
    dispatch_seqs: _containers.ScalarMap[str, int]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., request_id: _Optional[str] = ..., dispatch_seqs: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "groups_completed")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    groups_completed: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., groups_completed: _Optional[int] = ...) -> None: ...

class CollectRequest(_message.Message):
    __slots__ = ("num_groups", "wait_seconds", "allow_partial", "request_id", "lease_seconds", "rank", "world_size", "token_budget", "trainer_step", "max_response_bytes", "release_when_silent", "held_lease_ids", "named_at_grant", "run")
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_WHEN_SILENT_FIELD_NUMBER: _ClassVar[int]
    HELD_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMED_AT_GRANT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    wait_seconds: float
    allow_partial: bool
    request_id: str
    lease_seconds: float
    rank: int
    world_size: int
    token_budget: int
    trainer_step: int
    max_response_bytes: int
    release_when_silent: bool
    held_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    named_at_grant: bool
    run: str
    def __init__(self, num_groups: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., allow_partial: _Optional[bool] = ..., request_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., token_budget: _Optional[int] = ..., trainer_step: _Optional[int] = ..., max_response_bytes: _Optional[int] = ..., release_when_silent: _Optional[bool] = ..., held_lease_ids: _Optional[_Iterable[str]] = ..., named_at_grant: _Optional[bool] = ..., run: _Optional[str] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: int
    def __init__(self, groups: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: int
    def __init__(self, groups: _Optional[int] = ...) -> None: ...

class CollectResponse(_message.Message):
    __slots__ = ("groups", "timed_out", "lease_id", "cut_to_fit", "other_shapes_waiting")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CUT_TO_FIT_FIELD_NUMBER: _ClassVar[int]
    OTHER_SHAPES_WAITING_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    timed_out: bool
    lease_id: str
    cut_to_fit: bool
    other_shapes_waiting: _containers.RepeatedCompositeFieldContainer[CollectShape]
    def __init__(self, groups: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., timed_out: _Optional[bool] = ..., lease_id: _Optional[str] = ..., cut_to_fit: _Optional[bool] = ..., other_shapes_waiting: _Optional[_Iterable[_Union[CollectShape, _Mapping]]] = ...) -> None: ...

class CollectShape(_message.Message):
    __slots__ = ("world_size", "num_groups", "token_budget")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    num_groups: int
    token_budget: int
    def __init__(self, world_size: _Optional[int] = ..., num_groups: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("mode", "wait_seconds", "resume", "weight_version", "request_id", "max_response_bytes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    mode: ResetMode
    wait_seconds: float
    resume: bool
    weight_version: int
    request_id: str
    max_response_bytes: int
    def __init__(self, mode: _Optional[_Union[ResetMode, str]] = ..., wait_seconds: _Optional[float] = ..., resume: _Optional[bool] = ..., weight_version: _Optional[int] = ..., request_id: _Optional[str] = ..., max_response_bytes: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("restored", "dropped_prompt_ids", "pause_delay_seconds", "generation", "step", "weight_version", "paused", "report", "expired", "quarantined", "kept_prompt_ids", "cut_to_fit")
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    KEPT_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CUT_TO_FIT_FIELD_NUMBER: _ClassVar[int]
    restored: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    dropped_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    pause_delay_seconds: float
    generation: int
    step: int
    weight_version: int
    paused: bool
    report: StepReport
    expired: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    quarantined: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    kept_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    cut_to_fit: bool
    def __init__(self, restored: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., dropped_prompt_ids: _Optional[_Iterable[str]] = ..., pause_delay_seconds: _Optional[float] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., paused: _Optional[bool] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ..., expired: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., quarantined: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., kept_prompt_ids: _Optional[_Iterable[str]] = ..., cut_to_fit: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("prompt_ids", "dispatch_seqs", "loaded_weight_version", "lease_ids")
    class DispatchSeqsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_SEQS_FIELD_NUMBER: _ClassVar[int]
    LOADED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    dispatch_seqs: _containers.ScalarMap[str, int]
    loaded_weight_version: int
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ..., dispatch_seqs: _Optional[_Mapping[str, int]] = ..., loaded_weight_version: _Optional[int] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("renewed", "unknown_prompt_ids", "lease_seconds", "liveness_seconds", "ended_lease_ids")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    unknown_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    liveness_seconds: float
    ended_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, renewed: _Optional[int] = ..., unknown_prompt_ids: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ..., liveness_seconds: _Optional[float] = ..., ended_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("weight_version", "request_id")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    request_id: str
    def __init__(self, weight_version: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("step", "weight_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("running", "buffered", "queued_trajectories", "capacity", "window_size", "step", "weight_version", "generation", "paused", "resetting", "strategy", "dispatched", "submitted", "collected", "consumed", "filtered", "restored", "dropped", "stale_rejected", "duplicates", "config_summary", "waiting_calls", "recent_reports", "expired", "redelivered", "reclaimed", "leased", "held_bytes", "quarantined", "recent_incidents", "restored_kept", "rolled_back", "reinstated", "checkpoints", "restores", "last_checkpoint_step", "last_checkpoint_weight_version", "last_restore_step", "last_restore_weight_version", "job_ended", "prompts_per_step", "group_sizes", "mini_batch_size", "stale_steps", "collect_limit", "restored_kept_oldest_seconds", "state_dir_problem")
    class ConfigSummaryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESETTING_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    WAITING_CALLS_FIELD_NUMBER: _ClassVar[int]
    RECENT_REPORTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    RECENT_INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_KEPT_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    REINSTATED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STALE_STEPS_FIELD_NUMBER: _ClassVar[int]
    COLLECT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_KEPT_OLDEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIR_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    running: int
    buffered: int
    queued_trajectories: int
    capacity: int
    window_size: int
    step: int
    weight_version: int
    generation: int
    paused: bool
    resetting: bool
    strategy: str
    dispatched: int
    submitted: int
    collected: int
    consumed: int
    filtered: int
    restored: int
    dropped: int
    stale_rejected: int
    duplicates: int
    config_summary: _containers.ScalarMap[str, str]
    waiting_calls: int
    recent_reports: _containers.RepeatedCompositeFieldContainer[StepReport]
    expired: int
    redelivered: int
    reclaimed: int
    leased: int
    held_bytes: int
    quarantined: int
    recent_incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    restored_kept: int
    rolled_back: int
    reinstated: int
    checkpoints: int
    restores: int
    last_checkpoint_step: int
    last_checkpoint_weight_version: int
    last_restore_step: int
    last_restore_weight_version: int
    job_ended: bool
    prompts_per_step: int
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    mini_batch_size: int
    stale_steps: float
    collect_limit: int
    restored_kept_oldest_seconds: float
    state_dir_problem: str
    def __init__(self, running: _Optional[int] = ..., buffered: _Optional[int] = ..., queued_trajectories: _Optional[int] = ..., capacity: _Optional[int] = ..., window_size: _Optional[int] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., generation: _Optional[int] = ..., paused: _Optional[bool] = ..., resetting: _Optional[bool] = ..., strategy: _Optional[str] = ..., dispatched: _Optional[int] = ..., submitted: _Optional[int] = ..., collected: _Optional[int] = ..., consumed: _Optional[int] = ..., filtered: _Optional[int] = ..., restored: _Optional[int] = ..., dropped: _Optional[int] = ..., stale_rejected: _Optional[int] = ..., duplicates: _Optional[int] = ..., config_summary: _Optional[_Mapping[str, str]] = ..., waiting_calls: _Optional[int] = ..., recent_reports: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ..., expired: _Optional[int] = ..., redelivered: _Optional[int] = ..., reclaimed: _Optional[int] = ..., leased: _Optional[int] = ..., held_bytes: _Optional[int] = ..., quarantined: _Optional[int] = ..., recent_incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., restored_kept: _Optional[int] = ..., rolled_back: _Optional[int] = ..., reinstated: _Optional[int] = ..., checkpoints: _Optional[int] = ..., restores: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., last_checkpoint_weight_version: _Optional[int] = ..., last_restore_step: _Optional[int] = ..., last_restore_weight_version: _Optional[int] = ..., job_ended: _Optional[bool] = ..., prompts_per_step: _Optional[int] = ..., group_sizes: _Optional[_Iterable[int]] = ..., mini_batch_size: _Optional[int] = ..., stale_steps: _Optional[float] = ..., collect_limit: _Optional[int] = ..., restored_kept_oldest_seconds: _Optional[float] = ..., state_dir_problem: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("max_response_bytes",)
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_response_bytes: int
    def __init__(self, max_response_bytes: _Optional[int] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint", "step", "weight_version", "buffered_groups", "kept_groups", "in_flight_prompts", "trajectory_bytes")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KEPT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bytes
    step: int
    weight_version: int
    buffered_groups: int
    kept_groups: int
    in_flight_prompts: int
    trajectory_bytes: int
    def __init__(self, checkpoint: _Optional[bytes] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., buffered_groups: _Optional[int] = ..., kept_groups: _Optional[int] = ..., in_flight_prompts: _Optional[int] = ..., trajectory_bytes: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("checkpoint", "request_id")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bytes
    request_id: str
    def __init__(self, checkpoint: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("step", "weight_version", "generation", "discarded_groups", "discarded_trajectories", "discarded_newer_trajectories", "dropped_running", "reinstated_groups", "kept_groups", "reoffered_prompts", "checkpoint_taken_at", "discarded_prompt_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_NEWER_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REINSTATED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KEPT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REOFFERED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    generation: int
    discarded_groups: int
    discarded_trajectories: int
    discarded_newer_trajectories: int
    dropped_running: int
    reinstated_groups: int
    kept_groups: int
    reoffered_prompts: int
    checkpoint_taken_at: float
    discarded_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., generation: _Optional[int] = ..., discarded_groups: _Optional[int] = ..., discarded_trajectories: _Optional[int] = ..., discarded_newer_trajectories: _Optional[int] = ..., dropped_running: _Optional[int] = ..., reinstated_groups: _Optional[int] = ..., kept_groups: _Optional[int] = ..., reoffered_prompts: _Optional[int] = ..., checkpoint_taken_at: _Optional[float] = ..., discarded_prompt_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPromptCursorRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PromptCursor(_message.Message):
    __slots__ = ("marks", "restores")
    MARKS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    marks: _containers.RepeatedCompositeFieldContainer[CursorMark]
    restores: int
    def __init__(self, marks: _Optional[_Iterable[_Union[CursorMark, _Mapping]]] = ..., restores: _Optional[int] = ...) -> None: ...

class CursorMark(_message.Message):
    __slots__ = ("ds_index", "epoch", "below", "above")
    DS_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    ABOVE_FIELD_NUMBER: _ClassVar[int]
    ds_index: int
    epoch: int
    below: int
    above: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ds_index: _Optional[int] = ..., epoch: _Optional[int] = ..., below: _Optional[int] = ..., above: _Optional[_Iterable[int]] = ...) -> None: ...

class Incident(_message.Message):
    __slots__ = ("kind", "prompt_id", "strategy", "hook", "message", "step", "generation", "action")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    HOOK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    kind: str
    prompt_id: str
    strategy: str
    hook: str
    message: str
    step: int
    generation: int
    action: str
    def __init__(self, kind: _Optional[str] = ..., prompt_id: _Optional[str] = ..., strategy: _Optional[str] = ..., hook: _Optional[str] = ..., message: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., action: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "pipeline_buf_size", "filter_drop", "partial_ratio", "partial_span_max", "partial_restored_count", "partial_dropped_incomplete_count", "pause_delay", "partial_restored_group_count", "partial_dropped_incomplete_group_count")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_BUF_SIZE_FIELD_NUMBER: _ClassVar[int]
    FILTER_DROP_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_RATIO_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SPAN_MAX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_RESTORED_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_DROPPED_INCOMPLETE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DELAY_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_RESTORED_GROUP_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_DROPPED_INCOMPLETE_GROUP_COUNT_FIELD_NUMBER: _ClassVar[int]
    step: int
    pipeline_buf_size: int
    filter_drop: int
    partial_ratio: float
    partial_span_max: int
    partial_restored_count: int
    partial_dropped_incomplete_count: int
    pause_delay: float
    partial_restored_group_count: int
    partial_dropped_incomplete_group_count: int
    def __init__(self, step: _Optional[int] = ..., pipeline_buf_size: _Optional[int] = ..., filter_drop: _Optional[int] = ..., partial_ratio: _Optional[float] = ..., partial_span_max: _Optional[int] = ..., partial_restored_count: _Optional[int] = ..., partial_dropped_incomplete_count: _Optional[int] = ..., pause_delay: _Optional[float] = ..., partial_restored_group_count: _Optional[int] = ..., partial_dropped_incomplete_group_count: _Optional[int] = ...) -> None: ...

class WatchControlRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlEvent(_message.Message):
    __slots__ = ("type", "mode", "weight_version", "step", "generation", "paused", "restores", "job_ended")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    type: ControlEventType
    mode: ResetMode
    weight_version: int
    step: int
    generation: int
    paused: bool
    restores: int
    job_ended: bool
    def __init__(self, type: _Optional[_Union[ControlEventType, str]] = ..., mode: _Optional[_Union[ResetMode, str]] = ..., weight_version: _Optional[int] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., paused: _Optional[bool] = ..., restores: _Optional[int] = ..., job_ended: _Optional[bool] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ("mode", "wait_seconds", "request_id")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    mode: ResetMode
    wait_seconds: float
    request_id: str
    def __init__(self, mode: _Optional[_Union[ResetMode, str]] = ..., wait_seconds: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ("mode", "waited_seconds", "buffered_prompt_ids", "leased", "held_prompt_ids", "in_flight_prompt_ids", "kept_prompt_ids", "expired_prompt_ids", "quarantined_prompt_ids", "state")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    HELD_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    mode: ResetMode
    waited_seconds: float
    buffered_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    leased: int
    held_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    in_flight_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    kept_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    expired_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    quarantined_prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    state: GetStateResponse
    def __init__(self, mode: _Optional[_Union[ResetMode, str]] = ..., waited_seconds: _Optional[float] = ..., buffered_prompt_ids: _Optional[_Iterable[str]] = ..., leased: _Optional[int] = ..., held_prompt_ids: _Optional[_Iterable[str]] = ..., in_flight_prompt_ids: _Optional[_Iterable[str]] = ..., kept_prompt_ids: _Optional[_Iterable[str]] = ..., expired_prompt_ids: _Optional[_Iterable[str]] = ..., quarantined_prompt_ids: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[GetStateResponse, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("client_id", "max_groups_per_worker")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    max_groups_per_worker: int
    def __init__(self, client_id: _Optional[str] = ..., max_groups_per_worker: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHoldings]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerHoldings, _Mapping]]] = ...) -> None: ...

class WorkerHoldings(_message.Message):
    __slots__ = ("client_id", "running", "oldest_held_seconds", "groups", "loaded_weight_version", "leased", "lease_ids", "last_heard_seconds", "watch_streams")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    OLDEST_HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LOADED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WATCH_STREAMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    running: int
    oldest_held_seconds: float
    groups: _containers.RepeatedCompositeFieldContainer[HeldGroup]
    loaded_weight_version: int
    leased: int
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    last_heard_seconds: float
    watch_streams: int
    def __init__(self, client_id: _Optional[str] = ..., running: _Optional[int] = ..., oldest_held_seconds: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[HeldGroup, _Mapping]]] = ..., loaded_weight_version: _Optional[int] = ..., leased: _Optional[int] = ..., lease_ids: _Optional[_Iterable[str]] = ..., last_heard_seconds: _Optional[float] = ..., watch_streams: _Optional[int] = ...) -> None: ...

class HeldGroup(_message.Message):
    __slots__ = ("prompt_id", "seq", "ds_index", "held_seconds", "trajectories", "group_size", "lease_remaining_seconds")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DS_INDEX_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    seq: int
    ds_index: int
    held_seconds: float
    trajectories: int
    group_size: int
    lease_remaining_seconds: float
    def __init__(self, prompt_id: _Optional[str] = ..., seq: _Optional[int] = ..., ds_index: _Optional[int] = ..., held_seconds: _Optional[float] = ..., trajectories: _Optional[int] = ..., group_size: _Optional[int] = ..., lease_remaining_seconds: _Optional[float] = ...) -> None: ...
