"""The hand-offs of the decoding loop and the protocols of its parts, in one place both sides import.

A step goes: the proposer returns a `Proposal`, the verifier a `Verification`, the loop hands the
proposer and the schedule a `StepOutcome`; all of them read the `DecodeState`, and `generate`
returns a `Generation`. The parts are `Proposer`, `Verifier`, `Schedule` and `Decoder`.

They live here, beneath every part, so that a proposer or a verifier knows the loop's types
without importing the loop (which imports them): imports run one way, from the loop down to its
parts and from every part down to this module. Their old homes (`specdec.proposers.base`,
`specdec.core.verify`, `specdec.core.decoding`) still hand the same names on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec.core.device import to_device
from specdec.core.metrics import GenerationStats
from specdec.core.sampling import SamplingParams

# on_tokens(row, new_token_ids): called as soon as tokens are committed, for streaming.
TokenCallback = Callable[[int, list[int]], None]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists: how much of a cached sequence can be reused."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------- hand-offs


@dataclass
class Proposal:
    """Draft tokens for one step.

    tokens:  [B, k] proposed token ids; row b's first `lengths[b]` are real, the rest padding.
    lengths: per row, how many tokens were proposed (0 <= lengths[b] <= k); on the host.
    probs:   [B, k, V] draft probabilities q, or None for a deterministic proposer (q is then a
             one-hot at the proposed token, which keeps speculative sampling lossless).
    device_lengths: [B] the lengths on the device, for a proposer whose host does not know them
             without a synchronisation (off a CPU: n-gram lookup, a draft under a confidence
             schedule): `lengths` then holds only an upper
             bound (k per row, which sets the scoring width), verifiers read these, and the step's
             one read replaces `lengths` with them before anything else looks (`settle`).
    host_tokens: per row, its real drafts as a list, where the proposer has them on the host anyway
             (a lookup builds them there, or read them with its lengths), so that someone who reads
             the drafts on the host (the hybrid judging a lookup it did not use) needs no read of
             its own; None where only the device has them. A new proposal made from this one's
             tokens (`specdec.core.schedules.cut`) does not carry them.
    """

    tokens: torch.Tensor
    lengths: list[int]
    probs: torch.Tensor | None = None
    device_lengths: torch.Tensor | None = None
    host_tokens: list[list[int]] | None = None

    def drafts_on_host(self) -> list[list[int]]:
        """Per row, its real drafts as a list: `host_tokens`, else read from the device (a read)."""
        if self.host_tokens is not None:
            return self.host_tokens
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths)]

    def lengths_on(self, device: torch.device) -> torch.Tensor:
        """`[B]` the per-row lengths as a device tensor (uploaded when only the host has them)."""
        if self.device_lengths is not None:
            return self.device_lengths
        return to_device(self.lengths, device)

    @property
    def settled(self) -> bool:
        """Whether `lengths` are the rows' lengths, not a bound awaiting the step's read."""
        return self.device_lengths is None

    def settle(self, lengths: list[int]) -> None:
        """The rows' lengths, as the step's read brought them back: `lengths` becomes exact."""
        self.lengths, self.device_lengths = list(lengths), None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_length(self) -> int:
        return max(self.lengths, default=0)

    @property
    def drafted(self) -> list[int]:
        """Per row, the most drafts a step can accept: the proposal's length (a tree: its depth)."""
        return list(self.lengths)

    @staticmethod
    def empty(batch_size: int, device: torch.device | str) -> Proposal:
        """No drafts: the step is a plain decoding step."""
        return Proposal(torch.zeros(batch_size, 0, dtype=torch.long, device=device), [0] * batch_size)


@dataclass
class Verification:
    """tokens: [B, k+1] emitted tokens (first accepted[b]+1 valid); accepted: [B] long."""

    tokens: torch.Tensor
    accepted: torch.Tensor


@dataclass
class DecodeState:
    """Everything the loop and the proposers share about the batch being decoded.

    tokens:    [B, max_len] token buffer; row b holds `seq_lens[b]` real tokens (prompt + output).
    reuse:     per row, how many leading tokens of a previous generation's caches are still valid
               (multi-turn continuation), or None for a fresh start.
    past_stamps: the cache stamps the previous generation (`past=`) left; empty for a fresh start.
    stamps:    the stamps of the caches this generation holds (see `attach`).
    committed: per row, the same tokens on the host, `tokens[b, :seq_lens[b]]` as a list. The commit
               passes every emitted token through the host anyway, so work done on the host
               (suffix indexes, the outputs) reads them here instead of copying them back from the
               device. Derived from `tokens` when not given.
    """

    tokens: torch.Tensor
    seq_lens: list[int]
    prompt_lens: list[int]
    active: list[bool]
    max_new_tokens: int
    max_len: int
    sampling: SamplingParams
    generator: torch.Generator
    reuse: list[int] | None = None
    schedule: Schedule | None = None
    past_stamps: frozenset[int] = frozenset()
    stamps: list[int] = field(default_factory=list)
    committed: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.committed:
            self.committed = [row[:n] for row, n in zip(self.tokens.tolist(), self.seq_lens)]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def room(self, b: int) -> int:
        """Tokens row b may still emit before `max_new_tokens` (EOS may end it sooner)."""
        return self.max_new_tokens - (self.seq_lens[b] - self.prompt_lens[b])

    def open_rows(self) -> dict[int, int]:
        """The rows still decoding -> `room` of each: what the policy plans over (`specdec.adaptive.policy`)."""
        return {b: self.room(b) for b, on in enumerate(self.active) if on}

    def attach(self, model) -> None:
        """Give `model` (a `CachedModel`: the target, a draft) its cache for this generation.

        The cache it holds is kept, rolled back to the first `reuse[b]` tokens of each row, only if
        it is exactly as the previous turn left it: its stamp is one that `past` recorded, so no
        other generation has written it since and it belongs to this engine. Otherwise it starts
        fresh, and the first pass feeds the whole prompt."""
        cache = model.cache
        if self.reuse is not None and cache is not None and cache.stamp in self.past_stamps:
            model.rollback([min(n, r) for n, r in zip(model.lengths, self.reuse)])
            cache.claim()
        else:
            model.reset(self.batch_size, self.max_len)
        self.stamps.append(model.cache.stamp)

    def output_ids(self, row: int) -> list[int]:
        return self.committed[row][self.prompt_lens[row] : self.seq_lens[row]]


@dataclass
class StepOutcome:
    """What one step did, handed to the proposer's `observe`."""

    proposal: Proposal
    verification: Verification
    prev_seq_lens: list[int]  # sequence lengths before this step's commit
    accepted: list[int]  # accepted drafts per row (0 for rows that were already finished)
    emitted: list[int]  # tokens appended per row (after EOS and max_new_tokens cuts)
    active: list[bool]  # which rows took part in this step


@dataclass
class Generation:
    """Result of `SpeculativeDecoder.generate`."""

    output_ids: list[list[int]]
    prompt_ids: list[list[int]]
    stats: GenerationStats
    state: DecodeState
    texts: list[str] | None = None
    lossless: bool = True
    verifier: str = "greedy"
    acceptance_measured: bool = True  # False when drafts happen out of sight (the transformers anchors)
    # Whether every greedy scoring pass ran at the decoder's fixed width over the whole cache buffer
    # (`SpeculativeDecoder.exact_greedy`); False when it was off, for sampling, and where it cannot apply.
    exact_greedy: bool = False
    # What the proposer and schedule learned or chose in this generation, for results (the hybrid's
    # choice per step, the cost-aware policy's measured costs); only those with a `report()`.
    reports: dict = field(default_factory=dict)


# ---------------------------------------------------------------- protocols of the parts


class Proposer(Protocol):
    """What the decoding loop needs from a way of drafting. A proposer whose `propose` returns
    `TreeProposal`s says so with a class attribute `drafts_trees = True` (absent: False), which the
    config's validation reads before any model loads: trees take only verifiers with a tree form.
    A proposer that drafts with an engine's models or caches keeps that engine as `engine`, so that
    a decoder on another engine refuses it (`SpeculativeDecoder`); one that needs no engine (n-gram
    lookup) may leave it out."""

    name: str

    def reset(self, state: DecodeState) -> None:
        """A new generation starts (or continues a conversation): drop or trim per-request state."""

    def propose(self, state: DecodeState, k: int) -> Proposal:
        """Up to `k` draft tokens per row, continuing `state.tokens[b, :state.seq_lens[b]]`."""

    def observe(self, state: DecodeState, outcome: StepOutcome) -> None:
        """The verifier's outcome for the last proposal; `state` is already committed."""


class Verifier(Protocol):
    """Decides which drafts to keep. `lossless`: whether the output is distributed exactly as the
    target's (carried into every result)."""

    name: str
    lossless: bool

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] the target's, at the last committed token and at each draft."""


class Schedule(Protocol):
    """How many tokens to draft per step (`specdec.core.schedules`); `k_max` sizes the caches."""

    name: str
    k_max: int
    uses_confidence: bool

    def reset(self) -> None:
        """A new generation starts."""

    def next_k(self, state: DecodeState) -> int:
        """Drafts to ask for in this step."""

    def keep_drafting(self, top_probs: torch.Tensor) -> torch.Tensor:
        """top_probs: [B] the draft's highest probability for the token just drafted -> [B] bool."""

    def trim(self, state: DecodeState, proposal: Proposal) -> Proposal:
        """The proposal as it will be scored."""

    def observe(self, outcome: StepOutcome, draft_s: float, verify_s: float) -> None:
        """The step's outcome and how long its drafting and verification took (seconds)."""

    def report(self) -> dict | None:
        """What the schedule learned, for results (None: nothing to report)."""


# The members of a `Schedule`: what `SpeculativeDecoder` checks a schedule object for.
SCHEDULE_REQUIRED = ("k_max", "uses_confidence", "reset", "next_k", "keep_drafting", "trim", "observe", "report")


class SyncFreeHints(Protocol):
    """Optional members a schedule may declare for the engine's sync-free paths (absent: False, the
    safe choice). They are not part of the `Schedule` contract: they only let a step skip a host read
    on a GPU, and change no token.

    fixed_k:      `next_k` always returns `k_max`, so a greedy draft model may chain its k passes in
                  one compiled call (`DraftModelProposer`, under compile=on).
    reads_offers: `trim` reads `proposal.lengths` before the step's own read, so a lookup must bring
                  its match lengths to the host (`NgramProposer` on a GPU leaves them on the device
                  otherwise).
    """

    fixed_k: bool
    reads_offers: bool


class Decoder(Protocol):
    """What the experiment drives: specdec's `SpeculativeDecoder` and the `transformers` anchors.
    A decoder owns its cache budget: it says how many positions a request needs and whether they fit."""

    k: int

    def generate(self, prompts: Sequence[Any], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, on_tokens: TokenCallback | None = None,
                 past: Generation | None = None, reserve: int = 0) -> Generation:
        """Decode a batch of prompts; `past` continues a conversation, `reserve` makes room for its rest."""

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request of `prompt_len` tokens takes to produce `max_new_tokens`."""

    def fits(self, positions: int) -> bool:
        """Whether that many positions fit the models' context."""


# ---------------------------------------------------------------- the seams the accelerated engine plugs into


class CompiledPasses(Protocol):
    """A model's passes run another way than eagerly (`CachedModel.compiled`; `specdec.accel.compiled`).
    Each call returns None where that pass must run eagerly after all: the caller then runs it itself."""

    def forward(self, tokens: torch.Tensor, advance: list[int] | None, keep: torch.Tensor | None,
                positions: torch.Tensor | None, block_mask: torch.Tensor | None) -> torch.Tensor | None:
        """`CachedModel.forward`'s pass: tokens `[B, T]` -> logits `[B, T, V]`."""

    def catch_up_chain(self, chunk: torch.Tensor, counts: list[int], n: int) -> torch.Tensor | None:
        """Feed each row's unseen tokens `chunk: [B, T]` then n greedy passes -> tokens `[B, n + 1]`."""

    def chain(self, first: torch.Tensor, n: int) -> torch.Tensor | None:
        """n greedy single-token passes after `first: [B]` -> drafts `[B, n]`."""

    def options(self) -> dict:
        """How these passes compile, for passes added beside them."""

    def report(self) -> dict:
        """Graphs compiled and passes run compiled / eagerly, for results."""


class Passes(Protocol):
    """What an `Engine` is given to run its passes fast (`specdec.accel.Accelerated`); None is eager.

    The engine calls `settle` before it moves any model and `attach` once its models sit on its device, in its dtype; a proposer's own
    modules go through `Engine.compiled`, which asks `compiled`; a generation holds `hold(model)`
    on each model for its whole run. A speculative generation asks `runner_blocked`, and where
    nothing blocks, runs its steps with `step_runner(...)` (a `StepRunner`) before the serial loop
    finishes what that leaves.
    """

    METHODS = ("settle", "attach", "compiled", "hold", "runner_blocked", "step_runner")

    def settle(self, device: torch.device, dtype: torch.dtype) -> None:
        """Resolve its modes for this device and dtype; raise, before any model moves, where one cannot apply."""

    def attach(self, engine: Any) -> None:
        """Settle on the engine's device and dtype; give its target and draft `compiled` passes."""

    def compiled(self, what: Any, kind: str, like: Any) -> Any:
        """`what` (kind `model`, `module` or `call`) compiled with the options of `like.compiled`."""

    def hold(self, model: torch.nn.Module) -> Any:
        """A context manager held on `model` for a generation."""

    def runner_blocked(self, decoder: Any, sampling: SamplingParams, verifier: Any) -> str | None:
        """Why the decoder's steps run serially in this generation (None: `step_runner` runs them)."""

    def step_runner(self, decoder: Any, state: DecodeState, verifier: Any, stats: GenerationStats, start: float,
                    on_tokens: TokenCallback | None, draft_t: Any, verify_t: Any) -> StepRunner:
        """The runner of this generation's steps."""


class StepRunner(Protocol):
    """Runs a generation's steps another way than the serial loop (queued ahead of their reads,
    `specdec.accel.pipeline`), committing each through `SpeculativeDecoder.commit_step` and feeding
    the proposer's and schedule's `observe` as the loop does; it stops where it cannot go on (the
    serial loop then finishes the rows still active)."""

    def run(self) -> None:
        """Run steps until every row is done or this runner cannot go on."""

    def report(self) -> dict | None:
        """What it did, for results."""
