"""Naive per-epoch randomized response: THRESH's baseline at equal total privacy (Joseph et al. 2018, section 1).

Each epoch every device sends one 1BitMean bit (Ding et al. 2017, eq. 1, with m = 1) of its epoch mean at
eps/T, so T epochs spend exactly eps per device by basic composition; the collector publishes
mean_hat = (1/n) sum (b (e^(eps/T) + 1) - 1)/(e^(eps/T) - 1) every epoch. Noise grows linearly in T at a fixed
budget: the cost THRESH avoids by updating only when the population changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocols import config
from protocols import keyed
from protocols.base import ProtocolParams, check_epoch_epsilon, check_params, epoch_epsilon_problem
from protocols.collecting import Column, ReportCollector
from protocols.device import OneEpochReportDevices, at_rows
from protocols.epochs import EpochBudget, EpochMeans
from protocols.guard import Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import FRESH_REPORT, Charge
from protocols.messages import CollectorMessage, ReportBatch
from protocols.onebit import estimate_mean, mean_variance, p_one
from protocols.round_mechanism import RoundMechanism, randomized_response
from protocols.wire import bits as wire_bits

EPOCHRR = "epochrr"


@dataclass(frozen=True)
class EpochRRParams(EpochBudget):
    """``epsilon`` is the total budget over all ``epochs``; each epoch's report uses epsilon/epochs."""

    name: str
    epsilon: float
    epoch_length: int
    epochs: int
    max_value: float = 1.0

    kind = "epoch"

    collects_bits = True  # a device's daily value is a bit (a Bernoulli counter)

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'epochrr': {'epsilon': 1.0, 'epoch_length': 1}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "EpochRRParams":
        """[protocol] keys: epsilon (the total over the run), epoch_length (a divisor of rounds)."""
        epsilon = config.epsilon(table, total=True)
        rounds = ctx.rounds
        length = table.get("epoch_length", int, check=lambda v: 1 <= v <= rounds and rounds % v == 0,
                           what=f"a divisor of rounds ({rounds})")
        problem = epoch_epsilon_problem(epsilon, rounds // length)
        if problem:
            raise table.fail("epsilon", problem)
        return cls(name, epsilon, length, rounds // length)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value, total=True)
        check_epoch_epsilon(self.epsilon, self.epochs)
        if self.epoch_length < 1 or self.epochs < 1:
            raise ValueError("protocol.epoch_length and the number of epochs must be >= 1")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One epoch for a PLD accountant (protocols/round_mechanism.py): a fresh 1BitMean bit (Ding et al.
        2017, eq. 1, m = 1) of the epoch mean at eps/T, so the pair epoch mean 1 against 0 is binary randomized
        response at eps/T; it is attained and dominates every other pair of epoch means."""
        return randomized_response(self.epoch_epsilon, "epoch mean 1 against 0", "Ding et al. 2017, eq. 1 at eps/T")

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "EpochRRDevices":
        return EpochRRDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "EpochRRCollector":
        return EpochRRCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.mean())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        return math.sqrt(mean_variance(values, self.epoch_epsilon, 1.0) * values.size / reports)


class EpochRRDevices(EpochMeans, OneEpochReportDevices):
    """Epoch sums of the private bits (as THRESH's devices keep them) and one fresh report per epoch."""

    params: EpochRRParams

    def init_state(self) -> None:
        self.init_epochs(self.device_ids.size, self.params.epoch_length)

    def state_snapshot(self) -> dict:
        return self.epoch_snapshot()

    def state_restore(self, state: dict) -> None:
        self.epoch_restore(state)

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """One fresh randomized-response bit of the epoch mean, charged the epoch's epsilon."""
        p, t = self.params, msg.round
        rows = np.flatnonzero(here)
        rows = rows[self.guard.affordable(p.epoch_epsilon, rows)]
        u = keyed.uniform(stream_key(self.seed, Purpose.REPORT, t), self.device_ids)
        bits = u < p_one(self.current, p.epoch_epsilon, 1.0)
        return (ReportBatch(t, p.name, self.wire_ids(rows), {"bit": wire_bits(at_rows(bits, rows))}),
                [self.guard.charge(t, now, FRESH_REPORT, p.epoch_epsilon, rows)])


class EpochRRCollector(ReportCollector):
    def __init__(self, params: EpochRRParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("bit", np.uint8, high=1),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        return estimate_mean(reports["bit"][:, 0], self.params.epoch_epsilon, 1.0)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _EpochRRParams: type[ProtocolParams] = EpochRRParams
