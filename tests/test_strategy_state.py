"""Strategy state across a restart: the `state()`/`restore()` hook is saved in each snapshot and restored on
recovery, so a restarted server (real process, state_dir, killed and started again) makes every decision an
uninterrupted one makes; latency-aware's learned depth is the case in point."""
from __future__ import annotations

import pytest

from coda_client import PromptRef
from coda_server.core import Pacer, load_config
from coda_server.core.latency_aware import LatencyAwareStrategy
from test_durability_crash import B, N
from test_durability_restart import durable, group  # noqa: F401  (the fixture)

# latency-aware with C = 3 B: the buffer fills beyond a step's need, so the depth shrinks below C at Resumes.
LATENCY_AWARE = ("fully_async.sliding_window=latency-aware", "fully_async.stale_steps=2.0")
STEPS, RESTART_AFTER = 6, 3
SMALL = [f"data_source.num_prompts_per_step={B}", f"data_source.num_trajectories_per_prompt={N}",
         f"trainer.mini_batch_size={N}", *LATENCY_AWARE]


def run_steps(client, steps: range) -> list[tuple]:
    """Each step: offer many candidates, complete what is admitted, take one step's B groups, Reset and
    resume. Returns every decision: (step, admitted ids, seqs, capacity, remaining) per Dispatch."""
    decisions = []
    for step in steps:
        offered = [PromptRef(f"s{step}-p{i}", epoch=step, index=i) for i in range(3 * B)]
        answer = client.dispatch(offered)
        decisions.append((step, answer.admitted, answer.seqs, answer.capacity, answer.remaining))
        for prompt_id in answer.admitted:
            client.submit(group(prompt_id, weight_version=step))
        taken = client.collect(B, wait=10)
        decisions.append((step, "collected", [g.prompt_id for g in taken]))
        reset = client.reset("wait", resume=True, weight_version=step + 1)
        decisions.append((step, "reset", reset.step, [g.prompt_id for g in reset.restored], reset.dropped_prompt_ids))
    return decisions


def test_a_restarted_server_makes_every_decision_an_uninterrupted_one_makes(durable):  # noqa: F811
    restarted, twin = durable(*LATENCY_AWARE), durable(*LATENCY_AWARE)
    before = run_steps(restarted.client, range(RESTART_AFTER))
    assert before == run_steps(twin.client, range(RESTART_AFTER))
    # The depth has been learned by now: a Dispatch admits fewer than C - R - Q (what a fresh one would).
    peek = twin.client.dispatch([])
    assert peek.remaining < peek.capacity - peek.running - peek.buffered, peek

    restarted.restart(kill=True)
    assert restarted.client.dispatch([]).remaining == peek.remaining
    assert run_steps(restarted.client, range(RESTART_AFTER, STEPS)) == run_steps(twin.client, range(RESTART_AFTER, STEPS))


def test_state_round_trips_into_a_fresh_strategy_and_only_the_same_strategy_takes_it():
    config = load_config(overrides=SMALL)
    learned = LatencyAwareStrategy(config)
    learned.depth, learned.engine_concurrency, learned._fetch_groups = B + 1, 6, 2
    fresh = LatencyAwareStrategy(config)
    assert fresh.depth == 3 * B and fresh.state() != learned.state()
    fresh.restore(learned.state())
    assert fresh.state() == learned.state() and fresh.depth == B + 1

    pacer = Pacer(config)
    pacer.strategy.restore(learned.state())
    snapshot = pacer.export_state()
    assert snapshot["strategy"] == {"name": "latency-aware", "state": learned.state()}
    other = Pacer(config)
    with other.lock:
        other.snapshots.load({**snapshot, "strategy": {"name": "windowed-fifo", "state": learned.state()}})
    assert other.strategy.depth == 3 * B  # another strategy's state is not taken


@pytest.mark.parametrize("name", ["no-window", "window-gated", "windowed-fifo"])
def test_the_built_in_strategies_without_learned_state_save_nothing(name):
    pacer = Pacer(load_config(overrides=[f"fully_async.sliding_window={name}"]))
    assert pacer.export_state()["strategy"] == {"name": name, "state": None}
