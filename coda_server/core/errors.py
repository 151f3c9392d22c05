"""Typed errors of the pacing core; the transport maps each class to one status code."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence


class PacerError(Exception):
    """Base of every error the pacer raises on purpose; the state is unchanged when one is raised."""

    reason: str = "PACER_ERROR"

    def __init__(self, message: str, *, violations: Sequence[tuple[str, str]] = (), reason: Optional[str] = None):
        super().__init__(message)
        self.message = message
        # (field path, what was wrong and what is allowed), one per offending field.
        self.violations: list[tuple[str, str]] = list(violations)
        if reason is not None:
            self.reason = reason


class InvalidArgumentError(PacerError):
    """Malformed request, bad value, or a duplicate id with different content."""

    reason = "INVALID_ARGUMENT"


def refused(call: str, undone: str, violations: Sequence[tuple[str, str]]) -> InvalidArgumentError:
    """The INVALID_ARGUMENT refusing `call` for `violations` (field path, problem), every one in the details: its
    message reads "<call> refused, nothing <undone>: <field> <problem>" for the first, so that a reader of the
    message alone learns which field is wrong, and how many more there are."""
    field, problem = violations[0]
    more = len(violations) - 1
    also = f" ({more} more field violation{'s' if more > 1 else ''} in the details)" if more else ""
    return InvalidArgumentError(f"{call} refused, nothing {undone}: {field} {problem}{also}", violations=violations)


class UnknownPromptError(PacerError):
    """A trajectory names a prompt that was never dispatched (or is too old to remember)."""

    reason = "UNKNOWN_PROMPT"


class FailedPreconditionError(PacerError):
    """The request is well-formed but the pacer's state does not allow it now."""

    reason = "FAILED_PRECONDITION"


class StaleGenerationError(FailedPreconditionError):
    """A trajectory belongs to a prompt dispatched before the last Reset or Restore."""

    reason = "STALE_GENERATION"


class LeaseExpiredError(FailedPreconditionError):
    """A lease ran out: late Submits for a reclaimed group, or an Ack after the groups went back."""

    reason = "LEASE_EXPIRED"


class StaleDispatchError(FailedPreconditionError):
    """A Submit fenced with a dispatch the server no longer holds: the group was released from its worker
    (lease or liveness) and handed out again under a new dispatch seq."""

    reason = "STALE_DISPATCH"


class UnknownLeaseError(PacerError):
    """An Ack or Release names a lease the server does not know: never granted, already acknowledged, or ended
    (ran out, released) longer ago than the server remembers ended leases."""

    reason = "UNKNOWN_LEASE"


class MessageTooLargeError(FailedPreconditionError):
    """The oldest buffered group alone is larger than the answer the caller can receive: nothing was taken."""

    reason = "MESSAGE_TOO_LARGE"

    def __init__(self, prompt_id: str, size: int, limit: int):
        super().__init__(
            f"Collect refused, nothing taken: group {prompt_id!r} needs an answer of {size} bytes, over the "
            f"{limit} bytes the caller can receive; raise the client's max_message_bytes (its "
            f"grpc.max_receive_message_length) and server.max_message_bytes to at least {size} to collect it",
            violations=[("num_groups", f"group {prompt_id!r} alone is {size} bytes, over the limit {limit}")])
        self.size = size
        self.limit = limit


class ResetInProgressError(FailedPreconditionError):
    """A second Reset (or a Resume) arrived while a Reset runs."""

    reason = "RESET_IN_PROGRESS"


class JobEndedError(FailedPreconditionError):
    """EndJob ended the job: a Reset or Resume has no next step to open."""

    reason = "JOB_ENDED"


class ResourceExhaustedError(PacerError):
    """A cap is full; retry after `retry_after` seconds. `metadata` names the cap (ErrorInfo metadata)."""

    reason = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: Optional[str] = None,
                 metadata: Optional[Mapping[str, str]] = None):
        super().__init__(message, reason=reason)
        self.retry_after = retry_after
        self.metadata: dict[str, str] = dict(metadata or {})


class NotReadyError(PacerError):
    """The server is still recovering its state; retry shortly."""

    reason = "RECOVERING"


class StateDirUnwritableError(NotReadyError):
    """The journal cannot write (a full disk, a read-only or failing volume): nothing is applied until it can
    again; the server retries the write by itself. Retry after `retry_after` seconds."""

    reason = "STATE_DIR_UNWRITABLE"

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(PacerError):
    """The pacer is shutting down and takes no new work."""

    reason = "SHUTTING_DOWN"


class DirtyGroupError(FailedPreconditionError):
    """Groups holding a FAILED trajectory were refused (no `status` filter): the trainer's Collect reports it."""

    reason = "DIRTY_GROUP"


class StrategyHookError(PacerError):
    """A strategy (or filter) hook raised; the message names the strategy and the hook. Maps to INTERNAL."""

    reason = "STRATEGY_HOOK_FAILED"

    def __init__(self, message: str, *, strategy: str = "", hook: str = ""):
        super().__init__(message)
        self.strategy = strategy
        self.hook = hook


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key, the value and what is allowed."""


def not_built(subject: str, what: str, exc: BaseException, remedy: str) -> ConfigError:
    """The one-line start-up refusal of a plugin (`what`: the strategy, a filter) whose __init__ raised `exc`."""
    problem = " ".join(str(exc).split()) or "(no message)"
    return ConfigError(f"{subject}: {what} could not be built: its __init__ raised {type(exc).__name__}: {problem}; "
                       f"{remedy}")


class RecoveryError(RuntimeError):
    """Start-up cannot rebuild the state kept in server.state_dir (e.g. it was written under another
    pacing configuration); the server must not serve a state that differs from the one it acknowledged."""
