"""A device client that survives the collector's and its own restarts (scenarios/journal.py persists it).

Two additions to :class:`agents.client.DeviceClient`:

- **Answers are re-sent, never re-made.** The frames a client sent for each collector message of the current
  round are kept. When the same message (byte for byte) arrives again on a *new* connection, because the
  collector died and a resumed one re-runs the round it was in, or because the client reconnected mid-stage,
  the client sends the very same frames again instead of asking its devices: their reports are identical and
  no device is charged twice or answers a round twice (the device sides would refuse anyway). On the same
  connection (a collector replaying a message) the devices are asked as before and refuse.
- **State is saved before it is sent.** With a store (``client.store``: scenarios.journal.DeviceStore) the
  client saves its process's device state after answering a message and before the frames go out, so a
  device process killed at any point restarts with every charge it made and every answer it may have sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.client import DeviceClient
from protocols import wire
from protocols.framing import frame
from protocols.messages import CollectionRequest, Decision, ReportBatch, Threshold

NEW_CONNECTION = -1  # answers restored from a saved state: any connection is a new one


class ResumableClient(DeviceClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store: Any = None  # scenarios.journal.DeviceStore, or None (nothing saved)
        self.answered: dict[bytes, list[Any]] = {}  # message bytes -> [frames sent, connection number]
        self.answered_round = 0
        self.resent = 0  # answers re-sent on a new connection

    def answer(self, msg: CollectionRequest | Decision | Threshold) -> list[bytes]:
        key = wire.encode(msg)
        hit = self.answered.get(key)
        if hit is not None and hit[1] != self.connections:  # the collector may never have got them
            hit[1] = self.connections
            self.resent += 1
            return [*hit[0], self._ack(msg)]
        out = super().answer(msg)
        batches = out[:-1]
        if batches and msg.round <= self.limits.horizon:
            if msg.round != self.answered_round:  # a new round: the last one's answers are no longer asked for
                self.answered, self.answered_round = {}, msg.round
            self.answered[key] = [batches, self.connections]
        if self.store is not None:
            self.store.save()  # before the frames go out: a restart knows what it may have sent
        return out

    def _ack(self, msg: CollectionRequest | Decision | Threshold) -> bytes:
        return frame(wire.encode(ReportBatch(msg.round, msg.protocol, np.empty(0, np.uint32), {})))
