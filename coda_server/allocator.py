"""How much freed memory the C allocator keeps for the next large message (glibc's mallopt).

Every large Submit arrives as many small gRPC slices that the gRPC runtime copies, grows and copies again
into one `bytes` before our code sees it. With glibc's defaults each free at the top of the heap above
a small threshold is handed back to the kernel, so the next message faults the same pages in again:
on `bench/payload_path.py` the server's Submit throughput was about 30% higher with 8 MiB kept
(docs/operations.md, "Memory"). The cost is resident memory: up to about twice
`server.allocator_retain_bytes` of freed memory may stay in the process's RSS.
"""
from __future__ import annotations

import ctypes
import platform
from typing import Callable, Optional

# glibc's <malloc.h> parameter numbers (stable ABI since glibc 2.0).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
# mallopt takes a C int.
MAX_RETAIN_BYTES = 2**31 - 1


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
    threshold) and to grow the heap by that much at a time (top pad). 0 leaves the allocator's defaults.
    Returns whether the setting is in effect (`describe` says it in words, for the start-up log)."""
    if not retain_bytes:
        return False
    if not 0 < retain_bytes <= MAX_RETAIN_BYTES:
        raise ValueError(f"retain_bytes must be between 0 and {MAX_RETAIN_BYTES}, got {retain_bytes}")
    mallopt = mallopt or _glibc_mallopt()
    if mallopt is None:
        return False
    # Setting either also stops glibc's sliding mmap threshold: blocks over 128 KiB (a whole message) stay
    # in mmaps of their own, returned to the kernel exactly when freed, while the small slices gRPC
    # receives a message in come from the heap that is now kept.
    return all(mallopt(param, retain_bytes) for param in (M_TRIM_THRESHOLD, M_TOP_PAD))


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
