"""Distilling a small draft for a target (DistillSpec, Zhou et al. 2024), small enough for a CPU.

The recipe, in the order `scripts/train_draft.py` runs it:

1. prompts   `split_prompts`: built-in prompts and Spec-Bench prompts, minus the first
             `holdout_per_category` of every category, which are the ones studies evaluate on.
2. data      `generate_continuations`: the target's own greedy continuations, decoded by specdec's
             autoregressive decoder in ragged batches. Training on what the target says (on-policy
             for the target) is what makes the draft agree with it where it matters.
3. teacher   `teacher_targets`: one target pass over each prompt + continuation, keeping the target's
             final hidden state at the continuation positions (the lm_head turns it into the teacher
             distribution on the fly, so nothing of size [tokens, V] is stored).
4. draft     `make_draft`: the target's architecture with `num_layers` layers, initialised from the
             target's first layers, final norm, embeddings and (tied) head; embeddings and head frozen.
5. distil    `distill`: minimise KL(p_target || q_draft) at the continuation positions.
6. evaluate  `evaluate_draft`: speculative decoding against plain decoding on held-out prompts,
             measured by the experiment's harness.

Why this shape: on a CPU the draft's cost is per-layer overhead plus the [576 x 49152] head, so a
draft with 2 layers costs a fraction of the 30-layer target whatever its width; keeping the
target's width lets it reuse the embeddings and head (28M of SmolLM2's 135M parameters), which
already map hidden states to the target's vocabulary, and start from the target's own first layers
(the layer-skip draft) instead of from noise. Only ~7M parameters are trained, which a few thousand
target tokens and a few minutes of 2 CPU cores can move.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import random
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.core.attention import grouped_attention
from specdec.core.decoder_stack import early_exit_view, final_logits, hidden_source, logit_transform
from specdec.core.errors import InvalidInput, first_line
from specdec.core.files import umask_modes, write_whole
from specdec.study.data import Prompt, build_turn_input


def load_cache(path: Path, log):
    """A continuation cache file as plain data (`torch.load(weights_only=True)`), or None (with a
    warning) for a file that is not plain data or is cut short: the caller generates again."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        log.warning("%s is not plain data (%s); generating the continuations again", path, first_line(err))
    except (RuntimeError, EOFError, OSError) as err:
        log.warning("%s cannot be read (%s); generating the continuations again", path, first_line(err))
    return None


def save_cache(data, path: Path) -> None:
    """`torch.save`, whole or not at all (`write_whole`): an interrupted write never leaves a file cut short."""
    write_whole(path, lambda tmp: torch.save(data, tmp))


@dataclass
class Example:
    """One training sequence: tokens [L]; the draft learns the target's distribution for the tokens at
    positions [start, L), i.e. from the outputs at positions [start - 1, L - 1); hidden: [L - start, H]
    the target's final hidden states there."""

    tokens: torch.Tensor
    start: int
    hidden: torch.Tensor | None = None


# ---------------------------------------------------------------- 1. prompts


def split_prompts(prompts: list[Prompt], holdout_per_category: int,
                  category_map: dict[str, str] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): the first `holdout_per_category` prompts of each (mapped) category, in file
    order, are held out; `data.limit <= holdout_per_category` in a study then never sees a training prompt."""
    category_map = category_map or {}
    seen: dict[str, int] = {}
    train, held = [], []
    for p in prompts:
        cat = category_map.get(p.category, p.category)
        seen[cat] = seen.get(cat, 0) + 1
        (held if seen[cat] <= holdout_per_category else train).append(p)
    return train, held


def take_per_category(prompts: list[Prompt], n: int | None, category_map: dict[str, str] | None = None,
                      seed: int = 0) -> list[Prompt]:
    """Up to `n` prompts per (mapped) category, drawn at random with `seed` (all if n is None)."""
    if n is None:
        return list(prompts)
    category_map = category_map or {}
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(category_map.get(p.category, p.category), []).append(p)
    rng = random.Random(seed)
    return [p for g in groups.values() for p in (rng.sample(g, n) if len(g) > n else g)]


def first_turn_ids(tokenizer, prompts: Iterable[Prompt]) -> list[list[int]]:
    """Each prompt's first user turn, rendered through the chat template as the experiments do."""
    return [build_turn_input(tokenizer, [], p.turns[0]) for p in prompts]



class PhaseTimer:
    """Seconds per named phase of a training recipe (`timer("train")` ends the phase that began at the
    previous call), logged as each ends; `times` goes into the recipe's report."""

    def __init__(self, log):
        self.times: dict[str, float] = {}
        self._log = log
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self._clock, 1)
        self._log.info("%s: %.1f s", name, now - self._clock)
        self._clock = now

# ---------------------------------------------------------------- 2. data


def generate_continuations(engine, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
                           eos_token_id=None, progress: bool = True) -> list[Example]:
    """The target's greedy continuation of every prompt, batched (prompts sorted by length, so a
    batch's rows cost about the same to prefill)."""
    from specdec.core.decoding import SpeculativeDecoder

    # Plain decoding here is compared with nothing, so it runs one token wide: exact greedy's fixed
    # scoring width would only make the data cost more, most at large batch sizes.
    decoder = SpeculativeDecoder(engine, eos_token_id=eos_token_id, exact_greedy=False)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    examples: list[Example | None] = [None] * len(prompt_ids)
    bar = tqdm(total=len(order), desc="target continuations", unit="prompt", disable=not progress)
    for i in range(0, len(order), batch_size):
        rows = order[i : i + batch_size]
        out = decoder.generate([prompt_ids[r] for r in rows], max_new_tokens=max_new_tokens)
        for r, generated in zip(rows, out.output_ids):
            examples[r] = Example(torch.tensor(prompt_ids[r] + generated), len(prompt_ids[r]))
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{out.stats.tokens_per_s:.0f}")
    bar.close()
    return examples


def truncate(example: Example, max_len: int) -> Example:
    """Keep the last `max_len` tokens (all the continuation, then as much prompt as fits): long prompts
    (summaries, RAG) would otherwise dominate the cost of the teacher pass and of training."""
    cut = max(len(example.tokens) - max_len, 0)
    return Example(example.tokens[cut:], max(example.start - cut, 1), None)


# ---------------------------------------------------------------- 3. teacher


def _batches(examples: list[Example], max_tokens: int) -> list[list[Example]]:
    """Groups of similar length whose padded size stays under max_tokens."""
    ordered = sorted(examples, key=lambda e: len(e.tokens))
    out, cur = [], []
    for e in ordered:
        if cur and (len(cur) + 1) * len(e.tokens) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(e)
    if cur:
        out.append(cur)
    return out


def _pad(batch: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input ids [B, L] (right-padded) and attention mask [B, L]."""
    width = max(len(e.tokens) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e.tokens)] = e.tokens
        mask[i, : len(e.tokens)] = 1
    return ids, mask


def _loss_positions(batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the outputs that predict each example's continuation tokens."""
    rows = torch.cat([torch.full((len(e.tokens) - e.start,), i) for i, e in enumerate(batch)])
    cols = torch.cat([torch.arange(e.start - 1, len(e.tokens) - 1) for e in batch])
    return rows, cols


def _autocast(model, dtype: str | None):
    """Mixed precision for the matmuls (bfloat16 runs natively on the AMX units of recent CPUs,
    far faster than float32); None: off."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=getattr(torch, dtype or "bfloat16"), enabled=dtype is not None)


@torch.inference_mode()
def teacher_targets(target, examples: list[Example], max_tokens: int = 2048, pad_id: int = 0,
                    progress: bool = True, autocast: str | None = None) -> list[Example]:
    """Attach the target's final hidden states at each example's loss positions (in place): the
    output of its decoder (`decoder_stack.hidden_source`, the output head's input) under the engine's
    attention (`grouped_attention`), the features drafters read while decoding, whatever the decoder
    is called (`model`, `transformer`, `gpt_neox`, a multimodal wrapper's language model)."""
    decoder = hidden_source(target)
    for batch in tqdm(_batches(examples, max_tokens), desc="teacher pass", unit="batch", disable=not progress):
        ids, mask = _pad(batch, pad_id)
        with _autocast(target, autocast), grouped_attention(target):  # the engine's attention, too
            hidden = decoder(input_ids=ids, attention_mask=mask)[0]  # [B, L, H]
        rows, cols = _loss_positions(batch)
        flat = hidden[rows, cols].float()
        for e, h in zip(batch, flat.split([len(e.tokens) - e.start for e in batch])):
            e.hidden = h.clone()
    return examples


# ---------------------------------------------------------------- 4. draft


def make_draft(target, num_layers: int) -> torch.nn.Module:
    """A `num_layers`-layer model of the target's class and width, initialised from the target's
    embeddings, first `num_layers` layers, final norm and head (`decoder_stack.early_exit_view`, so any
    layout it reads: Llama's, GPT-2's, GPT-NeoX's, ...); in float32 (it is trained), with embeddings
    and head frozen. InvalidInput for a target without such a stack, a `num_layers` it lacks, or whose
    shallower model has other parameters than its first layers."""
    view = early_exit_view(target, num_layers, key="draft.num_layers", user="train_draft")
    try:  # the teacher's distribution is its head on its decoder's output: a model where it is not, refused
        hidden_source(target)
    except ValueError as err:
        raise InvalidInput(f"train_draft: {err}") from err
    config = copy.deepcopy(view.config)
    if hasattr(config, "quantization_config"):  # a GGUF marker: save_pretrained would refuse the draft
        del config.quantization_config
    draft = type(target)(config).float()
    want, have = draft.state_dict(), view.state_dict()
    differ = sorted(set(want) ^ set(have)) + sorted(k for k in want.keys() & have.keys() if want[k].shape != have[k].shape)
    if differ:  # GPT-NeoX-Japanese: its last layer has a bias the others lack, and a 1-layer model's is the last
        raise InvalidInput(f"train_draft: a {num_layers}-layer {type(target).__name__} is not the target's first "
                           f"{num_layers} layer{'s' if num_layers > 1 else ''} (its layers are built by their place in the stack: "
                           f"{', '.join(differ[:3])} differ); distil another model as the draft")
    draft.load_state_dict(have)
    draft.get_input_embeddings().requires_grad_(False)
    draft.get_output_embeddings().requires_grad_(False)
    return draft


# ---------------------------------------------------------------- 5. distil


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p_teacher || q_student) over positions; both [N, V]."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def distill(draft, head: torch.nn.Module, examples: list[Example], epochs: int = 2, lr: float = 5e-4,
            max_tokens: int = 2048, weight_decay: float = 0.0, seed: int = 0, pad_id: int = 0,
            progress: bool = True, log_every: int = 10, autocast: str | None = None) -> list[float]:
    """Train the draft's trainable parameters to match `head(teacher hidden)` at the loss positions.
    Returns the loss of every optimisation step. `head`: the target's lm_head (frozen). `autocast`:
    e.g. "bfloat16" for mixed precision (weights and optimizer stay in the draft's dtype)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    transform = logit_transform(draft)  # the target's (Cohere's logit scale, Gemma-2's soft cap): its p, not the head's
    batches = _batches(examples, max_tokens)
    steps = epochs * len(batches)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = random.Random(seed)
    losses: list[float] = []
    draft.train()
    bar = tqdm(total=steps, desc="distil", unit="step", disable=not progress)
    t0 = time.perf_counter()
    for _ in range(epochs):
        rng.shuffle(batches)
        for batch in batches:
            ids, mask = _pad(batch, pad_id)
            rows, cols = _loss_positions(batch)
            with _autocast(draft, autocast):
                hidden = draft.get_decoder()(input_ids=ids, attention_mask=mask)[0][rows, cols]
                with torch.no_grad():
                    teacher = final_logits(head(torch.cat([e.hidden for e in batch]).to(head.weight.dtype)), *transform)
                logits = final_logits(draft.get_output_embeddings()(hidden), *transform)
            loss = kl_loss(logits, teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(1)
            if len(losses) % log_every == 0 or len(losses) == 1:
                recent = losses[-log_every:]
                bar.set_postfix(kl=f"{sum(recent) / len(recent):.3f}", s=f"{time.perf_counter() - t0:.0f}")
    bar.close()
    draft.eval()
    return losses


# ---------------------------------------------------------------- 6. evaluate


def evaluate_draft(target, draft, tokenizer, prompts: list[Prompt], k: int = 4, max_new_tokens: int = 64,
                   dtype: str = "float32", progress: bool = True, exact_greedy: bool = True) -> dict:
    """Greedy speculative decoding with `draft` against plain decoding on the first turn of each
    prompt, through the experiment's harness (`specdec.study.experiment.measure`: a warm-up, then the two
    alternating batch by batch, so slow periods of a shared machine hit both; exact greedy as in an
    experiment). Returns what an experiment writes to summary.json (`specdec.study.report.summarize`):
    speedup, acceptance, tokens/s of both, the fraction of outputs equal to the baseline's, and the
    method's `MethodResults` under `methods`."""
    from omegaconf import OmegaConf

    from specdec.core.decoding import SpeculativeDecoder
    from specdec.core.engine import Engine
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.study.experiment import Setup, exact_greedy_state, measure, set_exact_greedy, warm_up
    from specdec.study.report import BASELINE, summarize

    engine = Engine(target, copy.deepcopy(draft), dtype=dtype)  # a copy: Engine casts the model it gets
    spec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=k, tokenizer=tokenizer)
    base = SpeculativeDecoder(engine, tokenizer=tokenizer)
    set_exact_greedy([spec, base], exact_greedy)
    setup = Setup(engine, tokenizer, {"draft": spec}, base)
    cfg = OmegaConf.create({"generation": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "top_k": 0,
                                           "top_p": 1.0, "batch_size": 1},
                            "data": {"system_prompt": None}, "seed": 0, "progress": progress,
                            "engine": {"exact_greedy": exact_greedy}, "repeats": 1})
    prompts = [Prompt(p.prompt_id, p.category, p.turns[:1]) for p in prompts]
    warm_up([spec, base], prompts[0], cfg, tokenizer)
    rows = measure(setup, prompts, cfg)
    exact = {name: exact_greedy_state(d, cfg) for name, d in (("draft", spec), (BASELINE, base))}
    return summarize(rows, "draft", {"num_speculative_tokens": k, "dtype": dtype}, greedy=True, exact_greedy=exact)


def save_draft(draft, tokenizer, path) -> None:
    """A directory that `ModelSpec(path=...)` / `draft.path=` loads: config, weights, tokenizer. Written
    into a temporary folder beside `path` and renamed into place, so an interrupted save leaves
    `path` as it was (a folder there before, replaced only once the new one is complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    old = path.with_name(f".{path.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        draft.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        umask_modes(tmp)  # safetensors writes the weights 0600; a shared folder needs them readable
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
