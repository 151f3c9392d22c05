"""Request checks: what a call may carry (ids, sizes, statuses, numbers), against the `Limits`; they change nothing."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, Container, Iterable, Mapping, Optional, Sequence

from .errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    ResourceExhaustedError,
    StaleGenerationError,
    UnknownPromptError,
    refused,
)
from .limits import Limits
from .shares import PLAIN, BatchShape
from .strategy import window_size
from .types import PromptRef, ResetMode, Trajectory, TrajectoryStatus

VALID_STATUSES = (TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED)
# A set's lookup finds a member by identity, without TrajectoryStatus.__eq__ (a Python call, kept for strategies that
# compare statuses with LoongSage's strings); a plain number is found by value and made a member (`sort_submit`).
_VALID_STATUS_SET = frozenset(VALID_STATUSES)
RESOURCE_RETRY_SECONDS = 1.0


def wire_status(status: Any) -> str:
    """A trajectory status as the contract names it (the .proto's TRAJECTORY_STATUS_* value and its number): the
    messages are read by callers in any language. A number the enum does not define is shown as it came."""
    if isinstance(status, TrajectoryStatus):
        return f"TRAJECTORY_STATUS_{status.name} ({int(status)})"
    return repr(status)


ALLOWED_STATUSES = ", ".join(wire_status(s) for s in VALID_STATUSES[:-1]) + f" or {wire_status(VALID_STATUSES[-1])}"


@dataclass
class SubmitSorting:
    """A Submit's trajectories sorted against the trajectory queue, before anything is accepted."""

    fresh: list[Trajectory] = field(default_factory=list)  # new, to be accepted
    duplicates: int = 0  # identical to one accepted before
    added_per_group: dict[str, int] = field(default_factory=dict)
    violations: list[tuple[str, str]] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # prompt ids never dispatched
    stale: list[str] = field(default_factory=list)  # prompt ids of an earlier generation
    expired: list[str] = field(default_factory=list)  # prompt ids whose in-flight lease ran out
    # Duplicates of trajectories an earlier dispatch of their prompt brought in, while a later dispatch of it runs
    # without them, in a Submit not fenced to that dispatch (fenced, they are violations): (trajectory id, prompt
    # id, the running dispatch's seq). A late retry of the earlier Submit, or new work under reused ids.
    earlier_dispatch: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def refused_as_stale(self) -> bool:
        """Refused for stale trajectories (which are counted), not for an earlier reason."""
        return bool(self.stale) and not self.violations and not self.unknown

    def refuse(self, generation: int, remembered_generations: Optional[int], inflight_lease_seconds: float,
               kept_for_continuation: bool) -> None:
        """Raise for the first kind of problem found, in this order: malformed, unknown, stale, expired.
        `kept_for_continuation` (rollout.continue_restored) says what became of an expired prompt's group."""
        if self.violations:
            raise refused("Submit", "accepted", self.violations)
        if self.unknown:
            raise UnknownPromptError(f"Submit refused, nothing accepted: prompt {self.unknown[0]!r} was never "
                                     f"dispatched (or was dispatched more than {remembered_generations} resets ago)")
        if self.stale:
            raise StaleGenerationError(f"Submit refused, nothing accepted: prompt {self.stale[0]!r} was dispatched "
                                       f"before the pacer's last Reset or Restore (current generation {generation})")
        if self.expired:
            raise LeaseExpiredError(f"Submit refused, nothing accepted: the in-flight lease of prompt "
                                    f"{self.expired[0]!r} ran out (server.inflight_lease_seconds = "
                                    f"{inflight_lease_seconds:g}) and its slot was reclaimed; "
                                    f"{expired_group_fate(kept_for_continuation)}")


def expired_group_fate(kept_for_continuation: bool) -> str:
    """What became of a group whose in-flight lease ran out, under rollout.continue_restored."""
    if kept_for_continuation:
        return ("the server keeps the group, with the trajectories it had, and re-offers it on Dispatch as a "
                "continuation (rollout.continue_restored); whoever continues it submits the whole group anew, so "
                "drop this work")
    return "its partial trajectories are returned by the next Reset (in `expired`); drop this work"


def well_formed_id(value: Any, limit: int) -> bool:
    """The usual id, told in one test: a non-empty printable str of at most `limit` characters (anything else
    goes to RequestChecks.id_problem, which says what is wrong)."""
    return value.__class__ is str and 0 < len(value) <= limit and value.isprintable()


class RequestChecks:
    """Refuses malformed requests with InvalidArgumentError naming every violation; holds no pacing state."""

    def __init__(self, limits: Limits, group_sizes: Sequence[int], continue_restored: bool):
        self.limits = limits
        self._datasets = len(group_sizes)
        self.continue_restored = continue_restored  # rollout.continue_restored: the LEASE_EXPIRED refusal says it

    def id_problem(self, value: Any, limit: Optional[int] = None) -> Optional[str]:
        """What is wrong with an id (None: nothing); `limit` defaults to server.max_id_length."""
        limit = self.limits.max_id_length if limit is None else limit
        if well_formed_id(value, limit):
            return None
        if not isinstance(value, str) or not value:
            return "must be a non-empty string"
        if len(value) > limit:
            return f"is {len(value)} characters long; at most {limit} are allowed"
        if not value.isprintable():
            return "must not contain control or non-printable characters"
        return None

    def check_request_id(self, request_id: Any) -> None:
        """A non-empty request_id is kept in the replay cache: bound its length and refuse control characters.
        (AnswerBook, which keeps them, calls it only for an id that well_formed_id does not pass.)"""
        problem = self.id_problem(request_id, self.limits.max_opaque_id_length)
        if problem:
            raise InvalidArgumentError(f"request_id {problem}", violations=[("request_id", problem)])

    def check_lease_id(self, lease_id: Any) -> None:
        problem = self.id_problem(lease_id, self.limits.max_opaque_id_length)
        if problem:  # before the id is echoed in any message
            raise InvalidArgumentError(f"lease_id {problem}", violations=[("lease_id", problem)])

    def check_candidates(self, candidates: Sequence[PromptRef], inflight: Mapping[str, Any],
                         kept: Container[str] = ()) -> None:
        """Every candidate well-formed, named once, configured, not in flight and not kept for continuation;
        else nothing is admitted."""
        limit = self.limits.max_candidates
        if len(candidates) > limit:
            raise InvalidArgumentError(f"{len(candidates)} candidates in one Dispatch; at most {limit} are allowed",
                                       violations=[("candidates", f"at most {limit} candidates per call")])
        datasets, max_length = self._datasets, self.limits.max_id_length
        # The usual request, every candidate well formed, named once, new and configured, told in one pass; the
        # loop below says what is wrong with each candidate of any other.
        seen: set[str] = set()
        for ref in candidates:
            prompt_id, ds_index = ref.prompt_id, ref.ds_index
            if not (well_formed_id(prompt_id, max_length)
                    and prompt_id not in seen and prompt_id not in inflight and prompt_id not in kept
                    and ds_index.__class__ is int and 0 <= ds_index < datasets):
                break
            seen.add(prompt_id)
        else:
            return
        violations: list[tuple[str, str]] = []
        seen = set()
        for i, ref in enumerate(candidates):
            prompt_id, ds_index = ref.prompt_id, ref.ds_index
            problem = self.id_problem(prompt_id)
            if problem is None:
                if prompt_id in seen:
                    problem = f"{prompt_id!r} is named twice in this request"
                elif prompt_id in inflight:
                    problem = f"{prompt_id!r} is already in flight"
                elif prompt_id in kept:
                    problem = (f"{prompt_id!r} is kept for continuation (restored by a Reset, or released from a "
                               f"worker); it is re-offered by Dispatch (max_continuations)")
                seen.add(prompt_id)
            if problem is not None:
                violations.append((f"candidates[{i}].prompt_id", problem))
            if not (isinstance(ds_index, int) and 0 <= ds_index < datasets):
                violations.append((f"candidates[{i}].ds_index",
                                   f"{ds_index!r} is not configured; allowed: 0..{datasets - 1}"))
        if violations:
            raise refused("Dispatch", "admitted", violations)

    def check_max_continuations(self, count: Any) -> None:
        """None (re-offer as many kept groups as candidates) or an integer >= 0."""
        if count is not None and not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise InvalidArgumentError(f"max_continuations {count!r} must be an integer >= 0",
                                       violations=[("max_continuations", "must be an integer >= 0")])

    def check_keep_alive(self, prompt_ids: Sequence[Any]) -> None:
        """KeepAlive names at most max_dispatch_candidates running groups, each a valid id (none: a heartbeat alone,
        as a trainer holding leases sends)."""
        limit = self.limits.max_candidates
        if len(prompt_ids) > limit:
            raise InvalidArgumentError(
                f"KeepAlive names {len(prompt_ids)} prompt ids; at most {limit} are allowed",
                violations=[("prompt_ids", f"at most {limit} prompt ids per call")])
        violations = [(f"prompt_ids[{i}]", problem) for i, prompt_id in enumerate(prompt_ids)
                      if (problem := self.id_problem(prompt_id)) is not None]
        if violations:
            raise refused("KeepAlive", "renewed", violations)

    @staticmethod
    def check_fence_targets(dispatch_seqs: Mapping[str, int], trajectories: Sequence[Trajectory]) -> None:
        """Refuse a fence for a group the Submit carries nothing of: its sender's mistake, which would leave the
        Submit unfenced (the fence itself is checked against the running dispatches: `InflightTable.check_fences`)."""
        carried = {t.prompt_id for t in trajectories}
        absent = [prompt_id for prompt_id in dispatch_seqs if prompt_id not in carried]
        if absent:
            raise InvalidArgumentError(
                f"dispatch_seqs names prompt {absent[0]!r}, which no trajectory of this Submit belongs to; name the "
                f"groups whose trajectories the Submit carries, each with the seq its Dispatch answered",
                violations=[(f"dispatch_seqs[{p!r}]", "no trajectory of this Submit belongs to this prompt")
                            for p in absent])

    def check_submit_size(self, trajectories: Sequence[Trajectory]) -> None:
        limit = self.limits.max_trajectories
        if len(trajectories) > limit:
            raise InvalidArgumentError(f"{len(trajectories)} trajectories in one Submit; at most {limit} are allowed",
                                       violations=[("trajectories", f"at most {limit} per call")])

    def sort_submit(self, trajectories: Sequence[Trajectory], accepted: Mapping[str, Trajectory | tuple],
                    inflight: Mapping[str, Any], expired_prompts: Collection[str],
                    generation_prompts: Collection[str], past_generations: Iterable[Collection[str]],
                    dispatch_seqs: Optional[Mapping[str, int]] = None) -> SubmitSorting:
        """Sort a Submit's trajectories: new, duplicate, or refused (and why); reads the queue, changes nothing.
        `dispatch_seqs`: the Submit's fences, which tell new work under an earlier dispatch's ids from a retry."""
        self.check_submit_size(trajectories)
        sorting = SubmitSorting()
        violations, fresh, added_per_group = sorting.violations, sorting.fresh, sorting.added_per_group
        in_batch: dict[str, Trajectory] = {}
        max_id = self.limits.max_id_length
        good_pid = None  # the last prompt id found well formed: a Submit's trajectories usually share one
        for i, t in enumerate(trajectories):
            tid, pid, reward = t.trajectory_id, t.prompt_id, t.reward
            # The usual trajectory is told well formed in one test (every submitted one is checked on the loop);
            # anything else gets the checks that name what is wrong.
            if not (well_formed_id(tid, max_id) and (pid == good_pid or well_formed_id(pid, max_id))
                    and t.status.__class__ is TrajectoryStatus and t.status in _VALID_STATUS_SET
                    and reward.__class__ is float and reward - reward == 0.0):
                problems = self._trajectory_problems(i, t)
                if problems:
                    violations += problems
                    continue
                if t.status.__class__ is not TrajectoryStatus:  # an in-process caller's number: the core compares
                    t.status = TrajectoryStatus(t.status)  # statuses by identity (filters, gates)
            good_pid = pid
            earlier = accepted.get(tid) or in_batch.get(tid)
            if earlier is not None:
                if not t.same_content(earlier):
                    violations.append((f"trajectories[{i}].trajectory_id",
                                       f"{tid!r} was already accepted with different content" if tid in accepted
                                       else f"{tid!r} comes twice in this Submit, with different content"))
                    continue
                group = inflight.get(pid) if tid not in in_batch else None
                if group is not None and tid not in group.trajectories:
                    # An earlier dispatch's trajectory while a later dispatch runs. Fenced to that later dispatch it
                    # is new work under a reused id (a retry of the earlier Submit names the earlier seq, which the
                    # fence refuses); unfenced it may be a late retry: a duplicate, said in the log (Intake).
                    if dispatch_seqs and dispatch_seqs.get(pid) == group.seq:
                        violations.append((f"trajectories[{i}].trajectory_id",
                                           f"{tid!r} repeats a trajectory an earlier dispatch of prompt {pid!r} "
                                           f"brought in this generation, yet the Submit is for its running dispatch "
                                           f"seq {group.seq}; trajectory ids must be unique within a generation: give "
                                           f"the new trajectories new ids"))
                        continue
                    sorting.earlier_dispatch.append((tid, pid, group.seq))
                sorting.duplicates += 1
                continue
            group = inflight.get(pid)
            if group is None:
                if pid in expired_prompts:
                    sorting.expired.append(pid)
                elif pid in generation_prompts:
                    violations.append((f"trajectories[{i}].prompt_id", f"{pid!r} names a group already complete "
                                       f"and collected; it takes no more trajectories"))
                elif any(pid in past for past in past_generations):
                    sorting.stale.append(pid)
                else:
                    sorting.unknown.append(pid)
                continue
            if t.ds_index != group.ds_index:
                violations.append((f"trajectories[{i}].ds_index", f"{t.ds_index!r} differs from the prompt's "
                                   f"ds_index {group.ds_index}"))
                continue
            added = added_per_group.get(pid, 0) + 1
            if len(group.trajectories) + added > group.group_size:
                violations.append((f"trajectories[{i}].prompt_id", f"group {pid!r} would hold more than its "
                                   f"{group.group_size} trajectories"))
                continue
            added_per_group[pid] = added
            in_batch[tid] = t
            fresh.append(t)
        return sorting

    def _trajectory_problems(self, i: int, t: Trajectory) -> list[tuple[str, str]]:
        """Every violation of a submitted trajectory's ids, status and reward, by field."""
        field_name = f"trajectories[{i}]"
        problems = []
        for name in ("trajectory_id", "prompt_id"):
            problem = self.id_problem(getattr(t, name))
            if problem:
                problems.append((f"{field_name}.{name}", problem))
        if t.status not in VALID_STATUSES:
            problems.append((f"{field_name}.status",
                             f"{wire_status(t.status)} is not allowed; use {ALLOWED_STATUSES}"))
        if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
            problems.append((f"{field_name}.reward", f"{t.reward!r} is not allowed; it must be a finite number"))
        return problems

    def check_room(self, held_bytes: int, incoming_bytes: int, buffered: int, completing: int) -> None:
        """Refuse a Submit that would overfill the byte budget or the pipeline buffer (retryable)."""
        max_bytes, max_buffered = self.limits.max_held_bytes, self.limits.max_buffered_groups
        if max_bytes and held_bytes + incoming_bytes > max_bytes:
            raise ResourceExhaustedError(
                f"Submit refused, nothing accepted: {held_bytes} bytes are held and this Submit brings "
                f"{incoming_bytes} more, over server.max_held_bytes = {max_bytes}; retry after the trainer "
                f"collects", retry_after=RESOURCE_RETRY_SECONDS, reason="BYTES_FULL")
        if max_buffered and completing and buffered + completing > max_buffered:
            raise ResourceExhaustedError(
                f"Submit refused, nothing accepted: the pipeline buffer holds {buffered} groups and this "
                f"Submit completes {completing} more, over server.max_buffered_groups = {max_buffered}; "
                f"retry after the trainer collects", retry_after=RESOURCE_RETRY_SECONDS, reason="BUFFER_FULL")

    def check_collect(self, num_groups: Any, lease_seconds: Any = 0.0, shape: BatchShape = PLAIN,
                      holder: str = "", named_at_grant: bool = False) -> int:
        """Checks a Collect; returns the groups it asks for at most (with a token budget, 0 is the server's limit)."""
        limit = self.limits.max_collect
        if shape.token_budget and num_groups == 0:
            num_groups = limit
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or not 1 <= num_groups <= limit:
            raise InvalidArgumentError(f"num_groups {num_groups!r} is out of range; allowed: 1..{limit}",
                                       violations=[("num_groups", f"must be an integer in 1..{limit}")])
        if not (isinstance(lease_seconds, (int, float)) and math.isfinite(lease_seconds) and lease_seconds >= 0):
            raise InvalidArgumentError(f"lease_seconds {lease_seconds!r} must be a finite number >= 0 (0: no lease)",
                                       violations=[("lease_seconds", "must be a finite number >= 0")])
        if holder and not lease_seconds:
            raise InvalidArgumentError(
                "release_when_silent applies to a leased Collect (lease_seconds > 0): without a lease the groups are "
                "consumed as they are answered", violations=[("release_when_silent", "needs lease_seconds > 0")])
        if named_at_grant and not holder:
            raise InvalidArgumentError(
                "named_at_grant applies to a lease its holder's silence ends: set release_when_silent too (with a "
                "client id and lease_seconds > 0)", violations=[("named_at_grant", "needs release_when_silent")])
        if shape.rank and shape.world_size <= 1:
            # Before the plain return: a single consumer's Collect (world_size 0 or 1) that names a rank would
            # otherwise be answered as if the rank were 0, the whole mini-batch to one of several ranks.
            raise InvalidArgumentError(
                f"rank {shape.rank} needs world_size > {shape.rank}: world_size 0 (unset) or 1 is a single consumer, "
                f"whose rank is 0; allowed: rank in 0..world_size-1 with world_size > 1 for one rank of a "
                f"data-parallel trainer", violations=[("rank", "must be 0 when world_size is 0 or 1"),
                                                      ("world_size", f"must be > rank ({shape.rank}) to name a rank")])
        if shape.run:
            self.check_run(shape)
        if shape.plain:
            return num_groups
        if shape.token_budget < 0:
            raise InvalidArgumentError(f"token_budget {shape.token_budget} must be >= 0 (0: cut by num_groups)",
                                       violations=[("token_budget", "must be >= 0")])
        if not 1 <= shape.world_size <= num_groups:
            raise InvalidArgumentError(
                f"world_size {shape.world_size} must be in 1..num_groups ({num_groups}): every rank gets whole "
                f"groups, at least one", violations=[("world_size", f"must be in 1..{num_groups}")])
        if not 0 <= shape.rank < shape.world_size:
            raise InvalidArgumentError(f"rank {shape.rank} must be in 0..{shape.world_size - 1}: world_size is "
                                       f"{shape.world_size}, and rank must be below it",
                                       violations=[("rank", f"must be in 0..world_size-1 (0..{shape.world_size - 1})")])
        if shape.world_size > 1 and not shape.token_budget and num_groups % shape.world_size:
            raise InvalidArgumentError(
                f"num_groups {num_groups} is not a multiple of world_size {shape.world_size}: each rank gets the "
                f"same number of groups (or cut by token_budget)",
                violations=[("num_groups", f"must be a multiple of world_size ({shape.world_size})")])
        if shape.world_size > 1 and not lease_seconds:
            raise InvalidArgumentError(
                "a rank's Collect (world_size > 1) must be leased: the other ranks' shares wait under a lease and "
                "go back to the buffer if no rank takes them", violations=[("lease_seconds", "must be > 0")])
        return num_groups

    def check_run(self, shape: BatchShape) -> None:
        """A run names a data-parallel launch of ranks: a rank's Collect only, an id as ids are."""
        if shape.world_size <= 1:
            # A single consumer has no shares of other ranks to keep in step: a run would silently do nothing.
            raise InvalidArgumentError(
                "run applies to a data-parallel rank's Collect (world_size > 1): it names the launch of the ranks, so "
                "that ranks started again together all begin at one new global mini-batch; a single consumer "
                "(world_size 0 or 1) sends none", violations=[("run", "needs world_size > 1")])
        problem = self.id_problem(shape.run)
        if problem:
            raise InvalidArgumentError(f"run {problem}", violations=[("run", problem)])

    @staticmethod
    def check_weight_version(weight_version: Any, current: int) -> None:
        """A new weight version: an integer, never below the current one (None: the current one, kept)."""
        if weight_version is None:
            return
        if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < current:
            behind = ("" if not isinstance(weight_version, int) or isinstance(weight_version, bool) else
                      "; the server is at a newer weight version than the trainer: a trainer restarted from an older "
                      "checkpoint must restore first (a Restore call with the pacer checkpoint saved with it; in "
                      "Python, PacerClient.restore)")
            raise InvalidArgumentError(f"weight_version {weight_version!r} must be an integer >= the current "
                                       f"{current}{behind}", violations=[("weight_version", f"must be >= {current}")])

    @staticmethod
    def reset_mode(mode: Any) -> ResetMode:
        mode = ResetMode(mode) if mode in ResetMode._value2member_map_ else mode
        if mode not in (ResetMode.UNSPECIFIED, ResetMode.ABORT, ResetMode.WAIT):
            raise InvalidArgumentError(f"reset mode {mode!r} is not allowed; use ABORT or WAIT",
                                       violations=[("mode", "must be ABORT, WAIT or unspecified (server default)")])
        return mode


class CollectLimit:
    """The most groups that can ever be buffered at once (`limit`, 0: no bound known), and the terms that say
    why: the window C for a strategy that promises to stay within it, server.max_buffered_groups when set. A
    Collect that must wait for more could never be answered, so it is refused at once."""

    __slots__ = ("limit", "terms")

    def __init__(self, config: Any, hooks: Any, limits: Limits):
        bounds: list[tuple[int, str]] = []
        if getattr(hooks, "bounded_by_window", False):
            source = config.data_sources[0]
            B, stale = int(source.num_prompts_per_step), float(config.fully_async.stale_steps)
            sizes = ",".join(str(int(s.num_trajectories_per_prompt)) for s in config.data_sources)
            C = window_size(config)
            bounds.append((C, f"the window holds at most C = int(B * (1 + stale_steps)) = int({B} * (1 + {stale:g})) "
                              f"= {C} groups running or buffered (B = num_prompts_per_step {B}, N = "
                              f"num_trajectories_per_prompt {sizes}, stale_steps {stale:g}, strategy "
                              f"{config.fully_async.sliding_window})"))
        if limits.max_buffered_groups:
            bounds.append((limits.max_buffered_groups,
                           f"server.max_buffered_groups caps the buffer at {limits.max_buffered_groups} groups"))
        self.limit, self.terms = min(bounds) if bounds else (0, "")

    def check(self, num_groups: int, allow_partial: bool, shape: BatchShape = PLAIN, buffered: int = 0) -> None:
        """A Collect that must have `num_groups` buffered at once (no allow_partial, no token budget) is refused
        when that many can never be: it would wait forever, silently. `buffered`: what the buffer holds now, which
        leased groups given back can take past the bound; a Collect it answers now is not refused. (A token budget
        the buffer cannot reach takes what a full buffer holds, see Delivery; its ranks must each get a group.)"""
        limit = self.limit
        if shape.token_budget and limit and shape.world_size > limit:  # each rank's share holds a group at least
            raise InvalidArgumentError(
                f"world_size {shape.world_size} ranks can never each get a group of one token-budget mini-batch: "
                f"{self.terms}; at most {limit} ranks share one", violations=[("world_size", f"must be at most {limit}")])
        if not allow_partial and not shape.token_budget and limit and num_groups > max(limit, buffered):
            raise InvalidArgumentError(
                f"num_groups {num_groups} can never be buffered at once, so this Collect could never be answered: "
                f"{self.terms}; ask for at most {limit} groups a Collect (a mini-batch of at most {limit} x N "
                f"trajectories), raise the window, or pass allow_partial",
                violations=[("num_groups", f"must be at most {limit} ({self.terms})")])
