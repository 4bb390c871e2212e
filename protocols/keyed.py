"""Keyed (counter-based) randomness: every draw is a pure function of (seed, purpose, context, device).

docs/design.md section 3. Nothing here keeps state: a draw for device ``i`` in round ``r`` for purpose ``p`` is
``splitmix64(i * GOLDEN + key(seed, p, r, ...))``, the SplitMix64 output function (Steele, Lea, Flood 2014)
applied to a Weyl sequence started at a per-stream key. Consequently results do not depend on how devices
are grouped into cohorts, on event order, or on the runtime, and a single device can be replayed alone.

Stream keys are derived in Python integers (exact); the per-device kernels are numba-compiled loops (the
hot path of every simulation: about 4 ns per draw, against 60 ns for the same arithmetic in numpy).
"""

from __future__ import annotations

import enum
import functools
import math

import numba as nb
import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TWO_M53 = 1.0 / 9007199254740992.0  # 2**-53


class Purpose(enum.IntEnum):
    """Stream tags. The numbers are part of the reproducibility contract: never renumber, only append."""

    ALPHA = 1  # alpha-point rounding offset, once per device
    MEMO = 2  # memoized 1BitMean bit of a grid value
    FLIP = 3  # output-perturbation flip, once per round
    REPORT = 4  # fresh (non-memoized) report randomness, once per round
    LEVEL = 5  # a device's own counter level, per scenario phase
    JITTER = 6  # per-round variation around the level
    AFFECTED = 7  # whether a scripted change hits a device
    LOSS = 8  # network loss of one report
    LATENCY = 9  # network latency of one report
    BUCKETS = 10  # dBitFlip's d sampled buckets J, once per device
    NOISE = 11  # additive noise of a report (Laplace)
    SPLIT = 12  # how a device's counter splits over several counters (apps)
    VOTE = 13  # THRESH vote, once per epoch
    ESTIMATE = 14  # THRESH estimate, once per epoch
    HOLDOUT = 15  # whether a device belongs to ToPL's holdout, once per device
    DOWNLINK = 16  # loss of a broadcast on its way to one device
    BEHAVIOR = 1000  # draws of scripted behaviors (agents/behavior.py), kept apart from the protocols' tags


def _mix_int(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=1 << 16)
def stream_key(seed: int, purpose: int, *context: int) -> int:
    """The 64-bit key of one stream: seed, purpose tag and integer context (round, grid index, ...). Cached:
    every cohort of a round asks for the same few keys."""
    k = _mix_int(int(seed) * GOLDEN + 0x5851F42D4C957F2D)
    for part in (int(purpose), *context):
        k = _mix_int(k ^ (int(part) & MASK64))
    return k


@nb.njit(inline="always")
def mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def _unit(z):
    """Top 53 bits of a 64-bit word as a float in [0, 1)."""
    return np.float64(z >> np.uint64(11)) * _TWO_M53


@nb.njit(inline="always")
def uniform1(key, device):
    """One uniform in [0, 1) for (key, device): the scalar building block of every kernel."""
    return _unit(mix(device * np.uint64(GOLDEN) + key))


@nb.njit(inline="always")
def uniform2(key, device, sub):
    """One uniform keyed by (key, device, sub): e.g. the memo bit of grid value ``sub``."""
    z = mix(device * np.uint64(GOLDEN) + key)
    return _unit(mix(z + (sub + np.uint64(1)) * np.uint64(GOLDEN)))


# Acklam's rational approximation of the inverse normal CDF (relative error < 1.2e-9): pure arithmetic in
# the central 95%, one log and one sqrt in the tails, so several times cheaper than Box-Muller.
_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
      -3.066479806614716e01, 2.506628277459239e00)
_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
      -1.328068155288572e01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
      4.374664141464968e00, 2.938163982698783e00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
_P_LOW = 0.02425


@nb.njit(inline="always")
def normal_uniform(key, device):
    """The uniform in (0, 1) whose inverse normal CDF is :func:`normal1`'s draw for (key, device)."""
    return (np.float64(mix(device * np.uint64(GOLDEN) + key) >> np.uint64(11)) + 0.5) * _TWO_M53


@nb.njit(inline="always")
def normal_tail(p):
    """Whether :func:`inverse_normal_cdf` takes a tail branch for p (about 5% of draws)."""
    return p < _P_LOW or p > 1.0 - _P_LOW


@nb.njit(inline="always")
def central_normal(p):
    """The central branch of :func:`inverse_normal_cdf` (its value for P_LOW <= p <= 1 - P_LOW), branch-free: a
    kernel computes it for every draw in vector instructions and redoes the few tail draws."""
    q = p - 0.5
    r = q * q
    return ((((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * q
            / (((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1.0))


@nb.njit(inline="always")
def inverse_normal_cdf(p):
    """Standard normal quantile of p in (0, 1) (Acklam's algorithm)."""
    if p < _P_LOW:
        q = math.sqrt(-2.0 * math.log(p))
        return ((((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5])
                / ((((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0))
    if p > 1.0 - _P_LOW:
        q = math.sqrt(-2.0 * math.log(1.0 - p))
        return -((((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5])
                 / ((((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0))
    return central_normal(p)


@nb.njit(inline="always")
def normal1(key, device):
    """One standard normal for (key, device): the inverse CDF of a keyed uniform in (0, 1)."""
    return inverse_normal_cdf(normal_uniform(key, device))


_BLOCK = 1024  # draws per block of :func:`_normal_kernel`


@nb.njit(cache=True, nogil=True)
def _uniform_kernel(key, ids, out):
    for i in range(ids.shape[0]):
        out[i] = uniform1(key, np.uint64(ids[i]))


@nb.njit(cache=True, nogil=True, error_model="numpy")
def _normal_kernel(key, ids, out):
    """out[i] = normal1(key, ids[i]) in blocks of three passes that the compiler turns into vector instructions
    (5-8x the element-wise loop): every draw's uniform and central branch, then the tails (about 5%) redone by
    the whole inverse CDF. The same operations on the same numbers, so the same bits; the numpy error model only
    lets the division vectorize (its denominator is never 0)."""
    p = np.empty(_BLOCK)
    for b0 in range(0, ids.shape[0], _BLOCK):
        size = min(_BLOCK, ids.shape[0] - b0)
        for j in range(size):
            p[j] = normal_uniform(key, np.uint64(ids[b0 + j]))
            out[b0 + j] = central_normal(p[j])
        for j in range(size):
            if normal_tail(p[j]):
                out[b0 + j] = inverse_normal_cdf(p[j])


@nb.njit(cache=True, nogil=True)
def _uniform_sub_kernel(key, ids, subs, out):
    for i in range(ids.shape[0]):
        out[i] = uniform2(key, np.uint64(ids[i]), np.uint64(subs[i]))


def kernel_ids(device_ids: np.ndarray) -> np.ndarray:
    """Device ids as the kernels take them: 64- or 32-bit integers as they are (each kernel turns an id into
    uint64 as numpy's astype would: negative ones wrap), anything else converted; contiguous."""
    ids = np.asarray(device_ids)
    if ids.dtype in (np.int64, np.uint64, np.uint32):
        return np.ascontiguousarray(ids)
    return np.ascontiguousarray(ids, dtype=np.uint64)


def uniform(key: int, device_ids: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1), one per device, for the stream ``key``."""
    ids = kernel_ids(device_ids)
    out = np.empty(ids.shape[0], dtype=np.float64)
    _uniform_kernel(np.uint64(key), ids, out)
    return out


def uniform_sub(key: int, device_ids: np.ndarray, subs: np.ndarray) -> np.ndarray:
    """Uniforms keyed additionally by a per-device integer ``subs`` (a grid index, a bucket...)."""
    ids = kernel_ids(device_ids)
    sub = np.ascontiguousarray(subs, dtype=np.int64)
    if sub.shape != ids.shape:
        raise ValueError("device_ids and subs must have the same shape")
    out = np.empty(ids.shape[0], dtype=np.float64)
    _uniform_sub_kernel(np.uint64(key), ids, sub, out)
    return out


def normal(key: int, device_ids: np.ndarray) -> np.ndarray:
    """Standard normals, one per device, for the stream ``key``."""
    ids = kernel_ids(device_ids)
    out = np.empty(ids.shape[0], dtype=np.float64)
    _normal_kernel(np.uint64(key), ids, out)
    return out


def bernoulli(key: int, device_ids: np.ndarray, p: np.ndarray | float) -> np.ndarray:
    """Bernoulli(p) draws as uint8, one per device: ``uniform < p``."""
    return (uniform(key, device_ids) < p).astype(np.uint8)
