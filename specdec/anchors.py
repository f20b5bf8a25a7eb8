"""The field's anchors as methods: `transformers` generate(), assisted generation, prompt lookup.

Each anchor exposes the same `generate(...) -> Generation` as `SpeculativeDecoder`, so the
experiment harness runs it on the same prompts, against the same baseline, into the same results
schema. What `transformers` does not report is measured from outside: target passes are counted
with a forward hook (so tau = tokens emitted per target pass is comparable), TTFT with a streamer.
Per-draft acceptance is not exposed by `generate()`, so alpha and per-position acceptance are
reported as unknown (NaN) rather than guessed; so is tau for assisted generation whose assistant is
the target itself (its passes cannot be told apart from the target's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from specdec.decoding import Generation, SpeculativeDecoder
from specdec.engine import Engine
from specdec.metrics import GenerationStats, RowStats
from specdec.sampling import SamplingParams


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


class HFGenerate:
    """`model.generate()` with the engine's target; subclasses add assisted / prompt-lookup args.

    Rows are generated one at a time: assisted generation and prompt lookup accept batch size 1
    only, and one code path keeps the three anchors comparable.
    """

    name = "hf_generate"
    lossless = True

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

    def _draft_is_target(self) -> bool:
        return self.speculative and self.engine.draft is not None and \
            self.engine.draft.model is self.engine.target.model

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, on_tokens=None, past=None) -> Generation:
        params = SamplingParams(temperature, top_k, top_p)
        ids = self._checks.encode(prompts)
        self._checks._check_lengths(ids, max_new_tokens)
        model = self.engine.target.model
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        sampling = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if not params.greedy:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k or None,
                        "top_p": params.top_p}
        stats = GenerationStats(rows=[RowStats() for _ in ids])
        outputs, start = [], time.perf_counter()
        try:
            for b, p in enumerate(ids):
                torch.manual_seed(seed + b)
                clock, calls[0] = _FirstTokenClock(), 0
                row_start = time.perf_counter()
                x = torch.tensor([p], device=self.engine.device)
                with torch.inference_mode():
                    # An explicit mask: without one, generate() takes prompt tokens equal to the pad
                    # id (chat templates' end-of-turn tokens, often) for padding and hides them.
                    out = model.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                        eos_token_id=self.eos_ids or None, pad_token_id=(self.eos_ids or [0])[0],
                        streamer=clock, **sampling, **self.extra_args(),
                    )
                new = out[0, len(p):].tolist()
                outputs.append(new)
                if on_tokens is not None:
                    on_tokens(b, new)
                row = stats.rows[b]
                row.new_tokens = len(new)
                if not self._draft_is_target():  # else draft passes and target passes look alike
                    row.steps, row.emitted = max(calls[0] - 1, 0), len(new) - 1  # first pass: prefill
                row.wall_s = time.perf_counter() - row_start
                if b == 0 and clock.first_token_at is not None:
                    stats.ttft_s = clock.first_token_at - row_start
        finally:
            hook.remove()
        stats.wall_s = time.perf_counter() - start
        stats.steps = sum(r.steps for r in stats.rows)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
        return Generation(outputs, ids, stats, state=None, texts=texts, lossless=self.lossless,
                          verifier="greedy" if params.greedy else "speculative_sampling",
                          acceptance_measured=not self.speculative)


class HFAssisted(HFGenerate):
    """Assisted generation (`assistant_model=` the engine's draft) with a constant k."""

    name = "hf_assisted"

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


class HFPromptLookup(HFGenerate):
    """Prompt lookup decoding (`prompt_lookup_num_tokens=` k)."""

    name = "hf_prompt_lookup"

    def __init__(self, engine: Engine, num_speculative_tokens: int = 4, **kw):
        super().__init__(engine, num_speculative_tokens, **kw)
        self.speculative = True

    def extra_args(self) -> dict:
        return {"prompt_lookup_num_tokens": self.k}
