"""Parameter sweeps: ``ldpsim sweep SCENARIO --grid KEY=V1,V2,... --repeat R --out DIR``.

A sweep runs every point of a grid (the cross product of each grid key's values, applied to the scenario like
``--set``) R times. Repetition r of every point uses the seed ``stream_key(base_seed, SWEEP_PURPOSE, r)``
masked to 63 bits: the same seeds at every point (common random numbers), so points are compared on equal
draws. Each run returns only ``output.summary`` of its run.

Where runs go. Jobs are started longest first, by estimated cost (devices x rounds of the parsed scenario of
each grid point), so a sweep does not end with one long run on one worker while the others idle. With
``--workers 1`` they run in this process. With W > 1 they go to one pool of W spawned worker processes for
the whole sweep (scenarios/sweep_worker.py): each is started with numba, OpenMP, MKL and OpenBLAS pinned to
one thread (NUMBA_NUM_THREADS=1 and the like in its environment before anything is imported, so W workers
use W cores without oversubscribing them), loads the numba kernels of the sweep's protocols once in the
pool initializer (a warm-up run on a few hundred devices), then takes runs one after another, each with its
cohorts in that process (``[simulation] workers = 1`` and ``threads = 1`` unless the scenario sets them: the sweep is parallel
across runs); it exits by itself if the sweep's process dies. ``--cluster tcp://HOST:PORT`` sends the runs to a running Dask
distributed scheduler instead (its workers need ldpsim installed, and any data file the scenario names at
the same path), and ``--cluster local:N`` starts a Dask LocalCluster of N single-threaded worker processes
for the sweep (numba pinned the same way) and stops it at the end. Every job is submitted at once with its
rank as the Dask priority (longest first); each worker process warms itself once per protocol. Dask is the
optional extra ``ldpsim[dask]``. Only plain data crosses to a worker, local or Dask: a job is a dict of
ints and the scenario's TOML data, a result a dict of JSON values; the worker function is named by
reference; no project object is pickled. The digests of a run are the same whichever way it ran.

DIR holds ``sweep.json`` (the definition, written first), ``runs.jsonl`` (one line per finished run, appended
as runs finish), ``failed.jsonl`` (runs that raised in the latest invocation, with their tracebacks),
``results.csv`` (one tidy row per run), ``points.csv`` (per grid point and figure: runs, mean, sd, standard
error and 95% interval of the mean over the repetitions), ``results.parquet`` (results.csv's rows, typed;
written to a temporary name and moved into place) and one ``error_<name>.png`` per error figure. Re-running
the same sweep into DIR runs only the (point, repetition) pairs missing from runs.jsonl, locally or on a
cluster, so an interrupted or partly failed sweep is resumed by repeating the command.

Scaling: ``python benchmarks/bench_sweep_scaling.py --repeat 2`` (32 runs of 150,000 devices x 14 rounds;
1 worker against N, pool and local cluster, start-up included). On the shared 2-core project machine (two
CPU-bound processes ran no faster than one: other jobs held a core) it gave a parallel efficiency on 2
workers of 0.45 and 0.63 (pool) and 0.49 and 0.39 (``local:2``) in two invocations; the target, 0.85, is
still to be measured on an idle machine (README.md, section Sweeps).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import sys
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from protocols.keyed import stream_key
from scenarios import sweep_worker
from scenarios.extras import install_command
from scenarios.schema import MAX_INTEGER, ScenarioError, _parse_value, apply_overrides, parse, read

SWEEP_PURPOSE = 100  # stream tag of repetition seeds; beyond protocols.keyed.Purpose so no stream collides
SEED_MASK = (1 << 63) - 1
FIXED_COLUMNS = ("repetition", "seed", "devices", "protocol")
_SWEEP_KEYS = ("repeat", "workers", "grid")
_IDENTITY = ("scenario_data", "grid", "repeat", "seeds", "on_every_point")  # what makes two sweep.json the same


def differences(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The entries of two sweep.json definitions that make them different sweeps (empty: the same sweep, or
    one that extends it, so its runs may be resumed); one written before ``on_every_point`` existed has none."""
    theirs = {"on_every_point": [], **theirs, "scenario_data": _unlabelled(theirs.get("scenario_data"))}
    mine = {**mine, "scenario_data": _unlabelled(mine["scenario_data"])}
    diff = [k for k in _IDENTITY if theirs.get(k) != mine[k]]
    return [] if diff and set(diff) <= {"grid", "repeat", "seeds"} and extends(theirs, mine) else diff


def _unlabelled(data: Any) -> Any:
    """A sweep's scenario without what only labels its output (``[population] unit``): a unit added to a study
    file does not make its finished runs another sweep's."""
    if not (isinstance(data, dict) and isinstance(data.get("population"), dict) and "unit" in data["population"]):
        return data
    return {**data, "population": {k: v for k, v in data["population"].items() if k != "unit"}}


def extends(theirs: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether sweep ``mine`` holds every run of ``theirs`` unchanged: at least as many repetitions (the seeds
    of the first ones are the same: each derives from its index alone) and the same grid keys, in order, with
    every value of theirs among its own. Its finished runs are then kept and only the new ones run."""
    repeat, seeds, grid = theirs.get("repeat"), theirs.get("seeds"), theirs.get("grid")
    if not (isinstance(repeat, int) and 1 <= repeat <= mine["repeat"] and seeds == mine["seeds"][:repeat]):
        return False
    if not (isinstance(grid, dict) and list(grid) == list(mine["grid"])):
        return False
    return all(isinstance(values, list) and {_canon(v) for v in values} <= {_canon(v) for v in mine["grid"][k]}
               for k, values in grid.items())


# ------------------------------------------------------------------------------------------- definition
@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base scenario (``--set`` applied, no [sweep] table), the grid and its seeds."""

    scenario_path: Path
    overrides: list[str]
    base: dict[str, Any]
    grid: dict[str, list[Any]]  # key -> values, in axis order (the plots' x axis: the first with 2+ values)
    repeat: int
    workers: int
    seeds: list[int]
    warnings: tuple[str, ...] = ()  # scenario warnings of the grid points (valid but probably not meant)
    #: ``--set`` overrides under a table the grid sets whole (e.g. protocol.holdout when the grid sweeps the
    #: protocol table): applied on top of every grid point, after its values
    on_every_point: tuple[str, ...] = ()
    #: the most devices of any scenario the validation parsed (the grid points, and each value alone on the
    #: base): what one run may need of memory
    largest_devices: int = 0

    @property
    def keys(self) -> list[str]:
        return list(self.grid)

    @property
    def points(self) -> list[tuple[Any, ...]]:
        """The cross product, last key varying fastest."""
        return list(itertools.product(*self.grid.values()))

    @property
    def name(self) -> str:
        return str(self.base.get("name", self.scenario_path.stem))

    def definition(self) -> dict[str, Any]:
        """The content of sweep.json."""
        return {"scenario": str(self.scenario_path), "overrides": self.overrides, "grid": self.grid,
                "repeat": self.repeat, "base_seed": self.base.get("seed", 0), "seed_purpose": SWEEP_PURPOSE,
                "seeds": self.seeds, "scenario_data": self.base, "on_every_point": list(self.on_every_point)}

    def point_data(self, point: tuple[Any, ...]) -> dict[str, Any]:
        """The scenario dict of one grid point, built with ``schema.apply_overrides``: the base, the point's
        values, then :attr:`on_every_point`."""
        return _point(self.base, list(zip(self.keys, point)), self.on_every_point)


def _point(base: dict[str, Any], pairs: list[tuple[str, Any]], after: tuple[str, ...]) -> dict[str, Any]:
    """The base with a point's values, a table before the keys under it whatever the grid's order (a grid
    ``protocol.epsilon`` before a grid ``protocol`` table was replaced by the table, every run at the table's
    epsilon, labelled with the grid's), then ``after``."""
    data = base
    for key, value in sorted(pairs, key=lambda kv: kv[0].strip().count(".")):  # stable: same depth, grid order
        data = _apply(data, key, value)
    return apply_overrides(data, list(after)) if after else data


#: runs in one sweep at most (a typo such as --repeat 1000000000 is refused rather than planned for minutes)
MAX_RUNS = 10_000_000


def derive_seeds(base_seed: int, repeat: int) -> list[int]:
    """The seed of each repetition: ``stream_key(base_seed, SWEEP_PURPOSE, r) & (2**63 - 1)``."""
    return [stream_key(base_seed, SWEEP_PURPOSE, r) & SEED_MASK for r in range(repeat)]


def split_values(text: str) -> list[str]:
    """Split ``V1,V2,...`` on the commas outside brackets, braces and quotes."""
    parts, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced {c!r}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if quote or depth:
        raise ValueError("unclosed quote" if quote else "unclosed bracket or brace")
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_grid_arg(item: str) -> tuple[str, list[Any]]:
    """One ``--grid KEY=V1,V2,...``: the key and its values (TOML values, else bare strings like ``--set``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ScenarioError(f"--grid {item!r}: expected KEY=V1,V2,...")
    try:
        texts = split_values(text)
    except ValueError as exc:
        raise ScenarioError(f"--grid {key}: {exc} in {text!r}") from None
    if any(not t for t in texts):
        raise ScenarioError(f"--grid {key}: empty value in {text!r}")
    return key, [_parse_value(t) for t in texts]


def toml_text(value: Any) -> str:
    """A value as TOML text (the inverse of ``schema._parse_value``), to feed ``apply_overrides``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_text(v)}" for k, v in value.items()) + "}"
    raise ScenarioError(f"grid value {value!r}: only numbers, strings, booleans, arrays and tables can be swept")


def _apply(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    try:
        return apply_overrides(data, [f"{key}={toml_text(value)}"])
    except ScenarioError as exc:
        raise ScenarioError(str(exc).replace("--set ", "--grid ", 1)) from None


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _as_number(value: Any) -> Any:
    """``value`` with every number a float (1 and 1.0 set a scenario key alike: one grid point, not two)."""
    if isinstance(value, dict):
        return {k: _as_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_number(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def value_labels(values: list[Any]) -> list[str]:
    """Short text for each value of one grid key. Tables: by their ``dist`` where every table has a different
    one, else by the entries in which the tables differ (``max_value=29, bins=29``; compact JSON for a table
    with none of them). If two values would share a label, every value of the key is shown as compact JSON."""
    tables = [v for v in values if isinstance(v, dict)]
    dists = [t.get("dist") for t in tables]
    by_dist = all(isinstance(d, str) for d in dists) and len(set(dists)) == len(dists)
    keys = list(dict.fromkeys(k for t in tables for k in t))
    missing = object()
    differing = [k for k in keys if len({_canon(t[k]) if k in t else missing for t in tables}) > 1]
    if len(tables) == 1:  # nothing to tell it from: every entry
        differing = keys

    def short(v: Any) -> str:
        if isinstance(v, dict):
            if by_dist:
                return str(v["dist"])
            return ", ".join(f"{k}={_cell(v[k])}" for k in differing if k in v) or _canon(v)
        if isinstance(v, list):
            return _canon(v)
        return _cell(v)

    labels = [short(v) for v in values]
    return labels if len(set(labels)) == len(labels) else [_canon(v) for v in values]


def _positive_int(value: Any, what: str) -> int:
    """An integer >= 1; command-line text is converted first, file values must already be integers."""
    if isinstance(value, str) and what.startswith("--"):
        try:
            value = int(value.strip())
        except ValueError:
            raise ScenarioError(f"{what}: must be an integer >= 1, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(f"{what}: must be an integer >= 1, got {value!r}")
    return value


def _file_grid(table: Any, where: str) -> dict[str, list[Any]]:
    """[sweep.grid]: dotted keys (quoted, or nested tables) to non-empty arrays of values."""
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: must be a table of KEY = [values]")
    out: dict[str, list[Any]] = {}
    for key, values in table.items():
        if isinstance(values, dict):
            out.update({f"{key}.{k}": v for k, v in _file_grid(values, f"{where}.{key}").items()})
        elif not isinstance(values, list) or not values:
            raise ScenarioError(f"{where}.{key}: must be a non-empty array of values, got {values!r}")
        else:
            out[key] = values
    return out


def plan(spec: str, grid_args: list[str], repeat: str | int | None = None, workers: str | int | None = None,
         overrides: list[str] | None = None) -> Sweep:
    """Load the scenario, merge its [sweep] table with the command line, and validate every grid point.

    A ``--grid`` key replaces that key's values from [sweep.grid]; other file keys are kept (file order
    first). Raises ScenarioError naming the key and value of the first point that does not validate."""
    path, data = read(spec)
    table = data.pop("sweep", {})
    if not isinstance(table, dict):
        raise ScenarioError("sweep: must be a table")
    for k in table:
        if k not in _SWEEP_KEYS:
            raise ScenarioError(f"sweep.{k}: unknown key (expected one of {list(_SWEEP_KEYS)})")
    grid = _file_grid(table.get("grid", {}), "sweep.grid")
    origin = dict.fromkeys(grid, "[sweep.grid]")  # where each key's values come from, for the errors
    seen: set[str] = set()
    for item in grid_args:
        key, values = parse_grid_arg(item)
        if key in seen:
            raise ScenarioError(f"--grid {key}: given twice")
        seen.add(key)
        grid[key] = values
        origin[key] = "--grid"
    if not grid:
        raise ScenarioError("no grid: give --grid KEY=V1,V2,... or a [sweep.grid] table in the scenario")
    for key, values in grid.items():
        if key == "seed":
            raise ScenarioError(f"{origin[key]} seed: the seed cannot be swept; repetitions derive their seeds from it")
        canon = [_canon(_as_number(v)) for v in values]
        if len(set(canon)) != len(canon):
            first = next(c for c in canon if canon.count(c) > 1)  # the first repeated value, in its spellings
            dups = list(dict.fromkeys(toml_text(v) for v, c in zip(values, canon) if c == first))
            raise ScenarioError(f"{origin[key]} {key}: value {dups[0]} given twice" if len(dups) == 1 else
                                f"{origin[key]} {key}: values {' and '.join(dups)} are the same number")
    if repeat is None and "repeat" not in table:
        raise ScenarioError("--repeat: required (or repeat = R in the scenario's [sweep] table)")
    n_rep = _positive_int(repeat if repeat is not None else table["repeat"],
                          "--repeat" if repeat is not None else "sweep.repeat")
    runs = n_rep * math.prod(len(v) for v in grid.values())
    if runs > MAX_RUNS:  # refused at once, before deriving a seed per repetition and a job per run
        raise ScenarioError(f"{runs:,} runs ({'x'.join(str(len(v)) for v in grid.values())} grid points x "
                            f"{n_rep:,} repetitions) exceed the limit of {MAX_RUNS:,} for one sweep")
    if workers is not None:
        n_workers = _positive_int(workers, "--workers")
    elif "workers" in table:
        n_workers = _positive_int(table["workers"], "sweep.workers")
    else:
        n_workers = min(2, os.cpu_count() or 1)
    overrides = list(overrides or [])
    on_base: list[str] = []
    on_every_point: list[str] = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        under = False
        for g in grid:
            gk = g.strip()
            if key == gk or gk.startswith(key + "."):  # the grid's values would silently replace this --set
                raise ScenarioError(f"--set {key}: the grid sets {gk!r} at every point, which would replace "
                                    f"it; vary it with --grid instead (or edit the study file)")
            under = under or key.startswith(gk + ".")
        (on_every_point if under else on_base).append(item)  # under a swept table: on top of each point
    base = apply_overrides(data, on_base)
    seed = base.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ScenarioError(f"seed: must be an integer in [0, 2^63), got {seed!r}")
    warnings, largest = _validate(base, grid, tuple(on_every_point), origin)
    return Sweep(path, overrides, base, grid, n_rep, n_workers, derive_seeds(seed, n_rep),
                 tuple(warnings), tuple(on_every_point), largest)


def _validate(base: dict[str, Any], grid: dict[str, list[Any]], after: tuple[str, ...] = (),
              origin: dict[str, str] | None = None) -> tuple[list[str], int]:
    """Each key's values alone on the base scenario first (so the error names that key and value, and where
    it was given: ``origin``, "--grid" unless it says "[sweep.grid]"), then every point of the cross product;
    ``after``: the --set overrides applied on top of each. Returns the points' distinct scenario warnings and
    the most devices of any scenario parsed."""
    warnings: dict[str, None] = {}
    largest = 0

    def check(pairs: list[tuple[str, Any]], on_top: tuple[str, ...]) -> dict[str, Any]:
        """The point's scenario data, once it parses."""
        data = _point(base, pairs, ())
        if on_top:  # an error in a --set names the point it was applied to
            try:
                data = apply_overrides(data, list(on_top))
            except ScenarioError as exc:
                shown = ", ".join(f"{k}={toml_text(v)}" for k, v in pairs)
                raise ScenarioError(f"grid point {shown}: {exc}") from None
        nonlocal largest
        try:
            sc = parse(data)
        except ScenarioError as exc:
            shown = ", ".join(f"{k}={toml_text(v)}" for k, v in pairs)
            where = (origin or {}).get(pairs[0][0], "--grid")
            raise ScenarioError(f"{where} {shown}: {exc}" if len(pairs) == 1 else f"grid point {shown}: {exc}") \
                from None
        warnings.update(dict.fromkeys(sc.warnings))
        largest = max(largest, sc.devices)
        return data

    for key, values in grid.items():
        # with every --set on top, as at the points themselves (a study tried small sets protocol.holdout
        # under a protocol table the grid sets whole); failing that, with the --set under this key only: the
        # others may be meant for the grid's own tables, not the base's (the points are checked below)
        mine = tuple(item for item in after if item.split("=", 1)[0].strip().startswith(key.strip() + "."))
        for v in values:
            if mine != after:
                try:
                    check([(key, v)], after)
                    continue
                except ScenarioError:
                    pass
            check([(key, v)], mine)
    if len(grid) > 1:
        seen: dict[str, str] = {}
        for point in itertools.product(*grid.values()):
            pairs = list(zip(grid, point))
            data = check(pairs, after)
            shown = ", ".join(f"{k}={toml_text(v)}" for k, v in pairs)
            same = seen.setdefault(json.dumps(data, sort_keys=True, default=str), shown)
            if same != shown:  # one key's values undone by another's: the rows would be labelled with values
                raise ScenarioError(f"grid points {same} and {shown} give the same scenario: one grid key "
                                    f"replaces what another sets (vary the keys inside a swept table in its "
                                    f"values instead)")
    return list(warnings), largest


# -------------------------------------------------------------------------------------------- running
Job = dict[str, Any]  # {"index", "repetition", "seed", "scenario"}: plain data, what a worker receives


def job_cost(data: dict[str, Any]) -> int:
    """The estimated cost of a run, for longest-first scheduling: devices x rounds of its parsed scenario."""
    sc = parse(data)
    return sc.devices * sc.rounds


def longest_first(jobs: list[Job]) -> list[Job]:
    """Jobs ordered by decreasing ``job_cost`` (ties keep their order): the long runs start first, so the
    sweep does not end with one long run on one worker while the others idle."""
    costs = [job_cost(job["scenario"]) for job in jobs]
    return [jobs[k] for k in sorted(range(len(jobs)), key=lambda k: -costs[k])]


def build_jobs(sweep: Sweep, todo: list[tuple[int, int]] | None = None) -> list[Job]:
    """The jobs of the (point index, repetition) pairs ``todo`` (default: every run), longest first; each
    carries its scenario dict with the repetition's seed."""
    points = sweep.points
    if todo is None:
        todo = [(i, r) for r in range(sweep.repeat) for i in range(len(points))]
    data = {i: sweep.point_data(points[i]) for i in sorted({i for i, _ in todo})}
    return longest_first([{"index": i, "repetition": r, "seed": sweep.seeds[r],
                           "scenario": {**data[i], "seed": sweep.seeds[r]}} for i, r in todo])


def _warm_set(jobs: list[Job]) -> list[dict[str, Any]]:
    """One scenario per protocol among the jobs (the first, so the longest): what each worker warms up."""
    seen: dict[str, dict[str, Any]] = {}
    for job in jobs:
        seen.setdefault(str(job["scenario"].get("protocol", {}).get("name", "")), job["scenario"])
    return list(seen.values())


def _failure(job: Job, exc: BaseException) -> dict[str, Any]:
    """The error record of a job whose worker died (or that the cluster gave up on)."""
    return {"index": job["index"], "repetition": job["repetition"], "seed": job["seed"],
            "error": f"{type(exc).__name__}: {exc}", "traceback": "".join(traceback.format_exception(exc))}


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ inside the block (for the processes started there), restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_jobs(jobs: list[Job], workers: int, in_process: bool | None = None) -> Iterator[dict[str, Any]]:
    """Results of ``sweep_worker.run_job`` as they finish, started in the order ``jobs`` are given (so longest
    first): in this process (``in_process``; by default for one worker), else in one pool of ``workers``
    processes for the whole sweep. Each pool process is spawned with one thread for numba and the
    BLAS/OpenMP libraries (``THREAD_ENV``, in its environment before anything is imported), warms the
    kernels of the sweep's protocols once in its initializer, then takes the runs one after another, each
    with its cohorts in that process unless the scenario sets ``[simulation] workers`` itself."""
    if in_process if in_process is not None else workers <= 1:
        for job in jobs:
            yield sweep_worker.run_job(job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with _environ(sweep_worker.THREAD_ENV):  # the pool's processes start in submit(): all of them in this block
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=sweep_worker.pool_init, initargs=(os.getpid(), _warm_set(jobs)))
        futures = {pool.submit(sweep_worker.pool_job, job): job for job in jobs}
    try:
        for fut in as_completed(futures):
            try:
                yield fut.result()
            except Exception as exc:  # noqa: BLE001 - the worker itself died (e.g. killed for memory)
                yield _failure(futures[fut], exc)
    except BaseException:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for proc in procs:  # interrupted: stop the runs in progress rather than wait for them
            proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


# ------------------------------------------------------------------------------------- a Dask cluster
CLUSTER_EXTRA = f"--cluster needs the dask extra: {install_command('dask')}"
_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")


@dataclass(frozen=True)
class Cluster:
    """Where ``--cluster`` sends the runs: ``address`` (tcp://HOST:PORT) or ``local`` worker processes."""

    address: str | None = None
    local: int = 0

    def __str__(self) -> str:
        return self.address or f"local:{self.local}"


#: Dask settings of a ``local:N`` cluster: one task at a time per worker (so runs start in priority order,
#: longest first, with nothing queued on a busy worker to steal back), and no statistical profiler sampling
#: the worker's threads every 10 ms (a few per cent more CPU time for the same runs, measured)
LOCAL_CLUSTER_CONFIG = {"distributed.scheduler.worker-saturation": 1.0,
                        "distributed.scheduler.work-stealing": False,
                        "distributed.worker.profile.enabled": False}


def parse_cluster(text: str) -> Cluster:
    """``--cluster tcp://HOST:PORT`` (a running Dask scheduler) or ``local:N`` (a LocalCluster of N
    single-threaded worker processes started for the sweep)."""
    text = text.strip()
    m = re.fullmatch(r"local:([0-9]+)", text)
    if m:
        if int(m[1]) < 1:
            raise ScenarioError(f"--cluster local:N: N must be an integer >= 1, got {m[1]!r}")
        return Cluster(local=int(m[1]))
    m = _TCP.fullmatch(text)
    if m and 1 <= int(m["port"]) <= 65535:
        return Cluster(address=text)
    raise ScenarioError(f"--cluster: expected tcp://HOST:PORT or local:N, got {text!r}")


def import_distributed() -> Any:
    """The ``distributed`` package, or a one-line ScenarioError naming the extra to install."""
    try:
        import distributed
    except ImportError:
        raise ScenarioError(CLUSTER_EXTRA) from None
    return distributed


def run_on_cluster(jobs: list[Job], cluster: Cluster) -> Iterator[dict[str, Any]]:
    """Results of ``sweep_worker.cluster_job`` on a Dask cluster, as they finish. Every job is submitted at
    once, with its rank as the task priority (Dask runs the highest first: longest first); a task is a
    function named by reference and a job of plain data, its result a dict of JSON values. ``local:N``
    starts a LocalCluster (N worker processes of one thread, numba pinned to one thread in their
    environment) and stops it at the end; a tcp:// cluster is only connected to."""
    distributed = import_distributed()
    import logging

    local = None
    try:
        if cluster.local:  # its workers' failures come back as failed runs: their logs are not shown
            import dask

            with dask.config.set(LOCAL_CLUSTER_CONFIG):  # read by the scheduler and passed to the workers
                local = distributed.LocalCluster(n_workers=min(cluster.local, len(jobs)), threads_per_worker=1,
                                                 processes=True, dashboard_address=None,
                                                 silence_logs=logging.CRITICAL, memory_limit=0,
                                                 env=dict(sweep_worker.THREAD_ENV))
            client = distributed.Client(local)
        else:
            client = distributed.Client(cluster.address, timeout="20s")
    except Exception as exc:  # noqa: BLE001 - no scheduler there, or the local workers did not start
        if local is not None:
            local.close()
        what = "cannot connect" if cluster.address else "the local cluster did not start"
        raise ScenarioError(f"--cluster {cluster}: {what}: {type(exc).__name__}: {exc}") from None
    parent = os.getpid() if local is not None else None
    token = f"{os.getpid()}-{time.time_ns()}"
    futures = {}
    try:
        if local is not None:
            client.run(sweep_worker.local_cluster_init, parent)
        for rank, job in enumerate(jobs):
            fut = client.submit(sweep_worker.cluster_job, job, parent, priority=len(jobs) - rank, pure=False,
                                key=f"ldpsim-sweep-{token}-{job['index']}-{job['repetition']}")
            futures[fut] = job
        for fut in distributed.as_completed(list(futures)):
            try:
                yield fut.result()
            except Exception as exc:  # noqa: BLE001 - the worker died (the cluster gave up on the task)
                yield _failure(futures[fut], exc)
            fut.release()
    except BaseException:
        client.cancel(list(futures))
        raise
    finally:
        client.close()
        if local is not None:
            local.close()


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _dumps(o: Any, **kw: Any) -> str:
    return json.dumps(o, default=_json_default, **kw)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class Outcome:
    """What one invocation did."""

    total: int
    skipped: int
    finished: int
    failed: int
    plots: list[Path]
    #: runs (of every invocation) whose devices spent past the protocol's own guarantee or the budget
    breached: list[str] = field(default_factory=list)


def _prepare(sweep: Sweep, out: Path, force: bool) -> None:
    """Check DIR against sweep.json (refuse a different sweep unless ``force``) and write sweep.json."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot create the sweep directory: {exc.strerror or exc}") from None
    if not out.is_dir():
        raise ScenarioError(f"--out {out}: not a directory")
    mine = json.loads(_dumps(sweep.definition()))
    meta, runs = out / "sweep.json", out / "runs.jsonl"
    for path in (meta, runs, out / "failed.jsonl"):  # a FIFO would block the read (or append) for ever
        if path.exists() and not path.is_file():
            raise ScenarioError(f"--out {out}: {path.name} is not a regular file")
    if not force:
        if meta.exists():
            try:
                theirs = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                theirs = {}
            diff = differences(theirs if isinstance(theirs, dict) else {}, mine)  # not an object: another sweep
            if diff:
                try:  # this sweep is the directory's cut down (fewer repetitions or grid values)
                    shrinks = set(diff) <= {"grid", "repeat", "seeds"} and extends(mine, theirs)
                except (KeyError, TypeError, AttributeError):  # a damaged sweep.json: just another sweep
                    shrinks = False
                raise ScenarioError(f"--out {out}: holds a different sweep ({', '.join(diff)} differ"
                                    + ("; a sweep may be extended, with more repetitions or grid values, but not cut"
                                       " down: its finished runs would be dropped" if shrinks else "")
                                    + "); pass --force to start over or choose another directory")
        elif runs.exists():
            raise ScenarioError(f"--out {out}: holds runs.jsonl but no sweep.json; pass --force to start over")
    else:
        for name in ("runs.jsonl", "failed.jsonl", "results.csv", "points.csv", "results.parquet", "sweep.json"):
            (out / name).unlink(missing_ok=True)
        for png in out.glob("error_*.png"):
            png.unlink()
    _write_atomic(meta, json.dumps(mine, indent=2) + "\n")


_FIGURE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _figure(v: Any) -> bool:
    """A figure as a run writes it: None, an int of 64 bits, or a float that is finite or NaN (undefined);
    10**400 in an edited line overflowed every float conversion, and pyarrow's int64 column."""
    if isinstance(v, float):
        return not math.isinf(v)
    return v is None or isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_INTEGER


def _readable_summary(summary: Any) -> bool:
    """Whether a runs.jsonl line's summary has the shape results.csv reads, as a run writes it: error and
    epsilon objects of numbers or nulls under short snake_case names (they become column and plot file names:
    ``error_<name>.png``), devices an integer, protocol a string, wall_seconds a number. A line edited into
    anything else is dropped and its run done again, rather than written through into results.csv or a path."""
    if not isinstance(summary, dict):
        return False
    for key in ("error", "epsilon"):
        part = summary.get(key, {})
        if not (isinstance(part, dict) and all(isinstance(k, str) and _FIGURE_NAME.fullmatch(k) and _figure(v)
                                               for k, v in part.items())):
            return False
    devices, protocol, wall = summary.get("devices"), summary.get("protocol"), summary.get("wall_seconds")
    return (isinstance(devices, int) and not isinstance(devices, bool) and 1 <= devices <= MAX_INTEGER
            and isinstance(protocol, str) and _figure(wall))


def load_records(sweep: Sweep, out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """The finished runs in DIR/runs.jsonl by (point index, repetition). Lines that cannot be read or do
    not belong to this sweep (e.g. a line cut short by a kill) are dropped from the file, with a warning."""
    path = out / "runs.jsonl"
    if not path.exists():
        return {}
    index = {_canon(list(p)): i for i, p in enumerate(sweep.points)}
    records: dict[tuple[int, int], dict[str, Any]] = {}
    kept, dropped = [], 0
    text = path.read_bytes().decode("utf-8", errors="replace")  # bytes that are not text: lines dropped below
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            i = index[_canon([rec["point"][k] for k in sweep.keys])]
            rep = rec["repetition"]
            ok = (len(rec["point"]) == len(sweep.keys) and isinstance(rep, int) and 0 <= rep < sweep.repeat
                  and rec["seed"] == sweep.seeds[rep] and _readable_summary(rec["summary"])
                  and (i, rep) not in records)
        except (ValueError, KeyError, TypeError, IndexError):
            ok = False
        if ok:
            records[(i, rep)] = rec
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped or (text and not text.endswith("\n")):
        if dropped:
            print(f"ldpsim: warning: {path}: dropped {dropped} unreadable or foreign line(s)", file=sys.stderr)
        _write_atomic(path, "".join(line + "\n" for line in kept))
    return records


def execute(sweep: Sweep, out: Path, force: bool = False, quiet: bool = False,
            cluster: Cluster | None = None) -> Outcome:
    """Run the missing runs of ``sweep`` into ``out`` (longest first; on ``cluster`` if given, else in
    ``sweep.workers`` local processes), then rebuild results.csv, points.csv, results.parquet and the plots."""
    if cluster is not None:
        import_distributed()  # a missing extra fails before anything is written
    _prepare(sweep, out, force)
    points = sweep.points
    done = load_records(sweep, out)
    todo = [(i, r) for r in range(sweep.repeat) for i in range(len(points)) if (i, r) not in done]
    failed_path = out / "failed.jsonl"
    failed_path.unlink(missing_ok=True)
    workers = max(1, min(sweep.workers, len(todo)))
    where = f"Dask cluster {cluster}" if cluster is not None else f"{workers} worker(s)"
    print(f"ldpsim: sweep {sweep.name}: {len(points)} grid points x {sweep.repeat} repetitions = "
          f"{len(points) * sweep.repeat} runs ({len(done)} already done), {where} -> {out}",
          file=sys.stderr)

    jobs = build_jobs(sweep, todo)
    if not jobs:
        results: Iterator[dict[str, Any]] = iter(())
    elif cluster is not None:
        results = run_on_cluster(jobs, cluster)
    else:
        results = run_jobs(jobs, workers)
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), unit="run", desc="sweep", file=sys.stderr, dynamic_ncols=True,
               disable=quiet or not jobs)
    finished = failed = 0
    failed_file = None
    try:
        with open(out / "runs.jsonl", "a", encoding="utf-8") as runs:
            for res in results:
                i, rep = res["index"], res["repetition"]
                head = {"point": dict(zip(sweep.keys, points[i])), "repetition": rep, "seed": res["seed"]}
                if "summary" in res:
                    runs.write(_dumps({**head, "summary": res["summary"]}) + "\n")
                    runs.flush()
                    finished += 1
                else:
                    if failed_file is None:
                        failed_file = open(failed_path, "a", encoding="utf-8")
                    failed_file.write(_dumps({**head, "error": res["error"], "traceback": res["traceback"]}) + "\n")
                    failed_file.flush()
                    failed += 1
                    bar.set_postfix(failed=failed)
                bar.update(1)
    finally:
        bar.close()
        if failed_file is not None:
            failed_file.close()
    records = load_records(sweep, out)  # every invocation's runs, read once for the tables and the verdicts
    plots = rebuild(sweep, out, records)
    return Outcome(len(points) * sweep.repeat, len(done), finished, failed, plots, breaches(records))


def breaches(records: dict[tuple[int, int], dict[str, Any]]) -> list[str]:
    """Each recorded run whose devices spent past the protocol's own guarantee or the budget (summary.json
    ``within_guarantee`` / ``within_budget`` false), as "point ..., repetition r: max spend X, guarantee G"."""
    found = []
    for (_, rep), rec in sorted(records.items()):
        pv = rec["summary"].get("privacy", {})
        if pv.get("within_guarantee") is False or pv.get("within_budget") is False:
            point = ", ".join(f"{k}={_cell(v)}" for k, v in rec["point"].items())
            budget = "" if pv.get("budget") is None else f", budget {_cell(pv['budget'])}"
            found.append(f"{point or 'the base scenario'}, repetition {rep}: max spend {_cell(pv.get('max_spend'))}, "
                         f"guarantee {_cell(pv.get('guarantee'))}{budget}")
    return found


# ------------------------------------------------------------------------------------------ the results
def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (dict, list)):
        return _canon(v)
    return str(v)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def tidy(sweep: Sweep, records: dict[tuple[int, int], dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The columns and rows of results.csv (one row per run, ordered by point then repetition). Varied keys
    hold labels (see ``value_labels``); missing figures are None."""
    labels = {k: dict(zip(map(_canon, vs), value_labels(vs))) for k, vs in sweep.grid.items()}
    ordered = [records[key] for key in sorted(records)]
    err_names: list[str] = []
    eps_names: list[str] = []
    for rec in ordered:
        s = rec["summary"]
        err_names += [k for k, v in s.get("error", {}).items() if _number(v) and k not in err_names]
        eps_names += [k for k in s.get("epsilon", {}) if k not in eps_names]
    # a fixed column that a grid key already names (e.g. the whole [protocol] table varied) becomes run_<name>
    fixed = {c: f"run_{c}" if c in sweep.grid else c for c in FIXED_COLUMNS}
    # memoized protocols' epsilon_* figures are spend within a behavior pattern, not a whole transcript's loss:
    # a column says which, and their worst-case loss (inf: unbounded) stands beside them
    memo = any(isinstance(rec["summary"].get("privacy", {}).get("worst_case_loss"), dict) for rec in ordered)
    # what each run promised its devices, and whether they kept within it (a protocol whose devices spend past
    # its own guarantee is broken: execute() reports such runs and the command exits 1)
    budgets = any(rec["summary"].get("privacy", {}).get("budget") is not None for rec in ordered)
    verdicts = ("guarantee", "within_guarantee", *(("budget", "within_budget") if budgets else ()))
    header = [*sweep.keys, *fixed.values(), *(("errors_of",) if err_names else ()), *(f"error_{k}" for k in err_names),
              *(f"epsilon_{k}" for k in eps_names), *verdicts,
              *(("privacy_scope", "worst_case_loss") if memo else ()), "wall_seconds"]
    rows = []
    for rec in ordered:
        s = rec["summary"]
        row: dict[str, Any] = {k: labels[k][_canon(rec["point"][k])] for k in sweep.keys}
        row.update({fixed["repetition"]: rec["repetition"], fixed["seed"]: rec["seed"],
                    fixed["devices"]: s.get("devices"), fixed["protocol"]: s.get("protocol")})
        err, eps = s.get("error", {}), s.get("epsilon", {})
        if err_names:
            row["errors_of"] = _errors_of(s)
        row.update({f"error_{k}": err.get(k) if _number(err.get(k)) else None for k in err_names})
        row.update({f"epsilon_{k}": eps.get(k) for k in eps_names})
        privacy = s.get("privacy", {})
        row.update({k: privacy.get(k) for k in verdicts})
        if memo:
            worst = s.get("privacy", {}).get("worst_case_loss")
            row["privacy_scope"] = "within behavior pattern" if isinstance(worst, dict) else "whole transcript"
            row["worst_case_loss"] = (None if not isinstance(worst, dict)
                                      else worst.get("value") if worst.get("bounded") else math.inf)
        row["wall_seconds"] = s.get("wall_seconds")
        rows.append(row)
    return header, rows


def _errors_of(summary: dict[str, Any]) -> str | None:
    """What a run's error figures are errors of, in words with its unit: summary.json's ``errors_of``, or for a
    run recorded before summaries said it, its protocol's words looked up here (None where that fails)."""
    given = summary.get("errors_of")
    if isinstance(given, str):
        return given
    from protocols import registry
    from scenarios.metrics import error_of

    try:
        params = registry.lookup(str(summary.get("protocol"))).params
    except registry.RegistryError:
        return None
    unit = summary.get("unit")
    return error_of(params, unit if isinstance(unit, str) else None)


#: points.csv's columns after the varied keys: one row per grid point and figure
POINT_COLUMNS = ("figure", "errors_of", "runs", "mean", "sd", "se", "ci95_low", "ci95_high")


def moments(values: list[float]) -> tuple[int, float, float, float]:
    """n, mean, sample standard deviation (n - 1 in the denominator) and standard error sd / sqrt(n) of one
    grid point's figures over its repetitions; sd and se are NaN (unknown, not 0) for fewer than two."""
    import numpy as np

    n = len(values)
    if n == 0:
        return 0, math.nan, math.nan, math.nan
    mean = float(np.mean(values))
    if n == 1:
        return 1, mean, math.nan, math.nan
    sd = float(np.std(values, ddof=1))
    return n, mean, sd, sd / math.sqrt(n)


def point_summary(sweep: Sweep, header: list[str],
                  rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The columns and rows of points.csv: for each grid point (in grid order) and each ``error_*`` and
    ``epsilon_*`` figure of results.csv (in its order), over the point's repetitions that have the figure:
    ``runs``, ``mean``, ``sd`` (sample, n - 1), ``se`` (sd / sqrt(runs)) and the two-sided 95% Student-t
    interval of the mean, mean -+ t(0.975, runs - 1) se. The interval takes the repetitions as independent
    draws of a figure roughly normal from run to run; the repetitions share their seeds across points (common
    random numbers), so two points' intervals are not independent: compare points on their paired
    differences (results.csv, same repetition). Unknown values are empty: sd, se and the interval for a point
    with one run, every statistic for a point without the figure."""
    from scipy import stats

    figures = [c for c in header if c.startswith(("error_", "epsilon_"))]
    by_point: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_point[tuple(row[k] for k in sweep.keys)].append(row)
    out = []
    for labels, runs in by_point.items():
        for col in figures:
            n, mean, sd, se = moments([float(r[col]) for r in runs if _number(r[col])])
            half = float(stats.t.ppf(0.975, n - 1)) * se if n > 1 else math.nan
            # what an error figure is an error of (a count of rounds, and a spend, are of nothing)
            of = ({r.get("errors_of") for r in runs} if col.startswith("error_")
                  and col != "error_rounds_without_estimate" else set())
            out.append({**dict(zip(sweep.keys, labels)), "figure": col,
                        "errors_of": next(iter(of)) if len(of) == 1 else None, "runs": n,
                        **{k: (None if math.isnan(v) else v) for k, v in
                           (("mean", mean), ("sd", sd), ("se", se), ("ci95_low", mean - half),
                            ("ci95_high", mean + half))}})
    return [*sweep.keys, *POINT_COLUMNS], out


def write_results(path: Path, header: list[str], rows: list[dict[str, Any]]) -> None:
    """A table of CSV (results.csv, points.csv), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows([_cell(row[c]) for c in header] for row in rows)
    os.replace(tmp, path)


def _grid_column(values: list[Any], labels: list[str], grid_values: list[Any]) -> Any:
    """A varied key's column in results.parquet, typed by all of the key's values: booleans, integers,
    numbers (float64) or strings as they are; tables, arrays and mixed kinds as their results.csv labels."""
    import pyarrow as pa

    if all(isinstance(v, bool) for v in grid_values):
        return pa.array(values, pa.bool_())
    if not any(isinstance(v, bool) for v in grid_values):
        if all(isinstance(v, int) for v in grid_values):
            return pa.array(values, pa.int64())
        if all(isinstance(v, (int, float)) for v in grid_values):
            return pa.array([float(v) for v in values], pa.float64())
    if all(isinstance(v, str) for v in grid_values):
        return pa.array(values, pa.string())
    return pa.array(labels, pa.string())


def write_parquet(path: Path, sweep: Sweep, header: list[str], rows: list[dict[str, Any]],
                  points: list[dict[str, Any]]) -> None:
    """results.parquet: the columns and rows of results.csv (``points``: each row's grid values), typed:
    varied keys as ``_grid_column``; repetition, seed, devices int64; protocol string; every figure float64
    (int64 for a figure that is a count; null where missing). The schema metadata ``ldpsim.sweep`` holds
    JSON: name, grid, repeat, seeds. Written to a temporary name in DIR and moved into place
    (``tables.atomic_path``): a reader sees the whole file or none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scenarios.tables import COMPRESSION, atomic_path

    columns = []
    for c in header:
        if c in sweep.grid:
            columns.append(_grid_column([p[c] for p in points], [row[c] for row in rows], sweep.grid[c]))
        elif c in ("repetition", "seed", "devices"):
            columns.append(pa.array([row[c] for row in rows], pa.int64()))
        elif c in ("protocol", "errors_of"):
            columns.append(pa.array([None if row[c] is None else str(row[c]) for row in rows], pa.string()))
        else:
            values = [row[c] for row in rows]
            given = [v for v in values if v is not None]
            if given and all(isinstance(v, bool) for v in given):
                columns.append(pa.array(values, pa.bool_()))  # a verdict (within_guarantee): true, false or null
            elif all(isinstance(v, int) and not isinstance(v, bool) for v in given) and given:
                columns.append(pa.array(values, pa.int64()))  # a count (e.g. rounds without an estimate)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in given):
                columns.append(pa.array([None if v is None else float(v) for v in values], pa.float64()))
            else:  # not a number after all: the text results.csv holds
                columns.append(pa.array([None if v is None else _cell(v) for v in values], pa.string()))
    meta = {"name": sweep.name, "grid": sweep.grid, "repeat": sweep.repeat, "seeds": sweep.seeds}
    schema = pa.schema([pa.field(c, col.type) for c, col in zip(header, columns)],
                       metadata={b"ldpsim.sweep": _dumps(meta).encode()})
    table = pa.Table.from_arrays(columns, schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=COMPRESSION)


def log_axis(values: Iterable[Any]) -> bool:
    """Whether an x axis should be logarithmic: all values positive numbers spanning more than a factor 20."""
    vs = list(values)
    return bool(vs) and all(_number(v) and v > 0 for v in vs) and max(vs) / min(vs) > 20


def error_axis(col: str, of: str | None, unit: str | None = None) -> str:
    """A plot's axis label for the results column ``col`` (error_<figure>): the figure in words (``unit``: what
    every run's counters count, the sweep's [population] unit, named instead of "the value's units"), and what
    it is an error of (``of``: the runs' ``errors_of``, None where unknown)."""
    from scenarios.metrics import ERROR_FIGURES, in_unit

    figure = col.removeprefix("error_")
    text = in_unit(ERROR_FIGURES.get(figure, col), unit)
    if figure not in ("rounds_without_estimate", "wasserstein") and of:
        text += f"\n({of})"
    return text


def _unit(sweep: Sweep) -> str | None:
    """The unit every run of the sweep gives its counters ([population] unit), None unless one for all."""
    points = sweep.points if any(k.startswith("population") for k in sweep.keys) else sweep.points[:1]
    units = {sweep.point_data(p).get("population", {}).get("unit") for p in points}
    (unit,) = units if len(units) == 1 else (None,)
    return str(unit) if unit else None


def plot_figures(sweep: Sweep, header: list[str], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per error column with numbers: mean over repetitions +- one standard error against the first
    key with more than one value, one line per combination of the other varied keys; one panel per kind of
    number the runs estimate (their ``errors_of``), each with its own y axis."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scenarios import plots
    from scenarios.labels import plain

    # the first key with more than one value (a study shrunk to one value of its first key drew every line
    # as one column of points at that value); single-valued keys go in the title
    xkey = next((k for k in sweep.keys if len(sweep.grid[k]) > 1), sweep.keys[0])
    others = [k for k in sweep.keys if k != xkey]
    xvals = sweep.grid[xkey]
    xlabels = value_labels(xvals)
    numeric = all(_number(v) for v in xvals)
    xpos = [float(v) for v in xvals] if numeric else [float(j) for j in range(len(xvals))]
    xindex = {lab: j for j, lab in enumerate(xlabels)}
    order = {k: {lab: j for j, lab in enumerate(value_labels(sweep.grid[k]))} for k in others}
    fixed = {k: value_labels(sweep.grid[k])[0] for k in others if len(sweep.grid[k]) == 1}  # in the title
    held = "".join(f"; {k}={v}" for k, v in fixed.items())
    unit = _unit(sweep)
    written = []
    for col in (c for c in header if c.startswith("error_")):
        count = col == "error_rounds_without_estimate"  # a count, not an error
        known = [row for row in rows if _number(row[col])]
        if not known or (count and not any(row[col] for row in known)):
            continue  # every run estimated every round: a flat line at 0 says nothing (results.csv has it)
        # one panel per kind of number the runs estimate (a mean's seconds beside a histogram's frequencies
        # would share an axis and a line): rows by their errors_of, in order of first appearance
        kinds: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        for row in known:
            kinds[None if count else row.get("errors_of")].append(row)
        panels = []
        for of, subset in kinds.items():
            groups: dict[tuple[str, ...], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
            for row in subset:
                groups[tuple(row[k] for k in others)][xindex[row[xkey]]].append(float(row[col]))
            panels.append((of, groups))
        most = max(len(groups) for _, groups in panels)
        beside = LEGEND_INSIDE < most <= LEGEND_BESIDE  # a legend beside the axes, in a wider figure
        fig, axes = plt.subplots(len(panels), 1, figsize=(12.5 if beside else 8, 5 + 3.5 * (len(panels) - 1)),
                                 sharex=True, squeeze=False)
        for ax, (of, groups) in zip(axes[:, 0], panels):
            _draw_panel(ax, groups, others, order, fixed, xpos)
            ax.set_ylabel(error_axis(col, of, plain(unit) if unit else None))
            if count:
                ax.set_ylim(bottom=0)
            lines = len(groups)
            if len(others) > len(fixed) and lines <= LEGEND_INSIDE:
                ax.legend(fontsize=7, loc="best")
            elif LEGEND_INSIDE < lines <= LEGEND_BESIDE:
                ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            elif len(others) > len(fixed):  # too many lines to label: say what they are and where to read them
                varied = ", ".join(k.strip() for k in others if k not in fixed)
                ax.text(0.01, 0.99, f"{lines} lines, one per combination of {varied}: too many to label "
                        "(results.csv has every run)", transform=ax.transAxes, va="top", fontsize=7,
                        color="dimgray", wrap=True)
            ax.grid(True, alpha=0.3)
        ax = axes[-1, 0]
        if numeric and log_axis(xvals):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if len(xvals) <= 12:
                ax.set_xticks(xpos, xlabels)
        if not numeric:
            ax.set_xlim(-0.5, len(xvals) - 0.5)
            ax.set_xticks(xpos, xlabels, rotation=20 if max(map(len, xlabels)) > 12 else 0, ha="right"
                          if max(map(len, xlabels)) > 12 else "center", fontsize=8)
        ax.set_xlabel(xkey)
        kinds_note = f"; one panel per kind of estimate ({len(panels)})" if len(panels) > 1 else ""
        axes[0, 0].set_title(f"{sweep.name}: {col} (mean ± 1 s.e. over {sweep.repeat} repetition"
                             f"{'s' if sweep.repeat != 1 else ''}{held}{kinds_note})", fontsize=10)
        fig.tight_layout()
        path = out / f"{col}.png"
        plots.save(fig, path, dpi=100)
        written.append(path)
    return written


def _draw_panel(ax: Any, groups: dict[tuple[str, ...], dict[int, list[float]]], others: list[str],
                order: dict[str, dict[str, int]], fixed: dict[str, str], xpos: list[float]) -> None:
    """One line per combination of the other varied keys (``groups``: its values by x position): the mean
    over repetitions +- one standard error."""
    for combo in sorted(groups, key=lambda c: [order[k][lab] for k, lab in zip(others, c)]):
        by_x = groups[combo]
        js = sorted(by_x, key=lambda j: xpos[j])
        ys = [by_x[j] for j in js]
        spread = [moments(y) for y in ys]
        mean = [m[1] for m in spread]
        se = [m[3] for m in spread]  # NaN for one run: no bar, rather than a bar of 0
        label = ", ".join(f"{k.strip()}={_short(str(v))}" for k, v in zip(others, combo) if k not in fixed) or None
        ax.errorbar([xpos[j] for j in js], mean, yerr=se, marker="o", ms=4, capsize=3, lw=1.2, label=label)


#: a sweep plot's lines labelled in a legend inside the axes up to this many, beside them up to LEGEND_BESIDE;
#: beyond it a note says what the lines are (63 entries had covered the whole plot)
LEGEND_INSIDE, LEGEND_BESIDE = 10, 20


def _short(label: str, most: int = 44) -> str:
    """One value of a legend entry cut to ``most`` characters (a table's value can be a long line of JSON)."""
    return label if len(label) <= most else label[:most - 1] + "…"


def rebuild(sweep: Sweep, out: Path, records: dict[tuple[int, int], dict[str, Any]] | None = None) -> list[Path]:
    """results.csv, points.csv, results.parquet and the plots from runs.jsonl (``records``: as load_records
    read it); stale error_*.png files are removed."""
    records = load_records(sweep, out) if records is None else records
    header, rows = tidy(sweep, records)
    write_results(out / "results.csv", header, rows)
    write_results(out / "points.csv", *point_summary(sweep, header, rows))
    write_parquet(out / "results.parquet", sweep, header, rows, [records[key]["point"] for key in sorted(records)])
    plots = plot_figures(sweep, header, rows, out) if rows else []
    for png in out.glob("error_*.png"):
        if png not in plots:
            png.unlink()
    return plots
