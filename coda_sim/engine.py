"""Discrete-event engine: a time-ordered event queue and the generation pool (replicas x slots x KV cache).

Each replica decodes its requests with processor sharing: with n requests decoding, every one of them
advances at `workload.decode_rate(n)` tokens/s. A replica keeps a "virtual progress" clock V (tokens
per request since it started); a request that needs w units of work finishes when V reaches
V_at_start + w, so only the replica's next finisher needs an event, re-planned whenever n changes.

With a KV-cache capacity, the cache a replica holds (every slot's prompt + generated tokens) grows
linearly in V between events, so the moment it fills is computed like a finish time; then the most
recently admitted requests are preempted. With `cluster.kv_reserve` the engines schedule as SGLang's
does instead: admission against KV reserved for the running requests' future tokens, and retraction of
the requests with the fewest new tokens (to the back of the engines' queue) when decoding fills the
cache. With a prefill throughput, a replica prefills one request
at a time (its whole context: a resumed or preempted request re-prefills what it generated) and its
decoding stands still meanwhile, as an engine that runs prefill batches ahead of decode steps.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, Optional

from .workload import TrajSpec, Workload

_EPS = 1e-9
# kv_reserve: a queue head that does not fit is tried again this often (simulated seconds) as well as at
# every finish, because the reservation shrinks between events as the new-token ratio decays.
RESERVE_RETRY_S = 1.0


class EventQueue:
    """Events ordered by (time, insertion order): ties run in the order they were scheduled."""

    __slots__ = ("now", "_heap", "_counter")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._counter = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (max(time, self.now), self._counter, fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def pop(self) -> Optional[tuple[Callable[..., Any], tuple]]:
        """Advance `now` to the next event and return it (None when no event is left)."""
        if not self._heap:
            return None
        time, _, fn, args = heapq.heappop(self._heap)
        self.now = time
        return fn, args

    def __len__(self) -> int:
        return len(self._heap)

    def clear(self) -> None:
        """Forget every pending event (the caller knows they are all superseded)."""
        self._heap.clear()


# Phases of a request (one trajectory's generation).
IDLE, QUEUED, PREFILL, DECODE, TOOL, DONE = range(6)


class Request:
    """One trajectory's generation across turns, aborts, preemptions and continuations."""

    __slots__ = ("owner", "j", "spec", "slowdown", "turn", "done_in_turn", "tokens_done", "phase", "ticket",
                 "replica", "v_start", "start_version", "tool_next", "kv_entry", "masked_tokens", "engine_base")

    def __init__(self, owner: Any, j: int, spec: TrajSpec, slowdown: float):
        self.owner = owner
        self.j = j
        self.spec = spec
        self.slowdown = slowdown
        self.turn = 0
        self.done_in_turn = 0.0  # tokens of the current turn generated so far
        self.tokens_done = 0.0  # response tokens generated so far, all turns
        self.phase = IDLE
        self.ticket = 0
        self.replica: Optional[Replica] = None
        self.v_start = 0.0
        self.start_version: Optional[int] = None  # weight version of its first token
        self.tool_next = False  # the next thing to do is the tool call after turn `turn - 1`
        self.kv_entry = 0.0  # context tokens in the KV cache when it took its slot
        self.masked_tokens = 0.0  # response tokens generated before its last abort (older weights)
        # Response tokens it had when its current engine request was sent (a continuation or a new turn
        # sends them as prompt): the engine counts only later tokens as output.
        self.engine_base = 0.0

    @property
    def finished(self) -> bool:
        return self.phase == DONE


class Replica:
    __slots__ = ("index", "occupied", "decoding", "v", "last_t", "heap", "ver", "members", "kv_fixed", "inv_s",
                 "vs", "prefill_queue", "prefilling", "due_finish", "ratio", "ratio_v")

    def __init__(self, index: int):
        self.index = index
        self.occupied = 0  # requests holding a slot (prefill or decode)
        self.decoding = 0
        self.v = 0.0
        self.last_t = 0.0
        self.heap: list[tuple[float, int, Request]] = []
        self.ver = 0
        self.members: dict[Request, None] = {}  # requests holding a slot, in admission order
        # KV cache = kv_fixed + v * inv_s - vs: entry contexts plus what each decoding request has added
        # since it started decoding, (v - v_start) / slowdown.
        self.kv_fixed = 0.0
        self.inv_s = 0.0
        self.vs = 0.0
        self.prefill_queue: deque[Request] = deque()  # serial prefill: waiting behind `prefilling`
        self.prefilling: Optional[Request] = None  # while set, decoding on this replica stands still
        self.due_finish: Optional[float] = None  # the V of the finisher the planned event is for
        # kv_reserve: the new-token ratio was `ratio` when V was `ratio_v` (it decays with decode steps, i.e. V).
        self.ratio = 1.0
        self.ratio_v = 0.0


class GenerationPool:
    """Replicas x slots; FIFO queue of requests waiting for a slot; calls `on_done(request)` at the end."""

    def __init__(self, events: EventQueue, workload: Workload, replicas: int,
                 on_done: Callable[[Request], None], on_first_token: Optional[Callable[[Request], None]] = None):
        self.events = events
        self.workload = workload
        self.slots = workload.slots_per_replica
        self.replicas = [Replica(i) for i in range(replicas)]
        self.total_slots = replicas * self.slots
        # The router's limit over every replica (0 = none): requests beyond it wait in `pending`.
        self.max_concurrent = workload.max_concurrent_requests or self.total_slots
        self.on_done = on_done
        self.on_first_token = on_first_token
        self.pending: deque[Request] = deque()
        self.live: dict[int, Request] = {}  # id -> request not IDLE/DONE, in start order (deterministic)
        self._ids: dict[Request, int] = {}
        self._next_id = 0
        self._ticket = 0
        self.occupied = 0
        self.busy_slot_seconds = 0.0
        self._busy_since = 0.0
        self.tokens_generated = 0.0
        self._serial_prefill = workload.prefill_tokens_per_s > 0
        self._kv_cap = workload.kv_cache_tokens
        self._kv_step = workload.kv_step_seconds_per_token  # decode step seconds per cached token
        # Admission (and preemption) keep a replica's cache at or below this: the watermark, and strictly
        # below full, or a request admitted into a full cache would be preempted at once, for ever.
        self._kv_room = min(workload.kv_admit_watermark, 1.0 - 1e-6) * workload.kv_cache_tokens
        # What the cost model adds up (reported by the simulation).
        self.prefill_tokens = 0.0  # context tokens prefilled (serial prefill only)
        self.reprefill_tokens = 0.0  # of those, response tokens prefilled again (resumed / preempted)
        self.prefill_seconds = 0.0  # replica-seconds spent prefilling (serial prefill only)
        self.preemptions = 0  # requests preempted (retracted) because their replica's KV cache was full
        # SGLang-style scheduling (None = the watermark): requests through the router wait in
        # `engine_queue` for KV room, retracted ones at its back; the router counts them as generating.
        self._reserve = workload.kv_reserve
        self._max_new = float(workload.cap)
        self.engine_queue: deque[Request] = deque()
        self._retry_at: Optional[float] = None  # when the planned retry of a blocked queue head runs
        if self._reserve is not None:
            self.max_concurrent = workload.max_concurrent_requests or math.inf
            for rep in self.replicas:
                self._reset_ratio(rep)

    # ------------------------------------------------------------------ public

    def start(self, req: Request) -> None:
        """Begin (or continue) a request: its next tool call, or queue its next turn for a slot."""
        self._register(req)
        if req.tool_next:
            self._begin_tool(req)
        else:
            self._enqueue(req)

    def abort_all(self) -> list[Request]:
        """Stop every live request now, keeping its progress; they go IDLE, in start order.

        The tokens each had generated are marked as generated under old weights (`masked_tokens`).
        """
        now = self.events.now
        for rep in self.replicas:
            self._advance(rep, now)
        aborted = list(self.live.values())
        for req in aborted:
            self._stop(req)
            req.masked_tokens = req.tokens_done
        self.pending.clear()
        self.engine_queue.clear()
        self.live.clear()
        self._ids.clear()
        for rep in self.replicas:
            rep.heap.clear()
            rep.ver += 1
            rep.prefill_queue.clear()
            rep.prefilling = None
            rep.members.clear()
            rep.kv_fixed = rep.inv_s = rep.vs = 0.0
            self._reset_ratio(rep)
        return aborted

    def cancel(self, req: Request) -> None:
        """Stop one request for good (its group was dropped)."""
        if req.phase in (IDLE, DONE):
            return
        rep = req.replica
        if rep is not None:
            self._advance(rep, self.events.now)
        if req.phase == QUEUED:
            (self.pending if req in self.pending else self.engine_queue).remove(req)
        self._stop(req)
        self._unregister(req)
        if rep is not None:
            self._replica_changed(rep)
        self._fill()

    @property
    def idle(self) -> bool:
        return not self.live

    def utilisation_until(self, now: float) -> float:
        """Slot-seconds busy (prefill or decode) up to `now`."""
        return self.busy_slot_seconds + self.occupied * (now - self._busy_since)

    def kv_used(self, rep: Replica) -> float:
        """Tokens in `rep`'s KV cache now (its V advanced to now first)."""
        self._advance(rep, self.events.now)
        return rep.kv_fixed + rep.v * rep.inv_s - rep.vs

    # ------------------------------------------------------------------ internals

    def _register(self, req: Request) -> None:
        if req not in self._ids:
            self._ids[req] = self._next_id
            self.live[self._next_id] = req
            self._next_id += 1

    def _unregister(self, req: Request) -> None:
        rid = self._ids.pop(req, None)
        if rid is not None:
            del self.live[rid]

    def _new_ticket(self, req: Request) -> int:
        self._ticket += 1
        req.ticket = self._ticket
        return self._ticket

    def _occupy(self, delta: int) -> None:
        now = self.events.now
        self.busy_slot_seconds += self.occupied * (now - self._busy_since)
        self._busy_since = now
        self.occupied += delta

    def _leave_slot(self, req: Request) -> None:
        """`req` gives its slot and its KV cache back (replica already advanced)."""
        rep = req.replica
        if req.phase == DECODE:
            rep.decoding -= 1
            rep.inv_s -= 1.0 / req.slowdown
            rep.vs -= req.v_start / req.slowdown
        rep.occupied -= 1
        rep.kv_fixed -= req.kv_entry
        rep.members.pop(req, None)
        if not rep.decoding:  # no rounding left-overs in the KV sums
            rep.inv_s = rep.vs = 0.0
        if not rep.occupied:
            rep.kv_fixed = 0.0
            self._reset_ratio(rep)  # an idle engine starts its estimate again
        self._occupy(-1)
        req.replica = None

    def _stop(self, req: Request) -> None:
        """Leave the current phase keeping progress (replica already advanced)."""
        rep = req.replica
        if req.phase == DECODE:
            progress = min((rep.v - req.v_start) / req.slowdown, req.spec.turns[req.turn] - req.done_in_turn)
            progress = max(0.0, progress)
            req.done_in_turn += progress
            req.tokens_done += progress
            self.tokens_generated += progress
        if req.phase == PREFILL and self._serial_prefill:
            if rep.prefilling is req:
                rep.prefilling = None  # the next prefill (or decoding) starts in _replica_changed
            else:
                rep.prefill_queue.remove(req)
        if req.phase in (DECODE, PREFILL):
            self._leave_slot(req)
        if req.phase == TOOL:
            req.tool_next = True  # the tool call is redone on continuation
        req.phase = IDLE
        req.replica = None
        self._new_ticket(req)

    def _replica_changed(self, rep: Replica) -> None:
        """After a request left `rep` outside an event of its own: go on prefilling, or re-plan decoding."""
        if rep.prefilling is None and rep.prefill_queue:
            self._next_prefill(rep)
        else:
            self._plan(rep)

    def _enqueue(self, req: Request) -> None:
        req.engine_base = req.tokens_done  # a new engine request: what it generated so far is its prompt
        req.phase = QUEUED
        self._new_ticket(req)
        self.pending.append(req)
        self._fill()

    def _context(self, req: Request) -> float:
        return self.workload.prompt_tokens + req.tokens_done

    def _fits(self, rep: Replica, context: float) -> bool:
        if self._kv_cap <= 0 or rep.occupied == 0:  # an empty replica takes any request
            return True
        return self.kv_used(rep) + context <= self._kv_room

    def _fill(self) -> None:
        if self._reserve is not None:
            self._fill_reserving()
            return
        slots = self.slots
        while self.pending and self.occupied < self.max_concurrent:
            context = self._context(self.pending[0])
            best = None
            for rep in self.replicas:
                if rep.occupied < slots and (best is None or rep.occupied < best.occupied) and self._fits(rep, context):
                    best = rep
                    if rep.occupied == 0:
                        break
            if best is None:
                return
            req = self.pending.popleft()
            self._admit(best, req, context)

    def _fill_reserving(self) -> None:
        """kv_reserve: the router lets requests into the engines' queue, which admits in order while the
        head fits a replica's unreserved cache (SGLang's prefill adder stops at the first that does not)."""
        slots = self.slots
        while True:
            while self.pending and self.occupied + len(self.engine_queue) < self.max_concurrent:
                self.engine_queue.append(self.pending.popleft())
            if not self.engine_queue:
                return
            req = self.engine_queue[0]
            context = self._context(req)
            need = context + self._future_tokens(req, req.tokens_done)
            best = None
            for rep in self.replicas:
                if rep.occupied < slots and (best is None or rep.occupied < best.occupied) \
                        and (rep.occupied == 0 or self._fits_reserving(rep, need)):
                    best = rep
                    if rep.occupied == 0:
                        break
            if best is None:
                now = self.events.now
                if self._retry_at is None or self._retry_at < now:  # none planned (or lost to a clear)
                    self._retry_at = now + RESERVE_RETRY_S
                    self.events.at(self._retry_at, self._retry_fill)
                return
            self.engine_queue.popleft()
            self._admit(best, req, context)

    def _retry_fill(self) -> None:
        self._retry_at = None
        self._fill()

    def _future_tokens(self, req: Request, tokens_done: float) -> float:
        """The tokens SGLang expects `req` may still add: its remaining max_new_tokens, clipped."""
        return max(0.0, min(self._max_new - tokens_done, float(self._reserve.clip_max_new_tokens)))

    def _tokens_now(self, req: Request, rep: Replica) -> float:
        """Response tokens `req` has now (`rep` advanced): its progress in the current decode counted."""
        if req.phase != DECODE:
            return req.tokens_done
        left = req.spec.turns[req.turn] - req.done_in_turn
        return req.tokens_done + max(0.0, min((rep.v - req.v_start) / req.slowdown, left))

    def _ratio(self, rep: Replica) -> float:
        return max(self._reserve.min_ratio, rep.ratio - self._reserve.decay_per_step * (rep.v - rep.ratio_v))

    def _reset_ratio(self, rep: Replica) -> None:
        if self._reserve is not None:
            rep.ratio, rep.ratio_v = self._reserve.init_ratio, rep.v

    def _fits_reserving(self, rep: Replica, need: float) -> bool:
        """`need` tokens fit in `rep`'s free KV less what its requests reserve for their future tokens
        (SGLang's rem_total_tokens). Each reserves at most ratio x clip: the sum is needed only in between."""
        free = self._kv_cap - self.kv_used(rep)
        if need >= free:
            return False
        ratio = self._ratio(rep)
        if need < free - ratio * self._reserve.clip_max_new_tokens * rep.occupied:
            return True
        clip, cap, v = float(self._reserve.clip_max_new_tokens), self._max_new, rep.v
        reserved = 0.0
        for r in rep.members:  # _future_tokens(r, _tokens_now(r, rep)), inlined: this loop is the hot path
            tokens = r.tokens_done
            if r.phase == DECODE:
                tokens += min((v - r.v_start) / r.slowdown, r.spec.turns[r.turn] - r.done_in_turn)
            left = cap - tokens
            reserved += clip if left >= clip else max(0.0, left)
        return need < free - ratio * reserved

    def _admit(self, rep: Replica, req: Request, context: float) -> None:
        rep.occupied += 1
        self._occupy(+1)
        req.replica = rep
        req.kv_entry = context
        rep.kv_fixed += context
        rep.members[req] = None
        if self._serial_prefill:
            req.phase = PREFILL
            self._new_ticket(req)
            rep.prefill_queue.append(req)
            if rep.prefilling is None:
                self._next_prefill(rep)
        elif self.workload.prefill_s > 0:
            req.phase = PREFILL
            self.events.after(self.workload.prefill_s, self._prefill_done, req, self._new_ticket(req))
        else:
            self._begin_decode(req)

    def _prefill_done(self, req: Request, ticket: int) -> bool:
        if req.ticket != ticket:
            return False
        self._begin_decode(req)
        return True

    def _next_prefill(self, rep: Replica) -> None:
        """Serial prefill: start the next request of `rep`'s prefill queue, or let decoding go on."""
        if not rep.prefill_queue:
            rep.prefilling = None
            self._plan(rep)
            return
        self._advance(rep, self.events.now)  # decoding progress up to now counts; it stands still from here
        req = rep.prefill_queue.popleft()
        rep.prefilling = req
        rep.ver += 1  # no decode event while prefilling
        seconds = self.workload.prefill_seconds(req.kv_entry)
        self.prefill_tokens += req.kv_entry
        self.reprefill_tokens += req.tokens_done
        self.prefill_seconds += seconds
        self.events.after(seconds, self._serial_prefill_done, rep, req, req.ticket)

    def _serial_prefill_done(self, rep: Replica, req: Request, ticket: int) -> bool:
        if rep.prefilling is not req or req.ticket != ticket:
            return False
        self._begin_decode(req)  # still frozen: V does not move, no event is planned
        rep.prefilling = None
        self._next_prefill(rep)
        self._fill()
        return True

    def _begin_decode(self, req: Request) -> None:
        rep = req.replica
        now = self.events.now
        self._advance(rep, now)
        req.phase = DECODE
        ticket = self._new_ticket(req)
        req.v_start = rep.v
        if req.start_version is None and self.on_first_token is not None:
            self.on_first_token(req)
        work = (req.spec.turns[req.turn] - req.done_in_turn) * req.slowdown
        heapq.heappush(rep.heap, (rep.v + work, ticket, req))
        rep.decoding += 1
        rep.inv_s += 1.0 / req.slowdown
        rep.vs += req.v_start / req.slowdown
        self._plan(rep)

    def _step_seconds(self, rep: Replica) -> float:
        """Seconds of `rep`'s decode step now (at `rep.last_t`): batch term plus the KV-cache term."""
        step = self.workload.decode_step_seconds(rep.decoding)
        if self._kv_step:
            step += self._kv_step * (rep.kv_fixed + rep.v * rep.inv_s - rep.vs)
        return step

    def _advance(self, rep: Replica, now: float) -> None:
        # The step time grows linearly in V (the cache grows by inv_s tokens per unit of V), so
        # dt = (alpha + beta * dV) dV integrates exactly: dt = alpha dV + beta dV^2 / 2.
        dt = now - rep.last_t
        if rep.decoding and rep.prefilling is None and dt > 0:
            alpha = self._step_seconds(rep)
            beta = self._kv_step * rep.inv_s
            rep.v += 2.0 * dt / (alpha + math.sqrt(alpha * alpha + 2.0 * beta * dt)) if beta > 0 else dt / alpha
        rep.last_t = now

    def _seconds_to(self, rep: Replica, dv: float) -> float:
        """Seconds until `rep`'s V has advanced by `dv` (the replica advanced to now, decoding)."""
        return dv * (self._step_seconds(rep) + 0.5 * self._kv_step * rep.inv_s * dv)

    def _top(self, rep: Replica) -> Optional[tuple[float, int, Request]]:
        heap = rep.heap
        while heap:
            fv, ticket, req = heap[0]
            if req.ticket == ticket and req.phase == DECODE:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _plan(self, rep: Replica) -> None:
        """One event for `rep`: its next finisher, or the moment its KV cache fills, whichever is first."""
        rep.ver += 1
        rep.due_finish = None
        if rep.prefilling is not None or not rep.decoding:
            return
        self._advance(rep, self.events.now)
        delay = None
        top = self._top(rep)
        if top is not None:
            delay = self._seconds_to(rep, max(0.0, top[0] - rep.v))
            rep.due_finish = top[0]
        if self._kv_cap > 0 and rep.decoding > 1:  # a lone request may overflow: nothing to preempt
            full_in = self._seconds_to(rep, max(0.0, (self._kv_cap - self.kv_used(rep)) / rep.inv_s))
            if delay is None or full_in < delay:
                delay, rep.due_finish = full_in, None
        if delay is not None:
            self.events.after(delay, self._replica_due, rep, rep.ver)

    def _replica_due(self, rep: Replica, ver: int) -> bool:
        if ver != rep.ver:
            return False
        self._advance(rep, self.events.now)
        top = self._top(rep)
        if top is not None and rep.due_finish is not None and top[0] == rep.due_finish:
            rep.v = max(rep.v, top[0])  # the event was planned for this finisher: no rounding left-over
        limit = rep.v + _EPS * max(1.0, abs(rep.v))
        finished = []
        while True:
            top = self._top(rep)
            if top is None or top[0] > limit:
                break
            heapq.heappop(rep.heap)
            finished.append(top[2])
        for req in finished:
            self._turn_done(req)
        if self._kv_cap > 0 and self.kv_used(rep) >= self._kv_cap * (1.0 - 1e-9):
            if self._reserve is not None:
                self._retract(rep)
            else:
                self._preempt(rep)
        self._plan(rep)
        self._fill()
        return True

    def _preempt(self, rep: Replica) -> None:
        """KV cache full: preempt the newest decoding requests until it is below the admission watermark."""
        while rep.decoding > 1 and self.kv_used(rep) > self._kv_room:
            victim = next(r for r in reversed(rep.members) if r.phase == DECODE)
            self._lose_kv(victim)
            self.pending.appendleft(victim)  # first in line again; it re-prefills its whole context

    def _retract(self, rep: Replica) -> None:
        """kv_reserve, decoding filled the cache: retract as SGLang's retract_decode does. Victims are the
        requests with the fewest new tokens in their engine request (ties: the longest prompt) until
        retract_decode_steps tokens per survivor are free; the new ratio is what the survivors need."""
        steps = self._reserve.retract_decode_steps
        now = {r: self._tokens_now(r, rep) for r in rep.members if r.phase == DECODE}
        victims = sorted(now, key=lambda r: (now[r] - r.engine_base, -r.engine_base))
        survivors = len(victims)
        for victim in victims:
            if survivors <= 1 or self._kv_cap - self.kv_used(rep) >= steps * survivors:
                break
            self._lose_kv(victim)
            self.engine_queue.append(victim)  # it keeps its router connection, at the back of the queue
            del now[victim]
            survivors -= 1
        generated = sum(tokens - r.engine_base for r, tokens in now.items())
        allowed = sum(self._max_new - r.engine_base for r in now)
        rep.ratio = min(1.0, (generated + steps * survivors) / allowed) if allowed > 0 else 1.0
        rep.ratio_v = rep.v

    def _lose_kv(self, victim: Request) -> None:
        """`victim` (decoding, replica advanced) gives its KV back and waits to be admitted again."""
        self._stop(victim)
        victim.phase = QUEUED
        self._new_ticket(victim)
        self.preemptions += 1

    def _turn_done(self, req: Request) -> None:
        rest = req.spec.turns[req.turn] - req.done_in_turn
        req.tokens_done += rest
        self.tokens_generated += rest
        req.done_in_turn = 0.0
        req.turn += 1
        self._leave_slot(req)
        if req.turn < len(req.spec.turns):
            req.tool_next = True
            self._begin_tool(req)
            return
        req.phase = DONE
        self._new_ticket(req)
        self._unregister(req)
        self.on_done(req)

    def _begin_tool(self, req: Request) -> None:
        req.tool_next = False
        req.phase = TOOL
        ticket = self._new_ticket(req)
        wait = req.spec.tool_waits[req.turn - 1] if req.turn >= 1 else 0.0
        self.events.after(wait, self._tool_done, req, ticket)

    def _tool_done(self, req: Request, ticket: int) -> bool:
        if req.ticket != ticket:
            return False
        self._enqueue(req)
        return True
