"""Keyed randomness: pure functions of (seed, purpose, context, device) with the right distributions."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import keyed
from protocols.keyed import Purpose, stream_key

Z = 4.5
N = 1_000_000


def test_uniform_moments_and_range() -> None:
    u = keyed.uniform(stream_key(1, Purpose.REPORT, 1), np.arange(N))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < Z * math.sqrt(1 / 12 / N)
    # each decile holds a tenth: binomial standard error
    counts = np.bincount((u * 10).astype(int), minlength=10)
    assert np.all(np.abs(counts / N - 0.1) < Z * math.sqrt(0.09 / N))


def test_streams_are_uncorrelated_across_purposes_rounds_and_neighbours() -> None:
    ids = np.arange(N)
    a = keyed.uniform(stream_key(1, Purpose.REPORT, 1), ids)
    for other in (keyed.uniform(stream_key(1, Purpose.REPORT, 2), ids),
                  keyed.uniform(stream_key(1, Purpose.FLIP, 1), ids),
                  keyed.uniform(stream_key(2, Purpose.REPORT, 1), ids),
                  np.roll(a, 1)):
        r = np.corrcoef(a, other)[0, 1]
        assert abs(r) < Z / math.sqrt(N)


def test_normal_moments() -> None:
    z = keyed.normal(stream_key(3, Purpose.JITTER, 4), np.arange(N))
    assert abs(z.mean()) < Z / math.sqrt(N)
    assert abs(z.var() - 1) < Z * math.sqrt(2 / N)
    for q, tail in ((1.959964, 0.025), (2.575829, 0.005)):
        assert abs(np.mean(z > q) - tail) < Z * math.sqrt(tail * (1 - tail) / N)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**63 - 1), round_=st.integers(0, 2**31), lo=st.integers(0, 2**32 - 200),
       size=st.integers(1, 150))
def test_draws_are_pure_functions_of_the_device(seed: int, round_: int, lo: int, size: int) -> None:
    """A device's draw does not depend on which other devices are drawn with it (cohort invariance)."""
    ids = np.arange(lo, lo + size)
    key = stream_key(seed, Purpose.MEMO, round_)
    whole = keyed.uniform(key, ids)
    alone = np.array([keyed.uniform(key, ids[i:i + 1])[0] for i in range(size)])
    np.testing.assert_array_equal(whole, alone)
    subs = ids % 7
    np.testing.assert_array_equal(keyed.uniform_sub(key, ids, subs)[::3], keyed.uniform_sub(key, ids[::3], subs[::3]))
    np.testing.assert_array_equal(keyed.normal(key, ids)[1:], keyed.normal(key, ids[1:]))


def test_blocked_normal_kernel_draws_what_the_scalar_definition_draws() -> None:
    """keyed.normal runs the inverse CDF's central branch on every draw and redoes the tails: each draw must be
    normal1's, bit for bit, in the tails too (a kernel that kept the central branch there would fail)."""
    key = stream_key(5, Purpose.LEVEL, 0)
    ids = np.concatenate([np.arange(3000), np.arange(2**40, 2**40 + 3000)])
    got = keyed.normal(key, ids)
    want = np.array([keyed.normal1(np.uint64(key), np.uint64(i)) for i in ids])
    assert np.array_equal(got, want)
    assert np.sum(np.abs(want) > 1.97) > 100  # the tails (|z| beyond the central branch's 2.4% bounds) are in


def test_ids_of_any_integer_type_draw_the_same_as_uint64() -> None:
    """The kernels take int64, uint32 and uint64 ids as they are and widen each one as numpy's astype would."""
    key = stream_key(9, Purpose.REPORT, 3)
    ids = np.array([0, 1, 7, 2**31 + 5, 2**32 - 1], dtype=np.int64)
    want = keyed.uniform(key, ids.astype(np.uint64))
    for dtype in (np.int64, np.uint32):  # every id fits both
        assert np.array_equal(keyed.uniform(key, ids.astype(dtype)), want), dtype
        assert np.array_equal(keyed.normal(key, ids.astype(dtype)), keyed.normal(key, ids.astype(np.uint64)))
    small = ids[:3]  # converted ones (int16, lists)
    assert np.array_equal(keyed.uniform(key, small.astype(np.int16)), want[:3])
    assert np.array_equal(keyed.uniform(key, small.tolist()), want[:3])
    wrapped = np.array([-1, -2**40], dtype=np.int64)
    assert np.array_equal(keyed.uniform(key, wrapped), keyed.uniform(key, wrapped.astype(np.uint64)))
    assert np.array_equal(keyed.normal(key, wrapped), keyed.normal(key, wrapped.astype(np.uint64)))
