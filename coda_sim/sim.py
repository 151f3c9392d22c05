"""The simulated fully-async RL job, driving the real `coda_server.core.Pacer`, and the colocate baseline.

Actors (all on one simulated clock, no threads):
- generation workers: ask the pacer for as many groups as it admits and they have room for
  (sim.cluster.worker_max_groups, as a real worker's max_groups), generate their N trajectories on the
  generation pool, submit each trajectory when it ends; at a step boundary they abort (partial
  rollout) or finish (wait) what runs, and continue the groups the Reset restores;
- the trainer: collects M // N groups per fetch, trains (B x N) / M fetches per step, then runs the step
  boundary: Reset (pause, wait until every running group is assembled, restore / drop), weight sync,
  Resume with the next weight version.
"""
from __future__ import annotations

import math
import time as _time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from coda_server.core import Pacer, PromptRef, ResetMode, Trajectory, TrajectoryStatus
from coda_server.core.errors import StrategyHookError
from coda_server.core.filters import GroupFilter, create_filters
from coda_server.core.strategy import window_size
from coda_server.core.types import StepReport

from .engine import IDLE, EventQueue, GenerationPool, Request
from .workload import PromptSpec, Workload


class SimulationError(RuntimeError):
    """The simulation could not go on: a stall (nothing left to happen) or a broken invariant."""


class GroupRun:
    """The worker / data-source side of one prompt group, across dispatches."""

    __slots__ = ("spec", "reqs", "final", "seq", "dispatches", "generating")

    def __init__(self, spec: PromptSpec):
        self.spec = spec
        self.reqs = [Request(self, j, t, spec.slowdown) for j, t in enumerate(spec.trajs)]
        self.final: dict[int, Trajectory] = {}  # trajectories that ended (COMPLETED / FAILED): never regenerated
        self.seq = -1
        self.dispatches = 0
        self.generating = False  # dispatched, some trajectory not yet submitted: it takes a worker's room

    def trajectory_id(self, j: int) -> str:
        return f"{self.spec.prompt_id}_t{j}"


class _ObservedFilters(GroupFilter):
    """The configured filters, applied as the pacer applies them (all must keep), with each verdict recorded.

    The pacer runs its filters on every group that leaves the trajectory queue, so this tells the
    simulated workers which groups moved on (to the buffer, or dropped) without changing what happens.
    """

    def __init__(self, inner: list[GroupFilter], moves: list[tuple[str, bool]]):
        super().__init__(None)
        self.inner = inner
        self.moves = moves

    def keep(self, group) -> bool:
        kept = all(f.keep(group) for f in self.inner)
        self.moves.append((next(iter(group.values())).prompt_id, kept))
        return kept


@dataclass
class StepRecord:
    step: int
    started: float
    ended: float = 0.0
    boundary_at: float = 0.0  # the trainer finished its last fetch; Reset begins
    paused_at: float = 0.0  # every running group assembled (reset ready, or wait timeout)
    trainer_wait: float = 0.0
    dispatched_before_boundary: int = 0  # pacer total `dispatched` when the Reset began
    consumed_tokens: float = 0.0  # response tokens of the trajectories the trainer took this step
    masked_tokens: float = 0.0  # of those, generated before the trajectory's last abort (masked out)
    report: StepReport = field(default_factory=StepReport)

    @property
    def duration(self) -> float:
        return self.ended - self.started


@dataclass
class RunResult:
    """Raw outcome of one simulated run; `coda_sim.report.summarize` turns it into the metrics."""

    strategy: str
    stale_steps: float
    capacity: int
    batch_groups: int
    group_size: int
    partial: bool
    seed: int
    steps: list[StepRecord]
    sim_time: float
    trainer_busy: float
    trainer_wait: float
    pause_wait: float
    sync_time: float
    slot_seconds_busy: float
    total_slots: int
    tokens_generated: float
    tokens_wasted: float
    staleness: Counter
    partial_consumed: int
    consumed_trajectories: int
    consumed_nominal_tokens: int
    population_trajectories: int
    population_nominal_tokens: int
    buffered_integral: float
    running_integral: float
    totals: dict
    final_running: int
    final_buffered: int
    final_candidates: int
    prompts_created: int
    fates: Counter  # consumed / filtered / dropped, per unique prompt
    events: int
    wall_seconds: float
    replicas: int = 1
    preemptions: int = 0
    prefill_tokens: float = 0.0
    reprefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, running, buffered, admissible)
    colocate: Optional["ColocateResult"] = None
    colocate_partial: Optional["ColocateResult"] = None


@dataclass
class ColocateResult:
    step_times: list[float]
    gen_times: list[float]
    train_times: list[float]
    regenerated_groups: int  # groups the filters dropped, generated again
    slot_seconds_busy: float
    total_slots: int
    partial: bool = False  # partial rollout: the groups still running when B are accepted are continued
    consumed_tokens: list[float] = field(default_factory=list)  # response tokens trained on, per step
    masked_tokens: list[float] = field(default_factory=list)  # of those, generated before a last abort
    restored_groups: int = 0  # groups carried into the next step (partial)
    discarded_groups: int = 0  # groups cancelled and thrown away when B were accepted (not partial)
    tokens_wasted: float = 0.0

    @property
    def avg_step_time(self) -> float:
        """Mean step time excluding step 0 (as the async figures; the partial baseline starts with no carry-over)."""
        steady = self.step_times[1:] or self.step_times
        return sum(steady) / len(steady) if steady else 0.0

    @property
    def useful_throughput(self) -> float:
        """Unmasked response tokens trained per second, excluding step 0."""
        time = sum(self.step_times[1:] or self.step_times)
        tokens = self.consumed_tokens[1:] or self.consumed_tokens
        masked = self.masked_tokens[1:] or self.masked_tokens
        return (sum(tokens) - sum(masked)) / time if time > 0 else 0.0


# Trainer phases.
_WAIT, _TRAIN, _RESET, _SYNC, _FINISHED = "wait", "train", "reset", "sync", "finished"


class AsyncSimulation:
    """One run: a pacer configuration (strategy, stale_steps, rollout.partial, filters) on a workload."""

    def __init__(self, pacer_config: Any, workload: Workload, steps: int, *, check_invariants: bool = False,
                 record_timeline: bool = False, on_step: Optional[Callable[[int, int], None]] = None):
        if steps < 1:
            raise ValueError(f"steps = {steps!r}: must be >= 1")
        self.config = pacer_config
        self.workload = workload
        self.steps_wanted = steps
        self.check_invariants = check_invariants
        self.record_timeline = record_timeline
        self.on_step = on_step
        source = pacer_config.data_sources[0]
        self.B = int(source.num_prompts_per_step)
        self.N = int(source.num_trajectories_per_prompt)
        self.M = int(pacer_config.trainer.mini_batch_size)
        if len(pacer_config.data_sources) != 1:
            raise SimulationError("coda-sim models one data source; configure exactly one in data_sources")
        if self.M % self.N:
            raise SimulationError(f"trainer.mini_batch_size = {self.M}: the simulator needs a multiple of "
                                  f"num_trajectories_per_prompt ({self.N}) so a fetch takes whole groups")
        if self.N == 1 and "reward" in list(pacer_config.rollout.filter):
            raise SimulationError("the reward filter drops every group of one trajectory (its rewards are all equal); "
                                  "use num_trajectories_per_prompt >= 2 or drop 'reward' from rollout.filter")
        self.fetch_groups = self.M // self.N
        self.fetches_per_step = (self.B * self.N) // self.M
        self.partial = bool(pacer_config.rollout.partial)
        self.mode = ResetMode.ABORT if self.partial else ResetMode.WAIT

        self.events = EventQueue()
        self.moves: list[tuple[str, bool]] = []
        filters = [_ObservedFilters(create_filters(list(pacer_config.rollout.filter), pacer_config), self.moves)]
        self.pacer = Pacer(pacer_config, filters=filters, clock=lambda: self.events.now)
        self.strategy = str(pacer_config.fully_async.sliding_window)
        self.capacity = window_size(pacer_config)
        self.pool = GenerationPool(self.events, workload, workload.replicas, self._request_done, self._first_token)

        self.inflight: dict[str, GroupRun] = {}  # dispatched in the current generation, not collected
        self.waiting_fate: dict[str, GroupRun] = {}  # collected by the pacer (buffer), not yet consumed
        self.candidates: deque[GroupRun] = deque()  # restored groups waiting to be dispatched again
        self.next_number = 0
        self.version = 0
        self.phase = _WAIT
        self.fetches_done = 0
        self.phase_since = 0.0
        self.steps: list[StepRecord] = [StepRecord(0, 0.0)]
        self.trainer_busy = self.trainer_wait = self.pause_wait = self.sync_time = 0.0
        self.staleness: Counter = Counter()
        self.partial_consumed = self.consumed_trajectories = self.consumed_nominal = 0
        self.population_trajectories = self.population_nominal = 0
        self.tokens_wasted = 0.0
        self.fates: Counter = Counter()
        self.events_handled = 0
        self._last_observed = (0.0, 0, 0)
        self.buffered_integral = self.running_integral = 0.0
        self.timeline: list[tuple[float, int, int, int]] = []
        self._reset_ticket = 0
        self._drawn_this_step = 0
        self._runaway_limit = 100 * max(self.capacity, self.B)  # fresh prompts per step before giving up
        self._filtered_at_boundary = 0  # fates["filtered"] when the step began
        # The workers' room (a real worker proposes at most max_groups - the groups it generates): without it a
        # strategy not bounded by C would be proposed every prompt it admits.
        self.max_groups = workload.worker_max_groups or 2 * max(self.capacity, self.B)
        self._generating = 0  # groups with a trajectory still to submit (GroupRun.generating)
        self._dirty = True  # the pacer changed since it was last asked what it admits
        # Newer cores answer "what would Dispatch admit now" without building a result; else peek.
        self._admissible_now = getattr(self.pacer, "admissible_now", None)

    # ------------------------------------------------------------------ main loop

    def run(self) -> RunResult:
        started = _time.perf_counter()
        events = self.events
        try:
            self._settle()
            while self.phase != _FINISHED:
                item = events.pop()
                if item is None:
                    raise SimulationError(self._stall_message())
                fn, args = item
                if fn(*args) is False:
                    continue  # superseded event
                self.events_handled += 1
                self._settle()
        except StrategyHookError as exc:  # a server reports it and goes on; a simulation of it would mean nothing
            raise SimulationError(self._hook_message(exc)) from exc
        return self._result(_time.perf_counter() - started)

    def _settle(self) -> None:
        """After every event: let the trainer collect and the workers dispatch until nothing changes.

        The pacer is only asked when something it knows changed since the last answer (`_dirty`).
        """
        pacer = self.pacer
        if self.phase == _FINISHED:  # the last Resume: the run ends here, nothing new starts
            self._observe()
            return
        while self._dirty:
            self._dirty = False
            collected = self._try_collect()
            want = min(self._admissible(), self.max_groups - self._generating)
            if want > 0:
                self._dispatch(want)
                self._dirty = True
            elif collected:
                self._dirty = True
        if self.phase == _RESET and pacer.reset_ready():
            self._paused()
            self._dirty = True
        self._observe()

    def _admissible(self) -> int:
        if self._admissible_now is not None:
            return self._admissible_now()
        peek = self.pacer.dispatch([])
        return 0 if peek.paused else peek.remaining

    def _observe(self) -> None:
        now = self.events.now
        t0, running, buffered = self._last_observed
        self.running_integral += running * (now - t0)
        self.buffered_integral += buffered * (now - t0)
        running, buffered = len(self.inflight), len(self.waiting_fate)
        self._last_observed = (now, running, buffered)
        if self.record_timeline and (not self.timeline or self.timeline[-1][1:3] != (running, buffered)):
            self.timeline.append((now, running, buffered, self._admissible()))
        if self.check_invariants:
            state = self.pacer.state()
            if not state.invariant_holds():
                raise SimulationError(f"pacer invariant broken at t={now:.3f}: {state}")
            if state.running != running:
                raise SimulationError(f"at t={now:.3f} the pacer counts {state.running} running groups, "
                                      f"the simulated workers {running}")
            if state.buffered != buffered:
                raise SimulationError(f"at t={now:.3f} the pacer buffers {state.buffered} groups, "
                                      f"the simulation expects {buffered}")
            generating = sum(g.generating for g in self.inflight.values())
            if generating != self._generating or generating > self.max_groups:
                raise SimulationError(f"at t={now:.3f} the workers count {self._generating} groups generating, "
                                      f"{generating} are (room for {self.max_groups})")

    # ------------------------------------------------------------------ workers

    def _dispatch(self, want: int) -> None:
        """Propose `want` groups (restored ones first, then fresh prompts) and start what is admitted."""
        groups: list[GroupRun] = []
        while self.candidates and len(groups) < want:
            groups.append(self.candidates.popleft())
        while len(groups) < want:
            groups.append(self._new_group())
        refs = [PromptRef(g.spec.prompt_id, 0, g.spec.epoch, g.spec.index) for g in groups]
        result = self.pacer.dispatch(refs)
        self._drain_moves()  # a dispatch re-examines groups the gate held
        admitted = result.admitted
        for g in reversed(groups[len(admitted):]):  # not admitted: first in line next time
            self.candidates.appendleft(g)
        finals: list[Trajectory] = []
        for a, g in zip(admitted, groups):
            if a.prompt_id != g.spec.prompt_id:
                raise SimulationError(f"Dispatch admitted {a.prompt_id!r} where {g.spec.prompt_id!r} was proposed")
            g.seq = a.seq
            g.dispatches += 1
            self.inflight[g.spec.prompt_id] = g
            if len(g.final) < len(g.reqs):
                g.generating = True
                self._generating += 1
            for req in g.reqs:
                if req.j in g.final:
                    finals.append(g.final[req.j])
                else:
                    self.pool.start(req)
        if finals:
            self._submit(finals)
        if not admitted:
            raise SimulationError(f"Dispatch admitted none of {want} candidates although {want} were admissible")

    def _new_group(self) -> GroupRun:
        self._drawn_this_step += 1
        if self._drawn_this_step > self._runaway_limit:
            raise SimulationError(self._runaway_message(self._drawn_this_step - 1))
        spec = self.workload.prompt(self.next_number)
        self.next_number += 1
        self.population_trajectories += len(spec.trajs)
        self.population_nominal += spec.nominal_tokens
        return GroupRun(spec)

    def _first_token(self, req: Request) -> None:
        req.start_version = self.version

    def _request_done(self, req: Request) -> None:
        g: GroupRun = req.owner
        spec = req.spec
        t = Trajectory(g.trajectory_id(req.j), g.spec.prompt_id, 0, spec.status, spec.reward,
                       req.start_version if req.start_version is not None else self.version, self.version,
                       len(spec.turns), num_tokens=spec.tokens)
        g.final[req.j] = t
        if g.generating and len(g.final) == len(g.reqs):  # its last trajectory: the worker has room again
            g.generating = False
            self._generating -= 1
        self._submit([t])

    def _submit(self, trajectories: list[Trajectory]) -> None:
        self.pacer.submit(trajectories)
        self._dirty = True
        self._drain_moves()

    def _drain_moves(self) -> None:
        """Groups that left the pacer's trajectory queue: into the buffer (kept) or dropped by a filter."""
        for prompt_id, kept in self.moves:
            g = self.inflight.pop(prompt_id, None)
            if g is None:
                raise SimulationError(f"the pacer collected {prompt_id!r}, which is not running")
            if kept:
                self.waiting_fate[prompt_id] = g
            else:
                self.fates["filtered"] += 1
                self.workload.forget(g.spec.number)
        self.moves.clear()

    # ------------------------------------------------------------------ trainer

    def _try_collect(self) -> bool:
        if self.phase != _WAIT:
            return False
        result = self.pacer.collect_now(self.fetch_groups)
        if not result.groups:
            return False
        now = self.events.now
        waited = now - self.phase_since
        self.trainer_wait += waited
        self.steps[-1].trainer_wait += waited
        tokens = trajectories = 0
        record = self.steps[-1]
        mask = self.workload.mask_partial_tokens
        for group in result.groups:
            g = self.waiting_fate.pop(group.prompt_id, None)
            if g is None:
                raise SimulationError(f"the trainer got group {group.prompt_id!r}, which no worker generated")
            self.fates["consumed"] += 1
            for req in g.reqs:
                record.consumed_tokens += req.spec.tokens
                if mask:
                    record.masked_tokens += req.masked_tokens
            for t in group.trajectories:
                self.staleness[self.version - t.start_weight_version] += 1
                if t.start_weight_version != t.end_weight_version:
                    self.partial_consumed += 1
            self.consumed_trajectories += len(group.trajectories)
            self.consumed_nominal += g.spec.nominal_tokens
            tokens += sum(t.tokens for t in g.spec.trajs)
            trajectories += len(group.trajectories)
            self.workload.forget(g.spec.number)
        self._dirty = True
        seconds = self.workload.train_seconds(self.workload.trainer_tokens(tokens, trajectories))
        self.trainer_busy += seconds
        self.phase, self.phase_since = _TRAIN, now
        self.events.after(seconds, self._trained)
        return True

    def _trained(self) -> None:
        self._dirty = True
        self.fetches_done += 1
        now = self.events.now
        if self.fetches_done < self.fetches_per_step:
            self.phase, self.phase_since = _WAIT, now
            return
        self.fetches_done = 0
        record = self.steps[-1]
        record.boundary_at = now
        record.dispatched_before_boundary = self.pacer.state().dispatched
        self.pacer.begin_reset(self.mode)
        self._dirty = True
        self.phase, self.phase_since = _RESET, now
        self._reset_ticket += 1
        if self.mode == ResetMode.ABORT:
            self.events.after(self.workload.abort_latency_s, self._abort_running, self._reset_ticket)
        elif self.workload.wait_timeout_s > 0:
            self.events.after(self.workload.wait_timeout_s, self._wait_timeout, self._reset_ticket)

    def _abort_running(self, ticket: int) -> Optional[bool]:
        if ticket != self._reset_ticket or self.phase != _RESET:
            return False
        aborted = self.pool.abort_all()
        self._none_generating()  # every request aborted is submitted now
        trajectories = []
        for req in aborted:
            g: GroupRun = req.owner
            start = req.start_version if req.start_version is not None else self.version
            trajectories.append(Trajectory(g.trajectory_id(req.j), g.spec.prompt_id, 0, TrajectoryStatus.ABORTED,
                                           0.0, start, self.version, req.turn, num_tokens=int(req.tokens_done)))
        if trajectories:
            self._submit(trajectories)
        return None

    def _wait_timeout(self, ticket: int) -> Optional[bool]:
        if ticket != self._reset_ticket or self.phase != _RESET:
            return False
        for g in list(self.inflight.values()):
            if len(g.final) < len(g.reqs):
                for req in g.reqs:
                    self.pool.cancel(req)
        self._paused()
        return None

    def _paused(self) -> None:
        """Every running group is assembled (or the wait gave up): finish the Reset, then sync weights."""
        now = self.events.now
        record = self.steps[-1]
        record.paused_at = now
        self.pause_wait += now - self.phase_since
        result = self.pacer.finish_reset(resume=False)
        self._dirty = True
        record.report = result.report
        restored_ids = [g.prompt_id for g in result.restored]
        for group in result.restored:
            g = self.inflight.pop(group.prompt_id, None)
            if g is None:
                raise SimulationError(f"Reset restored {group.prompt_id!r}, which is not running")
            for t in group.trajectories:
                j = int(t.trajectory_id.rsplit("_t", 1)[1])
                if t.status == TrajectoryStatus.ABORTED:
                    g.final.pop(j, None)
                    if g.reqs[j].phase not in (IDLE,):
                        raise SimulationError(f"restored trajectory {t.trajectory_id!r} is still generating")
                else:
                    g.final[j] = t
            self.candidates.append(g)
        for prompt_id in result.dropped_prompt_ids:
            g = self.inflight.pop(prompt_id, None)
            if g is None:
                raise SimulationError(f"Reset dropped {prompt_id!r}, which is not running")
            for req in g.reqs:
                self.pool.cancel(req)
                self.tokens_wasted += req.tokens_done
            self.fates["dropped"] += 1
            self.workload.forget(g.spec.number)
        if self.inflight:
            raise SimulationError(f"after Reset (restored {restored_ids[:5]} ...), groups "
                                  f"{list(self.inflight)[:5]} are neither restored nor dropped")
        for g in self.candidates:  # restored groups take room again when dispatched again
            g.generating = False
        self._generating = 0
        self.phase, self.phase_since = _SYNC, now
        self.events.after(self.workload.weight_sync_s, self._synced)

    def _synced(self) -> None:
        now = self.events.now
        self.sync_time += now - self.phase_since
        self.version += 1
        self.pacer.resume(self.version)
        self._dirty = True
        record = self.steps[-1]
        record.ended = now
        if self.on_step is not None:
            self.on_step(len(self.steps), self.steps_wanted)
        if len(self.steps) >= self.steps_wanted:
            self.phase = _FINISHED
            return
        self.steps.append(StepRecord(len(self.steps), now))
        self._drawn_this_step = 0
        self._filtered_at_boundary = self.fates["filtered"]
        self.phase, self.phase_since = _WAIT, now

    # ------------------------------------------------------------------ results

    def _none_generating(self) -> None:
        for g in self.inflight.values():
            g.generating = False
        self._generating = 0

    def _runaway_message(self, started: int) -> str:
        """Why a step started prompts without end: the filters drop what is generated, or the strategy admits
        more than the trainer takes (only the workers' room bounds it)."""
        state = self.pacer.state()
        filtered = self.fates["filtered"] - self._filtered_at_boundary
        head = (f"no progress in step {len(self.steps) - 1}: {started} fresh prompts started since the last boundary, "
                f"the trainer took {self.fetches_done} of {self.fetches_per_step} fetches ({filtered} groups filtered "
                f"this step")
        if 2 * filtered >= started:
            return f"{head}); do the filters {list(self.config.rollout.filter)} drop (nearly) every group?"
        return (f"{head}, {state.buffered} buffered, {state.running} running); strategy {self.strategy!r} admits more "
                f"than the trainer takes ({self.B} groups a step; C = {self.capacity}): does its "
                f"compute_dispatch_count count the buffered groups (buf_qsize)? The workers' room "
                f"(sim.cluster.worker_max_groups = {self.max_groups}) bounds only the groups generating")

    def _hook_message(self, exc: StrategyHookError) -> str:
        """One line naming the strategy, the hook and what it raised (from the pacer's own incident record)."""
        cause = exc.__cause__
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        for incident in reversed(self.pacer.state().recent_incidents):
            if incident.hook == exc.hook and incident.strategy == exc.strategy:
                what = incident.message + (f" (group {incident.prompt_id!r})" if incident.prompt_id else "")
                break
        verb = "" if what.startswith("returned ") else "raised "  # a hook's wrong answer says "returned ..."
        return (f"strategy {exc.strategy!r} hook {exc.hook} {verb}{what} at t={self.events.now:.1f}s, step "
                f"{len(self.steps) - 1}; the simulation stops (a server records it as an incident: "
                f"docs/custom-strategies.md, 'When a hook raises')")

    def _stall_message(self) -> str:
        state = self.pacer.state()
        # Running groups with every trajectory submitted wait on the strategy's will_collect, not on the workers.
        held = sum(len(g.final) == len(g.reqs) for g in self.inflight.values())
        gate = f" ({held} of them complete, held by the strategy's will_collect)" if held else ""
        return (f"simulation stalled at t={self.events.now:.1f}s, step {len(self.steps) - 1}, trainer {self.phase}: "
                f"nothing left to happen (strategy {self.strategy!r}: running {state.running}{gate}, buffered "
                f"{state.buffered}, admissible {state.capacity}, C {state.window_size}); the trainer needs "
                f"{self.fetch_groups} buffered groups")

    def _result(self, wall: float) -> RunResult:
        now = self.events.now
        self._observe()
        state = self.pacer.state()
        if not state.invariant_holds():
            raise SimulationError(f"pacer invariant broken at the end: {state}")
        return RunResult(
            strategy=self.strategy, stale_steps=float(self.config.fully_async.stale_steps), capacity=self.capacity,
            batch_groups=self.B, group_size=self.N, partial=self.partial, seed=self.workload.seed, steps=self.steps,
            sim_time=now, trainer_busy=self.trainer_busy, trainer_wait=self.trainer_wait,
            pause_wait=self.pause_wait, sync_time=self.sync_time,
            slot_seconds_busy=self.pool.utilisation_until(now), total_slots=self.pool.total_slots,
            tokens_generated=self.pool.tokens_generated, tokens_wasted=self.tokens_wasted,
            staleness=self.staleness, partial_consumed=self.partial_consumed,
            consumed_trajectories=self.consumed_trajectories, consumed_nominal_tokens=self.consumed_nominal,
            population_trajectories=self.population_trajectories, population_nominal_tokens=self.population_nominal,
            buffered_integral=self.buffered_integral, running_integral=self.running_integral,
            totals={k: getattr(state, k) for k in ("dispatched", "submitted", "collected", "consumed", "filtered",
                                                   "restored", "dropped", "stale_rejected", "duplicates")},
            final_running=state.running, final_buffered=state.buffered, final_candidates=len(self.candidates),
            prompts_created=self.next_number, fates=self.fates, events=self.events_handled, wall_seconds=wall,
            replicas=len(self.pool.replicas), preemptions=self.pool.preemptions, prefill_tokens=self.pool.prefill_tokens,
            reprefill_tokens=self.pool.reprefill_tokens, prefill_seconds=self.pool.prefill_seconds,
            timeline=self.timeline,
        )


def run_colocate(pacer_config: Any, workload: Workload, steps: int, partial: bool = False) -> ColocateResult:
    """The synchronous baseline on all GPUs: generate until B groups pass the filters, train, switch.

    As a synchronous dynamic sampler does: dispatch `ceil(B x colocate.oversample)` groups, dispatch
    one more for every group the filters drop, and stop generating as soon as B groups are accepted.
    What still runs then is thrown away, or with `partial` aborted and continued first in the next
    step (its tokens so far masked when `sim.trainer.mask_partial_tokens`), like the groups accepted
    beyond B. Uses the same prompts (same numbers, same draws) as the fully-async runs and the core's
    own filters.
    """
    return _Colocate(pacer_config, workload, partial).run(steps)


class _Colocate:
    """The colocate baseline's state across steps (one generation pool on every GPU)."""

    def __init__(self, pacer_config: Any, workload: Workload, partial: bool):
        source = pacer_config.data_sources[0]
        self.B, self.N = int(source.num_prompts_per_step), int(source.num_trajectories_per_prompt)
        self.fetch_groups = max(1, int(pacer_config.trainer.mini_batch_size) // self.N)
        self.filter_names = list(pacer_config.rollout.filter)
        self.filters = create_filters(self.filter_names, pacer_config)
        self.workload = workload
        self.partial = partial
        self.events = EventQueue()
        self.pool = GenerationPool(self.events, workload, workload.colocate_replicas, self._request_done,
                                   self._first_token)
        self.version = 0
        self.number = 0
        self.carried: deque[GroupRun] = deque()  # restored by the last step (partial), continued first
        self.completed: deque[GroupRun] = deque()  # every trajectory ended, not yet judged by the filters
        self.result = ColocateResult([], [], [], 0, 0.0, self.pool.total_slots, partial)

    def _first_token(self, req: Request) -> None:
        req.start_version = self.version

    def _request_done(self, req: Request) -> None:
        g: GroupRun = req.owner
        g.final[req.j] = None  # only the count matters here
        if len(g.final) == len(g.reqs):
            self.completed.append(g)

    def _dispatch(self, count: int, running: dict[str, GroupRun]) -> None:
        for _ in range(count):
            if self.carried:
                g = self.carried.popleft()
            else:
                g = GroupRun(self.workload.prompt(self.number))
                self.number += 1
                self._fresh += 1
            running[g.spec.prompt_id] = g
            if len(g.final) == len(g.reqs):
                self.completed.append(g)
            for req in g.reqs:
                if req.j not in g.final:
                    self.pool.start(req)

    def _keeps(self, g: GroupRun) -> bool:
        view = {g.trajectory_id(j): Trajectory(g.trajectory_id(j), g.spec.prompt_id, 0, t.status, t.reward)
                for j, t in enumerate(g.spec.trajs)}
        return all(f.keep(view) for f in self.filters)

    def run(self, steps: int) -> ColocateResult:
        B, workload, events, result = self.B, self.workload, self.events, self.result
        for _ in range(steps):
            started = events.now
            self._fresh = 0
            accepted: list[GroupRun] = []
            running: dict[str, GroupRun] = {}
            refills = 0
            oversample = workload.colocate_partial_oversample if self.partial else workload.colocate_oversample
            self._dispatch(math.ceil(B * oversample - 1e-9), running)
            while len(accepted) < B:
                while self.completed and len(accepted) < B:
                    g = self.completed.popleft()
                    del running[g.spec.prompt_id]
                    if self._keeps(g):
                        accepted.append(g)
                    else:
                        result.regenerated_groups += 1
                        workload.forget(g.spec.number)
                        need = B - len(accepted) - len(running)
                        if need > 0:
                            refill = math.ceil(need * workload.colocate_refill_ratio - 1e-9)
                            if workload.colocate_max_refill:
                                refill = min(refill, workload.colocate_max_refill - refills)
                            if refill > 0:
                                refills += refill
                                self._dispatch(refill, running)
                if len(accepted) >= B:
                    break
                if self._fresh > 100 * B or not running:
                    raise SimulationError(f"colocate baseline: {self._fresh} fresh prompts in one step and only "
                                          f"{len(accepted)} of {B} groups passed the filters {self.filter_names}")
                item = events.pop()
                if item is None:
                    raise SimulationError("colocate baseline stalled: groups missing and no event pending")
                fn, args = item
                fn(*args)
            self._end_generation(running)
            generated = events.now - started
            train = tokens = masked = 0.0
            for i in range(0, len(accepted), self.fetch_groups):
                chunk = accepted[i:i + self.fetch_groups]
                chunk_tokens = sum(t.tokens for g in chunk for t in g.spec.trajs)
                train += workload.train_seconds(workload.trainer_tokens(chunk_tokens, self.N * len(chunk)))
                tokens += chunk_tokens
                if workload.mask_partial_tokens:
                    masked += sum(req.masked_tokens for g in chunk for req in g.reqs)
            for g in accepted:
                workload.forget(g.spec.number)
            train /= workload.colocate_trainer_speedup
            events.now += train + workload.colocate_switch_s
            self.version += 1
            result.gen_times.append(generated)
            result.train_times.append(train)
            result.step_times.append(events.now - started)
            result.consumed_tokens.append(tokens)
            result.masked_tokens.append(masked)
        result.slot_seconds_busy = self.pool.utilisation_until(events.now)
        return result

    def _end_generation(self, running: dict[str, GroupRun]) -> None:
        """B groups accepted: abort what runs and carry it over (partial), or throw it away."""
        leftovers = list(running.values())  # in dispatch order: unfinished groups, and complete ones not yet judged
        self.completed.clear()
        if self.partial:
            self.pool.abort_all()
            self.carried.extend(leftovers)
            self.result.restored_groups += len(leftovers)
        else:
            for g in leftovers:
                for req in g.reqs:
                    self.pool.cancel(req)
                    self.result.tokens_wasted += req.tokens_done
                self.workload.forget(g.spec.number)
            self.result.discarded_groups += len(leftovers)
        if not self.pool.idle:
            raise SimulationError("colocate baseline: requests still live after the generation phase")
        self.events.clear()  # every pending event belongs to a stopped request
