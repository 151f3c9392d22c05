"""The trainer's data path: packed columnar mini-batches from leased Collects, the next one prefetched.

`PacerClient.batches()` and `AsyncPacerClient.batches()` return the iterators defined here (see
docs/trainer.md). Needs NumPy (`pip install 'coda-pacer[numpy]'`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import mmap
import operator
import os
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import grpc

from . import _calls
from ._channel import read_stream
from ._outage import OutageLog
from .arrays import dtype_of, numpy
from .errors import PacerClientError, ServerGoneError, refuses_for_now, translate
from .types import (CollectResult, ControlEvent, ControlEventType, KeepAliveResult, PacerState, Trajectory,
                    TrajectoryGroup)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from .client import AsyncPacerClient, PacerClient

__all__ = ["MiniBatch", "GroupView", "PaddedBatch", "BatchIterator", "AsyncBatchIterator", "BatchShape"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_LEASE_SECONDS = 600.0
DEFAULT_POLL_SECONDS = 5.0
# How long a call ended by the server waits for the SHUTDOWN event that explains it.
SHUTDOWN_EVENT_WAIT_SECONDS = 5.0
_ENDED_BY_SHUTDOWN = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
# How long the iterator waits for a server that announced SHUTDOWN or cannot be reached to answer again
# (a restart, a rolling update) before its calls give up with ServerGoneError.
DEFAULT_RECONNECT_SECONDS = 120.0
# Back-off between attempts while the server is away (an announced successor's STATE ends a wait at once).
_AWAY_RETRY_INITIAL_SECONDS = 0.2
_AWAY_RETRY_MAX_SECONDS = 2.0
# A mini-batch the caller has waited for this long (in next(), not while training on the one before) is logged with
# the server's state saying why (a Reset without its Resume, no worker dispatching, workers slower than the
# trainer), and again every STALL_REPEAT_SECONDS while it stays away: the server's own warning
# (server.collect_stall_warning_seconds) is in the server's log, not the trainer's.
STALL_WARNING_SECONDS = 60.0
# Sooner while the control stream says dispatch is paused: nothing comes until a Resume, and a trainer that reset
# without resuming and now waits for a batch waits on itself.
PAUSED_WARNING_SECONDS = 5.0
STALL_REPEAT_SECONDS = 600.0
# The clock of those warnings (when the caller asked, when the wait for its batch began); tests put their own.
_stall_clock = time.monotonic
# The longest close() waits for the iterator's own tasks to end once cut (they end at once).
_CLOSE_WAIT_SECONDS = 5.0
# The longest close() lets a prefetch still in progress go on before cutting it: an answer on its way (the groups
# were there) is received, and its lease given back; one that waits for groups is cut after it, nothing leased.
_CLOSE_PREFETCH_WAIT_SECONDS = 1.0
# Between heartbeats before the server has said its liveness grace (then a third of it, as workers beat).
_FIRST_BEAT_RETRY_SECONDS = 1.0


def _server_away(code: Any) -> bool:
    """Whether a call that ended with `code` is to be sent again (same request id) once a server answers: the server
    shut down or died (CANCELLED, UNAVAILABLE), or no answer was read before the deadline (DEADLINE_EXCEEDED): a
    client that waits for a server to be ready and found none, a server that did not answer in time, or this process
    stopped (SIGSTOP, a paused VM) past the deadline of a Collect that was waiting, whose answer it then reads too
    late. The retry takes nothing twice; `reconnect` bounds the whole."""
    return code in _ENDED_BY_SHUTDOWN or code == grpc.StatusCode.DEADLINE_EXCEEDED


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` is set within `seconds`. Not wait_for: on Python 3.10 and 3.11 it can swallow the caller's
    cancel when the event is set in the same turn of the loop."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=seconds)
    finally:
        waiter.cancel()
    return event.is_set()


@dataclass(frozen=True, eq=False)
class PaddedBatch:
    """A mini-batch as [B, L] matrices; `attention_mask` is True on real tokens, False on padding."""

    token_ids: np.ndarray  # int32 [B, L], pad_token_id on padding
    logprobs: np.ndarray  # float32 [B, L], 0.0 on padding
    loss_mask: np.ndarray  # int32 [B, L], 0 on padding
    attention_mask: np.ndarray  # bool [B, L]
    side: str  # "right": tokens first, padding after; "left": padding first


@dataclass(frozen=True, eq=False)
class GroupView:
    """One prompt group of a mini-batch: rows [start, stop) of the batch, and views of its slices."""

    batch: MiniBatch
    position: int  # index of the group in the batch (the value of batch.group_index for its rows)
    prompt_id: str
    seq: int
    ds_index: int
    epoch: int | None
    index: int | None
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def reward(self) -> np.ndarray:
        """Rewards of the group's trajectories (a view of batch.reward)."""
        return self.batch.reward[self.start:self.stop]

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Offsets of the group's trajectories in its token slice (starts at 0)."""
        offsets = self.batch.cu_seqlens[self.start:self.stop + 1]
        return offsets - offsets[0]

    def _tokens(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.batch.cu_seqlens[self.start]:self.batch.cu_seqlens[self.stop]]

    @property
    def token_ids(self) -> np.ndarray:
        return self._tokens(self.batch.token_ids)

    @property
    def logprobs(self) -> np.ndarray:
        return self._tokens(self.batch.logprobs)

    @property
    def loss_mask(self) -> np.ndarray:
        return self._tokens(self.batch.loss_mask)

    @property
    def trajectories(self) -> list[Trajectory]:
        """The group's trajectories as received (metadata, payload, ids)."""
        return self.batch.trajectories[self.start:self.stop]


@dataclass(frozen=True, eq=False)
class MiniBatch:
    """Complete prompt groups packed into flat columns, trajectories in Collect order.

    Trajectory b spans tokens cu_seqlens[b]:cu_seqlens[b+1] of token_ids, logprobs and loss_mask. An
    array a trajectory left empty (absent) is filled: logprobs with NaN, loss_mask with 1 (trained on),
    token_ids with 0. Arrays are read-only; `lease_ids` are the Collect leases the iterator acknowledges
    (several when the batch did not fit one answer within the client's message limit), `lease_id` the first.

    `token_weight_version` is the weight version each token was generated with (from the trajectories'
    segments; a trajectory without them counts as its end_weight_version throughout). Packed with
    `mask_offpolicy`, loss_mask is 0 on the tokens of a partial rollout generated before its last weight
    version (LoongSage's mask_offpolicy_in_partial_rollout); `offpolicy_mask()` gives that mask either way.
    """

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    loss_mask: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int64 [B + 1], cu_seqlens[0] == 0, cu_seqlens[-1] == T
    reward: np.ndarray  # float64 [B]
    group_index: np.ndarray  # int64 [B]: position of the trajectory's group in `groups`
    prompt_id: tuple[str, ...]  # [B]
    trajectory_id: tuple[str, ...]  # [B]
    status: np.ndarray  # int32 [B] (TrajectoryStatus numbers)
    start_weight_version: np.ndarray  # int64 [B]
    end_weight_version: np.ndarray  # int64 [B]
    trajectories: list[Trajectory]  # [B], as received (metadata, payload)
    source_groups: list[TrajectoryGroup]
    lease_id: str = ""
    lease_ids: tuple[str, ...] = ()

    @classmethod
    def from_groups(cls, groups: Sequence[TrajectoryGroup], lease_id: str = "", *,
                    mask_offpolicy: bool = False, lease_ids: Sequence[str] = ()) -> MiniBatch:
        """Packs groups (their arrays lists or NumPy arrays) into one batch; one copy per column. With
        `mask_offpolicy`, loss_mask is 0 on tokens generated before their trajectory's last weight version."""
        np = numpy()
        trajectories = [t for g in groups for t in g.trajectories]
        lengths = np.fromiter((max(len(t.token_ids), len(t.logprobs), len(t.loss_mask)) for t in trajectories),
                              dtype=np.int64, count=len(trajectories))
        cu_seqlens = np.zeros(len(trajectories) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        columns = {name: _packed(np, name, trajectories, lengths, fill)
                   for name, fill in (("token_ids", 0), ("logprobs", np.nan), ("loss_mask", 1))}
        per_trajectory = {
            "reward": np.fromiter((t.reward for t in trajectories), np.float64, len(trajectories)),
            "group_index": np.repeat(np.arange(len(groups), dtype=np.int64), [len(g.trajectories) for g in groups]),
            "status": np.fromiter((int(t.status) for t in trajectories), np.int32, len(trajectories)),
            "start_weight_version": np.fromiter((t.start_weight_version for t in trajectories), np.int64,
                                                len(trajectories)),
            "end_weight_version": np.fromiter((t.end_weight_version for t in trajectories), np.int64,
                                              len(trajectories)),
        }
        versions = None
        if mask_offpolicy:
            versions = _token_versions(np, trajectories, lengths, per_trajectory["end_weight_version"])
            columns["loss_mask"] = columns["loss_mask"] * _on_last_version(np, versions, lengths,
                                                                           per_trajectory["end_weight_version"])
        for value in (cu_seqlens, *columns.values(), *per_trajectory.values()):
            value.flags.writeable = False
        batch = cls(cu_seqlens=cu_seqlens, prompt_id=tuple(t.prompt_id for t in trajectories),
                    trajectory_id=tuple(t.trajectory_id for t in trajectories), trajectories=trajectories,
                    source_groups=list(groups), lease_id=lease_id or (lease_ids[0] if lease_ids else ""),
                    lease_ids=tuple(lease_ids) if lease_ids else ((lease_id,) if lease_id else ()),
                    **columns, **per_trajectory)
        if versions is not None:  # already computed: the cached property's value
            batch.__dict__["token_weight_version"] = versions
        return batch

    @classmethod
    def from_collect(cls, result: CollectResult, *, mask_offpolicy: bool = False) -> MiniBatch:
        """Packs a Collect answer (best read with arrays="numpy", so its arrays are views already)."""
        return cls.from_collects([result], mask_offpolicy=mask_offpolicy)

    @classmethod
    def from_collects(cls, results: Sequence[CollectResult], *, mask_offpolicy: bool = False) -> MiniBatch:
        """Packs the answers of several Collects into one batch, in order (a batch cut to fit the message limit)."""
        return cls.from_groups([g for r in results for g in r.groups], mask_offpolicy=mask_offpolicy,
                               lease_ids=[r.lease_id for r in results if r.lease_id])

    @functools.cached_property
    def token_weight_version(self) -> np.ndarray:
        """int64 [T]: the weight version each token was generated with (computed when first read: 8 bytes per
        token, more than the three token columns together, which a trainer that does not read it never pays)."""
        versions = _token_versions(numpy(), self.trajectories, self.seqlens, self.end_weight_version)
        versions.flags.writeable = False
        return versions

    def offpolicy_mask(self) -> np.ndarray:
        """int32 [T]: 1 on tokens generated with their trajectory's last weight version, 0 on older ones."""
        np = numpy()
        return _on_last_version(np, self.token_weight_version, self.seqlens, self.end_weight_version)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seqlens(self) -> np.ndarray:
        """Tokens of each trajectory [B]."""
        return numpy().diff(self.cu_seqlens)

    @property
    def groups(self) -> list[GroupView]:
        """One view per prompt group, in batch order."""
        views, start = [], 0
        for position, group in enumerate(self.source_groups):
            stop = start + len(group.trajectories)
            views.append(GroupView(self, position, group.prompt_id, group.seq, group.ds_index, group.epoch,
                                   group.index, start, stop))
            start = stop
        return views

    def to_padded(self, side: Literal["right", "left"] = "right", *, pad_token_id: int = 0,
                  length: int | None = None) -> PaddedBatch:
        """[B, L] matrices, L = the longest trajectory (or `length`, which must not be shorter).

        side="right" puts each trajectory's tokens first (training); side="left" puts them last (so
        generation continues at the same column for every row). One scatter per column, no per-row loop.
        """
        if side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left', not {side!r}")
        np = numpy()
        seqlens = self.seqlens
        longest = int(seqlens.max()) if len(seqlens) else 0
        width = longest if length is None else int(length)
        if width < longest:
            raise ValueError(f"length {width} is shorter than the longest trajectory ({longest} tokens)")
        rows = np.repeat(np.arange(len(seqlens)), seqlens)
        columns = np.arange(self.num_tokens) - np.repeat(self.cu_seqlens[:-1], seqlens)
        if side == "left":
            columns += (width - seqlens)[rows]
        shape = (len(seqlens), width)

        def scatter(flat: np.ndarray, pad: Any) -> np.ndarray:
            out = np.full(shape, pad, dtype=flat.dtype)
            out[rows, columns] = flat
            return out

        attention = np.zeros(shape, dtype=bool)
        attention[rows, columns] = True
        return PaddedBatch(scatter(self.token_ids, pad_token_id), scatter(self.logprobs, 0.0),
                           scatter(self.loss_mask, 0), attention, side)

    def to_torch(self) -> dict[str, Any]:
        """The flat columns and per-trajectory arrays as torch tensors (needs torch; see arrays.to_torch),
        sharing the batch's memory where DLPack allows: the batch owns those arrays (packing copied them
        out of the received bytes), so a tensor written to changes only this batch."""
        from .arrays import to_torch

        names = ("token_ids", "logprobs", "loss_mask", "cu_seqlens", "reward", "group_index", "status",
                 "start_weight_version", "end_weight_version", "token_weight_version")
        return {name: to_torch(getattr(self, name), share_read_only=True) for name in names}


def _token_versions(np: Any, trajectories: Sequence[Trajectory], lengths: Any, end_versions: Any) -> Any:
    """The weight version of every token, from each trajectory's segments (its end version without them,
    or when they do not cover its tokens): one pass writes every trajectory's end version, then the
    trajectories with segments get theirs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    versions = np.repeat(np.asarray(end_versions, dtype=np.int64), lengths)
    start = 0
    for trajectory, length in zip(trajectories, lengths.tolist()):
        if len(trajectory.segment_lengths):
            segment_lengths = np.asarray(trajectory.segment_lengths, dtype=np.int64)
            if int(segment_lengths.sum()) == length:
                versions[start:start + length] = np.repeat(
                    np.asarray(trajectory.segment_weight_versions, dtype=np.int64), segment_lengths)
        start += length
    return versions


def _on_last_version(np: Any, versions: Any, lengths: Any, end_versions: Any) -> Any:
    return (versions == np.repeat(np.asarray(end_versions, dtype=np.int64), lengths)).astype(np.int32)


def _packed(np: Any, name: str, trajectories: Sequence[Trajectory], lengths: Any, fill: Any) -> Any:
    dtype = np.dtype(dtype_of(name))
    parts = []
    for trajectory, length in zip(trajectories, lengths):
        values = getattr(trajectory, name)
        if len(values) == length:
            parts.append(np.asarray(values, dtype=dtype))
        elif length:  # absent in this trajectory: filled so the columns stay aligned
            parts.append(np.full(int(length), fill, dtype=dtype))
    total = sum(len(part) for part in parts)
    if not total:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts, out=_fresh_column(np, total, dtype))


def _fresh_column(np: Any, length: int, dtype: Any) -> Any:
    """An empty column in an anonymous mapping of its own, given back to `COLUMN_MAPPINGS` when the array
    (and every view of it) goes. NumPy would ask the kernel for transparent huge pages for an array this large,
    and with the usual `defrag=madvise` the kernel compacts memory to find them while the column is first
    written: packing stalled now and then for up to ~130 ms instead of ~20 (bench/payload_path.py)."""
    nbytes = length * dtype.itemsize
    if nbytes < _OWN_MAPPING_BYTES or not _LINUX:
        return np.empty(length, dtype=dtype)
    mapping = COLUMN_MAPPINGS.take(nbytes)
    column = np.frombuffer(mapping, dtype=dtype, count=length)
    weakref.finalize(column, COLUMN_MAPPINGS.give_back, mapping).atexit = False
    return column


class ColumnMappings:
    """The mappings of packed columns whose arrays are gone, kept for the next mini-batch's columns: a new
    mapping costs its pages zeroed and charged by the kernel (MAP_POPULATE), about two thirds of packing a
    column, while a kept one is only written over (`bench/payload_path.py`). It keeps at most as many as were
    in use at once at the most (`peak`; a step's mini-batches that a trainer holds together), so the memory kept
    idle never exceeds what the trainer itself held; `clear()` lets them go. A mapping is reused for a column of
    at least half its size. Safe from any thread: the finalizers that give mappings back run wherever the last
    view of a column goes."""

    def __init__(self) -> None:
        self._free: collections.deque[mmap.mmap] = collections.deque()
        self._lock = threading.Lock()  # the counts only (nothing allocated under it: a finalizer may run anywhere)
        self.in_use = 0  # mappings whose column is alive
        self.peak = 0  # the most in use at once since the last clear()

    def take(self, nbytes: int) -> mmap.mmap:
        """A kept mapping of `nbytes` to twice that (the smallest), else a new one of `nbytes`."""
        with self._lock:
            self.in_use += 1
            if self.in_use > self.peak:
                self.peak = self.in_use
        fits = [m for m in list(self._free) if nbytes <= len(m) <= 2 * nbytes]
        for mapping in sorted(fits, key=len):
            try:
                self._free.remove(mapping)  # another thread may have taken it meanwhile
            except ValueError:
                continue
            if _unviewed(mapping):
                return mapping
        return mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)

    def give_back(self, mapping: mmap.mmap) -> None:
        with self._lock:
            self.in_use -= 1
        self._free.append(mapping)
        while len(self._free) > self.peak:
            try:
                self._free.popleft()  # the oldest goes: unmapped once nothing refers to it
            except IndexError:
                break

    def kept_bytes(self) -> int:
        return sum(len(m) for m in list(self._free))

    def clear(self) -> None:
        """Lets every kept mapping go (unmapped at once: nothing else refers to them) and starts counting anew."""
        with self._lock:
            self.peak = self.in_use
        self._free.clear()


def _unviewed(mapping: mmap.mmap) -> bool:
    """Whether nothing views the mapping any more (a resize to its own size refuses while a buffer is exported):
    a column's finalizer gives it back when the column goes, but an array made from its `.base` would outlive it."""
    try:
        mapping.resize(len(mapping))
    except Exception:  # BufferError: still viewed; anything else (a Python that cannot resize it): not provably free
        return False
    return True


# MAP_POPULATE: the kernel supplies every page in the one call, instead of one fault per page as it is written.
# Transparent huge pages are Linux's: elsewhere columns come from NumPy as usual.
_LINUX = sys.platform.startswith("linux")
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE if _LINUX else 0
# Smaller columns come from the allocator as usual (NumPy asks for huge pages only from 4 MiB on).
_OWN_MAPPING_BYTES = 4 * 2**20
COLUMN_MAPPINGS = ColumnMappings()


def group_count(group_sizes: Sequence[int], mini_batch_size: int) -> int:
    """Groups per mini-batch: mini_batch_size over the server's group size (one size across data sources)."""
    sizes = set(group_sizes)
    if len(sizes) != 1:
        raise ValueError(f"the server's data sources have different group sizes ({list(group_sizes)}): "
                         "pass group_size")
    return _groups_per_batch(mini_batch_size, sizes.pop())


def check_reachable(state: PacerState, num_groups: int, mini_batch_size: int) -> None:
    """ValueError when a mini-batch needs more groups buffered at once than the server can ever hold
    (GetState's collect_limit): its Collects would wait forever, and the server refuses them."""
    limit = state.collect_limit
    if limit and num_groups > limit:
        summary = state.config_summary
        raise ValueError(
            f"mini_batch_size {mini_batch_size} needs {num_groups} groups buffered at once, but the server can "
            f"never hold more than {limit}: its window is C = int(B * (1 + stale_steps)) = "
            f"int({summary.get('num_prompts_per_step')} * (1 + {summary.get('stale_steps')})) = {state.window_size} "
            f"groups (N = {summary.get('num_trajectories_per_prompt')}; a lower server.max_buffered_groups caps it "
            f"too); use a mini_batch_size of at most {limit} groups' trajectories, or widen the window")


def check_group_size(state: PacerState, group_size: int | None) -> None:
    """ValueError when `group_size` is given and is none of the server's group sizes: every mini-batch would hold
    mini_batch_size / group_size of the server's groups, another number of trajectories than asked for."""
    sizes = sorted(set(getattr(state, "group_sizes", None) or ()))
    if group_size is not None and sizes and group_size not in sizes:
        raise ValueError(f"group_size {group_size} is not the server's group size (its data sources' "
                         f"num_trajectories_per_prompt: {', '.join(map(str, sizes))}): a mini-batch would hold "
                         f"mini_batch_size / {group_size} of its groups, not mini_batch_size trajectories; omit "
                         f"group_size to take the server's")


def _groups_per_batch(mini_batch_size: int, group_size: int) -> int:
    if group_size <= 0 or mini_batch_size <= 0 or mini_batch_size % group_size:
        raise ValueError(f"mini_batch_size ({mini_batch_size}) must be a positive multiple of the group size "
                         f"({group_size}): a mini-batch holds whole prompt groups")
    return mini_batch_size // group_size


STEP = "step"  # num_batches="step": one training step's mini-batches, B * N / M, as the server is configured


def step_batches(mini_batch_size: int | None, state: Any, token_budget: int | None = None) -> int:
    """Mini-batches of one training step: B * N / mini_batch_size, from the server's typed settings (GetState
    prompts_per_step and group_sizes; the config summary's strings for a server older than them)."""
    if mini_batch_size is None or token_budget is not None:
        raise ValueError("num_batches='step' needs mini_batch_size (trajectories per global mini-batch) and no "
                         "token_budget: a step's mini-batches cut by tokens cannot be counted in advance; pass "
                         "num_batches")
    summary = state.config_summary
    prompts = int(getattr(state, "prompts_per_step", 0) or summary.get("num_prompts_per_step", 0))
    sizes = set(getattr(state, "group_sizes", None) or
                (int(s) for s in summary.get("num_trajectories_per_prompt", "").split(",") if s))
    if len(sizes) != 1 or not prompts:
        raise ValueError(f"num_batches='step' needs one group size and a step size from the server (group sizes "
                         f"{sorted(sizes)}, {prompts} prompts per step); pass num_batches")
    trajectories = prompts * sizes.pop()
    if trajectories % mini_batch_size:
        raise ValueError(f"num_batches='step': a step's B * N = {trajectories} trajectories "
                         f"(data_source.num_prompts_per_step x num_trajectories_per_prompt) is not a multiple of "
                         f"mini_batch_size {mini_batch_size}; pass num_batches")
    return trajectories // mini_batch_size


@dataclass(frozen=True)
class BatchShape:
    """What one Collect of the iterator asks for: `num_groups` groups (with a token budget, at most that many;
    0: the server's limit), cut by `token_budget` tokens when > 0, and for one rank of a data-parallel
    trainer (`world_size` > 1) that rank's share of the global mini-batch."""

    num_groups: int
    token_budget: int = 0
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, mini_batch_size: int | None, group_size: int | None, server_group_sizes: Any, *,
           token_budget: int | None, rank: int, world_size: int) -> BatchShape:
        """Checks the trainer's arguments; `server_group_sizes` (a callable giving GetState's group_sizes) is
        called only when the group size must be asked from the server."""
        world_size, rank = _as_integer(world_size), _as_integer(rank)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, not {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in 0..{world_size - 1} (world_size {world_size}), not {rank!r}")
        token_budget = _as_integer(token_budget)
        if token_budget is not None and (not isinstance(token_budget, int) or token_budget <= 0):
            raise ValueError(f"token_budget must be a positive number of tokens or None, not {token_budget!r}")
        mini_batch_size, group_size = _as_integer(mini_batch_size), _as_integer(group_size)
        for name, value in (("mini_batch_size", mini_batch_size), ("group_size", group_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer number of trajectories, not {value!r}")
        if mini_batch_size is None:
            if token_budget is None:
                raise ValueError("pass mini_batch_size (trajectories per global mini-batch) or token_budget")
            return cls(0, token_budget, rank, world_size)
        num_groups = (_groups_per_batch(mini_batch_size, group_size) if group_size is not None
                      else group_count(server_group_sizes(), mini_batch_size))
        if token_budget is None and num_groups % world_size:
            raise ValueError(f"mini_batch_size {mini_batch_size} holds {num_groups} groups, which world_size "
                             f"{world_size} does not divide: every rank gets as many whole groups (or pass "
                             f"token_budget, whose shares are balanced by tokens alone)")
        if num_groups < world_size:
            raise ValueError(f"mini_batch_size {mini_batch_size} holds {num_groups} groups, fewer than world_size "
                             f"{world_size}: every rank gets at least one whole group")
        return cls(num_groups, token_budget or 0, rank, world_size)


def _as_integer(value: Any) -> Any:
    """An integer as a Python int (NumPy's integers, a torch rank, ...); anything else, a bool or a float among them,
    as it is, for the caller's check to refuse by name."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return value
    return operator.index(value)


def default_trainer_id(shape: BatchShape) -> str:
    """The client id a trainer's client without one takes: its rank when it has one, its process, a random part."""
    rank = f"rank{shape.rank}-" if shape.world_size > 1 else ""
    return f"trainer-{rank}{os.getpid()}-{uuid.uuid4().hex[:6]}"


# Control events that say whether dispatch is paused.
_PAUSE_STATE_EVENTS = (ControlEventType.STATE, ControlEventType.PAUSE, ControlEventType.RESUME)

# What a server older than heartbeats answers a KeepAlive naming no group (or no KeepAlive at all).
_NO_HEARTBEATS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)


def _lease_ids(batch: MiniBatch | None) -> tuple[str, ...]:
    return () if batch is None else batch.lease_ids


def _reopened_watch(client: Any) -> Any:
    """The client's control stream opened again, or None when the client was closed under the iterator: there is
    nothing left to follow, and the iterator's own calls say that the client is closed."""
    try:
        return client.watch()
    except RuntimeError as exc:
        log.info("batches: control stream not reopened: %s", exc)
        return None


class _BatchWait:
    """The wait for one mini-batch: says why it takes long, once the caller has waited for it STALL_WARNING_SECONDS
    (not while it trains on the batch before and the next is fetched meanwhile) and then every STALL_REPEAT_SECONDS,
    and when the batch came after such a warning."""

    def __init__(self, what: str, target: str) -> None:
        self.what = what  # "mini-batch of 8 groups", "share for rank 1 of 2 of a mini-batch of 8 groups"
        self.target = target
        self.began = _stall_clock()
        self.next_report = 0.0
        self.reported_at: float | None = None  # when the caller began waiting, once a warning said so

    @staticmethod
    def _after(paused: bool) -> float:
        return min(PAUSED_WARNING_SECONDS, STALL_WARNING_SECONDS) if paused else STALL_WARNING_SECONDS

    def due(self, asked_at: float | None, paused: bool = False) -> bool:
        """Whether to ask the server's state and report it now; `asked_at`: when the caller asked for the batch
        (None: it has not yet); `paused`: the control stream last said dispatch is paused."""
        now = _stall_clock()
        return (asked_at is not None and now - max(self.began, asked_at) >= self._after(paused)
                and now >= self.next_report)

    def poll(self, poll: float, asked_at: float | None, paused: bool = False) -> float:
        """The next Collect's wait: `poll`, cut to end when a warning falls due, since due() is asked after each
        Collect (a whole poll waited past that moment said the paused warning after up to 10 s, not 5). Before the
        caller asks, at most the soonest warning's delay: the caller may ask, dispatch pause, while it waits."""
        if asked_at is None:
            return min(poll, PAUSED_WARNING_SECONDS, STALL_WARNING_SECONDS)
        falls_due = max(max(self.began, asked_at) + self._after(paused), self.next_report)
        return min(poll, max(0.0, falls_due - _stall_clock()))

    def report(self, state: PacerState | Exception, asked_at: float) -> None:
        since = max(self.began, asked_at)
        self.next_report = _stall_clock() + STALL_REPEAT_SECONDS
        self.reported_at = since
        log.warning("batches: no %s for %.0f s from the pacer at %s: %s", self.what, _stall_clock() - since,
                    self.target, self.why(state))

    @staticmethod
    def why(state: PacerState | Exception) -> str:
        if isinstance(state, Exception):
            return f"its state could not be read ({state})"
        if state.paused:
            return (f"dispatch is paused (step {state.step}): a Reset without its Resume. The trainer resumes with "
                    "resume(weight_version) once the weights are synced; one that resets and then waits for a batch "
                    "before resuming waits on itself")
        if state.running == 0:
            return (f"no group is running and {state.buffered} are buffered: no rollout worker is dispatching (are "
                    "the workers running, and pointed at this address? coda-client workers lists them)")
        return (f"{state.running} groups are running on the workers and {state.buffered} are buffered (window "
                f"{state.window_size}): the workers are slower than the trainer, or one holds its groups without "
                "submitting (coda-client workers lists what each holds)")

    def done(self) -> None:
        if self.reported_at is not None:
            log.info("batches: the %s came after %.0f s", self.what, _stall_clock() - self.reported_at)


def check_reconnect(reconnect: float) -> float:
    """`reconnect` as a float, or ValueError: a bound of seconds >= 0 (NaN would never end a wait)."""
    if not reconnect >= 0:
        raise ValueError(f"reconnect must be >= 0 seconds, not {reconnect}")
    return float(reconnect)


class _StartWait:
    """GetState asked as an iterator starts (its group size, the step's batches, the window) through an outage: a
    server away (restarting at a step boundary) is asked again, as the running iterator's calls are, for up to
    `reconnect` seconds, said once as the outage begins and once as it ends; then ServerGoneError."""

    def __init__(self, target: str, reconnect: float, trouble: Callable[[str], Any] | None = None) -> None:
        self.target = target
        self.reconnect = check_reconnect(reconnect)
        # The client's reading of a connection error (its _connection_trouble): a settled one is no outage.
        self.trouble = trouble
        self.deadline: float | None = None
        self.delay = _AWAY_RETRY_INITIAL_SECONDS
        self.outage = OutageLog(
            log, began=f"batches: the pacer at {target} did not answer as the iterator started ({{reason}}); asking "
                       f"again for up to reconnect={self.reconnect:g} s",
            attempt=f"batches: the pacer at {target} still away as the iterator starts ({{reason}})",
            back=f"batches: the pacer at {target} answered after {{seconds}} s; the iterator starts")

    def pause(self, exc: PacerClientError) -> float | None:
        """Seconds to wait before asking again after `exc`; None when `exc` is no outage (the caller raises it).
        ServerGoneError once `reconnect` has passed since the first failure."""
        if not _server_away(exc.code) or self._settled(exc):
            return None
        now = time.monotonic()
        self.deadline = now + self.reconnect if self.deadline is None else self.deadline
        if now >= self.deadline:
            raise ServerGoneError(f"batches(): the pacer at {self.target} could not be reached as the iterator "
                                  f"started and no server answered within reconnect={self.reconnect:g} s; nothing "
                                  f"was collected (last error: {exc})") from exc
        self.outage.failed(exc)
        pause, self.delay = min(self.delay, self.deadline - now), min(self.delay * 2, _AWAY_RETRY_MAX_SECONDS)
        return pause

    def _settled(self, exc: PacerClientError) -> bool:
        """Whether `exc` says what waiting does not cure (no gRPC server at the address, a TLS misconfiguration):
        said at once, as the iterator has never reached a pacer there, rather than asked again for `reconnect`."""
        if self.trouble is None or exc.code != grpc.StatusCode.UNAVAILABLE or exc.reason:
            return False
        found = self.trouble(exc.details)
        return bool(getattr(found, "settled", False))

    def answered(self) -> None:
        self.outage.answered()


def starting_state(client: PacerClient, reconnect: float) -> PacerState:
    """The server's state for a blocking iterator about to start, through an outage of up to `reconnect` seconds
    (_StartWait): entering batches() while the server restarts waits for it as the iterator's own calls do."""
    start = _StartWait(client.target, reconnect, getattr(client, "_connection_trouble", None))
    while True:
        try:
            state = client.state()
        except PacerClientError as exc:
            pause = start.pause(exc)
            if pause is None:
                raise
            time.sleep(pause)
            continue
        start.answered()
        return state


class _IteratorBase:
    """Configuration and bookkeeping shared by the blocking and the async iterator."""

    def __init__(self, client: Any, shape: BatchShape | int, *, lease: float, poll: float,
                 num_batches: int | str | None, mask_offpolicy: bool = False, step: int | None = None,
                 reconnect: float = DEFAULT_RECONNECT_SECONDS, run: str = "") -> None:
        if lease <= 0:
            raise ValueError(f"lease must be > 0 seconds (the batches are leased until acknowledged), not {lease}")
        if poll <= 0:
            raise ValueError(f"poll must be > 0 seconds, not {poll}")
        num_batches = _as_integer(num_batches)
        if num_batches is not None and num_batches != STEP and not (isinstance(num_batches, int) and num_batches >= 0):
            raise ValueError(f"num_batches must be an integer >= 0, {STEP!r} (one training step) or None, "
                             f"not {num_batches!r}")
        reconnect = check_reconnect(reconnect)
        numpy()
        self._client = client
        self.shape = shape if isinstance(shape, BatchShape) else BatchShape(shape)
        if not isinstance(run, str):
            raise ValueError(f"run must be a str naming the ranks' launch (the same on every rank), not {run!r}")
        if run and self.shape.world_size == 1:
            raise ValueError("run names a launch of data-parallel ranks: it goes with world_size > 1 (a single "
                             "trainer has no other ranks to start in step with)")
        self.run = run  # CollectRequest.run of every Collect ("": none)
        self.lease = float(lease)
        self.poll = float(poll)
        self.num_batches = num_batches  # "step" until the async iterator has asked the server
        self.mask_offpolicy = mask_offpolicy
        self.step = step  # the trainer's step, stated with every Collect (None: not stated)
        self.delivered = 0  # batches handed to the caller
        self.acknowledged = 0  # batches acknowledged
        # Prefetched batches not handed out because their lease ended while this trainer was silent (stopped, cut
        # off) and their groups went to another trainer or rank meanwhile: trained there, not here.
        self.superseded = 0
        self.reconnect = float(reconnect)  # seconds calls wait for an away server to answer again
        self._asked_at: float | None = None  # when the caller asked for the batch it waits for now (None: it does not)
        self._paused = False  # what the control stream last said: dispatch is paused (a Reset without its Resume)
        self._over_budget_said = False  # a group over token_budget was warned of (_note_group_over_budget)
        # The control stream's outages, logged once each (a dead server would otherwise log a line every two
        # seconds until `reconnect` runs out).
        self._outage = OutageLog(
            log, began=f"batches: the control stream of the pacer at {client.target} ended ({{reason}}); "
                       f"reconnecting, and calls wait up to reconnect={self.reconnect:g} s for a server to answer",
            attempt="batches: control stream still away ({reason}); reconnecting",
            back=f"batches: control stream of the pacer at {client.target} back after {{seconds}} s")
        # Calls the server refuses for now while it is up (UNAVAILABLE with a reason: its state directory cannot be
        # written, it is recovering): asked again as for an outage, and said once each time it begins and ends.
        self._refusals = OutageLog(
            log, began=f"batches: the pacer at {client.target} refuses calls for now ({{reason}}); asking again for "
                       f"up to reconnect={self.reconnect:g} s",
            attempt="batches: the pacer still refuses calls ({reason})",
            back=f"batches: the pacer at {client.target} takes calls again after {{seconds}} s")
        self.server_shut_down = False  # the server announced SHUTDOWN and no server answered again in time
        # The trainer ended the job (JOB_ENDED): once a Collect finds too few groups, nothing more will come and
        # the iteration ends instead of polling for ever.
        self.job_ended = False
        self._current: MiniBatch | None = None
        self._closed = False
        # Collects go through CollectStream until a server older than it says it has none (then Collect).
        self._streamed = True
        # Once the heartbeats run, the leases end when they stop too (release_when_silent).
        self._release_when_silent = False
        self._beat_seconds = _FIRST_BEAT_RETRY_SECONDS
        # Heartbeats end at close(), or later while a batch is in hand or an acknowledgement is under way (through a
        # server restart it may take a while, and the lease must stay this trainer's meanwhile).
        self._beats_end = threading.Event()
        self._acks_pending = 0  # acknowledgements under way (`_ack_begins`, `_ack_ends`)
        # Set to send a heartbeat at once (`_beat_per_lease`): a lease just taken is named to the server within
        # milliseconds, so that a process killed right after it arrived has it back within the grace under a client
        # id shared with another.
        self._beat_now = threading.Event()
        # Whether each lease taken is named by a heartbeat at once: under a client id the caller chose (the iterator's
        # own default is unique, so never shared), when the server does not count the lease named at its grant.
        self._beat_per_lease = False
        # Whether each Collect asks the server to count its lease named at its grant (CollectRequest.named_at_grant):
        # only when its answers are read on a thread of their own, as they arrive (the blocking iterator's); an async
        # trainer's may wait unread while a step blocks its event loop, and are named by a heartbeat once read.
        self._named_at_grant = False
        self._handed_at = 0.0  # when the batch in hand was handed out (time.monotonic())
        self._heartbeat: threading.Thread | None = None
        # The leases taken and not yet acknowledged or given back, oldest first: each heartbeat and Collect names them,
        # so that those the server ended while this trainer was silent (stopped, cut off) come back to it, and so that
        # another process under the same client id does not keep them alive. Each with when the server last
        # confirmed it: the latest answered heartbeat naming it (or the Collect that took it) was sent then.
        self._held_leases: dict[str, float] = {}
        self._held_lock = threading.Lock()  # the heartbeat thread confirms them while the caller's thread lets go
        # What the heartbeats tell of the server: its liveness grace (0: off; None: no heartbeat answered yet), and
        # which held leases it says are not live any more.
        self._grace: float | None = None
        self._ended_leases: set[str] = set()

    @property
    def num_groups(self) -> int:
        """Groups of each global mini-batch (with a token budget: at most; 0 is the server's limit)."""
        return self.shape.num_groups

    def _collect_call(self, num_groups: int | None = None, wait: float | None = None) -> _calls.Call[CollectResult]:
        """A leased Collect of the batch (or of `num_groups`, the rest of one), cut by the server to fit the client;
        through CollectStream, whose messages of a few MiB arrive faster than one large answer. `wait`: its wait
        (None: `poll`)."""
        shape = self.shape
        call = _calls.collect(shape.num_groups if num_groups is None else num_groups,
                              wait=self.poll if wait is None else wait,
                              allow_partial=False, request_id=None, timeout=self._client.timeout, lease=self.lease,
                              arrays="numpy", rank=shape.rank, world_size=shape.world_size,
                              token_budget=shape.token_budget, trainer_step=self.step,
                              max_response_bytes=self._client.max_receive_bytes, streamed=self._streamed,
                              release_when_silent=self._release_when_silent, held_lease_ids=list(self._held_leases),
                              named_at_grant=self._named_at_grant)
        if self.run:  # a rank's Collect (world_size > 1): the launch it belongs to
            call.request.run = self.run
        return call

    def _start_heartbeats(self, twin: bool) -> None:
        """Names the client (trainer-...) if it has no id, before its first call, then heartbeats on a thread of its
        own; with `twin`, through a blocking twin of the client (the async iterator's: a training step that blocks
        its event loop must not stop them); without it, each Collect's lease counts as named at its grant."""
        self._named_at_grant = not twin
        self._beat_per_lease = twin and self._client.client_id is not None
        self._client.adopt_client_id(default_trainer_id(self.shape))
        self._release_when_silent = True
        client = self._client.blocking_twin() if twin else self._client
        self._heartbeat = threading.Thread(target=self._heartbeats, args=(client,), name="coda-batches-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _heartbeats(self, client: Any) -> None:
        """Tells the server this trainer is alive every third of its liveness grace until close() (and, after it,
        until the batch in hand is acknowledged or given back, or its lease has run out): a trainer that dies (kill
        -9, a lost node) has its batches delivered again within that grace, not its lease. One goes at once as each
        lease arrives too (`_beat_now`)."""
        try:
            wait = 0.0
            while True:
                self._beat_now.wait(wait)
                self._beat_now.clear()
                if self._beats_end.is_set():
                    return
                if self._closed and time.monotonic() > self._handed_at + self.lease:
                    return  # closed, and the lease of the batch in hand has run out: nothing left to keep
                sent, named = time.monotonic(), list(self._held_leases)
                try:
                    answer = client._run(self._heartbeat_call(named))
                except PacerClientError as exc:
                    answer = exc
                except Exception:  # noqa: BLE001 - the client was closed under the iterator: nothing more to keep
                    return
                next_wait = self._next_beat(answer, sent, named)
                if next_wait is None:
                    return
                wait = next_wait
        finally:
            if client is not self._client:
                client.close()

    def _in_hand(self, batch: MiniBatch | None) -> None:
        """The batch now in hand (None: acknowledged or given back)."""
        self._current = batch
        if batch is not None:
            self._handed_at = time.monotonic()
        self._end_beats_when_done()

    def _end_beats_when_done(self) -> None:
        """The heartbeats end once the iterator is closed with no batch in hand (ack() may still come for one) and no
        acknowledgement under way."""
        if self._closed and self._current is None and not self._acks_pending:
            self._beats_end.set()
            self._beat_now.set()

    def _ack_begins(self) -> None:
        """An acknowledgement is under way: the heartbeats go on until it ends."""
        with self._held_lock:
            self._acks_pending += 1

    def _ack_ends(self) -> None:
        with self._held_lock:
            self._acks_pending -= 1
        self._end_beats_when_done()

    def _heartbeat_call(self, lease_ids: Sequence[str]) -> _calls.Call[Any]:
        """A KeepAlive naming no group, and the leases this trainer holds: it is alive, so the server keeps them
        (release_when_silent), or gives back those it ended while the trainer was silent."""
        return _calls.keep_alive([], timeout=min(self._client.timeout, max(self._beat_seconds, 1.0)),
                                 lease_ids=lease_ids)

    def _next_beat(self, answer: Any, sent: float, named: Sequence[str]) -> float | None:
        """Seconds until the next heartbeat after this answer (a KeepAliveResult or the call's error) to the one
        `sent` then naming the leases `named`; None: no more (the server's liveness is off, or the server is older
        than heartbeats: its leases end by time alone)."""
        if isinstance(answer, Exception):
            if getattr(answer, "code", None) in _NO_HEARTBEATS:
                self._grace = 0.0  # no liveness to ask about
                log.info("batches: the server at %s takes no heartbeat (it is older than this client); a batch of a "
                         "trainer that dies returns when its lease runs out (lease=%g s)", self._client.target,
                         self.lease)
                return None
            return self._beat_seconds  # away or busy: the next beat tries again
        self._heard(answer, sent, named)
        if not answer.liveness_seconds:
            return None
        self._beat_seconds = answer.liveness_seconds / 3
        return self._beat_seconds

    def _heard(self, answer: KeepAliveResult, sent: float, named: Sequence[str]) -> None:
        """A heartbeat sent at `sent` naming the leases `named` was answered: those still live are confirmed as of
        then; those it says are not live any more are not held (nothing to name again, nothing to Ack)."""
        self._grace = answer.liveness_seconds
        ended = set(answer.ended_lease_ids)
        held = self._held_leases
        with self._held_lock:
            for lease_id in named:
                if lease_id not in held:
                    continue  # acknowledged or given back meanwhile
                if lease_id in ended:
                    self._ended_leases.add(lease_id)
                    del held[lease_id]
                elif held[lease_id] < sent:
                    held[lease_id] = sent

    def _note_event(self, event: ControlEvent) -> None:
        """What a control event says of the job, whichever iterator follows the stream: ended, dispatch paused."""
        self.job_ended = self.job_ended or bool(getattr(event, "job_ended", False))
        if event.type in _PAUSE_STATE_EVENTS:
            self._paused = bool(event.paused)

    def _not_confirmed(self, exc: Exception) -> None:
        """The heartbeat asking whether a prefetched batch is still this trainer's failed: the batch is handed out."""
        if getattr(exc, "code", None) in _NO_HEARTBEATS:
            self._grace = 0.0  # a server older than heartbeats: its leases end by time alone
            return
        log.warning("batches: could not ask the server whether the prefetched batch is still this trainer's after a "
                    "silence (%s); handing it out", exc)

    def _may_have_lapsed(self, batch: MiniBatch) -> bool:
        """Whether the server may have ended a lease of `batch` since it last confirmed it: more than half its grace
        ago (heartbeats go every third of it), e.g. the process was stopped or its network cut meanwhile; or the grace
        is not known yet, no heartbeat having been answered (the process stopped before the first answer came)."""
        if self._heartbeat is None or self._grace == 0.0:
            return False  # no heartbeats, or the server's liveness is off: leases end by time alone
        if self._grace is None:
            return True
        now, held = time.monotonic(), self._held_leases
        return any(now - held.get(lease_id, 0.0) > self._grace / 2 for lease_id in batch.lease_ids)

    def _superseded(self, batch: MiniBatch) -> list[str] | None:
        """None when this prefetched batch is the trainer's to train; otherwise a lease of it ended while the trainer
        was silent and its groups went to another trainer or rank, which trains them: the batch is not handed out,
        and the ids of its other leases, still live, are returned, to give back."""
        ended = [lease_id for lease_id in batch.lease_ids if lease_id in self._ended_leases]
        if not ended:
            return None
        live = [lease_id for lease_id in batch.lease_ids if lease_id not in ended and lease_id in self._held_leases]
        self._let_go(batch.lease_ids)
        self.superseded += 1
        log.warning("batches: a prefetched batch (lease %s) is not handed out: this trainer was silent past the "
                    "server's liveness grace (stopped or cut off) and its groups went to another trainer or rank "
                    "meanwhile, which trains them; collecting the next batch", ", ".join(ended))
        return live

    def _without_stream(self, exc: Exception) -> bool:
        """Whether a failed Collect says the server has no CollectStream (it is older than this client): then
        plain batches come through Collect from now on (True). A rank's share or a token budget is refused
        instead: such a server may not know them, and would silently hand each rank the whole mini-batch."""
        if not self._streamed or getattr(exc, "code", None) != grpc.StatusCode.UNIMPLEMENTED:
            return False
        if self.shape.world_size > 1 or self.shape.token_budget:
            raise PacerClientError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"the server at {self._client.target} has no CollectStream: it is older than this client, and may not "
                "know rank shares (rank, world_size) or token budgets either, which it would ignore; upgrade the "
                "server (a plain batches(mini_batch_size) works with it, through Collect)") from exc
        log.warning("batches: the server at %s has no CollectStream (older than this client); collecting through "
                    "Collect, which receives large batches more slowly", self._client.target)
        self._streamed = False
        return True

    def _took(self, result: CollectResult, sent: float) -> None:
        """The answer of a Collect `sent` then arrived: its lease is held until acknowledged or given back."""
        if result.lease_id:
            with self._held_lock:
                self._held_leases[result.lease_id] = sent
            if self._beat_per_lease:
                self._beat_now.set()  # named to the server at once (`_heartbeats`)
        self._note_other_shapes(result)
        budget = self.shape.token_budget
        if budget and len(result.groups) == 1 and not self._over_budget_said:
            self._note_group_over_budget(result.groups[0], budget)

    def _note_group_over_budget(self, group: Any, budget: int) -> None:
        """Groups are never cut: a group with more tokens than `token_budget` comes as a mini-batch of its own, over
        the budget. Said once per iterator (a budget below one group's tokens makes every batch so)."""
        tokens = sum(len(t.token_ids) for t in group.trajectories)
        if tokens > budget:
            self._over_budget_said = True
            log.warning("batches: group %r holds %d tokens, more than token_budget=%d: groups are never cut, so it "
                        "comes as a mini-batch of its own, over the budget (said once; a budget below one group's "
                        "tokens makes every mini-batch one group): set token_budget to several groups' worth",
                        group.prompt_id, tokens, budget)

    def _let_go(self, lease_ids: Sequence[str]) -> None:
        """These leases were acknowledged or given back: no longer held."""
        with self._held_lock:
            for lease_id in lease_ids:
                self._held_leases.pop(lease_id, None)
                self._ended_leases.discard(lease_id)

    def _note_other_shapes(self, result: CollectResult) -> None:
        """Warn when this rank's share came from a new global mini-batch while shares of another shape waited for
        their ranks: ranks passing different mini_batch_size / token_budget / world_size each train on shares of
        different mini-batches (a trainer restarted with another world size sees it too, for a lease's time)."""
        if result.other_shapes_waiting:
            log.warning("batches: rank %d of %d took a new global mini-batch while shares of another shape wait for "
                        "their ranks (%s): every rank of one trainer must pass the same mini_batch_size (or "
                        "token_budget) and world_size, or each trains on shares of different mini-batches; after a "
                        "restart with another world size, the old shares return to the buffer when their leases run "
                        "out", self.shape.rank, self.shape.world_size,
                        "; ".join(str(shape) for shape in result.other_shapes_waiting))

    def _rest(self, results: list[CollectResult]) -> int:
        """Groups still missing from a batch of `results` (0: complete). Only a plain batch is completed by
        further Collects: a token budget's or a rank's share is what the server cut it to."""
        if not results:  # a token budget with no cap on groups (num_groups 0) still needs its first Collect
            return self.shape.num_groups or 1
        if self.shape.world_size > 1 or self.shape.token_budget or not results[-1].cut_to_fit:
            return 0
        return self.shape.num_groups - sum(len(r.groups) for r in results)

    def _poll(self, wait: _BatchWait, job_ended: bool) -> float:
        """The next Collect's wait (_BatchWait.poll); a whole `poll` once the job ended: the groups still coming
        in have that long before an empty answer ends the iteration."""
        return self.poll if job_ended else wait.poll(self.poll, self._asked_at, self._paused)

    def _batch_wait(self) -> _BatchWait:
        shape = self.shape
        batch = (f"mini-batch of {shape.num_groups} groups" if not shape.token_budget
                 else f"mini-batch of up to {shape.token_budget} tokens")
        what = batch if shape.world_size == 1 else f"share for rank {shape.rank} of {shape.world_size} of a {batch}"
        return _BatchWait(what, self._client.target)

    def _wants_more(self) -> bool:
        return not self._closed and (self.num_batches is None or self.delivered < self.num_batches)

    def _prefetched(self) -> MiniBatch | None:
        """The batch prefetched and not handed out, if it has arrived: close() gives it back."""
        pending = self._pending
        if pending is None or not pending.done() or pending.cancelled() or pending.exception() is not None:
            return None
        return pending.result()

    def _release_calls(self, lease_ids: Sequence[str]) -> list[_calls.Call[int]]:
        """Release calls giving back these leases, of batches not trained on, bounded in time: close() waits for
        them."""
        timeout = min(self._client.timeout, _CLOSE_WAIT_SECONDS)
        self._let_go(lease_ids)  # not trained on: not to be claimed back, whether the Release arrives or not
        return [_calls.release(lease_id, request_id=None, timeout=timeout) for lease_id in lease_ids]

    def _give_back_through(self, client: PacerClient, lease_ids: Sequence[str]) -> int:
        """Gives back these leases (Release) through a blocking client; returns the groups given back."""
        groups = 0
        for call in self._release_calls(lease_ids):
            try:
                groups += client._run(call)
            except PacerClientError as exc:
                self._release_failed(call, exc)
                break  # the server is away or older: the others' leases run out alike
        return groups

    @property
    def _left_open(self) -> bool:
        """Whether the iterator started (its heartbeats run, it may hold leases) and was not closed."""
        return not self._closed and self._heartbeat is not None

    def _abandoned(self) -> None:
        """The iterator the trainer held was collected without close() (on a thread of its own, see
        _AbandonedIterators): its prefetch, control stream and heartbeats end, and every lease it holds is given back,
        to be delivered again at once rather than kept alive by heartbeats for the life of the process."""
        try:
            self._give_back_abandoned()
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise it to; the heartbeats end all the same
            self._closed = True
            self._in_hand(None)
            log.warning("batches: a batch iterator of the pacer at %s was abandoned without close() and collected; "
                        "its heartbeats stopped, but its leases could not be given back (%r): the server gives them "
                        "back after its liveness grace", self._client.target, exc)

    def _give_back_abandoned(self) -> None:
        raise NotImplementedError

    def _held_now(self) -> list[str]:
        with self._held_lock:
            return list(self._held_leases)

    def _report_abandoned(self, lease_ids: Sequence[str], groups: int) -> None:
        given = (f"its unacknowledged lease(s) {', '.join(lease_ids)} were given back ({groups} groups), to be "
                 "delivered again at once" if lease_ids else "it held no lease")
        log.warning("batches: a batch iterator of the pacer at %s was abandoned without close() (%d batches delivered, "
                    "%d acknowledged) and collected: its prefetch and heartbeats stopped, and %s; use `with "
                    "client.batches(...)` or call close()", self._client.target, self.delivered, self.acknowledged,
                    given)

    def _release_failed(self, call: _calls.Call[int], exc: Exception) -> None:
        log.warning("batches: lease %s could not be given back (%s); its groups return to the buffer when it runs out "
                    "(lease=%g s)", call.request.lease_id, exc, self.lease)

    def _gone(self, what: str, shut_down: bool) -> ServerGoneError:
        self.server_shut_down = shut_down
        cause = "announced SHUTDOWN" if shut_down else "could not be reached"
        return ServerGoneError(f"{what}: the server {cause} and no server answered on the address within "
                               f"reconnect={self.reconnect:g} s; {self.delivered} batches delivered, "
                               f"{self.acknowledged} acknowledged (an unacknowledged one is delivered again once "
                               f"its lease runs out on a server that kept it)")


class _Stopped(Exception):
    """A call was cut short because the iterator closed."""


class _Away(Exception):
    """A call found the server away (it announced SHUTDOWN, or did not answer): retried until it is back."""


class _BatchIteratorCore(_IteratorBase):
    """The work of a BatchIterator, shared by its threads (which hold this, never the BatchIterator)."""

    def __init__(self, client: PacerClient, shape: BatchShape | int, *, lease: float = DEFAULT_LEASE_SECONDS,
                 poll: float = DEFAULT_POLL_SECONDS, num_batches: int | str | None = None,
                 mask_offpolicy: bool = False, step: int | None = None,
                 reconnect: float = DEFAULT_RECONNECT_SECONDS, run: str = "") -> None:
        super().__init__(client, shape, lease=lease, poll=poll, num_batches=num_batches,
                         mask_offpolicy=mask_offpolicy, step=step, reconnect=reconnect, run=run)
        self._lock = threading.Lock()
        self._inflight: set[Any] = set()  # Collects in progress, cancelled by close() or a server shutdown
        self._acks_inflight: set[Any] = set()  # acknowledgements in progress, cancelled by a server shutdown
        self._shutdown = threading.Event()  # the server announced SHUTDOWN; no successor's STATE since
        self._present = threading.Event()  # the server answers (cleared while it is away)
        self._present.set()
        self._closing = threading.Event()
        self._watching = threading.Event()  # the control stream's first event arrived
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coda-batches")
        self._pending: concurrent.futures.Future[MiniBatch] | None = None
        # Acknowledgements go out on their own thread, so handing out the next batch does not wait for one.
        self._acker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coda-batches-ack")
        self._acking: concurrent.futures.Future[int] | None = None
        self._start_heartbeats(twin=False)
        self._watch = client.watch()
        self._watcher = threading.Thread(target=self._watch_events, name="coda-batches-watch", daemon=True)
        self._watcher.start()
        if self._wants_more():
            self._pending = self._executor.submit(self._prefetch)

    def wait_watching(self, timeout: float | None = None) -> bool:
        """Waits until the iterator follows the server's control stream (its first event arrived); True
        then, False on timeout. A server that shuts down before then cannot announce it to this iterator,
        whose calls then fail with the server's error instead of ending the iteration."""
        return self._watching.wait(timeout)

    def _watch_events(self) -> None:
        """Follows the control stream, reconnecting whenever it ends: SHUTDOWN marks the server away (calls in
        progress are cut and retried), the next server's STATE marks it back."""
        delay = _AWAY_RETRY_INITIAL_SECONDS
        while not self._closed:
            try:
                for event in self._watch:
                    self._watching.set()
                    self._outage.answered()
                    delay = _AWAY_RETRY_INITIAL_SECONDS
                    self._note_event(event)
                    if event.type == ControlEventType.SHUTDOWN:
                        self._present.clear()
                        self._shutdown.set()
                        self._cancel_inflight(self._acks_inflight)
                        self._cancel_inflight(self._inflight)
                    elif event.type == ControlEventType.STATE:
                        self._shutdown.clear()
                        self._present.set()
                if not self._closed:
                    self._outage.failed("the server ended it")
            except Exception as exc:  # noqa: BLE001 - a watch failure must not kill the trainer
                if not self._closed:  # closing cancels the stream: no outage
                    self._outage.failed(exc)
            if self._closing.wait(delay):
                return
            delay = min(delay * 2, _AWAY_RETRY_MAX_SECONDS)
            with self._lock:
                if self._closed:
                    return
                watch = _reopened_watch(self._client)
                if watch is None:
                    return
                self._watch = watch

    def _cancel_inflight(self, calls: set[Any]) -> None:
        with self._lock:
            inflight = list(calls)
        for future in inflight:
            future.cancel()

    def _call(self, call: _calls.Call[_T], *, survives_close: bool = False) -> _T:
        """Runs a call through a server restart: while the server is away (it announced SHUTDOWN, or does not
        answer) the call is cut short and sent again, with the same request id, once a server answers, for at
        most `reconnect` seconds (then ServerGoneError). close() cuts it short with _Stopped unless
        `survives_close`: acknowledgements survive close(), the caller trained on those batches."""
        deadline: float | None = None
        delay = _AWAY_RETRY_INITIAL_SECONDS
        while True:
            try:
                answer = self._call_once(call, survives_close)
                self._refusals.answered()
                return answer
            except _Away as away:
                if away.args:
                    self._refusals.failed(away.args[0])
                now = time.monotonic()
                deadline = now + self.reconnect if deadline is None else deadline
                if now >= deadline:
                    raise self._gone(call.method, self._shutdown.is_set()) from None
                # A successor's STATE ends the wait at once; a server that cannot be reached is tried again.
                self._present.wait(min(delay, deadline - now))
                if self._closed and not survives_close:
                    raise _Stopped from None
                delay = min(delay * 2, _AWAY_RETRY_MAX_SECONDS)

    def _call_once(self, call: _calls.Call[_T], survives_close: bool) -> _T:
        stub = self._client._stub_for_process()
        with self._lock:
            if self._closed and not survives_close:
                raise _Stopped
            if self._shutdown.is_set() and not self._closed:
                # Closed, the control stream is not followed any more, and nothing would say a server is back: an
                # acknowledgement then tries the address itself.
                raise _Away
            rpc = getattr(stub, call.method)
            # A streamed answer's call is a future too: cancel() cuts it short like a unary call's.
            try:
                future = (rpc if call.streamed else rpc.future)(call.request, timeout=call.timeout,
                                                                 metadata=self._client._metadata)
            except ValueError:  # "Channel closed!": the client was closed between taking its stub and this call
                if self._client._closed:
                    raise RuntimeError(f"{self._client!r} is closed") from None
                raise
            (self._acks_inflight if survives_close else self._inflight).add(future)
        try:
            return call.convert(read_stream(future) if call.streamed else future.result())
        except grpc.FutureCancelledError:
            if self._closed and not survives_close:
                raise _Stopped from None
            raise _Away from None  # cut by the server's SHUTDOWN
        except grpc.RpcError as exc:
            if self._closed and not survives_close:
                raise _Stopped from None
            # A server that shut down, died or (waiting for ready) never came: away until it is back.
            if _server_away(exc.code()):
                if not self._shutdown.wait(SHUTDOWN_EVENT_WAIT_SECONDS if exc.code() == grpc.StatusCode.CANCELLED
                                           else 0):
                    self._present.clear()
                refusal = translate(exc, self._client.target) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
                raise (_Away(refusal) if refuses_for_now(refusal) else _Away()) from None
            raise translate(exc, self._client.target, self._client.wait_for_ready,
                            getattr(self._client, "_explain", None)) from exc
        finally:
            with self._lock:
                self._inflight.discard(future)
                self._acks_inflight.discard(future)

    def _prefetch(self) -> MiniBatch:
        """Collects until a full batch arrived, in several answers when one would not fit the client's message
        limit (raises _Stopped when closed, ServerGoneError when the server does not come back)."""
        results: list[CollectResult] = []
        wait = self._batch_wait()
        while missing := self._rest(results):
            job_ended = self.job_ended  # read before the Collect: a batch completed after the end still counts
            sent, poll = time.monotonic(), self._poll(wait, job_ended)
            try:
                result = self._call(self._collect_call(missing if results else None, poll))
            except PacerClientError as exc:
                if not self._without_stream(exc):
                    raise
                result = self._call(self._collect_call(missing if results else None, poll))  # nothing was taken
            self._took(result, sent)
            if result.groups:
                results.append(result)
            elif job_ended and not results:
                raise _Stopped  # the job ended and a whole poll brought nothing: no batch will come
            if wait.due(asked_at := self._asked_at, self._paused):
                try:
                    wait.report(self._call(_calls.get_state(timeout=self._client.timeout)), asked_at)
                except PacerClientError as exc:
                    wait.report(exc, asked_at)
        wait.done()
        return MiniBatch.from_collects(results, mask_offpolicy=self.mask_offpolicy)

    def __next__(self) -> MiniBatch:
        """Sends the acknowledgement of the batch handed out last, hands out the prefetched one and
        prefetches the next. The acknowledgement completes in the background (wait_for_ack() waits for it);
        its error, if any, is raised by the next call."""
        try:
            self.wait_for_ack()
            batch, self._current = self._current, None
            if batch is not None and batch.lease_ids:
                self._ack_begins()  # before it is handed to the thread: a close() meanwhile keeps the heartbeats
                try:
                    self._acking = self._acker.submit(self._acknowledge_begun, batch)
                except BaseException:  # the thread is gone (next() after close()): nothing is under way
                    self._ack_ends()
                    raise
            if self._pending is None or self._closed:
                raise _Stopped
            pending, self._pending = self._pending, None
            self._asked_at = _stall_clock()
            try:
                batch = pending.result()
                while not self._still_held(batch):
                    batch = self._prefetch()  # here, not on the executor: close() may have shut that down
            finally:
                self._asked_at = None
        except _Stopped:
            self.close()
            try:
                self.wait_for_ack()  # the last batch's acknowledgement, sent above, completes before the end
            except _Stopped:
                pass
            raise StopIteration from None
        except BaseException:
            self.close()
            raise
        self.delivered += 1
        self._in_hand(batch)
        if self._wants_more():
            self._pending = self._executor.submit(self._prefetch)
        return batch

    def _still_held(self, batch: MiniBatch) -> bool:
        """Whether the prefetched `batch` is still this trainer's to hand out. After a silence the server may have
        taken as long as its grace (a stop, a cut network), a heartbeat asks it first: a lease given back is the
        trainer's again, one whose groups went to another trainer is not (its other leases are given back)."""
        if self._may_have_lapsed(batch):
            sent, named = time.monotonic(), list(self._held_leases)
            try:
                self._heard(self._call(self._heartbeat_call(named)), sent, named)
            except PacerClientError as exc:
                self._not_confirmed(exc)
        live = self._superseded(batch)
        if live is not None:
            self._give_back(live)
        return live is None

    def ack(self) -> int:
        """Acknowledges the batch handed out last now and waits for it (otherwise the next __next__ sends
        the acknowledgement); returns its groups. Through a server restart it waits for the server to be
        back (ServerGoneError after `reconnect` seconds). A LEASE_EXPIRED error (FailedPreconditionError)
        means the lease ran out before: the groups will be delivered again."""
        self.wait_for_ack()
        batch = self._current
        if batch is None or not batch.lease_ids:
            self._in_hand(None)
            return 0
        self._ack_begins()  # first: closed, the heartbeats would end with the batch out of hand
        self._in_hand(None)
        return self._acknowledge_begun(batch)

    def wait_for_ack(self) -> None:
        """Waits until the acknowledgement sent by the last __next__ is done; raises its error, if any."""
        acking, self._acking = self._acking, None
        if acking is not None:
            acking.result()

    def _acknowledge_begun(self, batch: MiniBatch) -> int:
        try:
            groups = sum(self._call(_calls.ack(lease_id, request_id=None, timeout=self._client.timeout),
                                    survives_close=True) for lease_id in batch.lease_ids)
        finally:
            self._ack_ends()
        self._let_go(batch.lease_ids)
        self.acknowledged += 1
        return groups

    def close(self) -> None:
        """Stops prefetching and the control stream; does not acknowledge the current batch (`ack()` still can, and
        the heartbeats go on until it does). A batch already prefetched and not handed out is given back (Release):
        its groups return to the server's buffer at once, to be delivered again, ahead of newer ones. A prefetch
        still in progress gets up to a second to bring its batch (then given back too) before it is cut; a batch cut
        while it is received returns once the heartbeats have stopped for the server's liveness grace."""
        self._give_back(self._stop())

    def _stop(self) -> tuple[str, ...]:
        """close() but for the give-back: stops prefetching and the control stream; returns the leases of the batch
        prefetched and not handed out (none when closed before)."""
        with self._lock:
            first, self._closed = not self._closed, True
        if first and self._pending is not None:  # no Collect starts now; one under way may bring a leased batch
            concurrent.futures.wait([self._pending], timeout=_CLOSE_PREFETCH_WAIT_SECONDS)
        prefetched = self._prefetched() if first else None
        self._closing.set()
        self._end_beats_when_done()
        self._cancel_inflight(self._inflight)
        self._watch.cancel()
        self._executor.shutdown(wait=False)
        self._acker.shutdown(wait=False)
        return _lease_ids(prefetched)

    def _give_back(self, lease_ids: Sequence[str]) -> int:
        return self._give_back_through(self._client, lease_ids)

    def _give_back_abandoned(self) -> None:
        try:
            self.wait_for_ack()  # the Ack sent for the batch before (trained on) lands first
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise it to
            log.warning("batches: the acknowledgement sent by an iterator abandoned without close() failed: %s", exc)
        self._stop()
        lease_ids = self._held_now()  # the batch in hand, the one prefetched, any cut while received
        groups = self._give_back(lease_ids)
        self._in_hand(None)  # closed, nothing in hand: the heartbeats end
        self._report_abandoned(lease_ids, groups)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Without an exception the batch in hand is acknowledged (it was trained on); with one it is given back
        (Release: delivered again at once, to this trainer restarted or another), as is the batch prefetched."""
        try:
            if exc_type is None:
                self.ack()
            else:
                self.wait_for_ack()
                current, self._current = self._current, None
                self._give_back(_lease_ids(current))
        except _Stopped:
            pass
        finally:
            self.close()


def _read_quietly(task: asyncio.Future[Any]) -> None:
    """Reads how a task the iterator left behind ended, so that asyncio logs no "exception never retrieved" for it."""
    if not task.cancelled():
        task.exception()


class _AsyncBatchIteratorCore(_IteratorBase):
    """The work of an AsyncBatchIterator, shared by its tasks and heartbeat thread (which hold this, never the
    AsyncBatchIterator)."""

    def __init__(self, client: AsyncPacerClient, mini_batch_size: int | None, group_size: int | None = None, *,
                 lease: float = DEFAULT_LEASE_SECONDS, poll: float = DEFAULT_POLL_SECONDS,
                 num_batches: int | str | None = None, mask_offpolicy: bool = False,
                 token_budget: int | None = None, rank: int = 0, world_size: int = 1,
                 step: int | None = None, reconnect: float = DEFAULT_RECONNECT_SECONDS, run: str = "") -> None:
        # The group size may have to be asked from the server, which needs the event loop: resolved on start
        # (the arguments are checked now, against the group size 1 where it is not known yet).
        self._shape_arguments = dict(token_budget=token_budget, rank=rank, world_size=world_size)
        self._group_size = group_size
        shape = BatchShape.of(mini_batch_size, group_size or 1, None, **self._shape_arguments)
        super().__init__(client, shape, lease=lease, poll=poll, num_batches=num_batches,
                         mask_offpolicy=mask_offpolicy, step=step, reconnect=reconnect, run=run)
        self._present = asyncio.Event()  # the server answers (cleared while it is away)
        self._present.set()
        self._shape_resolved = group_size is not None or mini_batch_size is None
        self.mini_batch_size = mini_batch_size
        self._shutdown = asyncio.Event()
        self._inflight: set[asyncio.Future[Any]] = set()
        self._acks_inflight: set[asyncio.Future[Any]] = set()
        self._pending: asyncio.Task[MiniBatch] | None = None
        self._acking: asyncio.Task[int] | None = None
        self._watch: Any = None
        self._watcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop it runs on, once started

    async def _start(self) -> None:
        if self._watcher is not None:  # started (every __anext__ calls this): no GetState per batch
            return
        # The server's state is asked for whenever the blocking iterator's batches() asks for it.
        if (not self._shape_resolved or self.num_batches == STEP or self._group_size is not None
                or not self.shape.token_budget):
            state = await self._starting_state()
            check_group_size(state, self._group_size)
            if not self._shape_resolved:
                self.shape = BatchShape.of(self.mini_batch_size, None, lambda: state.group_sizes,
                                           **self._shape_arguments)
                self._shape_resolved = True
            if self.num_batches == STEP:
                self.num_batches = step_batches(self.mini_batch_size, state,
                                                self._shape_arguments["token_budget"])
            if not self.shape.token_budget:
                check_reachable(state, self.shape.num_groups, self.mini_batch_size)
        self._loop = asyncio.get_running_loop()
        self._start_heartbeats(twin=True)
        self._watch = self._client.watch()
        self._watcher = asyncio.ensure_future(self._watch_events())
        if self._wants_more():
            self._pending = asyncio.ensure_future(self._prefetch())

    async def _starting_state(self) -> PacerState:
        """Coroutine form of starting_state: a server restarting as the iterator starts is waited for."""
        start = _StartWait(self._client.target, self.reconnect, getattr(self._client, "_connection_trouble", None))
        while True:
            try:
                state = await self._client.state()
            except PacerClientError as exc:
                pause = start.pause(exc)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
                continue
            start.answered()
            return state

    async def _watch_events(self) -> None:
        """Coroutine form of _BatchIteratorCore._watch_events."""
        delay = _AWAY_RETRY_INITIAL_SECONDS
        while not self._closed:
            try:
                async for event in self._watch:
                    self._outage.answered()
                    delay = _AWAY_RETRY_INITIAL_SECONDS
                    self._note_event(event)
                    if event.type == ControlEventType.SHUTDOWN:
                        self._present.clear()
                        self._shutdown.set()
                        for task in (*self._inflight, *self._acks_inflight):
                            task.cancel()
                    elif event.type == ControlEventType.STATE:
                        self._shutdown.clear()
                        self._present.set()
                if not self._closed:
                    self._outage.failed("the server ended it")
            except Exception as exc:  # noqa: BLE001 - a watch failure must not kill the trainer
                if not self._closed:  # closing cancels the stream: no outage
                    self._outage.failed(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _AWAY_RETRY_MAX_SECONDS)
            if not self._closed:
                watch = _reopened_watch(self._client)
                if watch is None:
                    return
                self._watch = watch

    async def _call(self, call: _calls.Call[_T], *, survives_close: bool = False) -> _T:
        """Coroutine form of _BatchIteratorCore._call."""
        deadline: float | None = None
        delay = _AWAY_RETRY_INITIAL_SECONDS
        while True:
            try:
                answer = await self._call_once(call, survives_close)
                self._refusals.answered()
                return answer
            except _Away as away:
                if away.args:
                    self._refusals.failed(away.args[0])
                now = time.monotonic()
                deadline = now + self.reconnect if deadline is None else deadline
                if now >= deadline:
                    raise self._gone(call.method, self._shutdown.is_set()) from None
                await _set_within(self._present, min(delay, deadline - now))
                if self._closed and not survives_close:
                    raise _Stopped from None
                delay = min(delay * 2, _AWAY_RETRY_MAX_SECONDS)

    async def _call_once(self, call: _calls.Call[_T], survives_close: bool) -> _T:
        if self._closed and not survives_close:
            raise _Stopped
        if self._shutdown.is_set() and not self._closed:  # see _BatchIteratorCore._call_once
            raise _Away
        task = asyncio.ensure_future(self._client._run(call))
        calls = self._acks_inflight if survives_close else self._inflight
        calls.add(task)
        try:
            # Not `await task`: the caller's cancel would cancel the call too, and read as the server's SHUTDOWN
            # cutting it (below), to be sent again: a trainer cancelled while it waits went on waiting.
            await asyncio.wait((task,))
        except asyncio.CancelledError:  # the caller's own task was cancelled: end the call, pass the cancel on
            task.cancel()
            calls.discard(task)
            raise
        try:
            return task.result()
        except asyncio.CancelledError:
            if self._closed and not survives_close:
                raise _Stopped from None
            raise _Away from None  # the call alone was cut: by the server's SHUTDOWN
        except Exception as exc:
            if self._closed and not survives_close:
                raise _Stopped from None
            if _server_away(getattr(exc, "code", None)):  # see _BatchIteratorCore._call_once
                if not self._shutdown.is_set() and not await _set_within(
                        self._shutdown, SHUTDOWN_EVENT_WAIT_SECONDS if exc.code == grpc.StatusCode.CANCELLED else 0.001):
                    self._present.clear()
                raise (_Away(exc) if refuses_for_now(exc) else _Away()) from None
            raise
        finally:
            calls.discard(task)

    async def _prefetch(self) -> MiniBatch:
        results: list[CollectResult] = []
        wait = self._batch_wait()
        while missing := self._rest(results):
            job_ended = self.job_ended
            sent, poll = time.monotonic(), self._poll(wait, job_ended)
            try:
                result = await self._call(self._collect_call(missing if results else None, poll))
            except PacerClientError as exc:
                if not self._without_stream(exc):
                    raise
                result = await self._call(self._collect_call(missing if results else None, poll))  # nothing was taken
            self._took(result, sent)
            if result.groups:
                results.append(result)
            elif job_ended and not results:
                raise _Stopped  # as in _BatchIteratorCore._prefetch
            if wait.due(asked_at := self._asked_at, self._paused):
                try:
                    wait.report(await self._call(_calls.get_state(timeout=self._client.timeout)), asked_at)
                except PacerClientError as exc:
                    wait.report(exc, asked_at)
        wait.done()
        return MiniBatch.from_collects(results, mask_offpolicy=self.mask_offpolicy)

    async def __anext__(self) -> MiniBatch:
        """Acknowledges the batch handed out last, then hands out the prefetched one and prefetches the next."""
        try:
            await self._start()
            await self.wait_for_ack()
            batch, self._current = self._current, None
            if batch is not None and batch.lease_ids:
                self._acking = self._acknowledge(batch)
            if self._pending is None or self._closed:
                raise _Stopped
            pending, self._pending = self._pending, None
            self._asked_at = _stall_clock()
            try:
                batch = await pending
                while not await self._still_held(batch):
                    batch = await self._prefetch()
            finally:
                self._asked_at = None
        except _Stopped:
            await self.close()
            try:
                await self.wait_for_ack()  # the last batch's acknowledgement, sent above, completes before the end
            except _Stopped:
                pass
            raise StopAsyncIteration from None
        except BaseException:
            await self.close()
            raise
        self.delivered += 1
        self._in_hand(batch)
        if self._wants_more():
            self._pending = asyncio.ensure_future(self._prefetch())
        return batch

    async def _still_held(self, batch: MiniBatch) -> bool:
        """Coroutine form of _BatchIteratorCore._still_held."""
        if self._may_have_lapsed(batch):
            sent, named = time.monotonic(), list(self._held_leases)
            try:
                self._heard(await self._call(self._heartbeat_call(named)), sent, named)
            except PacerClientError as exc:
                self._not_confirmed(exc)
        live = self._superseded(batch)
        if live is not None:
            await self._give_back(live)
        return live is None

    async def ack(self) -> int:
        """Coroutine form of BatchIterator.ack."""
        await self.wait_for_ack()
        batch = self._current
        if batch is None or not batch.lease_ids:
            self._in_hand(None)
            return 0
        acking = self._acknowledge(batch)  # first: closed, the heartbeats would end with the batch out of hand
        self._in_hand(None)
        return await acking

    async def wait_for_ack(self) -> None:
        """Coroutine form of BatchIterator.wait_for_ack."""
        acking, self._acking = self._acking, None
        if acking is not None:
            await acking

    def _acknowledge(self, batch: MiniBatch) -> asyncio.Future[int]:
        """The acknowledgement of `batch` as a task, counted under way from now until it ends however it ends (the
        heartbeats go on meanwhile), even if it is cancelled before it starts."""
        self._ack_begins()
        task = asyncio.ensure_future(self._acknowledge_now(batch))
        task.add_done_callback(lambda _done: self._ack_ends())
        return task

    async def _acknowledge_now(self, batch: MiniBatch) -> int:
        groups = 0
        for lease_id in batch.lease_ids:
            groups += await self._call(_calls.ack(lease_id, request_id=None, timeout=self._client.timeout),
                                       survives_close=True)
        self._let_go(batch.lease_ids)
        self.acknowledged += 1
        return groups

    async def close(self) -> None:
        """Coroutine form of BatchIterator.close."""
        first, self._closed = not self._closed, True
        pending = self._pending
        if first and pending is not None and pending is not asyncio.current_task():
            await asyncio.wait([pending], timeout=_CLOSE_PREFETCH_WAIT_SECONDS)  # see BatchIterator.close
        prefetched = self._prefetched() if first else None
        self._end_beats_when_done()
        self._cut_tasks()
        # A prefetch cut by the close ends with _Stopped, which nobody is left to read: waited for here (they end at
        # once) and read, or asyncio would log it as an unhandled exception at the loop's end.
        left = [t for t in (self._pending, self._watcher) if t is not None and t is not asyncio.current_task()]
        if left:
            ended, _ = await asyncio.wait(left, timeout=_CLOSE_WAIT_SECONDS)
            for task in ended:
                _read_quietly(task)
        await self._give_back(_lease_ids(prefetched))

    def _cut_tasks(self) -> None:
        """Cuts the calls in progress, the prefetch and the control stream (on the event loop)."""
        for task in (*self._inflight, self._pending, self._watcher):
            if task is not None and not task.done():
                task.cancel()
        if self._watch is not None:
            self._watch.cancel()

    async def _give_back(self, lease_ids: Sequence[str]) -> None:
        for call in self._release_calls(lease_ids):
            try:
                await self._client._run(call)
            except PacerClientError as exc:
                self._release_failed(call, exc)
                return  # the server is away or older: the others' leases run out alike

    def _give_back_abandoned(self) -> None:
        """_BatchIteratorCore's, for an event loop that may be blocked by a step, stopped or closed meanwhile: the
        tasks are cut on the loop if it still runs, and the leases given back through a blocking twin of the client,
        as the heartbeats go."""
        self._closed = True  # no call starts any more
        cut = threading.Event()
        try:
            self._loop.call_soon_threadsafe(self._cut_abandoned, cut)
        except RuntimeError:  # the loop is closed, and the tasks with it
            pass
        else:
            # The Ack sent for the batch before lands first; a loop blocked by a step is not waited for long.
            cut.wait(_CLOSE_WAIT_SECONDS)
        lease_ids = self._held_now()
        twin = self._client.blocking_twin()
        try:
            groups = self._give_back_through(twin, lease_ids)
        finally:
            twin.close()
        self._in_hand(None)  # closed, nothing in hand: the heartbeats end
        self._report_abandoned(lease_ids, groups)

    def _cut_abandoned(self, cut: threading.Event) -> None:
        """On the event loop: cuts the tasks, which nobody is left to read (their ends are read here, so that asyncio
        logs none of them), and sets `cut` once the Ack in progress, if any, has ended."""
        self._cut_tasks()
        for task in (self._pending, self._watcher):
            if task is not None:
                task.add_done_callback(_read_quietly)
        acking = self._acking
        if acking is None:
            cut.set()
            return

        def acknowledged(task: asyncio.Future[int]) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.warning("batches: the acknowledgement sent by an iterator abandoned without close() failed: "
                            "%s", task.exception())
            cut.set()

        acking.add_done_callback(acknowledged)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Coroutine form of _BatchIteratorCore.__exit__."""
        try:
            if exc_type is None:
                await self.ack()
            else:
                await self.wait_for_ack()
                current, self._current = self._current, None
                await self._give_back(_lease_ids(current))
        except _Stopped:
            pass
        finally:
            await self.close()


class _AbandonedIterators:
    """Gives back the leases of iterators collected without close(), on threads of this process's own: their
    finalizers only queue them, as SimpleQueue.put is safe wherever the collector runs a finalizer (any thread, any
    point, a lock held), and starting a thread or calling the server there is not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_IteratorBase] | None = None

    def queue(self) -> queue.SimpleQueue[_IteratorBase]:
        """The queue finalizers put iterators on, its thread started on first use (called as an iterator is made)."""
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._give_back_queued, args=(self._queue,), name="coda-batches-abandoned",
                                 daemon=True).start()
            return self._queue

    def forget_in_child(self) -> None:
        """In a forked child: the parent's thread did not come along (and another thread may have held the lock)."""
        self._lock = threading.Lock()
        self._queue = None

    @staticmethod
    def _give_back_queued(queued: queue.SimpleQueue[_IteratorBase]) -> None:
        while True:
            iterator = queued.get()
            if iterator._left_open:
                # A thread each: one whose server is away (its Releases wait out their deadlines) holds no other back.
                try:
                    threading.Thread(target=iterator._abandoned, name="coda-batches-abandoned", daemon=True).start()
                except RuntimeError:  # the interpreter is shutting down: no new thread
                    iterator._abandoned()
            del iterator  # not kept alive until the next one comes


_ABANDONED = _AbandonedIterators()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ABANDONED.forget_in_child)


class _Handle:
    """What the trainer holds of an iterator: its work is done by a core that the iterator's threads and tasks share
    and that refers to nothing of this object, so an iterator dropped without close() (a loop left by `break` in a
    function that returned, an exception path) is collected; its finalizer then has the core's prefetch, control
    stream and heartbeats end and its leases given back (`_IteratorBase._abandoned`). Attributes and methods
    (delivered, acknowledged, ack(), close(), ...) are the core's."""

    __slots__ = ("_core", "__weakref__")

    def __init__(self, core: _IteratorBase) -> None:
        object.__setattr__(self, "_core", core)
        # Not at exit: an iterator still held then was not abandoned, and the interpreter is going down.
        weakref.finalize(self, _ABANDONED.queue().put, core).atexit = False

    def __getattr__(self, name: str) -> Any:
        if name == "_core":  # not set: the core could not be made
            raise AttributeError(name)
        return getattr(self._core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._core, name, value)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *dir(self._core)})


class BatchIterator(_Handle):
    """Blocking iterator of MiniBatch; see PacerClient.batches (arguments: those of _BatchIteratorCore)."""

    __slots__ = ()

    def __init__(self, client: PacerClient, *args: Any, **options: Any) -> None:
        super().__init__(_BatchIteratorCore(client, *args, **options))

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> MiniBatch:
        return self._core.__next__()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._core.__exit__(exc_type, exc, tb)

    # The public methods, declared (not only passed through) so that help() and editors list them.
    def ack(self) -> int:
        return self._core.ack()

    def wait_for_ack(self) -> None:
        self._core.wait_for_ack()

    def close(self) -> None:
        self._core.close()

    def wait_watching(self, timeout: float | None = None) -> bool:
        return self._core.wait_watching(timeout)

    ack.__doc__ = _BatchIteratorCore.ack.__doc__
    wait_for_ack.__doc__ = _BatchIteratorCore.wait_for_ack.__doc__
    close.__doc__ = _BatchIteratorCore.close.__doc__
    wait_watching.__doc__ = _BatchIteratorCore.wait_watching.__doc__


class AsyncBatchIterator(_Handle):
    """Async iterator of MiniBatch; see AsyncPacerClient.batches (arguments: those of _AsyncBatchIteratorCore). Use
    it from the client's event loop."""

    __slots__ = ()

    def __init__(self, client: AsyncPacerClient, *args: Any, **options: Any) -> None:
        super().__init__(_AsyncBatchIteratorCore(client, *args, **options))

    def __aiter__(self) -> AsyncBatchIterator:
        return self

    async def __anext__(self) -> MiniBatch:
        return await self._core.__anext__()

    async def __aenter__(self) -> AsyncBatchIterator:
        await self._core._start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._core.__aexit__(exc_type, exc, tb)

    async def ack(self) -> int:
        """Coroutine form of BatchIterator.ack."""
        return await self._core.ack()

    async def wait_for_ack(self) -> None:
        """Coroutine form of BatchIterator.wait_for_ack."""
        await self._core.wait_for_ack()

    async def close(self) -> None:
        """Coroutine form of BatchIterator.close."""
        await self._core.close()
