"""The short seeded chaos run of bench/chaos.py (a few tens of seconds): server kill -9 and graceful restart,
worker kill -9, SIGSTOP and partition, trainer kill -9, SIGSTOP and partition, with nothing acknowledged lost, nothing
trained twice, and progress after every fault."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("chaos", REPO_ROOT / "bench" / "chaos.py")
chaos = importlib.util.module_from_spec(spec)
sys.modules["chaos"] = chaos  # its dataclasses look their module up
spec.loader.exec_module(chaos)


@pytest.mark.chaos
@pytest.mark.parametrize("trainer_id", [None, "trainer"], ids=["own-ids", "one-fixed-id"])
def test_a_short_seeded_chaos_run_loses_nothing_and_trains_nothing_twice(tmp_path, trainer_id):
    """Each trainer process with a client id of its own, or all under one fixed id (a restarted pod's): then the
    restart after a kill -9 heartbeats under the id the dead one's leases are held by."""
    result = chaos.run(seed=11, faults=len(chaos.FAULT_KINDS), prompts=60, workdir=tmp_path, trainer_id=trainer_id)
    report = chaos.table([result])
    assert result.finished, report
    assert sorted(f.kind for f in result.faults) == sorted(chaos.FAULT_KINDS), report  # each kind, with progress
    assert (result.lost, result.altered, result.twice) == ([], [], []), "\n".join([report, *result.twice_how])
    for fault in result.faults:  # the job went on after every fault
        assert any(at > fault.at for at in result.batches) or result.faults[-1] is fault, report
