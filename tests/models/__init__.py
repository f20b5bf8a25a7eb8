"""Tests of model loading (specdec.models): tiny random models, local folders, GGUF conversion and its cache."""
