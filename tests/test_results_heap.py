"""`run.py results` reuses its freed page buffers instead of faulting fresh memory in per page.

collector/delivery/heap.py `keep_freed_memory` raises glibc's mmap and trim
thresholds. Counted in page faults (not time, which follows the load): a
process that allocates and frees two 2 MiB buffers per page (the lines, the
newline check) faults them in afresh without it (glibc trims the heap's top
once more than twice its mmap threshold is free there), and once in all with it. Run in a child process:
the setting is process-wide.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = 40

PROBE = f"""
import resource, sys
from collector.delivery.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
parts = [bytes(range(256)) * 8 for _ in range(1024)]  # 2 MiB in 1,024 lines
before = 0
for number in range({PAGES} + 1):  # the first page is faulted in either way
    page = b"".join(parts)  # the lines, and a second buffer as large (the newline check)
    check = page.replace(b"\\x00", b"\\x01")
    del page, check
    before = before or resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    answer = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True
    )
    kept, count = answer.stdout.split()
    return kept, int(count)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_page_buffers_are_reused_not_faulted_in_per_page():
    _, plain = faults("plain")
    kept, reused = faults("keep")
    assert kept == "True"
    assert plain > PAGES * 256  # 2 x 2 MiB = 1,024 pages of 4 KiB, faulted in per page
    assert reused < 256  # reused: at most a few pages of incidental growth


def test_results_command_keeps_freed_memory():
    import inspect

    from cli.results import results_command

    assert "keep_freed_memory()" in inspect.getsource(results_command)
