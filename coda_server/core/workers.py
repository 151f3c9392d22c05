"""The workers as the pacer sees them: who holds what, keep-alives, liveness, engines' weight versions, silent ones."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from .checks import RequestChecks
from .clock import PacerClock
from .collector import Collector
from .inflight import InflightTable
from .job_end import Lifecycle
from .delivery import Delivery
from .journal import Expired, Reclaimed, Recorder
from .leases import Leases, holder_silent, lease_unnamed
from .liveness import Liveness
from .types import HeldGroup, KeepAliveResult


@dataclass
class SilentRelease:
    """What a client taken as gone lost: its running groups (a worker's) and its Collect leases (a trainer's); or,
    heard but its calls naming the leases they hold, the leases none of them named (`unnamed_lease_ids`)."""

    prompt_ids: list[str] = field(default_factory=list)
    lease_ids: list[str] = field(default_factory=list)
    leased_groups: int = 0
    unnamed_lease_ids: list[str] = field(default_factory=list)

    def why_leases_went(self, grace: float) -> str:
        """Why its leases were released, for the log: its silence, or no call under its id naming them."""
        if self.lease_ids:
            return f"silent for {grace:.0f} s (no heartbeat or call)"
        return (f"heard, but no call under that id named these for {grace:.0f} s (the process holding them stopped, "
                "died or was cut off)")


@dataclass
class Reclaim:
    """What a trainer heard again after its silence got back: the leases given back to it (their groups all still
    waited in the buffer), how many groups they hold, and the leases whose groups went elsewhere meanwhile."""

    lease_ids: list[str]
    groups: int
    missed: list[str]


class Workers:
    """The calls about workers rather than groups, over the owners they read and change. Each takes the pacer's
    lock itself, but for the liveness notes (`heard_from`, `watch_opened`, `watch_closed`): single dictionary
    writes made without it, on every call's path (docs/architecture.md)."""

    def __init__(self, lock: threading.RLock, lifecycle: Lifecycle, checks: RequestChecks, inflight: InflightTable,
                 leases: Leases, liveness: Liveness, collector: Collector, delivery: Delivery, recorder: Recorder,
                 clock: PacerClock):
        self._lock, self._lifecycle, self._checks, self._inflight = lock, lifecycle, checks, inflight
        self._leases, self._liveness, self._collector, self._delivery = leases, liveness, collector, delivery
        self._record, self._clock = recorder.record, clock

    def heard_from(self, client_id: str, held_leases: Sequence[str] = (), all_held: bool = True) -> Optional[Reclaim]:
        """A call from `client_id` (a worker's heartbeat, Dispatch or Submit, a trainer's Collect, Ack or heartbeat):
        it is alive. `held_leases`: the Collect leases it says it holds (`all_held`: every one its process holds, as
        a heartbeat and a Collect name them; an Ack names its own alone); they were named now (Leases.named), and
        those that ended with its silence, or unnamed, are given back to it, before its call is served, when their
        groups all still wait in the buffer (returned, for the log; None when it named none of them)."""
        now = self._clock.now()
        self._liveness.heard(client_id, now)
        if not held_leases:
            return None
        if all_held:
            with self._lock:
                self._leases.named(client_id, held_leases, now)
        if self._leases.reclaimable:
            return self._reclaim(client_id, held_leases)
        return None

    def _reclaim(self, holder: str, held_leases: Sequence[str]) -> Optional[Reclaim]:
        with self._lock:
            claimed = [] if self._lifecycle.closed else self._leases.claimed(holder, held_leases)
            if not claimed:
                return None
            reclaimed, missed = self.apply_reclaim(holder, claimed)
            return Reclaim([lease_id for lease_id, _, _ in reclaimed],
                           sum(len(priorities) for _, _, priorities in reclaimed), missed)

    def apply_reclaim(self, holder: str, claimed: Sequence[tuple]) -> tuple[list[tuple], list[str]]:
        """Give `holder` back the claimed leases whose groups all still wait (`Delivery.reclaim`), watch it again and
        record it; the journal's Reclaimed is replayed through here. Returns (given back, the ids missed)."""
        with self._lock:
            now = self._clock.now()
            reclaimed, missed = self._delivery.reclaim(holder, now, claimed)
            if reclaimed:
                self._liveness.watch([holder], now)
                self._record(Reclaimed(now, holder, reclaimed))
            return reclaimed, missed

    def watch_opened(self, client_id: str) -> None:
        """`client_id` opened a control stream: it is a watched worker from now on (see liveness.py)."""
        self._liveness.stream_opened(client_id, self._clock.now())

    def watch_closed(self, client_id: str) -> None:
        self._liveness.stream_closed(client_id)

    def note_loaded_version(self, client_id: str, weight_version: int) -> None:
        """`client_id`'s engine reports `weight_version` loaded (on its Dispatch or KeepAlive), the version its
        segments are tagged with. Shown by ListWorkers; not journaled (every worker says it again)."""
        if client_id:
            with self._lock:
                self._liveness.note_loaded(client_id, weight_version, self._clock.now())

    def loaded_versions(self) -> dict[str, int]:
        """The weight version each worker's engine last reported loaded, by client id: a watched worker's until it
        is taken as gone, another caller's for server.inflight_lease_seconds after it last said it."""
        with self._lock:
            return self._liveness.loaded(self._clock.now(), self._leases.inflight_seconds)

    def contact(self, client_ids: Sequence[str]) -> dict[str, tuple[Optional[float], int]]:
        """For each client id: seconds since it was last heard (None: not heard), its open WatchControl streams."""
        with self._lock:
            return self._liveness.contact(client_ids, self._clock.now())

    def held_groups(self, client_id: Optional[str] = None) -> list[HeldGroup]:
        """The running groups (all, or those `client_id` dispatched), oldest first: which worker holds what."""
        with self._lock:
            return self._inflight.held(client_id, self._clock.now())

    def held_leases(self, client_id: Optional[str] = None) -> dict[str, tuple[list[str], int]]:
        """Which trainer (client id) holds which Collect leases bound to its liveness, and how many groups in them."""
        with self._lock:
            return self._leases.held(client_id)

    def keep_alive(self, prompt_ids: Sequence[str], dispatch_seqs: Optional[Mapping[str, int]] = None,
                   lease_ids: Sequence[str] = ()) -> KeepAliveResult:
        """Renew the in-flight lease of these running groups (their worker is alive and generating), and say which of
        the Collect leases a trainer names (`lease_ids`, after `heard_from` gave back what it could) are not live any
        more: a batch of one it has not trained yet went, or goes, to another trainer.

        Not journaled: a restarted server gives every running group its full lease again anyway.
        """
        self._checks.check_keep_alive(prompt_ids)
        with self._lock:
            self._lifecycle.check_open()
            get = self._inflight.get
            seqs = dispatch_seqs or {}
            # A group handed out again under another dispatch is not the caller's any more: named unknown.
            running = [g for g in map(get, prompt_ids) if g is not None and seqs.get(g.prompt_id, g.seq) == g.seq]
            self._leases.extend([g for g in running if not g.complete], self._clock.now())
            known = {g.prompt_id for g in running}
            live = self._leases.collect
            return KeepAliveResult(len(running), [p for p in prompt_ids if p not in known],
                                   self._leases.inflight_seconds, self._liveness.shortest_grace,
                                   [lease_id for lease_id in lease_ids if lease_id not in live])

    def release_silent_workers(self) -> dict[str, SilentRelease]:
        """Release what watched clients silent for their grace hold: a worker's incomplete running groups, as an
        expired in-flight lease releases them, and a trainer's Collect leases bound to its liveness, as a Release
        gives them back (first in line again); and the leases of a trainer heard but whose calls, which name the
        leases they hold, named them for no grace (Leases.unnamed). Returns what each client lost. Called
        periodically by the server."""
        with self._lock:
            now = self._clock.now()
            gone, gone_trainers = self._liveness.silent(now)
            trainer_grace = self._liveness.trainer_grace
            unnamed = self._leases.unnamed(now, trainer_grace, gone_trainers)
            if not (gone or gone_trainers or unnamed) or self._lifecycle.closed:
                return {}
            groups = [g for g in self._inflight.in_dispatch_order() if g.client_id in gone and not g.complete]
            released: dict[str, SilentRelease] = {}
            for group in groups:
                released.setdefault(group.client_id, SilentRelease()).prompt_ids.append(group.prompt_id)
            leases = {holder: held for holder, held in self._leases.held().items() if holder in gone_trainers}
            for holder, (lease_ids, leased_groups) in leases.items():
                lost = released.setdefault(holder, SilentRelease())
                lost.lease_ids, lost.leased_groups = lease_ids, leased_groups
            for holder, lease_ids in unnamed.items():
                lost = released.setdefault(holder, SilentRelease())
                lost.unnamed_lease_ids = lease_ids
                lost.leased_groups = sum(len(self._leases.collect[lease_id].entries) for lease_id in lease_ids)
            if groups or leases or unnamed:
                prompt_ids = [group.prompt_id for group in groups]
                if prompt_ids:
                    self._collector.expire(prompt_ids, [])
                    self._record(Expired(now, prompt_ids, []))
                # In the order they went back, so that a replay rebuilds the buffer as it was; an Ack of one is told
                # whose silence ended it, after a restart too, and its holder can claim it back then as well.
                for holder, (lease_ids, _) in leases.items():
                    self._leases.note_silence(holder)
                    self.lapse_silent(now, holder, lease_ids, holder_silent(holder, trainer_grace))
                for holder, lease_ids in unnamed.items():
                    self.lapse_silent(now, holder, lease_ids, lease_unnamed(holder, trainer_grace))
            return released

    def lapse_silent(self, now: float, holder: str, lease_ids: list[str], why: str) -> None:
        """These leases of `holder` end with its silence (or unnamed by its calls), kept for it to claim back, and
        recorded; the journal's Expired naming a holder is replayed through here."""
        with self._lock:
            self._leases.keep_reclaimable(holder, lease_ids)
            self._collector.expire([], lease_ids, why)
            self._record(Expired(now, [], lease_ids, why, holder))
