"""Scenarios and everything that runs them (docs/design.md sections 4, 7 and 8), and the shipped
``*.toml`` scenarios, ``studies/`` and ``data/``.

Importing the package imports none of its modules; import the one you need
(``from scenarios import output, runner, schema``).

- ``schema``: scenario files (TOML), ``--set`` overrides and strict validation;
- ``runner``: a run in simulated time (SimPy); ``parallel``, ``ray_engine``: its cohorts in worker processes or
  Ray actors; ``pipes``: the msgpack frames the run's process exchanges with its child processes; ``live``,
  ``journal``: live runs over TCP and their crash-safe journals; ``jsonout``: strict JSON (no NaN, no Infinity);
- ``output``, ``tables``, ``plots``, ``plot_process``, ``labels``, ``metrics``, ``accounting``: the run directory:
  summary, tables, pictures (drawn by a process of their own for large runs) and their labels in the counters'
  unit, error metrics, (eps, delta) accounting;
- ``audit``: ``ldpsim audit``, replaying devices through protocols/reference.py's one-device models;
- ``attacks``, ``privacy_audit``: what a curious collector learns, and empirical lower bounds on epsilon;
- ``conformance``: the conformance kit every protocol (built in or a plugin) must pass, for test suites;
- ``sweep``, ``sweep_worker``, ``compare``: parameter grids (a pool of warmed workers or a Dask cluster), and
  THRESH against naive repetition;
- ``cli``: the ``ldpsim`` command; ``allocator``: the C allocator's settings of the processes it owns; ``jit``:
  numba's start-up in them (its BLAS probe, which imports SciPy's linear algebra, skipped);
  ``resources``: the memory a run asks for, checked before anything is allocated; ``extras``: how to install an
  optional extra where this ldpsim runs from; ``failure``: one line for an exception a user's own code raised.
"""

__all__ = [
    "accounting", "allocator", "attacks", "audit", "cli", "compare", "conformance", "extras", "failure", "jit", "journal", "jsonout", "labels", "live", "metrics", "output", "parallel",
    "pipes", "plot_process", "plots", "privacy_audit", "ray_engine", "resources", "runner", "schema", "sweep", "sweep_worker", "tables",
]
