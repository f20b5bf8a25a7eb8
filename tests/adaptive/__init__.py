"""Tests of the adaptive drafting: the cost-aware policy and the hybrid proposer."""
