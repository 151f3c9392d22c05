"""Trainer checkpoints of the pacer: what a Checkpoint call exports, its versioned blob, and what a Restore does.

A trainer that saves its model at step k takes a pacer checkpoint beside it; after a crash (or a deliberate
rollback) it restores that checkpoint, and the pacer continues from k as if the steps after it had never
run. `Checkpoints` is built by the Pacer over the owners a checkpoint reads and a Restore changes, passed
explicitly; it keeps when the last checkpoint was taken and restored. The blob is the journal's encoding
(journal.dumps: pickled plain data, trajectories in the transport's own bytes through the codec) behind a
magic line, a format number and (from format 2) the SHA-256 digest of that body. A Restore reads it only
whole and intact: the digest must match and the decoded checkpoint must have every field of the shape `take`
writes (`validate`), before anything changes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import struct
from numbers import Integral, Real
import threading
import time
from typing import Any, Mapping, Optional

from .answers import AnswerBook
from .buffer import PipelineBuffer
from .clock import PacerClock
from .collector import Collector
from .cursor import PromptCursor
from .errors import FailedPreconditionError, InvalidArgumentError, JobEndedError, ResetInProgressError
from .incidents import HOOK_FAILED, HookFailures, describe_exception
from .inflight import HeldBytes, InflightTable, bytes_of
from .job_end import Lifecycle
from .journal import TrajectoryCodec, dumps, loads
from .leases import Leases
from .replay import RestoredGroups
from .signals import Signals
from .steps import StepBoundary
from .types import ControlEventType, ResetMode, RestoreResult, Trajectory, TrajectoryGroup, TrajectoryStatus

log = logging.getLogger("coda_server.checkpoints")

CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: as the versions before the digest wrote it (read, and validated, all the same)
MAGIC = b"coda-pacer checkpoint\n"
_HEADER = struct.Struct(">I")  # the format number, after the magic line
# SHA-256, the same on every server (xxhash is optional there) and a few tens of ms for 64 MiB: a checkpoint is rare.
_DIGEST_BYTES = hashlib.sha256().digest_size
# What a Restore of bytes that are not a whole checkpoint is told to send instead, in terms of the RPCs.
_PASS_THE_BLOB = "pass the bytes an earlier Checkpoint call returned (its `checkpoint` field), unchanged"


class CheckpointFormatError(InvalidArgumentError):
    """The blob is not a pacer checkpoint, or one of a format this version does not read."""

    reason = "CHECKPOINT_FORMAT"


class CheckpointMismatchError(FailedPreconditionError):
    """The checkpoint was taken under other pacing settings (another job's configuration)."""

    reason = "CHECKPOINT_MISMATCH"


# ------------------------------------------------------------------ the blob


def encode_parts(checkpoint: dict[str, Any], codec: TrajectoryCodec) -> tuple[bytes, bytes]:
    """The opaque blob in two parts, to be sent one after the other: (magic line, format number and the digest
    of the body; the body, the journal's encoding of the checkpoint). Two parts: the answer copies each once."""
    body = dumps(checkpoint, codec)
    return MAGIC + _HEADER.pack(CHECKPOINT_FORMAT) + hashlib.sha256(body).digest(), body


def encode(checkpoint: dict[str, Any], codec: TrajectoryCodec) -> bytes:
    """The opaque blob: magic line, format number, digest of the body, then the body."""
    return b"".join(encode_parts(checkpoint, codec))


def decode(blob: bytes, codec: TrajectoryCodec) -> dict[str, Any]:
    """The checkpoint in `blob`, validated; CheckpointFormatError (changing nothing) when it is not one this
    version reads, whole and intact."""
    # The messages say what is wrong in terms of the RPCs, for a caller in any language: never the decoder's own
    # words (a Python exception's), which the server log keeps.
    if not isinstance(blob, (bytes, bytearray, memoryview)) or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CheckpointFormatError("Restore refused, nothing changed: checkpoint holds bytes that are not a pacer "
                                    f"checkpoint (they do not begin as one); {_PASS_THE_BLOB}",
                                    violations=[("checkpoint", "must be a blob taken by Checkpoint")])
    blob = memoryview(blob)
    start = len(MAGIC) + _HEADER.size
    if len(blob) < start:
        raise _undecodable("it ends inside its header")
    (found,) = _HEADER.unpack_from(blob, len(MAGIC))
    if found not in READABLE_FORMATS:
        raise CheckpointFormatError(f"Restore refused, nothing changed: checkpoint is in format {found}, this server "
                                    f"reads formats {' and '.join(map(str, READABLE_FORMATS))}; restore it with the "
                                    f"coda-server version that took it",
                                    violations=[("checkpoint", f"format must be {CHECKPOINT_FORMAT} or older")])
    if found >= 2:  # format 1 carries no digest: only the validation below stands between it and the state
        if len(blob) < start + _DIGEST_BYTES:
            raise _undecodable("it ends inside its header")
        recorded, start = bytes(blob[start:start + _DIGEST_BYTES]), start + _DIGEST_BYTES
        if hashlib.sha256(blob[start:]).digest() != recorded:
            log.info("Restore refused: the checkpoint blob's digest does not match its %d bytes", len(blob))
            raise CheckpointFormatError(
                "Restore refused, nothing changed: checkpoint is damaged (its digest does not match: bytes were "
                f"changed, cut or added since Checkpoint returned it); {_PASS_THE_BLOB}",
                violations=[("checkpoint", "must be a blob taken by Checkpoint, unchanged")])
    try:
        checkpoint = loads(blob[start:], codec)
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != found:
            raise ValueError("its body is not a checkpoint record of its format")
    except Exception as exc:
        raise _undecodable(f"{type(exc).__name__}: {exc}") from None
    validate(checkpoint)
    return checkpoint


def _undecodable(cause: str) -> CheckpointFormatError:
    """The refusal of a blob that begins as a checkpoint but does not decode; `cause`, the decoder's words, is
    logged, not sent."""
    log.info("Restore refused: the checkpoint blob does not decode (%s)", cause)
    return CheckpointFormatError(
        "Restore refused, nothing changed: checkpoint holds bytes that are not a checkpoint this server wrote (they "
        f"do not decode: truncated, damaged or of another format); {_PASS_THE_BLOB}",
        violations=[("checkpoint", "must be a blob taken by Checkpoint, unchanged")])


# ------------------------------------------------------------------ what a checkpoint must hold

_KEYS = frozenset({"format", "config", "step", "weight_version", "generation", "taken_at", "buffer", "kept",
                   "quarantined", "in_flight", "cursor", "strategy"})
_OPTIONAL_KEYS = frozenset({"paused"})  # absent from the first format-1 checkpoints: not paused
_GROUP_FIELDS = frozenset(f.name for f in dataclasses.fields(TrajectoryGroup))
# A trajectory pickled as it is (in-process) may carry its content key, built once (Trajectory.prepare_content_key).
_TRAJECTORY_FIELDS = frozenset(f.name for f in dataclasses.fields(Trajectory)) | {"_content_key"}


class _Invalid(Exception):
    """What is wrong with a decoded checkpoint, in its own terms (validate turns it into CheckpointFormatError)."""


def validate(checkpoint: Any) -> None:
    """Refuse (CheckpointFormatError, changing nothing) anything but a whole checkpoint of the shape `take`
    writes: a damaged one must be refused before the Restore changes anything, not fail half-way through it or
    leave the state holding what every later call trips over."""
    try:
        _check_checkpoint(checkpoint)
    except _Invalid as exc:
        log.info("Restore refused: the checkpoint does not hold what Checkpoint writes (%s)", exc)
        raise CheckpointFormatError(
            f"Restore refused, nothing changed: checkpoint is not a whole pacer checkpoint ({exc}); {_PASS_THE_BLOB}",
            violations=[("checkpoint", "must be a blob taken by Checkpoint, unchanged")]) from None


def _require(holds: bool, what: str) -> None:
    if not holds:
        raise _Invalid(what)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Numbers as an in-process caller may have given them (a NumPy integer for an index), but no bool.
def _is_int(value: Any, minimum: Optional[int] = None) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_sequence(value: Any, length: Optional[int] = None) -> bool:
    return isinstance(value, (list, tuple)) and (length is None or len(value) == length)


def _check_checkpoint(checkpoint: Any) -> None:
    _require(isinstance(checkpoint, dict), "it is not a record of named fields")
    keys = set(checkpoint)
    missing = _KEYS - keys
    _require(not missing, f"it lacks {', '.join(sorted(missing))}")
    unknown = keys - _KEYS - _OPTIONAL_KEYS
    _require(not unknown, f"it has fields no checkpoint has: {', '.join(sorted(map(_short, unknown)))}")
    _require(checkpoint["format"] in READABLE_FORMATS, f"format {_short(checkpoint['format'])} is unknown")
    config = checkpoint["config"]
    _require(isinstance(config, dict) and all(isinstance(key, str) for key in config),
             "config is not the pacing settings' record")
    for name in ("step", "weight_version", "generation"):
        _require(_is_int(checkpoint[name], 0), f"{name} {_short(checkpoint[name])} is not a whole number >= 0")
    _require(isinstance(checkpoint.get("paused", False), bool), f"paused {_short(checkpoint.get('paused'))} is not "
             f"true or false")
    _require(_is_real(checkpoint["taken_at"]), f"taken_at {_short(checkpoint['taken_at'])} is not a time")
    buffer = checkpoint["buffer"]
    _require(isinstance(buffer, list), "buffer is not a list of (priority, group) entries")
    priorities = set()
    for i, entry in enumerate(buffer):
        _require(_is_sequence(entry, 2), f"buffer[{i}] is not a (priority, group) entry")
        priority, group = entry
        # The buffer is a heap of (priority, group): priorities must order among themselves and never tie (a tie
        # would compare the groups, which do not order).
        _require(isinstance(priority, tuple) and len(priority) == 3 and
                 all(_is_real(p) and not math.isnan(p) for p in priority),
                 f"buffer[{i}]'s priority {_short(priority)} is not an (epoch, index, seq) of numbers")
        _require(priority not in priorities, f"buffer[{i}]'s priority {_short(priority)} is another entry's too")
        priorities.add(priority)
        _check_group(group, f"buffer[{i}]")
    for name in ("kept", "quarantined"):
        groups = checkpoint[name]
        _require(isinstance(groups, list), f"{name} is not a list of groups")
        for i, group in enumerate(groups):
            _check_group(group, f"{name}[{i}]")
    in_flight = checkpoint["in_flight"]
    _require(isinstance(in_flight, list), "in_flight is not a list of prompts")
    for i, prompt in enumerate(in_flight):
        _require(_is_sequence(prompt, 4) and _is_int(prompt[0]) and all(p is None or _is_int(p) for p in prompt[1:3])
                 and isinstance(prompt[3], str), f"in_flight[{i}] is not a (ds_index, epoch, index, prompt_id)")
    _check_cursor(checkpoint["cursor"])


def _check_cursor(cursor: Any) -> None:
    """As PromptCursor.export writes it: {"marks": [(ds_index, epoch, below, [indices above])]}."""
    _require(isinstance(cursor, dict) and set(cursor) == {"marks"} and isinstance(cursor["marks"], list),
             "cursor is not a prompt cursor")
    seen = set()
    for i, mark in enumerate(cursor["marks"]):
        _require(_is_sequence(mark, 4) and _is_int(mark[0]) and _is_int(mark[1]) and _is_int(mark[2], 0) and
                 _is_sequence(mark[3]) and all(_is_int(index, 0) for index in mark[3]),
                 f"cursor mark {i} is not a (ds_index, epoch, below, [indices above])")
        _require((mark[0], mark[1]) not in seen, f"cursor mark {i} repeats data source {mark[0]}, epoch {mark[1]}")
        seen.add((mark[0], mark[1]))


def _check_group(group: Any, where: str) -> None:
    _require(type(group) is TrajectoryGroup, f"{where} is not a trajectory group")
    state = vars(group)
    # A field read from the pickle under another name (a damaged key) is an unknown one here; a field of the
    # class absent from it reads as the class's default (`seq`), or is missing (`prompt_id`, `trajectories`).
    unknown = set(state) - _GROUP_FIELDS
    _require(not unknown, f"{where} has fields no group has: {', '.join(sorted(map(_short, unknown)))}")
    _require(isinstance(state.get("prompt_id"), str), f"{where} has no prompt_id")
    where = f"{where} (prompt {_short(group.prompt_id)})"
    _require(_is_int(group.seq, 0) and _is_int(group.ds_index), f"{where}: seq or ds_index is not a whole number")
    _require(all(v is None or _is_int(v) for v in (group.epoch, group.index)), f"{where}: epoch or index is not a "
             f"whole number or none")
    _require(_is_real(group.dispatched_at), f"{where}: dispatched_at is not a time")
    trajectories = state.get("trajectories")
    _require(isinstance(trajectories, list), f"{where} has no list of trajectories")
    prompt_id = group.prompt_id
    for j, trajectory in enumerate(trajectories):
        if not _well_formed(trajectory, prompt_id):  # the usual case costs one test; the message only when not
            _check_trajectory(trajectory, prompt_id, f"{where} trajectory {j}")


def _well_formed(t: Any, prompt_id: str) -> bool:
    """The usual trajectory, as the transport's codec makes them, told well formed in one expression (a checkpoint
    may hold 100,000 trajectories); False sends it to _check_trajectory, which also takes other number types."""
    if type(t) is not Trajectory:
        return False
    state = t.__dict__
    return (state.keys() <= _TRAJECTORY_FIELDS and type(state.get("trajectory_id")) is str and
            state.get("prompt_id") == prompt_id and type(t.ds_index) is int and type(t.start_weight_version) is int
            and type(t.end_weight_version) is int and type(t.num_turns) is int and t.num_turns >= 0 and
            type(t.size_bytes) is int and t.size_bytes >= 0 and type(t.num_tokens) is int and t.num_tokens >= 0 and
            type(t.status) is TrajectoryStatus and (type(t.reward) is float or type(t.reward) is int) and
            (type(t.metadata) is dict or isinstance(t.metadata, Mapping)))


def _check_trajectory(trajectory: Any, prompt_id: str, where: str) -> None:
    """Says what is wrong with a trajectory `_well_formed` refused."""
    _require(type(trajectory) is Trajectory, f"{where} is not a trajectory")
    state = vars(trajectory)
    unknown = set(state) - _TRAJECTORY_FIELDS
    _require(not unknown, f"{where} has fields no trajectory has: {', '.join(sorted(map(_short, unknown)))}")
    _require(isinstance(state.get("trajectory_id"), str), f"{where} has no trajectory_id")
    _require(state.get("prompt_id") == prompt_id, f"{where} has prompt_id {_short(state.get('prompt_id'))}, not "
             f"its group's")
    t = trajectory
    _require(all(_is_int(v) for v in (t.ds_index, t.start_weight_version, t.end_weight_version)) and
             all(_is_int(v, 0) for v in (t.num_turns, t.size_bytes, t.num_tokens)),
             f"{where}: ds_index, a weight version or a count is not a whole number")
    _require(isinstance(t.status, TrajectoryStatus), f"{where}: status {_short(t.status)} is not a status")
    _require(isinstance(t.reward, Real), f"{where}: reward {_short(t.reward)} is not a number")  # as Submit takes
    _require(isinstance(t.metadata, Mapping), f"{where}: metadata is not a map")


def strategy_state(hooks: Any, failures: HookFailures) -> Any:
    """What the strategy's state() hook returns, for a checkpoint or a snapshot; None (an incident recorded) when
    it raises."""
    hook = getattr(hooks, "state", None)
    if not callable(hook):  # a strategy of its own making, with an attribute of that name: nothing to save
        return None
    try:
        return hook()
    except Exception as exc:  # a broken hook must not cost the snapshot: reported, and the restart relearns
        failures.incident(HOOK_FAILED, "", "state", describe_exception(exc), "not saved")
        return None


class Checkpoints:
    """Takes a checkpoint (`take`) and brings the pacer back to one (`restore`); keeps (step, weight version,
    wall time) of the last checkpoint taken and of the last one restored (None: none yet), for GetState."""

    def __init__(self, lock: threading.RLock, lifecycle: Lifecycle, steps: StepBoundary, inflight: InflightTable,
                 collector: Collector, buffer: PipelineBuffer, leases: Leases, restored: RestoredGroups,
                 cursor: PromptCursor, held_bytes: HeldBytes, totals: dict, answers: AnswerBook, hooks: Any,
                 signals: Signals, failures: HookFailures, clock: PacerClock, summary: dict):
        self._lock, self._lifecycle, self._steps, self._inflight = lock, lifecycle, steps, inflight
        self._collector, self._buffer, self._leases, self._restored = collector, buffer, leases, restored
        self._cursor, self._held_bytes, self._totals, self._answers = cursor, held_bytes, totals, answers
        self._hooks, self._signals, self._failures, self._clock = hooks, signals, failures, clock
        self._summary = summary  # the pacing settings: a checkpoint restores only under the same
        self.last_checkpoint: Optional[tuple[int, int, float]] = None
        self.last_restore: Optional[tuple[int, int, float]] = None

    def take(self) -> dict[str, Any]:
        """What the pacer needs to continue from the current step: a consistent copy, taken under the lock
        without pausing anything (the buffer and kept groups are shared, not copied: they are never changed).
        Not counted yet: `taken` counts it once its caller has it (a blob too large to send is no checkpoint)."""
        with self._lock:
            self._lifecycle.check_open()
            steps = self._steps
            if steps.resetting:
                raise ResetInProgressError("a Reset is running; take the checkpoint after it, at the step boundary "
                                           "it ends in")
            in_flight = self._inflight.in_dispatch_order()
            reoffered = [(g.ds_index, g.epoch, g.index, g.prompt_id) for g in in_flight]
            reoffered += [(g.ds_index, g.epoch, g.index, g.prompt_id) for g in self._collector.expired]
            # Leased groups were not acknowledged: the trainer that restores this has not trained them.
            buffer = self._buffer.export()
            for lease in self._leases.collect.values():
                buffer.extend(lease.entries)
            buffer.sort(key=lambda entry: entry[0])
            return {
                "format": CHECKPOINT_FORMAT,
                "config": dict(self._summary),
                "step": steps.step, "weight_version": steps.weight_version, "generation": steps.generation,
                "paused": steps.paused,  # taken between a Reset and its Resume: restored paused, the Resume reopens
                "taken_at": time.time(),
                "buffer": buffer,
                "kept": self._restored.export(),
                "quarantined": self._collector.quarantined,
                "in_flight": reoffered,  # (ds_index, epoch, index, prompt_id): offered again after a Restore
                "cursor": self._cursor.copy_without(reoffered).export(),
                "strategy": strategy_state(self._hooks, self._failures),  # as the journal's snapshot saves it
            }

    def taken(self, checkpoint: dict[str, Any]) -> None:
        """`checkpoint` (of `take`) reached its caller: GetState counts it and names it the last taken."""
        with self._lock:
            self._totals["checkpoints"] += 1
            self.last_checkpoint = (checkpoint["step"], checkpoint["weight_version"], checkpoint["taken_at"])

    def check(self, checkpoint: dict[str, Any]) -> None:
        """Refuse (changing nothing) a checkpoint of another job's settings, or while a Reset runs."""
        if self._steps.resetting:
            raise ResetInProgressError("a Reset is running; restore after it ends (nothing was changed)")
        if self._lifecycle.job_ended:
            raise JobEndedError("Restore refused: EndJob ended this job, and a restored job would dispatch again "
                                "(nothing was changed); start a new server for a new run from the checkpoint")
        recorded, summary = checkpoint.get("config") or {}, self._summary
        changed = [f"{key} {recorded.get(key)!r} -> {summary.get(key)!r}"
                   for key in sorted(set(recorded) | set(summary)) if recorded.get(key) != summary.get(key)]
        if changed:
            raise CheckpointMismatchError(
                f"the checkpoint was taken under other pacing settings ({', '.join(changed)}): it is another job's, "
                f"or the configuration changed since; restore it on a server started with the settings it was "
                f"taken under (nothing was changed)", violations=[("checkpoint", "must be this job's")])

    def restore(self, checkpoint: dict[str, Any]) -> RestoreResult:
        """Bring the pacer back to the checkpoint's step: everything held now is discarded and counted, the
        checkpoint's buffer and kept groups are put back as they were, the prompts in flight then (and every
        prompt admitted since) are offered again, and workers are told (PAUSE with ABORT, then RESUME at its
        weight version unless it was taken while dispatch was paused: then the trainer's Resume reopens it).
        `checkpoint` was validated whole first (by `decode`, or by `validate`), outside the lock."""
        with self._lock:
            self._lifecycle.check_open()
            self.check(checkpoint)
            return self._restore(checkpoint)

    def _restore(self, checkpoint: dict[str, Any]) -> RestoreResult:
        # Everything that can fail comes before the first change (the strategy's hook last): a Restore applies
        # whole or not at all.
        step, version = checkpoint["step"], checkpoint["weight_version"]
        now = self._clock()
        buffer, leases, restored, collector, totals = (self._buffer, self._leases, self._restored, self._collector,
                                                       self._totals)

        # What is discarded: every group the server holds now, and what a worker still generates.
        buffered = buffer.groups()
        leased = [group for lease in leases.collect.values() for _, group in lease.entries]
        running = list(self._inflight.values())
        set_aside = [*restored.export(), *collector.quarantined, *collector.expired]
        discarded_groups = [*buffered, *leased, *set_aside]
        trajectories = [t for g in discarded_groups for t in g.trajectories]
        trajectories += [t for g in running for t in g.trajectories.values()]
        newer = sum(1 for t in trajectories if max(t.start_weight_version, t.end_weight_version) > version)
        before = len(self._cursor)

        # What is put back, worked out now (validate checked its shape: the heap's priorities order).
        entries, kept = list(checkpoint["buffer"]), list(checkpoint["kept"])
        quarantined = list(checkpoint["quarantined"])
        held = sum(bytes_of(g.trajectories) for g in [*(group for _, group in entries), *kept, *quarantined])

        strategy_state = checkpoint.get("strategy")
        hook = getattr(self._hooks, "restore", None)
        try:  # the strategy hears first: if it raises, nothing changed
            if strategy_state is not None and callable(hook):
                hook(strategy_state)
            self._hooks.on_reset()  # nothing is in flight after a Restore
        except Exception as exc:
            raise self._failures.refused("restore", exc, "the Restore changed nothing") from exc

        totals["dropped"] += len(running)
        totals["rolled_back"] += len(buffered) + len(leased)
        leases.lapse_all()  # an Ack of one now fails: its groups are gone
        self._inflight.new_generation()  # late Submits of what ran before are refused as stale, as after a Reset
        leases.forget_running()
        # The answers of calls that handed out discarded groups must not hand them out again to a retry.
        self._answers.forget("Collect", lambda answer: True)
        self._answers.forget("Reset", lambda answer: True)

        buffer.replace(entries)
        totals["reinstated"] += len(buffer)
        restored.restore(kept)
        collector.new_generation(quarantined)
        self._held_bytes.total = held
        self._cursor.restore(checkpoint["cursor"])
        steps = self._steps
        steps.rolled_back(step, version, bool(checkpoint.get("paused")), now)
        totals["restores"] += 1
        self.last_restore = (step, version, float(checkpoint.get("taken_at") or 0.0))

        self._signals.emit(ControlEventType.PAUSE, ResetMode.ABORT)  # workers abort what they generate
        if not steps.paused:
            self._signals.emit(ControlEventType.RESUME)  # and load the weights of the checkpoint's version
        self._signals.notify()
        return RestoreResult(
            step=step, weight_version=version, generation=steps.generation,
            discarded_groups=len(discarded_groups) + len(running), discarded_trajectories=len(trajectories),
            discarded_newer_trajectories=newer, dropped_running=len(running),
            reinstated_groups=len(buffer), kept_groups=len(restored),
            reoffered_prompts=max(0, before - len(self._cursor)), checkpoint_taken_at=self.last_restore[2],
            discarded_prompt_ids=[g.prompt_id for g in discarded_groups] + [g.prompt_id for g in running])

    def export(self) -> dict:
        return {"last_checkpoint": self.last_checkpoint, "last_restore": self.last_restore}

    def restore_marks(self, snapshot: dict) -> None:
        self.last_checkpoint, self.last_restore = snapshot.get("last_checkpoint"), snapshot.get("last_restore")


def restore_summary(result: RestoreResult) -> str:
    """One line for the log."""
    return (f"restored the checkpoint of step {result.step} (weight version {result.weight_version}): discarded "
            f"{result.discarded_groups} groups ({result.discarded_trajectories} trajectories, "
            f"{result.discarded_newer_trajectories} generated under a newer weight version; "
            f"{result.dropped_running} running), reinstated {result.reinstated_groups} buffered and "
            f"{result.kept_groups} kept groups, {result.reoffered_prompts} prompts offered again")

