"""Tests of the core: types, engine, cache, decoding loop, verifiers, trees, schedules, metrics, model loading."""
