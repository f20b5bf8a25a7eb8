"""The field's anchors as methods: `transformers` generate(), assisted generation, prompt lookup.

Each anchor exposes the same `generate(...) -> Generation` as `SpeculativeDecoder`, so the
experiment harness runs it on the same prompts, against the same baseline, into the same results
schema. What `transformers` does not report is measured from outside: target passes are counted
with a forward hook (so tau = tokens emitted per target pass is comparable), TTFT with a streamer.
Per-draft acceptance is not exposed by `generate()`, so alpha and per-position acceptance are
reported as unknown (NaN) rather than guessed; so is tau for assisted generation whose assistant is
the target itself (its passes cannot be told apart from the target's).

Rows are answered one at a time, each as a request of its own: a row's TTFT and latency run from
the start of that row, and the Generation's `ttft_s` is the mean over rows.

Multi-turn conversations: `HFGenerate.generate(past=...)` continues from the previous turn's cache,
as specdec's decoder does: each row's transformers cache goes back to `model.generate`, cropped to the
prefix the new input shares with the tokens it holds. Assisted generation and prompt lookup cannot:
transformers' assisted decoding feeds the whole input through the target on its first pass even when
the cache already holds a prefix, so a continued cache gives wrong tokens; they set
`continues_cache = False` and re-prefill every turn. The experiment reads that flag and runs every
method of a comparison under one policy (`experiment.py`). A `past` from another decoder, or one
already continued, is never reused: the turn starts from a fresh prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import ALL_CACHE_NAMES

from specdec.core.decoding import Generation, SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.metrics import GenerationStats, RowStats
from specdec.core.sampling import SamplingParams
from specdec.core.types import common_prefix_len


class _FirstTokenClock(BaseStreamer):
    """Records when generate() hands out its first new token (the first put() is the prompt)."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


# generate()'s keyword for a cache to continue from: "cache" from transformers 5.2x, "past_key_values" before.
CACHE_KWARG = ALL_CACHE_NAMES[0]


@dataclass
class AnchorState:
    """What an anchor's Generation keeps for the next turn, per row: the tokens so far (prompt and
    output) and the target's transformers cache, which holds a prefix of them (None for an anchor
    that cannot continue a cache).

    owner: the anchor that made it; a `past` from anything else is not reused.
    reuse: per row, the leading tokens this generation took from its `past`'s caches (None: fresh).
    spent: set once a later turn has continued from these caches, which it extends in place.
    """

    owner: object
    tokens: list[list[int]]
    caches: list
    reuse: list[int] | None = None
    spent: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.tokens)


class RequestRoom:
    """A decoder from another engine, as the harness sizes its requests: the engine grows its own caches
    to the prompt, the answer and the k drafts a step holds past them (no padded scoring width), within
    the context of the `SpeculativeDecoder` it keeps for its prompt checks (`_checks`)."""

    k: int
    _checks: SpeculativeDecoder

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.k

    def fits(self, positions: int) -> bool:
        return self._checks.fits(positions)

    @property
    def context_length(self) -> int | None:
        return self._checks.context_length


class HFGenerate(RequestRoom):
    """`model.generate()` with the engine's target; subclasses add assisted / prompt-lookup args.

    Rows are generated one at a time: assisted generation and prompt lookup accept batch size 1
    only, and one code path keeps the three anchors comparable.
    """

    name = "hf_generate"
    lossless = True
    continues_cache = True  # generate(past=...) reuses the previous turn's cache

    def __init__(self, engine: Engine, num_speculative_tokens: int = 0, tokenizer=None,
                 eos_token_id: int | Sequence[int] | None = None, **_ignored):
        self.engine = engine
        self.k = num_speculative_tokens
        self.tokenizer = tokenizer
        # The prompt checks and text encoding are the decoder's: reuse them, not a copy.
        self._checks = SpeculativeDecoder(engine, tokenizer=tokenizer, eos_token_id=eos_token_id)
        self.eos_ids = sorted(self._checks.eos_ids)
        self.speculative = False

    def extra_args(self) -> dict:
        return {}

    def _passes_look_alike(self) -> bool:
        """True when draft passes cannot be told from target passes: only for an anchor that runs a
        draft model (assisted generation), and only when that draft is the target itself."""
        return False

    def _previous_caches(self, past, n: int) -> AnchorState | None:
        """`past.state` if its caches may be continued for a batch of `n` rows, else None (fresh)."""
        state = getattr(past, "state", None)
        usable = isinstance(state, AnchorState) and state.owner is self and not state.spent
        if not (self.continues_cache and usable and state.batch_size == n):
            return None
        state.spent = True  # the caches are about to be extended in place: continuing twice would mix turns
        return state

    def _row_cache(self, previous: AnchorState | None, b: int, ids: list[int]) -> tuple[object, int]:
        """Row b's cache for prompt `ids` and how many of its tokens are reused: the previous turn's
        cache cropped to the prefix shared with `ids` (leaving at least one token to prefill), else a
        new one; None for an anchor that cannot continue a cache (generate() makes its own)."""
        if not self.continues_cache:
            return None, 0
        if previous is not None:
            cache = previous.caches[b]
            held = cache.get_seq_length()
            keep = min(held, common_prefix_len(ids, previous.tokens[b]), len(ids) - 1)
            if keep > 0:
                try:
                    if keep < held:
                        cache.crop(keep - held)  # a negative count: tokens to drop from the end
                    return cache, keep
                except RuntimeError:  # a sliding-window layer past its window cannot be rolled back
                    pass
        return DynamicCache(config=self.engine.target.model.config.get_text_config(decoder=True)), 0

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, on_tokens=None, past=None, reserve: int = 0) -> Generation:
        """As `SpeculativeDecoder.generate`; `reserve` is not needed: transformers grows its caches."""
        params = SamplingParams(temperature, top_k, top_p)
        ids = self._checks.encode(prompts)
        self._checks.check_request(ids, max_new_tokens)
        model = self.engine.target.model
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        sampling = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if not params.greedy:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k or None,
                        "top_p": params.top_p}
        stats = GenerationStats(rows=[RowStats() for _ in ids])
        previous = self._previous_caches(past, len(ids))
        state = AnchorState(owner=self, tokens=[], caches=[], reuse=[] if previous is not None else None)
        outputs, ttfts, start = [], [], time.perf_counter()
        try:
            for b, p in enumerate(ids):
                torch.manual_seed(seed + b)
                clock, calls[0] = _FirstTokenClock(), 0
                row_start = time.perf_counter()
                cache, reused = self._row_cache(previous, b, p)
                x = torch.tensor([p], device=self.engine.device)
                with torch.inference_mode():
                    # An explicit mask: without one, generate() takes prompt tokens equal to the pad
                    # id (chat templates' end-of-turn tokens, often) for padding and hides them.
                    out = model.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                        eos_token_id=self.eos_ids or None, pad_token_id=(self.eos_ids or [0])[0],
                        streamer=clock, **({CACHE_KWARG: cache} if cache is not None else {}),
                        **sampling, **self.extra_args(),
                    )
                new = out[0, len(p):].tolist()
                outputs.append(new)
                state.tokens.append(p + new)
                state.caches.append(cache)
                if state.reuse is not None:
                    state.reuse.append(reused)
                if on_tokens is not None:
                    on_tokens(b, new)
                row = stats.rows[b]
                row.new_tokens = len(new)
                if not self._passes_look_alike():
                    row.steps, row.emitted = max(calls[0] - 1, 0), len(new) - 1  # first pass: prefill
                row.wall_s = time.perf_counter() - row_start
                if clock.first_token_at is not None:
                    ttfts.append(clock.first_token_at - row_start)
        finally:
            hook.remove()
        stats.wall_s = time.perf_counter() - start
        stats.ttft_s = sum(ttfts) / len(ttfts) if ttfts else float("nan")
        stats.steps = sum(r.steps for r in stats.rows)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
        return Generation(outputs, ids, stats, state=state, texts=texts, lossless=self.lossless,
                          verifier="greedy" if params.greedy else "speculative_sampling",
                          acceptance_measured=not self.speculative)


class HFAssisted(HFGenerate):
    """Assisted generation (`assistant_model=` the engine's draft) with a constant k."""

    name = "hf_assisted"
    continues_cache = False  # transformers' assisted decoding cannot start from a filled cache

    def __init__(self, engine: Engine, num_speculative_tokens: int = 4, **kw):
        if engine.draft is None:
            raise ValueError("method=hf_assisted needs a draft model: set draft=self, draft.path=... ")
        super().__init__(engine, num_speculative_tokens, **kw)
        self.speculative = True

    def extra_args(self) -> dict:
        draft = self.engine.draft.model
        draft.generation_config.num_assistant_tokens = self.k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        return {"assistant_model": draft}

    def _passes_look_alike(self) -> bool:
        return self.engine.draft.model is self.engine.target.model


class HFPromptLookup(HFGenerate):
    """Prompt lookup decoding (`prompt_lookup_num_tokens=` k)."""

    name = "hf_prompt_lookup"
    continues_cache = False  # prompt lookup runs through assisted decoding: see HFAssisted

    def __init__(self, engine: Engine, num_speculative_tokens: int = 4, **kw):
        super().__init__(engine, num_speculative_tokens, **kw)
        self.speculative = True

    def extra_args(self) -> dict:
        return {"prompt_lookup_num_tokens": self.k}
