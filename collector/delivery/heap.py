"""Keep the results client's freed page buffers in its heap, instead of faulting them in afresh.

A page of 4,096 completion lines is rendered into buffers of about 2 MiB
(the joined lines, the newline check, the token text). glibc's malloc hands
blocks that large back to the kernel when they are freed (mmap'd blocks are
unmapped; the top of the heap is trimmed), so every page touches ~600 fresh
4 KiB pages, and each page fault costs the kernel several microseconds on a
busy virtual machine (6 us measured on the 2-core bench host: about 0.4 us
of kernel CPU per output line, a tenth of the client's CPU).

`keep_freed_memory` raises glibc's mmap and trim thresholds for the process
that calls it, so those blocks are reused page after page (the process keeps
up to `TRIM_BYTES` of freed memory). `run.py results` calls it: the command
is a process of its own. A library caller (`ResultsClient`, the one-shot
batch) is left alone; a test that runs the command inside its own process
(tests/client_commands.py) takes the setting with it, which only keeps more
freed memory there. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 * 1024 * 1024  # blocks below this come from the heap (glibc's largest)
TRIM_BYTES = 128 * 1024 * 1024  # freed memory at the heap's top is kept up to this


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False (and nothing done) without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)
    )
