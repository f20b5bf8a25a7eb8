"""Tests of the drafting strategies: n-gram lookup, suffix decoding, layer skipping, draft models, Medusa and EAGLE heads."""
