"""Protocol facts the client and the server share: the client-id rule, the table of RPCs (plain data, no grpc),
and the LoongSage prompt-id form that orders the buffer and places a prompt in the prompt cursor."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Who is calling (a worker or trainer name), sent with every call when the client is given one; the server
# shows it in its per-RPC log line, in the in-flight records and in per-client metrics, and may rate-limit
# by it. Letters, digits and -_.:@/ only, so it is safe in a log line and a Prometheus label.
CLIENT_ID_METADATA_KEY = "x-coda-client-id"
MAX_CLIENT_ID_LENGTH = 128
CLIENT_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:@/-]{1,%d}" % MAX_CLIENT_ID_LENGTH)
CLIENT_ID_RULE = (f"1 to {MAX_CLIENT_ID_LENGTH} characters, each a letter, a digit or one of - _ . : @ / "
                  "(e.g. rollout-worker-17 or trainer@node-3)")


# ------------------------------------------------------------------------------------------ the RPC table
#
# One row per RolloutPacer RPC, read by the client's retry policy and deadlines (coda_client/_channel.py),
# the server's admission (coda_server/admission.py), request-id answers (coda_server/core/answers.py, given
# `remembered_methods()` as data) and pass-through (de)serializers (coda_server/wire.py).
# To add an RPC: declare it in proto/coda/pacer/v1/pacer.proto, run scripts/gen_proto.py, add its row here,
# then its servicer method (coda_server/service.py) and its client call (coda_client/_calls.py);
# tests/test_rpc_table.py fails while the table and the proto's service disagree.

SERVICE = "coda.pacer.v1.RolloutPacer"


def package_version() -> str:
    """The installed coda-pacer's version, for --version and the server's start-up log ("unknown" when the code
    runs from a source tree that was never installed)."""
    try:
        return importlib.metadata.version("coda-pacer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# The packages of the distribution whose code decides what a build does (their .py files, the server's shipped
# YAML), read from beside this one, wherever it is installed.
_BUILD_PACKAGES = ("coda_client", "coda_server", "coda_worker", "coda_sim")
_BUILD_SUFFIXES = (".py", ".yaml")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """12 hex digits of a digest of this build's source, for --version and the start-up line: two builds of one
    version (a rebuilt image under the same tag, a rollback) read differently, with no release step to forget."""
    root = Path(__file__).resolve().parent.parent
    files = []
    for package in _BUILD_PACKAGES:
        # Links followed: in a source tree coda_server/conf links to conf/, in a wheel it is a directory.
        for directory, subdirectories, names in os.walk(root / package, followlinks=True):
            subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
            files += [Path(directory, name) for name in names if name.endswith(_BUILD_SUFFIXES)]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda path: path.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Rpc:
    """What the client and the server need to know about one RPC, besides its messages."""

    name: str
    mutating: bool  # changes the pacer's state (read-only otherwise)
    # The channel retries it on UNAVAILABLE: read-only, or mutating with a request_id the server de-duplicates,
    # or harmless to apply twice.
    retry_safe: bool
    long_poll: bool = False  # may wait (wait_seconds): the client stretches its deadline by the wait
    streaming: bool = False  # server-streaming: no per-call deadline unless it is a long-poll
    # Admission (docs/scaling.md): the kind of call it counts as when it does not wait, and when it waits
    # (wait_seconds > 0); None: a control call, never refused for lack of room.
    admission: tuple[Optional[str], Optional[str]] = (None, None)
    rate_limit_key: Optional[str] = None  # server.client_rate_limits.<key> applies to it, per client id
    # Its answer is remembered by request_id so a retry applies once: None (not remembered), "answer",
    # or "data" (the answer carries trajectories: fewer are kept and their bytes are counted).
    remembered: Optional[str] = None
    request_form: str = "message"  # "message" (generated parser) or "submit" (pass-through slices)
    # "message", "views" (pass-through views), "assembled" (a message joined with fields encoded ahead, e.g.
    # GetState's configuration summary, encoded once) or "encoded" (bytes as sent).
    response_form: str = "message"


RPCS: tuple[Rpc, ...] = (
    Rpc("Dispatch", mutating=True, retry_safe=True, long_poll=True, admission=("worker", "waiting_dispatch"),
        rate_limit_key="dispatch_per_second", remembered="answer", response_form="views"),
    Rpc("Submit", mutating=True, retry_safe=True, admission=("worker", "worker"),
        rate_limit_key="submit_per_second", remembered="answer", request_form="submit"),
    Rpc("Collect", mutating=True, retry_safe=True, long_poll=True, admission=(None, "waiting_collect"),
        remembered="data", response_form="views"),
    # Collect's answer in messages of a few MiB (what batches() uses); its answers are Collect's, remembered by
    # the core under Collect, so a retry of either with the same request_id gets the same answer.
    Rpc("CollectStream", mutating=True, retry_safe=True, long_poll=True, streaming=True,
        admission=(None, "waiting_collect"), response_form="views"),
    Rpc("Ack", mutating=True, retry_safe=True, remembered="answer"),
    Rpc("Release", mutating=True, retry_safe=True, remembered="answer"),
    Rpc("Reset", mutating=True, retry_safe=True, long_poll=True, remembered="data", response_form="views"),
    Rpc("Resume", mutating=True, retry_safe=True, remembered="answer"),
    Rpc("GetState", mutating=False, retry_safe=True, response_form="assembled"),
    # Renewing a lease twice is harmless: no request id.
    Rpc("KeepAlive", mutating=True, retry_safe=True),
    Rpc("WatchControl", mutating=False, retry_safe=True, streaming=True, admission=("watch", "watch"),
        response_form="encoded"),
    Rpc("ListWorkers", mutating=False, retry_safe=True),
    # Taking a checkpoint changes nothing the pacing depends on.
    Rpc("Checkpoint", mutating=False, retry_safe=True, response_form="encoded"),
    Rpc("Restore", mutating=True, retry_safe=True, remembered="answer"),
    Rpc("GetPromptCursor", mutating=False, retry_safe=True),
    # The trainer's last call: a control call (never refused for room); ending twice changes nothing.
    Rpc("EndJob", mutating=True, retry_safe=True, long_poll=True, remembered="answer"),
)
RPC_BY_NAME: dict[str, Rpc] = {rpc.name: rpc for rpc in RPCS}


def method_path(name: str) -> str:
    """The gRPC method path of RPC `name`, e.g. /coda.pacer.v1.RolloutPacer/Dispatch."""
    return f"/{SERVICE}/{name}"


def remembered_methods() -> dict[str, bool]:
    """The RPCs whose answers are remembered by request_id -> whether those answers carry trajectories."""
    return {rpc.name: rpc.remembered == "data" for rpc in RPCS if rpc.remembered is not None}


def describe_collect_shape(world_size: int, num_groups: int, token_budget: int) -> str:
    """A data-parallel Collect's shape as the ranks' settings that make it (the client's and the server's warnings
    of ranks that disagree name shapes alike)."""
    cut = f"token_budget {token_budget}" if token_budget else f"{num_groups} groups"
    return f"world_size {world_size}, {cut}"


# LoongSage names a prompt group e.g. "epoch0_step1_ds0_prompt116" (or "..._ds0_eval_prompt3"): (epoch, prompt
# number) orders the server's buffer and places the prompt in the prompt cursor. Matched whole (fullmatch).
LOONGSAGE_PROMPT_ID = re.compile(r"epoch(\d+)_(?:.*_)?prompt(\d+)")
