"""The devices' side of the runtimes (docs/design.md sections 2, 4 and 7).

Importing the package imports none of its modules; import the one you need.

- ``world``: the devices' true values: population groups, levels, jitter, scripted changes, churn;
- ``behavior``: scripted behaviors: a group's values as a keyed function of the day, and event hooks;
- ``cohort``: a cohort of devices as one SimPy process (a cohort of one is one device);
- ``shard``: a cohort's answer as a pure function, the cohorts of one worker process, and the SimPy process
  standing for every cohort of a run whose cohorts run in workers;
- ``client``: a live device client hosting cohorts over one TCP connection (asyncio);
- ``resumable``: a live client that survives the collector's restarts and its own.
"""

__all__ = ["behavior", "client", "cohort", "resumable", "shard", "world"]
