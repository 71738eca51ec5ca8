"""Fitting the profiled cost model: non-negative least squares on relative error.

Why this model. Each feature (a step, a prefill token, a decode token, a context token read, a
sequence, an attention pair, a shared context token) is a cost that adds up: the weights stream
once per step, every token pays the linears, attention pays per cached token read and per scored
pair, every sequence pays its per-request bookkeeping and sampling, and a token of a block that
another sequence of the step reads too (a shared prefix) pays a re-read from the CPU's cache. So
step time is a sum of non-negative rates times counts. Plain least squares on such a grid
happily returns a negative rate for one of two correlated features (decode tokens and sequences
move together), which then extrapolates to negative or shrinking step times outside the grid;
bounding every rate at >= 0 keeps each term physical. Rows are weighted by 1 / measured time so
a 15 ms decode step is fitted as closely, in relative terms, as a 1 s prefill: the latencies
users read (TPOT) are made of the small steps.

Lawson and Hanson's active-set NNLS (Solving Least Squares Problems, 1974, ch. 23), in numpy, on
columns scaled to unit maximum so that the tolerance means the same for every feature.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float,
                      iters: int) -> float:
    """The x in [lo, hi] where the increasing `f` reaches `target`: `iters` halvings of the
    bracket (the caller makes sure it holds the crossing)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(a).max(initial=0.0)))
    max_iter = max_iter or 3 * n
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            mask = passive & (s <= 0)
            alpha = np.min(x[mask] / (x[mask] - s[mask]))
            x = x + alpha * (s - x)
            passive &= x > tol
            if not passive.any():
                s = np.zeros(n)
                break
        x = s
        w = a.T @ (b - a @ x)
    return x


def weighted_nnls(rows, targets, weights) -> np.ndarray:
    """argmin sum_i (weights_i (rows_i . x - targets_i))^2 subject to x >= 0, on columns scaled
    to unit maximum (so `nnls`'s tolerance means the same for every feature)."""
    x = np.asarray(rows, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)[:, None]
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls((x / scale) * w, np.asarray(targets, dtype=np.float64) * w[:, 0]) / scale


def fit_step_times(rows: list[list[float]], times: list[float]) -> tuple[np.ndarray, dict]:
    """Coefficients (seconds per unit of each feature) and the fit's relative errors."""
    x = np.asarray(rows, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"need at least {x.shape[1]} timed shapes to fit, got {x.shape[0]}")
    coefs = weighted_nnls(x, t, 1.0 / t)
    rel = (x @ coefs - t) / t
    return coefs, {"method": "non-negative least squares on relative error (Lawson-Hanson)",
                   "relative_rms_error": float(np.sqrt(np.mean(rel ** 2))),
                   "max_relative_error": float(np.abs(rel).max()),
                   "num_shapes": int(len(t))}
