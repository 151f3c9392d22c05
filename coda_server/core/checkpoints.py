"""Trainer checkpoints of the pacer: what a Checkpoint call exports, its versioned blob, and what a Restore does.

A trainer that saves its model at step k takes a pacer checkpoint beside it; after a crash (or a deliberate
rollback) it restores that checkpoint, and the pacer continues from k as if the steps after it had never
run. `Checkpoints` is built by the Pacer over the owners a checkpoint reads and a Restore changes, passed
explicitly; it keeps when the last checkpoint was taken and restored. The blob is the journal's encoding
(journal.dumps: pickled plain data, trajectories in the transport's own bytes through the codec) behind a
magic line and a format number.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any, Optional

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
from .types import ControlEventType, ResetMode, RestoreResult

log = logging.getLogger("coda_server.checkpoints")

CHECKPOINT_FORMAT = 1
MAGIC = b"coda-pacer checkpoint\n"
_HEADER = struct.Struct(">I")  # the format number, after the magic line
# What a Restore of bytes that are not a whole checkpoint is told to send instead, in terms of the RPCs.
_PASS_THE_BLOB = "pass the bytes an earlier Checkpoint call returned (its `checkpoint` field), unchanged"


class CheckpointFormatError(InvalidArgumentError):
    """The blob is not a pacer checkpoint, or one of a format this version does not read."""

    reason = "CHECKPOINT_FORMAT"


class CheckpointMismatchError(FailedPreconditionError):
    """The checkpoint was taken under other pacing settings (another job's configuration)."""

    reason = "CHECKPOINT_MISMATCH"


# ------------------------------------------------------------------ the blob


def encode(checkpoint: dict[str, Any], codec: TrajectoryCodec) -> bytes:
    """The opaque blob: magic line, format number, then the journal's encoding of the checkpoint."""
    return dumps(checkpoint, codec, prefix=MAGIC + _HEADER.pack(CHECKPOINT_FORMAT))


def decode(blob: bytes, codec: TrajectoryCodec) -> dict[str, Any]:
    """The checkpoint in `blob`; CheckpointFormatError (changing nothing) when it is not one this version reads."""
    # The messages say what is wrong in terms of the RPCs, for a caller in any language: never the decoder's own
    # words (a Python exception's), which the server log keeps.
    if not isinstance(blob, (bytes, bytearray, memoryview)) or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CheckpointFormatError("Restore refused, nothing changed: checkpoint holds bytes that are not a pacer "
                                    f"checkpoint (they do not begin as one); {_PASS_THE_BLOB}",
                                    violations=[("checkpoint", "must be a blob taken by Checkpoint")])
    blob = memoryview(blob)
    if len(blob) < len(MAGIC) + _HEADER.size:
        raise _undecodable("it ends inside its header")
    (found,) = _HEADER.unpack_from(blob, len(MAGIC))
    if found != CHECKPOINT_FORMAT:
        raise CheckpointFormatError(f"Restore refused, nothing changed: checkpoint is in format {found}, this server "
                                    f"reads format {CHECKPOINT_FORMAT}; restore it with the coda-server version "
                                    f"that took it", violations=[("checkpoint", f"format must be {CHECKPOINT_FORMAT}")])
    try:
        checkpoint = loads(blob[len(MAGIC) + _HEADER.size:], codec)
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("its body is not a checkpoint record")
    except Exception as exc:
        raise _undecodable(f"{type(exc).__name__}: {exc}") from None
    return checkpoint


def _undecodable(cause: str) -> CheckpointFormatError:
    """The refusal of a blob that begins as a checkpoint but does not decode; `cause`, the decoder's words, is
    logged, not sent."""
    log.info("Restore refused: the checkpoint blob does not decode (%s)", cause)
    return CheckpointFormatError(
        "Restore refused, nothing changed: checkpoint holds bytes that are not a checkpoint this server wrote (they "
        f"do not decode: truncated, damaged or of another format); {_PASS_THE_BLOB}",
        violations=[("checkpoint", "must be a blob taken by Checkpoint, unchanged")])


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
        without pausing anything (the buffer and kept groups are shared, not copied: they are never changed)."""
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
            self._totals["checkpoints"] += 1
            self.last_checkpoint = (steps.step, steps.weight_version, time.time())
            return {
                "format": CHECKPOINT_FORMAT,
                "config": dict(self._summary),
                "step": steps.step, "weight_version": steps.weight_version, "generation": steps.generation,
                "paused": steps.paused,  # taken between a Reset and its Resume: restored paused, the Resume reopens
                "taken_at": self.last_checkpoint[2],
                "buffer": buffer,
                "kept": self._restored.export(),
                "quarantined": self._collector.quarantined,
                "in_flight": reoffered,  # (ds_index, epoch, index, prompt_id): offered again after a Restore
                "cursor": self._cursor.copy_without(reoffered).export(),
                "strategy": strategy_state(self._hooks, self._failures),  # as the journal's snapshot saves it
            }

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
        weight version unless it was taken while dispatch was paused: then the trainer's Resume reopens it)."""
        with self._lock:
            self._lifecycle.check_open()
            self.check(checkpoint)
            return self._restore(checkpoint)

    def _restore(self, checkpoint: dict[str, Any]) -> RestoreResult:
        step, version = int(checkpoint["step"]), int(checkpoint["weight_version"])
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

        buffer.replace(checkpoint["buffer"])
        totals["reinstated"] += len(buffer)
        restored.restore(checkpoint["kept"])
        collector.new_generation(checkpoint["quarantined"])
        self._held_bytes.total = sum(bytes_of(g.trajectories) for g in
                                     [*buffer.groups(), *restored.export(), *collector.quarantined])
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

