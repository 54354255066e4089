"""glibc's allocator settings: a pinned mmap threshold gives freed buffers back, for the length of a block."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

_RETAINED = textwrap.dedent("""
    import contextlib, sys
    from pipelines.glibc import mmap_threshold_pinned

    def anon_mb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    if sys.argv[1] == "after":
        with mmap_threshold_pinned():
            pass
    with mmap_threshold_pinned() if sys.argv[1] == "pinned" else contextlib.nullcontext():
        big = bytearray(8 << 20)
        del big  # glibc now takes blocks under 8 MB from the heap, unless the threshold is pinned
        before = anon_mb()
        blocks = [bytearray(4 << 20) for _ in range(32)]
        del blocks[:-1]  # the last block stays, above the others on the heap
        print(anon_mb() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's mallopt")
def test_a_pinned_mmap_threshold_gives_freed_buffers_back_for_the_length_of_the_block(tmp_path):
    """Why the multi-worker driver pins the threshold: its data-plane buffers stayed resident when freed."""
    def retained_mb(mode: str) -> float:
        # A clean environment: no MALLOC_* settings or preloaded allocator from the test run.
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
        out = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True,
                             env=env)
        return float(out.stdout)

    assert retained_mb("default") > 100  # 31 freed 4 MB blocks kept on the heap
    assert retained_mb("pinned") < 16  # each was its own mapping, gone when freed
    # After the block the threshold is glibc's ceiling (32 MiB): heap blocks again, for speed.
    assert retained_mb("after") > 100
