"""The run directory's pictures drawn by a process of their own (scenarios/plot_process.py): the same pictures as
in-process, a child that dies leaves nothing undrawn, a picture that fails is an error, and no child outlives it."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from scenarios import output, plot_process, runner, schema

PNG = b"\x89PNG\r\n\x1a\n"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone too once reaped; Popen.wait reaps it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def result():
    return runner.run(schema.load("app_usage_31d", ["population.devices=2000", "rounds=5"]))


def test_the_plot_process_draws_the_same_pictures_as_this_process(result, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    output.write_run_dir(result, here)
    with plot_process.start() as painter:
        pid = painter.proc.pid
        s = output.write_run_dir(result, there, painter=painter)
    assert _gone(pid)
    for name in ("estimates.png", "spend.png"):
        drawn = (there / name).read_bytes()
        assert drawn.startswith(PNG) and drawn == (here / name).read_bytes()
        assert s["write_seconds"]["files"][name] > 0  # the child's own drawing time
    assert not [p.name for p in there.iterdir() if "tmp" in p.name]
    assert (there / "summary.json").exists()


def test_a_plot_process_that_dies_leaves_its_pictures_to_this_process(tmp_path):
    painter = plot_process.start()
    painter.draw("estimates_plot", tmp_path / "a.png", np.arange(1, 4), np.ones(3), np.ones(3), np.zeros(3), "t", [])
    painter.proc.kill()  # dies with a request pending (drawn or not)
    painter.draw("estimates_plot", tmp_path / "b.png", np.arange(1, 4), np.ones(3), np.ones(3), np.zeros(3), "t", [2])
    seconds = painter.finish()
    painter.close()
    assert (tmp_path / "a.png").read_bytes().startswith(PNG) and (tmp_path / "b.png").read_bytes().startswith(PNG)
    assert set(seconds) <= {"a.png", "b.png"} and painter.proc is None


def test_a_picture_that_fails_to_draw_is_an_error_naming_it(tmp_path):
    with plot_process.start() as painter:
        painter.draw("estimates_plot", tmp_path / "bad.png", np.arange(3), "not an array of numbers")
        with pytest.raises(plot_process.PlotError, match="bad.png: drawing it failed"):
            painter.finish()
    assert not (tmp_path / "bad.png").exists()


def test_arrays_and_nested_values_cross_the_pipe_unchanged():
    value = {"a": np.arange(5, dtype=np.int32).reshape(5, 1), "b": [np.float64(2.5), (1, "x")],
             "c": [{"round": 1, "p50": 0.5}], "d": np.array([1.5, np.nan])}
    back = plot_process._decode(plot_process._encode(value))
    assert back["a"].dtype == np.int32 and back["a"].shape == (5, 1) and np.array_equal(back["a"], value["a"])
    assert back["b"] == [2.5, [1, "x"]] and back["c"] == [{"round": 1, "p50": 0.5}]
    assert np.array_equal(back["d"], value["d"], equal_nan=True)


def test_ldpsim_run_of_a_large_run_draws_its_pictures_in_a_plot_process(tmp_path, monkeypatch):
    """`ldpsim run` starts the plot process for runs of PLOT_PROCESS device-rounds or more (lowered here) and
    ends it: the run directory is complete, its pictures drawn there, and no child is left."""
    from scenarios import cli

    started: list[plot_process.PlotProcess] = []
    real_start = plot_process.start

    def start() -> plot_process.PlotProcess:
        started.append(real_start())
        return started[-1]

    monkeypatch.setattr(cli, "PLOT_PROCESS", 1000)
    monkeypatch.setattr(plot_process, "start", start)
    out = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--out", str(out), "--quiet", "--set", "population.devices=500",
                     "--set", "rounds=3"]) == 0
    assert len(started) == 1 and started[0].proc is None  # started, then closed
    for name in ("estimates.png", "spend.png", "summary.json"):
        assert (out / name).exists()


def test_pictures_pending_when_a_later_request_finds_the_child_gone_are_drawn_here(tmp_path):
    """The child dies with a picture pending; the next request finds its pipe broken and the child is forgotten:
    finish still draws the pending picture here (it used to read from the forgotten child and fail)."""
    painter = plot_process.start()
    painter.draw("estimates_plot", tmp_path / "a.png", np.arange(1, 4), np.ones(3), np.ones(3), np.zeros(3), "t", [])
    painter.proc.kill()
    painter.proc.wait()  # surely gone: the next write breaks the pipe
    painter.draw("estimates_plot", tmp_path / "b.png", np.arange(1, 4), np.ones(3), np.ones(3), np.zeros(3), "t", [2])
    assert painter.proc is None and len(painter._pending) == 1
    seconds = painter.finish()
    painter.close()
    assert (tmp_path / "a.png").read_bytes().startswith(PNG) and (tmp_path / "b.png").read_bytes().startswith(PNG)
    assert "a.png" in seconds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_child_imports_matplotlib_at_the_lowest_priority_and_draws_at_its_own(monkeypatch):
    """The child's import runs in a thread of nice 19 (it takes only the cores the run leaves idle); the thread
    that draws afterwards keeps the process's priority."""
    import threading

    seen: list[tuple[int, int]] = []
    real = os.setpriority

    def spy(which, who, prio):
        seen.append((who, prio))
        real(which, who, prio)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.setattr(plot_process.os, "setpriority", spy)
    plot_process._import_quietly()
    assert len(seen) == 1 and seen[0][1] == 19
    assert seen[0][0] not in (0, threading.get_native_id(), os.getpid())  # another thread's priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
