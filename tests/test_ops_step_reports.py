"""Step reports against a hand-computed scenario: known start and end weight versions, a filtered group, a
restored and a dropped group; checked in the Reset answers, in GetState and in /metrics."""
from __future__ import annotations

import pytest

from coda_client import PacerClient, TrajectoryStatus
from ops_harness import MetricsServer, trajectory

# B = 4, N = 2, M = 2 (a fetch is one group), stale_steps 1.0: window C = 8. no-window collects every complete,
# non-aborted group at once; the `status` filter drops groups holding a FAILED trajectory.
CONFIG = ("fully_async.sliding_window=no-window", "fully_async.stale_steps=1.0", "data_source.num_prompts_per_step=4",
          "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2", "rollout.filter=[status]")
ABORTED, FAILED = TrajectoryStatus.ABORTED, TrajectoryStatus.FAILED


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    with MetricsServer(tmp_path_factory.mktemp("reports"), *CONFIG) as server, PacerClient(server.address) as pacer:
        pacer.resume(weight_version=2)  # step 1, generation runs with version 2
        assert pacer.dispatch([f"p{i}" for i in range(7)]).admitted == [f"p{i}" for i in range(7)]
        pacer.submit([trajectory("p0", 0, 2, 2), trajectory("p0", 1, 2, 2)])  # no partial
        pacer.submit([trajectory("p1", 0, 1, 2), trajectory("p1", 1, 2, 2)])  # one partial, span 1
        pacer.submit([trajectory("p2", 0, 0, 2), trajectory("p2", 1, 1, 2)])  # two partial, spans 2 and 1
        pacer.submit([trajectory("p3", 0, 2, 2), trajectory("p3", 1, 2, 2, FAILED)])  # filtered
        pacer.submit([trajectory("p4", 0, 2, 2), trajectory("p4", 1, 2, 2)])  # left in the buffer
        pacer.submit([trajectory("p5", 0, 2, 2)])  # incomplete: dropped by the Reset
        pacer.submit([trajectory("p6", 0, 1, 2, ABORTED), trajectory("p6", 1, 2, 2)])  # held by the gate: restored
        first_taken = [g.prompt_id for _ in range(3) for g in pacer.collect(1)]
        first = pacer.reset("abort", wait=0, resume=True, weight_version=3)  # ends step 1, starts step 2
        pacer.dispatch(["p7"], max_continuations=0)  # p6 stays kept
        pacer.submit([trajectory("p7", 0, 1, 3), trajectory("p7", 1, 3, 3)])  # a continued rollout: span 2
        second_taken = [g.prompt_id for _ in range(2) for g in pacer.collect(1)]
        second = pacer.reset("wait", wait=5)  # nothing running: ready at once; stays paused
        state = pacer.state()
        yield {"first_taken": first_taken, "first": first, "second_taken": second_taken, "second": second,
               "state": state, "scrape": server.scrape()}


def test_first_step_report_matches_the_hand_computed_values(scenario):
    assert scenario["first_taken"] == ["p0", "p1", "p2"]  # oldest seq first; p3 was filtered
    result = scenario["first"]
    report = result.report
    # The assembled group is restored and, by default, kept by the server for continuation.
    assert result.restored == [] and result.kept_prompt_ids == ["p6"] and result.dropped_prompt_ids == ["p5"]
    # 6 consumed trajectories, 3 of them span versions (p1 t0: 1->2, p2 t0: 0->2, p2 t1: 1->2).
    assert (report.step, report.pipeline_buf_size, report.filter_drop) == (1, 1, 1)
    assert report.partial_ratio == pytest.approx(3 / 6)
    assert report.partial_span_max == 2
    # LoongSage's units: trajectories (p6 restored with its 2, p5 dropped with the 1 it had) ...
    assert (report.partial_restored_count, report.partial_dropped_incomplete_count) == (2, 1)
    # ... and the groups under names of their own.
    assert (report.partial_restored_group_count, report.partial_dropped_incomplete_group_count) == (1, 1)
    assert 0 <= report.pause_delay < 5 and report.pause_delay == result.pause_delay_seconds


def test_second_step_report_matches_the_hand_computed_values(scenario):
    assert scenario["second_taken"] == ["p4", "p7"]
    report = scenario["second"].report
    # 4 consumed trajectories (p4: 2->2 twice, p7: 1->3 and 3->3): one partial, span 2.
    assert (report.step, report.pipeline_buf_size, report.filter_drop) == (2, 0, 0)
    assert report.partial_ratio == pytest.approx(1 / 4)
    assert report.partial_span_max == 2
    assert (report.partial_restored_count, report.partial_dropped_incomplete_count) == (0, 0)
    assert 0 <= report.pause_delay < 5


def test_get_state_keeps_the_reports_oldest_first(scenario):
    state = scenario["state"]
    assert state.recent_reports == [scenario["first"].report, scenario["second"].report]
    assert (state.restored, state.dropped, state.filtered, state.consumed) == (1, 1, 1, 5)


def test_metrics_export_the_latest_report_and_count_the_reports(scenario):
    scrape, report = scenario["scrape"], scenario["second"].report
    assert scrape.value("coda_pacer_step_reports_total") == 2
    exported = {
        "step": scrape.value("coda_pacer_step_report_step"),
        "pipeline_buf_size": scrape.value("coda_pacer_step_report_pipeline_buf_size"),
        "filter_drop": scrape.value("coda_pacer_step_report_filter_drop"),
        "partial_ratio": scrape.value("coda_pacer_step_report_partial_ratio"),
        "partial_span_max": scrape.value("coda_pacer_step_report_partial_span_max"),
        "partial_restored_count": scrape.value("coda_pacer_step_report_partial_restored_count"),
        "partial_dropped_incomplete_count": scrape.value("coda_pacer_step_report_partial_dropped_incomplete_count"),
        "pause_delay": scrape.value("coda_pacer_step_report_pause_delay_seconds"),
        "restored_groups": scrape.value("coda_pacer_step_report_partial_restored_groups"),
        "dropped_groups": scrape.value("coda_pacer_step_report_partial_dropped_incomplete_groups"),
    }
    assert exported == {"step": 2, "pipeline_buf_size": 0, "filter_drop": 0, "partial_ratio": 0.25,
                        "partial_span_max": 2, "partial_restored_count": 0, "partial_dropped_incomplete_count": 0,
                        "pause_delay": pytest.approx(report.pause_delay), "restored_groups": 0, "dropped_groups": 0}


def test_staleness_histogram_over_both_steps(scenario):
    scrape = scenario["scrape"]
    # Step 1 took p0 (2, 2), p1 (1, 2), p2 (0, 1) at version 2 -> staleness 0 0 1 0 2 1;
    # step 2 took p4 (2, 2) and p7 (1, 3) at version 3 -> 1 1 2 0.
    assert scrape.value("coda_pacer_staleness_versions_count") == 10
    assert scrape.value("coda_pacer_staleness_versions_sum") == 8
    buckets = {le: scrape.value("coda_pacer_staleness_versions_bucket", le=le) for le in ("0.0", "1.0", "2.0", "3.0")}
    assert buckets == {"0.0": 4, "1.0": 8, "2.0": 10, "3.0": 10}
    assert scrape.value("coda_pacer_dispatch_to_collect_seconds_count") == 5


def test_a_restore_is_not_counted_as_a_step_report(tmp_path):
    """A Restore starts a new generation as a Reset does, but computes no step report: the counter, exported from the
    generation, counted it as one."""
    with MetricsServer(tmp_path, *CONFIG) as server, PacerClient(server.address) as pacer:
        pacer.restore(pacer.checkpoint())
        state = pacer.state()
        assert (state.generation, state.restores, len(state.recent_reports)) == (1, 1, 0)
        assert server.scrape().value("coda_pacer_step_reports_total") == 0
        pacer.reset("wait", wait=0)
        assert server.scrape().value("coda_pacer_step_reports_total") == 1


def test_a_second_reset_before_the_resume_times_its_own_pause_not_the_first_ones():
    """Two Resets 5 s apart with dispatch paused between them and nothing running: the second one's pause delay is
    its own (0), not the 5 s since the first Reset paused dispatch."""
    from coda_server.core import Pacer, load_config
    from fake_clock import FakeClock

    clock = FakeClock()
    pacer = Pacer(load_config(overrides=list(CONFIG)), clock=clock)
    first = pacer.reset(wait=0)
    clock.now += 5.0
    second = pacer.reset(wait=0)
    assert (first.report.pause_delay, second.report.pause_delay) == (0.0, 0.0)
    pacer.close()
