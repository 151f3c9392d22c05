"""server.allocator_retain_bytes: validation, what is asked of glibc, that glibc then keeps freed memory,
and that a real server says at start-up what applied."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from coda_server import allocator
from coda_server.core import ConfigError, load_config
from server_harness import ServerProcess

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize("value", ["-1", "2147483648", "1.5", "lots"])
def test_a_bad_value_names_the_key_and_the_allowed_range(value):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"server.allocator_retain_bytes={value}"])
    message = str(info.value)
    assert "server.allocator_retain_bytes" in message and value in message and "0" in message and "2147483647" in message


def test_the_trim_threshold_and_the_top_pad_are_both_set():
    calls = []
    assert allocator.retain_freed_memory(1 << 25, mallopt=lambda param, value: calls.append((param, value)) or 1)
    assert calls == [(allocator.M_TRIM_THRESHOLD, 1 << 25), (allocator.M_TOP_PAD, 1 << 25)]


def test_zero_leaves_the_allocator_alone_and_a_refusal_is_reported():
    calls = []
    assert not allocator.retain_freed_memory(0, mallopt=lambda param, value: calls.append(param) or 1)
    assert calls == [] and "defaults" in allocator.describe(0, False)
    assert not allocator.retain_freed_memory(1 << 20, mallopt=lambda param, value: 0)
    if GLIBC:
        assert "refused" in allocator.describe(1 << 20, False)


# Frees 24 MiB of 64 KiB blocks (below glibc's mmap threshold: they come from the heap) and reports how
# much of it the process still holds: glibc's defaults hand it back, a retain setting keeps it.
_FREED_AND_KEPT = textwrap.dedent("""
    import ctypes, sys
    from coda_server import allocator
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    allocator.retain_freed_memory(int(sys.argv[1]))
    blocks = []
    for _ in range(384):
        block = libc.malloc(65536)
        ctypes.memset(block, 1, 65536)  # touched: resident
        blocks.append(block)
    before_free = rss()
    for block in reversed(blocks):
        libc.free(block)
    print(before_free - rss())
""")


@pytest.mark.skipif(not GLIBC, reason="glibc only: elsewhere the setting has no effect")
def test_glibc_keeps_freed_memory_only_when_asked():
    def returned_to_kernel(retain: int) -> int:
        out = subprocess.run([sys.executable, "-c", _FREED_AND_KEPT, str(retain)], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)

    assert returned_to_kernel(0) > 16 << 20  # defaults: most of the 24 MiB goes back
    assert returned_to_kernel(64 << 20) < 4 << 20  # kept for the next message


def test_the_server_says_at_start_up_what_applied(tmp_path):
    with ServerProcess(tmp_path, "server.allocator_retain_bytes=16777216") as server:
        pass
    expected = "keeping up to 16 MiB of freed memory" if GLIBC else "has no effect here"
    assert expected in server.log()
