"""EAGLE-3 (Li et al. 2025): a one-layer drafter over several of the target's layers, drafting an
EAGLE-2 dynamic tree or a chain.

Where EAGLE-1 reads the target's last hidden state, EAGLE-3 reads the residual stream entering a few
of its decoder layers (by default [2, N//2, N-3] of an N-layer target; transformers'
`output_hidden_states[i]`), concatenated, and projects them with `fc` [n*Ht -> H]. Its one layer
(the "mid-layer") joins the normed token embedding and the normed hidden state, width 2H, as the
input of its attention's q/k/v; the output's residual is the hidden state itself. Its own output
head (`norm`, `lm_head`) covers a draft vocabulary of Vd tokens, mapped to the target's by `d2t`
(offsets: target id = i + d2t[i]). Later draft steps feed back the drafter's own output, width H, so
`fc` applies only where the input is the target's taps (/work/shared FORMATS.md, section 1.2).

The target keeps the taps in its cache from its scoring passes (`CachedModel.keep_hidden_states`
with layers), compacted to the accepted path after each tree step like EAGLE's features, so nothing
is computed twice. Drafting a tree is `EagleProposer.propose` unchanged: `Eagle3Proposer` gives it
the drafter and an output head backed by the drafter's `lm_head` and `d2t`. The chain mode
(`chain=True`) drafts one token per depth and, when sampling, hands the verifier the draft
distribution scattered into the target's vocabulary (zero outside the draft vocabulary), so
speculative sampling stays lossless with a reduced draft vocabulary. Trees are of deterministic
nodes (a one-hot q), lossless as EAGLE's are.

A drafter is read from a published folder by `specdec.proposers.formats.read_drafter`, into the
canonical names of the `speculators` package (`fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from specdec.core.cache import RowCache
from specdec.core.device import to_device
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.sampling import greedy_tokens, probabilities, sample
from specdec.proposers.base import Proposal
from specdec.proposers.eagle import EagleProposer

HEADS_HINT = ("an EAGLE-3 drafter's folder (config.json and model.safetensors: SafeAILab's EAGLE3-*, "
              "SpecForge's sglang-EAGLE3-*, a speculators *.eagle3 folder, NVIDIA ModelOpt's *-Eagle3) "
              "trained for this target")


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's taps for an N-layer target: [2, N//2, N-3] (`output_hidden_states` indices), made
    distinct and ascending and kept within [0, N] for the shallow targets of tests."""
    return sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)})


def _llama_config(config: dict) -> LlamaConfig:
    """The transformers config of the mid-layer's attention, MLP and rotary, from the canonical one."""
    heads = config["num_attention_heads"]
    llama = LlamaConfig(
        hidden_size=config["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0), max_position_embeddings=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"], attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)), num_hidden_layers=1)
    llama._attn_implementation = "sdpa"
    return llama


class Eagle3Layer(torch.nn.Module):
    """The mid-layer: attention over cat([input_layernorm(emb), hidden_norm(h)]) (q/k/v read 2H), the
    residual h (its normed form with `norm_before_residual`), then post_attention_layernorm, the MLP
    and its residual."""

    def __init__(self, llama: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        h, eps = llama.hidden_size, llama.rms_norm_eps
        self.self_attn = LlamaAttention(llama, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, torch.nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.mlp = LlamaMLP(llama)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, cache: RowCache | None) -> torch.Tensor:
        """embeds, hidden: [B, T, H]; rotary: (cos, sin); mask: additive [B, 1, T, kv] -> [B, T, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        if mask is None and cache is None:  # a plain causal pass (tests, training)
            t = x.shape[1]
            mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)[None, None]
        attn, _ = self.self_attn(x, position_embeddings=rotary, attention_mask=mask, cache=cache)
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(torch.nn.Module):
    """EAGLE-3's drafter from the canonical config (`formats.py`'s keys); its parameters and buffers
    carry the canonical tensor names, so `load_state_dict` takes a reader's tensors as they are."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        h = config["hidden_size"]
        self.hidden_size = h
        self.target_hidden_size = config.get("target_hidden_size") or h
        self.vocab_size = config["vocab_size"]
        self.draft_vocab_size = config.get("draft_vocab_size") or self.vocab_size
        self.num_taps = len(config["layer_ids"]) if config.get("layer_ids") else 3
        self.norm_output = bool(config.get("norm_output", False))
        llama = _llama_config(config)
        width = self.num_taps * self.target_hidden_size
        if config.get("fc_norm"):
            self.fc_norm = torch.nn.ModuleList(LlamaRMSNorm(self.target_hidden_size, eps=llama.rms_norm_eps)
                                               for _ in range(self.num_taps))
        if config.get("norm_before_fc"):
            self.input_norm = LlamaRMSNorm(width, eps=llama.rms_norm_eps)
        self.fc = torch.nn.Linear(width, h, bias=False)
        self.layers = torch.nn.ModuleList([Eagle3Layer(llama, bool(config.get("norm_before_residual", False)))])
        self.norm = LlamaRMSNorm(h, eps=llama.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, self.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.cache_layers = 1

    @classmethod
    def from_files(cls, files: Any, target_model: torch.nn.Module) -> Eagle3Drafter:
        """The drafter of `files` (a `DrafterFiles`: `config`, `tensors`), checked against the target:
        its hidden size and vocabulary must be the target's, its draft vocabulary map must land
        within the target's vocabulary. `embed_tokens.weight` (when the file has one) is kept as
        `embed_tokens`; the proposer uses it in place of the target's embeddings."""
        kind = getattr(files, "kind", "eagle3")
        where = getattr(files, "path", "the drafter")
        if kind != "eagle3":
            raise InvalidInput(f"method.heads_path={where} holds a {kind} drafter, not an EAGLE-3 one; use "
                               f"{HEADS_HINT}, or method={kind} for this one")
        config = dict(files.config)
        text = target_model.config.get_text_config(decoder=True)
        target = {"target_hidden_size": text.hidden_size,
                  "vocab_size": target_model.get_output_embeddings().out_features}
        config.setdefault("target_hidden_size", text.hidden_size)
        config["target_hidden_size"] = config["target_hidden_size"] or text.hidden_size
        wrong = {k: (config.get(k), v) for k, v in target.items() if config.get(k) != v}
        if wrong:
            said = ", ".join(f"{k}={got} where the target has {want}" for k, (got, want) in wrong.items())
            raise InvalidInput(f"method.heads_path={where}: the EAGLE-3 drafter does not fit this target ({said}); "
                               f"use {HEADS_HINT}")
        if config["hidden_size"] != text.hidden_size and "embed_tokens.weight" not in files.tensors:
            raise InvalidInput(f"method.heads_path={where}: the drafter's hidden size {config['hidden_size']} is not "
                               f"the target's {text.hidden_size}, and it has no embeddings of its own to read the "
                               f"tokens with; use {HEADS_HINT}")
        layer_ids = config.get("layer_ids")
        n_layers = text.num_hidden_layers
        if layer_ids is not None and (min(layer_ids) < 0 or max(layer_ids) > n_layers):
            raise InvalidInput(f"method.heads_path={where}: the drafter reads the target's layers {layer_ids}, but "
                               f"the target has {n_layers} layers (taps 0..{n_layers}); use {HEADS_HINT}")
        drafter = cls(config)
        tensors = dict(files.tensors)
        fc = tensors.get("fc.weight")
        if fc is not None and fc.shape[1] != drafter.fc.in_features:
            raise InvalidInput(f"method.heads_path={where}: fc.weight reads {fc.shape[1]} features, but "
                               f"{drafter.num_taps} taps of the target's {text.hidden_size} make "
                               f"{drafter.fc.in_features}; use {HEADS_HINT}")
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        embed = tensors.pop("embed_tokens.weight", None)
        if d2t is not None:
            if d2t.shape != (drafter.draft_vocab_size,):
                raise InvalidInput(f"method.heads_path={where}: d2t has shape {tuple(d2t.shape)}, the draft "
                                   f"vocabulary {drafter.draft_vocab_size} tokens; use {HEADS_HINT}")
            ids = torch.arange(drafter.draft_vocab_size) + d2t.long()
            if int(ids.min()) < 0 or int(ids.max()) >= drafter.vocab_size:
                raise InvalidInput(f"method.heads_path={where}: d2t maps draft tokens to target ids in "
                                   f"[{int(ids.min())}, {int(ids.max())}], outside the target's {drafter.vocab_size}; "
                                   f"use {HEADS_HINT}")
            tensors["d2t"] = d2t.long()
        elif drafter.draft_vocab_size != drafter.vocab_size:
            raise InvalidInput(f"method.heads_path={where}: the draft vocabulary has {drafter.draft_vocab_size} tokens "
                               f"of the target's {drafter.vocab_size} but no d2t maps them; use {HEADS_HINT}")
        else:
            tensors["d2t"] = drafter.d2t
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise InvalidInput(f"method.heads_path={where}: the EAGLE-3 drafter's tensors do not match its config "
                               f"(missing {missing}, unexpected {unexpected}); use {HEADS_HINT}")
        if embed is not None:
            drafter.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        return drafter

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: RowCache | None = None) -> torch.Tensor:
        """embeds: [B, T, H] token embeddings; hidden: [B, T, n*Ht] the target's taps, or [B, T, H]
        the drafter's own previous output (`fc` applies only when the width is not H); positions:
        [B, T]; mask: additive [B, 1, T, kv] or None (causal) -> the hidden state to feed back and
        read logits from [B, T, H]: pre-norm, or normed with `norm_output` (EAGLE-3.1)."""
        dtype = self.fc.weight.dtype
        hidden, embeds = hidden.to(dtype), embeds.to(dtype)
        if hidden.shape[-1] != self.hidden_size:
            if hasattr(self, "fc_norm"):
                hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, hidden.chunk(self.num_taps, -1))], -1)
            elif hasattr(self, "input_norm"):
                hidden = self.input_norm(hidden)
            hidden = self.fc(hidden)
        out = self.layers[0](embeds, hidden, self.rotary(hidden, positions), mask, cache)
        return self.norm(out) if self.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] (forward's output) -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the target's token ids (i + d2t[i])."""
        return draft_ids + self.d2t[draft_ids]


class _DraftHead:
    """The output head `EagleProposer.propose` reads (`logits`, `token_ids`, `weight`), backed by the
    drafter's own head and vocabulary map."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.weight = drafter.lm_head.weight
        self.vocab_ids = None if drafter.draft_vocab_size == drafter.vocab_size and not bool(drafter.d2t.any()) \
            else drafter.target_ids(torch.arange(drafter.draft_vocab_size, device=drafter.d2t.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(hidden)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.drafter.target_ids(index)


def read_files(heads_path: Any):
    """`heads_path` read (`formats.read_drafter`), or files already read (an object with `config` and
    `tensors`, as tests build them); a clear refusal when it is not set."""
    if heads_path is None or heads_path == "" or str(heads_path) == "embedded":
        raise MissingInput(f"method=eagle3 needs a drafter: set method.heads_path=<folder>, {HEADS_HINT} "
                           "(no EAGLE-3 drafter ships for the embedded target)")
    if hasattr(heads_path, "config") and hasattr(heads_path, "tensors"):
        return heads_path
    from specdec.proposers.formats import read_drafter

    return read_drafter(Path(str(heads_path)).expanduser())


class Eagle3Proposer(EagleProposer):
    """Drafts with an EAGLE-3 drafter read from `heads_path`: a dynamic tree of `budget` nodes as EAGLE-2
    does, or with `chain`, k tokens one per depth (`method.tree` is a static tree's rank paths, so the
    switch has another name).

    topk: children proposed per expanded node; width: nodes expanded per level; depth: the deepest
    level (the schedule's k caps it per step). layer_ids: the target's taps (default: the file's,
    else [2, N//2, N-3]).
    """

    name = "eagle3"
    drafts_trees = True  # without `chain` its proposals are TreeProposals (config checks the verifier)

    def __init__(self, engine: Engine, heads_path: str, budget: int = 12, topk: int = 4, width: int = 4,
                 depth: int = 5, layer_ids: list[int] | None = None, chain: bool = False):
        if not (budget >= 1 and topk >= 1 and width >= 1 and depth >= 1):
            raise ValueError(f"method.proposer: budget, topk, width and depth must be >= 1, got "
                             f"{budget}, {topk}, {width}, {depth}")
        self.engine, target = engine, engine.target
        target.hidden_source()  # a target without usable hidden states is refused before the file is read
        files = read_files(heads_path)
        n_layers = target.num_layers
        layer_ids = list(layer_ids) if layer_ids is not None else files.config.get("layer_ids") or default_layer_ids(n_layers)
        config = {**files.config, "layer_ids": layer_ids}
        self.drafter = Eagle3Drafter.from_files(SimpleNamespace(config=config, tensors=files.tensors,
                                                                kind=getattr(files, "kind", "eagle3"),
                                                                path=getattr(files, "path", heads_path)), target.model)
        self.drafter.to(engine.device, engine.dtype).eval()
        self.head = _DraftHead(self.drafter)
        vocab = self.drafter.draft_vocab_size
        if topk > vocab:
            raise InvalidInput(f"method.proposer.topk={topk}: the drafter proposes from {vocab} tokens; use a topk "
                               f"of at most {vocab}")
        own = getattr(self.drafter, "embed_tokens", None)
        self.embed = own if own is not None else target.model.get_input_embeddings()
        self.budget, self.topk, self.width, self.depth = budget, topk, width, depth
        self.chain = chain
        self.drafts_trees = not chain  # the instance's answer (the hybrid asks it); the class's is the config's
        self.num_nodes = 0 if chain else budget  # nodes a step scores; 0: a chain, verified as one
        self.layer_ids = self.taps = layer_ids
        self.target = target
        self.cache: RowCache | None = None
        target.keep_hidden_states(layer_ids)
        self.compiled = engine.compiled("eagle3 drafter", self.drafter, "module")

    @staticmethod
    def heads_info(heads_path: Any) -> tuple[int, bool]:
        """(tokens the drafter proposes from, whether that is a reduced vocabulary) of the drafter at
        `heads_path`, for the config's checks before any model loads; refuses what `read_files` does."""
        config = read_files(heads_path).config
        vocab = config.get("draft_vocab_size") or config["vocab_size"]
        return vocab, vocab != config["vocab_size"]

    def reset(self, state) -> None:
        room = self.depth + 1 if self.chain else self.depth * self.width + 1
        self.cache = RowCache(self.drafter.cache_layers, state.batch_size, state.max_len + room, state.tokens.device)

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        if not self.chain or k == 0:
            return super().propose(state, k)
        return self._chain(state, min(k, self.depth))

    def _chain(self, state, k: int) -> Proposal:
        """k tokens, one per depth: the catch-up as the tree's, then each draft fed with the feature
        the drafter predicted before it. Sampling: q over the draft vocabulary, scattered into the
        target's `[B, k, V]` (zero elsewhere)."""
        b, device = state.batch_size, state.tokens.device
        rows = torch.arange(b, device=device)
        seen, upto = list(self.cache.lengths), self.target.lengths
        counts = [u - s for u, s in zip(upto, seen)]
        pos = to_device(seen, device)[:, None] + torch.arange(max(counts), device=device)
        pos = torch.minimum(pos, to_device(upto, device)[:, None] - 1)
        out = self._feed(state.tokens[rows[:, None], pos + 1], self.target.hidden_at(self.taps, rows[:, None], pos), pos, counts)
        feature = out[rows, to_device(counts, device) - 1][:, None]  # [B, 1, H]
        base = to_device(upto, device)
        tokens, probs = [], []
        for i in range(k):
            logits = self.drafter.logits(feature[:, 0]).float()  # [B, Vd]
            if state.sampling.greedy:
                index = greedy_tokens(logits)
            else:
                q = probabilities(logits, state.sampling)
                index = sample(q, state.generator)
                full = q.new_zeros(b, self.target.vocab_size)
                probs.append(full.index_copy_(1, self.drafter.target_ids(torch.arange(q.shape[1], device=device)), q))
            token = self.drafter.target_ids(index)
            tokens.append(token)
            if i < k - 1:
                feature = self._feed(token[:, None], feature, (base + i)[:, None], [1] * b)
        self.cache.rollback(upto)  # the drafted tokens were scratch
        return Proposal(torch.stack(tokens, 1), [k] * b, torch.stack(probs, 1) if probs else None)
