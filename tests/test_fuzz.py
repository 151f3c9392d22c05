"""Fuzzing one live server through real gRPC (raw stubs) with random and malformed requests.

A hypothesis state machine sends Dispatch / Submit / Collect / Reset / Resume requests built from a mix of
sensible and hostile parts (control characters, over-long ids, NaN rewards, unknown enum values,
mismatched arrays, absurd counts, undecodable bytes, replays of a request_id), against ONE server
subprocess for the whole test. Next to it runs a reference model of the pacing rules (no-window
strategy, status filter), so every answer is checked for its exact outcome: which status code, which
prompts are admitted, which groups come back and byte for byte what they hold.

After every call: health answers SERVING, GetState's invariant holds
(dispatched == running + collected + filtered + restored + dropped, buffered == collected - consumed)
and every counter equals the model's. At the end of each run the server is reset and drained, and every
trajectory the server accepted must have come back exactly once (collected or restored) or been
dropped with its incomplete group or filtered with its failed group: no accepted data vanished.

Each run uses its own prompt-id prefix and fresh request ids, so runs stay independent although the
server lives on; that lets hypothesis replay a failing run (it is reported unshrunk: shrinking would
cost minutes of RPCs).
"""
from __future__ import annotations

import itertools
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from coda_client._proto import pacer_pb2 as pb
from coda_client._proto import pacer_pb2_grpc
from server_harness import ServerProcess

MAX_ID = 32
CAP = 16  # max candidates / trajectories / collect groups per call
GROUP_SIZES = (2, 3)  # data_sources[0] and [1]
WINDOW = 8  # C = int(B * (1 + stale_steps)) = int(4 * 2)
REMEMBERED_GENERATIONS = 16
CONFIG = f"""
fully_async: {{sliding_window: no-window, stale_steps: 1.0}}
data_source: {{num_prompts_per_step: 4, num_trajectories_per_prompt: {GROUP_SIZES[0]}}}
data_sources:
  - {{name: a}}
  - {{name: b, num_trajectories_per_prompt: {GROUP_SIZES[1]}}}
trainer: {{mini_batch_size: 2}}
rollout: {{filter: [status], partial: true, continue_restored: false}}
server:
  max_id_length: {MAX_ID}
  max_dispatch_candidates: {CAP}
  max_submit_trajectories: {CAP}
  max_collect_groups: {CAP}
  max_message_bytes: 262144
  request_id_cache_size: 64
  remembered_generations: {REMEMBERED_GENERATIONS}
  log_level: WARNING
"""
COMPLETED, FAILED, ABORTED = (pb.TRAJECTORY_STATUS_COMPLETED, pb.TRAJECTORY_STATUS_FAILED,
                              pb.TRAJECTORY_STATUS_ABORTED)
OK = grpc.StatusCode.OK
INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION)
COUNTERS = ("dispatched", "submitted", "collected", "consumed", "filtered", "restored", "dropped", "duplicates",
            "stale_rejected")
RUNS = itertools.count()


# ----------------------------------------------------------------------------------------------- strategies

def mostly(usual, odd, odds: int = 8):
    """`usual`, and one draw in `odds` something from `odd`: most requests are sensible, with one hostile part."""
    return st.integers(0, odds - 1).flatmap(lambda k: odd if k == 0 else usual)


# An id spec is turned into a string by the machine (which knows the run's prefix and the prompts in flight).
pool_id = st.tuples(st.just("pool"), st.integers(0, 11))
inflight_id = st.tuples(st.just("inflight"), st.integers(0, 20))
hostile_id = st.one_of(
    st.tuples(st.just("empty")),
    st.tuples(st.just("long"), st.integers(MAX_ID, 2000)),
    st.tuples(st.just("control"), st.sampled_from(["\x00", "\n", "\r", "\x1b", "\x7f", "\u2028", "\u200b", "\ufeff"])),
    st.tuples(st.just("text"), st.text(max_size=12)),  # anything, printable or not (prefixed by the run)
)
prompt_spec = mostly(st.one_of(inflight_id, inflight_id, pool_id), hostile_id)
trajectory_id_spec = mostly(st.one_of(st.tuples(st.just("own"), st.integers(0, 3)),
                                      st.tuples(st.just("shared"), st.integers(0, 3))), hostile_id)
request_id_kind = mostly(st.sampled_from(["none", "fresh"]), st.sampled_from(["long", "control"]))
wait_value = mostly(st.sampled_from([0.0, 0.0, 0.0, 0.01]), st.sampled_from([math.nan, -1.0, math.inf]))
reward_value = mostly(st.floats(-10, 10, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf]))
status_value = mostly(st.sampled_from([COMPLETED] * 6 + [FAILED, ABORTED]), st.integers(-3, 9))


@st.composite
def arrays(draw) -> dict:
    n = draw(st.integers(0, 4))
    lengths = draw(st.sampled_from(["equal"] * 6 + ["some-empty", "any"]))
    token_ids = draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=n, max_size=n))
    if lengths == "equal":
        sizes = (n, n)
    elif lengths == "some-empty":
        sizes = (draw(st.sampled_from([0, n])), draw(st.sampled_from([0, n])))
    else:
        sizes = (draw(st.integers(0, 5)), draw(st.integers(0, 5)))
    return {"token_ids": token_ids,
            "logprobs": draw(st.lists(st.floats(width=32, allow_nan=True), min_size=sizes[0], max_size=sizes[0])),
            "loss_mask": draw(st.lists(st.integers(0, 1), min_size=sizes[1], max_size=sizes[1]))}


trajectory_spec = st.fixed_dictionaries({
    "prompt": prompt_spec,
    "id": trajectory_id_spec,
    "ds_index": mostly(st.just("same"), st.sampled_from([0, 1, 3, 2**32 - 1])),
    "status": status_value,
    "reward": reward_value,
    "arrays": arrays(),
    "payload": st.binary(max_size=8),
    "metadata": mostly(st.just({}), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), odds=4),
    "num_turns": st.integers(0, 3),
    "versions": st.tuples(st.integers(0, 3), st.integers(0, 3)),
})
candidate_spec = st.fixed_dictionaries({
    "prompt": mostly(pool_id, st.one_of(inflight_id, hostile_id)),
    "ds_index": mostly(st.sampled_from([0, 0, 1]), st.sampled_from([2, 5, 2**32 - 1])),
    "order": st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 50)), st.tuples(st.integers(0, 3),
                                                                                             st.none())),
})
def too_many(spec):
    """("many", spec, count): a call carrying more than the cap, drawn compactly."""
    return st.tuples(st.just("many"), spec, st.integers(CAP + 1, CAP + 3))


count_value = mostly(st.integers(1, 4), st.sampled_from([0, CAP, CAP + 1, 2**32 - 1]))
METHODS = {"Dispatch": (pb.DispatchRequest, pb.DispatchResponse), "Submit": (pb.SubmitRequest, pb.SubmitResponse),
           "Collect": (pb.CollectRequest, pb.CollectResponse), "Reset": (pb.ResetRequest, pb.ResetResponse),
           "Resume": (pb.ResumeRequest, pb.ResumeResponse), "Ack": (pb.AckRequest, pb.AckResponse)}


# ----------------------------------------------------------------------------------------------- the model


@dataclass
class Group:
    prompt_id: str
    ds_index: int
    seq: int
    generation: int
    epoch: Optional[int]
    index: Optional[int]
    trajectories: list = field(default_factory=list)  # accepted pb.Trajectory, in order
    arrival: int = 1 << 62  # order of its first trajectory's arrival (a Reset restores in that order)

    @property
    def size(self) -> int:
        return GROUP_SIZES[self.ds_index]

    def priority(self) -> tuple:
        if self.epoch is not None and self.index is not None:
            return (self.epoch, self.index, self.seq)
        return (math.inf, math.inf, self.seq)


def id_problem(value: str, limit: int = MAX_ID) -> bool:
    return not value or len(value) > limit or not value.isprintable()


def opaque_id_problem(value: str) -> bool:
    """Request and lease ids may always have 128 characters (a UUID fits whatever max_id_length says)."""
    return id_problem(value, max(MAX_ID, 128))


def wait_problem(value: float) -> bool:
    return not math.isfinite(value) or value < 0


def key(message) -> bytes:
    return message.SerializeToString(deterministic=True)


class Server:
    """The live server of the test, set by the test before the machine runs."""

    process: ServerProcess
    stub: pacer_pb2_grpc.RolloutPacerStub
    channel: grpc.Channel
    health: health_pb2_grpc.HealthStub


class PacerFuzz(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tag = f"r{next(RUNS)}."
        self.stub = Server.stub
        self.inflight: dict[str, Group] = {}  # dispatched, not yet moved out (held aborted groups included)
        self.buffer: dict[int, Group] = {}  # by seq: a prompt may be dispatched again while its old group is buffered
        self.accepted: dict[str, Any] = {}  # this generation's accepted trajectories by id (the server's _accepted)
        self.generation_prompts: set[str] = set()
        self.past_prompts: deque[set[str]] = deque(maxlen=REMEMBERED_GENERATIONS)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.fate: dict[tuple[int, str], Optional[str]] = {}  # (generation, trajectory_id) -> None while held
        self.last_seq = -1
        self.last_success: Optional[tuple[str, Any, Any]] = None  # (method, request, response) with a request_id

    # ------------------------------------------------------------------ plumbing

    def call(self, method: str, request) -> tuple[grpc.StatusCode, Any, str]:
        try:
            response = getattr(self.stub, method)(request, timeout=20)
        except grpc.RpcError as error:
            code = error.code()
            assert code in (INVALID, NOT_FOUND, PRECONDITION), f"{method}: unexpected {code} {error.details()}"
            assert error.details(), f"{method}: {code} without a message"
            return code, None, error.details()
        if request.request_id:
            self.last_success = (method, request, response)
        return OK, response, ""

    def request_id(self, kind: str) -> str:
        return {"none": "", "fresh": f"{self.tag}{uuid.uuid4().hex[:16]}", "long": "q" * 129,
                "control": "id\x00"}[kind]

    def prompt_id(self, spec) -> str:
        kind = spec[0]
        if kind == "inflight":
            live = sorted(self.inflight)
            return live[spec[1] % len(live)] if live else f"{self.tag}p{spec[1] % 12}"
        if kind == "pool":
            return f"{self.tag}p{spec[1]}"
        return self.hostile(spec)

    def hostile(self, spec) -> str:
        kind = spec[0]
        if kind == "empty":
            return ""
        if kind == "long":
            return self.tag + "x" * spec[1]
        if kind == "control":
            return f"{self.tag}a{spec[1]}b"
        return self.tag + spec[1]  # "text": valid or not, depending on what hypothesis drew

    def state(self) -> pb.GetStateResponse:
        return self.stub.GetState(pb.GetStateRequest(), timeout=20)

    # ------------------------------------------------------------------ start of a run: a known state

    @initialize()
    def start_from_a_known_state(self) -> None:
        """Reset (restoring or dropping whatever earlier runs left) and drain the buffer; the model starts empty."""
        state = self.state()
        self.stub.Reset(pb.ResetRequest(mode=pb.RESET_MODE_ABORT, wait_seconds=0, resume=True,
                                        weight_version=state.weight_version), timeout=20)
        while self.stub.Collect(pb.CollectRequest(num_groups=CAP, allow_partial=True), timeout=20).groups:
            pass
        self.base = self.state()
        assert (self.base.running, self.base.buffered, self.base.queued_trajectories, self.base.paused) == (0, 0, 0, False)
        self.arrivals = 0
        self.generation, self.step, self.weight_version, self.paused = (
            self.base.generation, self.base.step, self.base.weight_version, False)

    # ------------------------------------------------------------------ Dispatch

    @rule(candidates=mostly(st.lists(candidate_spec, max_size=4), too_many(candidate_spec), odds=16),
          wait=wait_value, rid=request_id_kind)
    def dispatch(self, candidates, wait, rid) -> None:
        if isinstance(candidates, tuple):  # one spec, more times than a call may carry (distinct ids)
            _, spec, count = candidates
            candidates = [{**spec, "prompt": ("pool", 100 + i)} for i in range(count)]
        refs = []
        for spec in candidates:
            ref = pb.PromptRef(prompt_id=self.prompt_id(spec["prompt"]), ds_index=spec["ds_index"])
            if spec["order"] is not None:
                ref.epoch = spec["order"][0]
                if spec["order"][1] is not None:
                    ref.index = spec["order"][1]
            refs.append(ref)
        request = pb.DispatchRequest(candidates=refs, wait_seconds=wait, request_id=self.request_id(rid))
        ids = [r.prompt_id for r in refs]
        valid = (len(refs) <= CAP and not wait_problem(wait) and not (request.request_id and opaque_id_problem(request.request_id))
                 and all(not id_problem(i) and i not in self.inflight for i in ids) and len(set(ids)) == len(ids)
                 and all(r.ds_index < len(GROUP_SIZES) for r in refs))
        code, response, message = self.call("Dispatch", request)
        assert code == (OK if valid else INVALID), (code, message, request)
        if code != OK:
            return
        room = 0 if self.paused else max(0, WINDOW - len(self.inflight) - len(self.buffer))
        admitted = [(a.prompt_id, a.seq) for a in response.admitted]
        assert [p for p, _ in admitted] == ids[:min(room, len(ids))], (admitted, ids, room)
        assert response.paused == self.paused and response.generation == self.generation
        for (prompt_id, seq), ref in zip(admitted, refs):
            assert seq > self.last_seq
            self.last_seq = seq
            self.inflight[prompt_id] = Group(prompt_id, ref.ds_index, seq, self.generation,
                                             ref.epoch if ref.HasField("epoch") else None,
                                             ref.index if ref.HasField("index") else None)
            self.generation_prompts.add(prompt_id)
        self.counts["dispatched"] += len(admitted)

    @rule(count=st.integers(1, 4), ds_index=st.sampled_from([0, 0, 1]), wait=st.sampled_from([0.0, 0.01]))
    def dispatch_fresh_prompts(self, count, ds_index, wait) -> None:
        """What a well-behaved worker asks: a few prompts not in flight."""
        free = [k for k in range(12) if f"{self.tag}p{k}" not in self.inflight][:count]
        self.dispatch([{"prompt": ("pool", k), "ds_index": ds_index, "order": None} for k in free], wait, "fresh")

    # ------------------------------------------------------------------ Submit

    def trajectory(self, spec) -> pb.Trajectory:
        prompt_id = self.prompt_id(spec["prompt"])
        kind = spec["id"][0]
        if kind == "own":
            trajectory_id = f"{prompt_id}-t{spec['id'][1]}"
        elif kind == "shared":
            trajectory_id = f"{self.tag}t{spec['id'][1]}"
        else:
            trajectory_id = self.hostile(spec["id"])
        ds_index = spec["ds_index"]
        if ds_index == "same":
            ds_index = self.inflight[prompt_id].ds_index if prompt_id in self.inflight else 0
        return pb.Trajectory(trajectory_id=trajectory_id, prompt_id=prompt_id, ds_index=ds_index, status=spec["status"],
                             reward=spec["reward"], payload=spec["payload"], metadata=spec["metadata"],
                             num_turns=spec["num_turns"], start_weight_version=spec["versions"][0],
                             end_weight_version=spec["versions"][1], **spec["arrays"])

    def expected_submit(self, request: pb.SubmitRequest):
        """(code, fresh trajectories, duplicates, stale count) as the server's rules give them."""
        if request.request_id and opaque_id_problem(request.request_id):
            return INVALID, [], 0, 0
        batch = list(request.trajectories)
        for t in batch:
            if len({n for n in (len(t.token_ids), len(t.logprobs), len(t.loss_mask)) if n}) > 1:
                return INVALID, [], 0, 0
        if len(batch) > CAP:
            return INVALID, [], 0, 0
        violations = unknown = stale = duplicates = 0
        fresh, in_batch, added = [], {}, {}
        for t in batch:
            if (id_problem(t.trajectory_id) or id_problem(t.prompt_id) or t.status not in (COMPLETED, FAILED, ABORTED)
                    or not math.isfinite(t.reward)):
                violations += 1
                continue
            earlier = self.accepted.get(t.trajectory_id) or in_batch.get(t.trajectory_id)
            if earlier is not None:
                if earlier == t:
                    duplicates += 1
                else:
                    violations += 1
                continue
            group = self.inflight.get(t.prompt_id)
            if group is None:
                if t.prompt_id in self.generation_prompts:
                    violations += 1
                elif any(t.prompt_id in past for past in self.past_prompts):
                    stale += 1
                else:
                    unknown += 1
                continue
            if t.ds_index != group.ds_index:
                violations += 1
                continue
            count = added.get(t.prompt_id, 0) + 1
            if len(group.trajectories) + count > group.size:
                violations += 1
                continue
            added[t.prompt_id] = count
            in_batch[t.trajectory_id] = t
            fresh.append(t)
        if violations:
            return INVALID, [], 0, 0
        if unknown:
            return NOT_FOUND, [], 0, 0
        if stale:
            return PRECONDITION, [], 0, stale
        return OK, fresh, duplicates, 0

    def submit_request(self, request: pb.SubmitRequest) -> None:
        expected, fresh, duplicates, stale = self.expected_submit(request)
        code, response, message = self.call("Submit", request)
        assert code == expected, (code, expected, message, request)
        self.counts["stale_rejected"] += stale
        if code != OK:
            return
        completed = []
        for t in fresh:
            group = self.inflight[t.prompt_id]
            if not group.trajectories:
                group.arrival, self.arrivals = self.arrivals, self.arrivals + 1
            group.trajectories.append(t)
            self.accepted[t.trajectory_id] = t
            self.fate[(group.generation, t.trajectory_id)] = None
            if len(group.trajectories) == group.size:
                completed.append(group)
        assert (response.accepted, response.duplicates, response.groups_completed) == (
            len(fresh), duplicates, len(completed))
        self.counts["submitted"] += len(fresh)
        self.counts["duplicates"] += duplicates
        for group in completed:  # no-window: an aborted group waits for the Reset; a failed one is filtered
            statuses = {t.status for t in group.trajectories}
            if ABORTED in statuses:
                continue
            del self.inflight[group.prompt_id]
            if FAILED in statuses:
                self.counts["filtered"] += 1
                self.settle(group, "filtered")
            else:
                self.counts["collected"] += 1
                self.buffer[group.seq] = group

    @rule(specs=mostly(st.lists(trajectory_spec, max_size=4), too_many(trajectory_spec), odds=16), rid=request_id_kind)
    def submit(self, specs, rid) -> None:
        if isinstance(specs, tuple):  # one spec, more times than a call may carry (distinct ids)
            _, spec, count = specs
            specs = [{**spec, "id": ("own", 10 + i)} for i in range(count)]
        trajectories = [self.trajectory(spec) for spec in specs]
        self.submit_request(pb.SubmitRequest(trajectories=trajectories, request_id=self.request_id(rid)))

    @precondition(lambda self: self.inflight)
    @rule(which=st.integers(0, 20), statuses=st.lists(st.sampled_from([COMPLETED] * 8 + [FAILED, ABORTED]),
                                                       min_size=3, max_size=3),
          payload=st.binary(max_size=64), rid=request_id_kind)
    def submit_whole_group(self, which, statuses, payload, rid) -> None:
        """What a well-behaved worker sends: the rest of a group, so groups complete and reach the buffer."""
        group = self.inflight[sorted(self.inflight)[which % len(self.inflight)]]
        have = {t.trajectory_id for t in group.trajectories}
        missing = [i for i in range(8) if f"{group.prompt_id}-t{i}" not in have][:group.size - len(group.trajectories)]
        trajectories = [pb.Trajectory(trajectory_id=f"{group.prompt_id}-t{i}", prompt_id=group.prompt_id,
                                      ds_index=group.ds_index, status=statuses[n], reward=float(i),
                                      token_ids=[i, i + 1], logprobs=[-0.5, -0.25], payload=payload)
                        for n, i in enumerate(missing)]
        self.submit_request(pb.SubmitRequest(trajectories=trajectories, request_id=self.request_id(rid)))

    @rule(count=st.integers(1, 3), ds_index=st.sampled_from([0, 0, 1]),
          statuses=st.lists(st.sampled_from([COMPLETED] * 10 + [FAILED, ABORTED]), min_size=9, max_size=9))
    def worker_round(self, count, ds_index, statuses) -> None:
        """A worker's round trip: dispatch a few fresh prompts, then submit every admitted group whole in one call."""
        before = set(self.inflight)
        self.dispatch_fresh_prompts(count, ds_index, 0.0)
        trajectories = []
        for n, prompt_id in enumerate(sorted(set(self.inflight) - before)):
            group = self.inflight[prompt_id]
            trajectories += [pb.Trajectory(trajectory_id=f"{prompt_id}-t{i}", prompt_id=prompt_id, ds_index=ds_index,
                                           status=statuses[3 * n + i], reward=float(i), token_ids=[1, 2, 3],
                                           logprobs=[-1.0, -0.5, -0.25], loss_mask=[0, 1, 1], payload=bytes([n, i]))
                             for i in range(group.size)]
        if trajectories:
            self.submit_request(pb.SubmitRequest(trajectories=trajectories, request_id=self.request_id("fresh")))

    # ------------------------------------------------------------------ Collect

    @rule(num_groups=count_value, wait=wait_value, allow_partial=st.booleans(), rid=request_id_kind,
          lease=mostly(st.just(0.0), st.sampled_from([math.nan, -1.0, math.inf])))
    def collect(self, num_groups, wait, allow_partial, rid, lease=0.0) -> None:
        # Leases (lease_seconds > 0, then Ack) are not modelled here: only refused lease values are sent.
        request = pb.CollectRequest(num_groups=num_groups, wait_seconds=wait, allow_partial=allow_partial,
                                    request_id=self.request_id(rid), lease_seconds=lease)
        valid = 1 <= num_groups <= CAP and not wait_problem(wait) and not wait_problem(lease) and not (
            request.request_id and opaque_id_problem(request.request_id)) and (allow_partial or num_groups <= WINDOW)
        code, response, message = self.call("Collect", request)
        assert code == (OK if valid else INVALID), (code, message, request)
        if code != OK:
            return
        ordered = sorted(self.buffer.values(), key=Group.priority)
        if len(ordered) >= num_groups:
            expected, timed_out = ordered[:num_groups], False
        else:
            expected, timed_out = (ordered if allow_partial else []), True
        assert response.timed_out == timed_out
        self.check_groups(response.groups, expected, "consumed")
        for group in expected:
            del self.buffer[group.seq]
        self.counts["consumed"] += len(expected)

    def check_groups(self, messages, expected: list[Group], fate: str) -> None:
        """The groups the server handed back are exactly the expected ones, byte for byte, each for the first time."""
        assert [(m.prompt_id, m.seq) for m in messages] == [(g.prompt_id, g.seq) for g in expected]
        for message, group in zip(messages, expected):
            assert message.ds_index == group.ds_index
            assert [key(t) for t in message.trajectories] == [key(t) for t in group.trajectories]
            assert (message.epoch if message.HasField("epoch") else None) == group.epoch
            assert (message.index if message.HasField("index") else None) == group.index
            self.settle(group, fate)

    def settle(self, group: Group, fate: str) -> None:
        for t in group.trajectories:
            entry = (group.generation, t.trajectory_id)
            assert self.fate.get(entry, "missing") is None, f"{entry} delivered twice or never accepted"
            self.fate[entry] = fate

    @rule(lease=mostly(st.sampled_from(["lease-1", "lease-77", "x"]), hostile_id), rid=request_id_kind)
    def ack(self, lease, rid) -> None:
        """No lease is ever granted in these runs: an Ack is NOT_FOUND, or INVALID_ARGUMENT for a bad id."""
        lease_id = lease if isinstance(lease, str) else self.hostile(lease)
        request = pb.AckRequest(lease_id=lease_id, request_id=self.request_id(rid))
        bad = opaque_id_problem(lease_id) or (request.request_id and opaque_id_problem(request.request_id))
        code, _, message = self.call("Ack", request)
        assert code == (INVALID if bad else NOT_FOUND), (code, message, request)

    # ------------------------------------------------------------------ Reset / Resume

    @rule(mode=mostly(st.sampled_from([0, 1, 2]), st.integers(-3, 9)), wait=wait_value,
          resume=st.sampled_from([True, True, False]), version=mostly(st.integers(0, 2), st.integers(-2, -1)),
          rid=request_id_kind)
    def reset(self, mode, wait, resume, version, rid) -> None:
        weight_version = self.weight_version + version
        request = pb.ResetRequest(mode=mode, wait_seconds=wait, resume=resume, weight_version=weight_version,
                                  request_id=self.request_id(rid))
        valid = (mode in (0, 1, 2) and not wait_problem(wait) and not (resume and weight_version < self.weight_version)
                 and not (request.request_id and opaque_id_problem(request.request_id)))
        code, response, message = self.call("Reset", request)
        assert code == (OK if valid else INVALID), (code, message, request)
        if code != OK:
            return
        by_seq = sorted(self.inflight.values(), key=lambda g: g.seq)
        restored = [g for g in sorted(by_seq, key=lambda g: (g.arrival, g.seq)) if len(g.trajectories) == g.size]
        dropped = [g for g in by_seq if len(g.trajectories) < g.size]
        self.check_groups(response.restored, restored, "restored")
        assert list(response.dropped_prompt_ids) == [g.prompt_id for g in dropped]
        report = response.report
        assert (report.partial_restored_group_count, report.partial_dropped_incomplete_group_count) == (
            len(restored), len(dropped))
        assert (report.partial_restored_count, report.partial_dropped_incomplete_count) == (  # trajectories
            sum(len(g.trajectories) for g in restored), sum(len(g.trajectories) for g in dropped))
        for group in dropped:
            self.settle(group, "dropped")
        self.counts["restored"] += len(restored)
        self.counts["dropped"] += len(dropped)
        self.inflight.clear()
        self.accepted.clear()
        self.past_prompts.append(self.generation_prompts)
        self.generation_prompts = set()
        self.generation += 1
        self.paused = True
        if resume:
            self.step += 1
            self.weight_version = weight_version
            self.paused = False
        assert (response.generation, response.step, response.weight_version, response.paused) == (
            self.generation, self.step, self.weight_version, self.paused)

    @rule(version=mostly(st.integers(0, 2), st.integers(-2, -1)), rid=request_id_kind)
    def resume(self, version, rid) -> None:
        request = pb.ResumeRequest(weight_version=self.weight_version + version, request_id=self.request_id(rid))
        valid = version >= 0 and not (request.request_id and opaque_id_problem(request.request_id))
        code, response, message = self.call("Resume", request)
        assert code == (OK if valid else INVALID), (code, message, request)
        if code == OK:
            self.step, self.weight_version, self.paused = self.step + 1, request.weight_version, False
            assert (response.step, response.weight_version) == (self.step, self.weight_version)

    # ------------------------------------------------------------------ replays and raw bytes

    @precondition(lambda self: self.last_success is not None)
    @rule()
    def replay_last_request(self) -> None:
        """A retry with the same request_id gets the first answer again and changes nothing."""
        method, request, response = self.last_success
        before = self.state()
        assert getattr(self.stub, method)(request, timeout=20) == response
        self.assert_same_state(before, self.state())

    @rule(method=st.sampled_from(sorted(METHODS)), data=st.binary(max_size=48))
    def raw_bytes(self, method, data) -> None:
        request_type, response_type = METHODS[method]
        try:
            request_type.FromString(data)
        except Exception:  # not a message: the server must say INVALID_ARGUMENT and change nothing
            before = self.state()
            call = Server.channel.unary_unary(f"/coda.pacer.v1.RolloutPacer/{method}")
            with pytest.raises(grpc.RpcError) as caught:
                call(data, timeout=20)
            assert caught.value.code() == INVALID and "not a valid protobuf message" in caught.value.details()
            self.assert_same_state(before, self.state())
        # Bytes that do decode are an ordinary (random) request; the typed rules cover those.

    @staticmethod
    def assert_same_state(before, after) -> None:
        for name in ("running", "buffered", "queued_trajectories", "step", "weight_version", "generation", "paused",
                     *COUNTERS):
            assert getattr(before, name) == getattr(after, name), name

    # ------------------------------------------------------------------ after every step

    @invariant()
    def server_is_healthy_consistent_and_agrees_with_the_model(self) -> None:
        health = Server.health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=20)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert Server.process.process.poll() is None, "the server died"
        s = self.state()
        # The state's invariant (expired and leased are the server's in-flight and Collect leases: 0 here).
        assert s.dispatched == s.running + s.collected + s.filtered + s.restored + s.dropped + s.expired
        assert s.buffered == s.collected - s.consumed - s.leased
        assert (s.expired, s.leased, s.redelivered) == (0, 0, 0)
        if not hasattr(self, "base"):
            return
        for name in COUNTERS:
            assert getattr(s, name) - getattr(self.base, name) == self.counts[name], name
        assert (s.running, s.buffered) == (len(self.inflight), len(self.buffer))
        assert s.queued_trajectories == sum(len(g.trajectories) for g in self.inflight.values())
        assert (s.generation, s.step, s.weight_version, s.paused, s.resetting, s.waiting_calls) == (
            self.generation, self.step, self.weight_version, self.paused, False, 0)
        # No accepted trajectory is unaccounted for: still held = in flight or buffered, per the model.
        held = sum(1 for fate in self.fate.values() if fate is None)
        assert held == s.queued_trajectories + sum(len(g.trajectories) for g in self.buffer.values())

    def teardown(self) -> None:
        """End of run: reset and drain through the model; every accepted trajectory must have met one fate."""
        if not hasattr(self, "base"):
            return
        self.reset(mode=pb.RESET_MODE_ABORT, wait=0.0, resume=True, version=0, rid="none")
        while self.buffer:
            self.collect(num_groups=min(CAP, len(self.buffer)), wait=0.0, allow_partial=True, rid="none")
        self.server_is_healthy_consistent_and_agrees_with_the_model()
        unsettled = [entry for entry, fate in self.fate.items() if fate is None]
        assert not unsettled, f"accepted but never delivered, dropped or filtered: {unsettled}"


def test_fuzz_live_server(tmp_path):
    config = tmp_path / "fuzz.yaml"
    config.write_text(CONFIG)
    with ServerProcess(tmp_path, config_file=config) as server:
        Server.process = server
        Server.channel = server.channel()
        Server.stub = pacer_pb2_grpc.RolloutPacerStub(Server.channel)
        Server.health = health_pb2_grpc.HealthStub(Server.channel)
        run_state_machine_as_test(PacerFuzz, settings=settings(
            # derandomize: the same 30 runs every time (348 Dispatches, 130 groups taken or restored), so the
            # volume check below cannot fail on an unlucky draw (the property tests elsewhere still draw afresh).
            max_examples=30, stateful_step_count=30, deadline=None, database=None, derandomize=True,
            # No shrinking: every replay costs real RPCs, and the failing run's steps are printed as they are.
            phases=(Phase.explicit, Phase.reuse, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
        state = Server.stub.GetState(pb.GetStateRequest(), timeout=20)
        # The runs did real work, not only refusals.
        assert state.dispatched > 50 and state.consumed + state.restored > 10, state
        assert server.process.poll() is None
        assert server.terminate() == 0, server.log()
