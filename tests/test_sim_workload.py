"""coda-sim building blocks: configuration, the workload model and the generation pool (no Pacer here)."""
from __future__ import annotations

import pytest

from coda_server.core import TrajectoryStatus
from coda_server.core.errors import ConfigError
from coda_sim import Workload, WorkloadError, load_sim_config, preset_names
from coda_sim.engine import DONE, IDLE, EventQueue, GenerationPool, Request
from coda_sim.workload import TrajSpec


def sim_section(*overrides: str, preset: str | None = None) -> dict:
    return load_sim_config(overrides=list(overrides), preset=preset).sim


def workload(*overrides: str, n: int = 8, preset: str | None = None) -> Workload:
    return Workload(sim_section(*overrides, preset=preset), n)


# ------------------------------------------------------------------ configuration


def test_presets_ship_and_load():
    names = preset_names()
    assert "long_tail" in names and "defaults" not in names
    for name in names:
        config = load_sim_config(preset=name)
        assert config.steps >= 1
        config.pacer_config()  # the pacer half validates with the core's own rules


def test_default_preset_is_long_tail_and_overrides_apply():
    config = load_sim_config(overrides=["sim.cluster.rollout_replicas=3", "fully_async.stale_steps=0.5"])
    assert config.sim["generation"]["length"]["cap"] == 20000  # from long_tail
    assert config.sim["cluster"]["rollout_replicas"] == 3
    assert float(config.pacer_config().fully_async.stale_steps) == 0.5


@pytest.mark.parametrize("override, said", [
    ("sim.cluster.rollout_replica=3", "sim.cluster.rollout_replica: unknown key (did you mean "
                                      "sim.cluster.rollout_replicas?)"),
    ("sim.step=3", "sim.step: unknown key (did you mean sim.steps?)"),
    ("sim.workers=3", "sim.workers: unknown key (known keys here: sim.cluster, sim.colocate, sim.dataset_size,"),
])
def test_misspelt_sim_key_is_an_error_naming_the_closest_key(override, said):
    with pytest.raises(ConfigError) as caught:
        load_sim_config(overrides=[override])
    assert said in str(caught.value)


def test_a_sim_override_that_is_not_yaml_is_named():
    with pytest.raises(ConfigError, match=r"override 'sim.seed=\[1': the value '\[1' does not read as YAML"):
        load_sim_config(overrides=["sim.seed=[1"])


def test_invalid_pacer_key_reports_the_core_message():
    with pytest.raises(ConfigError, match="fully_async.stale_steps"):
        load_sim_config(overrides=["fully_async.stale_steps=-1"])


def test_reward_filter_is_added_when_groups_are_filtered():
    config = load_sim_config(overrides=["sim.reward.filtered_group_prob=0.2", "rollout.filter=[status]"])
    assert list(config.pacer_config().rollout.filter) == ["status", "reward"]
    config = load_sim_config(overrides=["sim.reward.filtered_group_prob=0.0", "rollout.filter=[status]"])
    assert list(config.pacer_config().rollout.filter) == ["status"]


@pytest.mark.parametrize("override, key", [
    ("sim.generation.decode.tokens_per_s_full=500.0", "tokens_per_s_full"),
    ("sim.generation.length.cap=0", "cap"),
    ("sim.reward.filtered_group_prob=1.5", "filtered_group_prob"),
    ("sim.generation.length.distribution=pareto", "distribution"),
    ("sim.colocate.oversample=0.5", "oversample"),
])
def test_invalid_workload_values_name_the_key(override, key):
    with pytest.raises(WorkloadError, match=key):
        workload(override)


# ------------------------------------------------------------------ workload draws


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b, c = workload("sim.seed=7"), workload("sim.seed=7"), workload("sim.seed=8")
    assert [a.prompt(k) for k in range(50)] == [b.prompt(k) for k in range(50)]
    assert [a.prompt(k) for k in range(50)] != [c.prompt(k) for k in range(50)]
    # Prompt k does not depend on which prompts were drawn before it.
    assert workload("sim.seed=7").prompt(33) == a.prompt(33)


def test_lognormal_lengths_respect_min_and_cap_and_have_a_tail():
    w = workload("sim.generation.length.median=1000", "sim.generation.length.sigma=1.2",
                 "sim.generation.length.cap=5000", "sim.generation.length.min=50")
    lengths = [t.nominal_tokens for k in range(300) for t in w.prompt(k).trajs]
    assert min(lengths) >= 50 and max(lengths) == 5000  # the cap is hit: a long tail
    assert sorted(lengths)[len(lengths) // 2] < 1500  # median near 1000


def test_constant_lengths():
    w = workload("sim.generation.length.distribution=constant", "sim.generation.length.median=321")
    assert {t.tokens for k in range(20) for t in w.prompt(k).trajs} == {321}


def test_empirical_lengths_from_a_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# measured\n10\n20\n\n40000\n")
    w = workload("sim.generation.length.distribution=empirical", f"sim.generation.length.file={path}",
                 "sim.generation.length.cap=30", "sim.generation.length.min=1")
    assert {t.tokens for k in range(40) for t in w.prompt(k).trajs} == {10, 20, 30}
    path.write_text("[5, 6]")
    w = workload("sim.generation.length.distribution=empirical", f"sim.generation.length.file={path}",
                 "sim.generation.length.min=1")
    assert {t.tokens for k in range(40) for t in w.prompt(k).trajs} == {5, 6}
    with pytest.raises(WorkloadError, match="file"):
        workload("sim.generation.length.distribution=empirical")


def test_multi_turn_splits_the_response_and_waits_for_tools():
    w = workload("sim.generation.turns.min=2", "sim.generation.turns.max=4", "sim.generation.turns.tool_latency_s=3.0")
    for k in range(30):
        for t in w.prompt(k).trajs:
            assert 2 <= len(t.turns) <= 4 and sum(t.turns) == t.nominal_tokens
            assert len(t.tool_waits) == len(t.turns) - 1 and all(x >= 0 for x in t.tool_waits)


def test_reward_filtered_groups_have_equal_rewards_others_do_not():
    w = workload("sim.reward.filtered_group_prob=0.3")
    specs = [w.prompt(k) for k in range(200)]
    flagged = [s for s in specs if s.all_equal_reward]
    assert 30 < len(flagged) < 90
    for s in specs:
        assert (len({t.reward for t in s.trajs}) == 1) == s.all_equal_reward


def test_failures_and_stragglers():
    w = workload("sim.generation.fail_prob=0.5", "sim.generation.stragglers.indices=[3]",
                 "sim.generation.stragglers.slowdown=9.0")
    statuses = {t.status for k in range(20) for t in w.prompt(k).trajs}
    assert statuses == {TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED}
    assert w.prompt(3).slowdown == 9.0 and w.prompt(4).slowdown == 1.0


# ------------------------------------------------------------------ generation pool


def _pool(single: float, full: float, slots: int, replicas: int = 1, *extra: str):
    w = workload(f"sim.generation.decode.tokens_per_s_single={single}",
                 f"sim.generation.decode.tokens_per_s_full={full}", f"sim.cluster.slots_per_replica={slots}",
                 "sim.generation.prefill_s=0.0", "sim.generation.prefill_tokens_per_s=0.0",
                 "sim.cluster.kv_cache_tokens=0", *extra)
    events = EventQueue()
    done: list[tuple[float, int]] = []
    pool = GenerationPool(events, w, replicas, lambda req: done.append((events.now, req.j)))
    return w, events, pool, done


def _request(j: int, tokens: int, slowdown: float = 1.0, turns: tuple[int, ...] | None = None) -> Request:
    turns = turns or (tokens,)
    spec = TrajSpec(turns, tuple(0.0 for _ in turns[1:]), TrajectoryStatus.COMPLETED, 1.0, sum(turns))
    return Request(None, j, spec, slowdown)


def _run(events: EventQueue, until: float = float("inf")) -> None:
    while len(events):
        if events._heap[0][0] > until:
            break
        fn, args = events.pop()
        fn(*args)


def _run_to(events: EventQueue, time: float) -> None:
    """Every event up to `time`, then the clock at `time` (where a test acts next)."""
    _run(events, until=time)
    events.now = time


def test_processor_sharing_by_hand():
    # 10 tok/s alone, 5 tok/s each when two decode: 100 and 200 tokens finish at 20 s and 30 s.
    w, events, pool, done = _pool(10.0, 5.0, slots=2)
    assert w.decode_rate(1) == pytest.approx(10.0) and w.decode_rate(2) == pytest.approx(5.0)
    pool.start(_request(0, 100))
    pool.start(_request(1, 200))
    _run(events)
    assert done == [(pytest.approx(20.0), 0), (pytest.approx(30.0), 1)]
    assert pool.tokens_generated == pytest.approx(300)
    assert pool.utilisation_until(30.0) == pytest.approx(50.0)  # slot-seconds: 2 x 20 + 1 x 10


def test_slots_queue_requests_fifo_and_least_loaded_replica_first():
    w, events, pool, done = _pool(10.0, 10.0, slots=1, replicas=2)
    for j in range(3):
        pool.start(_request(j, 100))
    _run(events)
    assert done == [(pytest.approx(10.0), 0), (pytest.approx(10.0), 1), (pytest.approx(20.0), 2)]


def test_abort_keeps_progress_and_continuation_finishes_the_rest():
    w, events, pool, done = _pool(10.0, 10.0, slots=4)
    a, b = _request(0, 100), _request(1, 100, slowdown=4.0)
    pool.start(a)
    pool.start(b)
    _run_to(events, 6.0)
    aborted = pool.abort_all()
    assert aborted == [a, b] and a.phase == b.phase == IDLE
    assert a.tokens_done == pytest.approx(60) and b.tokens_done == pytest.approx(15)  # b decodes 4x slower
    pool.start(a)
    _run(events)
    assert a.phase == DONE and done == [(pytest.approx(10.0), 0)]
    assert pool.tokens_generated == pytest.approx(115)


def test_multi_turn_request_leaves_its_slot_during_the_tool_call():
    w, events, pool, done = _pool(10.0, 10.0, slots=1)
    spec = TrajSpec((50, 50), (7.0,), TrajectoryStatus.COMPLETED, 0.0, 100)
    pool.start(Request(None, 0, spec, 1.0))
    pool.start(_request(1, 30))
    _run(events)
    # turn 1: 0-5 s; the tool call frees the slot, request 1 runs 5-8 s; turn 2: 12-17 s.
    assert done == [(pytest.approx(8.0), 1), (pytest.approx(17.0), 0)]


def test_abort_marks_the_tokens_generated_so_far_as_masked():
    w, events, pool, done = _pool(10.0, 10.0, 4)
    a = _request(0, 100)
    pool.start(a)
    _run_to(events, 3.0)
    pool.abort_all()
    assert a.masked_tokens == pytest.approx(30)
    pool.start(a)
    _run_to(events, 5.0)
    pool.abort_all()
    assert a.masked_tokens == pytest.approx(50)  # everything before the last abort
    pool.start(a)
    _run(events)
    assert a.phase == DONE and a.masked_tokens == pytest.approx(50) and a.tokens_done == pytest.approx(100)


def test_serial_prefill_stops_decoding_and_re_prefills_what_was_generated():
    # 10 tok/s decode, prefill 100 tok/s on the replica, prompts of 100 tokens.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.generation.prefill_tokens_per_s=100.0",
                                  "sim.generation.prompt_tokens=100")
    a, b = _request(0, 50), _request(1, 50)
    pool.start(a)
    _run_to(events, 2.0)  # a: prefill 0-1 s, then decodes
    pool.start(b)  # b prefills 2-3 s; a stands still meanwhile
    _run(events)
    # a decodes 1-2 s (10 tokens), stops 2-3 s, then 40 more tokens: 3-7 s; b decodes 3-8 s.
    assert done == [(pytest.approx(7.0), 0), (pytest.approx(8.0), 1)]
    assert pool.prefill_tokens == pytest.approx(200) and pool.reprefill_tokens == 0
    # A request continued after an abort re-prefills its prompt and the 20 tokens it had.
    c = _request(2, 100)
    pool.start(c)
    _run(events, until=events.now + 3.0)  # prefill 1 s, 2 s of decoding: 20 tokens
    events.now = 11.0
    pool.abort_all()
    assert c.tokens_done == pytest.approx(20)
    pool.start(c)
    _run(events)
    assert pool.reprefill_tokens == pytest.approx(20)
    assert done[-1] == (pytest.approx(11.0 + 1.2 + 8.0), 2)  # 120 tokens at 100 tok/s, then 80 tokens at 10 tok/s


def test_kv_cache_full_preempts_the_newest_request_which_re_prefills_later():
    # KV cache of 300 tokens, prompts of 50: a (first) and b both grow 10 tok/s; at 100 tokens each the
    # cache is full (2 x 150), b (admitted last) is preempted and waits until a has finished.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=300",
                                  "sim.cluster.kv_admit_watermark=1.0", "sim.generation.prompt_tokens=50")
    a, b = _request(0, 150), _request(1, 150)
    pool.start(a)
    pool.start(b)
    _run(events)
    assert pool.preemptions == 1
    # a: 0-15 s alone after the preemption at 10 s; b: resumes at 15 s with 100 tokens done, 50 to go.
    assert done == [(pytest.approx(15.0), 0), (pytest.approx(20.0), 1)]
    assert pool.kv_used(pool.replicas[0]) == pytest.approx(0.0)


def test_kv_admission_waits_for_room():
    # 200 tokens of KV, prompts of 150: the second request fits only once the first is gone.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=200",
                                  "sim.cluster.kv_admit_watermark=1.0", "sim.generation.prompt_tokens=150")
    pool.start(_request(0, 20))
    pool.start(_request(1, 20))
    _run(events)
    assert done == [(pytest.approx(2.0), 0), (pytest.approx(4.0), 1)] and pool.preemptions == 0


_RESERVE = ("sim.cluster.kv_reserve.enabled=true", "sim.cluster.kv_reserve.clip_max_new_tokens=1000",
            "sim.cluster.kv_reserve.retract_decode_steps=20")
# Next to no reservation: a ratio of 0 and one future token a request.
_NO_RESERVATION = ("sim.cluster.kv_reserve.init_ratio=0.0001", "sim.cluster.kv_reserve.min_ratio=0.0",
                   "sim.cluster.kv_reserve.decay_steps=0.001", "sim.cluster.kv_reserve.clip_max_new_tokens=1")


def test_kv_reserve_admission_counts_the_future_tokens_of_running_requests():
    # 1500 tokens of KV, prompts of 100, a fixed ratio of 0.5: a (running) reserves 0.5 x min(20000 - 0,
    # 1000) = 500, so b needs 100 + 1000 within 1500 - 100 - 500 = 900: it waits for a, though its 100
    # context tokens alone would fit (and do, without the reservation).
    fixed = ("sim.cluster.kv_reserve.init_ratio=0.5", "sim.cluster.kv_reserve.min_ratio=0.5")
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=1500",
                                  "sim.generation.prompt_tokens=100", *_RESERVE, *fixed)
    pool.start(_request(0, 50))
    pool.start(_request(1, 50))
    assert pool.replicas[0].occupied == 1 and len(pool.engine_queue) == 1 and not pool.pending
    _run(events)
    assert done == [(pytest.approx(5.0), 0), (pytest.approx(10.0), 1)] and pool.preemptions == 0
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=1500",
                                  "sim.cluster.kv_admit_watermark=1.0", "sim.generation.prompt_tokens=100")
    pool.start(_request(0, 50))
    pool.start(_request(1, 50))
    _run(events)
    assert done == [(pytest.approx(5.0), 0), (pytest.approx(5.0), 1)]


def test_kv_reserve_ratio_decays_with_decode_steps_and_admits_the_waiting_request():
    # As above, but the ratio falls from 0.5 to 0 over 20 decode steps (one a token): b's room is
    # 1500 - (100 + V) - 1000 (0.5 - 0.025 V) = 900 + 24 V, enough for 1100 from V = 8.3 (0.83 s); the
    # blocked head is retried every RESERVE_RETRY_S, so b starts at 1 s and ends 5 s later.
    decaying = ("sim.cluster.kv_reserve.init_ratio=0.5", "sim.cluster.kv_reserve.min_ratio=0.0",
                "sim.cluster.kv_reserve.decay_steps=20")
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=1500",
                                  "sim.generation.prompt_tokens=100", *_RESERVE, *decaying)
    pool.start(_request(0, 50))
    pool.start(_request(1, 50))
    _run(events)
    assert done == [(pytest.approx(5.0), 0), (pytest.approx(1.0 + 5.0), 1)]
    assert pool.replicas[0].ratio == pytest.approx(0.5)  # idle again: back to init_ratio


def test_kv_reserve_retracts_the_fewest_new_tokens_which_re_prefill_what_they_had():
    # 300 tokens of KV, prompts of 50, no reservation (ratio 0). a starts at 0 s, b at 2 s; both decode
    # 10 tok/s. The cache fills when 100 + V_a + V_b = 300, V_a = V_b + 20: at 11 s, b with 90 tokens
    # (fewer new tokens than a's 110) is retracted; a ends at 15 s, b re-prefills 50 + 90 and ends at 21 s.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=300",
                                  "sim.generation.prompt_tokens=50", "sim.generation.prefill_tokens_per_s=1e9",
                                  *_RESERVE, *_NO_RESERVATION)
    a, b = _request(0, 150), _request(1, 150)
    pool.start(a)
    _run_to(events, 2.0)
    pool.start(b)
    _run(events, until=11.0 + 1e-6)
    assert pool.preemptions == 1 and b.tokens_done == pytest.approx(90) and list(pool.engine_queue) == [b]
    # The ratio becomes what the survivor needs: (110 generated + 20 steps) / 20000 max_new_tokens.
    assert pool.replicas[0].ratio == pytest.approx(130 / 20000)
    _run(events)
    assert done == [(pytest.approx(15.0), 0), (pytest.approx(21.0), 1)]
    assert pool.reprefill_tokens == pytest.approx(90)
    assert pool.kv_used(pool.replicas[0]) == pytest.approx(0.0)


def test_kv_reserve_retracts_a_continued_request_first_its_earlier_tokens_being_prompt():
    # c (a straggler, 5 tok/s) is continued after an abort with 80 tokens: its next engine request sends
    # them as prompt. It is admitted at 16 s, d (fresh, 10 tok/s) at 17 s; the cache (300) fills when
    # 130 + 5 (t - 16) + 50 + 10 (t - 17) = 300, at 24.67 s: c has 43 new tokens (123 in all), d 77.
    # SGLang retracts the fewest new tokens: c, though it has more tokens in all and d came last (the
    # watermark rule would preempt d).
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=300",
                                  "sim.generation.prompt_tokens=50", *_RESERVE, *_NO_RESERVATION)
    c, d = _request(0, 200, slowdown=2.0), _request(1, 200)
    pool.start(c)
    _run_to(events, 16.0)
    pool.abort_all()
    assert c.tokens_done == pytest.approx(80)
    pool.start(c)
    _run_to(events, 17.0)
    pool.start(d)
    _run(events, until=24.7)
    assert pool.preemptions == 1 and list(pool.engine_queue) == [c]
    assert c.tokens_done == pytest.approx(80 + 5 * 26 / 3) and c.engine_base == pytest.approx(80)


def test_kv_reserve_off_ignores_its_settings_and_validates_when_on():
    # Disabled, the other kv_reserve values change nothing: the watermark preemption test's figures.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.cluster.kv_cache_tokens=300",
                                  "sim.cluster.kv_admit_watermark=1.0", "sim.generation.prompt_tokens=50",
                                  "sim.cluster.kv_reserve.init_ratio=1.0", "sim.cluster.kv_reserve.min_ratio=1.0",
                                  "sim.cluster.kv_reserve.clip_max_new_tokens=100000")
    a, b = _request(0, 150), _request(1, 150)
    pool.start(a)
    pool.start(b)
    _run(events)
    assert w.kv_reserve is None and pool.preemptions == 1 and not pool.engine_queue
    assert done == [(pytest.approx(15.0), 0), (pytest.approx(20.0), 1)]
    with pytest.raises(WorkloadError, match="kv_cache_tokens"):
        workload("sim.cluster.kv_reserve.enabled=true", "sim.cluster.kv_cache_tokens=0")
    with pytest.raises(WorkloadError, match="min_ratio"):
        workload("sim.cluster.kv_reserve.enabled=true", "sim.cluster.kv_cache_tokens=1000",
                 "sim.cluster.kv_reserve.min_ratio=0.9")
    with pytest.raises(WorkloadError, match="enabled"):
        workload("sim.cluster.kv_reserve.enabled=1")


def test_router_limit_holds_requests_beyond_max_concurrent_across_replicas():
    # Two replicas of 4 slots but a router that lets 2 requests generate at once: the third waits for a
    # connection (not for a slot) and starts when the first two finish at 10 s.
    w, events, pool, done = _pool(10.0, 10.0, 4, 2, "sim.cluster.max_concurrent_requests=2")
    for j in range(3):
        pool.start(_request(j, 100))
    assert pool.occupied == 2 and len(pool.pending) == 1
    assert sorted(rep.occupied for rep in pool.replicas) == [1, 1]  # least-loaded: one on each replica
    _run(events)
    assert done == [(pytest.approx(10.0), 0), (pytest.approx(10.0), 1), (pytest.approx(20.0), 2)]
    # Without the limit all three run at once.
    w, events, pool, done = _pool(10.0, 10.0, 4, 2)
    for j in range(3):
        pool.start(_request(j, 100))
    _run(events)
    assert [t for t, _ in done] == [pytest.approx(10.0)] * 3


def test_decode_step_grows_with_the_tokens_in_the_kv_cache():
    # 0.1 s a step alone, plus 1 ms per cached token (kv_step_s_per_mtoken = 1000). With no prompt the
    # cache holds what the request has generated, V: t = integral of (0.1 + 0.001 V) dV = 0.1 V + 0.0005 V^2,
    # so 100 tokens take 10 + 5 = 15 s (the batch-only model: 10 s).
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.generation.decode.kv_step_s_per_mtoken=1000.0",
                                  "sim.generation.prompt_tokens=0")
    pool.start(_request(0, 100))
    _run(events)
    assert done == [(pytest.approx(15.0), 0)]
    # A 100-token prompt in the cache adds 0.1 s to every step: 20 + 5 = 25 s.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.generation.decode.kv_step_s_per_mtoken=1000.0",
                                  "sim.generation.prompt_tokens=100")
    pool.start(_request(0, 100))
    _run(events)
    assert done == [(pytest.approx(25.0), 0)]
    # Progress between events follows the same curve: aborted at 7.5 s, it has 0.0005 V^2 + 0.1 V = 7.5.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.generation.decode.kv_step_s_per_mtoken=1000.0",
                                  "sim.generation.prompt_tokens=0")
    req = _request(0, 100)
    pool.start(req)
    _run_to(events, 7.5)
    pool.abort_all()
    assert req.tokens_done == pytest.approx((-0.1 + (0.01 + 4 * 0.0005 * 7.5) ** 0.5) / 0.001)
    # A second request's context slows the first: both decode with 200 tokens of prompt between them.
    w, events, pool, done = _pool(10.0, 10.0, 4, 1, "sim.generation.decode.kv_step_s_per_mtoken=1000.0",
                                  "sim.generation.prompt_tokens=100")
    pool.start(_request(0, 10))
    pool.start(_request(1, 10))
    _run(events)
    # dt = (0.1 + 0.001 (200 + 2 V)) dV over V = 10: 3 + 0.1 = 3.1 s for both.
    assert [t for t, _ in done] == [pytest.approx(3.1), pytest.approx(3.1)]


def test_length_drift_stretches_later_steps():
    w = workload("sim.generation.length.distribution=constant", "sim.generation.length.median=1000",
                 "sim.generation.length.drift_per_step=0.1", n=2)
    w.batch_groups = 4  # prompts 0-3 are step 0, 4-7 step 1 ...
    assert {t.tokens for t in w.prompt(3).trajs} == {1000}
    assert {t.tokens for t in w.prompt(4).trajs} == {1100}
    assert {t.tokens for t in w.prompt(8).trajs} == {1210}
    with pytest.raises(WorkloadError, match="drift_per_step"):
        workload("sim.generation.length.drift_per_step=-1.0")


def test_long_tail_preset_has_the_published_tail_shape():
    # p99 / median about 10 and the longest 5 % of responses holding 30 - 50 % of the tokens.
    w = workload(preset="long_tail")
    lengths = sorted(t.nominal_tokens for k in range(2500) for t in w.prompt(k).trajs)
    n = len(lengths)
    median, p99 = lengths[n // 2], lengths[int(0.99 * n)]
    top5 = sum(lengths[int(0.95 * n):]) / sum(lengths)
    assert 8.0 <= p99 / median <= 14.0
    assert 0.30 <= top5 <= 0.50
