"""Helpers of the operations tests: a server subprocess whose /metrics port is known, and a scrape parser."""
from __future__ import annotations

import time
import urllib.request
from typing import Callable, Optional

from prometheus_client.parser import text_string_to_metric_families

from coda_client import Trajectory, TrajectoryStatus
from server_harness import ServerProcess


class MetricsServer(ServerProcess):
    """A coda-server subprocess (metrics on 127.0.0.1:0, as the harness sets) that can be scraped."""

    @property
    def metrics_port(self) -> Optional[int]:
        return self.info["metrics_port"]  # from the --port-file JSON

    def scrape_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200
            return response.read().decode()

    def scrape(self) -> "Scrape":
        return Scrape(self.scrape_text())

    def scrape_until(self, ready: Callable[["Scrape"], bool], timeout: float = 10.0) -> "Scrape":
        """Scrape again until `ready(scrape)` (for effects that land after an RPC has returned)."""
        deadline = time.monotonic() + timeout
        while True:
            scrape = self.scrape()
            if ready(scrape) or time.monotonic() > deadline:
                return scrape


class Scrape:
    """Samples of one /metrics answer, looked up by sample name and a subset of labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        self.names = {s.name for s in self.samples}

    def value(self, name: str, **labels: str) -> float:
        """The value of the one sample named `name` whose labels include `labels` (0 when absent)."""
        matches = [s for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        assert len(matches) <= 1, f"{name}{labels} matches {len(matches)} samples"
        return matches[0].value if matches else 0.0

    def rpc(self, method: str, code: str = "OK") -> float:
        return self.value("grpc_server_handled_total", grpc_method=method, grpc_code=code)


def trajectory(prompt_id: str, i: int, start: int = 0, end: Optional[int] = None,
               status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    """A small trajectory with known weight versions; the reward varies so the `reward` filter never drops it."""
    return Trajectory(trajectory_id=f"{prompt_id}/t{i}", prompt_id=prompt_id, status=status, reward=float(i),
                      token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], start_weight_version=start,
                      end_weight_version=start if end is None else end)
