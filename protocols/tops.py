"""ToPS: central-DP continuous release of a stream (Wang et al., CCS 2021, "Continuous Release of Data Streams
under both Centralized and Local Differential Privacy", Sections 3.3-3.5 and Appendices C-D; docs/algorithms.md
section 4.4). A *trusted* collector sees the raw values x_1, x_2, ... (one non-negative number per time step,
bounded by ``max_value``; in the simulator a population total per round) and releases noisy per-step values
and range sums online. Three parts:

1. Threshold optimizer NM-E (Section 3.3, Eq. 6): report-noisy-max over the candidates theta in
   {0, step, 2 step, ...} (step 1: all integers, as in the paper) on a holdout of h values that is never
   released, with score(theta) = (#{x <= theta} - h) - c theta and Laplace(1/eps_1) noise per score. The
   scores are monotone counting queries of sensitivity 1 (changing one holdout value moves every count the
   same way), so 1/eps_1 suffices (Dwork and Roth, Claim 3.9; the paper, Section 2.3).
   c = sqrt(2 (F - 1) H^3 / eps^2) * 3 h / (N - h) / K, the authors' code (docs/algorithms.md section 4.4), with
   K = 60 (``bias_constant``). Our reading: sqrt(2 (F-1) H^3/eps^2) theta is the standard deviation of a
   random range query on the F-ary hierarchy (Eq. 4, Qardaji et al.: about (F-1) H nodes of variance
   2 (H theta/eps)^2); the truncation bias of a random query, (N - h)/3 values times a per-value bias
   approximated by K #{x > theta}/h, is scaled by 3 h/((N - h) K) to give the count term sensitivity 1.
   Hence h = the holdout size (number of values NM looks at) and N - h = the length of the released stream
   a random query ranges over (the authors: N values, the first h held out). Here queries live within a
   range limit R, so N - h := ``span``, by default R = ``range_limit`` (pass ``span`` for shorter streams).
   K is in value units (the authors' data are counts and fares of order 10-1000): rescale it with the data.
2. Perturber (Section 3.4): every chunk of R = ``range_limit`` steps gets its own complete F-ary tree of
   depth D = ceil(log_F R) (F^D >= R leaves; leaves beyond R are padding that never receive data), with
   H = D + 1 levels. Values are clipped to [0, theta]. eps is split evenly over the L levels that are
   kept (L = H - s, see 3), so every node gets Laplace(b), b = theta L / eps: one value changes one node per
   level by at most theta, so the chunk is eps-DP, and chunks are disjoint (parallel composition).
   Online consistency (Theorem 3.1, Appendix C): all the chunk's noise is drawn first, made consistent by
   the two passes of Hay et al. (PVLDB 2010, Theorem 3; minimum squared error for equal variances), and
   then added to the true node sums as the values arrive. The noise is data-independent and the true sums
   are consistent, so every released node equals the sum of its children and nothing released at t
   depends on values after t.
3. Smoother "Recent" (Section 3.5, Appendix D): the lowest s levels are dropped from the tree (its leaves
   become blocks of B = F^s steps, and eps goes to the remaining L = H - s levels). Each step of block k
   is released as the most recent block estimate's average, est(block k-1)/B (over the block's steps within
   its chunk, fewer than B for a padded last block; the first block of the stream uses theta/2, the paper's
   initial guess). The paper picks s by minimizing Eq. 7, whose formula was lost
   in conversion; we use its stated ingredients: noise 2 (F-1) (H-s)^3 theta^2/eps^2 (Eq. 4 with H - s
   levels) plus the squared smoothing bias (F^s beta)^2 (about F^s predicted values in a random query, those
   of its two partial blocks, each off by beta). beta is data-dependent and not recoverable; we take
   beta = theta/2 (``smooth_bias`` = 0.5), the worst-case error of the theta/2 guess for values in
   [0, theta], which keeps s small: smoothing is used only when the tree noise clearly dominates
   (F = 16, H = 3: s = 1 for eps < 2.99, s = 2 for eps < 0.11). ``smooth_levels`` overrides the choice.
   Range sums use tree nodes for the whole blocks of a range and the released (predicted) steps for its
   partial blocks; with s = 0 they are exactly sums of consistent leaves, unbiased below theta.

Randomness: all from protocols.keyed; tree noise of chunk c, level l from stream_key(seed, NOISE, 900 + l, c)
(ids: node index), NM noise from stream_key(seed, NOISE, 899, call) (ids: candidate index).
"""

from __future__ import annotations

import math

import numpy as np

from protocols import keyed
from protocols.keyed import Purpose, stream_key

FANOUT = 16  # Section 3.4, "Better Fan-out" (Qardaji et al. 2013)
BIAS_CONSTANT = 60.0  # K in c (authors' code, docs/algorithms.md section 4.4), value units
SMOOTH_BIAS = 0.5  # beta / theta in the smoothing criterion (our assumption, see module docstring)
MAX_CANDIDATES = 1 << 22
_TAG_THRESHOLD = 899
_TAG_TREE = 900
_HALF_CELL = 2.0 ** -54  # half the 2^-53 grid of keyed uniforms


# --------------------------------------------------------------------------------------------- Laplace
def laplace_from_uniform(u: np.ndarray, scale: float) -> np.ndarray:
    """Laplace(scale) by the inverse CDF: -scale sign(u - 1/2) log(1 - 2 |u - 1/2|).

    Guard at u = 0 (log 0): u is evaluated at the centre of its 2^-53 grid cell, u + 2^-54, a grid that is
    symmetric about 1/2, so the result is finite (|X| <= 53 ln 2 scale) and exactly symmetric.
    """
    v = (np.asarray(u, dtype=np.float64) - 0.5) + _HALF_CELL  # exact in binary64, never 0 or +-1/2
    return -scale * np.sign(v) * np.log1p(-2.0 * np.abs(v))


def laplace(key: int, ids: np.ndarray, scale: float) -> np.ndarray:
    """Keyed Laplace(scale) draws, one per id: a pure function of (key, id)."""
    return laplace_from_uniform(keyed.uniform(key, np.asarray(ids, dtype=np.uint64)), scale)


# ------------------------------------------------------------------------------------- threshold (NM-E)
def tree_depth(range_limit: int, fanout: int = FANOUT) -> int:
    """D = ceil(log_F R): the smallest D with F^D >= R (integer arithmetic). The tree has H = D + 1 levels."""
    d, n = 0, 1
    while n < range_limit:
        d, n = d + 1, n * fanout
    return d


def threshold_constant(eps: float, levels: int, holdout_size: int, span: int, fanout: int = FANOUT,
                       bias_constant: float = BIAS_CONSTANT) -> float:
    """c = sqrt(2 (F - 1) H^3 / eps^2) * 3 h / (N - h) / K (Eq. 6, authors' constants), with N - h = span."""
    return math.sqrt(2.0 * (fanout - 1) * levels ** 3 / eps ** 2) * 3.0 * holdout_size / span / bias_constant


def candidate_steps(max_value: float, step: float) -> int:
    """k, the last multiple of ``step`` in the candidates (:func:`threshold_candidates`); more than
    MAX_CANDIDATES - 2 is too many."""
    return int(math.floor(max_value / step + 1e-9))


def threshold_candidates(max_value: float, step: float = 1.0) -> np.ndarray:
    """{0, step, 2 step, ...} up to max_value, plus max_value itself (step 1: the integers of the paper)."""
    k = candidate_steps(max_value, step)
    if k + 2 > MAX_CANDIDATES:
        raise ValueError(f"{k + 1} threshold candidates: set threshold_step so max_value/threshold_step "
                         f"< {MAX_CANDIDATES}")
    cand = np.arange(k + 1, dtype=np.float64) * step
    return cand if cand[-1] >= max_value else np.append(cand, float(max_value))


def threshold_scores(holdout: np.ndarray, candidates: np.ndarray, c: float) -> np.ndarray:
    """Noise-free NM-E scores (Eq. 6): (#{x <= theta} - h) - c theta = -#{x > theta} - c theta."""
    x = np.sort(np.asarray(holdout, dtype=np.float64))
    return (np.searchsorted(x, candidates, side="right") - x.size) - c * np.asarray(candidates)


def noisy_max(scores: np.ndarray, eps_1: float, key: int) -> int:
    """Report-noisy-max: argmax of score + Laplace(1/eps_1) (monotone queries of sensitivity 1)."""
    noisy = scores + laplace(key, np.arange(scores.size), 1.0 / eps_1)
    return int(np.argmax(noisy))


# --------------------------------------------------------------------------------------- smoothing level
def smoothing_error(s: int, theta: float, eps: float, levels: int, fanout: int = FANOUT,
                    smooth_bias: float = SMOOTH_BIAS) -> float:
    """Our reconstruction of Eq. 7: 2 (F-1) (H-s)^3 theta^2/eps^2 + (F^s beta)^2, beta = smooth_bias theta."""
    return (2.0 * (fanout - 1) * (levels - s) ** 3 * theta ** 2 / eps ** 2
            + (fanout ** s * smooth_bias * theta) ** 2)


def choose_smooth_levels(theta: float, eps: float, levels: int, fanout: int = FANOUT,
                         smooth_bias: float = SMOOTH_BIAS) -> int:
    """s in {0, ..., H - 1} minimizing :func:`smoothing_error` (ties: the smaller s)."""
    errs = [smoothing_error(s, theta, eps, levels, fanout, smooth_bias) for s in range(levels)]
    return int(np.argmin(errs))


# ------------------------------------------------------------------------------------------ consistency
def enforce_consistency(noisy: list[np.ndarray], fanout: int) -> list[np.ndarray]:
    """Hay et al. (PVLDB 2010) two-pass least squares for a complete F-ary tree with equal node variances.

    ``noisy[p]`` holds level p bottom-up (p = 0: leaves, F^(L-1) nodes; p = L-1: the root), optionally with
    trailing batch axes. Bottom-up, at height i = p + 1 (Eq. 10):
    z[v] = (F^i - F^(i-1))/(F^i - 1) y[v] + (F^(i-1) - 1)/(F^i - 1) sum_children z[u];
    top-down (Eq. 11): out[root] = z[root], out[v] = z[v] + (out[parent] - sum_siblings_and_v z[u]) / F.
    The result is the orthogonal projection of ``noisy`` onto the consistent trees; it is linear.
    """
    f = int(fanout)
    levels = len(noisy)
    z = [np.asarray(noisy[0], dtype=np.float64)]
    for p in range(1, levels):
        y = np.asarray(noisy[p], dtype=np.float64)
        child = z[p - 1].reshape(y.shape[0], f, *y.shape[1:]).sum(axis=1)
        i = p + 1
        a = (f ** i - f ** (i - 1)) / (f ** i - 1)
        z.append(a * y + (f ** (i - 1) - 1) / (f ** i - 1) * child)
    if z[-1].shape[0] != 1:
        raise ValueError("the top level must be a single root")
    out: list[np.ndarray] = [np.empty(0)] * levels
    out[-1] = z[-1]
    for p in range(levels - 2, -1, -1):
        parent = out[p + 1]
        child = z[p].reshape(parent.shape[0], f, *parent.shape[1:]).sum(axis=1)
        out[p] = z[p] + np.repeat((parent - child) / f, f, axis=0)
    return out


def decompose(lo: int, hi: int, fanout: int, levels: int) -> list[tuple[int, int]]:
    """Minimal set of (level, index) nodes whose leaves are exactly [lo, hi) in a complete F-ary tree with
    ``levels`` levels (level 0: leaves): at most 2 (F - 1) nodes per level."""
    nodes: list[tuple[int, int]] = []
    level = 0
    while lo < hi:
        up_lo, up_hi = -(-lo // fanout) * fanout, (hi // fanout) * fanout
        if level == levels - 1 or up_lo >= up_hi:
            nodes.extend((level, k) for k in range(lo, hi))
            break
        nodes.extend((level, k) for k in range(lo, up_lo))
        nodes.extend((level, k) for k in range(up_hi, hi))
        lo, hi, level = up_lo // fanout, up_hi // fanout, level + 1
    return nodes


def consistent_range_factor(lo: int, hi: int, fanout: int, levels: int) -> float:
    """Var(consistent noise of leaves [lo, hi)) / Var(one node), in closed form (independent of the passes).

    The consistent tree is generalized least squares with A the node-by-leaf 0/1 matrix, so the variance of
    q^T leaves is sigma^2 q^T (A^T A)^-1 q. A^T A = sum_l F^l E_l, E_l the projection onto vectors constant
    on the level-l blocks; with Q_m = E_m - E_(m+1) (E_L = 0) this is sum_m Q_m (F^(m+1) - 1)/(F - 1), so
    q^T (A^T A)^-1 q = sum_m (F - 1)/(F^(m+1) - 1) (S_m - S_(m+1)), S_m = ||E_m q||^2
    = sum over level-m nodes of (leaves of the node in [lo, hi))^2 / F^m.
    """
    f = fanout

    def s_m(m: int) -> float:
        if m >= levels:
            return 0.0
        w = f ** m
        first, last = lo // w, (hi - 1) // w
        tot = 0.0
        for k in range(first, last + 1):
            n = min(hi, (k + 1) * w) - max(lo, k * w)
            tot += n * n
        return tot / w

    s = [s_m(m) for m in range(levels + 1)]
    return sum((f - 1) / (f ** (m + 1) - 1) * (s[m] - s[m + 1]) for m in range(levels))


# ------------------------------------------------------------------------------------------------ ToPS
class ToPS:
    """Trusted-collector ToPS (Wang et al. 2021): ``choose_threshold`` (or ``set_threshold``), then ``add``
    one value per time step t = 1, 2, ... (the holdout is not part of the released stream), and read
    ``estimate_range(i, j)`` / ``estimates()``. Privacy: eps for the released stream and eps_threshold for the
    holdout; they are disjoint data, so max(eps, eps_threshold) overall (parallel composition, Section 3.6).
    """

    def __init__(self, max_value: float, eps: float, eps_threshold: float, range_limit: int,
                 fanout: int = FANOUT, seed: int = 0, smooth_levels: int | None = None,
                 threshold_step: float = 1.0, bias_constant: float = BIAS_CONSTANT,
                 smooth_bias: float = SMOOTH_BIAS) -> None:
        if not (math.isfinite(max_value) and max_value > 0):
            raise ValueError(f"max_value must be positive, got {max_value}")
        for name, v in (("eps", eps), ("eps_threshold", eps_threshold)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive, got {v}")
        if int(range_limit) < 1 or int(fanout) < 2:
            raise ValueError("range_limit must be >= 1 and fanout >= 2")
        self.max_value, self.eps, self.eps_threshold = float(max_value), float(eps), float(eps_threshold)
        self.range_limit, self.fanout, self.seed = int(range_limit), int(fanout), int(seed)
        self.depth = tree_depth(self.range_limit, self.fanout)
        self.levels = self.depth + 1  # H
        if smooth_levels is not None and not 0 <= int(smooth_levels) < self.levels:
            raise ValueError(f"smooth_levels must be in [0, {self.levels - 1}]")
        self._smooth_request = smooth_levels
        self.threshold_step, self.bias_constant, self.smooth_bias = threshold_step, bias_constant, smooth_bias
        self.threshold: float | None = None
        self.c: float | None = None
        self.smooth_levels = 0
        self._nm_calls = 0
        self.clipped = 0
        self._prefix: list[float] = [0.0]  # prefix sums of the clipped released values
        self._est: list[float] = []  # per-step released estimates
        self._trees: dict[int, list[np.ndarray]] = {}
        self._rate = 0.0  # Recent smoother: current per-step prediction

    # -- structure
    @property
    def tree_levels(self) -> int:
        """L = H - s: the levels that get noise (and eps/L each)."""
        return self.levels - self.smooth_levels

    @property
    def block(self) -> int:
        """B = F^s: steps per leaf of the (pruned) tree."""
        return self.fanout ** self.smooth_levels

    @property
    def level_epsilon(self) -> float:
        return self.eps / self.tree_levels

    @property
    def scale(self) -> float:
        """Laplace scale per node, b = theta / (eps / L) (sensitivity theta per level)."""
        return self._need_threshold() / self.level_epsilon

    @property
    def node_variance(self) -> float:
        """Var of one node's raw noise: 2 b^2."""
        return 2.0 * self.scale ** 2

    @property
    def t(self) -> int:
        """Number of released steps so far."""
        return len(self._est)

    # -- snapshots
    def _config(self) -> list:
        return [self.max_value, self.eps, self.eps_threshold, self.range_limit, self.fanout, self.seed,
                -1 if self._smooth_request is None else int(self._smooth_request), float(self.threshold_step),
                float(self.bias_constant), float(self.smooth_bias)]

    def snapshot(self) -> dict:
        """Everything :meth:`add` and the range queries depend on: theta, the smoothing level, the noisy-max
        call count, the released steps and prefix sums. The noise trees are keyed draws, redrawn on demand."""
        return {"config": np.array(self._config(), dtype=np.float64),
                "threshold": math.nan if self.threshold is None else self.threshold,
                "has_threshold": self.threshold is not None, "c": math.nan if self.c is None else self.c,
                "smooth_levels": self.smooth_levels, "nm_calls": self._nm_calls, "clipped": int(self.clipped),
                "prefix": np.array(self._prefix, dtype=np.float64), "est": np.array(self._est, dtype=np.float64),
                "rate": float(self._rate)}

    def restore(self, state: dict) -> None:
        from protocols import snapshot as snap

        config = snap.array(state, "config", np.float64, (len(self._config()),))
        if not np.array_equal(config, np.array(self._config(), dtype=np.float64)):
            raise snap.SnapshotError("ToPS snapshot of other parameters (max_value, eps, range, seed...)")
        est = snap.array(state, "est", np.float64, (None,))
        prefix = snap.array(state, "prefix", np.float64, (est.size + 1,))
        self.threshold = snap.field(state, "threshold", float) if snap.field(state, "has_threshold", bool) else None
        c = snap.field(state, "c", float)
        self.c = None if math.isnan(c) else c
        self.smooth_levels = snap.field(state, "smooth_levels", int)
        self._nm_calls = snap.field(state, "nm_calls", int)
        self.clipped = snap.field(state, "clipped", int)
        self._prefix, self._est = prefix.tolist(), est.tolist()
        self._rate = snap.field(state, "rate", float)
        self._trees = {}

    # -- threshold
    def choose_threshold(self, holdout: np.ndarray, span: int | None = None) -> float:
        """NM-E on the holdout (eps_threshold-DP); sets and returns theta. N - h := span (default R)."""
        x = np.clip(np.asarray(holdout, dtype=np.float64).ravel(), 0.0, self.max_value)
        if x.size == 0:
            raise ValueError("the holdout is empty")
        span = self.range_limit if span is None else int(span)
        if span < 1:
            raise ValueError("span must be >= 1")
        self.c = threshold_constant(self.eps, self.levels, x.size, span, self.fanout, self.bias_constant)
        cand = threshold_candidates(self.max_value, self.threshold_step)
        key = stream_key(self.seed, Purpose.NOISE, _TAG_THRESHOLD, self._nm_calls)
        self._nm_calls += 1
        theta = float(cand[noisy_max(threshold_scores(x, cand, self.c), self.eps_threshold, key)])
        self.set_threshold(theta)
        return theta

    def set_threshold(self, theta: float) -> None:
        """Fix theta directly (as in the paper's Section 5.3); chooses s if it was left to the criterion."""
        if self.threshold is not None:
            raise ValueError("the threshold is already set")
        if not (math.isfinite(theta) and theta >= 0):
            raise ValueError(f"theta must be non-negative, got {theta}")
        self.threshold = float(theta)
        if self._smooth_request is None:
            # both terms of the criterion scale with theta^2: s depends on eps, H and F only
            self.smooth_levels = choose_smooth_levels(1.0, self.eps, self.levels, self.fanout, self.smooth_bias)
        else:
            self.smooth_levels = int(self._smooth_request)
        self._rate = self.threshold / 2.0  # Appendix D: initial estimate theta/2 per value

    def _need_threshold(self) -> float:
        """The threshold theta (a ValueError before it is chosen or set)."""
        if self.threshold is None:
            raise ValueError("call choose_threshold (or set_threshold) first")
        return self.threshold

    # -- noise trees
    def raw_noise(self, chunk: int) -> list[np.ndarray]:
        """The chunk's independent Laplace(b) node noise, levels bottom-up (level s of the full tree first)."""
        self._need_threshold()
        f, s, b = self.fanout, self.smooth_levels, self.scale
        return [laplace(stream_key(self.seed, Purpose.NOISE, _TAG_TREE + s + p, chunk),
                        np.arange(f ** (self.tree_levels - 1 - p)), b) for p in range(self.tree_levels)]

    def consistent_noise(self, chunk: int) -> list[np.ndarray]:
        """The chunk's noise after the consistency passes (cached; drawn before any of its values is used)."""
        tree = self._trees.get(chunk)
        if tree is None:
            tree = self._trees[chunk] = enforce_consistency(self.raw_noise(chunk), self.fanout)
        return tree

    # -- stream
    def _real_end(self, k: int) -> int:
        """Last in-chunk step (0-based) of block k."""
        return min((k + 1) * self.block, self.range_limit) - 1

    def _node_estimate(self, chunk: int, p: int, k: int) -> float:
        """True clipped sum of node (tree level p, index k) of ``chunk`` plus its consistent noise."""
        w = self.block * self.fanout ** p
        start = chunk * self.range_limit
        lo = start + min(k * w, self.range_limit)
        hi = start + min((k + 1) * w, self.range_limit)
        if hi > self.t:
            raise ValueError("node not complete yet")
        return self._prefix[hi] - self._prefix[lo] + float(self.consistent_noise(chunk)[p][k])

    def add(self, x: float, clip: bool = True) -> float:
        """Append x_t (clipped to [0, theta]); returns the step's released estimate. ``clip=False`` takes x_t as
        given: for a caller whose x_t already has sensitivity theta to one event (a sum of per-device values
        each clipped to theta, as the simulator's tops protocol feeds it)."""
        theta = self._need_threshold()
        x = float(x)
        v = min(max(x, 0.0), theta) if clip else x
        self.clipped += v != x
        t0 = self.t  # 0-based index of this step
        chunk, pos = divmod(t0, self.range_limit)
        tree = self.consistent_noise(chunk)
        self._prefix.append(self._prefix[-1] + v)
        if self.smooth_levels == 0:
            est = v + float(tree[0][pos])
        else:
            est = self._rate
            k = pos // self.block
            if pos == self._real_end(k):  # block complete: the most recent estimate for the next block
                self._est.append(est)
                self._rate = self._node_estimate(chunk, 0, k) / (pos + 1 - k * self.block)
                return est
        self._est.append(est)
        return est

    def estimates(self) -> np.ndarray:
        """Released per-step estimates (the leaf level after smoothing), t = 1..t."""
        return np.asarray(self._est, dtype=np.float64)

    def _pieces(self, i: int, j: int):
        """Split 1-based [i, j] by chunk into (chunk, in-chunk 0-based a, b)."""
        if not 1 <= i <= j <= self.t:
            raise ValueError(f"need 1 <= i <= j <= t = {self.t}, got [{i}, {j}]")
        a0, b0 = i - 1, j - 1
        for chunk in range(a0 // self.range_limit, b0 // self.range_limit + 1):
            start = chunk * self.range_limit
            yield chunk, max(a0, start) - start, min(b0, start + self.range_limit - 1) - start

    def _split_blocks(self, a: int, b: int) -> tuple[int, int, list[tuple[int, int]]]:
        """Whole blocks [f, g) in [a, b] and the partial step ranges (in-chunk, inclusive)."""
        bl = self.block
        ka, kb = a // bl, b // bl
        f = ka if a == ka * bl else ka + 1
        g = kb + 1 if b == self._real_end(kb) else kb
        partial: list[tuple[int, int]] = []
        if f >= g:  # no whole block: every step is a partial one
            return 0, 0, [(a, b)]
        if f > ka:
            partial.append((a, min(b, ka * bl + bl - 1)))
        if g <= kb:
            partial.append((max(a, kb * bl), b))
        return f, g, partial

    def estimate_range(self, i: int, j: int) -> float:
        """Estimated sum of x_i..x_j (1-based, j <= t): consistent tree nodes of the minimal decomposition for
        the whole blocks, released (Recent-smoothed) steps for partial blocks (none when s = 0)."""
        self._need_threshold()
        total = 0.0
        for chunk, a, b in self._pieces(i, j):
            f, g, partial = self._split_blocks(a, b)
            for p, k in decompose(f, g, self.fanout, self.tree_levels):
                total += self._node_estimate(chunk, p, k)
            start = chunk * self.range_limit
            for lo, hi in partial:
                total += float(np.sum(self._est[start + lo:start + hi + 1]))
        return total

    def range_variance(self, i: int, j: int, consistent: bool = True) -> float:
        """Closed-form noise variance of ``estimate_range(i, j)`` for a range of whole blocks (any range if
        s = 0): consistent, 2 b^2 q^T (A^T A)^-1 q per chunk (:func:`consistent_range_factor`); inconsistent,
        2 b^2 times the number of nodes in the minimal decomposition. Chunks are independent."""
        self._need_threshold()
        factor = 0.0
        for _, a, b in self._pieces(i, j):
            f, g, partial = self._split_blocks(a, b)
            if partial:
                raise ValueError("range_variance needs whole blocks (smoothed steps are predictions)")
            factor += (consistent_range_factor(f, g, self.fanout, self.tree_levels) if consistent
                       else len(decompose(f, g, self.fanout, self.tree_levels)))
        return factor * self.node_variance
