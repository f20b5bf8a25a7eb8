"""Tests of the training scripts: draft models distilled from a target."""
