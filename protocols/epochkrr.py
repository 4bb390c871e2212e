"""Naive per-epoch k-ary randomized response: HeavyTHRESH's baseline at equal total privacy (Joseph et al. 2018).

Each epoch every device draws one item from its epoch histogram over the D dictionary items (a keyed uniform
day of the epoch, as HeavyTHRESH's estimate does; protocols/heavythresh.py) and sends it through D-ary
randomized response at eps/T, so T epochs spend exactly eps per device by basic composition. The collector
publishes f_hat(v) = (share of reports equal to v - q)/(p - q) every epoch, p = e^(eps/T)/(e^(eps/T) + D - 1),
q = 1/(e^(eps/T) + D - 1): the cost in noise, linear in T at a fixed budget, that HeavyTHRESH avoids by
updating only when the devices' distributions change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocols import config
from protocols.base import ProtocolParams, check_epoch_epsilon, check_params, epoch_epsilon_problem
from protocols.baselines import KFlipParams, estimate_kflip
from protocols.collecting import ReportCollector
from protocols.dbitflip import histogram
from protocols.device import OneEpochReportDevices
from protocols.epochs import EpochBudget
from protocols.guard import Limits
from protocols.heavythresh import (EpochHistograms, check_items, item_column, items_table, krr_variance, randomize,
                                   sample_items)
from protocols.keyed import Purpose, stream_key
from protocols.ledger import FRESH_REPORT, Charge
from protocols.messages import CollectorMessage, ReportBatch
from protocols.round_mechanism import RoundMechanism

EPOCHKRR = "epochkrr"


@dataclass(frozen=True)
class EpochKRRParams(EpochBudget):
    """Naive per-epoch D-ary randomized response, HeavyTHRESH's baseline at equal total privacy: ``epsilon`` is
    the total over the ``epochs``; every epoch every device sends one item drawn from its epoch histogram at
    epsilon/epochs (basic composition), and the collector debiases the item shares every epoch."""

    name: str
    epsilon: float
    epoch_length: int
    epochs: int
    buckets: int
    max_value: float

    kind = "histogram"

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {"epochkrr": {"epsilon": 1.0, "epoch_length": 2, "buckets": 4, "max_value": 1.0}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "EpochKRRParams":
        """[protocol] keys: epsilon (the total over the run), epoch_length (a divisor of rounds), buckets (D),
        max_value."""
        epsilon = config.epsilon(table, total=True)
        rounds = ctx.rounds
        length = table.get("epoch_length", int, check=lambda v: 1 <= v <= rounds and rounds % v == 0,
                           what=f"a divisor of rounds ({rounds})")
        problem = epoch_epsilon_problem(epsilon, rounds // length)
        if problem:
            raise table.fail("epsilon", problem)
        buckets, max_value = items_table(table)
        return cls(name, epsilon, length, rounds // length, buckets, max_value)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value, total=True)
        check_epoch_epsilon(self.epsilon, self.epochs)
        check_items(self.buckets)
        if self.epoch_length < 1 or self.epochs < 1:
            raise ValueError("protocol.epoch_length and the number of epochs must be >= 1")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One epoch: D-ary randomized response at eps/T of an item drawn from the epoch histogram. A report's
        law is M h, linear in the histogram h; coupling h with h' writes (M h, M h') as a mixture of pairs of
        one-hot inputs, and the hockey-stick divergence is jointly convex, so the one-hot pair (KFlip's, at
        eps/T) dominates every pair and is attained."""
        return KFlipParams(self.name, self.epoch_epsilon, self.max_value, self.buckets).round_mechanism()

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "EpochKRRDevices":
        return EpochKRRDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "EpochKRRCollector":
        return EpochKRRCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        return np.sqrt(krr_variance(self.truth(values), reports, self.buckets, self.epoch_epsilon))


class EpochKRRDevices(EpochHistograms, OneEpochReportDevices):
    """Epoch item counts (as HeavyTHRESH's devices keep them) and one fresh report per epoch."""

    params: EpochKRRParams

    def init_state(self) -> None:
        p = self.params
        self.init_histograms(self.device_ids.size, p.epoch_length, p.buckets, p.max_value)

    def state_snapshot(self) -> dict:
        return self.histogram_snapshot()

    def state_restore(self, state: dict) -> None:
        self.histogram_restore(state)

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """One fresh D-ary randomized response of an item drawn from the epoch histogram, charged eps/T."""
        p, t = self.params, msg.round
        rows = np.flatnonzero(here)
        rows = rows[self.guard.affordable(p.epoch_epsilon, rows)]
        key = stream_key(self.seed, Purpose.REPORT, t)
        ids = self.device_ids[rows]
        y = randomize(key, ids, sample_items(key, ids, self.current[rows], p.epoch_length), p.buckets,
                      p.epoch_epsilon)
        return (ReportBatch(t, p.name, ids.astype(np.uint32), {"y": y.astype(np.uint8)}),
                [self.guard.charge(t, now, FRESH_REPORT, p.epoch_epsilon, rows)])


class EpochKRRCollector(ReportCollector):
    def __init__(self, params: EpochKRRParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (item_column(params.buckets),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        return estimate_kflip(reports["y"][:, 0], self.params.buckets, self.params.epoch_epsilon)

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.buckets, np.nan)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _EpochKRRParams: type[ProtocolParams] = EpochKRRParams
