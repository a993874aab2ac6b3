"""phoenix_flax: Equinox re-implementation of X's Phoenix recommendation models."""

from phoenix_flax import haiku_compat
from phoenix_flax.config import (HashConfig, NormConfig, PhoenixModelConfig,
                                 PhoenixRetrievalModelConfig, TransformerConfig, ffn_size)
from phoenix_flax.example import example_batch, example_corpus
from phoenix_flax.features import (compute_post_age_bucket, hash_ids, lookup_hash_embeddings,
                                   normalize_continuous_value)
from phoenix_flax.inference import (ACTIONS, NEGATIVE_ACTIONS, RankingOutput, RankingRunner,
                                    RetrievalResult, RetrievalRunner, validate_batch,
                                    weighted_score)
from phoenix_flax.masks import make_recsys_attn_mask, right_anchored_rope_positions
from phoenix_flax.ranking import PhoenixModel
from phoenix_flax.retrieval import CandidateTower, PhoenixRetrievalModel
from phoenix_flax.transformer import ContextCache, Transformer
from phoenix_flax.types import RecsysBatch, RecsysEmbeddings, RecsysModelOutput, RetrievalOutput

__version__ = "0.1.0"

__all__ = [
    "ACTIONS", "CandidateTower", "ContextCache", "HashConfig", "NEGATIVE_ACTIONS", "NormConfig",
    "PhoenixModel", "PhoenixModelConfig", "PhoenixRetrievalModel",
    "PhoenixRetrievalModelConfig", "RankingOutput", "RankingRunner", "RecsysBatch",
    "RecsysEmbeddings", "RecsysModelOutput", "RetrievalOutput", "RetrievalResult",
    "RetrievalRunner", "Transformer", "TransformerConfig",
    "compute_post_age_bucket", "example_batch", "example_corpus", "ffn_size", "haiku_compat",
    "hash_ids", "lookup_hash_embeddings", "make_recsys_attn_mask", "normalize_continuous_value",
    "right_anchored_rope_positions", "validate_batch", "weighted_score",
]
