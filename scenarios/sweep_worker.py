"""The worker side of ``ldpsim sweep`` (scenarios/sweep.py): what runs in a pool process or on a Dask worker.

This module imports nothing heavy at module level, so a fresh worker process can pin its thread pools
(:data:`THREAD_ENV`: numba, OpenMP, MKL, OpenBLAS to one thread) before numba and numpy are imported:
a worker is one core, and N workers on N cores do not oversubscribe them with numba's own thread pool.

Only plain data crosses to a worker and back: a job is a dict of ints and the scenario's dict (as parsed
from TOML), a result is a dict of JSON values (the run's ``output.summary``, passed through JSON in the
worker). No project object is pickled.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from scenarios import allocator, jit

#: the environment of a sweep worker: every thread pool a run could start holds one thread
THREAD_ENV = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1"}
WARM_DEVICES, WARM_ROUNDS = 500, 31  # at most, in the warm-up run of each protocol (it loads the kernels)

_lock = threading.Lock()
_warm: set[str] = set()  # protocol names warmed in this process
_parent_watched = False


def pin_threads() -> None:
    """One thread for numba, OpenMP, MKL and OpenBLAS in this process. The environment takes effect for
    libraries not yet imported; ``numba.set_num_threads(1)`` for the calling thread (numba keeps it per
    thread, so a Dask worker calls this in every task)."""
    for key, value in THREAD_ENV.items():
        os.environ[key] = value
    import numba

    numba.set_num_threads(1)


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def run_job(job: dict[str, Any], one_process: bool = False) -> dict[str, Any]:
    """Run one (point, repetition) in this process: ``job`` = {"index", "repetition", "seed", "scenario"}.
    Returns {"index", "repetition", "seed", "summary"}, or "error" and "traceback" for a run that raised.
    ``one_process``: a run left to choose its own ``[simulation] workers`` and ``threads`` (auto) keeps its
    cohorts in this process and on this thread (a worker of a pool or cluster is one core; the sweep is
    parallel across runs); an explicit ``workers`` or ``threads`` is kept."""
    index, rep, seed = job["index"], job["repetition"], job["seed"]
    try:
        from scenarios import jsonout, output, runner
        from scenarios.schema import parse

        # a sweep records summaries only: the attack metrics (which keep every device's true values) are not read
        sc = dataclasses.replace(parse(job["scenario"]), attacks=False)
        if one_process and (sc.simulation.workers == 0 or sc.simulation.threads == 0):
            sim = sc.simulation
            sc = dataclasses.replace(sc, simulation=dataclasses.replace(
                sim, workers=sim.workers or 1, threads=sim.threads or 1))
        result = runner.run(sc)
        # plain, strict JSON values: a non-finite figure is null and named in non_finite, as in summary.json
        summary = jsonout.document(json.loads(json.dumps(output.summary(result), default=_json_default)))
        return {"index": index, "repetition": rep, "seed": seed, "summary": summary}
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep carries on
        return {"index": index, "repetition": rep, "seed": seed, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


def warm(scenarios: list[dict[str, Any]]) -> None:
    """Load the numba kernels of each scenario's protocol once in this process, by running it on at most
    WARM_DEVICES devices and WARM_ROUNDS rounds (the first run of a worker then times the simulation, not
    the loading of the kernels from numba's cache, or their compilation on a fresh install). A warm-up
    that fails is ignored: the real run reports its own error."""
    for data in scenarios:
        name = str((data.get("protocol") or {}).get("name", ""))
        with _lock:
            if name in _warm:
                continue
            _warm.add(name)
        small = copy.deepcopy(data)
        pop = small.get("population")
        if isinstance(pop, dict) and isinstance(pop.get("devices"), int):
            pop["devices"] = min(pop["devices"], WARM_DEVICES)
        if isinstance(small.get("rounds"), int):
            small["rounds"] = min(small["rounds"], WARM_ROUNDS)
        try:
            run_job({"index": -1, "repetition": 0, "seed": 0, "scenario": small}, one_process=True)
        except Exception:  # noqa: BLE001 - run_job reports errors itself; nothing else may escape a warm-up
            pass


def exit_with_parent(parent: int) -> None:
    """This worker exits by itself when its parent (the sweep) dies, even by SIGKILL: on Linux the kernel
    sends it SIGTERM (PR_SET_PDEATHSIG), and everywhere a watcher thread notices the parent has changed."""
    global _parent_watched
    with _lock:
        if _parent_watched:
            return
        _parent_watched = True
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def local_cluster_init(parent: int) -> None:
    """Run by the sweep on each worker of the Dask cluster it started (``local:N``), in the worker's main
    thread: Ctrl-C is left to the sweep, which stops the cluster; exit with the sweep's process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)


def pool_job(job: dict[str, Any]) -> dict[str, Any]:
    """A local pool's task: ``run_job`` with the run's cohorts in this worker process."""
    return run_job(job, one_process=True)


def pool_init(parent: int, scenarios: list[dict[str, Any]]) -> None:
    """Initializer of a local pool process (spawned, so nothing is imported yet): Ctrl-C is left to the
    parent, which stops the pool; exit with the parent; one thread per pool; the allocator keeps freed memory
    (scenarios/allocator.py); warm the kernels."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)
    pin_threads()
    allocator.tune()
    jit.skip_blas_probe()
    warm(scenarios)


def cluster_job(job: dict[str, Any], parent: int | None = None) -> dict[str, Any]:
    """A Dask task: pin this thread to one numba thread, warm this process for the job's protocol (once),
    then ``run_job``. ``parent``: the sweep's process id when it started the cluster (``local:N``)."""
    if parent is not None:  # a worker of the cluster the sweep started: its process is ours to tune
        exit_with_parent(parent)
        allocator.tune()
    pin_threads()
    warm([job["scenario"]])
    return run_job(job, one_process=True)
