"""A sweep's worker processes exit when their parent dies, even by SIGKILL (no orphaned workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds orphaned sweep workers through /proc, which only Linux has")
def test_sweep_workers_exit_when_the_parent_is_killed(tmp_path) -> None:
    cmd = [sys.executable, "-m", "scenarios.cli", "sweep", "quickstart", "--grid", "protocol.epsilon=0.5,1,2,4",
           "--repeat", "20", "--workers", "2", "--out", str(tmp_path / "sweep"), "--set", "population.devices=200000"]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            workers = [p for p in _children(parent.pid) if _alive(p)]
        assert len(workers) >= 2, "the sweep did not start its workers"
        time.sleep(1.0)  # let the workers get into their runs
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "workers outlived their killed parent"
    finally:
        parent.kill()
        for p in _children(parent.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_a_terminated_sweep_stops_its_workers_names_what_it_kept_and_leaks_nothing(tmp_path) -> None:
    """SIGTERM (a scheduler's or a container's stop) is handled as Ctrl-C: the workers are stopped, one line
    says how many runs runs.jsonl keeps and that the same command resumes, exit status 143, and no
    multiprocessing resource is left behind (Python's resource tracker warned of leaked semaphores when the
    default handler ended the process on the spot)."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "scenarios.cli", "sweep", "quickstart", "--grid", "protocol.epsilon=0.5,1,2,4",
           "--repeat", "20", "--workers", "2", "--out", str(out), "--set", "population.devices=200000", "--quiet"]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and parent.poll() is None and not (
                (out / "runs.jsonl").exists() and (out / "runs.jsonl").read_text().count("\n") >= 2):
            time.sleep(0.2)
        assert parent.poll() is None, "the sweep ended before it could be terminated"
        workers = [p for p in _children(parent.pid) if _alive(p)] if Path("/proc/self/stat").exists() else []
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    lines = err.strip().splitlines()
    kept = (out / "runs.jsonl").read_text().count("\n")
    assert parent.returncode == 143, err
    assert lines[-1] == (f"ldpsim: terminated: {kept} of 80 run(s) are kept in {out / 'runs.jsonl'}; the same "
                         "command resumes with the rest"), err
    assert "leaked" not in err and "Traceback" not in err, err
    deadline = time.monotonic() + 20  # (multiprocessing's resource tracker, a child too, exits after its parent)
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if _alive(p)], "workers outlived the terminated sweep"
