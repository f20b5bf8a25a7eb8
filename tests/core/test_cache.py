"""Rollback is bookkeeping, and exact: after feeding tokens and rolling some back, each row's cache
and the next logits equal those of a cache that never saw the rejected tokens."""

import pytest
import torch

from specdec.core.engine import CachedModel


def _fresh(model, batch=2, max_len=64):
    m = CachedModel(model, "target")
    m.reset(batch, max_len)
    return m


def test_rollback_equals_never_having_fed_the_rejected_tokens(target):
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])  # row 1 has 3 real tokens
    spec = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])
    kept = [2, 4]  # row 0 keeps 2 of the 5 speculative tokens, row 1 keeps 4
    new = torch.tensor([[40, 41], [42, 43]])

    a = _fresh(target)
    a.forward(prompts, advance=[4, 3])
    a.forward(spec)
    a.rollback([4 + kept[0], 3 + kept[1]])
    logits_a = a.forward(new)

    for row in range(2):  # the reference: each row fed only what it kept, one row at a time
        b_row = _fresh(target, batch=1)
        n = 4 if row == 0 else 3
        seq = torch.cat([prompts[row, :n], spec[row, : kept[row]], new[row]])[None]
        logits_b = b_row.forward(seq)[:, -2:]
        assert torch.allclose(logits_a[row], logits_b[0], atol=1e-5)
        for layer in range(target.config.num_hidden_layers):
            ka, va = a.cache.valid_kv(layer, row)
            kb, vb = b_row.cache.valid_kv(layer, 0)
            assert ka.shape == kb.shape
            assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


def test_rollback_moves_lengths_and_copies_nothing(target):
    m = _fresh(target)
    m.forward(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    keys = m.cache.layers[0].keys
    ptr, before = keys.data_ptr(), keys.clone()
    m.rollback([1, 2])
    assert m.lengths == [1, 2]
    assert m.cache.layers[0].keys.data_ptr() == ptr and torch.equal(m.cache.layers[0].keys, before)


def test_cache_overflow_is_a_clear_error(target):
    m = _fresh(target, batch=1, max_len=4)
    m.forward(torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match="KV cache overflow"):
        m.forward(torch.tensor([[8, 9]]))


def test_capacity_is_checked_per_row_in_a_ragged_catch_up(target):
    """Row 0 holds 10 tokens and gets 2 more, row 1 is empty and gets 14: each row fits in 16 positions
    although the longest row plus the widest write (10 + 14) does not. Logits equal single-row runs."""
    tokens = torch.arange(3, 19)[None].repeat(2, 1)  # [2, 16]
    m = _fresh(target, max_len=16)
    m.forward(tokens[:, :10], advance=[10, 0])
    logits = m.catch_up(tokens[:, :16], upto=[12, 14])
    assert m.lengths == [12, 14]
    for row, n in enumerate([12, 14]):
        ref = _fresh(target, batch=1, max_len=16)
        assert torch.allclose(logits[row], ref.forward(tokens[:1, :n])[0, -1], atol=1e-5)
        for layer in range(target.config.num_hidden_layers):
            k, v = m.cache.valid_kv(layer, row)
            k_ref, v_ref = ref.cache.valid_kv(layer, 0)
            assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)


def test_a_row_that_fills_the_cache_exactly_fits_and_one_more_overflows(target):
    """Row 0 writes up to the last position while row 1's padding runs past the end: the padding
    goes to scratch, both rows' logits stay exact; one position more is a clear overflow."""
    tokens = torch.arange(3, 19)[None].repeat(2, 1)
    m = _fresh(target, max_len=16)
    m.forward(tokens[:, :10], advance=[4, 10])
    logits = m.catch_up(tokens, upto=[16, 11])  # 12 tokens for row 0, 1 (and 11 of padding) for row 1
    assert m.lengths == [16, 11]
    for row, n in enumerate([16, 11]):
        ref = _fresh(target, batch=1, max_len=16)
        assert torch.allclose(logits[row], ref.forward(tokens[:1, :n])[0, -1], atol=1e-5)
    m.rollback([15, 3])
    with pytest.raises(ValueError, match="KV cache overflow: row 0 would reach 17 .* holds 16"):
        m.forward(tokens[:, :2])
