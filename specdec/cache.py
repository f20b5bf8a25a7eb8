"""Per-model KV cache: preallocated, one valid length per batch row, rollback by bookkeeping.

Speculative decoding writes k+1 positions per step and keeps only the accepted ones, and in a
batch every row keeps a different number. So each row has its own valid length and its own write
position: a forward pass of T tokens writes row b at positions [len_b, len_b + T), and a rollback
just moves len_b back. Rejected entries are never deleted; they sit beyond the valid length,
masked out, until the next write overwrites them (gpt-fast's static cache, nanochat's row lengths).

`RowCache` plugs into any `transformers` model through the `Cache` interface: each layer calls
`update(key, value)` and gets back a *view* of its buffers up to the longest row, never a copy.
The attention mask that hides the invalid entries is built by the caller (`engine.py`), because
only the caller knows which positions are real tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _RowLayer(CacheLayerMixin):
    """One attention layer's buffers: keys/values `[B, H, max_len, D]`, allocated on first write."""

    def __init__(self, owner: RowCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        shape_k = (b, h, self.owner.max_len, key_states.shape[-1])
        shape_v = (b, h, self.owner.max_len, value_states.shape[-1])
        self.keys = torch.zeros(shape_k, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape_v, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write `key_states, value_states: [B, H, T, D]` at each row's write position."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.uniform_start is not None:  # every row at the same length: one slice copy
            s = o.uniform_start
            self.keys[:, :, s : s + o.step_len] = key_states
            self.values[:, :, s : s + o.step_len] = value_states
        else:  # ragged rows: scatter each row at its own offset
            rows, pos = o.write_index
            self.keys[rows, :, pos] = key_states.transpose(1, 2)
            self.values[rows, :, pos] = value_states.transpose(1, 2)
        return self.keys[:, :, : o.kv_len], self.values[:, :, : o.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.max_row_len

    def get_max_length(self) -> int:
        return self.owner.max_len


class RowCache(Cache):
    """KV cache with a valid length per row. `lengths` lives on the host: it drives Python-side
    slicing every step, and keeping it there avoids a device sync per layer.

    Protocol per forward pass: `begin_write(T)` (sets write positions), the model runs and each
    layer calls `update`, then `advance(n)` moves the valid lengths forward by `n` per row.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device | str):
        self.max_len = max_len
        self.device = torch.device(device)
        self.lengths: list[int] = [0] * batch_size
        self.step_len = 0
        self.kv_len = 0
        self.uniform_start: int | None = 0
        self.write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def max_row_len(self) -> int:
        return max(self.lengths)

    def begin_write(self, step_len: int) -> None:
        """Prepare a forward pass that writes `step_len` positions per row after its valid length."""
        end = self.max_row_len + step_len
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: a row would reach {end} positions but the cache holds {self.max_len}; "
                "raise the cache length (max_len) or lower max_new_tokens."
            )
        self.step_len = step_len
        self.kv_len = end
        first = self.lengths[0]
        if all(n == first for n in self.lengths):
            self.uniform_start, self.write_index = first, None
        else:
            self.uniform_start = None
            starts = torch.tensor(self.lengths, device=self.device)
            pos = starts[:, None] + torch.arange(step_len, device=self.device)
            rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(pos)
            self.write_index = (rows, pos)

    def advance(self, counts: list[int]) -> None:
        """Mark `counts[b]` of the positions just written as valid for row b."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def rollback(self, lengths: list[int]) -> None:
        """Set each row's valid length; entries beyond it are ignored and later overwritten."""
        if any(n < 0 or n > self.max_len for n in lengths):
            raise ValueError(f"rollback lengths {lengths} outside [0, {self.max_len}]")
        self.lengths = list(lengths)

    def nbytes(self) -> int:
        """Bytes held by the preallocated key and value buffers."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )

    def valid_kv(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[H, len_row, D]` of one row: what attention may see (for tests and tools)."""
        n = self.lengths[row]
        return self.layers[layer].keys[row, :, :n], self.layers[layer].values[row, :, :n]
