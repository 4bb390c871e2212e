"""The messages devices and collector exchange (decoded form). Encoding and validation: protocols.wire.

docs/design.md section 5. Report batches carry many devices' reports at once (a cohort's); each report column is a
typed array aligned with ``devices``. The columns a protocol uses are its own business: the collector-side
protocol object checks their names and ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CollectionRequest:
    """Collector -> devices: report for ``round`` before ``deadline`` (simulated or real seconds)."""

    TYPE = "collect"
    round: int
    protocol: str
    deadline: float


@dataclass(frozen=True)
class ReportBatch:
    """Devices -> collector: one report per device in ``devices`` (strictly increasing ids) for ``round``."""

    TYPE = "reports"
    round: int
    protocol: str
    devices: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.devices.shape[0])


@dataclass(frozen=True)
class Decision:
    """Collector -> devices: the outcome of a round's vote (THRESH's global update), asking for the next
    stage's reports before ``deadline``."""

    TYPE = "decision"
    round: int
    protocol: str
    update: bool
    deadline: float


@dataclass(frozen=True)
class Threshold:
    """Collector -> devices: ToPL's truncation threshold ``theta`` (``version`` counts re-estimations),
    applying to rounds from ``round`` on; devices then report for ``round`` before ``deadline``."""

    TYPE = "threshold"
    round: int
    protocol: str
    theta: float
    version: int
    deadline: float


@dataclass(frozen=True)
class Hello:
    """Device client -> collector (live runtime): the devices this connection hosts; ``round`` is the next
    round the client expects (1 on a fresh start; later after a reconnect). ``mac`` (32 bytes, optional) proves
    the devices' credentials for the connection's challenge (protocols.auth); a collector with a deployment
    secret refuses a Hello without a valid one."""

    TYPE = "hello"
    round: int
    protocol: str
    devices: np.ndarray
    mac: bytes | None = None
    #: 32-byte fingerprint of the scenario the devices run (optional): a collector running another refuses them
    scenario: bytes | None = None


@dataclass(frozen=True)
class Challenge:
    """Collector -> device client (live runtime, with a deployment secret): the first frame on a connection, a
    fresh random ``nonce`` (32 bytes) the connection's Hello must authenticate (protocols.auth). ``round`` is
    the collector's current round (at least 1); ``key_id`` the key id of its secret (8 bytes:
    protocols.auth.key_id; None from an older collector), so that a client holding credentials of another
    deployment says so instead of sending a Hello that fails its MAC."""

    TYPE = "challenge"
    round: int
    protocol: str
    nonce: bytes
    key_id: bytes | None = None


@dataclass(frozen=True)
class End:
    """Collector -> device clients (live runtime): the run is over after ``round``."""

    TYPE = "end"
    round: int
    protocol: str


@dataclass(frozen=True)
class Refusal:
    """Collector -> device client (live runtime): the collector will not serve this connection's devices, for
    ``reason`` (another protocol or scenario, no valid credential, ids outside the population), and closes it.
    Sent only for refusals that trying again cannot cure; a client stops instead of reconnecting."""

    TYPE = "refused"
    round: int
    protocol: str
    reason: str


Message = CollectionRequest | ReportBatch | Decision | Threshold | Hello | End | Challenge | Refusal
#: What a collector side broadcasts to device sides. A device side is handed whichever of them arrives (a hostile
#: collector may send any) and answers only what its protocol asks for at that moment.
CollectorMessage = CollectionRequest | Decision | Threshold
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (CollectionRequest, ReportBatch, Decision, Threshold,
                                                             Hello, End, Challenge, Refusal)}
