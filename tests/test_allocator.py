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


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LDPSIM_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, env={**clean, **env}, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def test_tuned_process_reuses_freed_memory_without_page_faults():
    got = probe("tune")
    assert got["tuned"] is True
    assert got["faults"][0] >= PAGES // 2  # the first round maps its memory
    assert max(got["faults"][1:]) < PAGES // 20  # later rounds reuse it


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
