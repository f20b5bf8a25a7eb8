"""N-gram prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`).

Each row drafts from its own tokens (prompt + output so far): find the most recent earlier
occurrence of the row's last n tokens, trying n = max_ngram down to min_ngram, and propose the up to
k tokens that followed it. There is no model and no q (a deterministic draft is a one-hot q, which
keeps speculative sampling lossless).

A row with no match proposes nothing, and the loop then scores 1 + (longest proposal) tokens: a step
in which no row matched is exactly a plain decoding step, so the method costs nothing where it has
nothing to say. The search is vectorised over the batch: for each n one unfold of the [B, L] token
buffer and one comparison, O(B * L * n) elementwise work per step and no Python loop over rows.

Knowing the longest match means reading the search's result before scoring: on a GPU a second
synchronisation in the step, with the device idle until the scoring pass is launched. So where reads
are not free (`static_width`, by default: off a CPU, unless the schedule or a hybrid reads the offers
on the host) the proposal is k wide whatever matched, its lengths stay on the device
(`Proposal.device_lengths`) and come back with the step's one read; a step with no match then
scores k + 1 tokens, which a GPU pays about as much for as one (memory-bound), and a CPU does not.
"""

from __future__ import annotations

import torch

from specdec.core.device import reads_are_free, to_device
from specdec.core.engine import Engine
from specdec.proposers.base import Proposal


class NgramProposer:
    name = "ngram"

    def __init__(self, engine: Engine | None = None, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"method.proposer: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # True: always k wide, the lengths left on the device; False: the lengths read before scoring;
        # None: True where reads are not free and nothing reads the offers on the host.
        self.static_width: bool | None = None

    def reset(self, state) -> None:
        pass

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        lens = to_device(state.seq_lens, device)  # [B]
        width = max(state.seq_lens)
        seqs = state.tokens[:, :width]  # [B, L]
        start, found = self.find(seqs, lens)
        active = to_device(state.active, device, torch.bool)
        lengths = torch.where(found & active, (lens - start).clamp(max=k), 0)  # [B]
        idx = (start[:, None] + torch.arange(k, device=device)).clamp(max=width - 1)  # [B, k]
        tokens = seqs.gather(1, idx)
        tokens = tokens.masked_fill(torch.arange(k, device=device)[None, :] >= lengths[:, None], 0)
        if self._static(state):  # the lengths come back with the step's read
            return Proposal(tokens, [k] * b, device_lengths=lengths)
        # The search's read: how long each match is decides the scoring width. The drafts come back
        # with their lengths, in the same read, for whoever looks at them on the host.
        read = torch.cat([lengths[:, None], tokens], dim=1).tolist()  # [B, 1 + k]
        found_lengths = [row[0] for row in read]
        drafts = [row[1: 1 + n] for row, n in zip(read, found_lengths)]
        return Proposal(tokens[:, : max(found_lengths)], found_lengths, host_tokens=drafts)

    def _static(self, state) -> bool:
        if self.static_width is not None:
            return self.static_width
        return not reads_are_free(state.tokens.device) and not getattr(state.schedule, "reads_offers", False)

    def find(self, seqs: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """seqs: [B, L] tokens, row b valid up to lens[b]. Returns, per row, where the continuation of
        the longest, most recent earlier match of its suffix starts ([B] long) and whether one exists."""
        b, width = seqs.shape
        start = torch.zeros(b, dtype=torch.long, device=seqs.device)
        found = torch.zeros(b, dtype=torch.bool, device=seqs.device)
        for n in range(min(self.max_ngram, width - 1), self.min_ngram - 1, -1):
            # suffix: [B, n], the last n tokens of each row (rows shorter than n + 1 cannot match)
            pos = (lens[:, None] - n + torch.arange(n, device=seqs.device)).clamp(min=0)
            suffix = seqs.gather(1, pos)
            windows = seqs.unfold(1, n, 1)  # [B, L-n+1, n]: windows[b, j] = seqs[b, j:j+n]
            hit = (windows == suffix[:, None, :]).all(-1)  # [B, L-n+1]
            j = torch.arange(hit.shape[1], device=seqs.device)
            hit &= j[None, :] + n < lens[:, None]  # a continuation token follows (and not the suffix itself)
            last = torch.where(hit, j[None, :], -1).amax(1)  # most recent match, -1 if none
            new = (last >= 0) & ~found
            start = torch.where(new, last + n, start)
            found |= new
            if reads_are_free(seqs.device) and bool(found.all()):
                break
        return start, found

    def observe(self, state, outcome) -> None:
        pass
