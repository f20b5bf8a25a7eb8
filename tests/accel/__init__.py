"""Tests of the acceleration: compiled passes, CUDA graphs, packed linear layers, overlap and pipelining, host syncs, benchmarks."""
