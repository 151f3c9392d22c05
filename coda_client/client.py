"""PacerClient (blocking) and AsyncPacerClient (grpc.aio): thin typed wrappers over the RolloutPacer stub."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from . import _calls, _health, _tls, arrays as _arrays, wire_forms as _wire
from ._calls import Call
from ._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_SECONDS,
    ChannelOptions,
    TlsConfig,
    TlsSpec,
    call_metadata,
    channel_options,
    check_client_limits,
    check_target,
    proxy_options,
    read_stream,
    resolve_tls,
    unreachable_target,
)
from ._proto import pacer_pb2_grpc
from .batches import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_POLL_SECONDS,
    DEFAULT_RECONNECT_SECONDS,
    AsyncBatchIterator,
    BatchIterator,
    STEP,
    BatchShape,
    check_group_size,
    check_reachable,
    starting_state,
    step_batches,
)
from .errors import NOT_CONNECTED, DeadlineExceededError, PacerClientError, UnavailableError, translate
from .types import (
    Checkpoint,
    CollectResult,
    ControlEvent,
    DispatchResult,
    JobEndReport,
    KeepAliveResult,
    PacerState,
    PromptCursor,
    PromptRef,
    ResetMode,
    ResetResult,
    RestoreResult,
    ResumeResult,
    SubmitResult,
    Trajectory,
    TrajectoryGroup,
    WorkerHoldings,
)

__all__ = ["PacerClient", "AsyncPacerClient", "ControlStream", "AsyncControlStream"]

_T = TypeVar("_T")

# Every client alive in this process, so the fork hook can make the child build its own channel.
_LIVE_CLIENTS: weakref.WeakSet[_ClientBase] = weakref.WeakSet()
# Channels inherited from the parent. They are kept referenced, never closed or collected, in the
# child: their destructors would drive gRPC core state that belongs to the parent process.
log = logging.getLogger(__name__)
_INHERITED_CHANNELS: list[Any] = []
# The call AsyncPacerClient.connection_trouble makes to learn why connections fail: the standard health check
# (empty request: the server as a whole), needing no token, and answered by any gRPC server that has one.
_HEALTH_CHECK = _health.HEALTH_CHECK_METHOD
CONNECTION_PROBE_SECONDS = 10.0
# The same look, bounded tighter, after a call of a client that waits for ready ran out its deadline unconnected: its
# caller has waited the call's timeout already (the look returns at once while connection attempts fail).
NOT_CONNECTED_PROBE_SECONDS = 2.0


def _after_fork_in_child() -> None:
    """os.register_at_fork hook: the child drops every inherited channel and rebuilds on its next call."""
    for client in list(_LIVE_CLIENTS):
        client._forget_inherited_channel()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _StreamBase:
    """Shared state of a watch stream: the gRPC call and whether this side cancelled it.

    `first_event_within`: seconds the first event (the server's current state, sent at once) may take from the
    first read; then the stream is cut and the read raises UnavailableError. A client that waits for ready gives
    its timeout: its stream, which has no deadline, otherwise waited silently for good for a server never there.
    None: no bound (gRPC itself ends the stream of a client that does not wait for ready, finding no server)."""

    def __init__(self, call: Any, target: str | None = None,
                 explain: Callable[[str], str | None] | None = None,
                 first_event_within: float | None = None) -> None:
        self._call = call
        self._target = target
        self._explain = explain  # the client's reading of a connection error (errors.translate)
        self._cancelled = False
        self._first_event_within = first_event_within
        self._answered = False  # an event arrived: the stream has no bound from then on
        self._late = False  # cut because the first event did not come in time
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Ends the stream; a pending or later read finishes the iteration instead of raising."""
        self._cancelled = True
        self._call.cancel()

    def _bounded(self) -> bool:
        """Whether this read is bound to bring the first event in time."""
        return self._first_event_within is not None and not self._answered and not self._cancelled

    def _cut_late(self) -> None:
        """The first event did not come in time: the stream is cut (its read then raises _no_first_event)."""
        with self._lock:
            if self._answered or self._cancelled:
                return
            self._late = True
        self._call.cancel()

    def _heard(self) -> None:
        with self._lock:
            self._answered, self._late = True, False

    def _no_first_event(self) -> UnavailableError:
        # An UnavailableError, as for a stream gRPC ends finding no server: callers that reconnect on it (the worker
        # kit, batches()) do so alike.
        return UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot reach the pacer at {self._target}: no control event within {self._first_event_within:g} s (the "
            f"client's timeout) of the first read; the client waits for a server to be ready (wait_for_ready=True), "
            f"so nothing may listen there, or the server is still starting")


class ControlStream(_StreamBase):
    """Iterator of ControlEvent from WatchControl; ends on server close, cancel() or client close()."""

    def __iter__(self) -> ControlStream:
        return self

    def __next__(self) -> ControlEvent:
        timer = None
        if self._bounded():  # a timer cuts the stream: a blocking read cannot be given a timeout of its own
            timer = threading.Timer(self._first_event_within, self._cut_late)
            timer.daemon = True
            timer.start()
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            if self._late:
                raise self._no_first_event() from None
            if self._cancelled:  # our own cancel (or the client's close): a normal end, not an error
                raise StopIteration from None
            raise translate(exc, self._target, explain=self._explain) from exc
        finally:
            if timer is not None:
                timer.cancel()
        self._heard()
        return ControlEvent.from_pb(message)

    def __enter__(self) -> ControlStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cancel()


class AsyncControlStream(_StreamBase):
    """Async iterator of ControlEvent from WatchControl; ends on server close, cancel() or client close()."""

    def __aiter__(self) -> AsyncControlStream:
        return self

    async def __anext__(self) -> ControlEvent:
        try:
            message = await (self._first_read() if self._bounded() else self._call.read())
        except asyncio.CancelledError:
            # grpc.aio reports a locally cancelled call as CancelledError; only swallow it when we
            # cancelled the call, so cancelling the awaiting task still propagates.
            if self._cancelled:
                raise StopAsyncIteration from None
            raise
        except grpc.RpcError as exc:
            if self._cancelled:
                raise StopAsyncIteration from None
            raise translate(exc, self._target, explain=self._explain) from exc
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        self._heard()
        return ControlEvent.from_pb(message)

    async def _first_read(self) -> Any:
        """The first read, cut (UnavailableError) when nothing came within `first_event_within`. Through
        asyncio.wait, not wait_for: on Python 3.10 and 3.11 that can swallow the caller's own cancel."""
        read = asyncio.ensure_future(self._call.read())
        try:
            await asyncio.wait((read,), timeout=self._first_event_within)
        except asyncio.CancelledError:
            read.cancel()
            raise
        if not read.done():
            self._cut_late()
            read.cancel()
            if self._late:
                raise self._no_first_event()
        return await read

    async def __aenter__(self) -> AsyncControlStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.cancel()


def _release_failed(lease_id: str, failed: PacerClientError, cause: BaseException) -> None:
    """A lease given back after `cause` could not be released: its groups return when it runs out instead."""
    log.warning("the groups of lease %s could not be given back after %s (%s); they return to the buffer when the "
                "lease runs out", lease_id, type(cause).__name__, failed)


def _collect_cut(request_id: str, cause: BaseException) -> None:
    """A plain Collect (no lease, its request id made here) was interrupted after it was sent, or ran out its
    deadline: said, with its id, since the groups the server took for it may never reach the caller (such a
    Collect is at-most-once; a server may answer after the client gave up)."""
    how = ("got no answer within its deadline" if isinstance(cause, DeadlineExceededError)
           else f"was interrupted ({type(cause).__name__})")
    log.warning("collect: the Collect with request_id %s %s after it was sent: the groups the server "
                "took for it, if any, never reached the caller and are lost unless it is asked again under that id "
                "(a Collect without a lease is at-most-once): collect the same num_groups with request_id=%r while "
                "the server remembers it (its last 16 Collects). To collect safely under interruption use "
                "batches(), or collect_result(..., lease=SECONDS) and ack(result.lease_id), or pass request_id= "
                "and retry with it", request_id, how, request_id)


def _unsafe_collect(lease: float, request_id: str | None, cause: BaseException) -> bool:
    """Whether `cause` may have lost a Collect's groups without the caller having a way to get them back: an
    interruption of the caller's (not an error of the call: Ctrl-C, a cancelled task, an asyncio timeout), or a
    deadline run out after the call was sent (the server may answer it, taking groups, after the client gave up;
    not one that never connected: nothing was sent)."""
    lost = not isinstance(cause, Exception) or (isinstance(cause, DeadlineExceededError)
                                                and cause.reason != NOT_CONNECTED)
    return lost and not lease and request_id is None


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place: a crash leaves the old file or the new."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, target)


def check_writable_path(path: str | os.PathLike) -> None:
    """Refuses, before the server is asked for anything, a checkpoint path whose file could not be written: a directory
    that does not exist or cannot be written to, or a path that is a directory (OSError naming the path)."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise IsADirectoryError(f"cannot write the checkpoint to {str(path)!r}: it is a directory; name a file in it")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot write the checkpoint to {str(path)!r}: the directory {str(folder)!r} does "
                                f"not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write the checkpoint to {str(path)!r}: the directory {str(folder)!r} is not "
                              f"writable")


def checkpoint_bytes(checkpoint: Checkpoint | bytes | str | os.PathLike) -> bytes:
    """The blob of a Checkpoint, of bytes as they are, or of the file a path names."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint.blob
    if isinstance(checkpoint, (bytes, bytearray, memoryview)):
        return bytes(checkpoint)
    if isinstance(checkpoint, (str, os.PathLike)):
        try:
            return Path(checkpoint).read_bytes()
        except OSError as exc:  # the path as given, and why; the server is not asked
            raise type(exc)(exc.errno, f"cannot read the checkpoint {str(checkpoint)!r}: {exc.strerror}") from None
    raise TypeError(f"restore takes a Checkpoint, its blob (bytes) or the path it was written to, not "
                    f"{type(checkpoint).__name__}")


class _ClientBase:
    """Configuration, per-process channel bookkeeping and call building shared by both clients."""

    # How an error's hint names the TLS settings (coda-client's own client names its flags).
    _tls_names = _tls.PYTHON_NAMES

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TlsSpec = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        options: ChannelOptions = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        arrays: _arrays.ArrayMode = "list",
        client_id: str | None = None,
        wait_for_ready: bool = False,
    ) -> None:
        # As given (client_id apart, which may be adopted later): a blocking twin is made with them.
        self._settings = dict(token=token, tls=tls, timeout=timeout, options=options, max_message_bytes=max_message_bytes,
                              arrays=arrays, wait_for_ready=wait_for_ready)
        self.wait_for_ready = wait_for_ready
        self.arrays: _arrays.ArrayMode = _arrays.check_mode(arrays)
        self.timeout, self.max_message_bytes = check_client_limits(timeout, max_message_bytes)
        self.client_id = client_id
        self._metadata = call_metadata(token, client_id)
        # Resolved now so a bad certificate path fails at construction, not at the first call.
        self._credentials, tls_options = resolve_tls(tls)
        # What a failed connection is read against: None (plaintext), the TlsConfig, or credentials given as such.
        self._tls = tls if isinstance(tls, grpc.ChannelCredentials) else TlsConfig.of(tls)
        self.target = check_target(target, plaintext=self._credentials is None)
        user_options = dict(options.items() if isinstance(options, Mapping) else options or ())
        self._options = channel_options(
            max_message_bytes=self.max_message_bytes,
            options={**proxy_options(self.target), **dict(tls_options), **user_options}, wait_for_ready=wait_for_ready,
            timeout=self.timeout,
        )
        # What an UNAVAILABLE error names: the target, and the HTTP proxy from the environment it went through.
        self._reach = unreachable_target(self.target, dict(self._options))
        # The largest answer this client takes: Collect tells the server, which cuts its answer to fit.
        merged = dict(self._options)
        receive = merged.get("grpc.max_receive_message_length", max_message_bytes)
        self.max_receive_bytes = int(receive) if receive and int(receive) > 0 else 0
        self._lock = threading.Lock()
        self._channel: Any = None
        self._stub: Any = None
        self._pid = os.getpid()
        self._closed = False
        self._streams: weakref.WeakSet[_StreamBase] = weakref.WeakSet()
        _LIVE_CLIENTS.add(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r})"

    def _connection_trouble(self, details: str) -> _tls.ConnectionTrouble | None:
        """What gRPC's connection error says about this client's TLS settings (_tls.diagnose)."""
        return _tls.diagnose(details, self._tls, self._tls_names)

    def _explain(self, details: str) -> str | None:
        """The likely cause and fix of an UNAVAILABLE with these `details`, for its message (errors.translate)."""
        trouble = self._connection_trouble(details)
        return trouble.text if trouble is not None else None

    def _failure(self, exc: grpc.RpcError) -> PacerClientError:
        """The PacerClientError of a failed call (errors.translate)."""
        return translate(exc, self._reach, self.wait_for_ready, self._explain)

    def _unconnected(self, error: PacerClientError) -> bool:
        """Whether `error` is a DEADLINE_EXCEEDED of a call that waited for ready on a channel not READY now: it may
        never have connected, which a look at the connection (_not_connected) tells and says why."""
        return (self.wait_for_ready and error.code == grpc.StatusCode.DEADLINE_EXCEEDED and not error.reason
                and self._channel is not None and not self._channel_ready())

    def _channel_ready(self) -> bool:
        raise NotImplementedError

    def _not_connected(self, error: PacerClientError, probe: grpc.RpcError | None) -> PacerClientError:
        """`error` (a wait_for_ready call's DEADLINE_EXCEEDED) saying why the client never connected, as a client
        that does not wait would have said at once (nothing listens, not a gRPC server, an untrusted certificate),
        when the look at the connection that followed (`probe`: its error, None when it answered) failed to
        connect too; else `error` as it is (a server that answers, only slowly)."""
        if probe is None or probe.code() != grpc.StatusCode.UNAVAILABLE:
            return error
        why = translate(probe, self._reach, explain=self._explain)
        return DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"{error.details}; the client could not connect within the call's deadline: "
                                     f"{why.details}", reason=NOT_CONNECTED)

    def adopt_client_id(self, client_id: str) -> str:
        """Names a client that has no client id (the worker kit names its client after the worker, so that
        `coda-client workers`, the server's logs and its liveness watch show the worker's id); a named client
        keeps its name. Returns the client's id; raises ValueError for an id that is not a valid client id."""
        with self._lock:
            if self.client_id is None:
                self._metadata = (*self._metadata, *call_metadata(None, client_id))
                self.client_id = client_id
            return self.client_id

    def blocking_twin(self) -> PacerClient:
        """A PacerClient with this client's settings and client id, on a channel of its own: for calls made from a
        thread of their own beside an event loop (the async trainer iterator's heartbeats). Close it when done."""
        return PacerClient(self.target, client_id=self.client_id, **self._settings)

    def _new_channel(self) -> Any:
        raise NotImplementedError

    def _stub_for_process(self) -> pacer_pb2_grpc.RolloutPacerStub:
        """The stub of this process's channel, created on first use (and again in a forked child)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._pid != os.getpid():  # forked without the hook having run (belt and braces)
                self._forget_inherited_channel_locked()
            self._follow_event_loop_locked()
            if self._stub is None:
                self._channel = self._new_channel()
                self._stub = _wire.passthrough_stub(self._channel)
            return self._stub

    def _follow_event_loop_locked(self) -> None:
        """A channel bound to an event loop (the async client's) is made again for a new one: no-op here."""

    def _forget_inherited_channel_locked(self) -> None:
        if self._channel is not None:
            _INHERITED_CHANNELS.append(self._channel)
        self._channel = self._stub = None
        self._streams = weakref.WeakSet()
        self._pid = os.getpid()

    def _forget_inherited_channel(self) -> None:
        # A fresh lock: another parent thread may have held the old one at the moment of fork.
        self._lock = threading.Lock()
        self._forget_inherited_channel_locked()

    def _track(self, stream: _StreamBase) -> None:
        with self._lock:
            self._streams.add(stream)

    def _detach(self) -> Any:
        """Marks the client closed, cancels its watch streams and hands back the channel to close."""
        with self._lock:
            self._closed = True
            if self._pid != os.getpid():
                self._forget_inherited_channel_locked()
            channel, self._channel, self._stub = self._channel, None, None
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        return channel

    def _first_event_within(self) -> float | None:
        """A watch's bound on its first event: the client's timeout when it waits for ready (_StreamBase)."""
        return self.timeout if self.wait_for_ready else None

    def _watch_call(self) -> Any:
        """Starts WatchControl (no deadline: the stream lives until cancelled or the server ends it)."""
        return self._stub_for_process().WatchControl(_calls.watch_request(), metadata=self._metadata)

    # Call builders shared by both clients; the public methods only add blocking or awaiting.
    def _dispatch(self, candidates: Iterable[PromptRef | str], wait: float, request_id: str | None,
                  max_continuations: int | None = None, loaded_weight_version: int | None = None) -> Call[Any]:
        return _calls.dispatch(candidates, wait=wait, request_id=request_id, timeout=self.timeout,
                               max_continuations=max_continuations, loaded_weight_version=loaded_weight_version,
                               max_response_bytes=self.max_receive_bytes)

    def _keep_alive(self, prompt_ids: Sequence[str], dispatch_seqs: Mapping[str, int] | None = None,
                    loaded_weight_version: int | None = None, lease_ids: Sequence[str] = ()) -> Call[Any]:
        return _calls.keep_alive(prompt_ids, timeout=self.timeout, dispatch_seqs=dispatch_seqs,
                                 loaded_weight_version=loaded_weight_version, lease_ids=lease_ids)

    def _submit(self, trajectories: Sequence[Trajectory], request_id: str | None,
                dispatch_seqs: Mapping[str, int] | None = None) -> Call[Any]:
        return _calls.submit(trajectories, request_id=request_id, timeout=self.timeout, dispatch_seqs=dispatch_seqs,
                             max_message_bytes=self.max_message_bytes)

    def _collect(
        self, num_groups: int, wait: float, allow_partial: bool, request_id: str | None, lease: float = 0.0,
        trainer_step: int | None = None, release_when_silent: bool = False, held_lease_ids: Sequence[str] = (),
        named_at_grant: bool = False,
    ) -> Call[Any]:
        return _calls.collect(
            num_groups, wait=wait, allow_partial=allow_partial, request_id=request_id, timeout=self.timeout,
            lease=lease, arrays=self.arrays, trainer_step=trainer_step, max_response_bytes=self.max_receive_bytes,
            release_when_silent=release_when_silent, held_lease_ids=held_lease_ids, named_at_grant=named_at_grant,
        )

    def _ack(self, lease_id: str, request_id: str | None) -> Call[Any]:
        return _calls.ack(lease_id, request_id=request_id, timeout=self.timeout)

    def _release(self, lease_id: str, request_id: str | None) -> Call[Any]:
        return _calls.release(lease_id, request_id=request_id, timeout=self.timeout)

    def _reset(self, mode: Any, wait: float | None, resume: bool, weight_version: int,
               request_id: str | None) -> Call[Any]:
        return _calls.reset(
            mode, wait=wait, resume=resume, weight_version=weight_version, request_id=request_id, timeout=self.timeout,
            arrays=self.arrays, max_response_bytes=self.max_receive_bytes,
        )

    def _resume(self, weight_version: int, request_id: str | None) -> Call[Any]:
        return _calls.resume(weight_version, request_id=request_id, timeout=self.timeout)

    def _end_job(self, mode: Any, wait: float, request_id: str | None) -> Call[Any]:
        return _calls.end_job(mode, wait=wait, request_id=request_id, timeout=self.timeout)

    def _get_state(self) -> Call[Any]:
        return _calls.get_state(timeout=self.timeout)

    def _list_workers(self, client_id: str | None, max_groups_per_worker: int) -> Call[Any]:
        return _calls.list_workers(client_id, max_groups_per_worker, timeout=self.timeout)

    def _checkpoint(self) -> Call[Any]:
        return _calls.checkpoint(timeout=self.timeout, max_response_bytes=self.max_receive_bytes)

    def _restore(self, checkpoint: Checkpoint | bytes | str | os.PathLike, request_id: str | None) -> Call[Any]:
        return _calls.restore(checkpoint_bytes(checkpoint), request_id=request_id, timeout=self.timeout)

    def _prompt_cursor(self) -> Call[Any]:
        return _calls.prompt_cursor(timeout=self.timeout)


class PacerClient(_ClientBase):
    """Blocking client of the RolloutPacer service; thread-safe, one channel per process.

    target: "host:port" (a port outside 1..65535 is a ValueError here), or a gRPC name such as
    "dns:///host:port" or "unix:/path". token: bearer token sent with every call. tls: None (plaintext), True (system
    roots), a TlsConfig or mapping of its fields (root cert, client cert/key for mTLS, server name), or
    grpc.ChannelCredentials. timeout: default deadline in seconds; long-polls get wait + a margin.
    options: extra gRPC channel arguments, overriding the defaults. arrays: how received trajectories hold
    token_ids, logprobs and loss_mask: "list" (default) or "numpy" (read-only arrays over the received bytes;
    needs coda-pacer[numpy]). client_id: who is calling (a worker or trainer name), sent with every call as
    `x-coda-client-id` (letters, digits and -_.:@/, at most 128); the server logs it, shows it in its
    in-flight records and counts per client. wait_for_ready: False (default): a call to an address where
    nothing listens fails within about 1.5 s with UnavailableError naming the target and the OS error; True:
    calls wait (within their deadline) for a server that is still starting or restarting, as the worker kit
    does. Errors raise PacerClientError subclasses.
    """

    def _new_channel(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.target, options=self._options)
        return grpc.secure_channel(self.target, self._credentials, options=self._options)

    def _run(self, call: Call[_T]) -> _T:
        rpc = getattr(self._stub_for_process(), call.method)
        try:
            response = rpc(call.request, timeout=call.timeout, metadata=self._metadata)
            if call.streamed:  # the answer's messages, every one received
                response = read_stream(response)
        except grpc.RpcError as exc:
            error = self._failure(exc)
            if self._unconnected(error):
                with contextlib.suppress(ValueError, AttributeError):  # closed meanwhile: the error as it is
                    error = self._not_connected(error, self._probe(NOT_CONNECTED_PROBE_SECONDS))
            raise error from exc
        return call.convert(response)

    def _channel_ready(self) -> bool:
        # The blocking channel tells its state only through a subscription (a thread); its core's answer is at hand.
        check = getattr(getattr(self._channel, "_channel", None), "check_connectivity_state", None)
        try:
            return check is not None and check(False) == grpc.ChannelConnectivity.READY.value[0]
        except Exception:  # closed meanwhile: the look (_probe) tells
            return False

    def _probe(self, timeout: float) -> grpc.RpcError | None:
        """A health check that does not wait for a connection (AsyncPacerClient.connection_trouble's look): its
        error, or None when it was answered."""
        try:
            self._channel.unary_unary(_HEALTH_CHECK)(b"", timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            return exc
        return None

    def dispatch(
        self, candidates: Iterable[PromptRef | str] = (), *, wait: float = 0.0, request_id: str | None = None,
        max_continuations: int | None = None, loaded_weight_version: int | None = None,
    ) -> DispatchResult:
        """Proposes prompt groups (ids or PromptRefs); admits the first k allowed. No candidates: a peek.
        Restored groups kept for continuation come first (result.continuations; continue them and submit all
        their trajectories again): by default in place of as many candidates, as LoongSage re-offers them
        before new prompts; max_continuations=n takes up to n on top of the candidates; 0 takes none (a
        caller that cannot continue a partial group). `loaded_weight_version`: the version the caller's
        engine reports loaded (ListWorkers shows it)."""
        return self._run(self._dispatch(candidates, wait, request_id, max_continuations, loaded_weight_version))

    def keep_alive(self, prompt_ids: Sequence[str], *, dispatch_seqs: Mapping[str, int] | None = None,
                   loaded_weight_version: int | None = None, lease_ids: Sequence[str] = ()) -> KeepAliveResult:
        """Renews the in-flight leases of running groups this worker is still generating (and is the worker's
        liveness heartbeat; with no prompt ids, the heartbeat alone, as batches() sends it for a trainer).
        `dispatch_seqs`: fencing tokens, as for submit(); `loaded_weight_version`: as for dispatch().
        `lease_ids`: the Collect leases a trainer holds (collect_result(release_when_silent=True)): those its
        silence ended are given back to it while their groups still wait in the buffer."""
        return self._run(self._keep_alive(prompt_ids, dispatch_seqs, loaded_weight_version, lease_ids))

    def submit(self, trajectories: Sequence[Trajectory], *, request_id: str | None = None,
               dispatch_seqs: Mapping[str, int] | None = None) -> SubmitResult:
        """Reports trajectories; a request_id is generated when None so retries are de-duplicated.
        `dispatch_seqs` (prompt id -> the seq its Dispatch answered): fencing tokens; a group handed out again
        since (its worker was taken as gone) is refused, FailedPreconditionError reason STALE_DISPATCH."""
        return self._run(self._submit(trajectories, request_id, dispatch_seqs))

    def collect(
        self, num_groups: int, *, wait: float = 0.0, allow_partial: bool = False, request_id: str | None = None
    ) -> list[TrajectoryGroup]:
        """Takes num_groups complete groups, waiting up to `wait` seconds; [] on timeout unless allow_partial.
        Fewer when all of them would not fit this client's max_message_bytes (the rest stay buffered:
        collect again); FailedPreconditionError (reason MESSAGE_TOO_LARGE) when the oldest alone does not.

        At-most-once: the groups leave the buffer when the server answers, so a call interrupted after it was sent
        (Ctrl-C, a cancelled task, asyncio.wait_for's timeout), or one that ran out its deadline (the server may
        answer after the client gave up), may take groups its caller never receives; it then logs a warning naming
        its request id. To collect safely under interruption use batches(), or
        collect_result(lease=...) with ack(), or pass `request_id` and, after an interruption, call collect again
        with the same id: the server answers it with the same groups (docs/trainer.md)."""
        return self.collect_result(num_groups, wait=wait, allow_partial=allow_partial, request_id=request_id).groups

    def collect_result(
        self, num_groups: int, *, wait: float = 0.0, allow_partial: bool = False, request_id: str | None = None,
        lease: float = 0.0, trainer_step: int | None = None, release_when_silent: bool = False,
        held_lease_ids: Sequence[str] = (), named_at_grant: bool = False,
    ) -> CollectResult:
        """Like collect(), also telling whether the wait timed out (and `cut_to_fit`: fewer groups, as more
        would not fit this client's message limit); with `lease` seconds, the groups come back to the buffer
        unless ack(result.lease_id) is called in time. With `trainer_step` (the steps the trainer has trained),
        the server refuses the Collect unless it is at that step ("restore first").
        `release_when_silent` (needs a client id and a lease): the lease also ends once this client has been silent
        for the server's liveness grace, so a dead trainer's groups come back within it: heartbeat with
        keep_alive([], lease_ids=...) meanwhile. `held_lease_ids`: the leases it holds, given back to it first if
        its silence ended them (as keep_alive's lease_ids). `named_at_grant` (with release_when_silent): this client
        reads the answer at once and names the lease in every heartbeat from then on, so the server counts it named
        at its grant: if this process dies before naming it, it comes back within the grace even while another
        process under the same client id goes on. batches() does all of this itself."""
        call = self._collect(num_groups, wait, allow_partial, request_id, lease, trainer_step, release_when_silent,
                             held_lease_ids, named_at_grant)
        try:
            return self._run(call)
        except BaseException as cause:
            if _unsafe_collect(lease, request_id, cause):
                _collect_cut(call.request.request_id, cause)
            raise

    def ack(self, lease_id: str, *, request_id: str | None = None) -> int:
        """Consumes a leased Collect's groups for good; returns how many."""
        return self._run(self._ack(lease_id, request_id))

    def release(self, lease_id: str, *, request_id: str | None = None) -> int:
        """Gives a leased Collect's groups back untrained: they return to the buffer now, ahead of newer groups, and
        are delivered again (as when the lease runs out). Returns how many (0: the lease had run out or was released
        already); UnknownLeaseError for a lease never granted or already acknowledged."""
        return self._run(self._release(lease_id, request_id))

    @contextlib.contextmanager
    def collect_leased(
        self, num_groups: int, *, lease: float, wait: float = 0.0, allow_partial: bool = False
    ) -> Iterator[list[TrajectoryGroup]]:
        """At-least-once Collect: the groups are acknowledged when the block completes without an
        exception; with one they are released (back to the buffer at once, delivered again); if the process dies,
        they return to the buffer after `lease` seconds."""
        result = self.collect_result(num_groups, wait=wait, allow_partial=allow_partial, lease=lease)
        try:
            yield result.groups
        except BaseException as exc:
            if result.lease_id:
                try:
                    self.release(result.lease_id)
                except PacerClientError as failed:
                    _release_failed(result.lease_id, failed, exc)
            raise
        if result.lease_id:
            self.ack(result.lease_id)

    def batches(
        self, mini_batch_size: int | None = None, *, group_size: int | None = None,
        lease: float = DEFAULT_LEASE_SECONDS, poll: float = DEFAULT_POLL_SECONDS,
        num_batches: int | str | None = None, mask_offpolicy: bool = False, token_budget: int | None = None,
        rank: int = 0, world_size: int = 1, step: int | None = None, reconnect: float = DEFAULT_RECONNECT_SECONDS,
        run: str = "",
    ) -> BatchIterator:
        """The trainer's iterator (docs/trainer.md): packed mini-batches of `mini_batch_size` trajectories
        (whole groups; group_size defaults to the server's), each from a leased Collect (several when the
        groups do not fit one answer within this client's max_message_bytes).

        `token_budget`: mini-batches cut by tokens instead (the oldest whole groups within that many response
        tokens; `mini_batch_size`, if given, caps the trajectories). `rank` and `world_size`: one rank of a
        data-parallel trainer; `mini_batch_size` (or `token_budget`) is then the global mini-batch, and each
        batch is this rank's share of it: whole groups, shares balanced by tokens, the same split for every
        rank (the server makes it), each share leased to its rank alone. `run`: the ranks' launch, the same on every
        rank and new on every launch or restart of them (under torchrun
        f"{TORCHELASTIC_RUN_ID}-{TORCHELASTIC_RESTART_COUNT}"; docs/trainer.md): a rank starting under a new run has
        the server end the shares of the earlier run first, so that ranks killed together and started again at once
        all begin at one new global mini-batch (CollectRequest.run; with world_size > 1 only; "": none named).

        The next Collect runs in the background while the caller trains on the current batch; asking for the
        next batch (or `ack()`) acknowledges the current one. A thread heartbeats while the caller trains, so a
        trainer that dies gets its groups delivered again, in order, within server.trainer_liveness_seconds (the
        client takes a client id `trainer-...` if it has none); otherwise after `lease` seconds (which must cover a
        training step plus the prefetch). Stops
        after `num_batches` batches without prefetching beyond them (a step boundary; "step": one training
        step's B * N / mini_batch_size, read from the server) or on `close()`. A server restart (its SHUTDOWN,
        or a lost connection) does not end it: its calls, acknowledgements included, are sent again once a
        server answers, for up to `reconnect` seconds, then raise ServerGoneError. With `mask_offpolicy`, each
        batch's loss_mask is 0 on the tokens a
        partial rollout generated before its last weight version (docs/partial-rollouts.md). With `step`
        (the steps the trainer has trained), every Collect states it and is refused, FAILED_PRECONDITION
        reason STEP_MISMATCH, unless the server is at that step (docs/durability.md). Needs NumPy
        (coda-pacer[numpy]).
        """
        asked: list[PacerState] = []

        def server_state() -> PacerState:  # asked once, and only when needed
            if not asked:
                asked.append(starting_state(self, reconnect))  # through a server restarting meanwhile
            return asked[0]

        shape = BatchShape.of(mini_batch_size, group_size, lambda: server_state().group_sizes,
                              token_budget=token_budget, rank=rank, world_size=world_size)
        if group_size is not None:
            check_group_size(server_state(), group_size)
        if num_batches == STEP:
            num_batches = step_batches(mini_batch_size, server_state(), token_budget)
        if not shape.token_budget:  # a batch the window can never fill: say so now, not by waiting forever
            check_reachable(server_state(), shape.num_groups, mini_batch_size)
        return BatchIterator(self, shape, lease=lease, poll=poll, num_batches=num_batches,
                             mask_offpolicy=mask_offpolicy, step=step, reconnect=reconnect, run=run)

    def reset(
        self,
        mode: ResetMode | str | None = None,
        *,
        wait: float | None = None,
        resume: bool = False,
        weight_version: int = 0,
        request_id: str | None = None,
    ) -> ResetResult:
        """Step boundary: mode "abort", "wait" or None (server default); optionally resumes at once.

        `wait`: seconds to wait for running groups to be assembled; 0 drops the incomplete ones at once;
        None (the default) waits until every running group is assembled: in WAIT mode bounded by
        server.max_wait_seconds, in ABORT mode by server.abort_wait_seconds (30 s by default: the workers
        abort and submit their partial trajectories, and every running group is restored).
        """
        return self._run(self._reset(mode, wait, resume, weight_version, request_id))

    def resume(self, weight_version: int, *, request_id: str | None = None) -> ResumeResult:
        """Increments the step, records weight_version and reopens dispatch."""
        return self._run(self._resume(weight_version, request_id))

    def end_job(self, mode: ResetMode | str | None = None, *, wait: float = 60.0,
                request_id: str | None = None) -> JobEndReport:
        """Ends the job (after the trainer's last step): dispatch closes for good and every worker is told
        (JOB_ENDED) to "abort" or "wait" for (finish) what it holds, submit it and stop; None is the server
        default (rollout.partial). Waits up to `wait` seconds for the running groups to be assembled, then
        returns what was left: buffered, leased, held, in flight, kept (JobEndReport). Safe to call twice."""
        return self._run(self._end_job(mode, wait, request_id))

    def state(self) -> PacerState:
        """Every counter of the pacer (GetState)."""
        return self._run(self._get_state())

    def checkpoint(self, path: str | os.PathLike | None = None) -> Checkpoint:
        """A pacer checkpoint to keep beside the model checkpoint just saved (docs/durability.md): `.blob`
        holds what the pacer needs to continue from this step. With `path`, the blob is also written there
        (atomically: a temporary file renamed into place). Nothing pauses while it is taken."""
        if path is not None:
            check_writable_path(path)
        taken = self._run(self._checkpoint())
        if path is not None:
            write_atomically(path, taken.blob)
        return taken

    def restore(self, checkpoint: Checkpoint | bytes | str | os.PathLike, *,
                request_id: str | None = None) -> RestoreResult:
        """Brings the server back to a checkpoint (a Checkpoint, its blob, or the path it was written to): its
        step and weight version, its buffered and kept groups; what was generated since is discarded and
        counted, and workers start again from it. Refused, changing nothing, while a Reset runs or for a blob
        of another format or job."""
        return self._run(self._restore(checkpoint, request_id))

    def prompt_cursor(self) -> PromptCursor:
        """The prompts a Dispatch has admitted (prompt sources skip them; see docs/worker.md)."""
        return self._run(self._prompt_cursor())

    def list_workers(self, client_id: str | None = None, *, max_groups_per_worker: int = 0) -> list[WorkerHoldings]:
        """Which worker (client id) holds which running groups and since when; one worker's with `client_id`."""
        return self._run(self._list_workers(client_id, max_groups_per_worker))

    def watch(self) -> ControlStream:
        """Control events, first the current state; iterate it, cancel() it, or close the client to end it."""
        stream = ControlStream(self._watch_call(), self._reach, self._explain, self._first_event_within())
        self._track(stream)
        return stream

    def close(self) -> None:
        """Ends open watch streams and closes the channel; the client cannot be used afterwards."""
        channel = self._detach()
        if channel is not None:
            channel.close()

    def __enter__(self) -> PacerClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncPacerClient(_ClientBase):
    """grpc.aio client with PacerClient's calls as coroutines; use it from one event loop.

    Same arguments as PacerClient. The channel is created on the first call, inside the running loop.
    """

    _channel_loop: asyncio.AbstractEventLoop | None = None  # the event loop the channel was made on

    def _follow_event_loop_locked(self) -> None:
        """grpc.aio binds a channel to the event loop it was made on. Once that loop has ended (a second
        asyncio.run with the same client, as tests and notebooks do), the next call makes a channel on its own
        loop, instead of failing with "Event loop is closed"; while it still runs, a call from another loop is
        refused, naming the fix."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # not called from a coroutine: nothing to bind to
            return
        bound = self._channel_loop
        if self._channel is not None and bound is not running:
            if bound is not None and not bound.is_closed():
                raise RuntimeError(f"{self!r} is in use on another event loop, which still runs: an AsyncPacerClient "
                                   "serves one event loop; make one client per loop (or use PacerClient from threads)")
            self._channel = self._stub = None  # its loop is gone: the channel cannot be closed, only let go
            self._streams = weakref.WeakSet()
        if self._channel is None:
            self._channel_loop = running

    def _new_channel(self) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=self._options)
        return grpc.aio.secure_channel(self.target, self._credentials, options=self._options)

    async def _run(self, call: Call[_T]) -> _T:
        rpc = getattr(self._stub_for_process(), call.method)
        try:
            if call.streamed:  # the answer's messages, every one received
                response = [message async for message in rpc(call.request, timeout=call.timeout,
                                                                metadata=self._metadata)]
            else:
                response = await rpc(call.request, timeout=call.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            error = self._failure(exc)
            if self._unconnected(error):
                with contextlib.suppress(ValueError, AttributeError, grpc.aio.UsageError):  # closed meanwhile
                    error = self._not_connected(error, await self._probe(NOT_CONNECTED_PROBE_SECONDS))
            raise error from exc
        return call.convert(response)

    def _channel_ready(self) -> bool:
        try:
            return self._channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY
        except Exception:  # closed meanwhile: the look (_probe) tells
            return False

    async def _probe(self, timeout: float) -> grpc.RpcError | None:
        """A health check that does not wait for a connection: its error, or None when it was answered. The
        pacer's own calls, waiting for ready, only time out."""
        try:
            await self._channel.unary_unary(_HEALTH_CHECK)(b"", timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            return exc
        return None

    async def connection_state(self, after: grpc.ChannelConnectivity | None = None) -> grpc.ChannelConnectivity:
        """The channel's connectivity: at once when `after` is None (and the channel starts connecting), else once it
        has changed from `after`. TRANSIENT_FAILURE: connection attempts fail (nothing listens at the address, or it
        cannot be reached), which a client that waits for ready (`wait_for_ready=True`) does not say until a call's
        deadline; SHUTDOWN: the client was closed. The worker kit watches it to say at once that its server is
        away."""
        self._stub_for_process()  # the channel, made if it is not yet
        channel = self._channel
        if after is not None:
            await channel.wait_for_state_change(after)
        return channel.get_state(try_to_connect=True)

    async def connection_trouble(self) -> tuple[str, _tls.ConnectionTrouble | None] | None:
        """Why this client cannot connect now, or None when it can: gRPC's last connection error (e.g. "Connection
        refused", a failed TLS handshake) and what it says about the TLS settings (ConnectionTrouble: `settled` for
        a TLS misconfiguration, which waiting does not cure), or None beside the error when it says nothing of them.
        Read from a health check that does not wait for a connection: the pacer's own calls (wait_for_ready) only
        time out. The worker kit asks it while its connection fails."""
        self._stub_for_process()
        failed = await self._probe(CONNECTION_PROBE_SECONDS)
        if failed is None or failed.code() != grpc.StatusCode.UNAVAILABLE:  # an answer of some kind: it connected
            return None
        details = _tls.tidy(failed.details() or "")
        return details, self._connection_trouble(details)

    async def dispatch(
        self, candidates: Iterable[PromptRef | str] = (), *, wait: float = 0.0, request_id: str | None = None,
        max_continuations: int | None = None, loaded_weight_version: int | None = None,
    ) -> DispatchResult:
        """Coroutine form of PacerClient.dispatch."""
        return await self._run(self._dispatch(candidates, wait, request_id, max_continuations, loaded_weight_version))

    async def keep_alive(self, prompt_ids: Sequence[str], *, dispatch_seqs: Mapping[str, int] | None = None,
                         loaded_weight_version: int | None = None, lease_ids: Sequence[str] = ()) -> KeepAliveResult:
        """Coroutine form of PacerClient.keep_alive."""
        return await self._run(self._keep_alive(prompt_ids, dispatch_seqs, loaded_weight_version, lease_ids))

    async def submit(self, trajectories: Sequence[Trajectory], *, request_id: str | None = None,
                     dispatch_seqs: Mapping[str, int] | None = None) -> SubmitResult:
        """Coroutine form of PacerClient.submit."""
        return await self._run(self._submit(trajectories, request_id, dispatch_seqs))

    async def collect(
        self, num_groups: int, *, wait: float = 0.0, allow_partial: bool = False, request_id: str | None = None
    ) -> list[TrajectoryGroup]:
        """Coroutine form of PacerClient.collect (at-most-once as it is: a cancelled one, or one that ran out its
        deadline, logs a warning naming its request id; see there)."""
        result = await self.collect_result(num_groups, wait=wait, allow_partial=allow_partial, request_id=request_id)
        return result.groups

    async def collect_result(
        self, num_groups: int, *, wait: float = 0.0, allow_partial: bool = False, request_id: str | None = None,
        lease: float = 0.0, trainer_step: int | None = None, release_when_silent: bool = False,
        held_lease_ids: Sequence[str] = (), named_at_grant: bool = False,
    ) -> CollectResult:
        """Coroutine form of PacerClient.collect_result (a plain one cancelled, e.g. by asyncio.wait_for, or out of
        its deadline, logs the warning collect() describes)."""
        call = self._collect(num_groups, wait, allow_partial, request_id, lease, trainer_step, release_when_silent,
                             held_lease_ids, named_at_grant)
        try:
            return await self._run(call)
        except BaseException as cause:
            if _unsafe_collect(lease, request_id, cause):
                _collect_cut(call.request.request_id, cause)
            raise

    async def ack(self, lease_id: str, *, request_id: str | None = None) -> int:
        """Coroutine form of PacerClient.ack."""
        return await self._run(self._ack(lease_id, request_id))

    async def release(self, lease_id: str, *, request_id: str | None = None) -> int:
        """Coroutine form of PacerClient.release."""
        return await self._run(self._release(lease_id, request_id))

    @contextlib.asynccontextmanager
    async def collect_leased(
        self, num_groups: int, *, lease: float, wait: float = 0.0, allow_partial: bool = False
    ) -> AsyncIterator[list[TrajectoryGroup]]:
        """Coroutine form of PacerClient.collect_leased."""
        result = await self.collect_result(num_groups, wait=wait, allow_partial=allow_partial, lease=lease)
        try:
            yield result.groups
        except BaseException as exc:
            if result.lease_id:
                try:
                    await self.release(result.lease_id)
                except PacerClientError as failed:
                    _release_failed(result.lease_id, failed, exc)
            raise
        if result.lease_id:
            await self.ack(result.lease_id)

    def batches(
        self, mini_batch_size: int | None = None, *, group_size: int | None = None,
        lease: float = DEFAULT_LEASE_SECONDS, poll: float = DEFAULT_POLL_SECONDS,
        num_batches: int | str | None = None, mask_offpolicy: bool = False, token_budget: int | None = None,
        rank: int = 0, world_size: int = 1, step: int | None = None, reconnect: float = DEFAULT_RECONNECT_SECONDS,
        run: str = "",
    ) -> AsyncBatchIterator:
        """Async form of PacerClient.batches: `async with client.batches(128) as batches: async for batch in
        batches: ...` (the group size is asked from the server on the first iteration)."""
        return AsyncBatchIterator(self, mini_batch_size, group_size, lease=lease, poll=poll, num_batches=num_batches,
                                  mask_offpolicy=mask_offpolicy, token_budget=token_budget, rank=rank,
                                  world_size=world_size, step=step, reconnect=reconnect, run=run)

    async def reset(
        self,
        mode: ResetMode | str | None = None,
        *,
        wait: float | None = None,
        resume: bool = False,
        weight_version: int = 0,
        request_id: str | None = None,
    ) -> ResetResult:
        """Coroutine form of PacerClient.reset."""
        return await self._run(self._reset(mode, wait, resume, weight_version, request_id))

    async def resume(self, weight_version: int, *, request_id: str | None = None) -> ResumeResult:
        """Coroutine form of PacerClient.resume."""
        return await self._run(self._resume(weight_version, request_id))

    async def end_job(self, mode: ResetMode | str | None = None, *, wait: float = 60.0,
                      request_id: str | None = None) -> JobEndReport:
        """Coroutine form of PacerClient.end_job."""
        return await self._run(self._end_job(mode, wait, request_id))

    async def state(self) -> PacerState:
        """Coroutine form of PacerClient.state."""
        return await self._run(self._get_state())

    async def checkpoint(self, path: str | os.PathLike | None = None) -> Checkpoint:
        """Coroutine form of PacerClient.checkpoint (the file, with `path`, is written on a thread)."""
        if path is not None:
            check_writable_path(path)
        taken = await self._run(self._checkpoint())
        if path is not None:
            await asyncio.to_thread(write_atomically, path, taken.blob)
        return taken

    async def restore(self, checkpoint: Checkpoint | bytes | str | os.PathLike, *,
                      request_id: str | None = None) -> RestoreResult:
        """Coroutine form of PacerClient.restore."""
        return await self._run(self._restore(checkpoint, request_id))

    async def prompt_cursor(self) -> PromptCursor:
        """Coroutine form of PacerClient.prompt_cursor."""
        return await self._run(self._prompt_cursor())

    async def list_workers(self, client_id: str | None = None, *,
                           max_groups_per_worker: int = 0) -> list[WorkerHoldings]:
        """Coroutine form of PacerClient.list_workers."""
        return await self._run(self._list_workers(client_id, max_groups_per_worker))

    def watch(self) -> AsyncControlStream:
        """Async iterator of control events (`async for event in client.watch()`); cancel() or close() ends it."""
        stream = AsyncControlStream(self._watch_call(), self._reach, self._explain, self._first_event_within())
        self._track(stream)
        return stream

    async def close(self) -> None:
        """Ends open watch streams and closes the channel; the client cannot be used afterwards."""
        channel = self._detach()
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncPacerClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
