"""dBitFlip, dBitFlipPM and BinFlip: histograms over k buckets (Ding, Kulkarni, Yekhanin, NIPS 2017).

docs/algorithms.md sections 1.2, 2.2-2.3. Each device draws d distinct buckets J once for life (keyed Floyd sampling);
each report holds, for every j_p in J, a bit that is 1 with probability e^(eps/2)/(e^(eps/2) + 1) if the
device's bucket is j_p and 1/(e^(eps/2) + 1) otherwise, which is eps-LDP: two inputs change at most two bits.
The collector's h_hat(v) = k/(n d) sum over devices with v in J of (b_v (e^(eps/2) + 1) - 1)/(e^(eps/2) - 1)
is unbiased; it may be negative (clipping and renormalizing is post-processing, done for the Wasserstein
metric only).

- ``dbitflip``: fresh bits every round, charged eps every round.
- ``dbitflippm``: permanent memoization keyed on the memo input s = (position of bucket(x) in J) + 1, or 0
  when bucket(x) is not in J, so a device has at most d + 1 distinct memoized reports; charged eps the
  first time each is revealed (spend = distinct reports revealed x eps).
- ``binflip``: d = k (Duchi et al.), fresh every round.
Output perturbation gamma flips each sent bit with fresh randomness; a report is then
2 eps'(eps/2, gamma)-LDP (Theorem 6 per bit, two bits differ) and the collector debiases each bit.
With d = 1 a single bit differs, so a report is in fact eps/2-LDP (see ``round_epsilon``).
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
from protocols.base import ProtocolError, ProtocolParams, check_params
from protocols.collecting import Column, ReportCollector
from protocols.device import OneReportDevices
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.memo import RevealSet, admit_reports, report_charges
from protocols.messages import ReportBatch
from protocols.round_mechanism import NoRoundMechanism, RoundMechanism, product, randomized_response
from protocols.onebit import epsilon_prime
from protocols.wire import bits as wire_bits

DBITFLIP, DBITFLIPPM, BINFLIP = "dbitflip", "dbitflippm", "binflip"


def bucket_of(x: np.ndarray, k: int, m: float) -> np.ndarray:
    """Bucket index of values in [0, m] for k equal-width buckets; x = m goes to k - 1."""
    return np.minimum((np.asarray(x, dtype=np.float64) * (k / m)).astype(np.int64), k - 1)


def histogram(x: np.ndarray, k: int, m: float) -> np.ndarray:
    """True bucket frequencies (summing to 1)."""
    return np.bincount(bucket_of(x, k, m), minlength=k) / max(np.asarray(x).size, 1)


def bit_moments(epsilon: float, gamma: float) -> tuple[float, float]:
    """E[Z^2 | the bit's bucket is the device's] and E[Z^2 | it is not], for the debiased summand
    Z = (b' (E + 1) - 1)/(E - 1), E = e^(eps/2), b' = (b - gamma)/(1 - 2 gamma) (E[Z] = 1 and 0)."""
    e = math.exp(epsilon / 2)
    out = []
    for p in (e / (e + 1), 1 / (e + 1)):
        q = gamma + (1 - 2 * gamma) * p  # P[sent bit = 1]
        b2 = (q * (1 - gamma) ** 2 + (1 - q) * gamma**2) / (1 - 2 * gamma) ** 2  # E[b'^2]
        out.append(((e + 1) ** 2 * b2 - 2 * (e + 1) * p + 1) / (e - 1) ** 2)
    return out[0], out[1]


def histogram_variance(h: np.ndarray, n: int, k: int, d: int, epsilon: float, gamma: float = 0.0) -> np.ndarray:
    """Exact Var[h_hat(v)] over J, bit and flip randomness, for true frequencies h and n reports.

    Per device the summand Y = (k/d) 1[v in J] Z has E[Y] = t and E[Y^2] = (k/d) E[Z^2 | t], t = 1[bucket = v],
    P[v in J] = d/k. Summing n independent devices: Var = (1/n) [ (k/d) (h A + (1 - h) B) - h ] with A, B from
    :func:`bit_moments`. For gamma = 0 and small h this is (k/(n d)) E/(E - 1)^2 with E = e^(eps/2)
    (docs/algorithms.md section 1.2; the coarser ((E + 1)/(E - 1))^2 / 4 is 6% higher at eps = 1).
    """
    a, b = bit_moments(epsilon, gamma)
    h = np.asarray(h, dtype=np.float64)
    return ((k / d) * (h * a + (1 - h) * b) - h) / n


@dataclass(frozen=True)
class DBitFlipParams:
    """``buckets`` k equal-width buckets on [0, max_value]; ``bits`` d sampled buckets per device."""

    name: str
    epsilon: float
    max_value: float
    buckets: int
    bits: int
    gamma: float = 0.0

    kind = "histogram"

    #: ``ldpsim protocols``' line for each name this class runs
    summaries = {"dbitflip": "dBitFlip (Ding, Kulkarni, Yekhanin, NIPS 2017): histograms over k buckets, d sampled "
                             "buckets' bits randomized afresh every round.",
                 "dbitflippm": "dBitFlipPM (Ding et al. 2017): dBitFlip with permanent memoization of each bucket's "
                               "response, optionally output perturbation (gamma).",
                 "binflip": "BinFlip (Ding et al. 2017): dBitFlip with d = k, every bucket's bit randomized afresh "
                            "every round."}
    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'dbitflip': {'epsilon': 1.0, 'max_value': 1.0, 'buckets': 8, 'bits': 2}, 'dbitflippm': {'epsilon': 1.0, 'max_value': 1.0, 'buckets': 8, 'bits': 2}, 'binflip': {'epsilon': 1.0, 'max_value': 1.0, 'buckets': 8}}

    report_family = "bitflip"  # how run-time attack metrics read the reports (scenarios/attacks.py)

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "DBitFlipParams":
        """[protocol] keys: epsilon, max_value, buckets, bits (binflip: all of them), gamma."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        k = table.get("buckets", int, check=lambda v: 2 <= v <= 65_536, what="an integer in [2, 65536]")
        d = table.get("bits", int, k if name == BINFLIP else ..., check=lambda v: 1 <= v <= k,
                      what=f"an integer in [1, buckets = {k}]")
        if name == BINFLIP and d != k:
            raise table.fail("bits", f"binflip sends all {k} buckets, got {d}")
        return cls(name, epsilon, max_value, k, d, table.get("gamma", float, 0.0, **config.GAMMA))

    def __post_init__(self) -> None:
        if self.name not in (DBITFLIP, DBITFLIPPM, BINFLIP):
            raise ValueError(f"not a dBitFlip protocol: {self.name!r}")
        check_params(self.epsilon, self.max_value, self.gamma)
        if not 2 <= self.buckets <= 65_536:
            raise ValueError(f"protocol.buckets must be in [2, 65536], got {self.buckets}")
        if not 1 <= self.bits <= self.buckets:
            raise ValueError(f"protocol.bits must be in [1, buckets = {self.buckets}], got {self.bits}")
        if self.name == BINFLIP and self.bits != self.buckets:
            raise ValueError(f"binflip sends every bucket: protocol.bits must equal buckets ({self.buckets})")

    @property
    def memoized(self) -> bool:
        return self.name == DBITFLIPPM

    @property
    def report_elements(self) -> int:
        """Values one device's report puts on the wire: d bits, and d bucket indices J when d < k (a runtime
        keeps a message's arrays under protocols.wire.MAX_ELEMENTS)."""
        return self.bits * (2 if self.bits < self.buckets else 1)

    @property
    def round_epsilon(self) -> float:
        """Exact worst-case loss of one report: two inputs change at most min(d, 2) bits, each by eps/2
        (eps'(eps/2, gamma) with output perturbation, Theorem 6 per bit). So eps for d >= 2 and eps/2 for
        d = 1 (checked by enumeration in the tests). Fresh reports are charged this; memoized reports are
        charged the paper's eps per distinct report revealed (conservative for d = 1)."""
        per_bit = epsilon_prime(self.epsilon / 2, self.gamma) if self.gamma > 0 else self.epsilon / 2
        return min(self.bits, 2) * per_bit

    def guarantee(self, horizon: int) -> Guarantee:
        """Fresh: R reports at ``round_epsilon``. dBitFlipPM: eps per distinct memoized report revealed, at most
        min(R, d + 1), or min(R, d) when d = k (within a behavior pattern, Ding et al. 2017 section 3)."""
        if not self.memoized:
            return Guarantee(horizon * self.round_epsilon, f"R x eps_round = {horizon} x {self.round_epsilon:.6g}")
        from protocols.worst_case import dbitflippm_worst_case

        wc = dbitflippm_worst_case(self.epsilon, self.gamma, horizon, self.bits, self.buckets)
        inputs = self.bits if self.bits == self.buckets else self.bits + 1  # d = k: "not in J" cannot occur
        return Guarantee(min(horizon, inputs) * self.epsilon,
                         f"min(R, memo inputs) x eps = min({horizon}, {inputs}) x {self.epsilon:g}",
                         "within a behavior pattern (Ding et al. 2017, Theorem 4)",
                         (wc.value, wc.exact, wc.method))

    def round_mechanism(self, round_: int = 1) -> RoundMechanism | NoRoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py), given the device's J.

        J (d of the k buckets, drawn once per device) travels with every report and stays fixed for the
        device's life, so it is *not* fresh: averaging the round's law over J and composing that T times would
        treat J as redrawn every round and understate the loss. The accountant therefore conditions on the
        worst J, the one that holds both buckets b = bucket(x) and b' = bucket(x') (the ledger's
        round_epsilon does the same). Given J, each position's bit is 1 with E/(E + 1) for the device's own
        bucket and 1/(E + 1) otherwise, E = e^(eps/2) (Ding et al. 2017, dBitFlip), then flips with gamma
        (section 3.2): q_hi = gamma + (1 - 2 gamma) E/(E + 1), q_lo = 1 - q_hi, a ratio of e^eps'(eps/2, gamma)
        (Theorem 6 per bit). Only the bits at b and b' differ in law; the other d - 2 are identically
        distributed and are left out (their loss is 0).
        - d >= 2: the pair is the two bits (at b, at b'): Bern(q_hi) x Bern(q_lo) under x, Bern(q_lo) x
          Bern(q_hi) under x'. Attained; every other pair of inputs changes one of these bits or none (a
          post-processing), so it dominates. Pure eps: 2 eps'(eps/2, gamma) = round_epsilon.
        - d = 1: J = {j}; only one bit exists, Bern(q_hi) (x in j) against Bern(q_lo) (x' not): eps/2.
        dBitFlipPM: memoized reports are not fresh mechanisms."""
        if self.memoized:
            return NoRoundMechanism("memoized: a device resends the same memoized report whenever its memo input "
                                    "repeats, so rounds are not fresh mechanisms to compose (see worst_case_loss)")
        per_bit = epsilon_prime(self.epsilon / 2, self.gamma) if self.gamma > 0 else self.epsilon / 2
        source = "Ding et al. 2017, dBitFlip" + ("; Theorem 6 per bit (eps'(eps/2, gamma))" if self.gamma > 0 else "")
        if self.bits == 1:
            return randomized_response(per_bit, "x in the device's sampled bucket j against x' outside it", source)
        one = randomized_response(per_bit, "bit at bucket(x)", source)
        return product(one, one.swapped(), "the bits at b = bucket(x) and b' = bucket(x'), J holding both, "
                                            "under x and under x'", source)

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[each device's reports | its values were ``values`` (one per round)], the attacker's model
        (protocols.likelihood). Given the device's sampled buckets J (sent with every report), position p's
        bit is 1 with e^(eps/2)/(e^(eps/2) + 1) when J_p is the value's bucket, else 1/(e^(eps/2) + 1), then
        flips with gamma (Ding et al. 2017, dBitFlip and section 3.2). Fresh: independent across rounds.
        dBitFlipPM: the bits are memoized per memo input s (J's position of the bucket, 0 when absent), so the
        rounds sharing s share each position's bit (Theorem 3's memoization applied to dBitFlip)."""
        k, d, gamma = self.buckets, self.bits, self.gamma
        y = lik.column(reports, "b").astype(np.float64) * present[:, :, None]  # (n, T, d)
        zeros = (1.0 - y) * present[:, :, None]
        J = (lik.column(reports, "j")[:, 0, :].astype(np.int64) if d < k
             else np.broadcast_to(np.arange(k), (y.shape[0], k)))
        e = math.exp(self.epsilon / 2)
        pe, qe = e / (e + 1), 1 / (e + 1)
        buckets = bucket_of(np.asarray(values, dtype=np.float64), k, self.max_value)
        # memo input of each device and round: 1 + J's position of the bucket, 0 when the bucket is not in J
        s = np.zeros((y.shape[0], buckets.size), dtype=np.int64)
        for p in range(d):
            s[J[:, p][:, None] == buckets[None, :]] = p + 1
        prob = np.where(np.arange(d)[None, None, :] == s[:, :, None] - 1, pe, qe)  # (n, T, d)
        if not self.memoized:
            return lik.bernoulli_loglik(y, zeros, lik.sent_one_probability(prob, gamma)).sum(axis=(1, 2))
        total = np.zeros(y.shape[0])
        done = np.zeros(s.shape, dtype=bool)
        firsts = np.unique(buckets, return_index=True)[1]  # a round's s repeats that of its bucket's first round
        for r in np.sort(firsts):  # one memo group per distinct s of a device, taken at its first round
            first = ~done[:, r]
            group = (s == s[:, [r]]) & first[:, None]
            done |= group
            ll = lik.memo_bit_loglik((y * group[:, :, None]).sum(axis=1), (zeros * group[:, :, None]).sum(axis=1),
                                     prob[:, r, :], gamma).sum(axis=1)
            total += np.where(first, ll, 0.0)
        return total

    @property
    def bucket_dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.buckets <= 256 else np.uint32)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "DBitFlipDevices":
        return DBitFlipDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "DBitFlipCollector":
        return DBitFlipCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        return np.sqrt(histogram_variance(self.truth(values), reports, self.buckets, self.bits,
                                          self.epsilon, self.gamma))


# ------------------------------------------------------------------------------------------- kernels
@nb.njit(cache=True, nogil=True)
def _sample_j(ids, k, d, key, out):
    """Floyd's algorithm: d distinct buckets of k per device, keyed by (key, device, step); sorted."""
    for i in range(ids.shape[0]):
        count = 0
        for j in range(k - d, k):
            t = int(keyed.uniform2(key, ids[i], np.uint64(j)) * (j + 1))
            dup = False
            for c in range(count):
                if out[i, c] == t:
                    dup = True
                    break
            # insertion into the sorted prefix (d is small): J stays sorted without a per-row sort call
            v = j if dup else t
            c = count
            while c > 0 and out[i, c - 1] > v:
                out[i, c] = out[i, c - 1]
                c -= 1
            out[i, c] = v
            count += 1


@nb.njit(cache=True, nogil=True)
def _report_kernel(ids, buckets, J, pe, qe, key, memoized, flip_key, gamma, out_bits, out_input):
    """Bits of each device's report. Memoized: keyed by (device, memo input s, position) with the round-free
    ``key``; fresh: keyed by (device, position) with a per-round ``key``. Then output perturbation."""
    d = J.shape[1]
    for i in range(ids.shape[0]):
        s = 0
        for p in range(d):
            if J[i, p] == buckets[i]:
                s = p + 1
        out_input[i] = s
        for p in range(d):
            prob = pe if p == s - 1 else qe
            sub = s * d + p if memoized else p
            b = keyed.uniform2(key, ids[i], np.uint64(sub)) < prob
            if gamma > 0.0 and keyed.uniform2(flip_key, ids[i], np.uint64(p)) < gamma:
                b = not b
            out_bits[i, p] = b


# ------------------------------------------------------------------------------------------- device side
class DBitFlipDevices(OneReportDevices):
    """Device side for a cohort: J fixed at setup; answers each round at most once."""

    def __init__(self, params: DBitFlipParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.guard = Guard(self.device_ids, limits)
        self.reveals: RevealSet | None = None
        k, d = params.buckets, params.bits
        self.J = np.empty((self.device_ids.size, d), dtype=np.int64)
        if d == k:
            self.J[:] = np.arange(k)
        else:
            _sample_j(self.device_ids, k, d, np.uint64(stream_key(seed, Purpose.BUCKETS)), self.J)
        e = math.exp(params.epsilon / 2)
        self._pe, self._qe = e / (e + 1), 1 / (e + 1)
        if params.memoized:
            self.reveals = RevealSet(self.device_ids.size, d + 1)

    def report_bits(self, round_: int, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (devices, d) bits sent for ``round_`` and each device's memo input s in 0..d."""
        p = self.params
        buckets = bucket_of(values, p.buckets, p.max_value)
        key = stream_key(self.seed, Purpose.MEMO) if p.memoized else stream_key(self.seed, Purpose.REPORT, round_)
        out = np.empty(self.J.shape, dtype=np.uint8)
        inputs = np.empty(self.device_ids.size, dtype=np.int64)
        _report_kernel(self.device_ids, buckets, self.J, self._pe, self._qe, np.uint64(key), p.memoized,
                       np.uint64(stream_key(self.seed, Purpose.FLIP, round_)), float(p.gamma), out, inputs)
        return out, inputs

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The accepted round's d bits (and J when d < k) of the devices at ``rows``, charged through the guard."""
        p = self.params
        bits, inputs = self.report_bits(round_, values)
        rows, new = admit_reports(self.guard, p, rows, self.reveals, inputs, positions=True)
        charges = report_charges(self.guard, p, round_, now, rows, new)
        ids, bits, J = self.device_ids[rows], bits[rows], self.J[rows]
        columns = {"b": wire_bits(bits)}
        if p.bits < p.buckets:
            columns["j"] = J.astype(p.bucket_dtype)
        return ReportBatch(round=round_, protocol=p.name, devices=ids.astype(np.uint32),
                           columns=columns), charges


# ------------------------------------------------------------------------------------------- collector side
def estimate_histogram(J: np.ndarray, b: np.ndarray, k: int, epsilon: float, gamma: float = 0.0) -> np.ndarray:
    """h_hat(v) = k/(n d) sum_{i, p: J_ip = v} (b'_ip (E + 1) - 1)/(E - 1), b' debiased for gamma."""
    n, d = b.shape
    if n == 0:
        return np.full(k, np.nan)
    e = math.exp(epsilon / 2)
    z = (((b.astype(np.float64) - gamma) / (1 - 2 * gamma)) * (e + 1) - 1) / (e - 1)
    return np.bincount(J.ravel(), weights=z.ravel(), minlength=k) * (k / (n * d))


class DBitFlipCollector(ReportCollector):
    def __init__(self, params: DBitFlipParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        k, d = params.buckets, params.bits
        cols = [Column("b", np.uint8, width=d, high=1)]
        if d < k:
            cols.append(Column("j", params.bucket_dtype, width=d, high=k - 1))
        self.columns = tuple(cols)
        super().__init__(n_devices)

    def validate(self, columns: dict[str, np.ndarray]) -> None:
        """J must be d distinct buckets in increasing order (a repeated bucket would count twice)."""
        J = columns.get("j")
        if J is not None and J.shape[1] > 1 and np.any(np.diff(J.astype(np.int64), axis=1) <= 0):
            raise ProtocolError("column 'j' must hold distinct buckets in increasing order")

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        p = self.params
        b = reports["b"]
        J = reports["j"] if "j" in reports else np.broadcast_to(np.arange(p.buckets), b.shape)
        return estimate_histogram(np.ascontiguousarray(J, dtype=np.int64), b, p.buckets, p.epsilon, p.gamma)

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.buckets, np.nan)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _DBitFlipParams: type[ProtocolParams] = DBitFlipParams
