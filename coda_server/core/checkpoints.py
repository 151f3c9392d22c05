"""Trainer checkpoints of the pacer: what a Checkpoint call exports, its versioned blob, and what a Restore does.

A trainer that saves its model at step k takes a pacer checkpoint beside it; after a crash (or a deliberate
rollback) it restores that checkpoint, and the pacer continues from k as if the steps after it had never
run. Written as functions over one Pacer's state, as its own methods would be (like reset_steps.py). The
blob is the journal's encoding (journal.dumps: pickled plain data, trajectories in the transport's own
bytes through the codec) behind a magic line and a format number.
"""
from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING, Any

from . import recovery
from .cursor import PromptCursor
from .errors import FailedPreconditionError, InvalidArgumentError, JobEndedError, ResetInProgressError
from .inflight import bytes_of
from .journal import TrajectoryCodec, dumps, loads
from .types import ControlEventType, ResetMode, RestoreResult

if TYPE_CHECKING:
    from .pacer import Pacer

CHECKPOINT_FORMAT = 1
MAGIC = b"coda-pacer checkpoint\n"
_HEADER = struct.Struct(">I")  # the format number, after the magic line


class CheckpointFormatError(InvalidArgumentError):
    """The blob is not a pacer checkpoint, or one of a format this version does not read."""

    reason = "CHECKPOINT_FORMAT"


class CheckpointMismatchError(FailedPreconditionError):
    """The checkpoint was taken under other pacing settings (another job's configuration)."""

    reason = "CHECKPOINT_MISMATCH"


# ------------------------------------------------------------------ taking one


def take(pacer: "Pacer") -> dict[str, Any]:
    """What the pacer needs to continue from the current step: a consistent copy, taken under the lock
    without pausing anything (the buffer and kept groups are shared, not copied: they are never changed)."""
    with pacer.lock:
        pacer.check_open()
        if pacer.resetting:
            raise ResetInProgressError("a Reset is running; take the checkpoint after it, at the step boundary "
                                       "it ends in")
        in_flight = pacer.inflight.in_dispatch_order()
        reoffered = [(g.ds_index, g.epoch, g.index, g.prompt_id) for g in in_flight]
        reoffered += [(g.ds_index, g.epoch, g.index, g.prompt_id) for g in pacer.collector.expired]
        # Leased groups were not acknowledged: the trainer that restores this has not trained them.
        buffer = pacer.buffer.export()
        for lease in pacer.leases.collect.values():
            buffer.extend(lease.entries)
        buffer.sort(key=lambda entry: entry[0])
        pacer.totals["checkpoints"] += 1
        pacer.last_checkpoint = (pacer.step, pacer.weight_version, time.time())
        return {
            "format": CHECKPOINT_FORMAT,
            "config": dict(pacer.summary),
            "step": pacer.step, "weight_version": pacer.weight_version, "generation": pacer.generation,
            "paused": pacer.paused,  # taken between a Reset and its Resume: restored paused, the Resume reopens
            "taken_at": pacer.last_checkpoint[2],
            "buffer": buffer,
            "kept": pacer.restored.export(),
            "quarantined": pacer.collector.quarantined,
            "in_flight": reoffered,  # (ds_index, epoch, index, prompt_id): offered again after a Restore
            "cursor": pacer.cursor.copy_without(reoffered).export(),
            "strategy": recovery.strategy_state(pacer),  # as the journal's snapshot saves it
        }


def encode(checkpoint: dict[str, Any], codec: TrajectoryCodec) -> bytes:
    """The opaque blob: magic line, format number, then the journal's encoding of the checkpoint."""
    return dumps(checkpoint, codec, prefix=MAGIC + _HEADER.pack(CHECKPOINT_FORMAT))


def decode(blob: bytes, codec: TrajectoryCodec) -> dict[str, Any]:
    """The checkpoint in `blob`; CheckpointFormatError (changing nothing) when it is not one this version reads."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CheckpointFormatError("the blob is not a pacer checkpoint (pass the bytes PacerClient.checkpoint() "
                                    "returned, or wrote to its path, unchanged)",
                                    violations=[("checkpoint", "must be a blob taken by Checkpoint")])
    blob = memoryview(blob)
    (found,) = _HEADER.unpack_from(blob, len(MAGIC)) if len(blob) >= len(MAGIC) + _HEADER.size else (None,)
    if found != CHECKPOINT_FORMAT:
        raise CheckpointFormatError(f"the checkpoint is in format {found}, this server reads format "
                                    f"{CHECKPOINT_FORMAT}; restore it with the coda-server version that took it",
                                    violations=[("checkpoint", f"format must be {CHECKPOINT_FORMAT}")])
    try:
        checkpoint = loads(blob[len(MAGIC) + _HEADER.size:], codec)
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("its body is not a checkpoint record")
    except Exception as exc:
        raise CheckpointFormatError(f"the checkpoint cannot be read ({exc}); it is damaged or truncated",
                                    violations=[("checkpoint", "must be a blob taken by Checkpoint")]) from None
    return checkpoint


# ------------------------------------------------------------------ restoring one


def check(pacer: "Pacer", checkpoint: dict[str, Any]) -> None:
    """Refuse (changing nothing) a checkpoint of another job's settings, or while a Reset runs."""
    if pacer.resetting:
        raise ResetInProgressError("a Reset is running; restore after it ends (nothing was changed)")
    if pacer.job_ended:
        raise JobEndedError("Restore refused: EndJob ended this job, and a restored job would dispatch again "
                            "(nothing was changed); start a new server for a new run from the checkpoint")
    recorded, summary = checkpoint.get("config") or {}, pacer.summary
    changed = [f"{key} {recorded.get(key)!r} -> {summary.get(key)!r}"
               for key in sorted(set(recorded) | set(summary)) if recorded.get(key) != summary.get(key)]
    if changed:
        raise CheckpointMismatchError(
            f"the checkpoint was taken under other pacing settings ({', '.join(changed)}): it is another job's, "
            f"or the configuration changed since; restore it on a server started with the settings it was "
            f"taken under (nothing was changed)", violations=[("checkpoint", "must be this job's")])


def restore(pacer: "Pacer", checkpoint: dict[str, Any]) -> RestoreResult:
    """Bring the pacer back to the checkpoint's step: everything held now is discarded and counted, the
    checkpoint's buffer and kept groups are put back as they were, the prompts in flight then (and every
    prompt admitted since) are offered again, and workers are told (PAUSE with ABORT, then RESUME at its weight
    version unless it was taken while dispatch was paused: then the trainer's Resume reopens it). Caller holds
    the lock."""
    pacer.check_open()
    check(pacer, checkpoint)
    step, version = int(checkpoint["step"]), int(checkpoint["weight_version"])
    now = pacer.clock()

    # What is discarded: every group the server holds now, and what a worker still generates.
    buffered = pacer.buffer.groups()
    leased = [group for lease in pacer.leases.collect.values() for _, group in lease.entries]
    running = list(pacer.inflight.values())
    set_aside = [*pacer.restored.export(), *pacer.collector.quarantined, *pacer.collector.expired]
    discarded_groups = [*buffered, *leased, *set_aside]
    trajectories = [t for g in discarded_groups for t in g.trajectories]
    trajectories += [t for g in running for t in g.trajectories.values()]
    newer = sum(1 for t in trajectories if max(t.start_weight_version, t.end_weight_version) > version)
    before = len(pacer.cursor)

    strategy_state = checkpoint.get("strategy")
    hook = getattr(pacer.hooks, "restore", None)
    try:  # the strategy hears first: if it raises, nothing changed
        if strategy_state is not None and callable(hook):
            hook(strategy_state)
        pacer.hooks.on_reset()  # nothing is in flight after a Restore
    except Exception as exc:
        raise pacer.hook_refused("restore", exc, "the Restore changed nothing") from exc

    pacer.totals["dropped"] += len(running)
    pacer.totals["rolled_back"] += len(buffered) + len(leased)
    pacer.leases.lapse_all()  # an Ack of one now fails: its groups are gone
    pacer.inflight.new_generation()  # late Submits of what ran before are refused as stale, as after a Reset
    pacer.leases.forget_running()
    # The answers of calls that handed out discarded groups must not hand them out again to a retry.
    pacer.answers.forget("Collect", lambda answer: True)
    pacer.answers.forget("Reset", lambda answer: True)

    pacer.buffer.replace(checkpoint["buffer"])
    pacer.totals["reinstated"] += len(pacer.buffer)
    pacer.restored.restore(checkpoint["kept"])
    pacer.collector.new_generation(checkpoint["quarantined"])
    pacer.held_bytes.total = sum(bytes_of(g.trajectories) for g in
                                  [*pacer.buffer.groups(), *pacer.restored.export(), *pacer.collector.quarantined])
    pacer.cursor = PromptCursor.restored(checkpoint["cursor"])
    pacer.steps.rolled_back(step, version, bool(checkpoint.get("paused")), now)
    pacer.totals["restores"] += 1
    pacer.last_restore = (step, version, float(checkpoint.get("taken_at") or 0.0))

    pacer.emit(ControlEventType.PAUSE, ResetMode.ABORT)  # workers abort what they generate
    if not pacer.paused:
        pacer.emit(ControlEventType.RESUME)  # and load the weights of the checkpoint's version
    pacer.notify()
    return RestoreResult(
        step=step, weight_version=version, generation=pacer.generation,
        discarded_groups=len(discarded_groups) + len(running), discarded_trajectories=len(trajectories),
        discarded_newer_trajectories=newer, dropped_running=len(running),
        reinstated_groups=len(pacer.buffer), kept_groups=len(pacer.restored),
        reoffered_prompts=max(0, before - len(pacer.cursor)), checkpoint_taken_at=pacer.last_restore[2],
        discarded_prompt_ids=[g.prompt_id for g in discarded_groups] + [g.prompt_id for g in running])


def restore_summary(result: RestoreResult) -> str:
    """One line for the log."""
    return (f"restored the checkpoint of step {result.step} (weight version {result.weight_version}): discarded "
            f"{result.discarded_groups} groups ({result.discarded_trajectories} trajectories, "
            f"{result.discarded_newer_trajectories} generated under a newer weight version; "
            f"{result.dropped_running} running), reinstated {result.reinstated_groups} buffered and "
            f"{result.kept_groups} kept groups, {result.reoffered_prompts} prompts offered again")

