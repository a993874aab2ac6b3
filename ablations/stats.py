"""Statistics over seeds, numpy and the standard library only.

Student-t distribution (CDF and quantile from the regularized incomplete beta function,
evaluated by its continued fraction), per-variant summaries with t-based 95% confidence
intervals, paired comparisons against a baseline (paired t-test for continuous metrics,
exact McNemar test for 0/1 outcomes such as divergence) and Holm's step-down adjustment.

Missing values (`None`, e.g. the AUC of a diverged run) are never imputed: summaries use
the values present and say how many that was; paired comparisons use the pairs in which
both sides are present.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

_EPS = 1e-15
_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
  """Continued fraction of I_x(a, b) (modified Lentz), convergent for x < (a+1)/(a+b+2)."""
  c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
  d = 1.0 / (d if abs(d) > _TINY else _TINY)
  result = d
  for m in range(1, 10_000):
    for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                      -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
      d = 1.0 + numerator * d
      d = 1.0 / (d if abs(d) > _TINY else _TINY)
      c = 1.0 + numerator / c
      c = c if abs(c) > _TINY else _TINY
      result *= c * d
    if abs(c * d - 1.0) < _EPS:
      return result
  raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
  """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
  if not (a > 0 and b > 0):
    raise ValueError(f"betainc needs a > 0 and b > 0, got a={a}, b={b}")
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"betainc needs 0 <= x <= 1, got x={x}")
  if x in (0.0, 1.0):
    return x
  log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
               + a * math.log(x) + b * math.log1p(-x))
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
  return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with `df` degrees of freedom."""
  if not df > 0:
    raise ValueError(f"degrees of freedom must be > 0, got {df}")
  if math.isinf(t):
    return 1.0 if t > 0 else 0.0
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
  """Quantile of Student's t: the t with `t_cdf(t, df) == q`, by bisection."""
  if not 0.0 < q < 1.0:
    raise ValueError(f"quantile level must lie in (0, 1), got {q}")
  if q == 0.5:
    return 0.0
  lo, hi = -1.0, 1.0
  while t_cdf(lo, df) > q:
    lo *= 2.0
  while t_cdf(hi, df) < q:
    hi *= 2.0
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < q:
      lo = mid
    else:
      hi = mid
    if hi - lo < 1e-12 * max(1.0, abs(mid)):
      break
  return 0.5 * (lo + hi)


def two_sided_p(t: float, df: float) -> float:
  """Two-sided p-value of a t statistic."""
  if math.isnan(t):
    return 1.0
  return min(1.0, 2.0 * t_cdf(-abs(t), df))


def _present(values: Sequence[Optional[float]]) -> np.ndarray:
  return np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)


def _clean(value: Optional[float]) -> Optional[float]:
  """JSON-safe float: None for missing or non-finite values."""
  if value is None or not math.isfinite(value):
    return None
  return float(value)


def mean_ci(x: np.ndarray, level: float = 0.95) -> tuple[Optional[float], Optional[float],
                                                           Optional[list]]:
  """Mean, sample std (ddof=1) and the t-based confidence interval of the mean."""
  n = x.size
  if n == 0:
    return None, None, None
  mean = float(np.mean(x))
  if n == 1:
    return mean, None, None
  std = float(np.std(x, ddof=1))
  half = t_ppf(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
  return mean, std, [mean - half, mean + half]


def summarize(per_seed: Sequence[Optional[float]]) -> dict:
  """{"mean", "std", "ci95", "n", "per_seed"} over the present values (None = missing)."""
  x = _present(per_seed)
  mean, std, ci = mean_ci(x)
  return {"mean": _clean(mean), "std": _clean(std),
          "ci95": None if ci is None else [_clean(ci[0]), _clean(ci[1])],
          "n": int(x.size), "per_seed": [_clean(v) for v in per_seed]}


def seed_means(levels: Sequence[Sequence[Optional[float]]]) -> list[Optional[float]]:
  """Per seed, the mean of its values over the condition levels (`levels[c][seed]`); None
  for a seed missing a value at some level, so that its pair leaves a paired comparison."""
  out = []
  for values in zip(*levels):
    present = [x for x in values if _clean(x) is not None]
    out.append(sum(present) / len(present) if len(present) == len(values) else None)
  return out


def _pairs(baseline: Sequence[Optional[float]], variant: Sequence[Optional[float]]):
  if len(baseline) != len(variant):
    raise ValueError(f"paired comparison needs equal lengths, got {len(baseline)} "
                     f"baseline and {len(variant)} variant values")
  keep = [(b, v) for b, v in zip(baseline, variant)
          if _clean(b) is not None and _clean(v) is not None]
  return (np.asarray([b for b, _ in keep], np.float64),
          np.asarray([v for _, v in keep], np.float64))


# Relative float64 rounding of a mean of differences, against their largest magnitude.
_ROUNDING = 1e-12


def paired_t(baseline: Sequence[Optional[float]], variant: Sequence[Optional[float]], *,
             sources: Optional[Sequence[Sequence[Optional[float]]]] = None) -> dict:
  """Paired t-test of variant - baseline over the pairs where both are present.

  Returns {"delta", "ci95", "p_value", "n", "test"}; with fewer than two pairs the CI and
  p-value are None. Identical differences (no spread beyond float rounding), where the
  t statistic is undefined:
  - all zero: a zero-width CI and p = 1;
  - a deterministic quantity (every seed gives the same value on each side, like a
    parameter count): the exact difference as a zero-width CI and p = 0;
  - otherwise (the seeds' values vary but every pair moved by the same amount, as a coarse
    metric can by chance): no CI, and the exact sign-flip p (`sign_flip_p`: 2 of the 2**n
    flips, 0.25 with three pairs), since nothing but the pairs' signs is left to test.

  `sources`: when `baseline` and `variant` are not metric values but differences of them
  (per seed, as `analysis.interactions` compares), the per-seed lists of the values they
  came from. Float rounding is then judged against those values' size, not the small
  differences', and the quantity is deterministic only if every one of them is the same
  across seeds.
  """
  b, v = _pairs(baseline, variant)
  diff = v - b
  n = diff.size
  out = {"delta": None, "ci95": None, "p_value": None, "n": int(n), "test": "paired t"}
  if n == 0:
    return out
  mean, std, ci = mean_ci(diff)
  # A mean that is 0 up to float64 rounding (differences in thirds of a rate: 1 - 1/3 -
  # 1/3 - 1/3 is not 0.0) is 0.
  mean = 0.0 if abs(mean) <= _ROUNDING * float(np.max(np.abs(diff))) else mean
  out["delta"] = _clean(mean)
  if n < 2:
    return out
  # Equal up to float32 rounding (a spread below 1e-6 of the values' size; the metrics
  # are float32) is equal: 12/48 - 10/48 and 15/48 - 13/48 are one number computed twice.
  # Counts (every value a whole number, like a parameter count) are exact: 50 more
  # parameters in 1.2e8 is a difference.
  values = [b, v] if sources is None else [
      np.asarray([x for x in xs if _clean(x) is not None], np.float64) for xs in sources]
  values = [x for x in values if x.size]
  counts = all(np.all(x == np.round(x)) for x in values)
  tol = 0.0 if counts else 1e-6 * max((float(np.max(np.abs(x))) for x in values),
                                      default=0.0)
  same = lambda x: float(np.ptp(x)) <= tol
  if same(diff):
    zero = same(np.append(diff, 0.0))
    if zero or all(same(x) for x in values):
      out["ci95"] = [0.0, 0.0] if zero else [mean, mean]
      out["delta"] = 0.0 if zero else out["delta"]
      out["p_value"] = 1.0 if zero else 0.0
    else:
      out["p_value"] = 2.0 ** (1 - n)   # sign_flip_p of n equal differences
      out["test"] = "sign-flip permutation (identical differences)"
    return out
  out["ci95"] = [_clean(ci[0]), _clean(ci[1])]
  out["p_value"] = two_sided_p(mean / (std / math.sqrt(n)), n - 1)
  return out


SIGN_FLIP_MAX_PAIRS = 16


def sign_flip_p(diff: Sequence[float]) -> float:
  """Exact two-sided p of a paired permutation test: the share of the 2**n sign flips of
  the differences whose mean is at least as far from 0 as the observed one. Unlike a
  t-test it cannot reach p = 0 from a handful of pairs (three pairs: p >= 0.25)."""
  d = np.asarray(diff, np.float64)
  observed = abs(float(np.mean(d))) if d.size else 0.0
  # Means are compared up to float rounding, relative to the largest difference: the
  # differences of rates come in thirds, and a flip whose mean is 0 can read 1e-17.
  tol = _ROUNDING * float(np.max(np.abs(d))) if d.size else 0.0
  if observed <= tol:
    return 1.0
  if d.size > SIGN_FLIP_MAX_PAIRS:
    raise ValueError(f"sign_flip_p enumerates 2**n flips; n={d.size} > {SIGN_FLIP_MAX_PAIRS}")
  signs = 1.0 - 2.0 * ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1)
  return float(np.mean(np.abs(signs @ d) / d.size >= observed - tol))


def rate_difference(baseline: Sequence[Optional[float]], variant: Sequence[Optional[float]]
                    ) -> dict:
  """Paired comparison of event rates in [0, 1] (e.g. the share of a seed's runs that
  diverged): the mean difference, and the exact sign-flip p (`sign_flip_p`; a t-test on a
  few rates reads p = 0 whenever every pair differs by the same amount) for up to
  `SIGN_FLIP_MAX_PAIRS` pairs, the t-test's beyond (the exact 2**(1 - n) there when every
  pair differs by the same amount). No CI: a t-interval of rates can leave
  [-1, 1], and equal observed rates (say, no divergence on either side in three pairs) do
  not pin the true rates down."""
  out = paired_t(baseline, variant)
  out["ci95"] = None
  b, v = _pairs(baseline, variant)
  if 2 <= out["n"] <= SIGN_FLIP_MAX_PAIRS:
    out["p_value"] = sign_flip_p(v - b)
    out["test"] = "sign-flip permutation"
  elif out["n"] > SIGN_FLIP_MAX_PAIRS and out["p_value"] == 0.0:
    # Every seed's rate moved by the same amount (paired_t's p = 0, meant for a
    # deterministic quantity): t is undefined; the exact sign-flip p of n equal
    # differences.
    out["p_value"] = 2.0 ** (1 - out["n"])
    out["test"] = "sign-flip permutation (identical differences)"
  return out


def mcnemar_exact(baseline: Sequence[Optional[float]], variant: Sequence[Optional[float]]
                  ) -> dict:
  """Exact McNemar test for paired 0/1 outcomes (a two-sided sign test on the pairs that
  disagree). "delta" is the difference in rates; no CI (the divergence counts say more)."""
  b, v = _pairs(baseline, variant)
  out = paired_t(b.tolist(), v.tolist())
  out["ci95"] = None
  up = int(np.sum((v > 0.5) & (b < 0.5)))
  down = int(np.sum((v < 0.5) & (b > 0.5)))
  discordant = up + down
  tail = sum(math.comb(discordant, k) for k in range(min(up, down) + 1)) / 2.0 ** discordant
  out["p_value"] = min(1.0, 2.0 * tail) if out["n"] else None
  out["test"] = "exact McNemar"
  return out


def holm(p_values: Sequence[Optional[float]]) -> list[Optional[float]]:
  """Holm's step-down adjustment of a family of p-values (None entries are skipped)."""
  idx = [i for i, p in enumerate(p_values) if p is not None]
  order = sorted(idx, key=lambda i: p_values[i])
  m = len(order)
  adjusted: list[Optional[float]] = [None] * len(p_values)
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p_values[i]))
    adjusted[i] = running
  return adjusted
