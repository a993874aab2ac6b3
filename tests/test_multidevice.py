"""Data parallelism on 8 simulated CPU devices matches one device.

Runs in a subprocess: `--xla_force_host_platform_device_count` must be set before JAX
initialises, and must not leak into the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys
import jax
import numpy as np
from experiments.configs import ranking
from phoenix_flax.training import Trainer, make_placement, parse_config, run_experiment

assert jax.device_count() == 8, jax.devices()
out = {}
for name, devices in (("single", 1), ("data8_tables", 8)):
  cfg = ranking.get_config("smoke")
  cfg.num_seeds = 2
  cfg.mesh.num_devices, cfg.mesh.shard_hash_tables = devices, devices > 1
  trainer = Trainer(parse_config(cfg), make_placement(devices, devices > 1))
  state = trainer.init([0, 1])
  losses = []
  for _ in range(4):
    state, stats = trainer.train_chunk(state)
    losses.append(np.asarray(stats["loss"]))
  table = state.params.tables.post_table
  out[name] = {"loss": np.concatenate(losses, axis=1).tolist(),
               "auc": np.asarray(trainer.evaluate(state)["eval/auc_mean"]).tolist(),
               "table_replicated": table.sharding.is_fully_replicated,
               "table_shard_rows": table.addressable_shards[0].data.shape[1]}
cfg = ranking.get_config("smoke")
cfg.num_seeds = 2
cfg.mesh.num_devices = 8
results = run_experiment(cfg, sys.argv[1])
out["data8_auc"] = [results[k]["final"]["auc_mean"] for k in (0, 1)]
out["data8_chunk_loss"] = [
    [json.loads(line)["train/loss"] for line in open(f"{sys.argv[1]}/seed_{k}/metrics.jsonl")]
    for k in (0, 1)]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_eight_devices_match_one_device(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO,
             XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  out = json.loads(line[len("RESULT"):])
  single = np.asarray(out["single"]["loss"])
  assert single.shape == (2, 40)
  assert not np.allclose(single[0], single[1])  # two seeds, two curves
  # Hash tables sharded by rows over the 8 devices: same per-step losses.
  np.testing.assert_allclose(out["data8_tables"]["loss"], single, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(out["data8_tables"]["auc"], out["single"]["auc"], atol=2e-3)
  assert out["single"]["table_replicated"] and not out["data8_tables"]["table_replicated"]
  assert out["data8_tables"]["table_shard_rows"] == 512 // 8
  # run_experiment on the mesh (parameters replicated): same chunk-mean loss curve.
  chunk_means = single.reshape(2, 4, 10).mean(axis=2)
  np.testing.assert_allclose(out["data8_chunk_loss"], chunk_means, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(out["data8_auc"], out["single"]["auc"], atol=2e-3)
  assert os.path.exists(tmp_path / "run" / "seed_1" / "result.json")
