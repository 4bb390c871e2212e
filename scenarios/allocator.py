"""The C allocator's settings for an ``ldpsim`` process (glibc only): keep freed memory for reuse.

A run allocates and frees arrays of a cohort's size (0.1-1 MB) and of the population's (a few MB to a few
hundred) every round, on several threads. glibc's defaults hand such blocks back to the kernel as soon as
they are freed (``mmap``/``munmap`` above a threshold, trimming the top of each thread's heap beyond 128 kB),
so the next round takes a page fault for every 4 kB page again, and with several threads every unmap also
interrupts the other cores to flush their address translations. Measured on 3M devices x 31 rounds with two
threads (``benchmarks/bench_parallel.py``): a third of the process's CPU time was the kernel's (0.5-1.1 s), and
the settings below cut it to 0.2-0.4 s at ~40 MB more peak memory.

glibc also gives each thread that allocates a heap (an "arena") of its own. A run's threads hand arrays to one
another (a cohort thread computes the next day's values, the run's thread frees them a day later), so a freed
block went back to a heap that the next allocating thread might not use, and that thread touched fresh pages
instead. One arena for the process makes every freed block reusable by every thread: with two threads the
same run simulated 4-5% faster (median of 8 alternating runs each, 2.00 s against 2.10 s), unchanged on one
core. The threads allocate a few large arrays per cohort, so they rarely wait on the arena's lock. The cap binds
only arenas made after it, so it is set only in a process that has no other thread yet (the ``ldpsim`` program
and its workers call :func:`tune` first thing).

:func:`tune` is called once by the process that owns the run (the ``ldpsim`` program, its worker processes,
sweep workers), never on import: a library does not change its host's allocator. It does nothing where
glibc is absent, or where the user chose the allocator's settings (any ``MALLOC_*_`` or ``GLIBC_TUNABLES``
variable in the environment) or asked for the system's own (``LDPSIM_MALLOC=system``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8

#: blocks below this come from the heap, not from their own mapping (glibc's largest allowed value on 64-bit)
MMAP_THRESHOLD = 32 << 20
#: free memory at the top of a heap kept rather than given back
TRIM_THRESHOLD = 256 << 20
#: extra memory taken each time a heap grows
TOP_PAD = 64 << 20
#: heaps shared by all threads: one, so that a block freed by one thread is reused by the next to allocate
ARENA_MAX = 1

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
                  "GLIBC_TUNABLES")
_done: bool | None = None


def tune() -> bool:
    """Apply the settings of the module docstring once per process; whether they are in force."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("LDPSIM_MALLOC", "").lower() == "system" or any(k in os.environ for k in _USER_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting any of them fixes the others (glibc stops adjusting them itself)
    _done = all(mallopt(param, value) == 1 for param, value in
                ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    # the arena cap binds only arenas created from now on: in a process whose threads already have theirs (a
    # Dask worker running a sweep job) it would only make later threads take turns on the existing ones
    if _done and threading.active_count() == 1:
        mallopt(M_ARENA_MAX, ARENA_MAX)

    return _done
