"""L-OSUE, one device at a time in plain Python: the reference model ``ldpsim audit`` replays.

Written from the formulas (ldpsim_losue.losue's module docstring; Arcolezi et al. 2022, arXiv:2111.04636) with
the math module and loops, sharing no code with the vectorized device side: only the stream keys and the
pure-Python keyed uniforms of protocols.reference, which restate protocols.keyed bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

from protocols.keyed import Purpose
from protocols.reference import (MEMO_REVEAL, ROUND_GUARANTEE, Charge, ReferenceDevice, Report, clip, key,
                                 uniform2)


class LosueReference(ReferenceDevice):
    """A device: bucket v of its value; memo bit j of B(v) is 1 w.p. 1/2 (j = v) or 1/(e^eps_perm + 1), drawn
    from (seed, MEMO, device, v k + j); each round bit j repeats it w.p. p2, else flips (seed, REPORT, round,
    device, j). Charged eps_perm the first time a bucket is revealed; each report records eps_1 (not cumulative)."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        self.memoized = True
        self.revealed: set[int] = set()
        eps_perm, eps_1 = params.epsilon, params.eps_1
        self.p1, self.q1 = 0.5, 1.0 / (math.exp(eps_perm) + 1.0)
        self.p2 = (1.0 - math.exp(eps_1 + eps_perm)) / (math.exp(eps_1) - math.exp(eps_perm)
                                                        - math.exp(eps_1 + eps_perm) + 1.0)
        self.q2 = 1.0 - self.p2

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r, k = msg.round, p.buckets
        v = min(int(clip(float(value), 0.0, p.max_value) * k / p.max_value), k - 1)
        new = v not in self.revealed
        if not self.affordable(p.epsilon if new else 0.0):
            return None, []
        charges = []
        if new:
            self.revealed.add(v)
            charges.append(self.charge(r, MEMO_REVEAL, p.epsilon))
        charges.append(Charge(r, ROUND_GUARANTEE, p.eps_1, False))
        bits = []
        for j in range(k):
            memo = uniform2(key(self.seed, Purpose.MEMO), self.id, v * k + j) < (self.p1 if j == v else self.q1)
            bits.append(int(uniform2(key(self.seed, Purpose.REPORT, r), self.id, j) < (self.p2 if memo else self.q2)))
        return Report("report", r, {"b": tuple(bits)}), charges
