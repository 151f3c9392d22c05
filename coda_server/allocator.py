"""How much freed memory the C allocator keeps for the next large message (glibc's mallopt).

Every large message costs fresh memory on its way: a Submit arrives as many small gRPC slices that the gRPC
runtime copies into one `bytes`, and each message of a Collect answer is joined into one `bytes` that gRPC
copies again. With glibc's defaults the blocks of a whole message get mmaps of their own and every free at the
top of the heap above a small threshold is handed back to the kernel, so each message faults its pages in
anew, which costs more than the copies: on `bench/payload_path.py` the server's Submit throughput was about 30%
higher with 8 MiB kept, and its CPU for `batches()` fell from about 160 to 115 ms per 100 MB once blocks up to
that size came from the kept heap (docs/operations.md, "Memory"). The cost is resident memory: up to about
twice `server.allocator_retain_bytes` of freed memory may stay in the process's RSS. Memory freed in the
middle of the heap (held trajectories the trainer took) is handed back by `HeapTrimmer` once the bytes held
have fallen far enough.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers (stable ABI since glibc 2.0).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# The largest mmap threshold every glibc takes on 64-bit (HEAP_MAX_SIZE / 2; older versions refuse more).
MAX_MMAP_THRESHOLD = 32 * 2**20
# mallopt takes a C int.
MAX_RETAIN_BYTES = 2**31 - 1
# A trim once the bytes held fall to this fraction of their high mark: a drain, not the ebb and flow of a step
# (held bytes swing by half when the trainer takes a step of a window twice as large), where the heap's free
# pages are reused by the next Submits and trimming them would only fault them in again.
TRIM_BELOW_FRACTION = 8


def _glibc_mallopt() -> Optional[Callable[[int, int], int]]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None  # e.g. musl (Alpine) or macOS: no glibc heap to tune
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def retain_freed_memory(retain_bytes: int, mallopt: Optional[Callable[[int, int], int]] = None) -> bool:
    """Asks the allocator to keep up to `retain_bytes` of freed memory at the top of the heap (trim
    threshold), to grow the heap by that much at a time (top pad) and to serve blocks up to that size (at most
    32 MiB) from the heap (mmap threshold). 0 leaves the allocator's defaults.
    Returns whether the setting is in effect (`describe` says it in words, for the start-up log)."""
    if not retain_bytes:
        return False
    if not 0 < retain_bytes <= MAX_RETAIN_BYTES:
        raise ValueError(f"retain_bytes must be between 0 and {MAX_RETAIN_BYTES}, got {retain_bytes}")
    mallopt = mallopt or _glibc_mallopt()
    if mallopt is None:
        return False
    # The mmap threshold too: a message up to what is kept comes from the kept heap and goes back to it (glibc
    # would otherwise fix the threshold at 128 KiB once the others are set, mapping and faulting in every
    # message anew); a larger one still gets an mmap of its own, returned to the kernel when freed.
    return all(mallopt(param, value) for param, value in ((M_TRIM_THRESHOLD, retain_bytes), (M_TOP_PAD, retain_bytes),
                                                          (M_MMAP_THRESHOLD, min(retain_bytes, MAX_MMAP_THRESHOLD))))


def describe(retain_bytes: int, applied: bool) -> str:
    """What `retain_freed_memory(retain_bytes)` did, in one sentence."""
    if not retain_bytes:
        return "allocator: glibc's defaults (server.allocator_retain_bytes is 0)"
    if applied:
        return (f"allocator: keeping up to {retain_bytes / 2**20:g} MiB of freed memory for the next large "
                f"message (server.allocator_retain_bytes)")
    if _glibc_mallopt() is None:
        libc = "-".join(filter(None, platform.libc_ver())) or platform.system()
        return f"allocator: server.allocator_retain_bytes has no effect here: the C library is not glibc ({libc})"
    return "allocator: glibc refused server.allocator_retain_bytes; running with its defaults"


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    if _glibc_mallopt() is None:
        return None
    malloc_trim = ctypes.CDLL(None).malloc_trim
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return malloc_trim


class HeapTrimmer:
    """Hands the heap's free pages back to the kernel once the trajectories held have fallen to an eighth of their
    high mark (and by at least what is kept): the kept heap then serves messages without faulting, yet memory
    that held trajectories the trainer has taken does not stay resident after a drain. glibc's malloc_trim runs in a
    thread of its own (it walks the whole heap), at most one at a time."""

    def __init__(self, retain_bytes: int, malloc_trim: Optional[Callable[[int], int]] = None,
                 start: Optional[Callable[[Callable[[], None]], None]] = None):
        """`start(run)` runs `run` in another thread; the server defers it until the call that released the
        bytes has let go of them (the event loop's next turn)."""
        self._retain_bytes = retain_bytes
        self._malloc_trim = malloc_trim or _glibc_malloc_trim()
        self._start = start or in_a_thread
        self._high_mark = 0  # the most bytes held since the last trim
        self._trimming = False
        self.trims = 0  # trims started

    def held_bytes_changed(self, total: int) -> None:
        """Follows the bytes held (HeldBytes.watch); starts a trim when they have fallen far enough."""
        if total > self._high_mark:
            self._high_mark = total
        elif (total <= self._high_mark // TRIM_BELOW_FRACTION and self._high_mark - total >= self._retain_bytes
              and not self._trimming and self._malloc_trim is not None):
            fell_from, self._high_mark = self._high_mark, total
            self._trimming = True
            self.trims += 1
            try:
                self._start(lambda: self._trim(fell_from, total))
            except RuntimeError:  # the event loop has closed (shutting down): nothing left to trim for
                self._trimming = False

    def _trim(self, fell_from: int, fell_to: int) -> None:
        try:
            started = time.perf_counter()
            self._malloc_trim(self._retain_bytes)  # keeps what the top of the heap may keep anyway
            log.debug("allocator: freed heap pages handed back to the kernel in %.1f ms (held bytes fell from "
                      "%d to %d)", (time.perf_counter() - started) * 1e3, fell_from, fell_to)
        finally:
            self._trimming = False


def in_a_thread(run: Callable[[], None]) -> None:
    threading.Thread(target=run, name="coda-heap-trim", daemon=True).start()
