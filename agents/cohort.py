"""A cohort of devices as one SimPy process; a cohort of one is one device (docs/design.md section 2).

The process waits for collector messages (bytes), decodes them through the wire format, reads its devices'
current counters from the world, lets the sans-IO device side answer, records the charges in the ledger and
hands each report sub-batch (split by the network's per-device fate) to the network as encoded bytes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import simpy

from agents.shard import answer_cohort, cohort_day, signed_ids
from agents.world import World
from collector.network import Network
from protocols import wire
from protocols.base import DeviceSide, Observer
from protocols.ledger import Ledger
from protocols.messages import CollectionRequest, Decision, Threshold

class CohortAgent:
    def __init__(self, env: simpy.Environment, device: DeviceSide, world: World, network: Network,
                 ledger: Ledger, send: Callable[[bytes], object], round_seconds: float) -> None:
        self.env, self.device, self.world, self.network, self.ledger = env, device, world, network, ledger
        self.send, self.round_seconds = send, round_seconds
        self.ids = signed_ids(device.device_ids)
        self.inbox: simpy.Store = simpy.Store(env)
        self.rejected = 0  # collector messages this cohort could not decode
        self.process = env.process(self.run())

    def day(self) -> int:
        """The devices' own round counter: rounds start every ``round_seconds``, the first at time 0."""
        return cohort_day(self.env.now, self.round_seconds)

    def run(self):
        while True:
            raw = yield self.inbox.get()
            try:
                msg = wire.decode(raw)
            except wire.WireError:
                self.rejected += 1
                continue
            if isinstance(msg, (CollectionRequest, Decision, Threshold)):
                self.answer(msg)

    def observe(self, day: int) -> None:
        """The devices' daily look at their own counters (protocols that keep epoch state, e.g. THRESH)."""
        if isinstance(self.device, Observer):
            values, _ = self.world.values(self.ids)
            self.device.observe(day, values, self.world.present(self.ids))

    def answer(self, request: CollectionRequest | Decision | Threshold) -> None:
        ans = answer_cohort(self.device, self.ids, self.world, self.network, request, self.day(), self.env.now)
        for charge in ans.charges:
            self.ledger.record(charge)
        for data, delay, reports in ans.sent:
            self.network.transmit(data, delay, self.send, reports=reports)
