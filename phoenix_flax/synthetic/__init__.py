"""On-device synthetic recommendation world with known true action probabilities."""

from phoenix_flax.synthetic.config import SplitConfig, WorldConfig
from phoenix_flax.synthetic.sampling import SyntheticBatch, sample_batch
from phoenix_flax.synthetic.world import (World, make_world, post_features, true_logits,
                                          user_interest)

__all__ = ["SplitConfig", "SyntheticBatch", "World", "WorldConfig", "make_world",
           "post_features", "sample_batch", "true_logits", "user_interest"]
