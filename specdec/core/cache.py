"""Per-model KV cache: preallocated, one valid length per batch row, rollback by bookkeeping.

Speculative decoding writes k+1 positions per step and keeps only the accepted ones, and in a
batch every row keeps a different number. So each row has its own valid length and its own write
position: a forward pass of T tokens writes row b at positions [len_b, len_b + T), and a rollback
just moves len_b back. Rejected entries are never deleted; they sit beyond the valid length,
masked out, until the next write overwrites them (gpt-fast's static cache, nanochat's row lengths).

A ragged pass feeds every row T tokens, of which row b may need only its first `count_b` (the rest
is padding). Capacity is checked per row, len_b + count_b <= max_len; padding that would fall past
the end goes to one scratch position after it, which is never valid.

`RowCache` plugs into any `transformers` model through the `Cache` interface: each layer calls
`update(key, value)` and gets back a *view* of its buffers covering every row's writes, never a copy.
The attention mask that hides the invalid entries is built by the caller (`engine.py`), because
only the caller knows which positions are real tokens.

Each cache carries a `stamp`, a number no other cache state has had: new for every cache and every
time a generation takes it over. A generation records the stamps it leaves behind, and a later
turn reuses a cache only while its stamp is still one of those (`decoding.py`), so another
generation on the same cache in between, or a cache of another engine, is never mistaken for it.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.core.device import to_device

_STAMPS = itertools.count(1)  # next() is atomic under the GIL: stamps are unique across threads too


class _RowLayer(CacheLayerMixin):
    """One attention layer's buffers: keys/values `[B, H, max_len + 1, D]` (the last position is
    scratch), allocated on first write."""

    def __init__(self, owner: RowCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        shape_k = (b, h, self.owner.max_len + 1, key_states.shape[-1])
        shape_v = (b, h, self.owner.max_len + 1, value_states.shape[-1])
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


_ROW_INDEX: dict[tuple, torch.Tensor] = {}


def row_index(batch_size: int, width: int, device: torch.device) -> torch.Tensor:
    """`[B, T]` row numbers (row b: all b), the row half of an index into `[B, ...]` buffers; made
    once per shape, device and inference mode (read-only: a view of one arange). An index made under
    inference mode cannot serve a pass that autograd records, nor the other way round without a
    second compiled graph, hence one of each."""
    key = (batch_size, width, torch.device(device), torch.is_inference_mode_enabled())
    if key not in _ROW_INDEX:
        _ROW_INDEX[key] = torch.arange(batch_size, device=device)[:, None].expand(batch_size, width)
    return _ROW_INDEX[key]


class RowCache(Cache):
    """KV cache with a valid length per row. `lengths` lives on the host: it drives Python-side
    slicing every step, and keeping it there avoids a device sync per layer.

    Protocol per forward pass: `begin_write(T, counts)` (checks capacity, sets write positions),
    the model runs and each layer calls `update`, then `advance(n)` moves the valid lengths forward
    by `n` per row.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device | str):
        self.max_len = max_len
        self.device = torch.device(device)
        self.lengths: list[int] = [0] * batch_size
        self.step_len = 0
        self.kv_len = 0
        self.uniform_start: int | None = 0
        self.write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fixed_kv_len = False  # True: attention always runs over the whole buffer (exact greedy)
        self.stamp = next(_STAMPS)
        self.hidden: torch.Tensor | None = None  # [B, max_len + 1, H] when the model's owner keeps them
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def max_row_len(self) -> int:
        return max(self.lengths)

    def claim(self) -> int:
        """A generation takes this cache over: a new stamp, so that earlier holders see it changed."""
        self.stamp = next(_STAMPS)
        return self.stamp

    def begin_write(self, step_len: int, counts: list[int] | None = None) -> torch.Tensor:
        """Prepare a forward pass that writes `step_len` positions per row after its valid length;
        returns those cache indices, `slots: [B, step_len]` (each row's valid length onwards, before
        any clamping to the scratch position: the pass's default positions).

        counts: per row, how many of the positions must be kept (default all `step_len`); the rest
                is padding, written wherever it fits (past the end: the scratch position).
        """
        counts = counts if counts is not None else [step_len] * self.batch_size
        need = [n + c for n, c in zip(self.lengths, counts)]
        if max(need) > self.max_len:
            row = need.index(max(need))
            raise ValueError(
                f"KV cache overflow: row {row} would reach {need[row]} positions but the cache holds "
                f"{self.max_len}; raise the cache length (max_len) or lower max_new_tokens."
            )
        self.step_len = step_len
        # The view returned to attention covers every row's writes (scratch included); with
        # `fixed_kv_len`, the whole buffer, so that every pass attends over the same key length (exact
        # greedy decoding: attention's rounding then does not depend on where a pass starts; the
        # extra keys lie past every query and are masked).
        self.kv_len = self.max_len + 1 if self.fixed_kv_len else min(self.max_row_len + step_len, self.max_len + 1)
        # Worked out on the host, which knows the lengths: one copy to the device, not a small kernel
        # per term (on a GPU each is a launch, and the draft runs k passes a step).
        slots = to_device([[n + i for i in range(step_len)] for n in self.lengths], self.device)
        first = self.lengths[0]
        if all(n == first for n in self.lengths) and first + step_len <= self.max_len + 1:
            self.uniform_start, self.write_index = first, None
        else:
            self.uniform_start = None
            self.write_index = (row_index(self.batch_size, step_len, self.device), self.clamp_slots(slots))
        return slots

    def clamp_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """`slots: [B, T]` (from `begin_write`) with the positions past the buffer's end sent to the
        scratch position; the same tensor when none is (the host knows from the lengths)."""
        if self.max_row_len + slots.shape[1] <= self.max_len + 1:
            return slots
        return slots.clamp(max=self.max_len)

    def advance(self, counts: list[int]) -> None:
        """Mark `counts[b]` of the positions just written as valid for row b."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def rollback(self, lengths: list[int]) -> None:
        """Set each row's valid length; entries beyond it are ignored and later overwritten."""
        if any(n < 0 or n > self.max_len for n in lengths):
            raise ValueError(f"rollback lengths {lengths} outside [0, {self.max_len}]")
        self.lengths = list(lengths)

    def compact(self, starts: list[int], sources: list[list[int]]) -> None:
        """Row b keeps its entries before `starts[b]`, then the entries at cache indices `sources[b]`
        moved, in that order, to starts[b], starts[b] + 1, ...; its valid length becomes
        starts[b] + len(sources[b]). After a tree step this keeps exactly the accepted path.

        One gather and one scatter per layer for the whole batch; entries already in place are not
        copied (a path along the first nodes of each level moves nothing)."""
        if len(starts) != self.batch_size or len(sources) != self.batch_size:
            raise ValueError(f"compact needs one start and one source list per row ({self.batch_size} rows)")
        rows, dst, src = [], [], []
        for b, (start, slots) in enumerate(zip(starts, sources)):
            if slots and not (start >= 0 and 0 <= min(slots) and max(slots) < self.max_len):
                raise ValueError(f"compact: row {b} sources {slots} or start {start} outside [0, {self.max_len})")
            for j, slot in enumerate(slots):
                if slot != start + j:
                    rows.append(b)
                    dst.append(start + j)
                    src.append(slot)
        if rows:
            rows_t, dst_t, src_t = (to_device(x, self.device) for x in (rows, dst, src))
            for layer in self.layers:
                if layer.is_initialized:
                    # The right-hand side is gathered before the write, so overlapping moves are safe.
                    layer.keys[rows_t, :, dst_t] = layer.keys[rows_t, :, src_t]
                    layer.values[rows_t, :, dst_t] = layer.values[rows_t, :, src_t]
            if self.hidden is not None:
                self.hidden[rows_t, dst_t] = self.hidden[rows_t, src_t]
        self.rollback([s + len(x) for s, x in zip(starts, sources)])

    def store_hidden(self, states: torch.Tensor) -> None:
        """Keep the model's last hidden states of this pass, `states: [B, T, H]`, at the positions its
        keys and values go to, so that they roll back and compact with them: drafters that read the
        target's hidden states (Medusa heads, an EAGLE-style drafter) find row b's at `hidden[b, :len_b]`."""
        if self.hidden is None:
            self.hidden = torch.zeros(self.batch_size, self.max_len + 1, states.shape[-1],
                                      dtype=states.dtype, device=states.device)
        if self.uniform_start is not None:
            self.hidden[:, self.uniform_start : self.uniform_start + self.step_len] = states
        else:
            rows, pos = self.write_index
            self.hidden[rows, pos] = states

    def nbytes(self) -> int:
        """Bytes held by the preallocated key and value buffers."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )

    def valid_kv(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[H, len_row, D]` of one row: what attention may see (for tests and tools)."""
        n = self.lengths[row]
        return self.layers[layer].keys[row, :, :n], self.layers[layer].values[row, :, :n]
