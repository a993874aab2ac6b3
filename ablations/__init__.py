"""Ablation suite: one script per Phoenix component, a shared sweep helper and reports."""
