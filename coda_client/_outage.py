"""Logging of the pacer's outages as a client sees them: one line as an outage begins, one as it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any


class OutageLog:
    """Logs each outage of the pacer once: the first failure as a warning (`began`, saying what the caller does
    meanwhile), the attempts that follow at debug level (`attempt`), and the first answer after it at info level with
    how long the server was away. A server that is down would otherwise log a line at every retry, every few seconds
    for as long as it stays down.

    `began` and `attempt` are texts in which `{reason}` stands for the failure, `back` one in which `{seconds}` stands
    for the time away (put in by replacement, not str.format: a worker id or an address may hold braces).
    `extra`: the fields each record carries (structured logs).
    """

    def __init__(self, logger: logging.Logger, *, began: str, attempt: str, back: str,
                 extra: Mapping[str, Any] | None = None) -> None:
        self.logger = logger
        self.began = began
        self.attempt = attempt
        self.back = back
        self.extra = dict(extra or {})
        self.since: float | None = None  # monotonic time the outage began; None while the server answers
        self.answered_once = False  # the server has answered at least once
        self._warned: set[str | None] = set()  # the kinds of failure warned of in this outage

    def failed(self, reason: object, kind: str | None = None) -> None:
        """A call (or the control stream) failed because the server is away. `kind`: the sort of failure when it is
        known (e.g. a failed TLS handshake): a kind not yet warned of in this outage is warned of too, so that a
        server that was down and comes back with a certificate this client refuses is not left at debug level."""
        if self.since is None:
            self.since = time.monotonic()
            self._warned = {kind}
            self.logger.warning(self.began.replace("{reason}", str(reason)), extra=self.extra)
        elif kind is not None and kind not in self._warned:
            self._warned.add(kind)
            self.logger.warning(self.attempt.replace("{reason}", str(reason)), extra=self.extra)
        else:
            self.logger.debug(self.attempt.replace("{reason}", str(reason)), extra=self.extra)

    def answered(self) -> None:
        """The server answered: ends the outage, if one is on."""
        self.answered_once = True
        if self.since is not None:
            seconds = time.monotonic() - self.since
            self.since = None
            self.logger.info(self.back.replace("{seconds}", f"{seconds:.1f}"), extra=self.extra)
