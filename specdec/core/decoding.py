"""The decoding loop: prefill, then propose -> score -> verify -> commit -> observe until done.

`SpeculativeDecoder` runs any proposer against the target on one `Engine`. With no proposer it is
the plain autoregressive baseline: the same loop, caches and code path with zero drafts per step,
so a measured speedup compares the drafting and nothing else.

Cache invariant: after every commit the target's cache holds `seq_len - 1` tokens per row; the last
emitted token is fed at the start of the next scoring pass, followed by the drafts.

A generation holds its engine for its whole run (`Engine.exclusive`), and a continuation (`past=`)
reuses a cache only while it is exactly as that past generation left it (`DecodeState.attach`):
anything else is prefilled again, never silently reused.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.core.contract import check_proposal
from specdec.core.device import to_device
from specdec.core.engine import Engine, Timer
from specdec.core.metrics import GenerationStats, RowStats
from specdec.core.sampling import SamplingParams, check_number
from specdec.core.schedules import ConstantSchedule, make_schedule
from specdec.core.tree import TreeProposal
from specdec.core.tree_verify import TreeVerifier
from specdec.core.types import (
    SCHEDULE_REQUIRED,
    DecodeState,
    Generation,
    Proposal,
    Proposer,
    StepOutcome,
    TokenCallback,
    common_prefix_len,
)
from specdec.core.verify import make_verifier

# Exact greedy in reduced precision (bfloat16): the logits of a token depend, in their last bits, on
# the shapes of the pass that scored it: its width (a 1-row matrix product takes other kernels than a
# 5-row one) and the key length attention runs over (SDPA's CPU kernel blocks the keys by length).
# So under exact greedy every pass has the same width and attends over the whole cache buffer
# (experiments/measurement/LOG.md, "1. Exact greedy in bfloat16"). EXACT_WIDTH is the default width: k <= 7.
EXACT_WIDTH = 8
OVERLAP_MODES = ("auto", "on", "off", True, False)


class NoDraftProposer:
    """No drafting at all: every step is one target pass that emits one token. The plain decoding
    baseline runs through the same engine, caches and loop as every speculative method with it, so
    that speedups compare like with like."""

    name = "autoregressive"

    def reset(self, state) -> None:
        pass

    def propose(self, state, k: int) -> Proposal:
        return Proposal.empty(state.batch_size, state.tokens.device)

    def observe(self, state, outcome) -> None:
        pass


def _check_proposer(engine: Engine, proposer) -> None:
    """`proposer` is a proposer object, and one built for `engine` where it drafts with an engine's
    models (its `engine`, and its parts' for a hybrid): one built for another engine would draft from
    that engine's models and caches, and fail mid-generation or propose for other prompts."""
    name = type(proposer).__name__
    if not all(callable(getattr(proposer, f, None)) for f in ("reset", "propose", "observe")):
        raise TypeError(f"proposer must be a proposer object (reset, propose, observe), got {proposer!r}: build "
                        "one, e.g. NgramProposer(engine) or DraftModelProposer(engine)")
    for part in (proposer, *getattr(proposer, "parts", {}).values()):
        bound = getattr(part, "engine", None)
        if bound is not None and bound is not engine:
            raise ValueError(f"{type(part).__name__}{'' if part is proposer else f' (a part of {name})'} was built "
                             f"for another Engine than the decoder's: build it with the decoder's engine, "
                             f"{type(part).__name__}(engine, ...)")


def _schedule(spec, k: int):
    """`schedule=` as a schedule object: None is k every step, a name is built as `method.schedule=`
    builds it (with k as its `num_speculative_tokens`), an object is checked for what the decoding
    loop calls on it, so that a wrong value fails here, before any model runs, and not mid-generation."""
    schedule = ConstantSchedule(k) if spec is None else make_schedule(spec, k)
    missing = [m for m in SCHEDULE_REQUIRED if not hasattr(schedule, m)]
    if missing:
        raise TypeError(f"schedule= takes None, a schedule's name (heuristic, confidence, cost_aware, ...) or a "
                        f"schedule object, got {spec!r}, which has no {', '.join(missing)}: subclass "
                        f"specdec.core.schedules.ConstantSchedule for a schedule of your own")
    return schedule


class SpeculativeDecoder:
    """Speculative decoding of a batch of prompts with any proposer (None: plain decoding).

    engine:                 target (and draft) models with their caches.
    proposer:               a `Proposer`; None gives the autoregressive baseline.
    num_speculative_tokens: k, drafts proposed per step (ignored without a proposer).
    schedule:               chooses k per step: None (k every step), a name ("heuristic", "confidence",
                            "cost_aware": the files of conf/method/schedule/) or a schedule object;
                            see `specdec.core.schedules`.
    verifier:               "auto" (greedy at temperature 0, else speculative sampling), or a name.
    verifier_args:          keyword arguments of the named verifier (typical: epsilon, delta).
    tokenizer:              optional; needed to pass text prompts and to get text back.
    eos_token_id:           id or ids that end a row; default from the tokenizer / model config;
                            an empty list never stops early.
    max_len:                minimum cache length to allocate in every generation (see `reserve` for one).
    overlap:                let the engine's step runner queue step n+1 before reading step n's
                            outcome, so that the device never waits for the host's bookkeeping: plain
                            decoding (`specdec.accel.overlap`) and a greedy draft model under compile=on
                            (`specdec.accel.pipeline`); only an engine with passes has one.
                            "auto" (the default): on CUDA, where the device runs ahead of the host;
                            "on" / "off" (also True / False). Tokens are the same either way.

    The decoder owns its cache budget: `positions_needed` says how many positions a request takes,
    `fits` whether they fit the models' context, `check_request` refuses one that does not.
    """

    def __init__(self, engine: Engine, proposer: Proposer | None = None, num_speculative_tokens: int = 4,
                 verifier: str = "auto", tokenizer=None, eos_token_id: int | Sequence[int] | None = None,
                 max_len: int = 0, schedule=None, verifier_args: dict | None = None, exact_greedy: bool = True,
                 overlap: str | bool = "auto"):
        self.engine = engine
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap={overlap!r} is not one of: auto, on, off (or True / False)")
        self.overlap = overlap
        if proposer is not None:
            _check_proposer(engine, proposer)
        self.proposer = proposer or NoDraftProposer()
        self.speculative = proposer is not None
        num_speculative_tokens = check_number("num_speculative_tokens", num_speculative_tokens, integer=True)
        max_len = check_number("max_len", max_len, integer=True)
        if self.speculative and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens (k) must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens if self.speculative else 0
        self.schedule = _schedule(schedule, max(self.k, 1))
        self.k = self.schedule.k_max if self.speculative else 0
        if self.speculative and hasattr(self.schedule, "bind"):  # a schedule that prices its proposer
            self.schedule.bind(self.proposer, engine)
        # A proposer that drafts trees scores up to `num_nodes` nodes per step: caches make room for them.
        self.k = max(self.k, getattr(self.proposer, "num_nodes", 0))
        self.verifier_name = verifier
        self.verifier_args = dict(verifier_args or {})
        self.tokenizer = tokenizer
        self.eos_ids = self._eos_ids(eos_token_id)
        self.max_len = max_len
        # Exact greedy: at temperature 0 every scoring pass has `score_width` positions (padding
        # included) and attends over the whole cache buffer, so a token's logits do not depend on
        # which pass scored it (see `score`). Decoders that must agree bit for bit (a method and its
        # baseline) need the same score_width and the same cache length.
        self.exact_greedy = exact_greedy
        self.score_width = max(EXACT_WIDTH, self.k + 1)

    def _eos_ids(self, eos: int | Sequence[int] | None) -> set[int]:
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.engine.target.model.generation_config, "eos_token_id", None)
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    # ---------------------------------------------------------------- input checks

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts as lists of token ids, checked: each a text or a sequence of integer ids (ints,
        numpy integers, integer tensors; not bools or floats) within the vocabulary of every model."""
        if prompts is None or isinstance(prompts, (str, bytes)) \
                or (isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim != 2) \
                or (len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)):
            raise TypeError("generate() takes a list of prompts: a list of strings or a list of token-id lists")
        vocab = min(m.vocab_size for m in self._models())
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass tokenizer= or give token ids")
                p = self.tokenizer.encode(p)
            ids.append(_token_ids(p, i, vocab))
            if len(ids[-1]) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if not ids:
            raise ValueError("no prompts given")
        return ids

    # ---------------------------------------------------------------- cache budget

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request of `prompt_len` tokens needs to produce `max_new_tokens`: a row's
        cache holds seq_len - 1 tokens and a step writes the last token and up to k drafts (the scoring
        width, with exact greedy) after them; a finished row still takes part in scoring passes."""
        return prompt_len + max_new_tokens + max(self.k, self.score_width - 1 if self.exact_greedy else 0)

    @property
    def context_length(self) -> int | None:
        """The most positions every model of this decoder can attend over (None: no limit known)."""
        limits = [m.context_length for m in self._models() if m.context_length is not None]
        return min(limits) if limits else None

    def fits(self, positions: int) -> bool:
        """Whether `positions` (from `positions_needed`) fit every model's context."""
        return self.context_length is None or positions <= self.context_length

    def check_request(self, ids: list[list[int]], max_new_tokens: int, reserve: int = 0, ahead: int = 0) -> int:
        """The cache length to allocate for these prompts (at least `reserve`, and `ahead` positions
        more than they need, as far as the context allows); raises before any model work if a prompt
        cannot fit."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max(len(p) for p in ids)
        need = self.positions_needed(longest, max_new_tokens)
        extra = need - longest - max_new_tokens  # k, or exact greedy's wider scoring pass
        room = f"k ({self.k})" if extra == self.k else \
            f"{extra} positions of scoring room (exact greedy scores {self.score_width} positions a pass)"
        for model in self._models():
            if model.context_length is not None and need > model.context_length:
                raise ValueError(
                    f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + {room} "
                    f"= {need} exceeds the {model.name}'s context of {model.context_length} tokens; "
                    "shorten the prompt or lower max_new_tokens."
                )
        limit = self.context_length or need + ahead
        return max(need, min(need + ahead, limit), min(max(self.max_len, reserve), limit))

    def _models(self):
        return [m for m in (self.engine.target, self.engine.draft) if m is not None]

    # ---------------------------------------------------------------- the loop

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 on_tokens: TokenCallback | None = None, past: Generation | None = None,
                 reserve: int = 0) -> Generation:
        """Decode a batch of prompts (text or token ids). `past`: the previous turn's Generation; its
        caches are reused for the shared prefix (the next turn of a conversation) when it has this
        batch size and nothing else has run on them since, else the prompts are prefilled again
        (`state.reuse` is None). `reserve`: cache positions to allocate at least, so that later turns
        can continue these caches (`positions_needed` of the whole conversation; too few only costs
        that reuse). Raises `EngineBusyError` while another generation runs on the engine."""
        max_new_tokens = check_number("max_new_tokens", max_new_tokens, integer=True)
        seed = check_number("seed", seed, integer=True)
        sampling = SamplingParams(temperature, top_k, top_p)
        verifier = make_verifier(self.verifier_name, sampling, **self.verifier_args)
        if hasattr(verifier, "check_k"):  # arguments that depend on k (forced: one a_i per draft position)
            verifier.check_k(self.k)
        if getattr(self.proposer, "num_nodes", 0) and not isinstance(verifier, TreeVerifier):
            verifier = TreeVerifier(verifier)
        ids = self.encode(prompts)
        reserve = check_number("reserve", reserve, integer=True)
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0 (cache positions to allocate at least), got {reserve}")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be a callable (for example TextStreamer(tokenizer, on_text)), "
                            f"got {on_tokens!r}")
        # Pipelined steps write a step ahead of what the host has read: room for one more keeps them
        # pipelined to the end (`specdec.accel.pipeline`; where the context has it).
        runs_ahead = self._runs_ahead(sampling, verifier)
        max_len = self.check_request(ids, max_new_tokens, reserve, self.k + 1 if runs_ahead and self.speculative else 0)
        if past is not None and not isinstance(past, Generation):
            raise TypeError(f"past= takes the Generation returned by the previous turn's generate(), "
                            f"got {type(past).__name__}")
        with self.engine.exclusive():
            state = self._new_state(ids, max_new_tokens, max_len, sampling, seed, past)
            return self._decode(state, ids, verifier, on_tokens, runs_ahead)

    def _decode(self, state: DecodeState, ids: list[list[int]], verifier, on_tokens, runs_ahead: bool) -> Generation:
        """Prefill, then the speculative steps until every row is done; the engine is held.
        `runs_ahead`: the engine's step runner runs the steps first (`_runs_ahead`)."""
        sampling, device, target = state.sampling, self.engine.device, self.engine.target
        state.attach(target)
        target.cache.fixed_kv_len = self._exact(state)
        self.proposer.reset(state)
        self.schedule.reset()
        stats = GenerationStats(rows=[RowStats() for _ in ids])
        draft_t, verify_t = Timer(device), Timer(device)
        start, cpu_start = time.perf_counter(), time.process_time()

        # prefill: the first token of each row comes from the prompt's last logits (TTFT ends here)
        logits = target.catch_up(state.tokens, state.seq_lens)
        first = verifier(logits[:, None], Proposal.empty(state.batch_size, device), sampling, state.generator)
        self.commit_tokens(state, first.tokens[:, :1].tolist(), [1] * state.batch_size, stats, start, on_tokens)
        target.rollback([n - 1 for n in state.seq_lens])
        stats.ttft_s = time.perf_counter() - start

        runner = None
        if runs_ahead:  # the engine's step runner (`StepRunner`); the loop below finishes what it leaves
            runner = self.engine.passes.step_runner(self, state, verifier, stats, start, on_tokens, draft_t, verify_t)
            runner.run()
        while any(state.active):
            k = self.schedule.next_k(state) if self.speculative else 0
            k = min(k, max(state.open_rows().values()) - 1)  # never draft past what can still be emitted
            draft_before, verify_before = draft_t.total, verify_t.total
            with draft_t:  # 1. propose, checked and cut to its longest row (`specdec.core.contract`)
                proposal = check_proposal(self.proposer, self.proposer.propose(state, k), state, k, target.vocab_size)
                proposal = _capped(state, self.schedule.trim(state, proposal))
            with verify_t:
                logits = self.score(state, proposal)  # 2. score
                result = verifier(logits, proposal, sampling, state.generator)  # 3. verify
                accepted, tokens, path = _read_step(proposal, result)
            outcome = self.commit_step(state, proposal, result, accepted, tokens, path, stats, start, on_tokens)
            self.proposer.observe(state, outcome)  # 5. observe
            self.schedule.observe(outcome, draft_t.total - draft_before, verify_t.total - verify_before)
            stats.steps += 1
            stats.draft_lengths.append(proposal.max_length)

        stats.wall_s = time.perf_counter() - start
        stats.cpu_s = time.process_time() - cpu_start
        stats.draft_s, stats.verify_s = draft_t.total, verify_t.total
        out = [state.output_ids(b) for b in range(state.batch_size)]
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in out]
        reports = {name: r for name, r in (("proposer", _report(self.proposer)), ("schedule", self.schedule.report()),
                                           ("compile", self.engine.compile_report()),
                                           ("pipeline", runner and runner.report())) if r is not None}
        # A lossy rule that coincides with greedy at temperature 0 (typical acceptance) is lossless there.
        lossless = verifier.lossless or (state.sampling.greedy and getattr(verifier, "lossless_when_greedy", False))
        return Generation(out, ids, stats, state, texts, lossless=lossless, verifier=verifier.name,
                          reports=reports, exact_greedy=self._exact(state))

    def _new_state(self, ids, max_new_tokens, max_len, sampling, seed, past) -> DecodeState:
        b = len(ids)
        reuse, past_stamps = None, frozenset()
        old = past.state if past is not None else None
        cache = self.engine.target.cache
        # Reusable: the past's target cache is this engine's, untouched since, big enough, same batch.
        if isinstance(old, DecodeState) and cache is not None and cache.stamp in old.stamps \
                and old.batch_size == b and old.max_len >= max_len:
            reuse = [min(common_prefix_len(p, old.committed[i]), len(p) - 1)
                     for i, p in enumerate(ids)]
            max_len, past_stamps = old.max_len, frozenset(old.stamps)
        tokens = torch.zeros(b, max_len, dtype=torch.long)
        for i, p in enumerate(ids):
            tokens[i, : len(p)] = torch.tensor(p)
        gen = torch.Generator(device=self.engine.device).manual_seed(seed)
        lens = [len(p) for p in ids]
        return DecodeState(to_device(tokens, self.engine.device), list(lens), lens, [True] * b, max_new_tokens,
                           max_len, sampling, gen, reuse, self.schedule, past_stamps,
                           committed=[list(p) for p in ids])

    def overlaps(self) -> bool:
        """Whether plain decoding's steps run overlapped, the host one step behind the device (the
        engine's step runner: `specdec.accel.overlap`): asked for (`overlap`) and the engine has one."""
        return not self.speculative and self._runs_ahead(SamplingParams(), None)

    def _overlap_on(self) -> bool:
        if self.overlap in ("off", False):
            return False
        return self.overlap in ("on", True) or self.engine.device.type == "cuda"

    def pipelines(self, sampling: SamplingParams, verifier) -> bool:
        """Whether a generation's speculative steps run through the engine's step runner (queued one
        ahead of their reads: `specdec.accel.pipeline`, a greedy draft model under compile=on), where
        the engine's passes have one and nothing blocks it."""
        return self.speculative and self._runs_ahead(sampling, verifier)

    def _runs_ahead(self, sampling: SamplingParams, verifier) -> bool:
        """Whether a generation's steps go to the engine's step runner rather than the serial loop."""
        passes = self.engine.passes
        return self._overlap_on() and passes is not None and passes.runner_blocked(self, sampling, verifier) is None

    def score(self, state: DecodeState, proposal: Proposal, lens: list[int] | None = None) -> torch.Tensor:
        """One target pass over each row's last token and its drafts: logits [B, T, V], T = 1 + max drafts
        (1 + the node budget for a tree). `lens`: the rows' lengths when they are not `state.seq_lens`
        (steps queued ahead of the host's commit)."""
        roots = to_device([n - 1 for n in (state.seq_lens if lens is None else lens)], state.tokens.device)
        last = state.tokens.gather(1, roots[:, None])[:, 0]
        if isinstance(proposal, TreeProposal):  # every node, at its depth, seeing only its ancestors
            chunk = torch.cat([last[:, None], proposal.tokens], dim=1)
            tree = proposal.tree
            return self.engine.target.forward(chunk, positions=tree.positions(roots), block_mask=tree.mask)
        chunk = torch.cat([last[:, None], proposal.tokens[:, :proposal.max_length]], dim=1) \
            if proposal.max_length else last[:, None]
        if not self._exact(state):
            return self.engine.target.forward(chunk)
        # Pad to the fixed width with scratch copies of the last token: they sit after every real
        # token (causal, so no real token sees them) and the commit's rollback drops them.
        t = chunk.shape[1]
        if t > self.score_width:
            raise ValueError(f"exact_greedy: a step scores {t} tokens but score_width is {self.score_width}")
        pad = last[:, None].expand(-1, self.score_width - t)
        return self.engine.target.forward(torch.cat([chunk, pad], dim=1))[:, :t]

    def _exact(self, state: DecodeState) -> bool:
        """Whether this generation scores at a fixed width: exact greedy on, temperature 0, and nothing
        in `exact_greedy_blocked`."""
        return self.exact_greedy and state.sampling.greedy and self.exact_greedy_blocked is None

    @property
    def exact_greedy_blocked(self) -> str | None:
        """Why exact greedy cannot apply to this decoder (None: it can). A greedy run where it cannot
        is still the target's greedy decoding in float32, but in bfloat16 may drift from plain decoding
        at near-ties (docs/engine.md#numerics-and-exact-greedy); results say so (`exact_greedy` in results and summary)."""
        if getattr(self.proposer, "num_nodes", 0):
            return ("a token tree is scored with its own positions and an ancestors-only mask, and its "
                    "nodes' keys sit apart in the cache, so a node's logits are summed in another order "
                    "than a one-token pass's")
        if self.engine.target.compiled is not None:
            return ("compile=on scores at power-of-two widths and key lengths that follow the sequence, "
                    "not at one width over the whole cache buffer")
        return None

    def commit_step(self, state, proposal, result, accepted, tokens, path, stats, start, on_tokens,
                     write: bool = True) -> StepOutcome:
        """4. commit: append emitted tokens, roll the target's cache back to the accepted length.
        Public: a `StepRunner` commits its steps through it, as the serial loop does. `accepted`,
        `tokens` and `path` are the step's outcome read on the host (`_read_step`).
        `write=False`: the device's token buffer holds them already (`commit_tokens`)."""
        prev, active = list(state.seq_lens), list(state.active)
        accepted = [a if on else 0 for a, on in zip(accepted, active)]
        counts = [a + 1 if on else 0 for a, on in zip(accepted, active)]
        emitted = self.commit_tokens(state, tokens, counts, stats, start, on_tokens, write)
        # A tree counts its depth as drafted, so alpha and per-position acceptance are per depth.
        drafted = proposal.drafted
        for b, on in enumerate(active):
            if on:
                stats.rows[b].record(drafted[b], accepted[b], emitted[b])
        if isinstance(proposal, TreeProposal):  # keep exactly the accepted path's entries, in order
            self.engine.target.keep_path([n - 1 for n in prev], path)
        self.engine.target.rollback([n - 1 for n in state.seq_lens])
        return StepOutcome(proposal, result, prev, accepted, emitted, active)

    def commit_tokens(self, state, tokens: list[list[int]], counts: list[int], stats, start, on_tokens,
                write: bool = True) -> list[int]:
        """Append `tokens[b][:counts[b]]` to each active row, cut at EOS and at max_new_tokens.
        `write=False`: the device's token buffer holds them already (written when they were queued)."""
        emitted, written = [], []  # written: (row, column, token) of every token appended
        for b, n in enumerate(counts):
            if not state.active[b] or n == 0:
                emitted.append(0)
                continue
            row = tokens[b][:n]
            room = state.room(b)
            row = row[:room]
            for i, t in enumerate(row):
                if t in self.eos_ids:
                    row = row[: i + 1]
                    break
            s = state.seq_lens[b]
            written += [(b, s + i, t) for i, t in enumerate(row)]
            state.committed[b].extend(row)
            state.seq_lens[b] = s + len(row)
            stats.rows[b].new_tokens += len(row)
            emitted.append(len(row))
            if len(row) == room or row[-1] in self.eos_ids:
                state.active[b] = False
                stats.rows[b].wall_s = time.perf_counter() - start
            if on_tokens is not None:
                on_tokens(b, row)
        if written and write:  # one copy to the device buffer for the whole batch
            rows, columns, values = to_device(written, state.tokens.device).T
            state.tokens[rows, columns] = values
        return emitted


def _capped(state: DecodeState, proposal: Proposal) -> Proposal:
    """Each row's drafts cut to what it can still emit less one (`room - 1`: the step's recovered or
    bonus token is the last), so that no step drafts past `max_new_tokens` and a drafter that is always
    right reports acceptance 1.0 (transformers' assisted generation caps its drafts alike). A tree is
    capped by the step's k, its depth, which the loop sets from the row with the most room."""
    if isinstance(proposal, TreeProposal) or proposal.max_length == 0:
        return proposal
    caps = [max(state.room(b) - 1, 0) if on else 0 for b, on in enumerate(state.active)]
    if all(n <= c for n, c in zip(proposal.lengths, caps)):
        return proposal
    lengths = [min(n, c) for n, c in zip(proposal.lengths, caps)]
    device_lengths = None
    if proposal.device_lengths is not None:  # a bound on the host, the lengths on the device: no read
        device_lengths = torch.minimum(proposal.device_lengths, to_device(caps, proposal.device_lengths.device))
    width = max(lengths)
    probs = proposal.probs[:, :width] if proposal.probs is not None else None
    host = [row[:n] for row, n in zip(proposal.host_tokens, lengths)] if proposal.host_tokens is not None else None
    return Proposal(proposal.tokens[:, :width], lengths, probs, device_lengths, host)


def _read_step(proposal: Proposal, result) -> tuple[list[int], list[list[int]], list[list[int]] | None]:
    """The step's one copy from the device to the host (on a GPU, its one synchronisation): per row
    the accepted count, the emitted tokens and, for a tree, the accepted path and the tree's depth
    (which becomes `proposal.drafted`), for a proposal with its lengths on the device those lengths
    (`Proposal.settle`), packed into one tensor. Returns (accepted, tokens, path)."""
    dtype = result.tokens.dtype
    parts = [result.accepted[:, None].to(dtype), result.tokens]
    tree = isinstance(proposal, TreeProposal)
    if tree:
        parts += [result.path.to(dtype), proposal.depths()[:, None].to(dtype)]
    elif not proposal.settled:  # lengths the proposer left on the device (n-gram lookup on a GPU)
        parts.append(proposal.device_lengths[:, None].to(dtype))
    host = torch.cat(parts, dim=1).tolist()
    width = 1 + result.tokens.shape[1]
    accepted, tokens = [row[0] for row in host], [row[1:width] for row in host]
    if not tree:
        if not proposal.settled:
            proposal.settle([row[-1] for row in host])
        return accepted, tokens, None
    proposal.drafted = [row[-1] for row in host]
    return accepted, tokens, [row[width:-1] for row in host]


def _report(part) -> dict | None:
    """A proposer's optional `report()`: what it chose or learned in the last generation."""
    report = getattr(part, "report", None)
    return report() if report is not None else None


def _token_ids(prompt, index: int, vocab: int) -> list[int]:
    """One prompt's token ids as Python ints; TypeError for anything but integers (bools and floats
    included), ValueError for an id outside [0, vocab). Messages name the prompt and the token."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        dtype = prompt.dtype
        integer = dtype.kind in "iu" if isinstance(prompt, np.ndarray) else \
            not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if prompt.ndim != 1 or not integer:
            raise TypeError(f"prompt {index} is a {prompt.ndim}-D {type(prompt).__name__} of {dtype}; a prompt "
                            "is a text or a 1-D sequence of integer token ids")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        ids = []
        for j, t in enumerate(prompt):
            is_int = isinstance(t, numbers.Integral) and not isinstance(t, bool) or \
                isinstance(t, torch.Tensor) and t.ndim == 0 and not (t.is_floating_point() or t.is_complex()
                                                                     or t.dtype == torch.bool)
            if not is_int:
                raise TypeError(f"prompt {index}, token {j}: {t!r} is a {type(t).__name__}; token ids must be "
                                "integers (int, a numpy integer or an integer tensor)")
            ids.append(int(t))
    else:
        raise TypeError(f"prompt {index} is a {type(prompt).__name__}; a prompt is a text or a sequence of "
                        "token ids")
    bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt {index}, token {bad}: {ids[bad]} is outside the vocabulary [0, {vocab}) of "
                         "the models; were these ids made by another model's tokenizer?")
    return ids


class TextStreamer:
    """Incremental detokenization: turns `on_tokens` calls into text deltas per row.

    Decodes each row's tokens from a moving offset and holds back text that ends in an incomplete
    UTF-8 character, so the printed pieces concatenate to the final text.
    """

    def __init__(self, tokenizer, on_text: Callable[[int, str], None]):
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.tokens: dict[int, list[int]] = {}
        self.printed: dict[int, int] = {}

    def __call__(self, row: int, new_ids: list[int]) -> None:
        ids = self.tokens.setdefault(row, [])
        ids.extend(new_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        done = self.printed.get(row, 0)
        if len(text) > done:
            self.on_text(row, text[done:])
            self.printed[row] = len(text)
