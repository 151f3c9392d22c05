"""The in-flight groups (dispatched prompts assembling their trajectories) and their table, the bytes held, and the step tally."""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from .errors import InvalidArgumentError, StaleDispatchError
from .prompt_ids import loongsage_order
from .types import HeldGroup, PromptRef, StepReport, Trajectory, TrajectoryGroup, TrajectoryStatus

_NO_PRIORITY = float("inf")
_NO_ARRIVAL = 1 << 62  # no trajectory yet


class InflightGroup:
    """A dispatched group that has not left the trajectory queue; handed to strategy hooks."""

    __slots__ = ("prompt_id", "ds_index", "epoch", "index", "seq", "group_size", "trajectories", "deadline",
                 "dispatched_at", "held", "client_id", "arrival")

    def __init__(self, ref: PromptRef, seq: int, group_size: int, now: float, client_id: str = ""):
        self.prompt_id = ref.prompt_id
        self.ds_index = ref.ds_index
        self.epoch = ref.epoch
        self.index = ref.index
        self.seq = seq
        self.group_size = group_size
        self.trajectories: dict[str, Trajectory] = {}
        self.dispatched_at = now
        self.held = False  # complete, but the strategy's will_collect refused it so far
        self.deadline = math.inf  # when its in-flight lease runs out (extended by every Submit for it)
        self.client_id = client_id  # who dispatched it (x-coda-client-id; "" when the caller sent none)
        self.arrival = _NO_ARRIVAL  # order of its first trajectory's arrival in this generation (Reset order)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.group_size

    def priority(self) -> tuple:
        """Buffer order: the prompt's (epoch, index) when the dispatcher gave both; else (E, N) read from a
        LoongSage-form prompt id `epoch{E}_..._prompt{N}`, as LoongSage's buffer orders; else dispatch seq."""
        if self.epoch is not None and self.index is not None:
            return (self.epoch, self.index, self.seq)
        order = loongsage_order(self.prompt_id)
        if order is not None:
            return (order[0], order[1], self.seq)
        return (_NO_PRIORITY, _NO_PRIORITY, self.seq)

    def to_group(self) -> TrajectoryGroup:
        return TrajectoryGroup(self.prompt_id, self.seq, self.ds_index, list(self.trajectories.values()),
                               self.epoch, self.index, self.dispatched_at)


class DispatchedGroup:
    """A group as `on_dispatched` sees it, in LoongSage's form: its ids and, in `trajectories`, the N pending
    trajectories of a new group (status UNSPECIFIED, LoongSage's PENDING; trajectory_id "" as the worker names
    them) or the trajectories a continued group brings back. Built when asked for: a strategy that reads
    only `prompt_id` and `seq`, as the built-ins do, costs one small object per group."""

    __slots__ = ("prompt_id", "seq", "ds_index", "epoch", "index", "group_size", "dispatched_at", "_brought")

    def __init__(self, group: InflightGroup, brought: "list[Trajectory] | None" = None):
        self.prompt_id = group.prompt_id
        self.seq = group.seq
        self.ds_index = group.ds_index
        self.epoch = group.epoch
        self.index = group.index
        self.group_size = group.group_size
        self.dispatched_at = group.dispatched_at
        self._brought = brought

    @property
    def trajectories(self) -> list[Trajectory]:
        if self._brought is not None:
            return list(self._brought)
        return [Trajectory("", self.prompt_id, self.ds_index, TrajectoryStatus.UNSPECIFIED)
                for _ in range(self.group_size)]


class StepTally:
    """What the trainer took since the last Reset, for the step report."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """A new step starts: nothing taken yet."""
        self.trajectories = 0
        self.partial = 0
        self.span_max = 0
        self.filtered = 0

    def count_consumed(self, group: TrajectoryGroup) -> None:
        partial = span_max = 0  # summed here, then added: once per trajectory of every consumed group
        for t in group.trajectories:
            span = t.end_weight_version - t.start_weight_version
            if span != 0:
                partial += 1
                if span > span_max:
                    span_max = span
        self.trajectories += len(group.trajectories)
        self.partial += partial
        if span_max > self.span_max:
            self.span_max = span_max

    def report(self, step: int, buffered: int, restored: list[TrajectoryGroup], dropped: list[InflightGroup],
               pause_delay: float) -> StepReport:
        """The step report a Reset closes the step with; restored and dropped are counted in trajectories, as
        LoongSage's partial_restored_count / partial_dropped_incomplete_count are, and in groups."""
        return StepReport(
            step=step,
            pipeline_buf_size=buffered,
            filter_drop=self.filtered,
            partial_ratio=(self.partial / self.trajectories) if self.trajectories else 0.0,
            partial_span_max=self.span_max,
            partial_restored_count=sum(len(group.trajectories) for group in restored),
            partial_dropped_incomplete_count=sum(len(group.trajectories) for group in dropped),
            pause_delay=pause_delay,
            partial_restored_group_count=len(restored),
            partial_dropped_incomplete_group_count=len(dropped),
        )


def bytes_of(trajectories: Iterable[Trajectory]) -> int:
    return sum([t.size_bytes for t in trajectories])  # a list: a generator costs a resumption per trajectory


# Framing a length-delimited field adds at most a 1-byte tag (field numbers below 16) and a 5-byte length.
_FIELD_FRAMING_BYTES = 6
# A group's header fields besides its prompt id: seq, ds_index, epoch, index (tags and varints, at most).
_GROUP_HEADER_BYTES = 48
# An answer's fields besides its groups (timed_out, cut_to_fit, a lease id of at most 128 characters).
ANSWER_OVERHEAD_BYTES = 160


def encoded_group_bound(group: TrajectoryGroup) -> int:
    """An upper bound on the bytes a group adds to an answer (its trajectories are held at their encoded size)."""
    return (_FIELD_FRAMING_BYTES + _GROUP_HEADER_BYTES + _FIELD_FRAMING_BYTES + len(group.prompt_id.encode())
            + sum([t.size_bytes for t in group.trajectories]) + _FIELD_FRAMING_BYTES * len(group.trajectories))


def fitting_answer(groups: Sequence[TrajectoryGroup], limit: int) -> Sequence[TrajectoryGroup]:
    """The first of `groups` whose trajectories fit one answer of `limit` bytes (0: no limit)."""
    size = ANSWER_OVERHEAD_BYTES
    for count, group in enumerate(groups):
        size += encoded_group_bound(group)
        if limit and size > limit:
            return groups[:count]
    return groups


class HeldBytes:
    """The bytes of every trajectory the server holds (queued, buffered, leased, kept, quarantined, expired):
    added when a Submit is accepted, released when the trainer consumes a group or a Reset or Restore lets it go."""

    __slots__ = ("total", "_watcher")

    def __init__(self, total: int = 0):
        self.total = total
        self._watcher: Optional[Callable[[int], None]] = None

    def watch(self, watcher: Optional[Callable[[int], None]]) -> None:
        """Calls `watcher(total)` after every change (the server's heap trimmer follows the held bytes)."""
        self._watcher = watcher

    def add(self, size: int) -> None:
        self.total += size
        if self._watcher is not None:
            self._watcher(self.total)

    def release(self, trajectories: Iterable[Trajectory]) -> None:
        self.total -= bytes_of(trajectories)
        if self._watcher is not None:
            self._watcher(self.total)


class InflightTable:
    """The groups in flight this generation (dispatched, not out of the trajectory queue), with what is counted
    over them (complete groups, queued trajectories), the accepted trajectories' ids for duplicate detection,
    the prompts of this and recent generations (stale Submits), the latest dispatch seq of each prompt (the
    fence), and the prompts whose in-flight lease ran out. Every change to them goes through its methods."""

    __slots__ = ("groups", "_complete", "_queued", "_accepted", "_generation_prompts", "_latest_seqs",
                 "_past_generations", "_expired_prompts", "_arrivals", "next_seq", "_awaiting_keys")

    def __init__(self, remembered_generations: int):
        self.groups: dict[str, InflightGroup] = {}  # by prompt id; for reading only (changed by the methods)
        self._complete = 0
        self._queued = 0
        # This generation's accepted trajectories, by id: the trajectory while the server holds it, then only
        # its content_key() (the body, e.g. its token arrays, is let go).
        self._accepted: dict[str, "Trajectory | tuple"] = {}
        self._awaiting_keys: list[Trajectory] = []  # trajectories that left, kept whole until their key is ready
        self._generation_prompts: set[str] = set()
        self._latest_seqs: dict[str, int] = {}
        self._past_generations: deque[set[str]] = deque(maxlen=remembered_generations)
        self._expired_prompts: set[str] = set()  # late Submits: LEASE_EXPIRED until dispatched again
        self._arrivals = 0  # groups whose first trajectory came (InflightGroup.arrival)
        self.next_seq = 0  # the dispatch seq the next admitted group gets

    # ------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self.groups)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self.groups

    def get(self, prompt_id: str) -> "InflightGroup | None":
        return self.groups.get(prompt_id)

    def values(self) -> Iterable[InflightGroup]:
        return self.groups.values()

    def in_dispatch_order(self) -> list[InflightGroup]:
        return sorted(self.groups.values(), key=lambda g: g.seq)

    @property
    def queued_trajectories(self) -> int:
        return self._queued

    @property
    def all_assembled(self) -> bool:
        """Every running group holds all its trajectories (any status)."""
        return self._complete == len(self.groups)

    @property
    def remembered_generations(self) -> "int | None":
        return self._past_generations.maxlen

    def sort_submit(self, checks: Any, trajectories: Sequence[Trajectory],
                    dispatch_seqs: Optional[Mapping[str, int]] = None) -> Any:
        """`checks.sort_submit` against this table (changes nothing)."""
        return checks.sort_submit(trajectories, self._accepted, self.groups, self._expired_prompts,
                                  self._generation_prompts, self._past_generations, dispatch_seqs)

    def check_candidates(self, checks: Any, candidates: Sequence[PromptRef], restored: Any) -> None:
        checks.check_candidates(candidates, self.groups, restored.ids)

    def stale_fences(self, dispatch_seqs: Mapping[str, int]) -> list[tuple[str, int, int]]:
        """(prompt id, the seq named, the latest seq) of each group dispatched again since the named seq."""
        latest = self._latest_seqs  # also for a group complete by now: it is another worker's work
        return [(prompt_id, seq, latest[prompt_id]) for prompt_id, seq in dispatch_seqs.items()
                if prompt_id in latest and latest[prompt_id] != seq]

    def check_fences(self, dispatch_seqs: Mapping[str, int]) -> None:
        """Refuse a Submit from a worker that lost a group: the group was released from it (lease or liveness)
        and handed out again, so its running dispatch has another seq than the one the Submit names."""
        stale = self.stale_fences(dispatch_seqs)
        never = [(prompt_id, yours, now) for prompt_id, yours, now in stale if yours > now]
        if never:  # seqs only grow: a later seq than the group's latest was never this group's
            prompt_id, yours, now = never[0]
            raise InvalidArgumentError(
                f"dispatch_seqs names seq {yours} for group {prompt_id!r}, a seq the server never gave it: its "
                f"dispatch is seq {now}; send each group's seq as its Dispatch answered it",
                violations=[(f"dispatch_seqs[{p!r}]", f"seq {y} was never a dispatch of this group (its latest: {n})")
                            for p, y, n in never])
        if stale:
            prompt_id, yours, now = stale[0]
            raise StaleDispatchError(
                f"group {prompt_id!r} was released from its dispatch seq {yours} (its worker went silent or its "
                f"lease ran out) and was dispatched again as seq {now}, to another worker; drop this worker's "
                f"work on it"
                + (f" ({len(stale)} groups in all)" if len(stale) > 1 else ""))

    def held(self, client_id: "str | None", now: float) -> list[HeldGroup]:
        """The running groups (all, or those `client_id` dispatched), oldest first: which worker holds what."""
        return [HeldGroup(g.prompt_id, g.seq, g.ds_index, g.client_id, max(0.0, now - g.dispatched_at),
                          len(g.trajectories), g.group_size, max(0.0, g.deadline - now))
                for g in self.in_dispatch_order() if client_id is None or g.client_id == client_id]

    # ------------------------------------------------------------- changing

    def admit(self, groups: Sequence[InflightGroup]) -> None:
        """Dispatch admitted these groups (seqs from `next_seq` on)."""
        self.next_seq += len(groups)
        table, generation_prompts, latest_seqs = self.groups, self._generation_prompts, self._latest_seqs
        for group in groups:
            table[group.prompt_id] = group
            generation_prompts.add(group.prompt_id)
            latest_seqs[group.prompt_id] = group.seq

    def continued(self, prompt_ids: Iterable[str]) -> None:
        """Kept groups handed out again: a Submit for them is expected again."""
        self._expired_prompts.difference_update(prompt_ids)

    def accept(self, fresh: Sequence[Trajectory]) -> tuple[list[InflightGroup], list[InflightGroup], int]:
        """Add sorted, fresh trajectories to their groups: (groups completed, groups still assembling that
        got one, bytes added)."""
        completed: list[InflightGroup] = []
        touched: dict[str, InflightGroup] = {}
        self._sweep_awaiting_keys()
        accepted, table = self._accepted, self.groups
        added = 0
        for trajectory in fresh:
            group = touched[trajectory.prompt_id] = table[trajectory.prompt_id]
            if not group.trajectories:  # a Reset restores groups in the order their first trajectory came
                group.arrival, self._arrivals = self._arrivals, self._arrivals + 1
            group.trajectories[trajectory.trajectory_id] = trajectory
            accepted[trajectory.trajectory_id] = trajectory
            added += trajectory.size_bytes
            if group.complete:
                completed.append(group)
        self._queued += len(fresh)
        self._complete += len(completed)
        return completed, [group for group in touched.values() if not group.complete], added

    def check_retried_submit(self, trajectories: Sequence[Trajectory], dispatch_seqs: Any = None) -> None:
        """A Submit answered from memory (its request_id's first answer): refuse it if it carries, under the ids
        accepted then, other content, which that answer would drop without a word. Compared while this generation
        keeps what it accepted (not after a Reset or Restore)."""
        accepted = self._accepted
        changed = [(i, t.trajectory_id) for i, t in enumerate(trajectories)
                   if t.trajectory_id in accepted and not t.same_content(accepted[t.trajectory_id])]
        if changed:
            raise InvalidArgumentError(
                f"Submit refused, nothing done: it repeats the request_id of a Submit already answered, yet "
                f"{len(changed)} of its trajectories ({changed[0][1]!r} first) differ in content from the ones "
                f"accepted under those ids then; a retry must repeat the call as it was (it then gets the first "
                f"answer), and new content needs a new request_id and new trajectory ids",
                violations=[(f"trajectories[{i}]", f"{tid!r} differs from the trajectory accepted under this id")
                            for i, tid in changed])

    def remove_complete(self, group: InflightGroup) -> None:
        """A complete group left the trajectory queue (to the buffer, a filter, or quarantine)."""
        del self.groups[group.prompt_id]
        self._complete -= 1
        self._queued -= len(group.trajectories)

    def expire(self, prompt_id: str, resubmitted: bool) -> InflightGroup:
        """A running group's lease ran out: out of the table; late Submits for it are refused (LEASE_EXPIRED)
        until it is dispatched again. `resubmitted`: whoever continues it submits every trajectory anew."""
        group = self.groups.pop(prompt_id)
        self._queued -= len(group.trajectories)
        if resubmitted:
            for trajectory_id in group.trajectories:
                self._accepted.pop(trajectory_id, None)
        self._expired_prompts.add(prompt_id)
        return group

    def left(self, trajectories: Iterable[Trajectory]) -> None:
        """These trajectories have left the server (the trainer has them, or a filter dropped their group): keep
        only each one's content key, so that its body, and the Submit's bytes it is a slice of, are let go. A key
        whose digest is still being made (off the event loop) is taken at the next sweep."""
        self._sweep_awaiting_keys()
        accepted, awaiting = self._accepted, self._awaiting_keys
        for trajectory in trajectories:
            if trajectory.trajectory_id in accepted:
                key = trajectory.content_key_if_ready()
                if key is None:
                    awaiting.append(trajectory)
                else:
                    accepted[trajectory.trajectory_id] = key

    def _sweep_awaiting_keys(self) -> None:
        """Take the keys of the trajectories that left by an earlier call: made by now as a rule, else made here,
        so what waits is never more than what left since the last Submit, Collect or Ack."""
        if self._awaiting_keys:
            accepted = self._accepted
            for trajectory in self._awaiting_keys:
                if accepted.get(trajectory.trajectory_id) is trajectory:  # not forgotten since
                    accepted[trajectory.trajectory_id] = trajectory.content_key()
            self._awaiting_keys = []

    def new_generation(self) -> None:
        """A Reset or Restore ends the generation: nothing is in flight; late Submits of it are stale."""
        self.groups.clear()
        self._complete = 0
        self._queued = 0
        self._accepted.clear()
        self._awaiting_keys = []
        self._past_generations.append(self._generation_prompts)
        self._generation_prompts = set()
        self._latest_seqs = {}
        self._expired_prompts = set()

    def export(self) -> dict:
        return {"next_seq": self.next_seq, "past_generation_prompts": list(self._past_generations)}

    def restore(self, snapshot: dict) -> None:
        self.next_seq = snapshot["next_seq"]
        self._past_generations.extend(snapshot["past_generation_prompts"])
