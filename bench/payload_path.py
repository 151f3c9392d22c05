"""The trainer's data path against the protobuf floor of the same work (issue 15's benchmark).

In one run and one process tree: a live coda-server on its shipped defaults (metrics on, per-RPC logs on)
holding 512 trajectories x 32,768 tokens (token ids, logprobs and loss mask all that long) in groups of 16,
then a trainer collecting them in mini-batches of 128 trajectories into NumPy arrays. Per repeat, with a
fresh server:

* Submit-from-NumPy: a worker submits the 32 groups (one Submit per group) from NumPy arrays through
  `PacerClient.submit`; floor: building the same SubmitRequests from the same arrays the fastest way
  protobuf allows (array bytes into the pass-through view's bytes fields), serializing them and parsing
  them as a view, in this process. Beside both, the same `PacerClient.submit` to an empty-handler gRPC
  server (rpc_throughput.py's floor server: our server's options and allocator setting, Submit parsed as
  our server parses it, nothing else done): what gRPC's transport alone costs, so the report can tell
  our server's share from gRPC's;
* server RSS per held byte: (server RSS with the 512 trajectories held - its RSS before) / held_bytes
  (the encoded size the server reports in GetState);
* Collect-to-NumPy: the trainer takes the 4 mini-batches with `PacerClient(arrays="numpy").collect_result`
  (leased, then acknowledged) and gets every trajectory's arrays as NumPy views; floor: serializing an
  identical CollectResponse (8 groups of 16) and parsing it as a view plus the NumPy views, in this process.
  The same figure is also given through `batches()` (packed into flat columns: one more copy);
* prefetch gap: the groups submitted again, the trainer iterates `batches(128)` with a 2 s sleep standing
  in for each training step; the gap is the time from the end of a step to the next batch in hand.

MB/s counts array bytes (token ids, logprobs, loss mask: 12 bytes per token). Floor and ours are measured
request by request, alternately (the order rotating), so load from elsewhere hits both alike. Submit
figures are the median over every Submit of every repeat (one group, 6.3 MB, each: the floor's time per
request varies by a factor of two with the state of this process's allocator, which the median of a few
per-repeat sums did not smooth); the other figures are medians over the repeats. Ratios are
median(ours) / median(floor).

    python bench/payload_path.py             # 3 repeats, about 40 s on an idle machine
    python bench/payload_path.py --quick     # 1 repeat of a quarter of the data, a smoke run
    python bench/payload_path.py --set server.allocator_retain_bytes=0   # glibc's allocator defaults
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpc_throughput import FLOOR_PASSTHROUGH_ENV, ServerProcess, machine_busy_ticks  # noqa: E402  (same directory)

from coda_client import MiniBatch, PacerClient, Trajectory, TrajectoryStatus  # noqa: E402
from coda_client import wire_forms as _wire  # noqa: E402
from coda_server import wire  # noqa: E402

GROUP_SIZE = 16
MINI_BATCH = 128
STEP_SECONDS = 2.0
TARGETS = {"collect": 0.5, "submit": 0.5, "rss_per_held_byte": 1.3, "prefetch_gap_fraction": 0.05}


# --set KEY=VALUE: configuration overrides for both servers (e.g. server.allocator_retain_bytes=0).
EXTRA_OVERRIDES: list[str] = []


def overrides(groups: int) -> list[str]:
    """Shipped defaults, except the shape of the workload, free ports and --set."""
    return ["server.address=127.0.0.1:0", "server.metrics_address=127.0.0.1:0",
            f"data_source.num_prompts_per_step={groups}", f"data_source.num_trajectories_per_prompt={GROUP_SIZE}",
            f"trainer.mini_batch_size={MINI_BATCH}", *EXTRA_OVERRIDES]


def make_arrays(trajectories: int, tokens: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 151_936, tokens, dtype=np.int32), -rng.exponential(2.0, tokens).astype(np.float32),
             (rng.random(tokens) < 0.9).astype(np.int32)) for _ in range(trajectories)]


def trajectories_of(prompt_id: str, arrays: list, round_: int) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"{prompt_id}/{j}/{round_}", prompt_id=prompt_id,
                       status=TrajectoryStatus.COMPLETED, reward=float(j), token_ids=t, logprobs=l, loss_mask=m)
            for j, (t, l, m) in enumerate(arrays)]


def array_bytes(arrays: list) -> int:
    return sum(t.nbytes + l.nbytes + m.nbytes for t, l, m in arrays)


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------------------------------- floors
# Floor and ours are measured request by request, alternately (the order flipping each time), so a burst of
# load from elsewhere on the machine hits both alike. What each produces is kept until the end of its
# measurement: a server keeps what it accepted, a trainer keeps its batches (fresh memory for each).

def submit_floor_one(g: int, arrays: list, kept: list) -> float:
    """Seconds to build the group's SubmitRequest from the arrays (their bytes into the pass-through view's
    bytes fields: the fastest way protobuf offers), serialize it and parse it as a view."""
    started = time.perf_counter()
    request = wire.SubmitRequest(request_id=f"r-{g}")
    for j, (t, l, m) in enumerate(arrays):
        request.trajectories.add(trajectory_id=f"p{g}/{j}", prompt_id=f"p{g}", status=1, reward=float(j),
                                 token_ids=t.tobytes(), logprobs=l.tobytes(), loss_mask=m.tobytes())
    parsed = wire.SubmitRequest.FromString(request.SerializeToString())
    elapsed = time.perf_counter() - started
    assert len(parsed.trajectories) == len(arrays)
    kept.append(parsed)
    return elapsed


def collect_response(groups: list[list], first: int) -> Any:
    """The CollectResponse our server would answer with for these groups, as a view (built untimed)."""
    response = _wire.CollectResponse(lease_id="lease-1")
    for g, arrays in enumerate(groups):
        group = response.groups.add(prompt_id=f"p{first + g}", seq=first + g)
        for j, (t, l, m) in enumerate(arrays):
            trajectory = Trajectory(trajectory_id=f"p{g}/{j}", prompt_id=f"p{first + g}", status=1, reward=float(j),
                                    token_ids=t, logprobs=l, loss_mask=m)
            group.trajectories.append(_wire.Trajectory.FromString(b"".join(trajectory.encoded_parts())))
    return response


def collect_floor_one(response: Any, kept: list) -> float:
    """Seconds to serialize the response (a view), parse it as a view and view every array as NumPy."""
    started = time.perf_counter()
    view = _wire.CollectResponse.FromString(response.SerializeToString())
    arrays = [(np.frombuffer(t.token_ids, "<i4"), np.frombuffer(t.logprobs, "<f4"), np.frombuffer(t.loss_mask, "<i4"))
              for g in view.groups for t in g.trajectories]
    elapsed = time.perf_counter() - started
    assert len(arrays) == sum(len(g.trajectories) for g in response.groups)
    kept.append(arrays)
    return elapsed


# ------------------------------------------------------------------------------------------- ours

def submit_ours_one(pacer: PacerClient, prompt_id: str, arrays: list, round_: int) -> float:
    trajectories = trajectories_of(prompt_id, arrays, round_)  # the caller's own values, built untimed
    started = time.perf_counter()
    result = pacer.submit(trajectories)
    elapsed = time.perf_counter() - started
    assert result.accepted == len(arrays) and result.groups_completed == 1, result
    return elapsed


def submit_sink_one(sink: PacerClient, prompt_id: str, arrays: list, round_: int) -> float:
    trajectories = trajectories_of(prompt_id, arrays, round_)
    started = time.perf_counter()
    sink.submit(trajectories)  # the empty handler answers accepted=0
    return time.perf_counter() - started


def submit_all(pacer: PacerClient, groups: list[list], round_: int, floor: bool = False,
               sink: PacerClient | None = None) -> dict[str, list[float]]:
    """Submits every group (ours), each next to its floor when `floor` and to the empty-handler server
    when `sink` is given, the order rotating group by group: the seconds of each Submit, by kind."""
    prompts = [f"p{g}-r{round_}" for g in range(len(groups))]
    answer = pacer.dispatch(prompts)
    assert answer.admitted == prompts, f"window too small: {answer}"
    seconds: dict[str, list[float]] = {"ours": [], "floor": [], "sink": []}
    kept: list = []
    for g, (prompt_id, arrays) in enumerate(zip(prompts, groups)):
        measures = {"ours": lambda: submit_ours_one(pacer, prompt_id, arrays, round_)}
        if floor:
            measures["floor"] = lambda: submit_floor_one(g, arrays, kept)
        if sink is not None:
            measures["sink"] = lambda: submit_sink_one(sink, prompt_id, arrays, round_)
        names = list(measures)
        for name in names[g % len(names):] + names[:g % len(names)]:
            seconds[name].append(measures[name]())
    return seconds


def collect_ours_one(pacer: PacerClient, packed: bool, kept: list) -> tuple[float, int]:
    """Seconds for the trainer to take one leased mini-batch into NumPy arrays and acknowledge it."""
    started = time.perf_counter()
    result = pacer.collect_result(MINI_BATCH // GROUP_SIZE, wait=10, lease=60)
    assert len(result.groups) == MINI_BATCH // GROUP_SIZE, result.timed_out
    if packed:
        batch = MiniBatch.from_collect(result)
        size = batch.token_ids.nbytes + batch.logprobs.nbytes + batch.loss_mask.nbytes
        kept.append(batch)
    else:
        size = sum(t.token_ids.nbytes + t.logprobs.nbytes + t.loss_mask.nbytes
                   for g in result.groups for t in g.trajectories)
        kept.append(result)
    pacer.ack(result.lease_id)
    return time.perf_counter() - started, size


def collect_all(pacer: PacerClient, batches: int, packed: bool, response: Any = None) -> tuple[float, float, int]:
    """Takes every mini-batch (ours), each next to its floor when `response` is given."""
    ours = floor_seconds = 0.0
    size = 0
    kept: list = []
    floor_kept: list = []
    for b in range(batches):
        if response is not None and b % 2:
            floor_seconds += collect_floor_one(response, floor_kept)
        seconds, batch_size = collect_ours_one(pacer, packed, kept)
        ours += seconds
        size += batch_size
        if response is not None and not b % 2:
            floor_seconds += collect_floor_one(response, floor_kept)
    return ours, floor_seconds, size


def prefetch_gaps(pacer: PacerClient, batches: int) -> list[float]:
    gaps = []
    with pacer.batches(MINI_BATCH, lease=120, poll=5, num_batches=batches) as iterator:
        next(iterator)
        for _ in range(batches - 1):
            time.sleep(STEP_SECONDS)  # the training step
            step_ended = time.perf_counter()
            next(iterator)
            gaps.append(time.perf_counter() - step_ended)
    return gaps


# ------------------------------------------------------------------------------------------- run

def one_repeat(repeat: int, arrays: list, workdir: Path) -> dict:
    groups = [arrays[i:i + GROUP_SIZE] for i in range(0, len(arrays), GROUP_SIZE)]
    batches = len(arrays) // MINI_BATCH
    payload = array_bytes(arrays)
    workdir = workdir / f"repeat-{repeat}"  # a fresh port file: the previous server's must not be read
    workdir.mkdir()
    server = ServerProcess("ours", workdir, None, overrides(len(groups))).start()
    sink_server = ServerProcess("floor", workdir, None, overrides(len(groups))).start()
    try:
        server.wait_ready()
        sink_server.wait_ready()
        with PacerClient(server.address, arrays="numpy", timeout=120) as pacer, \
                PacerClient(sink_server.address, timeout=120) as sink:
            pacer.state()
            rss_before = rss_bytes(server.process.pid)
            submit_seconds = submit_all(pacer, groups, 0, floor=True, sink=sink)
            state = pacer.state()
            rss_held = rss_bytes(server.process.pid)
            response = collect_response(groups[:MINI_BATCH // GROUP_SIZE], 0)
            collect_seconds, floor_collect, collected = collect_all(pacer, batches, False, response)
            assert collected == payload, (collected, payload)
            rss_consumed = rss_bytes(server.process.pid)  # everything acknowledged: nothing is held any more
            del response
            submit_all(pacer, groups, 1)
            packed_seconds, _, _ = collect_all(pacer, batches, True)
            submit_all(pacer, groups, 2)
            gaps = prefetch_gaps(pacer, batches)
    finally:
        server.stop()
        sink_server.stop()
    return {
        "repeat": repeat,
        "array_mb": payload / 1e6,
        # Per Submit (one group each): the report takes the median over every Submit of every repeat.
        "group_mb": payload / 1e6 / len(groups),
        "submit_seconds": submit_seconds,
        "collect_mb_s": payload / 1e6 / collect_seconds,
        "collect_packed_mb_s": payload / 1e6 / packed_seconds,
        "collect_floor_mb_s": payload / 1e6 / floor_collect,
        "held_bytes": state.held_bytes,
        "rss_growth_bytes": rss_held - rss_before,
        "rss_per_held_byte": (rss_held - rss_before) / state.held_bytes,
        "server_rss_mb": rss_held / 1e6,
        "rss_after_consumed_mb": rss_consumed / 1e6,
        "rss_before_mb": rss_before / 1e6,
        "gaps_ms": [g * 1000 for g in gaps],
        "gap_median_ms": statistics.median(gaps) * 1000,
    }


def report(runs: list[dict], busy: float) -> bool:
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]
           if key not in ("repeat", "gaps_ms", "submit_seconds")}
    for kind, key in (("ours", "submit_mb_s"), ("floor", "submit_floor_mb_s"), ("sink", "submit_sink_mb_s")):
        med[key] = runs[0]["group_mb"] / statistics.median(t for r in runs for t in r["submit_seconds"][kind])
        for r in runs:
            r[key] = r["group_mb"] / statistics.median(r["submit_seconds"][kind])
    submit_ratio = med["submit_mb_s"] / med["submit_floor_mb_s"]
    collect_ratio = med["collect_mb_s"] / med["collect_floor_mb_s"]
    packed_ratio = med["collect_packed_mb_s"] / med["collect_floor_mb_s"]
    gap_fraction = med["gap_median_ms"] / 1000 / STEP_SECONDS
    rows = [
        ("Collect-to-NumPy MB/s (views)", med["collect_mb_s"], med["collect_floor_mb_s"], collect_ratio,
         f">= {TARGETS['collect']}", collect_ratio >= TARGETS["collect"]),
        ("  same, packed by batches()", med["collect_packed_mb_s"], med["collect_floor_mb_s"], packed_ratio, "", True),
        ("Submit-from-NumPy MB/s", med["submit_mb_s"], med["submit_floor_mb_s"], submit_ratio,
         f">= {TARGETS['submit']}", submit_ratio >= TARGETS["submit"]),
    ]
    sink_ratio = med["submit_sink_mb_s"] / med["submit_floor_mb_s"]
    rows.append(("  empty-handler gRPC server", med["submit_sink_mb_s"], med["submit_floor_mb_s"], sink_ratio, "", True))
    print(f"\n{len(runs)} repeat(s) of {runs[0]['array_mb']:.0f} MB of arrays; machine busy {busy:.0f}% "
          f"(all cores, anyone's) during the run\n")
    print(f"{'':34} {'ours':>9} {'floor':>9} {'ratio':>7}  target")
    for name, ours, floor, ratio, target, ok in rows:
        print(f"{name:34} {ours:9.1f} {floor:9.1f} {ratio:7.2f}  {target} {'' if not target else 'PASS' if ok else 'FAIL'}")
    print(f"Submit, ours / empty-handler gRPC server: {med['submit_mb_s'] / med['submit_sink_mb_s']:.2f} "
          f"(what our server adds to gRPC's transport)")
    rss_ok = med["rss_per_held_byte"] <= TARGETS["rss_per_held_byte"]
    print(f"\nserver RSS per held byte: {med['rss_per_held_byte']:.2f}  (RSS growth "
          f"{med['rss_growth_bytes'] / 1e6:.0f} MB for held_bytes {med['held_bytes'] / 1e6:.0f} MB; server RSS "
          f"{med['server_rss_mb']:.0f} MB)  target <= {TARGETS['rss_per_held_byte']} {'PASS' if rss_ok else 'FAIL'}")
    print(f"server RSS before the Submits {med['rss_before_mb']:.0f} MB, with everything held "
          f"{med['server_rss_mb']:.0f} MB, after the trainer took and acknowledged all {med['rss_after_consumed_mb']:.0f} MB")
    gap_ok = gap_fraction < TARGETS["prefetch_gap_fraction"]
    print(f"prefetch gap: {med['gap_median_ms']:.1f} ms after a {STEP_SECONDS:.0f} s step = {100 * gap_fraction:.2f}% "
          f"(every gap, ms: {[round(g, 1) for r in runs for g in r['gaps_ms']]})  target < 5% "
          f"{'PASS' if gap_ok else 'FAIL'}")
    print("\nper repeat: " + "; ".join(
        f"collect {r['collect_mb_s']:.0f}/{r['collect_floor_mb_s']:.0f}, submit {r['submit_mb_s']:.0f}/"
        f"{r['submit_floor_mb_s']:.0f} (empty handler {r['submit_sink_mb_s']:.0f}), rss/held {r['rss_per_held_byte']:.2f}" for r in runs))
    return all(ok for *_, ok in rows) and rss_ok and gap_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 128 trajectories of 32,768 tokens")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a configuration override for both servers, e.g. server.allocator_retain_bytes=0")
    args = parser.parse_args(argv)
    EXTRA_OVERRIDES[:] = args.set
    if args.quick:
        args.repeats, args.trajectories = 1, 2 * MINI_BATCH
    if args.trajectories % MINI_BATCH:
        parser.error(f"--trajectories must be a multiple of {MINI_BATCH}")
    print(f"payload_path: {args.trajectories} trajectories x {args.tokens} tokens, groups of {GROUP_SIZE}, "
          f"mini-batches of {MINI_BATCH}; python {platform.python_version()}, {os.cpu_count()} cores")
    print("command: python bench/payload_path.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    arrays = make_arrays(args.trajectories, args.tokens)
    os.environ[FLOOR_PASSTHROUGH_ENV] = "1"  # the empty-handler server parses Submit as ours does
    busy0 = machine_busy_ticks()
    runs = []
    with tempfile.TemporaryDirectory(prefix="payload-path-") as tmp:
        for repeat in range(args.repeats):
            runs.append(one_repeat(repeat, arrays, Path(tmp)))
            print(f"  repeat {repeat + 1}/{args.repeats} done", flush=True)
    busy1 = machine_busy_ticks()
    busy = 100 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    ok = report(runs, busy)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "busy_percent": busy}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
