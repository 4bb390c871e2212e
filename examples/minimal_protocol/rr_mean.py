"""A complete ldpsim protocol in one short file: the mean of values in [0, max_value] by randomized response.

Each round, each device turns its value x into one bit, b = 1 with probability x / max_value, then sends b
with probability p = e^eps / (e^eps + 1) and 1 - b otherwise: eps-LDP per report, charged eps every round.
P[sent bit = 1] = q + (p - q) x / max_value with q = 1 - p, so the collector's unbiased estimate of the mean
is max_value (mean of the bits - q) / (p - q), with standard deviation max_value sqrt(f (1 - f) / n) / (p - q)
for f the mean of P[sent bit = 1] over the n reporting devices. (This is 1BitMean of Ding et al. 2017 under
another name: ``ldpsim sweep`` can put the two side by side.)

Run it from the repository root:

    PYTHONPATH=examples/minimal_protocol ldpsim run examples/minimal_protocol/rr_mean.toml
    PYTHONPATH=examples/minimal_protocol ldpsim conformance examples/minimal_protocol/rr_mean.toml
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protocols import config, keyed
from protocols.baselines import FreshDevices
from protocols.collecting import Column, ReportCollector
from protocols.guard import Guarantee, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import FRESH_REPORT
from protocols.reference import ReferenceDevice, Report, clip, key, uniform1
from protocols.wire import bits


def flip_probability(epsilon: float) -> float:
    """p: the probability of sending the bit as it is."""
    return math.exp(epsilon) / (math.exp(epsilon) + 1.0)


class RRMeanDevices(FreshDevices):
    """A cohort's reports (one row per device); FreshDevices asks the budget and charges eps per report."""

    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        p = self.params
        # two keyed uniforms per device and round: the same numbers whatever the cohort split or runtime
        u_bit = keyed.uniform(stream_key(self.seed, Purpose.REPORT, round_, 0), self.device_ids)
        u_keep = keyed.uniform(stream_key(self.seed, Purpose.REPORT, round_, 1), self.device_ids)
        b = u_bit < np.clip(values, 0.0, p.max_value) / p.max_value
        sent = np.where(u_keep < flip_probability(p.epsilon), b, ~b)
        return {"bit": bits(sent.astype(np.uint8))}  # 0/1 bits, bit-packed on the wire


class RRMeanCollector(ReportCollector):
    def __init__(self, params: "RRMeanParams", n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("bit", np.uint8, high=1),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        p = flip_probability(self.params.epsilon)
        return self.params.max_value * (float(reports["bit"][:, 0].mean()) - (1 - p)) / (2 * p - 1)


class RRMeanReference(ReferenceDevice):
    """One device in plain Python, drawing the very numbers RRMeanDevices draws: what ``ldpsim audit`` replays."""

    def on_message(self, msg, day, value, present=True, now=0.0):  # type: ignore[no-untyped-def]
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r = msg.round
        b = uniform1(key(self.seed, Purpose.REPORT, r, 0), self.id) < clip(float(value), 0.0, p.max_value) / p.max_value
        keep = uniform1(key(self.seed, Purpose.REPORT, r, 1), self.id) < flip_probability(p.epsilon)
        if not self.affordable(p.epsilon):
            return None, []
        return Report("report", r, {"bit": int(b == keep)}), [self.charge(r, FRESH_REPORT, p.epsilon)]


@dataclass(frozen=True)
class RRMeanParams:
    name: str
    epsilon: float
    max_value: float

    kind = "mean"
    reference_model = RRMeanReference
    examples = {"rr_mean": {"epsilon": 1.0, "max_value": 86400.0}}  # ldpsim conformance / privacy-audit

    @classmethod
    def from_table(cls, name: str, table: config.Table, ctx: config.Context) -> "RRMeanParams":
        """[protocol] keys: epsilon, max_value. The name sent on the wire is the short one."""
        return cls("rr_mean", config.epsilon(table), config.max_value(table))

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g} (basic composition)")

    def truth(self, values: np.ndarray) -> float:
        return float(np.mean(values))

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        p = flip_probability(self.epsilon)
        f = float(np.mean((1 - p) + (2 * p - 1) * np.clip(values, 0.0, self.max_value) / self.max_value))
        return self.max_value * math.sqrt(f * (1 - f) / max(reports, 1)) / (2 * p - 1)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> RRMeanDevices:
        return RRMeanDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> RRMeanCollector:
        return RRMeanCollector(self, n_devices)
