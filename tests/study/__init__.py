"""Tests of the studies: configs, experiments, sweeps, results, tracking, comparison, dashboard, prompt sets, packaging."""
