"""Post-age buckets, continuous normalisation and the token feature embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phoenix_flax as pf
from phoenix_flax import features

NOW = 1_000_000


def bucket(age_minutes=None, impression=NOW, post=None, granularity=60):
  post = NOW - age_minutes * 60 if post is None else post
  out = pf.compute_post_age_bucket(jnp.array([[impression]]), jnp.array([[post]]),
                                   granularity_mins=granularity)
  assert out.dtype == jnp.int32
  return int(out[0, 0])


@pytest.mark.parametrize("minutes, expected", [(0, 1), (30, 1), (59, 1), (60, 2), (120, 3),
                                               (4799, 80), (4800, 81), (5000, 81)])
def test_post_age_bucket(minutes, expected):
  assert bucket(minutes) == expected


def test_post_age_bucket_floors_seconds_to_whole_minutes():
  """SPEC: minutes = (impr - post) // 60, a floor: 3599 s is 59 minutes (bucket 1), 7199 s
  119 (bucket 2), and a post 30 s newer than the impression is -1 minute old (bucket 0)."""
  ages_s = [59, 3599, 3600, 7199, -30]
  assert [bucket(post=NOW - age) for age in ages_s] == [1, 1, 2, 2, 0]


def test_post_age_bucket_of_unsigned_timestamps():
  """uint32 epoch seconds: a post newer than the impression is bucket 0 as with int32 (the
  subtraction wrapped, and it got the oldest bucket), and older ones age as usual."""
  now = 1_700_000_000
  for dtype in (np.uint32, np.int32):
    found = pf.compute_post_age_bucket(np.array([[now]], dtype),
                                       np.array([[now + 600, now - 3600, now]], dtype), 60)
    np.testing.assert_array_equal(found, [[0, 2, 1]])


def test_post_age_bucket_granularity():
  assert bucket(90, granularity=30) == 4
  assert bucket(10_000, granularity=30) == 4800 // 30 + 1


@pytest.mark.parametrize("granularity", [0, -60, 7.5, True])
def test_post_age_bucket_rejects_bad_granularity(granularity):
  # -60 used to return bucket -79 (clipped to [0, -79]); 0 a ZeroDivisionError.
  with pytest.raises(ValueError, match="granularity_mins"):
    pf.compute_post_age_bucket(NOW, NOW - 3600, granularity)


def test_post_age_bucket_refuses_timestamps_beyond_int32():
  """Millisecond timestamps would wrap to int32 (a post 10 minutes old landed in the oldest
  bucket): refused, naming the field and the unit."""
  ms = np.array([1_700_000_000_000], np.int64)
  with pytest.raises(ValueError, match=r"impression_ts holds 1700000000000, beyond int32: "
                                       r"timestamps are seconds"):
    pf.compute_post_age_bucket(ms, ms - 600_000, 1)
  assert int(pf.compute_post_age_bucket(ms // 1000, (ms - 600_000) // 1000, 1)[0]) == 11
  # The post's timestamps are checked too (an impression in seconds, a post in ms), and
  # the message quotes the value that does not fit, not the array's first.
  s = ms // 1000
  with pytest.raises(ValueError, match=r"post_ts holds 1699999400000, beyond int32"):
    pf.compute_post_age_bucket(s, (s - 600) * 1000, 1)
  mixed = np.array([1_700_000_000, 1_700_000_000_123], np.int64)
  with pytest.raises(ValueError, match=r"impression_ts holds 1700000000123, beyond int32"):
    pf.compute_post_age_bucket(mixed, mixed // 1000, 1)


def test_post_age_bucket_and_normalization_refuse_wrong_dtypes():
  """Timestamps are integer seconds: float32 would round today's epoch seconds to 128 s
  (1_700_000_059.0 reads as 1_700_000_000), so float and bool arrays are refused by name."""
  assert float(np.float32(1_700_000_059)) == 1_700_000_000.0
  for bad in (jnp.array([NOW], jnp.float32), np.array([float(NOW)]), jnp.array([True])):
    with pytest.raises(ValueError, match=r"impression_ts must hold integer seconds"):
      pf.compute_post_age_bucket(bad, jnp.array([NOW]))
    with pytest.raises(ValueError, match=r"post_ts must hold integer seconds"):
      pf.compute_post_age_bucket(jnp.array([NOW]), bad)
  cfg = pf.NormConfig(norm_scale=10.0)
  with pytest.raises(ValueError, match=r"value must hold real numbers.*bool"):
    pf.normalize_continuous_value(jnp.array([True, False]), cfg)
  with pytest.raises(TypeError, match="config must be a NormConfig, got float"):
    pf.normalize_continuous_value(jnp.array([1.0]), 10.0)
  np.testing.assert_allclose(pf.normalize_continuous_value(np.array([5, 20]), cfg), [0.5, 1.0])


def test_missing_timestamps_map_to_zero():
  assert bucket(impression=0, post=NOW) == 0
  assert bucket(impression=NOW, post=0) == 0
  # A missing impression time wins even over a timestamp that reads as older (negative).
  assert bucket(impression=0, post=-7200) == 0


def test_negative_age_maps_to_zero():
  assert bucket(impression=NOW, post=NOW + 3600) == 0


def test_post_age_bucket_broadcasts_impressions_over_candidates():
  impressions = jnp.array([NOW, NOW + 7200])[:, None]
  posts = jnp.array([[NOW - 1800, 0, NOW - 3600], [NOW, NOW + 7200, NOW + 9000]])
  np.testing.assert_array_equal(pf.compute_post_age_bucket(impressions, posts),
                                [[1, 0, 2], [3, 1, 0]])


def test_linear_normalization():
  cfg = pf.NormConfig(norm_scale=30.0, use_log=False)
  out = pf.normalize_continuous_value(jnp.array([0.0, 15.0, 30.0, 60.0]), cfg)
  np.testing.assert_allclose(out, [0.0, 0.5, 1.0, 1.0], atol=1e-6)


def test_log_normalization():
  cfg = pf.NormConfig(norm_scale=30.0, use_log=True)
  out = pf.normalize_continuous_value(jnp.array([0.0, 5.0, 30.0, 100.0]), cfg)
  np.testing.assert_allclose(out, [0.0, np.log1p(5.0) / np.log1p(30.0), 1.0, 1.0], atol=1e-6)


def test_clamping():
  cfg = pf.NormConfig(norm_scale=10.0, use_log=False)
  out = pf.normalize_continuous_value(jnp.array([-5.0, 0.0, 5.0, 15.0]), cfg)
  np.testing.assert_allclose(out, [0.0, 0.0, 0.5, 1.0], atol=1e-6)


def test_action_embedding_is_signed_and_zero_without_actions():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((5, 4)).astype(np.float32)
  actions = np.array([[[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]], np.float32)
  out = np.asarray(features.action_embedding(jnp.asarray(actions), jnp.asarray(w)))
  expected = (2 * actions - 1) @ w
  expected[0, 1] = 0.0
  np.testing.assert_allclose(out, expected, atol=1e-5)


def test_single_hot_embedding_out_of_range_is_zero():
  table = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
  out = features.single_hot_embedding(jnp.array([[0, 3, 4, -1]]), table)
  np.testing.assert_array_equal(out[0], [[0, 1, 2], [9, 10, 11], [0, 0, 0], [0, 0, 0]])


def test_dwell_time_embedding_formula():
  rng = np.random.default_rng(1)
  w1 = rng.standard_normal((1, 6)).astype(np.float32)
  w2 = rng.standard_normal((6, 4)).astype(np.float32)
  dwell = np.array([[0.0, 12.0, 90.0]], np.float32)
  cfg = pf.NormConfig(norm_scale=30.0)
  x = np.clip(dwell, 0, 30)[..., None] / 30 @ w1
  gelu = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  out = features.dwell_time_embedding(jnp.asarray(dwell), cfg, jnp.asarray(w1), jnp.asarray(w2))
  np.testing.assert_allclose(out, gelu @ w2, atol=1e-5)


def test_hash_ids_range_padding_and_determinism():
  ids = jnp.arange(-50, 5000)
  valid = ids % 7 != 0
  h = pf.hash_ids(ids, 1000, 2, valid)
  assert h.shape == (ids.shape[0], 2) and h.dtype == jnp.int32
  h = np.asarray(h)
  assert (h[np.asarray(valid)] >= 1).all() and (h < 1000).all()
  assert (h[~np.asarray(valid)] == 0).all()
  np.testing.assert_array_equal(h, pf.hash_ids(ids, 1000, 2, valid))
  # Without a mask every id is valid, and the first function does not depend on how many
  # functions are asked for.
  np.testing.assert_array_equal(pf.hash_ids(ids, 1000, 1)[:, 0],
                                np.asarray(pf.hash_ids(ids, 1000, 3))[:, 0])


SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)   # xxHash32's primes


def fmix32(x: int) -> int:
  """The murmur3 32-bit finaliser, in Python integers."""
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & 0xFFFFFFFF
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & 0xFFFFFFFF
  return x ^ (x >> 16)


def _reference_hash(i: int, num_buckets: int, k: int) -> int:
  """hash_ids's documented function in Python integers: id modulo 2**32, then the murmur3
  finaliser twice around hash function k's seed (the k-th prime of xxHash32)."""
  seed = SEEDS[k]
  return 1 + fmix32((fmix32((i & 0xFFFFFFFF) ^ seed) + seed) & 0xFFFFFFFF) % (num_buckets - 1)


def test_hash_ids_values_are_pinned():
  """Hash tables trained on a user's hashed ids stay usable only while hash_ids gives the
  same values: they equal the reference above for all five functions, negative and large
  ids and extreme bucket counts, and four of them are written out."""
  np.testing.assert_array_equal(pf.hash_ids(jnp.array([0, 1, -1, 123456789]), 1000, 2),
                                [[382, 155], [299, 193], [155, 640], [647, 729]])
  ids = [0, 1, 2, 7, -1, -2**31, 2**31 - 1, 123456789, -987654321]
  for buckets in (2, 3, 1000, 2**20, 2**31 - 1):
    got = np.asarray(pf.hash_ids(jnp.array(ids, jnp.int32), buckets, 5))
    want = [[_reference_hash(i, buckets, k) for k in range(5)] for i in ids]
    np.testing.assert_array_equal(got, want, err_msg=f"num_buckets={buckets}")


def test_hash_ids_spread_and_independent_functions():
  ids = jnp.arange(100_000)
  h = np.asarray(pf.hash_ids(ids, 257, 2))
  counts = np.bincount(h[:, 0], minlength=257)[1:]
  expected = ids.shape[0] / 256
  chi2 = np.sum((counts - expected) ** 2 / expected)
  assert chi2 < 256 + 6 * np.sqrt(2 * 256)     # uniform over the 256 buckets
  # Pairs that collide under the first function collide under the second at the chance
  # rate (1/256), not systematically.
  same_first = h[:-1, 0] == h[1:, 0]
  order = np.argsort(h[:, 0], kind="stable")
  a, b = order[:-1], order[1:]
  collide = h[a, 0] == h[b, 0]
  both = np.mean(h[a[collide], 1] == h[b[collide], 1])
  assert both < 3 / 256, both
  assert same_first.mean() < 3 / 256


def enable_x64():
  return (jax.enable_x64(True) if hasattr(jax, "enable_x64")   # newer jax
          else __import__("jax.experimental", fromlist=["x"]).enable_x64())


def _reference_wide_hash(i: int, num_buckets: int, k: int) -> int:
  """hash_ids's documented function for an id outside int32: its high half, mixed with
  the murmur3 finaliser of hash function k's seed, XORed into its low half first."""
  low, high = i & 0xFFFFFFFF, (i >> 32) & 0xFFFFFFFF
  return _reference_hash(low ^ fmix32(high ^ fmix32(SEEDS[k])), num_buckets, k)


def test_hash_ids_int64_and_bad_arguments():
  ids = [2**40 + 3, 5, 2**32 + 5, 4, 2**32 + 4, -7, 3, 2**31, 2**63 - 1, -2**40,
         2**31 - 1, -2**31, -2**31 - 1]   # (the last three: int32's bounds and one past)
  with enable_x64():   # jax int64 ids, as x64 allows
    wide = np.asarray(pf.hash_ids(jnp.array(ids, jnp.int64), 1 << 20, 2))
    wide_jit = np.asarray(jax.jit(lambda i: pf.hash_ids(i, 1 << 20, 2))(
        jnp.array(ids, jnp.int64)))
  # numpy int64 ids without x64 (split on the host), and a Python list: the same hashes.
  narrow = np.asarray(pf.hash_ids(np.array(ids, np.int64), 1 << 20, 2))
  listed = np.asarray(pf.hash_ids(ids, 1 << 20, 2))
  for got in (wide_jit, narrow, listed):
    np.testing.assert_array_equal(got, wide)
  for i, row in zip(ids, wide):
    inside = -2**31 <= i < 2**31
    want = [(_reference_hash(i, 1 << 20, k) if inside else _reference_wide_hash(i, 1 << 20, k))
            for k in range(2)]
    np.testing.assert_array_equal(row, want, err_msg=str(i))
  # A 64-bit id shares no hash with an int32 id of the same low half, or of a low half
  # one bit away (a fold would: 2**32 + 5 XOR its high half 1 is 4).
  assert (wide[1] != wide[2]).all() and (wide[3] != wide[2]).all() and (wide[3] != wide[4]).all()
  # uint32 ids above int32 hash as the same values in int64.
  big = [3_000_000_000, 2**31, 7]
  np.testing.assert_array_equal(np.asarray(pf.hash_ids(np.array(big, np.uint32), 1 << 20)),
                                np.asarray(pf.hash_ids(np.array(big, np.int64), 1 << 20)))
  with pytest.raises(ValueError, match="num_buckets"):
    pf.hash_ids(jnp.arange(3), 1)
  with pytest.raises(ValueError, match="num_hashes"):
    pf.hash_ids(jnp.arange(3), 10, 0)
  for flag in (True, np.True_):   # 1 as a bool is a mistake, not one hash
    with pytest.raises(ValueError, match="num_hashes"):
      pf.hash_ids(jnp.arange(3), 10, flag)
  with pytest.raises(ValueError, match="integers"):
    pf.hash_ids(jnp.arange(3.0), 10)
  with pytest.raises(ValueError, match="num_buckets"):
    pf.hash_ids(jnp.arange(3), 2**31)
  with pytest.raises(ValueError, match="valid has shape"):
    pf.hash_ids(jnp.arange(3), 10, valid=jnp.ones((1,), bool))
  np.testing.assert_array_equal(pf.hash_ids(jnp.arange(3), np.int64(10), np.int32(2)),
                                pf.hash_ids(jnp.arange(3), 10, 2))


def test_lookup_hash_embeddings_pads_with_zeros_without_gradient():
  table = jnp.arange(12.0).reshape(4, 3) + 1
  hashes = jnp.array([[0, 2], [3, 0]])
  np.testing.assert_array_equal(pf.lookup_hash_embeddings(table, hashes)[0, 0], 0.0)
  np.testing.assert_array_equal(pf.lookup_hash_embeddings(table, hashes)[0, 1], table[2])
  grad = jax.grad(lambda t: pf.lookup_hash_embeddings(t, hashes).sum())(table)
  np.testing.assert_array_equal(grad[:, 0], [0.0, 0.0, 1.0, 1.0])
  # Whatever row 0 holds: a NaN or inf there reaches neither the padding nor the gradient.
  bad = table.at[0].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
  np.testing.assert_array_equal(pf.lookup_hash_embeddings(bad, hashes),
                                pf.lookup_hash_embeddings(table, hashes))
  total, grad = jax.value_and_grad(lambda t: pf.lookup_hash_embeddings(t, hashes).sum())(bad)
  assert np.isfinite(float(total))
  np.testing.assert_array_equal(grad[:, 0], [0.0, 0.0, 1.0, 1.0])
  # A Python int or list, as `hash_ids` takes them (they failed on `(3 != 0)[..., None]`).
  np.testing.assert_array_equal(pf.lookup_hash_embeddings(table, 3), table[3])
  np.testing.assert_array_equal(pf.lookup_hash_embeddings(table, [[0, 2], [3, 0]]),
                                pf.lookup_hash_embeddings(table, hashes))


def test_lookup_hash_embeddings_rejects_bad_table_or_hashes():
  # A [N] table used to give a [2, 2] result for 2 hashes (rows broadcast against the mask).
  with pytest.raises(ValueError, match="table must be"):
    pf.lookup_hash_embeddings(jnp.arange(10.0), jnp.array([1, 2]))
  with pytest.raises(ValueError, match="hashes must hold integers"):
    pf.lookup_hash_embeddings(jnp.ones((10, 4)), jnp.array([1.0, 2.0]))


def test_lookup_hash_embeddings_refuses_concrete_hashes_outside_the_table():
  # Clipped, 4 read row 3 and -2 row 0 (not masked like hash 0), with no error.
  table = jnp.arange(12.0).reshape(4, 3)
  with pytest.raises(ValueError, match=r"hash 4 at index \(1,\) is outside the table's \[0, 4\)"):
    pf.lookup_hash_embeddings(table, jnp.array([3, 4]))
  with pytest.raises(ValueError, match=r"hash -2 at index \(0, 1\)"):
    pf.lookup_hash_embeddings(table, np.array([[1, -2]]))
  # Traced hashes cannot be checked: clipped, as documented.
  traced = jax.jit(pf.lookup_hash_embeddings)(table, jnp.array([3, 4]))
  np.testing.assert_array_equal(traced, np.asarray(table)[[3, 3]])
