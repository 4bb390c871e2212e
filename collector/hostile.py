"""Hostile collector behaviors (``[collector] behavior``), for audits: the devices' guarantees must hold against
each of them, in the simulator and over TCP alike.

- ``honest``: the protocol as written.
- ``always_update``: THRESH forces a global update every epoch (implemented by THRESH's collector side).
- ``beyond_horizon``: after the scenario's last round, keeps requesting rounds (``EXTRA_ROUNDS`` more), in
  simulated time, so the devices' own clock agrees with the requested round.
- ``replay``: sends every broadcast twice, and at the start of each round re-sends the previous round's.
- ``far_future``: after every broadcast, a collection request for round 2^31 - 1.
- ``bad_threshold``: after every broadcast, ToPL thresholds theta = 0, -1, 1e-300 and 1e308 under a version
  never issued, and a plausible theta under a version already used.

Devices must ignore every extra message (each is counted by the device side, once per device, in
``privacy.ignored_messages``); none of
them may cost privacy or crash a device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from protocols.guard import MAX_ROUND
from protocols.messages import CollectionRequest, Decision, Threshold

EXTRA_ROUNDS = 3
BAD_THETAS = (0.0, -1.0, 1e-300, 1e308)
Broadcast = CollectionRequest | Decision | Threshold


def describe(msg: Broadcast, time: float) -> dict[str, Any]:
    """A broadcast as a ``downlink.jsonl`` record."""
    out: dict[str, Any] = {"time": float(time), "type": msg.TYPE, **dataclasses.asdict(msg)}
    return out


class Hostility:
    """The extra messages and rounds a behavior adds to an honest collector's schedule."""

    def __init__(self, behavior: str, max_value: float) -> None:
        self.behavior, self.max_value = behavior, float(max_value)
        self._versions: list[int] = []  # threshold versions broadcast honestly
        self._previous: list[Broadcast] = []  # the last round's honest broadcasts (replay)
        self._current: list[Broadcast] = []

    def extra_rounds(self, last: int) -> list[int]:
        """Collection rounds to run after the scenario's last one."""
        if self.behavior == "beyond_horizon":
            return list(range(last + 1, last + 1 + EXTRA_ROUNDS))
        return []

    def start_round(self) -> list[Broadcast]:
        """Messages to send before a round's first honest broadcast."""
        self._previous, self._current = self._current, []
        return list(self._previous) if self.behavior == "replay" else []

    def after(self, msg: Broadcast) -> list[Broadcast]:
        """Messages to send right after the honest broadcast ``msg``."""
        self._current.append(msg)
        if isinstance(msg, Threshold):
            self._versions.append(msg.version)
        if self.behavior == "replay":
            return [msg]
        if self.behavior == "far_future":
            return [CollectionRequest(round=MAX_ROUND, protocol=msg.protocol, deadline=msg.deadline)]
        if self.behavior == "bad_threshold":
            out: list[Broadcast] = [Threshold(round=msg.round, protocol=msg.protocol, theta=theta, version=MAX_ROUND,
                                              deadline=msg.deadline) for theta in BAD_THETAS]
            if self._versions:
                out.append(Threshold(round=msg.round, protocol=msg.protocol, theta=self.max_value / 2,
                                     version=self._versions[-1], deadline=msg.deadline))
            return out
        return []
