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
from coda_client import PacerClient, Trajectory, TrajectoryStatus
from server_harness import ServerProcess, until

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
    assert calls == [(allocator.M_TRIM_THRESHOLD, 1 << 25), (allocator.M_TOP_PAD, 1 << 25),
                     (allocator.M_MMAP_THRESHOLD, 1 << 25)]
    calls.clear()  # older glibc refuses an mmap threshold over 32 MiB: blocks up to that come from the kept heap
    assert allocator.retain_freed_memory(1 << 27, mallopt=lambda param, value: calls.append((param, value)) or 1)
    assert calls[-1] == (allocator.M_MMAP_THRESHOLD, allocator.MAX_MMAP_THRESHOLD)


def test_zero_leaves_the_allocator_alone_and_a_refusal_is_reported():
    calls = []
    assert not allocator.retain_freed_memory(0, mallopt=lambda param, value: calls.append(param) or 1)
    assert calls == [] and "defaults" in allocator.describe(0, False)
    assert not allocator.retain_freed_memory(1 << 20, mallopt=lambda param, value: 0)
    if GLIBC:
        assert "refused" in allocator.describe(1 << 20, False)


# What both scripts below start with: glibc's malloc and free, the process's RSS, the setting from argv[1].
_WITH_SETTING = textwrap.dedent("""
    import ctypes, sys
    from coda_server import allocator
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    allocator.retain_freed_memory(int(sys.argv[1]))
""")

# Frees 24 MiB of 64 KiB blocks (below glibc's mmap threshold: they come from the heap) and reports how
# much of it the process still holds: glibc's defaults hand it back, a retain setting keeps it.
_FREED_AND_KEPT = _WITH_SETTING + textwrap.dedent("""
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


# Allocates, touches and frees one 6 MiB block (a large message: over glibc's first mmap threshold) and
# reports how much of it the process handed back to the kernel when it was freed.
_LARGE_BLOCK_RETURNED = _WITH_SETTING + textwrap.dedent("""
    block = libc.malloc(6 << 20)
    ctypes.memset(block, 1, 6 << 20)
    before_free = rss()
    libc.free(block)
    print(before_free - rss())
""")


@pytest.mark.skipif(not GLIBC, reason="glibc only: elsewhere the setting has no effect")
def test_a_large_message_is_served_from_the_kept_heap_when_it_fits():
    def returned_to_kernel(retain: int) -> int:
        out = subprocess.run([sys.executable, "-c", _LARGE_BLOCK_RETURNED, str(retain)], capture_output=True,
                             text=True, check=True)
        return int(out.stdout)

    assert returned_to_kernel(0) >= 5 << 20  # defaults: a block of its own (mmap), unmapped when freed
    assert returned_to_kernel(8 << 20) < 1 << 20  # kept: the next message of that size faults nothing in
    assert returned_to_kernel(4 << 20) >= 5 << 20  # larger than what is kept: still a block of its own


def test_a_trim_starts_once_held_bytes_fall_to_an_eighth_of_their_high_mark_by_what_is_kept():
    assert allocator.TRIM_BELOW_FRACTION == 8
    runs = []
    too_little = allocator.HeapTrimmer(4 << 20, malloc_trim=lambda pad: 1, start=runs.append)
    too_little.held_bytes_changed(3 << 20)
    too_little.held_bytes_changed(0)  # fell by less than what is kept: the top of the heap keeps that anyway
    assert runs == []

    trims = []
    trimmer = allocator.HeapTrimmer(4 << 20, malloc_trim=lambda pad: trims.append(pad) or 1, start=runs.append)
    for total in (80 << 20, 40 << 20, 60 << 20, 20 << 20, 11 << 20):  # a step's ebb and flow, still above 10 MiB
        trimmer.held_bytes_changed(total)
    assert runs == []
    trimmer.held_bytes_changed(10 << 20)
    assert len(runs) == 1 and trimmer.trims == 1
    trimmer.held_bytes_changed(0)  # the first trim has not run yet: at most one at a time
    assert len(runs) == 1
    runs[0]()
    assert trims == [4 << 20]  # the top of the heap keeps what the setting keeps anyway
    trimmer.held_bytes_changed(0)  # the high mark is 10 MiB, where the trim started: fell by 10 MiB
    assert len(runs) == 2


def test_a_release_after_the_event_loop_closed_still_succeeds_without_a_trim():
    def closed_loop(run):
        raise RuntimeError("Event loop is closed")

    trimmer = allocator.HeapTrimmer(1 << 20, malloc_trim=lambda pad: 1, start=closed_loop)
    trimmer.held_bytes_changed(8 << 20)
    trimmer.held_bytes_changed(0)  # the core's release goes on; the trimmer is ready for the next fall
    assert trimmer.trims == 1
    trimmer.held_bytes_changed(8 << 20)
    trimmer.held_bytes_changed(0)
    assert trimmer.trims == 2


# Frees 24 MiB of 1 MiB blocks from the heap, under a block that keeps the top of the heap in use (as a newer
# Submit does), then lets HeapTrimmer follow held bytes falling from 24 MiB to 0; prints what the free and
# then the trim handed back to the kernel.
_TRIMMED = _WITH_SETTING + textwrap.dedent("""
    blocks = []
    for _ in range(24):
        block = libc.malloc(1 << 20)
        ctypes.memset(block, 1, 1 << 20)
        blocks.append(block)
    top = libc.malloc(512 << 10)  # no free block fits it yet: it comes from the top, above the others
    before_free = rss()
    for block in blocks:
        libc.free(block)
    after_free = rss()
    trimmer = allocator.HeapTrimmer(int(sys.argv[1]), start=lambda run: run())
    trimmer.held_bytes_changed(24 << 20)
    trimmer.held_bytes_changed(0)
    print(before_free - after_free, after_free - rss())
""")


@pytest.mark.skipif(not GLIBC, reason="glibc only: elsewhere the setting has no effect")
def test_the_trim_hands_back_memory_freed_under_the_top_of_the_heap():
    out = subprocess.run([sys.executable, "-c", _TRIMMED, str(8 << 20)], capture_output=True, text=True, check=True)
    freed, trimmed = map(int, out.stdout.split())
    assert freed < 4 << 20  # the free alone keeps it resident: the top of the heap is in use
    assert trimmed >= 20 << 20


@pytest.mark.skipif(not GLIBC, reason="glibc only: elsewhere the setting has no effect")
def test_a_live_server_trims_its_heap_once_the_trainer_has_taken_what_it_held(tmp_path):
    with ServerProcess(tmp_path, "server.allocator_retain_bytes=1048576", "server.log_level=DEBUG",
                       "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                       "trainer.mini_batch_size=4") as server:
        with PacerClient(server.address, timeout=30) as client:
            assert client.dispatch(["p0", "p1"]).admitted == ["p0", "p1"]
            client.submit([Trajectory(trajectory_id=f"{p}/{i}", prompt_id=p, status=TrajectoryStatus.COMPLETED,
                                      payload=bytes([i]) * (1 << 20)) for p in ("p0", "p1") for i in range(2)])
            assert "handed back to the kernel" not in server.log()
            result = client.collect_result(2, wait=10, lease=60)
            assert sum(len(group.trajectories) for group in result.groups) == 4
            client.ack(result.lease_id)
            until(lambda: "handed back to the kernel" in server.log(), "the heap trim after the Ack")


def test_the_server_says_at_start_up_what_applied(tmp_path):
    with ServerProcess(tmp_path, "server.allocator_retain_bytes=16777216") as server:
        pass
    expected = "keeping up to 16 MiB of freed memory" if GLIBC else "has no effect here"
    assert expected in server.log()
