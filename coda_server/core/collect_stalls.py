"""The trainers' waits for groups: when one began, and the warning when it lasts while dispatch admits nothing."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from .types import TrajectoryStatus

if TYPE_CHECKING:
    from .pacer import Pacer

log = logging.getLogger("coda_server.pacing")


class CollectStalls:
    """The waiting Collects (asyncio face), as one wait of the trainers: it begins with the first Collect since groups
    were last taken (a trainer polls in short Collects, batches() every few seconds: its wait spans them), or after
    a pause longer than server.collect_stall_warning_seconds with none waiting (a trainer that stopped and came
    back), and ends when a Collect takes groups. Logged once if it lasts past that threshold while dispatch admits
    nothing."""

    def __init__(self, pacer: Pacer) -> None:
        self._pacer = pacer
        self._waiting: dict[int, int] = {}  # waiting Collects: id -> groups asked
        self._next_id = 0
        self._starved_since: Optional[float] = None  # when the trainers began waiting (None: none waits since)
        self._warned = False  # this wait was logged
        self._idle_since = 0.0  # when the last waiting Collect ended (none waits since)

    def begin(self, groups: int, now: float) -> int:
        """A Collect for `groups` starts waiting at `now`; returns its id for `end`."""
        self._next_id += 1
        if (self._starved_since is None or not self._waiting
                and now - self._idle_since > self._pacer.limits.collect_stall_warning_seconds):
            self._starved_since, self._warned = now, False
        self._waiting[self._next_id] = groups
        return self._next_id

    def end(self, wait_id: int, took_groups: bool, now: float) -> None:
        """The Collect `wait_id` ended at `now`, taking groups or not (then the trainers' wait goes on)."""
        del self._waiting[wait_id]
        self._idle_since = now
        if took_groups:
            self._starved_since, self._warned = None, False

    def warn_if_stalled(self, now: float) -> None:
        """Log, once per wait, trainers that have waited longer than server.collect_stall_warning_seconds for groups
        (in one Collect or a series of polls, none taking any) while dispatch admits nothing: the trainer waits on
        the window, which the warning spells out."""
        pacer = self._pacer
        threshold = pacer.limits.collect_stall_warning_seconds
        if not threshold or not self._waiting or self._warned or self._starved_since is None:
            return
        waited = now - self._starved_since
        if waited < threshold or pacer.admissible_now() > 0:
            return
        self._warned = True
        state = pacer.state()
        summary = state.config_summary
        asked = max(self._waiting.values())
        held, aborted = self._held_by_gate()
        bounded = bool(getattr(pacer.hooks, "bounded_by_window", False))
        sizes = summary.get("num_trajectories_per_prompt")
        if bounded:
            window = (f"window C = int(B * (1 + stale_steps)) = int({summary.get('num_prompts_per_step')} * (1 + "
                      f"{summary.get('stale_steps')})) = {state.window_size} groups (N = {sizes}, strategy "
                      f"{state.strategy})")
        else:  # a custom window that C does not bound (no bounded_by_window): the formula would mislead
            window = (f"window: strategy {state.strategy}'s own (compute_dispatch_count), admitting {state.capacity} "
                      f"now, not bounded by C = int(B * (1 + stale_steps)) (N = {sizes})")
        log.warning(
            "a trainer has waited %.0f s for groups (Collect for %d groups, in one call or several polls, none taking "
            "any) while dispatch admits nothing: %d buffered, %d running, %d leased%s; %s%s",
            waited, asked, state.buffered, state.running, state.leased,
            ", dispatch paused (Reset without resume?)" if state.paused else "", window,
            "" if state.paused else self._hint(state.strategy, state.running, state.buffered, held, aborted),
            extra={"fields": {"num_groups": asked, "waited_seconds": round(waited, 1),
                              "buffered": state.buffered, "running": state.running, "leased": state.leased,
                              "held_by_gate": held, "window_size": state.window_size,
                              "bounded_by_window": bounded}})

    def _held_by_gate(self) -> tuple[int, int]:
        """(complete running groups the strategy's will_collect has refused so far, those of them holding an ABORTED
        trajectory); a pass over the running groups, made only when the warning fires."""
        pacer = self._pacer
        with pacer.lock:
            held = [group for group in pacer.inflight.values() if group.held]
            aborted = sum(1 for group in held
                          if any(t.status is TrajectoryStatus.ABORTED for t in group.trajectories.values()))
        return len(held), aborted

    @staticmethod
    def _hint(strategy: str, running: int, buffered: int, held: int, aborted: int) -> str:
        """What must change for the trainer to get groups: the workers, the strategy's gate, or its window."""
        if held:
            why = (f" ({aborted} of them hold an ABORTED trajectory, which the base will_collect refuses: the next "
                   f"Reset returns those)" if aborted else "")
            gate = (f"{held} complete group(s) are held by strategy {strategy}'s will_collect, which refused them so "
                    f"far{why}: only the strategy can let them go (it is asked again when its state changes and every "
                    f"fully_async.gate_recheck_seconds), or a Reset returns them")
            if held < running:
                return (f"; {gate}; the other {running - held} running group(s) must complete (are workers "
                        f"generating?)")
            return f"; all {gate}; workers have nothing left to generate"
        if not running:
            take = (f" (or the trainer takes the {buffered} buffered in a smaller Collect)" if buffered else "")
            return (f"; nothing is running: strategy {strategy}'s window (compute_dispatch_count) admits 0 with "
                    f"{buffered} buffered, so only the strategy can let groups in{take}; workers cannot")
        return "; running groups must complete (are workers generating?) or the trainer must take what is buffered"
