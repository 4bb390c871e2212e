"""BinFlip+: Bassily and Smith's generic one-bit protocol applied to BinFlip (a baseline of Ding et al. 2017).

Ding, Kulkarni, Yekhanin (NIPS 2017) compare dBitFlipPM with "BinFlip+ (applying the generic protocol with
1-bit reports in [Bassily and Smith, STOC 2015] on BinFlip)". That generic protocol turns any eps-LDP
randomizer Q into a one-bit one with public coins: the collector and the device share a public random
report y drawn from a reference law Q_ref, and the device sends one bit whose probability depends on the
likelihood ratio Q(x)(y) / Q_ref(y); the collector reads y as a sample of Q(x) weighted by the bit.

Applied to BinFlip (k buckets, bit v is 1 with E/(E + 1) if v is the value's bucket b = bucket(x), else
1/(E + 1), E = e^(eps/2); Duchi et al.). The reference is BinFlip's own law for a value in no bucket: k
independent bits, each 1 with q = 1/(E + 1). Then Q(x)(y) / Q_ref(y) = E^(2 y_b - 1): the ratio depends on y
only through y_b, the public bit at the device's own bucket, and takes two values. A bit whose probability
is a function of that ratio is therefore a randomized response of y_b, and the most accurate eps-LDP one is

    P[bit = 1] = e^eps/(e^eps + 1) if y_b = 1, else 1/(e^eps + 1).

Bassily and Smith send 1 with probability (1/2) Q(x)(y)/Q_ref(y), a probability only while the ratio is at
most 2, which bounds eps (Ding et al.'s footnote: the generic protocol needs a small eps, and tuning its
parameters relaxes the bound); the randomized-response form above is that bit with its two probabilities
tuned, and it is eps-LDP at every eps.

Per round and device (fresh every round, charged eps every round, like BinFlip):
- the public coins: a 32-bit seed s, a keyed draw of (seed, device, round); y_v = [U(PUBLIC_KEY, s, v) < q]
  for v = 0..k-1, a public function of s (PUBLIC_KEY is a constant of this module, not of the run). The
  device evaluates only y_b. In a deployment the coins would be a public function of (device id, round)
  and cost nothing on the wire; here s travels with the bit (the report is (s, bit)) so that the
  transcript alone holds everything an attacker sees, as dBitFlip's J does.
- the bit: randomized response at eps of y_b, as above.

Why fresh public coins every round (and not one y per device for life): BinFlip+ is a one-time mechanism
run every round; fresh y makes each round's estimate independent of the others (one fixed y would correlate
a device's rounds and change nothing in the per-round law). Privacy does not depend on the choice: the
guarantee holds for every y (it is conditional on the public coins), so even a y chosen by the collector
would leave each report eps-LDP.

Collector: with t = (bit - lo)/(hi - lo) (E[t | y] = y_b; hi, lo = e^eps/(e^eps + 1), 1/(e^eps + 1)) and
g_v = (y_v - q)/(q (1 - q)) (E[y_b g_v] = 1[v = b], E[g_v] = 0),

    h_hat(v) = (1/n) sum_i (t_i - q) g_v(y_i),

unbiased for the bucket frequencies of the devices that reported (subtracting q, a constant, changes no
expectation because E[g_v] = 0, and lowers the variance). Its exact variance for fixed inputs
(:func:`binflipplus_variance`), with A = e^eps/(e^eps - 1)^2 the variance of t given y:

    Var[h_hat(v)] = (1/n) [ (A + h(v) ((1 - q)^3 + q^3) + (1 - h(v)) q (1 - q)) / (q (1 - q)) - h(v) ].

For small eps this is about BinFlip's (1/n) e^(eps/2)/(e^(eps/2) - 1)^2 (both ~ 4/(n eps^2)); as eps grows q
falls to 0 and a bucket holding mass h costs about h/q: BinFlip+ is good for small eps and falls behind
dBitFlip for large eps, as Ding et al. report.
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
from protocols import reference as ref
from protocols.base import ProtocolParams, check_params
from protocols.baselines import FreshDevices
from protocols.collecting import Column, ReportCollector
from protocols.dbitflip import bucket_of, histogram
from protocols.guard import Guarantee, Limits
from protocols.keyed import Purpose, stream_key
from protocols.round_mechanism import RoundMechanism, randomized_response
from protocols.wire import bits as wire_bits

BINFLIPPLUS = "binflipplus"

#: the key of the public coins: y_v = [U(PUBLIC_KEY, s, v) < q]. A constant (public), the same in every run.
PUBLIC_KEY = stream_key(0xB1F1, Purpose.REPORT, 0x5EED)
SEED_SPAN = 2.0**32  # the public seed s is a uint32


def reference_q(epsilon: float) -> float:
    """q = 1/(e^(eps/2) + 1): P[y_v = 1], BinFlip's bit for a bucket that is not the value's."""
    return 1.0 / (math.exp(epsilon / 2) + 1.0)


def rr_probabilities(epsilon: float) -> tuple[float, float]:
    """(hi, lo) = (e^eps/(e^eps + 1), 1/(e^eps + 1)): P[bit = 1] when y_b = 1 and when y_b = 0."""
    hi = 1.0 / (1.0 + math.exp(-epsilon))
    return hi, 1.0 - hi


def binflipplus_variance(h: np.ndarray, n: int, epsilon: float) -> np.ndarray:
    """Exact Var[h_hat(v)] for true frequencies h of n fixed inputs, over the public coins and the bits
    (module docstring). Per device Y = (t - q) g_v: E[(t - q)^2 | y] = A + (y_b - q)^2, A = e^eps/(e^eps - 1)^2;
    for v != b, g_v is independent of y_b, so E[Y^2] = (A + q (1 - q))/(q (1 - q)) and E[Y] = 0; for v = b,
    E[Y^2] = (A q (1 - q) + E[(y_b - q)^4])/(q (1 - q))^2 = (A + (1 - q)^3 + q^3)/(q (1 - q)) and E[Y] = 1."""
    q = reference_q(epsilon)
    e = math.exp(epsilon)
    a = e / (e - 1.0) ** 2
    w = q * (1.0 - q)
    h = np.asarray(h, dtype=np.float64)
    return ((a + h * ((1.0 - q) ** 3 + q**3) + (1.0 - h) * w) / w - h) / n


# ------------------------------------------------------------------------------------------- kernels
@nb.njit(cache=True, nogil=True)
def _report_kernel(ids, buckets, key, public_key, q, hi, lo, out_s, out_b):
    """Each device's public seed s (uniform 0 of its round stream), y_b from s, and the bit (uniform 1)."""
    for i in range(ids.shape[0]):
        s = np.uint32(keyed.uniform2(key, ids[i], np.uint64(0)) * 4294967296.0)
        y = keyed.uniform2(public_key, np.uint64(s), np.uint64(buckets[i])) < q
        out_s[i] = s
        out_b[i] = keyed.uniform2(key, ids[i], np.uint64(1)) < (hi if y else lo)


@nb.njit(cache=True, nogil=True)
def _estimate_kernel(s, b, k, public_key, q, lo, span, out):
    """out[v] = sum_i (t_i - q)(y_iv - q), the public bits y_iv expanded from each seed."""
    for i in range(s.shape[0]):
        t = (b[i] - lo) / span - q
        seed = np.uint64(s[i])
        for v in range(k):
            y = 1.0 if keyed.uniform2(public_key, seed, np.uint64(v)) < q else 0.0
            out[v] += t * (y - q)


def public_bits(s: np.ndarray, buckets: np.ndarray, epsilon: float) -> np.ndarray:
    """y_b of each report: the public bit of seed s at bucket b (one per element)."""
    return keyed.uniform_sub(PUBLIC_KEY, np.asarray(s, dtype=np.uint64), np.asarray(buckets)) < reference_q(epsilon)


def estimate_binflipplus(s: np.ndarray, b: np.ndarray, k: int, epsilon: float) -> np.ndarray:
    """h_hat(v) = (1/n) sum_i (t_i - q)(y_iv - q)/(q (1 - q)) (module docstring)."""
    n = s.shape[0]
    if n == 0:
        return np.full(k, np.nan)
    q = reference_q(epsilon)
    hi, lo = rr_probabilities(epsilon)
    out = np.zeros(k)
    _estimate_kernel(np.ascontiguousarray(s, dtype=np.uint32), np.ascontiguousarray(b, dtype=np.float64), k,
                     np.uint64(PUBLIC_KEY), q, lo, hi - lo, out)
    return out / (n * q * (1.0 - q))


# ------------------------------------------------------------------------------------------- reference model
class BinFlipPlusReference(ref.ReferenceDevice):
    """One device, from the formulas (protocols/reference.py's conventions): the seed s = floor(2^32 u0) and
    the bit [u1 < hi if y_b else lo], u0, u1 the uniforms 0 and 1 of the round's report stream, y_b =
    [U(PUBLIC_KEY, s, b) < q]; charged eps per report."""

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r, k = msg.round, p.buckets
        bucket = min(int(ref.clip(float(value), 0.0, p.max_value) * (k / p.max_value)), k - 1)
        stream = ref.key(self.seed, Purpose.REPORT, r)
        s = int(ref.uniform2(stream, self.id, 0) * 2**32)
        y = ref.uniform2(PUBLIC_KEY, s, bucket) < 1.0 / (math.exp(p.epsilon / 2) + 1.0)
        hi = math.exp(p.epsilon) / (math.exp(p.epsilon) + 1.0)
        bit = 1 if ref.uniform2(stream, self.id, 1) < (hi if y else 1.0 - hi) else 0
        if not self.affordable(p.epsilon):
            return None, []
        return ref.Report("report", r, {"s": s, "b": bit}), [self.charge(r, ref.FRESH_REPORT, p.epsilon)]


# ------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class BinFlipPlusParams:
    """``buckets`` k equal-width buckets on [0, max_value]; one bit (and its public seed) per device a round."""

    name: str
    epsilon: float
    max_value: float
    buckets: int

    kind = "histogram"

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {BINFLIPPLUS: {"epsilon": 1.0, "max_value": 1.0, "buckets": 8}}

    #: the audit's model of one device (protocols/reference.py)
    reference_model = BinFlipPlusReference

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "BinFlipPlusParams":
        """[protocol] keys: epsilon, max_value, buckets."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        return cls(name, epsilon, max_value,
                   table.get("buckets", int, check=lambda v: 2 <= v <= 65_536, what="an integer in [2, 65536]"))

    def __post_init__(self) -> None:
        if self.name != BINFLIPPLUS:
            raise ValueError(f"not BinFlip+: {self.name!r}")
        check_params(self.epsilon, self.max_value)
        if not 2 <= self.buckets <= 65_536:
            raise ValueError(f"protocol.buckets must be in [2, 65536], got {self.buckets}")

    @property
    def round_epsilon(self) -> float:
        """One report is eps-LDP for every public seed: given s, two inputs change the bit's probability
        between hi and lo at most (ratio e^eps; attained when y_b = 1 and y_b' = 0, probability q (1 - q))."""
        return self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon, f"R x eps = {horizon} x {self.epsilon:g}")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py): conditioned on the public coins (the
        attacker sees s), the bit is randomized response at eps of y_b. The worst pair of inputs has y_b = 1
        and y_b' = 0 (probability q (1 - q) > 0; a pair with y_b = y_b' gives identical laws), where it is
        exactly binary randomized response at eps: attained, and it dominates every other pair and seed."""
        return randomized_response(self.epsilon, "x in bucket b against x' in b', public coins with y_b = 1, y_b' = 0",
                                   "BinFlip+ (Bassily-Smith one-bit protocol on BinFlip): randomized response of y_b")

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[reports | values] (the attacker's model, protocols.likelihood): each round independently, given
        the public seed s (whose law does not depend on the input), the bit is 1 with e^eps/(e^eps + 1) when
        the public bit y_b of s at the value's bucket is 1, else 1/(e^eps + 1)."""
        s = lik.column(reports, "s")[:, :, 0].astype(np.uint64)
        ones = lik.column(reports, "b")[:, :, 0].astype(np.float64) * present
        zeros = (1.0 - ones) * present
        buckets = bucket_of(np.asarray(values, dtype=np.float64), self.buckets, self.max_value)
        y = public_bits(s.ravel(), np.broadcast_to(buckets[None, :], s.shape).ravel(), self.epsilon)
        hi, lo = rr_probabilities(self.epsilon)
        prob = np.where(y.reshape(s.shape), hi, lo)
        return lik.bernoulli_loglik(ones, zeros, prob).sum(axis=1)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "BinFlipPlusDevices":
        return BinFlipPlusDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "BinFlipPlusCollector":
        return BinFlipPlusCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        return np.sqrt(binflipplus_variance(self.truth(values), reports, self.epsilon))


# ------------------------------------------------------------------------------------------- device side
class BinFlipPlusDevices(FreshDevices):
    """Device side for a cohort: a fresh public seed and one bit per device and round (OneReportDevices
    template through FreshDevices: charged eps per report through the guard)."""

    def report(self, round_: int, values: np.ndarray) -> dict[str, np.ndarray]:
        p = self.params
        n = self.device_ids.size
        s, b = np.empty(n, dtype=np.uint32), np.empty(n, dtype=np.uint8)
        hi, lo = rr_probabilities(p.epsilon)
        _report_kernel(self.device_ids, bucket_of(values, p.buckets, p.max_value),
                       np.uint64(stream_key(self.seed, Purpose.REPORT, round_)), np.uint64(PUBLIC_KEY),
                       reference_q(p.epsilon), hi, lo, s, b)
        return {"s": s, "b": wire_bits(b)}


# ------------------------------------------------------------------------------------------- collector side
class BinFlipPlusCollector(ReportCollector):
    def __init__(self, params: BinFlipPlusParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("s", np.uint32), Column("b", np.uint8, high=1))
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        p = self.params
        return estimate_binflipplus(reports["s"][:, 0], reports["b"][:, 0], p.buckets, p.epsilon)

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.buckets, np.nan)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _BinFlipPlusParams: type[ProtocolParams] = BinFlipPlusParams
