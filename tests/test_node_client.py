"""A Node client generated from pacer.proto alone still round-trips a trajectory, in both directions.

The test installs the stock @grpc/grpc-js and @grpc/proto-loader from the npm registry into a temporary
directory (about 5 s) and skips, saying why, when node or npm is missing or the install fails.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest

from coda_client import PacerClient, Trajectory, TrajectoryStatus
from conftest import REPO_ROOT
from server_harness import ServerProcess

NODE_PACKAGES = ["@grpc/grpc-js@1.14.7", "@grpc/proto-loader@0.8.1"]
SCRIPT = REPO_ROOT / "tests" / "node" / "roundtrip.js"
NODE_ARRAYS = {"token_ids": [0, 1, -5, 2**31 - 1, -(2**31)], "logprobs": [-0.5, -1.25, 0.0, -3.5, math.nan],
               "loss_mask": [1, 0, 1, 1, 0]}


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory):
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"node/npm not installed (node={node}, npm={npm}): the Node client check needs them")
    directory = tmp_path_factory.mktemp("node-client")
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(directory),
                               *NODE_PACKAGES], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {' '.join(NODE_PACKAGES)} did not finish in 180 s (no registry access?)")
    if done.returncode != 0:
        pytest.skip(f"npm install {' '.join(NODE_PACKAGES)} failed (no registry access?): {done.stderr[-500:]}")
    return directory / "node_modules"


def test_a_node_client_built_from_the_proto_round_trips_trajectories(tmp_path, node_modules):
    with ServerProcess(tmp_path, "fully_async.sliding_window=no-window", "data_source.num_prompts_per_step=4",
                       "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2") as server, \
            PacerClient(server.address, arrays="numpy") as pacer:
        pacer.dispatch(["py-1"])
        tokens, logprobs = np.array([7, -8, 2**31 - 1], np.int64), np.array([-0.125, np.nan, -2.0], np.float32)
        pacer.submit([Trajectory(trajectory_id=f"py-1/{i}", prompt_id="py-1", status=TrajectoryStatus.COMPLETED,
                                 token_ids=tokens, logprobs=logprobs, loss_mask=np.array([True, False, True]))
                      for i in range(2)])
        done = subprocess.run(["node", str(SCRIPT), server.address, str(REPO_ROOT / "proto")], capture_output=True,
                              text=True, timeout=60, env={"NODE_PATH": str(node_modules), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["round_tripped"] and answer["order"] == ["py-1", "node-1"]  # Node -> server -> Node
        python_group = answer["groups"][0]["trajectories"]  # Python (NumPy) -> server -> Node
        assert [t["token_ids"] for t in python_group] == [[7, -8, 2**31 - 1]] * 2
        assert [t["loss_mask"] for t in python_group] == [[1, 0, 1]] * 2
        assert [t["logprobs"] for t in python_group] == [[-0.125, "NaN", -2.0]] * 2
        [node_group] = pacer.collect(1, wait=10)  # Node -> server -> Python, as views over the received bytes
    assert node_group.prompt_id == "node-2"
    for trajectory in node_group.trajectories:
        assert trajectory.token_ids.tolist() == NODE_ARRAYS["token_ids"]
        assert trajectory.loss_mask.tolist() == NODE_ARRAYS["loss_mask"]
        assert trajectory.logprobs[:4].tolist() == NODE_ARRAYS["logprobs"][:4] and np.isnan(trajectory.logprobs[4])
        assert trajectory.metadata == {"from": "node"} and trajectory.payload == b"\x00\xff"
