"""Single-round baselines the papers compare against, usable in any scenario (docs/algorithms.md sections 1.3-1.4).

Each report uses fresh randomness and is charged eps every round (naive repetition):
- ``kflip``: k-ary randomized response (Kairouz et al.): the true bucket with p = e^eps/(e^eps + k - 1), else
  a uniformly random other bucket; h_hat(v) = (count_v/n - q)/(p - q), q = 1/(e^eps + k - 1).
- ``laplace``: the value plus Laplace(m/eps) noise on a grid of step m/1024 (a discrete Laplace: a float
  Laplace leaks through its low-order bits); the mean of the reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

from protocols import config
from protocols import keyed
from protocols import likelihood as lik
from protocols.base import ProtocolParams, check_params
from protocols.collecting import Column, ReportCollector
from protocols.dbitflip import bucket_of, histogram
from protocols.device import OneReportDevices
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import FRESH_REPORT, Charge
from protocols.messages import ReportBatch
from protocols.round_mechanism import DiscretePair, LaplacePair, RoundMechanism
from protocols.wire import Bits
from protocols.wire import bits as wire_bits

KFLIP, LAPLACE = "kflip", "laplace"


class FreshDevices(OneReportDevices):
    """Device side shared by the fresh-randomness protocols: one report per round, each charged the
    protocol's per-report loss ``params.round_epsilon`` under ``reason``."""

    reason = FRESH_REPORT

    def __init__(self, params, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.guard = Guard(self.device_ids, limits)

    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__}.report")

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The accepted round's fresh reports of the devices at ``rows`` the budget can pay, each charged the
        per-report loss through the guard."""
        p = self.params
        columns = self.report(round_, values)
        rows = rows[self.guard.affordable(p.round_epsilon, rows)]
        if rows.size != self.device_ids.size:
            columns = {k: (wire_bits(np.asarray(v)[rows]) if isinstance(v, Bits) else v[rows])
                       for k, v in columns.items()}
        return (ReportBatch(round=round_, protocol=p.name, devices=self.wire_ids(rows),
                            columns=columns),
                [self.guard.charge(round_, now, self.reason, p.round_epsilon, rows)])


# ------------------------------------------------------------------------------------------- k-ary RR
def kflip_pq(epsilon: float, k: int) -> tuple[float, float]:
    e = math.exp(epsilon)
    return e / (e + k - 1), 1 / (e + k - 1)


def kflip_variance(h: np.ndarray, n: int, k: int, epsilon: float) -> np.ndarray:
    """Exact Var[h_hat(v)] for fixed inputs: the n h devices in bucket v report v with probability p, the
    others with q, so Var = (h p (1 - p) + (1 - h) q (1 - q)) / (n (p - q)^2). (The often-quoted
    f (1 - f)/(n (p - q)^2), f = q + (p - q) h, adds the sampling variance of inputs drawn from h.)"""
    p, q = kflip_pq(epsilon, k)
    h = np.asarray(h, dtype=np.float64)
    return (h * p * (1 - p) + (1 - h) * q * (1 - q)) / (n * (p - q) ** 2)


@nb.njit(cache=True, nogil=True)
def _kflip_kernel(ids, buckets, k, p, key, out):
    for i in range(ids.shape[0]):
        if keyed.uniform2(key, ids[i], np.uint64(0)) < p:
            out[i] = buckets[i]
        else:
            other = int(keyed.uniform2(key, ids[i], np.uint64(1)) * (k - 1))
            out[i] = other + 1 if other >= buckets[i] else other


@dataclass(frozen=True)
class KFlipParams:
    name: str
    epsilon: float
    max_value: float
    buckets: int

    kind = "histogram"

    #: ``ldpsim protocols``' line
    summaries = {"kflip": "k-ary randomized response over k buckets, fresh every round: the single-round "
                          "histogram baseline of Ding et al. 2017."}
    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'kflip': {'epsilon': 1.0, 'max_value': 1.0, 'buckets': 8}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "KFlipParams":
        """[protocol] keys: epsilon, max_value, buckets."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        return cls(name, epsilon, max_value,
                   table.get("buckets", int, check=lambda v: 2 <= v <= 65_536, what="an integer in [2, 65536]"))

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        if not 2 <= self.buckets <= 65_536:
            raise ValueError(f"protocol.buckets must be in [2, 65536], got {self.buckets}")

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g}")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py): k-ary randomized response (Kairouz et
        al.) sends the true bucket with p = e^eps/(e^eps + k - 1) and each other bucket with q = 1/(e^eps + k - 1).
        For buckets b != b' the outputs fall in three classes: b (p under x, q under x'), b' (q, p) and the
        k - 2 others ((k - 2) q under both). Every pair of distinct buckets gives this same pair (attained);
        inputs in the same bucket give identical laws. Pure eps: ln(p/q) = eps."""
        p, q = kflip_pq(self.epsilon, self.buckets)
        outs, pp, qq = ["b", "b'"], [p, q], [q, p]
        if self.buckets > 2:
            outs.append("another bucket")
            pp.append((self.buckets - 2) * q)
            qq.append((self.buckets - 2) * q)
        return DiscretePair(tuple(outs), tuple(pp), tuple(qq), "x in bucket b against x' in bucket b' != b",
                            "k-ary randomized response (Kairouz et al.): p/q = e^eps")

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[reports | values], the attacker's model (protocols.likelihood): each round independently the
        true bucket with p = e^eps/(e^eps + k - 1), any other with q = 1/(e^eps + k - 1)."""
        p, q = kflip_pq(self.epsilon, self.buckets)
        y = lik.column(reports, "y")[:, :, 0].astype(np.int64)
        hit = y == bucket_of(np.asarray(values, dtype=np.float64), self.buckets, self.max_value)[None, :]
        return (np.where(hit, math.log(p), math.log(q)) * present).sum(axis=1)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "KFlipDevices":
        return KFlipDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "KFlipCollector":
        return KFlipCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        return np.sqrt(kflip_variance(self.truth(values), reports, self.buckets, self.epsilon))


class KFlipDevices(FreshDevices):
    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        p = self.params
        out = np.empty(self.device_ids.size, dtype=np.int64)
        _kflip_kernel(self.device_ids, bucket_of(values, p.buckets, p.max_value), p.buckets,
                      kflip_pq(p.epsilon, p.buckets)[0], np.uint64(stream_key(self.seed, Purpose.REPORT, round_)),
                      out)
        return {"y": out.astype(np.uint8 if p.buckets <= 256 else np.uint32)}


def estimate_kflip(y: np.ndarray, k: int, epsilon: float) -> np.ndarray:
    p, q = kflip_pq(epsilon, k)
    if y.size == 0:
        return np.full(k, np.nan)
    return (np.bincount(y.astype(np.int64), minlength=k) / y.size - q) / (p - q)


class KFlipCollector(ReportCollector):
    def __init__(self, params: KFlipParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("y", np.uint8 if params.buckets <= 256 else np.uint32, high=params.buckets - 1),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        return estimate_kflip(reports["y"][:, 0], self.params.buckets, self.params.epsilon)

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.buckets, np.nan)


# ------------------------------------------------------------------------------------------- Laplace mean
LAPLACE_STEPS = 1024  # the Laplace report's grid: max_value / 1024
LAPLACE_TAIL = 12.0  # reports are clamped LAPLACE_TAIL scales beyond [0, max_value] (module docstring of grid_laplace)


def laplace_grid(epsilon: float, max_value: float) -> tuple[float, float, int]:
    """(step, alpha, clamp) of the grid Laplace report: step m/1024, the two-sided geometric's ratio
    alpha = e^(-eps/1024) (one value's range m is 1024 steps), and the clamp in steps beyond [0, 1024]."""
    return max_value / LAPLACE_STEPS, math.exp(-epsilon / LAPLACE_STEPS), int(math.ceil(LAPLACE_TAIL * LAPLACE_STEPS / epsilon))


@nb.njit(cache=True, nogil=True)
def _laplace_kernel(ids, values, step, log_alpha, clamp, key, out):
    """Grid Laplace: randomized rounding of x/step to k, then k + G1 - G2 (G ~ Geometric(1 - alpha), so the
    difference is two-sided geometric), clamped to [-clamp, 1024 + clamp], times step."""
    for i in range(ids.shape[0]):
        f = values[i] / step
        k = math.floor(f)
        if keyed.uniform2(key, ids[i], np.uint64(0)) < f - k:
            k += 1
        g1 = math.floor(math.log(1.0 - keyed.uniform2(key, ids[i], np.uint64(1))) / log_alpha)
        g2 = math.floor(math.log(1.0 - keyed.uniform2(key, ids[i], np.uint64(2))) / log_alpha)
        n = min(max(k + g1 - g2, -clamp), 1024 + clamp)
        out[i] = n * step


@dataclass(frozen=True)
class LaplaceParams:
    """The Laplace mechanism for a mean, on a grid (a discrete Laplace): y = step (k + Z), k the value's
    randomized rounding to the grid of step m/1024, Z two-sided geometric with P[Z = z] proportional to
    alpha^|z|, alpha = e^(-eps/1024), the result clamped 12 scales beyond [0, m].

    Why a grid: a floating-point Laplace report x + noise leaks the input through its low-order bits
    (Mironov, CCS 2012); ``ldpsim privacy-audit laplace`` measured eps_lb = 4.4 against a claim of 1 on the
    earlier float version. On the grid every report is an integer number of steps, and the ratio of any
    output's probability under two inputs is at most alpha^-1024 = e^eps exactly (randomized rounding is a
    mixture of eps-LDP mechanisms; the clamp merges tails whose ratio is also bounded). Unbiased apart from
    the clamp (bias below e^-12 (m/eps)); docs/algorithms.md section 1.4."""

    name: str
    epsilon: float
    max_value: float

    kind = "mean"

    #: ``ldpsim protocols``' line
    summaries = {"laplace": "The Laplace mechanism on the value, fresh every round: the single-round mean "
                            "baseline of Ding et al. 2017."}
    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'laplace': {'epsilon': 1.0, 'max_value': 1.0}}

    report_family = "value"  # how run-time attack metrics read the reports (scenarios/attacks.py)

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "LaplaceParams":
        """[protocol] keys: epsilon, max_value."""
        epsilon = config.epsilon(table)
        return cls(name, epsilon, config.max_value(table))

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    @property
    def scale(self) -> float:
        """The continuous Laplace scale m/eps the grid mechanism approximates (sensitivity m over eps)."""
        return self.max_value / self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g}")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py): the grid Laplace report
        n = k + Z (in steps of m/1024), Z two-sided geometric with P[Z = z] proportional to e^(-(eps/1024)|z|),
        k the randomized rounding of x/step, then the clamp (see the class docstring).
        The pair k = 0 (x = 0) against k = 1024 (x' = m) without the clamp is a discrete Laplace mechanism with
        parameter eps/1024 and sensitivity 1024, pure eps = 1024 eps/1024 = eps. It dominates every input pair:
        the rounding makes each input a mixture over k in [0, 1024], every pair of mixture components is a shift
        of at most 1024 steps (a post-processing of the largest shift), and the hockey-stick divergence is
        jointly convex; the clamp is a post-processing too. Not attained exactly, only because of the clamp,
        which merges tails 12 scales out."""
        step, _, _ = laplace_grid(self.epsilon, self.max_value)
        return LaplacePair(self.scale, self.max_value, "x = 0 against x' = max_value, without the clamp",
                           "discrete Laplace on the grid m/1024 (LaplaceParams; docs/algorithms.md section 1.4)",
                           attained=False, step=step)

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[reports | values] (the attacker's model, protocols.likelihood): each round independently,
        P[n] = sum over the rounding k of P[k | x] P[Z = n - k], ignoring the clamp (never reached by the
        audit's canaries in practice: probability below e^-12)."""
        step, alpha, _ = laplace_grid(self.epsilon, self.max_value)
        n = np.rint(lik.column(reports, "y")[:, :, 0].astype(np.float64) / step)
        f = np.clip(np.asarray(values, dtype=np.float64), 0.0, self.max_value) / step
        k = np.floor(f)
        up = f - k
        log_a, log_c = -self.epsilon / LAPLACE_STEPS, math.log((1 - alpha) / (1 + alpha))
        with np.errstate(divide="ignore"):
            down_ll = np.log1p(-up)[None, :] + log_c + np.abs(n - k[None, :]) * log_a
            up_ll = np.log(up)[None, :] + log_c + np.abs(n - k[None, :] - 1) * log_a
        return (np.logaddexp(down_ll, up_ll) * present).sum(axis=1)

    def truth(self, values: np.ndarray) -> float:
        return float(values.mean())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        """sd of the mean of r reports (the values fixed): per report Var = step^2 (f(1 - f) + 2 alpha /
        (1 - alpha)^2), f the fractional part of x/step (randomized rounding, then the geometric difference);
        the clamp is ignored. Close to the continuous 2 (m/eps)^2."""
        step, alpha, _ = laplace_grid(self.epsilon, self.max_value)
        f = np.asarray(values, dtype=np.float64) / step
        frac = f - np.floor(f)
        rounding = float(np.mean(frac * (1 - frac)))
        return step * math.sqrt(rounding + 2 * alpha / (1 - alpha) ** 2) / math.sqrt(reports)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "LaplaceDevices":
        return LaplaceDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "LaplaceCollector":
        return LaplaceCollector(self, n_devices)


class LaplaceDevices(FreshDevices):
    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        out = np.empty(self.device_ids.size, dtype=np.float64)
        step, _, clamp = laplace_grid(self.params.epsilon, self.params.max_value)
        _laplace_kernel(self.device_ids, np.ascontiguousarray(values, dtype=np.float64), step,
                        -self.params.epsilon / LAPLACE_STEPS,
                        clamp, np.uint64(stream_key(self.seed, Purpose.NOISE, round_)), out)
        return {"y": out}


class LaplaceCollector(ReportCollector):
    def __init__(self, params: LaplaceParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("y", np.float64),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        return float(reports["y"].mean())


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _KFlipParams: type[ProtocolParams] = KFlipParams
    _LaplaceParams: type[ProtocolParams] = LaplaceParams
