"""L-OSUE (Arcolezi et al. 2022): memoized OUE at eps_perm, then a fresh SUE at eps_1 per report; histograms.

An ldpsim protocol plugin written only against ldpsim's public API: the registry finds ``LosueParams`` through
the entry point ``losue`` in the group ``ldpsim.protocols`` (pyproject.toml), or as
``[protocol] name = "ldpsim_losue:LosueParams"`` without installing. See README.md and ``ldpsim_losue.losue``.
"""

from ldpsim_losue.losue import (LOSUE, LosueCollector, LosueDevices, LosueParams, estimate_frequencies,
                                losue_probabilities, losue_variance)

__all__ = ["LOSUE", "LosueCollector", "LosueDevices", "LosueParams", "estimate_frequencies", "losue_probabilities",
           "losue_variance"]
