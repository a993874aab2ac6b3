"""Training on the synthetic world: systems, losses, the scanned loop, the runner."""

from phoenix_flax.training.loop import (Trainer, TrainState, make_optimizer, make_schedule,
                                        make_system, optimizer_from, schedule_from)
from phoenix_flax.training.loss import (binary_cross_entropy, first_positive,
                                        in_batch_softmax_loss, is_positive, ranking_loss,
                                        sampling_log_q, update_sampling_counts)
from phoenix_flax.training.runner import (LoadedRun, Progress, RunInterrupted, RunInUseError,
                                          RunOutputError, check_run_dirs, load_checkpoint,
                                          load_run, run_dirs, run_experiment)
from phoenix_flax.training.schema import (ConfigError, ExperimentSpec, base_config,
                                          parse_config, split_config, world_config)
from phoenix_flax.training.sharding import Placement, make_placement
from phoenix_flax.training.system import (HashEmbeddingTables, RankingSystem, RetrievalSystem,
                                          validate_training_batch)

__all__ = [
    "ConfigError", "ExperimentSpec", "HashEmbeddingTables", "LoadedRun", "Placement",
    "Progress", "RankingSystem", "RetrievalSystem", "RunInUseError", "RunInterrupted",
    "RunOutputError",
    "TrainState", "Trainer",
    "base_config", "binary_cross_entropy", "check_run_dirs", "first_positive",
    "in_batch_softmax_loss", "is_positive", "load_checkpoint", "load_run", "make_optimizer",
    "make_placement", "make_schedule", "make_system", "optimizer_from", "parse_config",
    "ranking_loss", "sampling_log_q", "schedule_from", "update_sampling_counts",
    "run_dirs", "run_experiment", "split_config", "validate_training_batch", "world_config",
]
