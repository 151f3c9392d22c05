"""Leases: the in-flight lease of each running group, and Collect leases awaiting their Ack (at-least-once delivery)."""
from __future__ import annotations

import heapq
import math
from operator import attrgetter
from typing import Iterable, Mapping, Optional, Sequence

from .errors import LeaseExpiredError, UnknownLeaseError
from .inflight import InflightGroup

LAPSED_LEASES_KEPT = 4096  # recently expired lease ids, for a clear Ack error
# Why a lease ended unacknowledged, as an Ack of it is told after the lease id (LAPSED_UNKNOWN: before a restart).
_BACK = "its groups went back to the buffer and will be delivered again"
RAN_OUT = f"ran out before this Ack; {_BACK}"
RELEASED = f"was given back (Release) before this Ack; {_BACK}"
DISCARDED = ("ended with a Restore before this Ack; the pacer went back to the checkpoint, whose buffer holds these "
             "groups again if they were generated before it")
LAPSED_UNKNOWN = f"ran out or was given back before this Ack; {_BACK}"
# A rank's share never handed out, ended because another rank's share of its mini-batch was (shares.py).
WITH_ITS_MINI_BATCH = ("was given back with the mini-batch it belonged to, when another rank's share of it was given "
                       f"back before this one was handed out (every rank then takes a new mini-batch); {_BACK}")


def started_again(run: str) -> str:
    """Why a rank's share ended that was cut under an earlier run of its ranks than `run` (`Leases.run_change`)."""
    return (f"was given back when the ranks started again as run {run!r} (their earlier run's shares all went "
            f"back); {_BACK}")


def holder_silent(holder: str, grace: float) -> str:
    """Why a lease ended whose holder went silent."""
    return (f"ended before this Ack: its holder {holder} was silent for {grace:g} s (no heartbeat or call; "
            f"server.trainer_liveness_seconds); {_BACK}")


def lease_unnamed(holder: str, grace: float) -> str:
    """Why a lease ended that no call of its holder's named, though calls under its client id went on."""
    return (f"ended before this Ack: no call under its client id {holder} named it for {grace:g} s, though calls "
            f"under that id went on (the process holding it stopped, died or was cut off while another process "
            f"under the same client id went on; server.trainer_liveness_seconds); {_BACK}")


class CollectLease:
    """Groups handed to the trainer that go back to the buffer unless acknowledged before `deadline`, or sooner
    when `holder` (the client id of a trainer that heartbeats) goes silent, or when its holder's calls stopped naming
    it (`Leases.unnamed`)."""

    __slots__ = ("lease_id", "entries", "seconds", "deadline", "holder", "named_at", "unnamed_since")

    def __init__(self, lease_id: str, entries: list, seconds: float, deadline: float, holder: str = ""):
        self.lease_id = lease_id
        self.entries = entries  # (priority, group) as they were in the buffer, so redelivery keeps the order
        self.seconds = seconds
        self.deadline = deadline
        self.holder = holder  # "": bound by its time alone
        # When a call of its holder naming the leases it holds last named this one (None: none has since it was
        # granted, given back or restored), and when one first named a lease granted after it but not it.
        self.named_at: Optional[float] = None
        self.unnamed_since: Optional[float] = None

    @property
    def granted_at(self) -> float:
        """When it was granted, given back or claimed by its rank (its time runs from then)."""
        return self.deadline - self.seconds


def _keep_newest(kept: dict) -> None:
    """Forget the oldest entries of an insertion-ordered record beyond LAPSED_LEASES_KEPT."""
    while len(kept) > LAPSED_LEASES_KEPT:
        del kept[next(iter(kept))]


class Leases:
    """Deadlines only: which running groups and which Collect leases ran out. The Pacer decides what that means."""

    def __init__(self, inflight_lease_seconds: float):
        self.inflight_seconds = inflight_lease_seconds  # 0: running groups never expire
        # (deadline, seq of the first, prompt ids): one entry per call that started or extended leases; an id whose
        # group has another deadline by now is skipped lazily.
        self._heap: list[tuple[float, int, list[str]]] = []
        self.collect: dict[str, CollectLease] = {}  # Collect leases awaiting Ack, by lease id
        self.serial = 0
        # Recently ended lease ids -> why (RAN_OUT, RELEASED, a silent holder, WITH_ITS_MINI_BATCH), oldest first,
        # LAPSED_LEASES_KEPT at most.
        self.lapsed: dict[str, str] = {}
        # Leases that went back to the buffer because their holder fell silent, by id, oldest first: (holder,
        # seconds, the priorities of its groups), LAPSED_LEASES_KEPT at most. One is given back to its holder when the
        # holder names it again (a heartbeat's or Collect's held leases, an Ack) while all its groups still wait: a
        # trainer stopped or cut off for longer than the grace that goes on trains them once, after a restart too.
        self.reclaimable: dict[str, tuple[str, float, tuple]] = {}
        # Holder -> how many times it was taken as silent: a Collect it sent before that takes nothing (polls.py).
        self.silences: dict[str, int] = {}
        # Shares of data-parallel mini-batches (shares.py) not handed to their rank yet, by the ranks' shape key:
        # per mini-batch, oldest first, each rank's share lease id (None once handed out).
        self.open_shares: dict[tuple, list[list[Optional[str]]]] = {}
        # A rank's share lease id -> its mini-batch's share lease ids, by rank (until its Ack or lapse): a claimed
        # share that ends unacknowledged ends its mini-batch's unclaimed shares with it (`end`).
        self.mini_batches: dict[str, tuple[str, ...]] = {}
        # By the ranks' shape key: the run their last new mini-batch was cut under ("": none named) and the lease ids
        # of the shares cut under it (those ended are dropped at the next cut): a rank Collect naming another run
        # ends the live ones (`run_change`).
        self.runs: dict[tuple, tuple[str, list[str]]] = {}

    # ----------------------------------------------------------------- in-flight leases

    def extend(self, groups: Sequence[InflightGroup], now: float) -> None:
        """Give these groups their full in-flight lease from `now`, with one heap entry for all of them."""
        if not self.inflight_seconds or not groups:
            return
        deadline = now + self.inflight_seconds
        extended = []
        for group in groups:
            if group.deadline != deadline:
                group.deadline = deadline
                extended.append(group.prompt_id)
        if extended:
            heapq.heappush(self._heap, (deadline, groups[0].seq, extended))

    def running_out(self, now: float, inflight: Mapping[str, InflightGroup]) -> list[InflightGroup]:
        """The incomplete running groups whose lease ran out by `now`, in dispatch order (taken: not again)."""
        groups = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _seq, prompt_ids = heapq.heappop(heap)
            for prompt_id in prompt_ids:
                group = inflight.get(prompt_id)
                if group is not None and group.deadline == deadline and not group.complete:
                    group.deadline = math.inf  # taken: a duplicate heap entry must not take it twice
                    groups.append(group)
        groups.sort(key=attrgetter("seq"))
        return groups

    def forget_running(self) -> None:
        """A Reset ended every running group."""
        self._heap.clear()

    # ----------------------------------------------------------------- Collect leases

    def grant(self, entries: list, seconds: float, now: float, holder: str = "") -> CollectLease:
        self.serial += 1
        lease = CollectLease(f"lease-{self.serial}", entries, seconds, now + seconds, holder)
        self.collect[lease.lease_id] = lease
        return lease

    def grant_shares(self, key: tuple, shares: list[list], rank: int, seconds: float, now: float,
                     holder: str = "", run: str = "") -> CollectLease:
        """One lease per rank's share of a mini-batch; `rank`'s is handed out now (held by `holder`), the others
        wait for their ranks (claim) and lapse like any lease when none comes. Cut under `run` (`runs`; "" keeps
        the key's run: a Collect naming none is no new run)."""
        leases = [self.grant(entries, seconds, now) for entries in shares]
        current, cut = self.runs.get(key, (run, []))
        if run and run != current:
            current, cut = run, []  # run_change ended the earlier run's live shares before this Collect took
        collect = self.collect
        self.runs[key] = (current, [lease_id for lease_id in cut if lease_id in collect]
                          + [lease.lease_id for lease in leases])
        slots: list[Optional[str]] = [lease.lease_id for lease in leases]
        if len(slots) > 1:
            lease_ids = tuple(slots)
            for lease_id in lease_ids:
                self.mini_batches[lease_id] = lease_ids
        slots[rank] = None
        if any(slots):
            self.open_shares.setdefault(key, []).append(slots)
        leases[rank].holder = holder
        return leases[rank]

    def run_change(self, key: tuple, run: str) -> list[str]:
        """The live shares to end before a rank Collect under `key` naming `run` takes: those cut under the key's
        earlier run when `run` is another one (an earlier "" counts as one: a trainer that starts naming runs after one
        that named none starts clean too), so that the ranks of the new run all start from one new mini-batch. None
        for the key's current run, or for an empty `run` (no run named). Changes nothing: the Collect's take makes
        `run` the key's (grant_shares), as the replay of its journaled Collect does."""
        if not run:
            return []
        current = self.runs.get(key)  # the one lookup of the usual rank Collect
        if current is None or current[0] == run:
            return []
        collect = self.collect
        return [lease_id for lease_id in current[1] if lease_id in collect]

    def waiting_shapes(self, besides: tuple) -> tuple:
        """The keys other than `besides` under which a share still waits for its rank (its lease live)."""
        return tuple(key for key, batches in self.open_shares.items() if key != besides and any(
            lease_id in self.collect for slots in batches for lease_id in slots if lease_id))

    def claimable(self, key: tuple, rank: int) -> bool:
        """Whether an open mini-batch under `key` holds a live share for `rank`."""
        return any(slots[rank] in self.collect for slots in self.open_shares.get(key, ()) if slots[rank])

    def claim(self, key: tuple, rank: int, now: float, holder: str = "") -> Optional[CollectLease]:
        """The share of `rank` in the oldest open mini-batch under `key` that still has a live one for it, handed
        out now to `holder` (its lease runs from now); None when there is none. Mini-batches left with no live
        share go."""
        batches = self.open_shares.get(key, [])
        found = None
        for slots in batches:
            lease_id, slots[rank] = slots[rank], None
            if lease_id in self.collect:
                found = self.collect[lease_id]
                found.deadline = now + found.seconds
                found.holder = holder
                break
        batches[:] = [slots for slots in batches if any(lease_id in self.collect for lease_id in slots if lease_id)]
        if not batches:
            self.open_shares.pop(key, None)
        return found

    def acknowledge(self, lease_id: str) -> CollectLease:
        """The lease, ended by its Ack; LeaseExpiredError / UnknownLeaseError when there is none to end."""
        lease = self.collect.pop(lease_id, None)
        self.mini_batches.pop(lease_id, None)
        if lease is None:
            if lease_id in self.lapsed:
                raise LeaseExpiredError(f"lease {lease_id!r} {self.lapsed[lease_id]}")
            raise UnknownLeaseError(f"lease {lease_id!r} is not known: never granted, already acknowledged, or "
                                    f"ended so long ago that the server no longer remembers it (it remembers the "
                                    f"last {LAPSED_LEASES_KEPT} leases that ran out or were released)")
        return lease

    def releasable(self, lease_id: str) -> int:
        """The groups a Release of this lease gives back: 0 when it ran out (they are back already);
        UnknownLeaseError when there is no such lease."""
        lease = self.collect.get(lease_id)
        if lease is not None:
            return len(lease.entries)
        if lease_id in self.lapsed:
            return 0
        raise UnknownLeaseError(f"lease {lease_id!r} is not known: never granted, already acknowledged, or ended so "
                                f"long ago that the server no longer remembers it (it remembers the last "
                                f"{LAPSED_LEASES_KEPT} leases that ran out or were released; a Release of one of "
                                f"those answers 0 groups)")

    def held(self, holder: Optional[str] = None) -> dict[str, tuple[list[str], int]]:
        """Holder -> (the ids of its Collect leases, oldest first, and the groups in them); one holder's with
        `holder`. Leases without a holder are not listed."""
        held: dict[str, tuple[list[str], int]] = {}
        for lease_id, lease in self.collect.items():
            if lease.holder and (holder is None or lease.holder == holder):
                lease_ids, groups = held.get(lease.holder, ([], 0))
                lease_ids.append(lease_id)
                held[lease.holder] = (lease_ids, groups + len(lease.entries))
        return held

    def named(self, holder: str, lease_ids: Sequence[str], now: float) -> None:
        """A call of `holder` named these leases as every one its process holds (a heartbeat's or a Collect's held
        leases): each of its live ones was named `now`; and a lease of its granted before one of them, never named,
        was not known to the process that named them (it is another's under the same client id, or one whose
        answer this process has not read yet: `unnamed` waits the grace on it)."""
        collect = self.collect
        newest = None  # when the latest granted of those named was granted
        for lease_id in lease_ids:
            lease = collect.get(lease_id)
            if lease is not None and lease.holder == holder:
                lease.named_at = now
                lease.unnamed_since = None
                newest = lease.granted_at if newest is None else max(newest, lease.granted_at)
        if newest is None:
            return
        for lease in collect.values():
            if (lease.holder == holder and lease.named_at is None and lease.unnamed_since is None
                    and lease.granted_at < newest):
                lease.unnamed_since = now

    def named_at_grant(self, lease_id: str, now: float) -> None:
        """The lease just granted counts as named by its holder now: its Collect said its process reads the answer as
        it arrives and names the lease from then on (CollectRequest.named_at_grant), so one it never names ends a
        grace from now (`unnamed`), not a grace after a later lease's naming."""
        self.collect[lease_id].named_at = now

    def unnamed(self, now: float, grace: float, besides: Iterable[str] = ()) -> dict[str, list[str]]:
        """Holder -> its leases its calls stopped naming, but those of the holders in `besides` (taken as silent: all
        theirs end anyway). A holder whose calls name the leases they hold (docs/protocol.md) names each of its own
        every third of the grace, so one named before but not for `grace` seconds, or one never named while for
        `grace` seconds its calls named a lease granted after it, is held by a process that stopped, died or was cut
        off while another under the same client id went on (ranks given one id, a trainer restarted under its fixed
        id). A lease never named by a holder whose calls name none is bound by the holder's silence alone."""
        if not grace or not self.collect:
            return {}
        cutoff = now - grace
        skip = set(besides)
        unnamed: dict[str, list[str]] = {}
        for lease_id, lease in self.collect.items():
            since = lease.named_at if lease.named_at is not None else lease.unnamed_since
            if since is not None and since <= cutoff and lease.holder and lease.holder not in skip:
                unnamed.setdefault(lease.holder, []).append(lease_id)
        return unnamed

    def note_silence(self, holder: str) -> None:
        """`holder` is taken as silent: a Collect it sent before now takes nothing (polls.py)."""
        self.silences[holder] = self.silences.pop(holder, 0) + 1
        _keep_newest(self.silences)

    def keep_reclaimable(self, holder: str, lease_ids: Sequence[str]) -> None:
        """These leases of `holder` are about to lapse with its silence, or because none of its calls named them:
        remember them (reclaimable)."""
        for lease_id in lease_ids:
            lease = self.collect[lease_id]
            self.reclaimable[lease_id] = (holder, lease.seconds, tuple(priority for priority, _ in lease.entries))
        _keep_newest(self.reclaimable)

    def claimed(self, holder: str, lease_ids: Iterable[str]) -> list[tuple[str, float, tuple]]:
        """Of these lease ids `holder` says it holds, its reclaimable ones, oldest first, as (lease id, seconds,
        priorities), forgotten here (given back now, or never)."""
        reclaimable = self.reclaimable
        wanted = {lease_id for lease_id in lease_ids if reclaimable.get(lease_id, ("",))[0] == holder}
        if not wanted:  # the usual call: no walk over what dead trainers left
            return []
        return [(lease_id, *reclaimable.pop(lease_id)[1:])
                for lease_id in [lease_id for lease_id in reclaimable if lease_id in wanted]]

    def regrant(self, lease_id: str, entries: list, seconds: float, now: float, holder: str) -> CollectLease:
        """A lapsed lease given back to its holder, with these entries (as they were) and its full time from `now`;
        no longer claimable (`claimed` forgot it already; a replayed give-back forgets it here)."""
        self.lapsed.pop(lease_id, None)
        self.reclaimable.pop(lease_id, None)
        lease = self.collect[lease_id] = CollectLease(lease_id, entries, seconds, now + seconds, holder)
        return lease

    def lapsing(self, now: float) -> list[str]:
        """The ids of the Collect leases whose time ran out by `now`."""
        return [lease_id for lease_id, lease in self.collect.items() if lease.deadline <= now]

    def lapse(self, lease_id: str, why: str = LAPSED_UNKNOWN) -> CollectLease:
        lease = self.collect.pop(lease_id)
        self.lapsed[lease_id] = why
        _keep_newest(self.lapsed)
        return lease

    def end(self, lease_ids: Sequence[str], why: str) -> list[CollectLease]:
        """These live Collect leases end unacknowledged (`why`: what an Ack of one is told), and with each rank's
        share among them that was handed out, every share of its mini-batch still waiting for its rank: else that
        rank would claim a share of this mini-batch while the rank given back its own takes a new one, their k-th
        batches no longer shares of one mini-batch. Claimed shares of other ranks stay. Returns the leases ended:
        these, then the shares ended with them; a replay of the same ids ends the same ones."""
        ended = [self.lapse(lease_id, why) for lease_id in lease_ids]
        mini_batches = self.mini_batches
        for lease_id in lease_ids:
            shares = mini_batches.pop(lease_id, None)
            if shares is not None:
                ended += self._end_unclaimed(lease_id, shares)
        return ended

    def _end_unclaimed(self, lease_id: str, shares: tuple[str, ...]) -> list[CollectLease]:
        """The still unclaimed shares of the mini-batch whose share `lease_id` just ended, ended with it, and the
        mini-batch out of open_shares; none when every share was handed out, or `lease_id` never was (it ran out
        waiting for its rank)."""
        found = next(((key, slots) for key, batches in self.open_shares.items() for slots in batches
                      if any(slot in shares for slot in slots if slot)), None)
        if found is None or lease_id in found[1]:
            return []
        key, slots = found
        batches = self.open_shares[key]
        batches[:] = [other for other in batches if other is not slots]
        if not batches:
            del self.open_shares[key]
        # Nor may its holder claim it back (reclaimable): the other ranks take a new mini-batch.
        self.reclaimable.pop(lease_id, None)
        ended = []
        for slot in slots:
            if slot in self.collect:
                self.mini_batches.pop(slot, None)
                ended.append(self.lapse(slot, WITH_ITS_MINI_BATCH))
        return ended

    def lapse_all(self) -> list[CollectLease]:
        """Every Collect lease ends unacknowledged (a Restore discards its groups); an Ack of one then fails."""
        leases = [self.lapse(lease_id, DISCARDED) for lease_id in list(self.collect)]
        self.mini_batches.clear()
        self.open_shares.clear()
        self.reclaimable.clear()  # the buffer is the checkpoint's: nothing in it is a lapsed lease's any more
        return leases

    @property
    def leased_groups(self) -> int:
        collect = self.collect  # read by every GetState: no generator when nothing is leased
        return sum([len(lease.entries) for lease in collect.values()]) if collect else 0

    # ----------------------------------------------------------------- restart

    def restart_clocks(self, now: float, running: Iterable[InflightGroup]) -> None:
        """Deadlines were on the old process's clock: every lease gets its full time again from `now`."""
        self.extend(list(running), now)
        for lease in self.collect.values():
            lease.deadline = now + lease.seconds
            lease.named_at = lease.unnamed_since = None  # named again by its holder's next calls, if it names them

    def export(self) -> dict:
        return {"leases": [(lease.lease_id, lease.entries, lease.seconds, lease.holder)
                           for lease in self.collect.values()],
                "lease_serial": self.serial, "lapsed_leases": list(self.lapsed.items()),
                "reclaimable_leases": list(self.reclaimable.items()),
                "open_shares": [(key, [list(slots) for slots in batches]) for key, batches in self.open_shares.items()],
                "share_mini_batches": list(self.mini_batches.items()),
                "share_runs": [(key, run, list(cut)) for key, (run, cut) in self.runs.items()]}

    def restore(self, snapshot: Mapping, now: float) -> None:
        for lease_id, entries, seconds, *holder in snapshot["leases"]:  # no holder in snapshots before holders
            # The old deadline was on the old process's clock: a recovered lease gets its full time again.
            self.collect[lease_id] = CollectLease(lease_id, entries, seconds, now + seconds, *holder)
        self.serial = snapshot["lease_serial"]
        for lapsed in snapshot["lapsed_leases"]:  # (id, why); a bare id in snapshots written before reasons were kept
            lease_id, why = (lapsed, LAPSED_UNKNOWN) if isinstance(lapsed, str) else lapsed
            self.lapsed[lease_id] = why
        self.reclaimable.update(snapshot.get("reclaimable_leases", ()))  # absent from snapshots before it was kept
        self.open_shares = {tuple(key): [list(slots) for slots in batches]
                            for key, batches in snapshot.get("open_shares", ())}  # absent before shares existed
        # Absent before a share's end ended its mini-batch's unclaimed ones: those leases' shares end alone.
        self.mini_batches = {lease_id: tuple(shares) for lease_id, shares in snapshot.get("share_mini_batches", ())}
        # Absent before runs were kept: the shares cut before are under none, and end as they did.
        self.runs = {tuple(key): (run, list(cut)) for key, run, cut in snapshot.get("share_runs", ())}
