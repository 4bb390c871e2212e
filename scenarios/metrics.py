"""Error metrics of a run (docs/algorithms.md section 5).

- Means: the absolute error per round; mean and max over rounds.
- Histograms: max over buckets of |h_hat(v) - h(v)| per round (the papers' metric), and the Wasserstein-1
  distance in value units between the true histogram and the estimate clipped at 0 and renormalized (an
  estimate with no positive bucket is taken as uniform).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def clip_renormalize(est: np.ndarray) -> np.ndarray:
    """Post-processing of a histogram estimate: negative frequencies to 0, then scaled to sum to 1."""
    c = np.clip(np.asarray(est, dtype=np.float64), 0.0, None)
    total = c.sum()
    return c / total if total > 0 else np.full(c.size, 1.0 / c.size)


def wasserstein(truth: np.ndarray, est: np.ndarray, bucket_width: float) -> float:
    """W1 between two histograms on equal-width buckets: width x sum over bucket edges of |F - F_hat|."""
    t = np.asarray(truth, dtype=np.float64)
    return float(bucket_width * np.abs(np.cumsum(t / t.sum()) - np.cumsum(clip_renormalize(est)))[:-1].sum())


def round_metrics(kind: str, truth, est, bucket_width: float = 1.0) -> dict[str, float]:
    """The per-round error figures logged with each closed round."""
    if kind in ("mean", "epoch", "stream"):
        return {"abs_error": abs(float(est) - float(truth))}
    err = np.abs(np.asarray(est) - np.asarray(truth))
    if kind == "counters":
        return {"max_abs": float(err.max()) if np.all(np.isfinite(err)) else math.nan}
    if not np.all(np.isfinite(err)):
        return {"max_abs": math.nan, "wasserstein": math.nan}
    return {"max_abs": float(err.max()), "wasserstein": wasserstein(truth, est, bucket_width)}


#: what summary.json's ``error`` figures are errors of, by the protocol's kind of estimate
ERROR_OF = {"mean": "of each round's mean counter, in the counter's units",
            "epoch": "of each epoch's mean, a probability",
            "stream": "of each round's sum over devices, in the counter's units",
            "histogram": "of each bucket's frequency",
            "counters": "of each round's mean of each counter, in the counters' units"}



def error_of(params: Any, unit: str | None = None) -> str:
    """What a protocol's error figures are errors of: its parameter class's ``error_of`` (a plugin's own
    words); else, for a mean whose plugin words what it estimates (``estimate_label``), each round's that (in
    no unit: it need not be the counters'); else :data:`ERROR_OF` by its kind of estimate, with ``unit`` (the
    scenario's [population] unit) named in place of "the counter's units"."""
    own = getattr(params, "error_of", None)
    if isinstance(own, str) and own:
        return own
    label = getattr(params, "estimate_label", None)
    if isinstance(label, str) and label and getattr(params, "kind", None) == "mean":
        return f"of each round's {label}"
    return in_unit(ERROR_OF.get(params.kind, "per estimated number"), unit)


def in_unit(text: str, unit: str | None) -> str:
    """``text`` (an :data:`ERROR_OF` or :data:`ERROR_FIGURES` phrase) with the counters' unit named where the
    scenario gives one."""
    if not unit:
        return text
    for vague in ("the counter's units", "the counters' units", "the value's units"):
        text = text.replace(vague, unit)
    return text


#: each figure of summary.json's ``error`` in words (a sweep's plot axes)
ERROR_FIGURES = {"mean_abs": "mean |error| over every estimated number",
                 "max_abs": "max |error| over every estimated number",
                 "rmse": "root mean squared error",
                 "rounds_without_estimate": "rounds without an estimate (a count)",
                 "hist_max_abs": "max bucket error, mean over rounds",
                 "wasserstein": "Wasserstein-1 distance, mean over rounds (in the value's units)"}


def error_summary(kind: str, truths: Sequence | np.ndarray, ests: Sequence | np.ndarray, bucket_width: float = 1.0) -> dict[str, float | int | None]:
    """``error`` of summary.json: mean_abs, max_abs, rmse over every estimated number; for histograms also
    hist_max_abs (mean over rounds of the max bucket error) and wasserstein (mean over rounds)."""
    t = np.asarray(truths, dtype=np.float64)
    e = np.asarray(ests, dtype=np.float64)
    err = np.abs(e - t)
    ok = np.isfinite(err) if err.ndim == 1 else np.all(np.isfinite(err), axis=1)
    out: dict[str, float | int | None] = {"mean_abs": None, "max_abs": None, "rmse": None,
                                           "rounds_without_estimate": int(ok.size - ok.sum())}
    if ok.any():
        good = err[ok]
        out.update(mean_abs=float(good.mean()), max_abs=float(good.max()), rmse=float(np.sqrt(np.mean(good**2))))
    if kind == "histogram":
        out["hist_max_abs"] = float(err[ok].max(axis=1).mean()) if ok.any() else None
        out["wasserstein"] = (float(np.mean([wasserstein(t[i], e[i], bucket_width) for i in np.flatnonzero(ok)]))
                              if ok.any() else None)
    return out


def range_queries(rounds: int, count: int, seed: int) -> np.ndarray:
    """``count`` random ranges [i, j] of rounds 1..rounds with endpoints uniform and sorted (keyed by seed)."""
    from protocols import keyed

    ends = np.stack([keyed.uniform(keyed.stream_key(seed, 99, k), np.arange(count)) for k in (0, 1)], axis=1)
    ends = np.sort(np.minimum((ends * rounds).astype(np.int64), rounds - 1), axis=1)
    return ends + 1


def range_mse(truth: np.ndarray, est: np.ndarray, queries: np.ndarray) -> float:
    """Mean squared error of range-sum queries: sum of estimates over [i, j] against the true sum."""
    ct = np.concatenate(([0.0], np.cumsum(truth)))
    ce = np.concatenate(([0.0], np.cumsum(np.nan_to_num(est))))
    i, j = queries[:, 0], queries[:, 1]
    return float(np.mean(((ce[j] - ce[i - 1]) - (ct[j] - ct[i - 1])) ** 2))
