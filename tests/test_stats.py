"""Student-t, summaries and paired tests of ablations.stats against known values."""

import math

import numpy as np
import pytest

from ablations import stats

# Two-sided 95% critical values t_{0.975, df} from standard tables.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228,
         20: 2.086, 29: 2.045, 120: 1.980}


@pytest.mark.parametrize("df,expected", sorted(T_975.items()))
def test_t_ppf_matches_table(df, expected):
  assert stats.t_ppf(0.975, df) == pytest.approx(expected, abs=6e-4)


def test_t_ppf_other_levels_and_symmetry():
  assert stats.t_ppf(0.995, 4) == pytest.approx(4.604, abs=6e-4)
  assert stats.t_ppf(0.95, 10) == pytest.approx(1.812, abs=6e-4)
  assert stats.t_ppf(0.025, 9) == pytest.approx(-2.262, abs=6e-4)
  assert stats.t_ppf(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)


def test_t_cdf_closed_forms():
  # df=1 is Cauchy, df=2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2)).
  for t in (-7.0, -1.3, 0.0, 0.4, 3.0, 25.0):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
  for q in (0.01, 0.3, 0.9, 0.999):
    assert stats.t_cdf(stats.t_ppf(q, 7), 7) == pytest.approx(q, abs=1e-10)


def test_betainc_known_values():
  assert stats.betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)
  assert stats.betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-12)
  assert stats.betainc(0.5, 0.5, 0.5) == pytest.approx(0.5, abs=1e-12)
  with pytest.raises(ValueError, match="0 <= x <= 1"):
    stats.betainc(1.0, 1.0, 1.5)


def test_betainc_converges_for_large_shapes_and_rejects_nonpositive_ones():
  assert stats.betainc(1e4, 1e4, 0.5) == pytest.approx(0.5, abs=1e-9)
  for a, b in ((-0.5, 1.0), (1.0, -0.5), (0.0, 1.0)):
    with pytest.raises(ValueError, match="a > 0 and b > 0"):
      stats.betainc(a, b, 0.3)


def test_t_distribution_edges():
  """Infinite t, a NaN statistic, zero degrees of freedom and the quantile levels 0, 1."""
  assert stats.t_cdf(math.inf, 3) == 1.0 and stats.t_cdf(-math.inf, 3) == 0.0
  assert stats.two_sided_p(math.inf, 3) == 0.0
  assert stats.two_sided_p(math.nan, 3) == 1.0
  for t in (1.0, math.inf):
    with pytest.raises(ValueError, match="degrees of freedom must be > 0"):
      stats.t_cdf(t, 0)
  for q in (0.0, 1.0):
    with pytest.raises(ValueError, match=r"lie in \(0, 1\)"):
      stats.t_ppf(q, 3)


def test_summarize_counts_missing_values():
  s = stats.summarize([0.70, None, 0.72, 0.74])
  assert s["n"] == 3 and s["per_seed"] == [0.70, None, 0.72, 0.74]
  assert s["mean"] == pytest.approx(0.72)
  assert s["std"] == pytest.approx(0.02)
  half = 4.303 * 0.02 / math.sqrt(3)
  assert s["ci95"] == pytest.approx([0.72 - half, 0.72 + half], abs=1e-5)
  one = stats.summarize([0.5, None])
  assert one["mean"] == 0.5 and one["std"] is None and one["ci95"] is None
  assert stats.summarize([None, float("nan")])["mean"] is None
  nan = stats.summarize([1.0, float("nan"), 3.0])   # a NaN counts as missing
  assert nan["mean"] == 2.0 and nan["n"] == 2 and nan["per_seed"] == [1.0, None, 3.0]
  assert stats.seed_means([[1.0, None], [3.0, 4.0]]) == [2.0, None]


def test_paired_t_matches_hand_computation():
  base = [0.70, 0.71, 0.69, 0.72, 0.70]
  var = [0.72, 0.725, 0.70, 0.745, 0.715]
  d = np.subtract(var, base)
  t = d.mean() / (d.std(ddof=1) / math.sqrt(5))
  r = stats.paired_t(base, var)
  assert r["n"] == 5 and r["delta"] == pytest.approx(d.mean())
  assert r["p_value"] == pytest.approx(2 * stats.t_cdf(-abs(t), 4))
  assert r["p_value"] < 0.01
  assert r["ci95"][0] > 0 and r["ci95"][1] > r["delta"]


def test_paired_t_no_effect_and_missing_pairs():
  r = stats.paired_t([0.7, 0.8, 0.75], [0.71, 0.79, 0.75])
  assert r["p_value"] > 0.5 and r["ci95"][0] < 0 < r["ci95"][1]
  r = stats.paired_t([0.7, None, 0.75], [0.71, 0.8, None])
  assert r["n"] == 1 and r["delta"] == pytest.approx(0.01) and r["p_value"] is None
  assert stats.paired_t([1.0, 2.0], [1.0, 2.0])["p_value"] == 1.0
  with pytest.raises(ValueError, match="equal lengths"):
    stats.paired_t([1.0], [1.0, 2.0])


def test_mcnemar_exact():
  # 6 pairs disagree, all in one direction: p = 2 * 0.5**6.
  r = stats.mcnemar_exact([0] * 8, [1] * 6 + [0] * 2)
  assert r["p_value"] == pytest.approx(2 / 64) and r["delta"] == pytest.approx(0.75)
  assert r["test"] == "exact McNemar"
  none = stats.mcnemar_exact([0, 0, 0], [0, 0, 0])
  assert none["p_value"] == 1.0 and none["delta"] == 0.0
  assert none["ci95"] is None   # three pairs without divergence do not pin the rates at 0
  assert stats.mcnemar_exact([1, 0, 1], [0, 1, 1])["p_value"] == 1.0


def test_rate_difference_and_zero_spread():
  rates = stats.rate_difference([0.0, 0.0, 0.0], [0.5, 0.0, 0.0])
  assert rates["delta"] == pytest.approx(1 / 6) and rates["ci95"] is None
  assert rates["test"] == "sign-flip permutation" and rates["p_value"] == pytest.approx(1.0)
  assert stats.rate_difference([0.0, 0.0], [0.0, 0.0])["p_value"] == 1.0
  # Every seed diverging more often: a t-test would read p = 0 (zero spread) or 0.02;
  # three pairs cannot do better than 2 of 8 sign flips.
  assert stats.rate_difference([0.0] * 3, [1 / 3] * 3)["p_value"] == pytest.approx(0.25)
  assert stats.rate_difference([0.0] * 3, [2 / 3, 2 / 3, 1.0])["p_value"] == pytest.approx(0.25)
  assert stats.rate_difference([0.0] * 6, [0.5] * 6)["p_value"] == pytest.approx(2 / 64)
  # Two pairs are the fewest the exact test takes: 2 of the 4 sign flips are as extreme
  # (the t-test's zero spread would read p = 0).
  two = stats.rate_difference([0.0, 0.0], [0.5, 0.5])
  assert two["test"] == "sign-flip permutation" and two["p_value"] == pytest.approx(0.5)
  # Beyond the exact test's 16 pairs the t-test takes over, except where every seed's
  # rate moved alike (t undefined): there the exact p of n equal differences, not 0.
  many = stats.rate_difference([0.0] * 17, [1.0] * 17)
  assert many["p_value"] == pytest.approx(2.0 ** -16) and "identical" in many["test"]
  assert stats.rate_difference([0.0] * 17, [0.0] * 17)["p_value"] == 1.0
  varied = stats.rate_difference([0.0] * 17, [0.5, 1.0] * 8 + [1.0])
  assert varied["test"] == "paired t" and 0 < varied["p_value"] < 1e-6
  # A deterministic quantity (the same value in every seed on each side) keeps its exact
  # CI and p = 0.
  fixed = stats.paired_t([100.0, 100.0, 100.0], [60.0, 60.0, 60.0])
  assert fixed["ci95"] == [-40.0, -40.0] and fixed["p_value"] == 0.0
  assert fixed["test"] == "paired t"
  # ... however small against its size: counts are exact, not equal up to float32 rounding.
  params = stats.paired_t([1.2e8] * 3, [1.2e8 + 50] * 3)
  assert params["delta"] == 50.0 and params["ci95"] == [50.0, 50.0]
  assert params["p_value"] == 0.0
  # Rates in thirds whose differences have mean 0 (in float64, 1.85e-17): Δ 0 and p = 1,
  # as exact fractions give.
  d = [1, -1 / 3, -1 / 3, 1 / 3, -2 / 3]
  assert float(np.mean(d)) != 0.0
  assert stats.sign_flip_p(d) == 1.0
  base = [0.0, 1 / 3, 2 / 3, 0.0, 1.0]
  thirds = stats.rate_difference(base, [b + x for b, x in zip(base, d)])
  assert thirds["delta"] == 0.0 and thirds["p_value"] == 1.0


def test_paired_t_identical_differences_of_varying_values():
  # A coarse metric whose seeds vary but move by the same step in every pair: the t-test
  # would read p = 0 from two seeds; only the signs are left to test (exact sign flips).
  for n, p in ((2, 0.5), (3, 0.25), (6, 2 / 64)):
    base = [0.5 + 0.05 * i for i in range(n)]
    r = stats.paired_t(base, [b + 0.125 for b in base])
    assert r["delta"] == pytest.approx(0.125) and r["ci95"] is None, r
    assert r["p_value"] == pytest.approx(p)
    assert r["p_value"] == pytest.approx(stats.sign_flip_p([0.125] * n))
    assert r["test"] == "sign-flip permutation (identical differences)"
  # Equal up to float rounding counts as equal: a metric in steps of 1/48.
  coarse = stats.paired_t([10 / 48, 13 / 48, 11 / 48], [12 / 48, 15 / 48, 13 / 48])
  assert coarse["p_value"] == pytest.approx(0.25) and coarse["ci95"] is None
  # ... computed in float32, as the metrics are, and stored as float64.
  f32 = lambda xs: [float(np.float32(x)) for x in xs]
  coarse32 = stats.paired_t(f32([10 / 48, 13 / 48, 11 / 48]), f32([12 / 48, 15 / 48, 13 / 48]))
  assert coarse32["p_value"] == pytest.approx(0.25) and coarse32["ci95"] is None
  # A spread well above rounding is the t-test's.
  assert stats.paired_t([0.5, 0.6], [0.625, 0.7251])["test"] == "paired t"
  # ... and so is a small one: gains of 3e-5 to 5e-5 at 0.7, hundreds of float32 steps.
  small = stats.paired_t([0.70, 0.71, 0.72], [0.70005, 0.71003, 0.72004])
  assert small["test"] == "paired t" and small["delta"] == pytest.approx(4e-5)
  assert small["p_value"] < 0.05 and small["ci95"][0] > 0
  # Zero up to rounding is zero.
  zero = stats.paired_t([0.3, 0.6], [0.1 + 0.2, 0.6])
  assert zero["p_value"] == 1.0 and zero["delta"] == 0.0 and zero["ci95"] == [0.0, 0.0]
  # A difference of zero in every pair stays p = 1, however the values vary.
  same = stats.paired_t([0.5, 0.6], [0.5, 0.6])
  assert same["p_value"] == 1.0 and same["ci95"] == [0.0, 0.0]


def test_holm():
  adjusted = stats.holm([0.01, None, 0.04, 0.03])
  assert adjusted == pytest.approx([0.03, None, 0.06, 0.06])


def test_paired_t_drops_nan_pairs_and_has_no_result_without_pairs():
  r = stats.paired_t([0.70, math.nan, 0.72, 0.71], [0.72, 0.80, 0.75, 0.72])
  assert r["n"] == 3 and r == stats.paired_t([0.70, 0.72, 0.71], [0.72, 0.75, 0.72])
  assert stats.paired_t([None, 1.0], [1.0, None]) == {
      "delta": None, "ci95": None, "p_value": None, "n": 0, "test": "paired t"}


def test_sign_flip_test_up_to_16_pairs_and_no_further():
  r = stats.rate_difference([0.0] * 16, [0.5, 1.0] * 8)
  assert r["test"] == "sign-flip permutation" and r["p_value"] == pytest.approx(2.0 ** -15)
  with pytest.raises(ValueError, match="n=17 > 16"):
    stats.sign_flip_p([0.1] * 17)


def test_rates_and_mcnemar_without_two_pairs_have_no_p():
  one = stats.rate_difference([0.0], [1.0])
  assert one["n"] == 1 and one["p_value"] is None and one["test"] == "paired t"
  none = stats.mcnemar_exact([None, None], [1.0, None])
  assert none["n"] == 0 and none["p_value"] is None
