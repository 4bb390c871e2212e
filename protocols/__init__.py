"""The sans-IO protocol core (docs/design.md sections 1, 3, 5, 6): every mechanism and protocol as plain
Python, numpy and numba, with no I/O, no clock and no global random state. Both runtimes (the SimPy
simulator and the asyncio live runtime) drive these same objects.

Importing the package imports none of its modules; import the one you need (``from protocols import wire``).

Protocols (a parameter class, a device side and a collector side each):

- ``onebit``: 1BitMean and 1BitRRPM (Ding, Kulkarni, Yekhanin 2017), means with one bit a round;
- ``dbitflip``: dBitFlip, dBitFlipPM and BinFlip, histograms over buckets;
- ``multicounter``: 1BitMulti, several counters in one report;
- ``baselines``: kflip and laplace, fresh single-round baselines;
- ``binflipplus``: BinFlip+, Bassily and Smith's one-bit protocol on BinFlip (a baseline of Ding et al. 2017);
- ``thresh``: THRESH voting and global updates (Joseph, Roth, Ullman, Waggoner 2018);
- ``epochrr``: naive per-epoch randomized response, THRESH's baseline;
- ``heavythresh``: HeavyTHRESH, THRESH's frequency oracle over D items (Joseph et al. 2018, section 5);
- ``epochkrr``: naive per-epoch k-ary randomized response, HeavyTHRESH's baseline;
- ``topl``: ToPL threshold optimizer and Hybrid Mechanism (Wang et al. 2021);
- ``tops_protocol``: ToPS, the central-DP baseline, as a protocol (``tops``: its algorithm).

Shared pieces:

- ``base``: the device-side and collector-side interfaces, ``RoundResult``, ``ProtocolError``;
- ``registry``, ``config``: protocol lookup by name and strict parsing of a ``[protocol]`` table;
- ``device``, ``collecting``: the one-report-a-round device-side template (the acceptance rule before any
  report) and collector side (batch checks, storage, transcript, multi-stage ``Stage``);
- ``staged``: multi-stage collector sides as stage machines, their states and transitions as data;
- ``epochs``: per-device epoch means (THRESH, epochrr);
- ``keyed``: keyed randomness, every draw a pure function of (seed, purpose, context, device);
- ``memo``: alpha-point rounding and the set of revealed memoized responses;
- ``numeric``: SR, PM, HM and Square Wave with EM;
- ``guard``, ``ledger``: device-side enforcement of the horizon and budget, and the privacy ledger;
- ``worst_case``, ``round_mechanism``, ``likelihood``: privacy analysis of memoized and fresh reports, and
  transcript likelihoods for the privacy audit;
- ``messages``, ``wire``, ``framing``, ``auth``: the messages, their wire format, length-prefixed frames and
  device authentication;
- ``transcript``, ``snapshot``: the canonical transcript digest, and snapshots of protocol state;
- ``reference``: one-device reference models in plain Python, written from the formulas apart from the
  vectorized device sides, which ``ldpsim audit`` replays;
"""

__all__ = [
    "auth", "base", "baselines", "binflipplus", "collecting", "config", "dbitflip", "device", "epochkrr", "epochrr",
    "epochs", "framing", "guard", "heavythresh", "keyed", "ledger", "likelihood", "memo", "messages",
    "multicounter", "numeric", "onebit", "reference", "registry", "round_mechanism", "snapshot", "staged", "thresh",
    "topl", "tops", "tops_protocol", "transcript", "wire", "worst_case",
]
