"""The access log writes, in batches, exactly the per-RPC lines `logging` would write one by one."""
from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from coda_server.logs import TEXT_FORMAT, AccessLog, JsonFormatter

CALLS = [
    # (service, method, code, elapsed seconds, request_id, peer, client_id)
    ("coda.pacer.v1.RolloutPacer", "Dispatch", "OK", 0.000412, "abc", "ipv4:127.0.0.1:5000", "worker-7"),
    ("coda.pacer.v1.RolloutPacer", "GetState", "OK", 0.0015, "", "ipv6:[::1]:5001", ""),
    ("coda.pacer.v1.RolloutPacer", "Submit", "INVALID_ARGUMENT", 1.25, 'quote"and\\slash', "unix:/tmp/x \u00e9", ""),
    ("coda.pacer.v1.RolloutPacer", "KeepAlive", "OK", 0.0009999, "", "ipv4:127.0.0.1:5002", "w-2"),
]


@pytest.fixture
def logger():
    """A private logger with one stream handler, as the server's root logger has."""
    logger = logging.getLogger("test_access_log.rpc")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.handlers[:] = [handler]
    yield logger, handler, stream
    logger.handlers[:] = []


def expected_lines(logger: logging.Logger, formatter: logging.Formatter, calls, times) -> list[str]:
    """What logging itself writes for these calls: the reference the access log must match."""
    lines = []
    for (service, method, code, elapsed, request_id, peer, client_id), created in zip(calls, times):
        text = f"{method} {code} {elapsed * 1000.0:.3f}ms" + (f" request_id={request_id}" if request_id else "")
        text += f" client={client_id}" if client_id else ""
        values = {"event": "rpc", "service": service, "method": method, "code": code,
                  "duration_ms": round(elapsed * 1000.0, 3)}
        if request_id:
            values["request_id"] = request_id
        if client_id:
            values["client_id"] = client_id
        values["peer"] = peer
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s peer=%s", (text, peer), None,
                                   extra={"fields": values})
        record.created, record.msecs = created, int(created * 1000) % 1000
        lines.append(formatter.format(record))
    return lines


@pytest.mark.parametrize("log_format, formatter", [("text", logging.Formatter(TEXT_FORMAT)), ("json", JsonFormatter())])
def test_batched_lines_equal_what_logging_writes(logger, log_format, formatter):
    logger, handler, stream = logger
    handler.setFormatter(formatter)
    noted_at = [1767607201.002, 1767607201.999, 1767607202.5, 1767607202.0004]  # two in one second, two in the next
    times = iter(noted_at)
    access_log = AccessLog(log_format, logger=logger, clock=lambda: next(times))

    async def note_all() -> None:
        for call in CALLS:
            access_log.note(*call)
        assert stream.getvalue() == ""  # noted, not yet written
        access_log.flush()

    asyncio.run(note_all())
    assert stream.getvalue().splitlines() == expected_lines(logger, formatter, CALLS, noted_at)
    if log_format == "json":
        assert [json.loads(line)["request_id"] for line in stream.getvalue().splitlines()[:3:2]] == ["abc", CALLS[2][4]]


def test_lines_are_written_without_an_explicit_flush(logger):
    logger, handler, stream = logger
    access_log = AccessLog("text", logger=logger, flush_seconds=0.0)

    async def note_and_let_the_loop_run() -> None:
        access_log.note(*CALLS[0])
        assert stream.getvalue() == ""
        for _ in range(3):  # a timer of 0 s fires within the next loop iterations
            await asyncio.sleep(0)

    asyncio.run(note_and_let_the_loop_run())
    assert stream.getvalue().count("Dispatch OK 0.412ms request_id=abc") == 1


def test_a_full_batch_is_written_at_once(logger):
    logger, handler, stream = logger
    access_log = AccessLog("text", logger=logger, max_pending=2)

    async def note_two() -> None:
        access_log.note(*CALLS[0])
        assert stream.getvalue() == ""
        access_log.note(*CALLS[1])
        assert len(stream.getvalue().splitlines()) == 2
        access_log.flush()  # nothing left: writes nothing more

    asyncio.run(note_two())
    assert len(stream.getvalue().splitlines()) == 2


def test_other_handlers_get_ordinary_records_and_levels_are_respected(logger):
    logger, handler, stream = logger
    records: list[logging.LogRecord] = []

    class Collecting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    quiet = logging.StreamHandler(io.StringIO())
    quiet.setLevel(logging.WARNING)  # an INFO line must not reach it
    logger.addHandler(Collecting())
    logger.addHandler(quiet)
    access_log = AccessLog("text", logger=logger)

    async def note_and_flush() -> None:
        access_log.note(*CALLS[1])
        access_log.flush()

    asyncio.run(note_and_flush())
    assert [r.getMessage() for r in records] == ["GetState OK 1.500ms peer=ipv6:[::1]:5001"]
    assert records[0].fields["method"] == "GetState" and records[0].levelno == logging.INFO
    assert quiet.stream.getvalue() == ""
    assert "GetState OK 1.500ms" in stream.getvalue()


def test_the_observer_asks_a_request_for_its_request_id_only_if_its_message_declares_one(logger):
    from coda_client._proto import pacer_pb2 as pb
    from coda_server.observability import GrpcServerMetrics, MethodObserver
    from prometheus_client import CollectorRegistry

    logger, handler, stream = logger
    access_log = AccessLog("text", logger=logger)
    metrics = GrpcServerMetrics(CollectorRegistry())

    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:5000"

        def code(self) -> None:
            return None

    class Watched:
        """A request that records the attributes asked of it (a missing one raises, as a message's does)."""

        def __init__(self, request):
            self.request, self.asked = request, []

        def __getattr__(self, name):
            self.asked.append(name)
            return getattr(self.request, name)

    async def one_call_each() -> tuple[Watched, Watched]:
        context = Context()
        dispatch, get_state = Watched(pb.DispatchRequest(request_id="abc")), Watched(pb.GetStateRequest())
        for method, request in (("Dispatch", dispatch), ("GetState", get_state)):
            observer = MethodObserver(metrics, "unary", f"/coda.pacer.v1.RolloutPacer/{method}", access_log)
            observer.end(observer.begin(context), context, request, None)
        access_log.flush()
        return dispatch, get_state

    dispatch, get_state = asyncio.run(one_call_each())
    assert dispatch.asked == ["request_id"] and get_state.asked == []
    lines = stream.getvalue().splitlines()
    assert "Dispatch OK" in lines[0] and "request_id=abc" in lines[0]
    assert "GetState OK" in lines[1] and "request_id" not in lines[1]
