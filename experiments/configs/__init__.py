"""Experiment configs: each module's `get_config(preset)` returns an ml_collections config."""
