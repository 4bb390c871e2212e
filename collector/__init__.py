"""The collector's side of the runtimes and the simulated network (docs/design.md sections 4-6).

Importing the package imports none of its modules; import the one you need.

- ``stages``: one collection round as a stage machine, walked by both runtimes (request, advance, close);
- ``process``: the collector as a SimPy process: rounds, deadlines, stages, rejected messages counted;
- ``network``: the simulated network: keyed per-device loss and latency, downlink loss, traffic counts;
- ``hostile``: hostile collector behaviors (``[collector] behavior``) for audits of the devices' guarantees;
- ``server``: the live collector over TCP (asyncio), with its hardening against hostile peers;
- ``shares``: the hosts' fair shares of the live collector's buffer budget and connection slots;
- ``spill``: a transcript store on disk for large runs, handed to collector sides by the runtimes.
"""

__all__ = ["hostile", "network", "process", "server", "shares", "spill", "stages"]
