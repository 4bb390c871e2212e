"""scenarios/allocator.py: the ldpsim process keeps freed memory for reuse (glibc), and leaves the allocator
alone where the user chose its settings. Each case runs in its own interpreter (the settings are per process)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the allocator settings are glibc's; other C libraries are left alone")

#: a round of arrays of a cohort's size: 40 arrays of 1 MiB written, then freed; the page faults of each round
PROBE = """
import json, resource, sys
import numpy as np
from scenarios import allocator
tuned = allocator.tune() if sys.argv[1] == "tune" else None
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.ones(1 << 17) for _ in range(40)]
    del arrays
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""
PAGES = 40 * (1 << 20) // 4096  # the pages one round touches


def probe(mode: str, code: str = PROBE, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LDPSIM_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, env={**clean, **env}, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def test_tuned_process_reuses_freed_memory_without_page_faults():
    got = probe("tune")
    assert got["tuned"] is True
    assert got["faults"][0] >= PAGES // 2  # the first round maps its memory
    assert max(got["faults"][1:]) < PAGES // 20  # later rounds reuse it


#: a day's values handed between threads: one thread allocates and writes 24 MiB, the main thread frees it,
#: another thread allocates as much; how much the process grew meanwhile (bytes)
HANDOVER = """
import json, resource, sys, threading
import numpy as np
from scenarios import allocator
tuned = allocator.tune()
if sys.argv[1] == "arena per thread":  # the control: the settings, but glibc's heap per thread
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(allocator.M_ARENA_MAX, 8)
def resident():  # bytes of the process in memory
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
box, done = {}, threading.Event()
def make():  # a thread that stays alive (a pool's), with its own heap when there is one per thread
    np.ones(1000)
    box["a"] = np.ones(3 << 20)
    done.wait()
def again():
    np.ones(1000)
    before = resident()
    box["b"] = np.ones(3 << 20)
    box["grew"] = resident() - before
first = threading.Thread(target=make)
first.start()
while "a" not in box:
    pass
del box["a"]
second = threading.Thread(target=again)
second.start(); second.join()
done.set(); first.join()
print(json.dumps({"tuned": tuned, "grew": box["grew"]}))
"""


def test_tuned_process_reuses_a_block_freed_by_another_thread():
    """One heap for all threads (ARENA_MAX): the second thread writes the memory the first one touched, and the
    process does not grow. With a heap per thread it grows by the whole array (checked below)."""
    size = (3 << 20) * 8
    got = probe("tune", code=HANDOVER)
    assert got["tuned"] is True and got["grew"] < size // 20
    assert probe("arena per thread", code=HANDOVER)["grew"] >= size // 2


def test_untuned_process_maps_the_memory_again_every_round():
    """The default the settings fix (this is what makes the test above able to fail)."""
    got = probe("leave")
    assert min(got["faults"][1:]) >= PAGES // 2


@pytest.mark.parametrize("env", [{"LDPSIM_MALLOC": "system"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_user_choice_of_allocator_settings_is_left_alone(env):
    got = probe("tune", **env)
    assert got["tuned"] is False
    assert min(got["faults"][1:]) >= PAGES // 2


def test_ldpsim_program_tunes_its_process_and_python_callers_do_not():
    code = ("import sys; from scenarios import allocator, cli; sys.argv = ['ldpsim']; "
            "cli.main(['protocols']); print(allocator._done)")
    # called from Python with argv (the tests, a notebook): the host process is not changed
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "None"
    # the program itself (python -m scenarios.cli): tuned before the command runs
    code = ("import runpy, sys, atexit; from scenarios import allocator; "
            "atexit.register(lambda: print('tuned', allocator._done)); sys.argv = ['cli.py', 'protocols']; "
            "runpy.run_module('scenarios.cli', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "tuned True" in out.stdout
