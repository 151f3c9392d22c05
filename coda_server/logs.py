"""Log formats (text or JSON, by server.log_format) and the per-RPC access log, written in batches.

* `configure_logging` installs the `server.log_format` formatter; structured lines pass their figures as
  `extra=fields(...)`, shown as JSON keys (the text message already says them).
* `AccessLog` writes the one-line-per-RPC log of the logger `coda_server.rpc`. Going through `logging`
  costs about 30 us of the event loop per line, a tenth of what a small RPC costs the whole server, so
  calls are noted in a list and formatted and written together, in one write, at most
  `ACCESS_LOG_FLUSH_SECONDS` later (and at shutdown). Each line carries the time its call ended, in the
  same format as every other line of the server.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any, Callable, Optional

rpc_log = logging.getLogger("coda_server.rpc")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Noted calls are written at most this long after the first of them...
ACCESS_LOG_FLUSH_SECONDS = 0.05
# ...or as soon as this many are waiting.
ACCESS_LOG_MAX_PENDING = 1024


def fields(**values: Any) -> dict[str, Any]:
    """`extra=` for a structured log line: the figures become keys of the JSON line."""
    return {"fields": values}


def json_line(created: float, level: str, logger: str, message: str, values: Optional[dict[str, Any]] = None,
              exc: Optional[str] = None) -> str:
    """One JSON log line: ts (UTC, ms), level, logger, msg, then the line's fields."""
    entry: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z",
        "level": level,
        "logger": logger,
        "msg": message,
    }
    if values:
        entry.update(values)
    if exc:
        entry["exc"] = exc
    return json.dumps(entry, default=str, separators=(",", ":"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see `json_line`)."""

    def format(self, record: logging.LogRecord) -> str:
        return json_line(record.created, record.levelname, record.name, record.getMessage(),
                         getattr(record, "fields", None),
                         self.formatException(record.exc_info) if record.exc_info else None)


def configure_logging(log_format: str, level: str) -> None:
    """Give every root handler the `server.log_format` formatter and set the level."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in root.handlers:
        handler.setFormatter(formatter)
    root.setLevel(str(level).upper())


# A text line of the access log: TEXT_FORMAT's, with AccessLog._message as its message.
_TEXT_LINE = "%s,%03d INFO %s: %s %s %.3fms%s%s%s%s peer=%s\n"


class AccessLog:
    """The per-RPC lines of one server: noted on the event loop, formatted and written in batches."""

    def __init__(self, log_format: str, logger: logging.Logger = rpc_log,
                 flush_seconds: float = ACCESS_LOG_FLUSH_SECONDS, max_pending: int = ACCESS_LOG_MAX_PENDING,
                 clock: Callable[[], float] = time.time):
        self._clock = clock  # wall-clock seconds, as LogRecord.created
        self._json = log_format == "json"
        self._logger = logger
        self._flush_seconds = flush_seconds
        self._max_pending = max_pending
        self._pending: list[tuple] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._second = -1  # the whole second _second_text spells (text format)
        self._second_text = ""
        # Whether lines are written now (the logger's level may change while serving); asked on every call,
        # so a C-level partial: no Python frame of its own.
        self.enabled: Callable[[], bool] = functools.partial(logger.isEnabledFor, logging.INFO)


    def note(self, service: str, method: str, code: str, elapsed: float, request_id: str, peer: str,
             client_id: str = "") -> None:
        """One finished call; written within ACCESS_LOG_FLUSH_SECONDS. Call on the event loop."""
        self._pending.append((self._clock(), service, method, code, elapsed, request_id, peer, client_id))
        if len(self._pending) >= self._max_pending:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._flush_seconds, self.flush)

    def flush(self) -> None:
        """Write every noted call now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        block: Optional[str] = None
        for handler in self._handlers():
            if isinstance(handler, logging.StreamHandler):  # the server's own handlers: one write per batch
                if block is None:
                    block = "".join([self._line(entry) for entry in pending])
                handler.acquire()
                try:
                    handler.stream.write(block)
                    handler.flush()
                except Exception:
                    handler.handleError(self._record(pending[0]))
                finally:
                    handler.release()
            else:  # a handler someone else configured gets ordinary records
                for entry in pending:
                    handler.handle(self._record(entry))

    def _handlers(self) -> list[logging.Handler]:
        """The handlers an INFO record of the logger reaches (the logger's own, then its ancestors')."""
        handlers: list[logging.Handler] = []
        logger: Optional[logging.Logger] = self._logger
        while logger is not None:
            handlers.extend(h for h in logger.handlers if h.level <= logging.INFO)
            logger = logger.parent if logger.propagate else None
        return handlers

    @staticmethod
    def _message(entry: tuple) -> str:
        _, _, method, code, elapsed, request_id, peer, client_id = entry
        text = f"{method} {code} {elapsed * 1000.0:.3f}ms"
        if request_id:
            text += f" request_id={request_id}"
        if client_id:
            text += f" client={client_id}"
        return f"{text} peer={peer}"

    @staticmethod
    def _values(entry: tuple) -> dict[str, Any]:
        _, service, method, code, elapsed, request_id, peer, client_id = entry
        values: dict[str, Any] = {"event": "rpc", "service": service, "method": method, "code": code,
                                  "duration_ms": round(elapsed * 1000.0, 3)}
        if request_id:
            values["request_id"] = request_id
        if client_id:
            values["client_id"] = client_id
        values["peer"] = peer
        return values

    def _line(self, entry: tuple) -> str:
        """The line the server's formatter writes (`json_line`, or TEXT_FORMAT with the timestamp's whole
        second spelled once per second)."""
        if self._json:
            return json_line(entry[0], "INFO", self._logger.name, self._message(entry), self._values(entry)) + "\n"
        created, _, method, code, elapsed, request_id, peer, client_id = entry
        second = int(created)
        if second != self._second:
            self._second, self._second_text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        # `_message` within the line, in one %-format: half the work of formatting the message and the line apart.
        return _TEXT_LINE % (self._second_text, int(created * 1000) % 1000, self._logger.name, method, code,
                             elapsed * 1000.0, " request_id=" if request_id else "", request_id,
                             " client=" if client_id else "", client_id, peer)

    def _record(self, entry: tuple) -> logging.LogRecord:
        record = self._logger.makeRecord(self._logger.name, logging.INFO, __file__, 0, "%s", (self._message(entry),),
                                         None, extra={"fields": self._values(entry)})
        record.created = entry[0]
        record.msecs = int(entry[0] * 1000) % 1000
        return record
