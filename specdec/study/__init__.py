"""Experiments: Hydra configs, prompt sets, runs, results files, reports, W&B tracking, sweeps,
comparisons, dashboards and the transformers anchors. The decoding loop knows nothing of this wing."""
