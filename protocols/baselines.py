"""Single-round baselines the papers compare against, usable in any scenario (docs/algorithms.md sections 1.3-1.4).

Each report uses fresh randomness and is charged eps every round (naive repetition):
- ``kflip``: k-ary randomized response (Kairouz et al.): the true bucket with p = e^eps/(e^eps + k - 1), else
  a uniformly random other bucket; h_hat(v) = (count_v/n - q)/(p - q), q = 1/(e^eps + k - 1).
- ``laplace``: the value plus Laplace(m/eps) noise; the mean of the reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba as nb
import numpy as np

from protocols import keyed
from protocols.base import accepts, check_params
from protocols.collecting import Column, ReportCollector
from protocols.dbitflip import bucket_of, histogram
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import FRESH_REPORT, Charge
from protocols.messages import CollectionRequest, ReportBatch
from protocols.snapshot import GuardedSnapshot
from protocols.wire import Bits
from protocols.wire import bits as wire_bits

KFLIP, LAPLACE = "kflip", "laplace"


class FreshDevices(GuardedSnapshot):
    """Device side shared by the fresh-randomness protocols: one report per round, each charged the
    protocol's per-report loss ``params.round_epsilon`` under ``reason``."""

    reason = FRESH_REPORT

    def __init__(self, params, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.guard = Guard(self.device_ids, limits)

    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def check_values(self, values: np.ndarray) -> None:
        if values.shape != self.device_ids.shape:
            raise ValueError("one value per device is required")

    def respond(self, request: CollectionRequest, day: int, values: np.ndarray, now: float,
                present: np.ndarray | None = None) -> tuple[ReportBatch | None, list[Charge]]:
        p = self.params
        self.check_values(values)
        if not accepts(self, request, day):
            return None, []
        columns = self.report(request.round, values)
        rows = np.arange(self.device_ids.size) if present is None else np.flatnonzero(present)
        rows = rows[self.guard.affordable(p.round_epsilon, rows)]
        if rows.size != self.device_ids.size:
            columns = {k: (wire_bits(np.asarray(v)[rows]) if isinstance(v, Bits) else v[rows])
                       for k, v in columns.items()}
        return (ReportBatch(round=request.round, protocol=p.name, devices=self.device_ids[rows].astype(np.uint32),
                            columns=columns),
                [self.guard.charge(request.round, now, self.reason, p.round_epsilon, rows)])


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


@nb.njit(cache=True)
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

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        if not 2 <= self.buckets <= 65_536:
            raise ValueError(f"protocol.buckets must be in [2, 65536], got {self.buckets}")

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g}")

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
@nb.njit(cache=True)
def _laplace_kernel(ids, values, scale, key, out):
    for i in range(ids.shape[0]):
        u = keyed.uniform1(key, ids[i]) - 0.5  # in [-0.5, 0.5)
        mag = -math.log(1.0 - 2.0 * abs(u)) if abs(u) < 0.5 else 40.0  # 1 - 2|u| > 0 except u = -0.5
        out[i] = values[i] + (scale * mag if u >= 0 else -scale * mag)


@dataclass(frozen=True)
class LaplaceParams:
    name: str
    epsilon: float
    max_value: float

    kind = "mean"

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    @property
    def scale(self) -> float:
        """Laplace scale m/eps: the sensitivity of one value in [0, m] over eps."""
        return self.max_value / self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g}")

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "LaplaceDevices":
        return LaplaceDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "LaplaceCollector":
        return LaplaceCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.mean())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        """Var of the mean of r reports: 2 (m/eps)^2 / r (the values are fixed)."""
        return math.sqrt(2.0) * self.scale / math.sqrt(reports)


class LaplaceDevices(FreshDevices):
    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        out = np.empty(self.device_ids.size, dtype=np.float64)
        _laplace_kernel(self.device_ids, np.ascontiguousarray(values, dtype=np.float64), self.params.scale,
                        np.uint64(stream_key(self.seed, Purpose.NOISE, round_)), out)
        return {"y": out}


class LaplaceCollector(ReportCollector):
    def __init__(self, params: LaplaceParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("y", np.float64),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        return float(reports["y"].mean())
