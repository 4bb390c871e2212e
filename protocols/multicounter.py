"""Several counters at once (Ding, Kulkarni, Yekhanin 2017, Theorem 7): x_1..x_c, each in [0, m], with
sum_j x_j <= m (time in c apps within one period), each sent with a fresh 1BitMean bit at eps.

The joint privacy loss of one report (the exact worst case, docs/algorithms.md section 2.5; derivation):
with p0 = 1/(e^eps + 1) and slope (e^eps - 1)/(e^eps + 1), P[b | x] = prod_j P[b_j | x_j] and
log P[b_j = 1 | x_j] = log(p0 + slope x_j/m) is increasing and concave, log P[b_j = 0 | x_j] decreasing and
concave. For an output b with k1 ones and k0 = c - k1 zeros:
- the largest log P[b | x] puts x_j = 0 on the zeros and splits the budget sum x_j <= m equally over the
  ones (concave, symmetric): k1 log(p0 + slope/k1) + k0 log(1 - p0);
- the smallest log P[b | x'] puts x'_j = 0 on the ones and, minimizing a sum of concave functions over the
  simplex, the whole budget on one zero (an extreme point): k1 log p0 + (k0 - 1) log(1 - p0) + log p0,
  using 1 - p0 - slope = p0 (needs k0 >= 1; with k0 = 0 it is k1 log p0).
Their difference is eps + k1 log(1 + (e^eps - 1)/k1) for k0 >= 1 and c log(1 + (e^eps - 1)/c) for k0 = 0.
g(k) = k log(1 + a/k), a = e^eps - 1, is increasing and concave with g(1) - g(0) = eps, so the maximum over
outputs is at k1 = c - 1:

    eps_joint(c) = eps + (c - 1) log(1 + (e^eps - 1)/(c - 1))   (c >= 2; eps for c = 1),

below eps + e^eps - 1 for every c: the bound independent of c that Theorem 7 states. For c = 2 it is 2 eps
(no saving); from c = 3 on it is below c eps (c = 3, eps = 1: 2.24 instead of 3). The tests check it by
brute force over a grid of feasible inputs that contains the extreme points.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

from protocols import config
from protocols import keyed
from protocols.base import MisuseError, ProtocolParams, check_params
from protocols.baselines import FreshDevices
from protocols.collecting import Column, ReportCollector
from protocols.guard import Guarantee, Limits
from protocols.keyed import Purpose, stream_key
from protocols.onebit import estimate_mean, mean_variance
from protocols.round_mechanism import DiscretePair, RoundMechanism, lower_envelope, randomized_response, rr_power
from protocols.wire import bits as wire_bits

MULTI = "1bitmulti"
JOINT_REPORT = "joint_report"


def joint_epsilon(epsilon: float, counters: int) -> float:
    """Exact worst-case loss of one report of ``counters`` 1BitMean bits under sum x_j <= m (see above)."""
    if counters <= 1:
        return epsilon
    return epsilon + (counters - 1) * math.log1p(math.expm1(epsilon) / (counters - 1))


@functools.lru_cache(maxsize=64)
def joint_report_pair(epsilon: float, counters: int) -> DiscretePair:
    """The dominating pair of one joint report (:meth:`MultiParams.round_mechanism`); cached, since a run asks
    for it once per round."""
    eps, c = epsilon, counters
    source = "Ding et al. 2017, Theorem 7 and eq. 1"
    if c == 1:
        return randomized_response(eps, "x = m against x' = 0", source)
    bits = rr_power(eps, c, f"{c} independent bits, each x_j = m against x'_j = 0 (a bound)", source,
                    attained=(c == 2))
    if c == 2:
        return DiscretePair(bits.outputs, bits.p, bits.q, "x = (m, 0) against x' = (0, m)", source)
    joint = randomized_response(joint_epsilon(eps, c), "eps_joint(c)-DP (a bound)", source, attained=False)
    return lower_envelope(joint, bits, f"dominates every pair of feasible inputs (c = {c}); attained by none",
                          f"{source}: the tightest pair below randomized response at eps_joint(c) and "
                          f"{c} randomized-response bits at eps")


@nb.njit(cache=True, nogil=True)
def _multi_kernel(ids, values, m, p0, slope, key, out):
    for i in range(ids.shape[0]):
        for j in range(values.shape[1]):
            out[i, j] = keyed.uniform2(key, ids[i], np.uint64(j)) < p0 + slope * (values[i, j] / m)


@dataclass(frozen=True)
class MultiParams:
    name: str
    epsilon: float
    max_value: float
    counters: int

    kind = "counters"

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'1bitmulti': {'epsilon': 1.0, 'max_value': 1.0, 'counters': 3}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "MultiParams":
        """[protocol] keys: epsilon, max_value, counters (every population group then needs that many apps)."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        counters = table.get("counters", int, check=lambda v: 1 <= v <= 64, what="an integer in [1, 64]")
        joint, high = joint_epsilon(epsilon, counters), config.EPSILON_RANGE[1]
        if joint > high:  # the report is one mechanism at eps_joint: it must be in range too
            raise table.fail("epsilon", f"{epsilon:g} with {counters} counters makes a report eps_joint = {joint:.4g}-LDP "
                                        f"(Theorem 7), above {high:g}: lower protocol.epsilon or protocol.counters")
        return cls(name, epsilon, max_value, counters)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        if not 1 <= self.counters <= 64:
            raise ValueError(f"protocol.counters must be in [1, 64], got {self.counters}")

    @property
    def round_epsilon(self) -> float:
        return joint_epsilon(self.epsilon, self.counters)

    def guarantee(self, horizon: int) -> Guarantee:
        """R reports, each at the exact joint loss of its c bits (Theorem 7)."""
        return Guarantee(horizon * self.round_epsilon,
                         f"R x eps_joint(c) = {horizon} x {self.round_epsilon:.6g} (c = {self.counters})")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py): the joint report of c fresh 1BitMean
        bits (Ding et al. 2017, Theorem 7; eq. 1 per bit) under sum_j x_j <= m.

        No single pair of inputs dominates the joint report for c >= 3: brute force over the feasible inputs
        shows that the pair attaining the pure eps_joint(c) (the budget split evenly over c - 1 counters
        against all of it on the last, module docstring) is the worst only near alpha = e^eps_joint(c), while
        two vertices e_i against e_j (two bits at eps each) are worse for middle alphas. So the round is
        described by the tightest pair implied by two valid bounds (:func:`lower_envelope`):
        - the report is eps_joint(c)-DP, so binary randomized response at eps_joint(c) dominates it (Kairouz,
          Oh, Viswanath 2015);
        - the c bits are independent given x and each is eps-DP whatever the other counters hold, so c
          randomized-response bits at eps dominate it (their product; dominating pairs compose).
        The envelope's pure eps is min(eps_joint(c), c eps) = eps_joint(c) = round_epsilon. For c = 2 the
        second pair is attained, by x = (m, 0) against x' = (0, m); for c = 1 the report is one 1BitMean bit."""
        return joint_report_pair(self.epsilon, self.counters)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "MultiDevices":
        return MultiDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "MultiCollector":
        return MultiCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return values.mean(axis=0)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        n = values.shape[0]
        return np.array([math.sqrt(mean_variance(values[:, j], self.epsilon, self.max_value) * n / reports)
                         for j in range(values.shape[1])])


class MultiDevices(FreshDevices):
    """c fresh 1BitMean bits a round, charged the joint loss eps_joint(c) (not c x eps)."""

    reason = JOINT_REPORT

    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        p = self.params
        e = math.exp(p.epsilon)
        out = np.empty(values.shape, dtype=np.uint8)
        _multi_kernel(self.device_ids, np.ascontiguousarray(values, dtype=np.float64), float(p.max_value),
                      1 / (e + 1), (e - 1) / (e + 1), np.uint64(stream_key(self.seed, Purpose.REPORT, round_)), out)
        return {"b": wire_bits(out)}

    def check_values(self, values: np.ndarray) -> None:
        if values.ndim != 2 or values.shape != (self.device_ids.size, self.params.counters):
            raise MisuseError(f"{self.params.counters} counters per device are required")
        if np.any(values.sum(axis=1) > self.params.max_value * (1 + 1e-9)):
            raise MisuseError("the counters of a device must sum to at most max_value")


class MultiCollector(ReportCollector):
    def __init__(self, params: MultiParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("b", np.uint8, width=params.counters, high=1),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        p, b = self.params, reports["b"]
        return np.array([estimate_mean(b[:, j], p.epsilon, p.max_value) for j in range(p.counters)])

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.counters, np.nan)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _MultiParams: type[ProtocolParams] = MultiParams
