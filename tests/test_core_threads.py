"""Thread safety: many threads dispatching, submitting and collecting through one Pacer at once.

A checking subclass of each strategy records a violation whenever the Pacer admits more than the
strategy's last `compute_dispatch_count` granted, admits without a fresh grant (two dispatchers
interleaving compute and admit), lets running + buffered exceed the strategy's limit, or calls a hook
without holding the thread-safe proxy's lock (the contract: hooks run under the strategy lock).
"""
from __future__ import annotations

import queue
import sys
import threading
from collections import Counter

import pytest

from coda_server import TrajectoryStatus
from coda_server.core import Pacer, PromptRef, Trajectory
from coda_server.core.strategy import STRATEGIES, ThreadSafeStrategy

OK, FAILED = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED
STRATEGY_NAMES = ["no-window", "window-gated", "windowed-fifo", "fixed-capacity"]
JOIN_BOUND = 60.0  # a hang guard, not a timing assertion


@pytest.fixture(autouse=True)
def fast_thread_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more interleavings per test
    yield
    sys.setswitchinterval(old)


def checked(base, limit: int):
    class Checked(base):
        def __init__(self, config):
            super().__init__(config)
            self.violations: list[str] = []
            self.grant = None  # what the latest compute allowed, consumed by the next on_dispatched
            self.last_q = 0
            self.collected: list[str] = []
            self.max_load = 0
            self.proxy_lock = None  # set by build(): the lock every hook must run under

        def check_locked(self, hook):
            if not self.proxy_lock._is_owned():
                self.violations.append(f"{hook} called without the strategy lock")

        def compute_dispatch_count(self, buf_qsize):
            self.check_locked("compute_dispatch_count")
            n = super().compute_dispatch_count(buf_qsize)
            self.grant, self.last_q = max(0, n), buf_qsize
            return n

        def on_dispatched(self, groups):
            self.check_locked("on_dispatched")
            groups = list(groups)
            if self.grant is None:
                self.violations.append(f"admitted {len(groups)} without a fresh compute_dispatch_count")
            elif len(groups) > self.grant:
                self.violations.append(f"admitted {len(groups)} > granted {self.grant}")
            load = self._running_count + len(groups) + self.last_q
            self.max_load = max(self.max_load, load)
            if load > limit:
                self.violations.append(f"running + admitted + buffered = {load} > {limit}")
            self.grant = None
            super().on_dispatched(groups)
            seqs = getattr(self, "_seqs", None)
            if base.__name__ == "WindowGatedStrategy" and seqs.next_seq - seqs.min_seq() > limit:
                self.violations.append(f"seq span {seqs.next_seq - seqs.min_seq()} > {limit}")

        def on_collected(self, prompt_id):
            self.check_locked("on_collected")
            super().on_collected(prompt_id)
            self.collected.append(prompt_id)

        def will_collect(self, group):
            self.check_locked("will_collect")
            return super().will_collect(group)

        def on_reset(self):
            self.check_locked("on_reset")
            super().on_reset()

    return Checked


def build(core_config, name, B=8, stale=1.0, N=4):
    config = core_config(name, B=B, stale=stale, N=N, M=2 * N)
    limit = B if name == "fixed-capacity" else int(B * (1 + stale))
    strategy = ThreadSafeStrategy(checked(STRATEGIES.get(name), limit)(config), name)
    pacer = Pacer(config, strategy=strategy)
    strategy.wrapped.proxy_lock = strategy.lock  # the pacer's own lock, which the proxy runs under once adopted
    assert strategy.lock is pacer.lock
    return pacer, strategy.wrapped, limit


def run_threads(threads):
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_BOUND)
    assert not any(t.is_alive() for t in threads), "a worker hung"


@pytest.fixture(autouse=True)
def _fixed_capacity_registered(core_config):
    core_config("fixed-capacity")


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_concurrent_dispatch_admits_exactly_what_one_caller_would(core_config, name):
    pacer, strategy, limit = build(core_config, name)
    results: list = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(w):
        barrier.wait()
        for j in range(20):
            r = pacer.dispatch([PromptRef(f"w{w}-{j}-{k}") for k in range(1 + (w + j) % 3)])
            with lock:
                results.append(r)

    run_threads([threading.Thread(target=worker, args=(w,)) for w in range(8)])
    seqs = sorted(a.seq for r in results for a in r.admitted)
    assert seqs == list(range(limit))  # serial answer: exactly the capacity, each seq once
    assert strategy.violations == []
    assert pacer.state().running == limit and pacer.state().invariant_holds()


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_waiting_dispatchers_are_admitted_as_slots_open(core_config, name):
    pacer, strategy, limit = build(core_config, name, N=1)
    first = [a.prompt_id for a in pacer.dispatch([PromptRef(f"p{i}") for i in range(limit)]).admitted]
    assert len(first) == limit
    got: dict[int, list[str]] = {}

    def waiter(w):
        got[w] = [a.prompt_id for a in pacer.dispatch([PromptRef(f"late{w}")], wait=JOIN_BOUND).admitted]

    threads = [threading.Thread(target=waiter, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    # Free four slots, oldest first (so window-gated's head moves too).
    for pid in first[:4]:
        pacer.submit([Trajectory(f"{pid}/t0", pid)])
        assert len(pacer.collect_now(1).groups) == 1
    for t in threads:
        t.join(JOIN_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert sorted(sum(got.values(), [])) == [f"late{w}" for w in range(4)]
    assert pacer.dispatch([PromptRef("extra")]).admitted == []
    assert strategy.violations == []
    assert pacer.state().running == limit


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_many_threads_dispatch_submit_collect(core_config, name):
    N, TARGET = 4, 240
    pacer, strategy, limit = build(core_config, name, N=N)
    work: queue.Queue = queue.Queue()
    lock = threading.Lock()
    admitted: list[str] = []
    delivered: list = []
    errors: list[BaseException] = []
    resent = Counter()
    dispatch_done = threading.Event()
    stop = threading.Event()

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as exc:  # surface in the main thread
                errors.append(exc)
                stop.set()
                dispatch_done.set()
        return run

    def check_state():
        st = pacer.state()
        if st.running + st.buffered > limit or not st.invariant_holds():
            raise AssertionError(f"bad state under contention: {st}")

    def failed_group(pid):
        return hash(pid) % 7 == 0

    def dispatcher(w):
        j = 0
        while not stop.is_set():
            with lock:
                if len(admitted) >= TARGET:
                    break
            r = pacer.dispatch([PromptRef(f"d{w}-{j}-{k}") for k in range(3)], wait=0.05)
            j += 1
            ids = [a.prompt_id for a in r.admitted]
            with lock:
                admitted.extend(ids)
            for pid in ids:
                work.put((pid, 0))
            check_state()

    def submitter(w):
        while not stop.is_set():
            try:
                pid, start = work.get(timeout=0.05)
            except queue.Empty:
                continue
            # Submit half now and leave the rest to whichever submitter takes it next: groups
            # complete out of dispatch order, from different threads.
            end = N if start else N // 2
            statuses = [FAILED if failed_group(pid) and i == N - 1 else OK for i in range(start, end)]
            batch = [Trajectory(f"{pid}/t{i}", pid, 0, s, reward=float(i)) for i, s in zip(range(start, end), statuses)]
            if start and w % 2 == 0:
                batch.append(Trajectory(f"{pid}/t0", pid, 0, OK, reward=0.0))  # a harmless retry
                with lock:
                    resent[pid] += 1
            pacer.submit(batch)
            if not start:
                work.put((pid, end))
            check_state()

    def collector():
        while not stop.is_set():
            r = pacer.collect(2, wait=0.05, allow_partial=True)
            with lock:
                delivered.extend(r.groups)
            st = pacer.state()
            if dispatch_done.is_set():
                with lock:
                    if st.consumed + st.filtered == len(admitted) and st.running == 0 and st.buffered == 0:
                        return
            check_state()

    dispatchers = [threading.Thread(target=guarded(dispatcher), args=(w,)) for w in range(3)]
    submitters = [threading.Thread(target=guarded(submitter), args=(w,)) for w in range(3)]
    collectors = [threading.Thread(target=guarded(collector)) for _ in range(2)]
    for t in submitters + collectors:
        t.start()
    run_threads(dispatchers)
    dispatch_done.set()
    for t in collectors:
        t.join(JOIN_BOUND)
    stop.set()
    for t in submitters:
        t.join(JOIN_BOUND)
    assert not any(t.is_alive() for t in submitters + collectors), "a worker hung"
    assert errors == []
    assert strategy.violations == []

    assert len(admitted) >= TARGET and len(set(admitted)) == len(admitted)
    ids = [g.prompt_id for g in delivered]
    assert len(ids) == len(set(ids)), "a group was delivered twice"
    expected_dropped = {p for p in admitted if failed_group(p)}
    assert set(ids) == set(admitted) - expected_dropped, "a group was lost"
    # on_collected exactly once per group, dropped or delivered.
    assert sorted(strategy.collected) == sorted(admitted)
    for g in delivered:
        assert sorted(t.trajectory_id for t in g.trajectories) == [f"{g.prompt_id}/t{i}" for i in range(N)]
    st = pacer.state()
    assert (st.running, st.buffered, st.queued_trajectories) == (0, 0, 0)
    assert st.dispatched == len(admitted) and st.submitted == N * len(admitted)
    assert st.consumed == len(ids) and st.filtered == len(expected_dropped)
    assert st.duplicates == sum(resent.values())
    assert st.invariant_holds()
    assert strategy.max_load <= limit


def test_close_answers_waiting_calls_at_once_without_admitting(core_pacer):
    from coda_server.core import ShuttingDownError

    pacer = core_pacer("no-window", B=2, stale=1.0, N=1)  # C = 4
    pacer.dispatch([PromptRef(f"p{i}") for i in range(4)])
    pacer.submit([Trajectory("p0/t0", "p0")])  # one group in the buffer
    waiting = threading.Semaphore(0)
    pacer.waits.on_block = waiting.release  # the public hook: told each time a caller starts waiting
    answers: dict = {}
    errors: list = []

    def call(key, fn):
        try:
            answers[key] = fn()
        except BaseException as exc:
            errors.append((key, exc))

    # Collect of 1 would succeed at once, so ask for 2 groups: they wait, the dispatch too (R + Q = C).
    threads = [
        threading.Thread(target=call, args=("dispatch", lambda: pacer.dispatch([PromptRef("late")], wait=JOIN_BOUND))),
        threading.Thread(target=call, args=("collect", lambda: pacer.collect(2, wait=JOIN_BOUND))),
        threading.Thread(target=call, args=("partial", lambda: pacer.collect(3, wait=JOIN_BOUND, allow_partial=True))),
    ]
    for t in threads:
        t.start()
    for _ in threads:
        assert waiting.acquire(timeout=JOIN_BOUND)
    pacer.close()
    for t in threads:
        t.join(JOIN_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert answers["dispatch"].admitted == [] and answers["dispatch"].remaining == 0
    # Without allow_partial nothing; with it, what the buffer holds.
    assert answers["collect"].groups == [] and answers["collect"].timed_out
    assert [g.prompt_id for g in answers["partial"].groups] == ["p0"] and answers["partial"].timed_out
    st = pacer.state()
    assert st.dispatched == 4 and st.running == 3 and st.invariant_holds()
    # New calls after close fail.
    with pytest.raises(ShuttingDownError):
        pacer.dispatch([PromptRef("later")])
    with pytest.raises(ShuttingDownError):
        pacer.collect(1)
