"""Property-based: random operation sequences against a small reference model of the semantics doc.

The model restates the formulas directly (no heaps, no lazy deletion, plain scans), so a
disagreement points at the Pacer or a built-in strategy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda_server import TrajectoryStatus
from coda_server.core import InvalidArgumentError, Pacer, PromptRef, StaleGenerationError, Trajectory

OK, FAILED, ABORTED = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED


@dataclass
class ModelGroup:
    pid: str
    seq: int
    ds: int
    size: int
    statuses: list = field(default_factory=list)
    arrival: int = 1 << 62  # order of its first trajectory's arrival (a Reset restores in that order)

    @property
    def complete(self) -> bool:
        return len(self.statuses) == self.size


class Model:
    """The semantics doc, literally."""

    def __init__(self, strategy: str, B: int, stale: float, sizes: list[int]):
        self.strategy, self.B, self.C, self.sizes = strategy, B, int(B * (1 + stale)), sizes
        self.next_seq = 0
        self.inflight: dict[str, ModelGroup] = {}
        self.buffer: list[ModelGroup] = []
        self.generation_prompts: set[str] = set()
        self.past: deque[set[str]] = deque(maxlen=16)  # server.remembered_generations
        self.paused = False
        self.arrivals = 0
        self.step = self.weight_version = self.generation = 0
        self.totals = dict.fromkeys(("dispatched", "submitted", "collected", "consumed", "filtered", "restored",
                                     "dropped", "stale_rejected"), 0)

    def min_seq(self) -> int:
        return min((g.seq for g in self.inflight.values()), default=self.next_seq)

    def count(self) -> int:
        free = self.C - len(self.inflight) - len(self.buffer)
        if self.strategy == "window-gated":
            return min(self.min_seq() + self.C - self.next_seq, free)
        return max(0, free)

    def admissible(self) -> int:
        return 0 if self.paused else max(0, self.count())

    def gate(self, g: ModelGroup) -> bool:
        if ABORTED in g.statuses:
            return False
        if self.strategy == "windowed-fifo":
            return g.seq - self.min_seq() < self.B
        return True

    def settle(self) -> None:
        """Collect every complete group the gate allows, until nothing changes."""
        changed = True
        while changed:
            changed = False
            for g in sorted(self.inflight.values(), key=lambda g: g.seq):
                if g.complete and self.gate(g):
                    del self.inflight[g.pid]
                    if FAILED in g.statuses:  # the default `status` filter
                        self.totals["filtered"] += 1
                    else:
                        self.buffer.append(g)
                        self.totals["collected"] += 1
                    changed = True

    def dispatch(self, pids: list[str], ds: list[int]) -> list[str]:
        n = 0 if self.paused else max(0, min(self.count(), len(pids)))
        for pid, d in zip(pids[:n], ds[:n]):
            self.inflight[pid] = ModelGroup(pid, self.next_seq, d, self.sizes[d])
            self.next_seq += 1
            self.generation_prompts.add(pid)
        self.totals["dispatched"] += n
        self.settle()
        return pids[:n]

    def submit(self, pid: str, statuses: list) -> None:
        group = self.inflight[pid]
        if not group.statuses and statuses:
            group.arrival, self.arrivals = self.arrivals, self.arrivals + 1
        group.statuses.extend(statuses)
        self.totals["submitted"] += len(statuses)
        self.settle()

    def collect(self, k: int, partial: bool) -> list[str]:
        self.buffer.sort(key=lambda g: g.seq)
        take = k if len(self.buffer) >= k else (len(self.buffer) if partial else 0)
        taken, self.buffer = self.buffer[:take], self.buffer[take:]
        self.totals["consumed"] += take
        return [g.pid for g in taken]

    def reset(self, resume: bool, weight_version: int):
        groups = sorted(self.inflight.values(), key=lambda g: g.seq)
        restored = [g.pid for g in sorted(groups, key=lambda g: (g.arrival, g.seq)) if g.complete]
        dropped = [g.pid for g in groups if not g.complete]
        self.totals["restored"] += len(restored)
        self.totals["dropped"] += len(dropped)
        self.past.append(self.generation_prompts)
        self.generation_prompts = set()
        self.inflight.clear()
        self.generation += 1
        self.paused = True
        if resume:
            self.resume(weight_version)
        return restored, dropped

    def resume(self, weight_version: int) -> None:
        self.step += 1
        self.weight_version = weight_version
        self.paused = False

    def stale_prompts(self) -> list[str]:
        return sorted(set().union(*self.past) - set(self.inflight)) if self.past else []


def check(pacer: Pacer, model: Model) -> None:
    s = pacer.state()
    assert s.invariant_holds(), s
    expected = dict(
        running=len(model.inflight), buffered=len(model.buffer),
        queued_trajectories=sum(len(g.statuses) for g in model.inflight.values()),
        capacity=model.admissible(), window_size=model.C, paused=model.paused, step=model.step,
        generation=model.generation, weight_version=model.weight_version, **model.totals)
    actual = {key: getattr(s, key) for key in expected}
    assert actual == expected
    assert pacer.strategy.running_count == len(model.inflight)


STATUSES = st.sampled_from([OK, OK, OK, FAILED, ABORTED])


def run_sequence(core_config, strategy: str, data) -> None:
    B = data.draw(st.integers(1, 4), label="B")
    stale = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]), label="stale_steps")
    n0 = data.draw(st.integers(1, 3), label="N0")
    n1 = data.draw(st.integers(1, 3), label="N1")
    config = core_config(strategy, B=B, stale=stale, N=n0, M=n0,
                         extra=(f"data_sources=['${{data_source}}',{{name: b, num_trajectories_per_prompt: {n1}}}]",))
    pacer = Pacer(config)
    model = Model(strategy, B, stale, [n0, n1])
    fresh = iter(range(10**6))
    check(pacer, model)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["dispatch", "dispatch", "submit", "submit", "submit", "collect", "reset",
                                        "resume", "stale"]), label="op")
        if op == "dispatch":
            k = data.draw(st.integers(0, 6), label="k")
            ds = [data.draw(st.integers(0, 1), label="ds") for _ in range(k)]
            pids = [f"g{next(fresh)}" for _ in range(k)]
            result = pacer.dispatch([PromptRef(p, d) for p, d in zip(pids, ds)])
            assert [a.prompt_id for a in result.admitted] == model.dispatch(pids, ds)
            assert result.paused == model.paused
        elif op == "submit":
            open_groups = sorted((g for g in model.inflight.values() if not g.complete), key=lambda g: g.seq)
            if not open_groups:
                continue
            g = data.draw(st.sampled_from(open_groups), label="group")
            have, need = len(g.statuses), g.size - len(g.statuses)
            m = data.draw(st.integers(1, need), label="m")
            statuses = [data.draw(STATUSES, label="status") for _ in range(m)]
            pacer.submit([Trajectory(f"{g.pid}/t{have + i}", g.pid, g.ds, s, reward=float(i))
                          for i, s in enumerate(statuses)])
            model.submit(g.pid, statuses)
        elif op == "collect":
            k = data.draw(st.integers(1, 4), label="k")
            partial = data.draw(st.booleans(), label="partial")
            if not partial and k > model.C:  # the window can never hold k groups: refused, nothing taken
                with pytest.raises(InvalidArgumentError, match=f"num_groups {k} can never be buffered"):
                    pacer.collect_now(k, allow_partial=partial)
                continue
            got = pacer.collect_now(k, allow_partial=partial)
            assert [g.prompt_id for g in got.groups] == model.collect(k, partial)
        elif op == "reset":
            resume = data.draw(st.booleans(), label="resume")
            version = model.weight_version + data.draw(st.integers(0, 2), label="version_step")
            result = pacer.reset(resume=resume, weight_version=version if resume else None)
            restored, dropped = model.reset(resume, version)
            assert [g.prompt_id for g in result.restored] == restored
            assert result.dropped_prompt_ids == dropped
        elif op == "resume":
            version = model.weight_version + data.draw(st.integers(0, 2), label="version_step")
            pacer.resume(version)
            model.resume(version)
        elif op == "stale":
            stale_pids = model.stale_prompts()
            if not stale_pids:
                continue
            pid = data.draw(st.sampled_from(stale_pids), label="stale_pid")
            with pytest.raises(StaleGenerationError):
                pacer.submit([Trajectory(f"{pid}/late{next(fresh)}", pid, 0)])
            model.totals["stale_rejected"] += 1
        check(pacer, model)
    pacer.close()


@pytest.mark.parametrize("strategy", ["no-window", "window-gated", "windowed-fifo"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_sequences_match_the_reference_model(core_config, strategy, data):
    run_sequence(core_config, strategy, data)
